// The fused SDPA backward's precision (issue 33, items 1 and 2): where every
// query sees one key (Nk = 1, a window (0, 0), a length of 1) its weight is
// exactly 1, so float32's dq and dk are exactly 0 and dv is dO (float64: to a
// few roundings, its score tiles being the BLAS's); and float32 gradients,
// given the forward's softmax statistics, are held to a float64 plain loop
// within 2x the error of the same computation done in float32 plain loops
// (FlashAttention's rule, bench/fa_grad_rule.py runs its grid against
// torch). Also the statistics themselves: (m, l) against float64 loops, the
// pairs of rows without one, and their errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_testing.h"
#include "qkv/qkv.h"
#include "test_util.h"
#include "tolerances.h"

namespace qkv::test {
namespace {

using ElementTypes = ::testing::Types<float, double>;

template <class T>
class SdpaBackwardOneKey : public ::testing::Test {};
TYPED_TEST_SUITE(SdpaBackwardOneKey, ElementTypes, TypeNames);

struct OneKeyCase {
  int64_t batch, nq, nk, dim;
  bool window;      // window (0, 0), bottom-right: query i sees key i + Nk - Nq
  bool len_one;     // valid_lens of 1 for every batch element
  const char* why;  // which way every query sees one key
};

// Indices of the exact-zero checks: the first element that is not the
// expected bits, or -1.
template <class T>
int64_t first_mismatch(const Tensor<T>& got, const Tensor<T>& want) {
  const auto g = got.values(), w = want.values();
  for (size_t e = 0; e < g.size(); ++e) {
    if (g[e] != w[e] || std::signbit(g[e]) != std::signbit(w[e])) return static_cast<int64_t>(e);
  }
  return -1;
}

TYPED_TEST(SdpaBackwardOneKey, GradientsAreExactZerosAndTheOutputGradient) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  // Sizes around the backward's 128-query blocks and the forward's 256, and
  // Nq <= 16 (the forward's row products).
  const OneKeyCase cases[] = {{2, 1, 1, 64, false, false, "Nk = 1"},
                              {1, 7, 1, 16, false, false, "Nk = 1"},
                              {2, 300, 1, 32, false, false, "Nk = 1"},
                              {1, 64, 64, 128, true, false, "window (0, 0)"},
                              {2, 129, 129, 32, true, false, "window (0, 0)"},
                              {1, 300, 300, 64, true, false, "window (0, 0)"},
                              {1, 5, 5, 64, true, false, "window (0, 0)"},
                              {2, 1, 200, 64, false, true, "lengths 1"}};
  for (const OneKeyCase& c : cases) {
    std::ostringstream what;
    what << c.why << ": B=" << c.batch << " Nq=" << c.nq << " Nk=" << c.nk << " D=" << c.dim;
    SCOPED_TRACE(what.str());
    const Tensor<T> q = random_tensor<T>(rng, {c.batch, c.nq, c.dim}, -2.0, 2.0);
    const Tensor<T> k = random_tensor<T>(rng, {c.batch, c.nk, c.dim}, -2.0, 2.0);
    const Tensor<T> v = random_tensor<T>(rng, {c.batch, c.nk, c.dim});
    const Tensor<T> d_out = random_tensor<T>(rng, {c.batch, c.nq, c.dim});
    AttentionOptions o;
    o.return_lse = true;
    o.return_softmax_stats = true;
    if (c.window) o.window_left = o.window_right = 0;
    const Tensor<int64_t> ones({c.batch}, int64_t{1});
    const ValidLens lens = c.len_one ? ValidLens(ones) : ValidLens{};
    const AttentionResult<T> fwd = scaled_dot_product_attention(q, k, v, lens, o);
    // With the forward's statistics and with the lse alone: exact either way.
    for (const bool stats : {true, false}) {
      SCOPED_TRACE(stats ? "with softmax_stats" : "lse alone");
      const DotProductGrads<T> g = scaled_dot_product_attention_backward(
          q, k, v, lens, o,
          {fwd.output, fwd.lse, stats ? ConstView<T>(fwd.softmax_stats) : ConstView<T>()}, d_out);
      const Tensor<T> zeros_q(q.shape()), zeros_k(k.shape());
      // dv_j = sum of dO_i over the queries that see key j: one query each here
      // (window), or one query per batch element (Nq = 1).
      Tensor<T> want_dv(v.shape());
      for (int64_t b = 0; b < c.batch; ++b) {
        for (int64_t i = 0; i < c.nq; ++i) {
          const int64_t j = c.window ? i + c.nk - c.nq : 0;
          for (int64_t e = 0; e < c.dim; ++e) want_dv(b, j, e) = d_out(b, i, e);
        }
      }
      const bool dv_is_d_out = c.window || c.nq == 1;
      if constexpr (std::is_same_v<T, float>) {
        EXPECT_EQ(first_mismatch(g.d_queries, zeros_q), -1) << "d_queries not exactly 0";
        EXPECT_EQ(first_mismatch(g.d_keys, zeros_k), -1) << "d_keys not exactly 0";
        if (dv_is_d_out) {
          EXPECT_EQ(first_mismatch(g.d_values, want_dv), -1) << "d_values not exactly d_output";
        }
      } else {
        // float64's score tiles run on the BLAS, whose bits can depend on the
        // tile's shape (OpenBLAS's small-matrix kernels): P is then 1 to a few
        // roundings and the gradients are that small (docs/semantics.md).
        const Tol tiny{.atol = 1e-13, .rtol = 1e-14};
        EXPECT_TRUE(expect_close(g.d_queries, zeros_q, tiny, "d_queries"));
        EXPECT_TRUE(expect_close(g.d_keys, zeros_k, tiny, "d_keys"));
        if (dv_is_d_out) EXPECT_TRUE(expect_close(g.d_values, want_dv, tiny, "d_values"));
      }
    }
  }
}

// ---- float32 against float64 and float32 plain loops ---------------------------

// softmax(scale q kᵀ) v and its gradients for one batch element in plain loops in
// A, from float inputs: S, the row max, exp, the sum, P = e / sum, dP = dO vᵀ,
// D = sum P dP, dS = P (dP - D), then dq, dk, dv; masked keys (the window) out.
template <class A>
struct LoopGrads {
  std::vector<A> dq, dk, dv;
};

template <class A>
LoopGrads<A> loop_grads(const float* q, const float* k, const float* v, const float* d_out,
                        int64_t nq, int64_t nk, int64_t d, int64_t left, int64_t right) {
  const A scale = A(1) / std::sqrt(static_cast<A>(d));
  LoopGrads<A> g{std::vector<A>(nq * d, A(0)), std::vector<A>(nk * d, A(0)),
                 std::vector<A>(nk * d, A(0))};
  std::vector<A> p(nk), dp(nk);
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t diag = i + nk - nq;
    const auto seen = [&](int64_t j) {
      return (left < 0 || j >= diag - left) && (right < 0 || j <= diag + right);
    };
    A m = -std::numeric_limits<A>::infinity();
    for (int64_t j = 0; j < nk; ++j) {
      A s = 0;
      for (int64_t e = 0; e < d; ++e)
        s += static_cast<A>(q[i * d + e]) * static_cast<A>(k[j * d + e]);
      p[j] = s * scale;
      if (seen(j)) m = std::max(m, p[j]);
    }
    if (m == -std::numeric_limits<A>::infinity()) continue;  // no key: no gradient
    A sum = 0;
    for (int64_t j = 0; j < nk; ++j) {
      p[j] = seen(j) ? std::exp(p[j] - m) : A(0);
      sum += p[j];
    }
    A delta = 0;
    for (int64_t j = 0; j < nk; ++j) {
      p[j] /= sum;
      A x = 0;
      for (int64_t e = 0; e < d; ++e) {
        x += static_cast<A>(d_out[i * d + e]) * static_cast<A>(v[j * d + e]);
      }
      dp[j] = x;
      delta += p[j] * x;
    }
    for (int64_t j = 0; j < nk; ++j) {
      const A ds = p[j] * (dp[j] - delta) * scale;
      for (int64_t e = 0; e < d; ++e) {
        g.dq[i * d + e] += ds * static_cast<A>(k[j * d + e]);
        g.dk[j * d + e] += ds * static_cast<A>(q[i * d + e]);
        g.dv[j * d + e] += p[j] * static_cast<A>(d_out[i * d + e]);
      }
    }
  }
  return g;
}

template <class A, class B>
double max_error(const std::vector<A>& got, const std::vector<B>& ref) {
  double worst = 0;
  for (size_t e = 0; e < got.size(); ++e) {
    worst = std::max(worst, std::abs(static_cast<double>(got[e]) - static_cast<double>(ref[e])));
  }
  return worst;
}

// FlashAttention's rule (hopper/test_flash_attn.py): qkv's max error against
// float64 at most 2x the float32 computation's plus atol, twice the rounding
// of the reference's values near 0.3 in float32 (which matters only where
// both errors are ~0). Shapes from its grid (Nq, Nk in 1, 64, 113, 128, 239,
// 512; D 32, 64, 128; windows none, causal (-1, 0), (0, 0) and a random one).
// The backward gets the forward's softmax statistics, as qkv.torch gives
// them. The bound is 3x, not FlashAttention's 2x: both sides are float32
// computations of about the same accuracy, and the ratio of their largest
// errors has a tail: over 160 runs of this test (24 shapes each) it reached
// 2.45x, and 2x in 4 % of runs. From the lse alone and with dP on the BLAS
// (before) it reached 3.02x in 60 runs, and 4.0x in CI (seed
// 9000119388978406908, dv, Nq = 1). The bench's grid against torch:
// docs/semantics.md.
TEST(SdpaBackwardPrecision, Float32GradientsWithinFlashAttentionsRule) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  constexpr double kBound = 3.0;
  const int64_t sizes[] = {1, 64, 113, 128, 239, 512};
  const int64_t dims[] = {32, 64, 128};
  double worst = 0;
  for (int trial = 0; trial < 24; ++trial) {
    const int64_t nq = sizes[rng.uniform_int(0, 5)], nk = sizes[rng.uniform_int(0, 5)];
    const int64_t d = dims[rng.uniform_int(0, 2)];
    const int kind = trial % 4;  // none, causal, one key, a random window
    const int64_t left = kind == 0 ? -1 : kind == 1 ? -1 : kind == 2 ? 0 : rng.uniform_int(0, 63);
    const int64_t right = kind == 0 ? -1 : kind == 1 ? 0 : kind == 2 ? 0 : rng.uniform_int(0, 63);
    std::ostringstream what;
    what << "Nq=" << nq << " Nk=" << nk << " D=" << d << " window (" << left << ", " << right
         << ")";
    SCOPED_TRACE(what.str());
    // Normal-like inputs as FlashAttention's tests draw (randn): the sum of
    // four uniforms, scaled to variance 1.
    const auto draw = [&](Shape shape) {
      Tensor<float> t(shape);
      for (float& x : t.values()) {
        double s = 0;
        for (int u = 0; u < 4; ++u) s += rng.uniform(-1.0, 1.0);
        x = static_cast<float>(s * std::sqrt(0.75));
      }
      return t;
    };
    const Tensor<float> q = draw({1, nq, d}), k = draw({1, nk, d}), v = draw({1, nk, d});
    const Tensor<float> d_out = draw({1, nq, d});
    AttentionOptions o;
    o.return_lse = true;
    o.return_softmax_stats = true;
    o.window_left = left;
    o.window_right = right;
    const AttentionResult<float> fwd = scaled_dot_product_attention(q, k, v, {}, o);
    const DotProductGrads<float> g = scaled_dot_product_attention_backward(
        q, k, v, {}, o, {fwd.output, fwd.lse, fwd.softmax_stats}, d_out);
    const auto exact =
        loop_grads<double>(q.data(), k.data(), v.data(), d_out.data(), nq, nk, d, left, right);
    const auto single =
        loop_grads<float>(q.data(), k.data(), v.data(), d_out.data(), nq, nk, d, left, right);
    const Tensor<float>* got[] = {&g.d_queries, &g.d_keys, &g.d_values};
    const std::vector<double>* ref[] = {&exact.dq, &exact.dk, &exact.dv};
    const std::vector<float>* f32[] = {&single.dq, &single.dk, &single.dv};
    const char* names[] = {"dq", "dk", "dv"};
    for (int t = 0; t < 3; ++t) {
      const auto values = got[t]->values();
      const std::vector<float> mine(values.begin(), values.end());
      const double err = max_error(mine, *ref[t]);
      const double err32 = max_error(*f32[t], *ref[t]);
      double atol = 0;
      for (const double x : *ref[t]) {
        const float r = static_cast<float>(x);
        atol = std::max(atol, 2.0 * std::abs(static_cast<double>((r + 0.3f) - 0.3f - r)));
      }
      const double allowed = kBound * err32 + atol;
      if (err > 0) worst = std::max(worst, err / (err32 + atol / kBound));
      EXPECT_LE(err, allowed) << names[t] << ": error " << err << " against float64, the float32 "
                              << "loops' " << err32 << ", atol " << atol;
    }
  }
  std::printf("worst err / (err_f32 + atol / %.0f): %.2f\n", kBound, worst);
}

// ---- the softmax's statistics ---------------------------------------------------

// (m, l) of every row against float64 loops over the same float inputs:
// m the largest valid scaled score (to the float32 rounding of the score), l
// the sum of exp(score - m) (to float32 summation error), lse = m + log l;
// the pairs of rows the kernels sum exactly or without a pair: (lse, 1),
// and a row with no key: (-inf, 0). Shapes through the kernels' paths:
// decoding (Nq = 1) with key chunks, the row products (Nq <= 16), the block
// products, weights asked for, heads, D <= 4 (the small-dimension kernel),
// a row with an infinite score (the exact path).
TEST(SdpaSoftmaxStats, AreTheForwardsRowMaxAndSum) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  struct Case {
    int64_t batch, heads, nq, nk, d;
    bool weights;
    const char* why;
  };
  const Case cases[] = {{2, 1, 1, 3000, 64, false, "decoding, key chunks"},
                        {1, 2, 9, 200, 32, false, "row products, heads"},
                        {2, 1, 300, 257, 64, false, "block products"},
                        {1, 1, 40, 70, 16, true, "weights asked for"},
                        {2, 1, 33, 50, 3, false, "D = 3: the small-dimension kernel"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.why);
    const Shape qs = c.heads > 1 ? Shape{c.batch, c.heads, c.nq, c.d} : Shape{c.batch, c.nq, c.d};
    const Shape ks = c.heads > 1 ? Shape{c.batch, c.heads, c.nk, c.d} : Shape{c.batch, c.nk, c.d};
    const Tensor<float> q = random_tensor<float>(rng, qs, -1.5, 1.5);
    const Tensor<float> k = random_tensor<float>(rng, ks, -1.5, 1.5);
    const Tensor<float> v = random_tensor<float>(rng, ks);
    // Batch element 0 sees every key; element 1, if any, none.
    Tensor<int64_t> lens({c.batch}, c.nk);
    if (c.batch > 1) lens(1) = 0;
    AttentionOptions o;
    o.return_lse = true;
    o.return_softmax_stats = true;
    o.return_weights = c.weights;
    const AttentionResult<float> r = scaled_dot_product_attention(q, k, v, ValidLens(lens), o);
    ASSERT_EQ(r.softmax_stats.shape(),
              c.heads > 1 ? Shape({c.batch, c.heads, c.nq, 2}) : Shape({c.batch, c.nq, 2}));
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
    const bool small = c.d <= 4;
    for (int64_t b = 0; b < c.batch; ++b) {
      for (int64_t h = 0; h < c.heads; ++h) {
        const int64_t head = b * c.heads + h;
        for (int64_t i = 0; i < c.nq; ++i) {
          const int64_t row = head * c.nq + i;
          const float m = r.softmax_stats.data()[2 * row], l = r.softmax_stats.data()[2 * row + 1];
          const float lse = r.lse.data()[row];
          if (lens(b) == 0) {
            EXPECT_EQ(m, -std::numeric_limits<float>::infinity()) << "row " << row;
            EXPECT_EQ(l, 0.0f) << "row " << row;
            continue;
          }
          const float* qi = q.data() + (head * c.nq + i) * c.d;
          std::vector<double> s(c.nk);
          double want_m = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j < c.nk; ++j) {
            const float* kj = k.data() + (head * c.nk + j) * c.d;
            double x = 0;
            for (int64_t e = 0; e < c.d; ++e) x += double(qi[e]) * kj[e];
            s[j] = x * scale;
            want_m = std::max(want_m, s[j]);
          }
          double want_l = 0;
          for (const double x : s) want_l += std::exp(x - want_m);
          const double want_lse = want_m + std::log(want_l);
          if (small) {
            EXPECT_EQ(m, lse) << "row " << row << ": (lse, 1)";
            EXPECT_EQ(l, 1.0f) << "row " << row;
          } else {
            // A score's float32 error: D products of |x| <= 1.5^2 rounding.
            EXPECT_NEAR(m, want_m, 1e-5) << "row " << row;
            EXPECT_NEAR(l, want_l, want_l * (c.nk * 1.2e-7 + 2e-5)) << "row " << row;
            // The lse the kernels wrote is m + log l, rounded once.
            EXPECT_EQ(lse, m + std::log(l)) << "row " << row;
          }
          EXPECT_NEAR(lse, want_lse, 2e-5) << "row " << row;
        }
      }
    }
  }
}

// Given the forward's statistics, the backward forms the very weights the
// forward returned: with dO zero but for a 1 at (query i, column 0), dV's
// column 0 is P_i, one product by 1 per key, and must equal the forward's
// weights row bit for bit (float32, more than 16 queries so both sweeps
// take the block product, key counts around the 128-key blocks; masks and
// heads too). From the lse alone 2,116 of the 3,942 weights differed in a run.
TEST(SdpaSoftmaxStats, BackwardFormsTheForwardsWeights) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  struct Case {
    int64_t heads, kv_heads, nq, nk;
    int64_t left, right;
  };
  const Case cases[] = {{1, 1, 40, 100, -1, -1}, {2, 1, 33, 300, -1, 0}, {1, 1, 129, 257, 30, 5}};
  int64_t compared = 0;
  for (const Case& c : cases) {
    const int64_t d = 32;
    const Tensor<float> q = random_tensor<float>(rng, {1, c.heads, c.nq, d}, -1.5, 1.5);
    const Tensor<float> k = random_tensor<float>(rng, {1, c.kv_heads, c.nk, d}, -1.5, 1.5);
    const Tensor<float> v = random_tensor<float>(rng, {1, c.kv_heads, c.nk, d});
    AttentionOptions o;
    o.return_lse = true;
    o.return_softmax_stats = true;
    o.return_weights = true;
    o.window_left = c.left;
    o.window_right = c.right;
    const AttentionResult<float> fwd = scaled_dot_product_attention(q, k, v, {}, o);
    for (const int64_t h : {int64_t{0}, c.heads - 1}) {
      for (const int64_t i : {int64_t{0}, c.nq / 2, c.nq - 1}) {
        Tensor<float> d_out({1, c.heads, c.nq, d}, 0.0f);
        d_out(0, h, i, 0) = 1.0f;
        const DotProductGrads<float> g = scaled_dot_product_attention_backward(
            q, k, v, {}, o, {fwd.output, fwd.lse, fwd.softmax_stats}, d_out);
        const int64_t kv = h / (c.heads / c.kv_heads);
        for (int64_t j = 0; j < c.nk; ++j) {
          ASSERT_EQ(g.d_values(0, kv, j, 0), fwd.weights(0, h, i, j))
              << "head " << h << " query " << i << " key " << j << " of Nq=" << c.nq
              << " Nk=" << c.nk;
          ++compared;
        }
      }
    }
  }
  EXPECT_GT(compared, 0);
}

// A row with a +inf score takes the exact path, which gives it lse NaN
// (DESIGN.md §3): its pair is (lse, 1), NaN too, so the backward's weights,
// exp(score - m) / l, are NaN as its lse makes them. Its neighbours keep
// their (m, l).
TEST(SdpaSoftmaxStats, ExactRowsGiveTheLseAndOne) {
  Tensor<float> q({1, 3, 4}, 0.5f), k({1, 5, 4}, 0.25f), v({1, 5, 4}, 1.0f);
  AttentionOptions o;
  o.return_lse = true;
  o.return_softmax_stats = true;
  Tensor<float> bias({3, 5}, 0.0f);
  bias(1, 2) = std::numeric_limits<float>::infinity();
  o.bias = ConstView<float>(bias);
  const AttentionResult<float> r = scaled_dot_product_attention(q, k, v, {}, o);
  EXPECT_TRUE(std::isnan(r.lse(0, 1)));
  EXPECT_TRUE(std::isnan(r.softmax_stats(0, 1, 0)));
  EXPECT_EQ(r.softmax_stats(0, 1, 1), 1.0f);
  // Every score of row 0 is 4 x 0.5 x 0.25 / sqrt(4) = 0.25: m = 0.25, l = 5.
  EXPECT_EQ(r.softmax_stats(0, 0, 0), 0.25f);
  EXPECT_EQ(r.softmax_stats(0, 0, 1), 5.0f);
  EXPECT_EQ(r.softmax_stats(0, 0, 0) + std::log(r.softmax_stats(0, 0, 1)), r.lse(0, 0));
}

// Bad uses name the function, the argument and what to do.
TEST(SdpaSoftmaxStats, MisuseIsAnError) {
  const Tensor<float> q({2, 3, 4}, 0.5f), k({2, 5, 4}, 0.25f), v({2, 5, 4}, 1.0f);
  AttentionOptions o;
  o.return_softmax_stats = true;
  expect_error([&] { scaled_dot_product_attention(q, k, v, {}, o); },
               {"scaled_dot_product_attention", "options.return_softmax_stats",
                "options.return_lse is not"});
  o.return_lse = true;
  const Tensor<float> wq({6, 4}, 0.1f), wk({6, 4}, 0.1f), wv({6}, 0.1f);
  expect_error(
      [&] {
        additive_attention(q, k, v, {wq, wk, wv}, {}, o);
      },
      {"additive_attention", "options.return_softmax_stats", "only scaled_dot_product_attention"});
  // The write-into form: the statistics need the lse beside them, and their shape.
  Tensor<float> out({2, 3, 4}), lse({2, 3}), stats({2, 3, 2}), wrong({2, 3});
  AttentionOutputs<float> outputs{out.view(), std::nullopt, std::nullopt, stats.view()};
  expect_error([&] { scaled_dot_product_attention(q, k, v, {}, {}, outputs); },
               {"scaled_dot_product_attention", "outputs.softmax_stats", "outputs.lse is not"});
  outputs.lse = lse.view();
  outputs.softmax_stats = wrong.view();
  expect_error([&] { scaled_dot_product_attention(q, k, v, {}, {}, outputs); },
               {"scaled_dot_product_attention", "outputs.softmax_stats", "[2, 3, 2]"});
  // The backward: the forward's shape.
  const AttentionResult<float> fwd = scaled_dot_product_attention(q, k, v, {}, o);
  const Tensor<float> d_out({2, 3, 4}, 1.0f);
  expect_error(
      [&] {
        scaled_dot_product_attention_backward(q, k, v, {}, o, {fwd.output, fwd.lse, wrong}, d_out);
      },
      {"scaled_dot_product_attention_backward", "softmax_stats", "[2, 3, 2]"});
}

}  // namespace
}  // namespace qkv::test
