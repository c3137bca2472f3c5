// Logit capping and ALiBi in scaled dot-product attention
// (AttentionOptions::softcap, alibi_slopes; docs/semantics.md, "Softcap and
// ALiBi"): the fused kernels and the reference against a float64 plain loop
// of the formula (forward and gradients, through the tanh), then the fused
// kernels against the float64 reference on random cases combining them with
// lengths, causal, masks, windows, a bias, dropout, weights and grouped
// heads; finite differences of the reference's gradient; the same bits for
// any thread count; bf16; every error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "attention_testing.h"
#include "qkv/qkv.h"
#include "test_util.h"
#include "tolerances.h"

namespace qkv::test {
namespace {

// What the plain loop below takes beyond q, k, v: per-batch lengths (empty:
// none), causal, the window, a key mask (B, Nk) (empty: none), softcap and
// the slopes per (b, h) (empty: no ALiBi).
struct Formula {
  std::vector<int64_t> lens;
  Causal causal = Causal::kNone;
  int64_t window_left = -1, window_right = -1;
  std::vector<uint8_t> key_mask;
  double softcap = 0.0;
  std::vector<double> slopes;  // (B, H) row-major
};

struct LoopResult {
  std::vector<double> out, lse, dq, dk, dv;
};

// The definition, one query row at a time in double: x = scale q.k, s =
// softcap tanh(x / softcap) (or x) - slope |i + Nk - Nq - j| over the keys
// the lengths, causal, window and key mask leave; P = softmax(s), O = P V.
// Gradients: dP = dO Vᵀ, dS = P (dP - sum_j P dP), dX = dS (1 - tanh²),
// dQ = scale dX K, dK = scale dXᵀ Q, dV = Pᵀ dO (key heads summed over
// their query heads).
template <class T>
LoopResult loop_formula(const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v, double scale,
                        const Formula& f, const Tensor<T>& d_out) {
  const int64_t batch = q.size(0), heads = q.size(1), kv_heads = k.size(1);
  const int64_t nq = q.size(2), nk = k.size(2), d = q.size(3), dv = v.size(3);
  const int64_t group = heads / kv_heads;
  LoopResult r;
  r.out.assign(batch * heads * nq * dv, 0.0);
  r.lse.assign(batch * heads * nq, -std::numeric_limits<double>::infinity());
  r.dq.assign(batch * heads * nq * d, 0.0);
  r.dk.assign(batch * kv_heads * nk * d, 0.0);
  r.dv.assign(batch * kv_heads * nk * dv, 0.0);
  std::vector<double> s(nk), p(nk), cap_grad(nk), dp(nk);
  std::vector<bool> seen(nk);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t hk = h / group;
      const double slope = f.slopes.empty() ? 0.0 : f.slopes[b * heads + h];
      for (int64_t i = 0; i < nq; ++i) {
        int64_t len = f.lens.empty() ? nk : f.lens[b];
        if (f.causal == Causal::kTopLeft) len = std::min(len, std::clamp<int64_t>(i + 1, 0, nk));
        if (f.causal == Causal::kBottomRight) {
          len = std::min(len, std::clamp<int64_t>(i + 1 + nk - nq, 0, nk));
        }
        double max = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < nk; ++j) {
          const int64_t diagonal = i + nk - nq;
          seen[j] = j < len && (f.window_left < 0 || j >= diagonal - f.window_left) &&
                    (f.window_right < 0 || j <= diagonal + f.window_right) &&
                    (f.key_mask.empty() || f.key_mask[b * nk + j] != 0);
          double x = 0;
          for (int64_t c = 0; c < d; ++c) x += double(q(b, h, i, c)) * double(k(b, hk, j, c));
          x *= scale;
          cap_grad[j] = 1.0;
          if (f.softcap > 0) {
            const double t = std::tanh(x / f.softcap);
            x = f.softcap * t;
            cap_grad[j] = 1 - t * t;
          }
          s[j] = x - slope * std::abs(double(i + nk - nq - j));
          if (seen[j]) max = std::max(max, s[j]);
        }
        if (max == -std::numeric_limits<double>::infinity()) continue;  // no key: zeros
        double sum = 0;
        for (int64_t j = 0; j < nk; ++j) sum += p[j] = seen[j] ? std::exp(s[j] - max) : 0.0;
        const int64_t row = (b * heads + h) * nq + i;
        r.lse[row] = max + std::log(sum);
        double delta = 0;
        for (int64_t j = 0; j < nk; ++j) {
          p[j] /= sum;
          dp[j] = 0;
          for (int64_t c = 0; c < dv; ++c) {
            r.out[row * dv + c] += p[j] * double(v(b, hk, j, c));
            dp[j] += double(d_out(b, h, i, c)) * double(v(b, hk, j, c));
          }
          delta += p[j] * dp[j];
        }
        for (int64_t j = 0; j < nk; ++j) {
          if (!seen[j]) continue;
          const double dx = p[j] * (dp[j] - delta) * cap_grad[j] * scale;
          const int64_t key = (b * kv_heads + hk) * nk + j;
          for (int64_t c = 0; c < d; ++c) {
            r.dq[row * d + c] += dx * double(k(b, hk, j, c));
            r.dk[key * d + c] += dx * double(q(b, h, i, c));
          }
          for (int64_t c = 0; c < dv; ++c) r.dv[key * dv + c] += p[j] * double(d_out(b, h, i, c));
        }
      }
    }
  return r;
}

template <class T>
double worst(const Tensor<T>& got, const std::vector<double>& want) {
  double w = 0;
  for (int64_t e = 0; e < got.numel(); ++e) {
    if (std::isinf(want[e]) && double(got.data()[e]) == want[e]) continue;
    w = std::max(w, std::abs(double(got.data()[e]) - want[e]));
  }
  return w;
}

template <class T>
bool close_to(const Tensor<T>& got, const std::vector<double>& want, Tol tol, const char* name) {
  return expect_close(got, Tensor<double>(got.shape(), want), tol, name);
}

// How far float scores reach: the cap (or scale D, inputs in [-1, 1]) plus
// ALiBi's max slope (Nq + Nk).
double score_reach(double softcap, double scale, int64_t d, double max_slope, int64_t nq,
                   int64_t nk) {
  return (softcap > 0 ? softcap : scale * static_cast<double>(d)) +
         max_slope * static_cast<double>(nq + nk);
}

// float tolerances for scores of that reach: a score carries a rounding of
// eps |score|, and ALiBi's reach hundreds (slopes up to 1, scores near -340:
// weights 1.3e-5 off, relative; outputs 1.4e-5 and lse 2.7e-6 off,
// absolute; gradients 7e-5), past the base tolerances, made for scores of a
// few units. So they grow by 4 eps that reach (weights relative; output and
// lse absolute) and 16 eps (gradients, absolute).
struct ReachTols {
  Tol output, lse, weights, grads;
  explicit ReachTols(double reach)
      : output{.atol = kSdpa.atol + 0x1p-22 * reach, .rtol = kSdpa.rtol},
        lse{.atol = kSdpaLse.atol + 0x1p-22 * reach, .rtol = kSdpaLse.rtol},
        weights{.atol = kSoftmax.atol, .rtol = kSoftmax.rtol + 0x1p-22 * reach},
        grads{.atol = kSdpaBackward.atol + 0x1p-20 * reach, .rtol = kSdpaBackward.rtol} {}
};

struct LoopCase {
  int64_t batch, heads, kv_heads, nq, nk, d, dv;
  double scale;  // large scales make the cap bite: |x| up to ~scale * D / 3
  Formula f;
  bool per_batch_slopes;
};

template <class T>
class SoftcapAlibi : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(SoftcapAlibi, Types, TypeNames);

TYPED_TEST(SoftcapAlibi, FastAndReferenceMatchThePlainLoop) {
  using T = TypeParam;
  constexpr bool kFloat = std::is_same_v<T, float>;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  // Softcap alone (scores up to ~10x the cap), ALiBi alone per head and per
  // batch element, both with grouped heads and lengths, with causal (both
  // alignments), a window and a key mask; several query and key blocks
  // (256) and the few-query row products.
  std::vector<LoopCase> cases = {
      {2, 2, 2, 300, 600, 32, 16, 2.0, {{}, Causal::kNone, -1, -1, {}, 5.0, {}}, false},
      {2, 4, 2, 70, 530, 16, 8, 0.25, {{}, Causal::kNone, -1, -1, {}, 0.0, {1}}, false},
      {2, 4, 1, 260, 260, 8, 8, 0.5, {{}, Causal::kBottomRight, -1, -1, {}, 0.0, {1}}, true},
      {2, 4, 2, 300, 520, 16, 16, 1.0, {{}, Causal::kTopLeft, -1, -1, {}, 3.0, {1}}, false},
      {1, 6, 2, 3, 900, 64, 32, 0.5, {{}, Causal::kNone, 200, 10, {1}, 30.0, {1}}, true},
      {2, 2, 1, 40, 700, 16, 4, 1.0, {{1}, Causal::kBottomRight, 100, 0, {}, 1.0, {1}}, true},
  };
  // Under the sanitizers a sample: softcap alone, ALiBi with causal and
  // grouped heads, and everything at once (the six took 33 s there in CI
  // run 46, over the best target and scalar); Release runs them all.
  if (kSanitized) cases = {cases[0], cases[2], cases[5]};
  int checked = 0;
  double worst_out = 0, worst_grad = 0;
  for (LoopCase& c : cases) {
    SCOPED_TRACE("case " + std::to_string(checked++));
    Formula& f = c.f;
    if (!f.lens.empty()) {
      f.lens.clear();
      for (int64_t b = 0; b < c.batch; ++b) f.lens.push_back(rng.uniform_int(0, c.nk));
    }
    if (!f.key_mask.empty()) {
      f.key_mask.assign(c.batch * c.nk, 0);
      for (uint8_t& m : f.key_mask) m = rng.bernoulli(0.7);
    }
    // Slopes as ALiBi's geometric 2^(-8 h / H), or random per batch element.
    std::vector<double> slopes;
    if (!f.slopes.empty()) {
      f.slopes.clear();
      for (int64_t b = 0; b < c.batch; ++b)
        for (int64_t h = 0; h < c.heads; ++h) {
          f.slopes.push_back(c.per_batch_slopes ? rng.uniform(0.0, 1.0)
                                                : std::pow(2.0, -8.0 * (h + 1) / c.heads));
        }
      slopes.assign(f.slopes.begin(),
                    f.slopes.begin() + (c.per_batch_slopes ? c.batch : 1) * c.heads);
    }
    const Tensor<T> q = random_tensor<T>(rng, {c.batch, c.heads, c.nq, c.d});
    const Tensor<T> k = random_tensor<T>(rng, {c.batch, c.kv_heads, c.nk, c.d});
    const Tensor<T> v = random_tensor<T>(rng, {c.batch, c.kv_heads, c.nk, c.dv});
    const Tensor<T> d_out = random_tensor<T>(rng, {c.batch, c.heads, c.nq, c.dv});
    Tensor<int64_t> lens;
    Tensor<uint8_t> key_mask;
    AttentionOptions o;
    o.scale = c.scale;
    o.causal = f.causal;
    o.window_left = f.window_left;
    o.window_right = f.window_right;
    o.softcap = f.softcap;
    o.return_lse = true;
    if (!f.key_mask.empty()) {
      key_mask = Tensor<uint8_t>(Shape{c.batch, c.nk}, f.key_mask);
      o.key_mask = key_mask.view();
    }
    const Tensor<double> slope_tensor = slopes.empty() ? Tensor<double>()
                                        : c.per_batch_slopes
                                            ? Tensor<double>(Shape{c.batch, c.heads}, slopes)
                                            : Tensor<double>(Shape{c.heads}, slopes);
    if (!slopes.empty()) o.alibi_slopes = slope_tensor.view();
    ValidLens valid;
    if (!f.lens.empty()) {
      lens = Tensor<int64_t>(Shape{c.batch}, f.lens);
      valid = ValidLens(lens);
    }
    const LoopResult want = loop_formula(q, k, v, c.scale, f, d_out);
    double max_slope = 0;
    for (const double s : f.slopes) max_slope = std::max(max_slope, s);
    const ReachTols tols(score_reach(f.softcap, c.scale, c.d, max_slope, c.nq, c.nk));
    for (const bool fast : {true, false}) {
      SCOPED_TRACE(fast ? "fast" : "reference");
      const AttentionResult<T> r = fast ? scaled_dot_product_attention(q, k, v, valid, o)
                                        : ref::scaled_dot_product_attention(q, k, v, valid, o);
      ASSERT_TRUE(close_to(r.output, want.out, kFloat ? tols.output : kSdpaDouble, "output"));
      ASSERT_TRUE(close_to(r.lse, want.lse, kFloat ? tols.lse : kSdpaLseDouble, "lse"));
      const DotProductGrads<T> g =
          fast ? scaled_dot_product_attention_backward(q, k, v, valid, o, {r.output, r.lse}, d_out)
               : ref::scaled_dot_product_attention_backward(q, k, v, valid, o, {r.output, r.lse},
                                                            d_out);
      const Tol back = kFloat ? tols.grads : kSdpaBackwardDouble;
      ASSERT_TRUE(close_to(g.d_queries, want.dq, back, "d_queries"));
      ASSERT_TRUE(close_to(g.d_keys, want.dk, back, "d_keys"));
      ASSERT_TRUE(close_to(g.d_values, want.dv, back, "d_values"));
      if (fast) {
        worst_out = std::max({worst_out, worst(r.output, want.out), worst(r.lse, want.lse)});
        worst_grad = std::max({worst_grad, worst(g.d_queries, want.dq), worst(g.d_keys, want.dk),
                               worst(g.d_values, want.dv)});
      }
    }
  }
  // The figures docs/semantics.md quotes (printed, not asserted beyond the tolerances).
  std::printf(
      "softcap/ALiBi, %s: worst |fast - float64 loop|: output and lse %.3g, gradients %.3g\n",
      kFloat ? "float32" : "float64", worst_out, worst_grad);
}

// Random problems: softcap and ALiBi with everything else the kernels
// combine them with, the fused kernels against the float64 reference.
TYPED_TEST(SoftcapAlibi, MatchTheReferenceWithMasksBiasDropoutAndHeads) {
  using T = TypeParam;
  constexpr bool kFloat = std::is_same_v<T, float>;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  static const int64_t kGroups[][2] = {{1, 1}, {4, 4}, {4, 2}, {6, 1}};
  static const int64_t kDims[] = {1, 8, 16, 64};
  const int cases = kSanitized ? 4 : 24;
  for (int n = 0; n < cases; ++n) {
    const auto& g = kGroups[rng.uniform_int(0, 3)];
    const int64_t batch = rng.uniform_int(1, 2), heads = g[0], kv_heads = g[1];
    const int64_t nq = rng.bernoulli(0.25) ? rng.uniform_int(1, 3) : rng.uniform_int(1, 520);
    const int64_t nk = rng.uniform_int(1, 700);
    const int64_t d = kDims[rng.uniform_int(0, 3)], dv = kDims[rng.uniform_int(0, 3)];
    AttentionOptions o;
    o.softcap = rng.bernoulli(0.7) ? rng.uniform(0.5, 20.0) : 0.0;
    o.scale = rng.uniform(0.1, 3.0);
    const int slope_form = rng.uniform_int(0, 2);  // none, (H), (B, H)
    Tensor<double> slopes;
    if (slope_form > 0) {
      slopes = random_tensor<double>(rng, slope_form == 1 ? Shape{heads} : Shape{batch, heads}, 0.0,
                                     1.0);
      o.alibi_slopes = slopes.view();
    }
    Tensor<uint8_t> key_mask;
    if (rng.bernoulli(0.3)) {
      key_mask = Tensor<uint8_t>(Shape{batch, nk});
      for (uint8_t& m : key_mask.values()) m = rng.bernoulli(0.7);
      o.key_mask = key_mask.view();
    }
    if (rng.bernoulli(0.3)) {
      o.window_left = rng.uniform_int(-1, 300);
      o.window_right = rng.uniform_int(-1, 40);
    }
    Tensor<T> bias;
    if (rng.bernoulli(0.3)) {
      bias = random_tensor<T>(rng, {nq, nk}, -2.0, 2.0);
      o.bias = ConstView<T>(bias.view());
      o.want_bias_grad = true;
    }
    o.causal = static_cast<Causal>(rng.uniform_int(0, 2));
    o.dropout_p = rng.bernoulli(0.25) ? 0.2 : 0.0;
    o.training = o.dropout_p > 0;
    o.seed = rng.next();
    o.return_weights = rng.bernoulli(0.3);
    o.return_lse = true;
    const OwnedLens lens = make_lens(rng, static_cast<LensForm>(rng.uniform_int(0, 2)),
                                     rng.bernoulli(0.5), batch, nq, nk, 0.1);
    SCOPED_TRACE(
        "B=" + std::to_string(batch) + " H=" + std::to_string(heads) +
        " Hkv=" + std::to_string(kv_heads) + " Nq=" + std::to_string(nq) +
        " Nk=" + std::to_string(nk) + " D=" + std::to_string(d) + " Dv=" + std::to_string(dv) +
        " softcap=" + std::to_string(o.softcap) + " slopes=" + std::to_string(slope_form) +
        " window=(" + std::to_string(o.window_left) + ", " + std::to_string(o.window_right) +
        ") causal=" + std::to_string(static_cast<int>(o.causal)) +
        " dropout=" + std::to_string(o.dropout_p) + " bias=" + std::to_string(bias.numel() > 0));
    const Tensor<T> q = random_tensor<T>(rng, {batch, heads, nq, d});
    const Tensor<T> k = random_tensor<T>(rng, {batch, kv_heads, nk, d});
    const Tensor<T> v = random_tensor<T>(rng, {batch, kv_heads, nk, dv});
    const Tensor<T> d_out = random_tensor<T>(rng, {batch, heads, nq, dv});
    double max_slope = 0;
    for (const double s : slopes.values()) max_slope = std::max(max_slope, s);
    const double reach = score_reach(o.softcap, *o.scale, d, max_slope, nq, nk) + 2.0;  // + bias
    const ReachTols tols(reach);
    SCOPED_TRACE("score reach " + std::to_string(reach));
    const AttentionResult<T> got = scaled_dot_product_attention(q, k, v, lens.get(), o);
    const AttentionResult<T> ref = ref::scaled_dot_product_attention(q, k, v, lens.get(), o);
    ASSERT_TRUE(expect_close(got.output, ref.output, kFloat ? tols.output : kSdpaDouble, "output"));
    ASSERT_TRUE(expect_close(got.lse, ref.lse, kFloat ? tols.lse : kSdpaLseDouble, "lse"));
    if (o.return_weights) {
      ASSERT_TRUE(expect_close(got.weights, ref.weights, kFloat ? tols.weights : kSoftmaxDouble,
                               "weights"));
    }
    const DotProductGrads<T> gf =
        scaled_dot_product_attention_backward(q, k, v, lens.get(), o, {got.output, got.lse}, d_out);
    const DotProductGrads<T> gr = ref::scaled_dot_product_attention_backward(
        q, k, v, lens.get(), o, {ref.output, ref.lse}, d_out);
    const Tol back = kFloat ? tols.grads : kSdpaBackwardDouble;
    ASSERT_TRUE(expect_close(gf.d_queries, gr.d_queries, back, "d_queries"));
    ASSERT_TRUE(expect_close(gf.d_keys, gr.d_keys, back, "d_keys"));
    ASSERT_TRUE(expect_close(gf.d_values, gr.d_values, back, "d_values"));
    if (o.want_bias_grad) ASSERT_TRUE(expect_close(gf.d_bias, gr.d_bias, back, "d_bias"));
  }
}

// The gradients through the cap against central differences of
// sum(output * d_out) in float64, fast and reference alike.
TEST(SoftcapAlibiGradient, MatchesFiniteDifferences) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t batch = 2, heads = 2, nq = 5, nk = 7, d = 4;
  Tensor<double> q = random_tensor<double>(rng, {batch, heads, nq, d}, -2.0, 2.0);
  Tensor<double> k = random_tensor<double>(rng, {batch, 1, nk, d}, -2.0, 2.0);
  const Tensor<double> v = random_tensor<double>(rng, {batch, 1, nk, d});
  const Tensor<double> d_out = random_tensor<double>(rng, {batch, heads, nq, d});
  const Tensor<double> slopes(Shape{heads}, std::vector<double>{0.5, 0.25});
  AttentionOptions o;
  o.softcap = 1.5;  // scores up to ~4: the tanh well into its bend
  o.alibi_slopes = slopes.view();
  o.causal = Causal::kBottomRight;
  o.return_lse = true;
  const auto loss = [&] { return sdpa_dot_loss(q, k, v, o, d_out); };
  const AttentionResult<double> fwd = scaled_dot_product_attention(q, k, v, {}, o);
  for (const bool fast : {true, false}) {
    SCOPED_TRACE(fast ? "fast" : "reference");
    const DotProductGrads<double> g =
        fast ? scaled_dot_product_attention_backward(q, k, v, {}, o, {fwd.output, fwd.lse}, d_out)
             : ref::scaled_dot_product_attention_backward(q, k, v, {}, o, {fwd.output, fwd.lse},
                                                          d_out);
    for (auto [x, grad, name] :
         {std::tuple{&q, &g.d_queries, "d_queries"}, std::tuple{&k, &g.d_keys, "d_keys"}}) {
      for (int64_t e = 0; e < x->numel(); ++e) {
        const double saved = x->data()[e], h = 1e-6;
        x->data()[e] = saved + h;
        const double up = loss();
        x->data()[e] = saved - h;
        const double down = loss();
        x->data()[e] = saved;
        EXPECT_NEAR(grad->data()[e], (up - down) / (2 * h), 1e-8) << name << " element " << e;
      }
    }
  }
}

// The cap bounds every score: with softcap c, lse <= log(Nk) + c however
// large q.k is, and huge scores that would all tie at the cap give uniform
// weights.
TEST(Softcap, BoundsTheScores) {
  const Tensor<float> q(Shape{1, 1, 2, 4}, std::vector<float>{1e4f, 1e4f, 1e4f, 1e4f,  //
                                                              -1e4f, 0, 0, 0});
  Tensor<float> k(Shape{1, 1, 3, 4}, 1.0f);
  k(0, 0, 1, 0) = 2.0f;
  const Tensor<float> v(Shape{1, 1, 3, 1}, std::vector<float>{0, 3, 6});
  AttentionOptions o;
  o.softcap = 2.0;
  o.return_lse = true;
  o.return_weights = true;
  const AttentionResult<float> r = scaled_dot_product_attention(q, k, v, {}, o);
  // Row 0: every score tanh(>= 2e4) = 1, capped to 2: uniform, lse 2 + log 3.
  EXPECT_NEAR(r.output(0, 0, 0, 0), 3.0f, 1e-5f);
  EXPECT_NEAR(r.lse(0, 0, 0), 2.0f + std::log(3.0f), 1e-5f);
  // Row 1: every score below -5000, capped to -2: uniform too.
  EXPECT_NEAR(r.weights(0, 0, 1, 0), 1.0f / 3, 1e-6f);
}

TYPED_TEST(SoftcapAlibi, SameBitsForAnyThreadCount) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tensor<T> q = random_tensor<T>(rng, {2, 4, 300, 32});
  const Tensor<T> k = random_tensor<T>(rng, {2, 2, 700, 32});
  const Tensor<T> v = random_tensor<T>(rng, {2, 2, 700, 32});
  const Tensor<T> d_out = random_tensor<T>(rng, {2, 4, 300, 32});
  const Tensor<double> slopes = random_tensor<double>(rng, {2, 4}, 0.0, 1.0);
  AttentionOptions o;
  o.softcap = 3.0;
  o.alibi_slopes = slopes.view();
  o.window_left = 200;
  o.dropout_p = 0.3;
  o.training = true;
  o.seed = rng.next();
  expect_sdpa_same_bits_for_thread_counts(q, k, v, {}, o, d_out);
}

// bf16 inputs against the float reference on the widened inputs (the bound
// of docs/semantics.md: 2^-8 max|v| plus float rounding), forward and
// backward (the backward's P and dS rounded to bf16 for their products).
TEST(SoftcapAlibiBf16, MatchTheFloatReferenceOnWidenedInputs) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (const int64_t nq : {1, 300}) {
    SCOPED_TRACE("Nq=" + std::to_string(nq));
    const Shape qs{2, 4, nq, 64}, ks{2, 2, 600, 64};
    Tensor<bfloat16> qb(qs), kb(ks), vb(ks);
    Tensor<float> qw(qs), kw(ks), vw(ks);
    for (auto [b, w] : {std::pair{&qb, &qw}, {&kb, &kw}, {&vb, &vw}}) {
      for (int64_t e = 0; e < b->numel(); ++e) {
        b->data()[e] = bfloat16(static_cast<float>(rng.uniform(-1.0, 1.0)));
        w->data()[e] = static_cast<float>(b->data()[e]);
      }
    }
    const Tensor<double> slopes = random_tensor<double>(rng, {4}, 0.0, 0.5);
    AttentionOptions o;
    o.softcap = 1.0;
    o.scale = 1.0;
    o.alibi_slopes = slopes.view();
    o.causal = Causal::kBottomRight;
    o.return_lse = true;
    const AttentionResult<float> got = scaled_dot_product_attention(qb, kb, vb, {}, o);
    const AttentionResult<float> ref = ref::scaled_dot_product_attention(qw, kw, vw, {}, o);
    expect_close(got.output, ref.output, Tol{.atol = 0x1p-8 + 1e-5, .rtol = 0}, "output");
    expect_close(got.lse, ref.lse, ReachTols(score_reach(1.0, 1.0, 64, 0.5, nq, 600)).lse, "lse");
    const Tensor<float> d_out = random_tensor<float>(rng, {2, 4, nq, 64});
    const DotProductGrads<float> g =
        scaled_dot_product_attention_backward(qb, kb, vb, {}, o, {got.output, got.lse}, d_out);
    const DotProductGrads<float> r =
        ref::scaled_dot_product_attention_backward(qw, kw, vw, {}, o, {ref.output, ref.lse}, d_out);
    // P and dS in bf16 (8 bits): 2^-7 of the gradients' scale, ~1 here.
    const Tol back{.atol = 0x1p-6, .rtol = 0x1p-6};
    expect_close(g.d_queries, r.d_queries, back, "d_queries");
    expect_close(g.d_keys, r.d_keys, back, "d_keys");
    expect_close(g.d_values, r.d_values, back, "d_values");
  }
}

TEST(SoftcapAlibiErrors, NameTheArgumentAndValue) {
  const Tensor<float> q(Shape{2, 4, 5, 8}), k(Shape{2, 2, 7, 8}), v(Shape{2, 2, 7, 3});
  AttentionOptions o;
  for (const double bad :
       {-1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    o.softcap = bad;
    expect_error(
        [&] { scaled_dot_product_attention(q, k, v, {}, o); },
        {"scaled_dot_product_attention", "options.softcap =", "expected a finite number >= 0"});
  }
  o = AttentionOptions{};
  const Tensor<double> three(Shape{3}), wrong_batch(Shape{3, 4}), good(Shape{2, 4});
  o.alibi_slopes = three.view();
  expect_error([&] { scaled_dot_product_attention(q, k, v, {}, o); },
               {"options.alibi_slopes has shape [3]; expected [4] (one slope per head) or [2, 4]"});
  const double scalar = 0.5;
  o.alibi_slopes = ConstView<double>(&scalar, Shape{}, Shape{});
  expect_error([&] { scaled_dot_product_attention(q, k, v, {}, o); },
               {"options.alibi_slopes has shape []; expected [4]"});
  o.alibi_slopes = wrong_batch.view();
  expect_error([&] { scaled_dot_product_attention(q, k, v, {}, o); },
               {"options.alibi_slopes has shape [3, 4]"});
  Tensor<double> nan_slope(Shape{2, 4}, 0.5);
  nan_slope(1, 2) = std::numeric_limits<double>::quiet_NaN();
  o.alibi_slopes = nan_slope.view();
  expect_error([&] { scaled_dot_product_attention(q, k, v, {}, o); },
               {"options.alibi_slopes[1, 2] = nan is not finite"});
  Tensor<double> inf_slope(Shape{4}, 0.5);
  inf_slope(3) = -std::numeric_limits<double>::infinity();
  o.alibi_slopes = inf_slope.view();
  expect_error([&] { scaled_dot_product_attention(q, k, v, {}, o); },
               {"options.alibi_slopes[3] = -inf is not finite"});
  // The backward checks the same.
  const Tensor<float> out(Shape{2, 4, 5, 3}), lse(Shape{2, 4, 5});
  o.alibi_slopes = three.view();
  expect_error(
      [&] {
        scaled_dot_product_attention_backward(q, k, v, {}, o, {out, lse}, out);
      },
      {"scaled_dot_product_attention_backward", "options.alibi_slopes"});
  o = AttentionOptions{};
  o.softcap = -2;
  expect_error(
      [&] {
        scaled_dot_product_attention_backward(q, k, v, {}, o, {out, lse}, out);
      },
      {"scaled_dot_product_attention_backward", "options.softcap"});
  // 3-D inputs have one head.
  const Tensor<float> q3(Shape{2, 5, 8}), k3(Shape{2, 7, 8}), v3(Shape{2, 7, 3});
  o = AttentionOptions{};
  o.alibi_slopes = good.view();
  expect_error([&] { scaled_dot_product_attention(q3, k3, v3, {}, o); },
               {"options.alibi_slopes has shape [2, 4]; expected [1]"});
  // The other scoring functions take neither.
  const Tensor<float> w_q(Shape{4, 8}), w_k(Shape{4, 8}), w_v(Shape{4});
  const Tensor<double> one(Shape{1}, 0.5);
  o = AttentionOptions{};
  o.softcap = 5;
  expect_error(
      [&] {
        additive_attention(q3, k3, v3, {w_q, w_k, w_v}, {}, o);
      },
      {"additive_attention", "softcap and alibi_slopes are for scaled dot-product"});
  o = AttentionOptions{};
  o.alibi_slopes = one.view();
  expect_error([&] { distance_attention(q3, k3, v3, {}, o); },
               {"distance_attention", "are for scaled dot-product attention"});
}

}  // namespace
}  // namespace qkv::test
