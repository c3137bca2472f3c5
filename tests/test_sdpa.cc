// GoogleTest suite of scaled dot-product attention's own behaviour
// (qkv/attention.h); the contract every scoring function meets is in
// test_attention.cc. Here: the scale (override, 0 = average pooling, large =
// a lookup, scores that overflow exp without the max subtraction), a zero
// feature size, the exercise's Jacobian = covariance identity, and the
// feature-size errors. The many-block and bf16 paths are in test_sdpa_flash.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "attention_suite.h"
#include "attention_testing.h"
#include "test_util.h"
#include "tolerances.h"

namespace qkv::test {
namespace {

template <class T>
class Sdpa : public ::testing::Test {};
using ElementTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Sdpa, ElementTypes, TypeNames);

// The op's tolerances (attention_suite.h).
template <class T>
constexpr Tols kTol = tols<SdpaScoring, T>();

// D = 0 (docs/semantics.md): with an explicit scale every score is 0
// (average pooling); without one it is an error (1/sqrt(0)).
TYPED_TEST(Sdpa, ZeroFeatureSize) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  AttentionOptions opt;
  opt.return_weights = true;
  opt.return_lse = true;
  for (const bool use_ref : {false, true}) {
    SCOPED_TRACE(use_ref ? "ref" : "fast");
    auto attend = [&](const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v,
                      const AttentionOptions& o) {
      return use_ref ? ref::scaled_dot_product_attention(q, k, v, {}, o)
                     : scaled_dot_product_attention(q, k, v, {}, o);
    };
    const Tensor<T> q(Shape{2, 3, 0}), k(Shape{2, 4, 0});
    const Tensor<T> v = random_tensor<T>(rng, {2, 4, 3});
    AttentionOptions scaled = opt;
    scaled.scale = 1.0;
    const AttentionResult<T> r = attend(q, k, v, scaled);
    expect_close(r.output, mean_over_keys(v, 3), tol_for<T>(kAverage, kPoolingDouble), "output",
                 "b q d");
    expect_close(r.weights, Tensor<double>(Shape{2, 3, 4}, 0.25), kTol<T>.weights, "weights");
    expect_close(r.lse, Tensor<double>(Shape{2, 3}, std::log(4.0)), kTol<T>.lse, "lse", "b q");
    expect_error([&] { attend(q, k, v, opt); }, {"scaled_dot_product_attention", "scale"});
  }
}

TYPED_TEST(Sdpa, ScaleOverride) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (const double scale : {1.0, 0.37, 2.5, rng.uniform(0.01, 3.0)}) {
    Case c;
    c.nq = 17;
    c.nk = 33;
    c.dq = 16;
    c.dv = 9;
    c.scale = scale;
    c.lens_form = LensForm::kPerQuery;
    check_forward<SdpaScoring, T>(rng, c);
  }
}

// scale = 0 makes every valid score 0: uniform weights, average pooling.
TYPED_TEST(Sdpa, ZeroScaleIsAveragePooling) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  Case c;
  c.batch = 2;
  c.nq = 4;
  c.nk = 70;
  c.dq = 5;
  c.dv = 3;
  c.scale = 0.0;
  c.lens_form = LensForm::kPerQuery;
  const Inputs<SdpaScoring, T> in(rng, c);
  const AttentionResult<T> r =
      scaled_dot_product_attention(in.q, in.k, in.v, in.valid_lens(), c.options(0));
  Tensor<double> mean(Shape{c.batch, c.nq, c.dv});
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t i = 0; i < c.nq; ++i) {
      const int64_t len = in.lens.at(b, i, c.nk);
      for (int64_t d = 0; d < c.dv; ++d) {
        double sum = 0.0;
        for (int64_t j = 0; j < len; ++j) sum += double(in.v(b, j, d));
        mean(b, i, d) = len > 0 ? sum / double(len) : 0.0;
      }
    }
  }
  expect_close(r.output, mean, tol_for<T>(kAverage, kPoolingDouble), "average pooling", "b q d");
}

// One-hot weights: keys are basis vectors and a large scale makes each query
// pick exactly one key, the database lookup of the chapter.
TYPED_TEST(Sdpa, LargeScaleIsALookup) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t nk = 19, nq = 11, dv = 4;
  Tensor<T> keys(Shape{1, nk, nk});
  for (int64_t j = 0; j < nk; ++j) keys(0, j, j) = T(1);
  Tensor<T> queries(Shape{1, nq, nk});
  std::vector<int64_t> pick(static_cast<size_t>(nq));
  for (int64_t i = 0; i < nq; ++i) {
    pick[static_cast<size_t>(i)] = rng.uniform_int(0, nk - 1);
    queries(0, i, pick[static_cast<size_t>(i)]) = T(1);
  }
  const Tensor<T> values = random_tensor<T>(rng, {1, nk, dv});
  AttentionOptions opt;
  opt.scale = 200.0;  // the other weights are exp(-200) relative
  const AttentionResult<T> r = scaled_dot_product_attention(queries, keys, values, {}, opt);
  Tensor<double> expected(Shape{1, nq, dv});
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t d = 0; d < dv; ++d) expected(0, i, d) = values(0, pick[static_cast<size_t>(i)], d);
  }
  expect_close(r.output, expected, tol_for<T>(kPooling, kPoolingDouble), "lookup", "b q d");
}

// Scores of 30 to 1000 overflow exp (float past 88, double past 709) unless
// the row max is subtracted first. Queries and keys are multiples of 0.5 in
// [1, 2] and the scales powers of two, so every score is exact in float and
// the comparison measures the softmax and pooling alone.
TYPED_TEST(Sdpa, LargeScoresStayFinite) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (const double scale : {4.0, 32.0}) {
    for (const int64_t nk : {3, 64, 130}) {
      Case c;
      c.nq = 9;
      c.nk = nk;
      c.dq = 8;
      c.dv = 5;
      c.scale = scale;
      c.lens_form = LensForm::kPerBatch;
      check_forward<SdpaScoring, T>(rng, c, 0.75, 2.25, 0.5);
    }
  }
}

// d2l §11.1, exercise 2: with a(q, k) = q·k (scale 1) and k_i = v_i, the
// Jacobian of the output w.r.t. q is Cov_p[k] = sum p_i k_i k_iᵀ − μ μᵀ.
TEST(SdpaGradient, JacobianIsKeyCovariance) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (const int64_t dim : {1, 3, 6}) {
    const int64_t nk = 2 * dim + 3;
    SCOPED_TRACE("D=" + std::to_string(dim) + " Nk=" + std::to_string(nk));
    const Tensor<double> keys = random_tensor<double>(rng, {1, nk, dim}, -1.5, 1.5);
    const Tensor<double> query = random_tensor<double>(rng, {1, 1, dim});
    AttentionOptions opt;
    opt.scale = 1.0;
    opt.return_lse = true;

    // Cov_p[k] in a plain loop.
    std::vector<double> p(static_cast<size_t>(nk));
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < nk; ++j) {
      double s = 0.0;
      for (int64_t d = 0; d < dim; ++d) s += query(0, 0, d) * keys(0, j, d);
      p[static_cast<size_t>(j)] = s;
      m = std::max(m, s);
    }
    double z = 0.0;
    for (double& x : p) z += (x = std::exp(x - m));
    for (double& x : p) x /= z;
    std::vector<double> mu(static_cast<size_t>(dim), 0.0);
    for (int64_t j = 0; j < nk; ++j) {
      for (int64_t d = 0; d < dim; ++d)
        mu[static_cast<size_t>(d)] += p[static_cast<size_t>(j)] * keys(0, j, d);
    }
    Tensor<double> cov(Shape{dim, dim});
    for (int64_t a = 0; a < dim; ++a) {
      for (int64_t b = 0; b < dim; ++b) {
        double e = 0.0;
        for (int64_t j = 0; j < nk; ++j)
          e += p[static_cast<size_t>(j)] * keys(0, j, a) * keys(0, j, b);
        cov(a, b) = e - mu[static_cast<size_t>(a)] * mu[static_cast<size_t>(b)];
      }
    }

    const ThreadCount one_thread(1);
    // J[a][b] = d out_a / d q_b from the backward with d_output = e_a, from
    // finite differences, and (float) from the float backward.
    const AttentionResult<double> fwd = scaled_dot_product_attention(query, keys, keys, {}, opt);
    const Tensor<float> keys_f = cast<float>(keys), query_f = cast<float>(query);
    const AttentionResult<float> fwd_f =
        scaled_dot_product_attention(query_f, keys_f, keys_f, {}, opt);
    Tensor<double> jac(Shape{dim, dim}), jac_ref(Shape{dim, dim}), jac_fd(Shape{dim, dim});
    Tensor<float> jac_f(Shape{dim, dim});
    for (int64_t a = 0; a < dim; ++a) {
      Tensor<double> unit(Shape{1, 1, dim});
      unit(0, 0, a) = 1.0;
      const DotProductGrads<double> g = scaled_dot_product_attention_backward(
          query, keys, keys, {}, opt, {fwd.output, fwd.lse}, unit);
      const DotProductGrads<double> gr = ref::scaled_dot_product_attention_backward(
          query, keys, keys, {}, opt, {fwd.output, fwd.lse}, unit);
      const DotProductGrads<float> gf = scaled_dot_product_attention_backward(
          query_f, keys_f, keys_f, {}, opt, {fwd_f.output, fwd_f.lse}, cast<float>(unit));
      const Tensor<double> fd = numerical_gradient(
          [&](const Tensor<double>& q) {
            return scaled_dot_product_attention(q, keys, keys, {}, opt).output(0, 0, a);
          },
          query);
      for (int64_t b = 0; b < dim; ++b) {
        jac(a, b) = g.d_queries(0, 0, b);
        jac_ref(a, b) = gr.d_queries(0, 0, b);
        jac_f(a, b) = gf.d_queries(0, 0, b);
        jac_fd(a, b) = fd(0, 0, b);
      }
    }
    expect_close(jac, cov, kSdpaBackwardDouble, "Jacobian (fast backward) vs Cov_p[k]", "a b");
    expect_close(jac_ref, cov, kSdpaBackwardDouble, "Jacobian (ref backward) vs Cov_p[k]", "a b");
    expect_close(jac_fd, cov, kFiniteDiff, "Jacobian (finite differences) vs Cov_p[k]", "a b");
    expect_close(jac_f, cov, kSdpaBackward, "Jacobian (float backward) vs Cov_p[k]", "a b");
  }
}
// d_lse (the gradient arriving at lse, for losses such as cross-entropy over
// the keys, docs/search.md): the backward of L = sum dO.O + sum c_i lse_i
// matches finite differences of L, fast and ref, with per-query lengths and
// enough keys for several key blocks; and with d_output = 0, d_lse = 1 the
// gradients are scale sum_j P_ij k_j and scale sum_i P_ij q_i, the weights
// from a float64 loop (naive_sdpa), in float32 too.
TEST(SdpaGradient, LseGradient) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  AttentionOptions opt;
  opt.return_lse = true;
  for (const auto& [nq, nk, dim] : {std::tuple<int64_t, int64_t, int64_t>{3, 5, 4}, {5, 300, 8}}) {
    SCOPED_TRACE("Nq=" + std::to_string(nq) + " Nk=" + std::to_string(nk));
    const Tensor<double> q = random_tensor<double>(rng, {2, nq, dim}, -2, 2);
    const Tensor<double> k = random_tensor<double>(rng, {2, nk, dim}, -2, 2);
    const Tensor<double> v = random_tensor<double>(rng, {2, nk, 3});
    const Tensor<int64_t> len_tensor = random_lens<int64_t>(rng, LensForm::kPerQuery, 2, nq, nk);
    const ValidLens lens = as_valid_lens(len_tensor);
    const Tensor<double> d_out = random_tensor<double>(rng, {2, nq, 3});
    const Tensor<double> d_lse = random_tensor<double>(rng, {2, nq});
    auto loss = [&](const Tensor<double>& qq, const Tensor<double>& kk) {
      const AttentionResult<double> r = scaled_dot_product_attention(qq, kk, v, lens, opt);
      double l = 0.0;
      for (int64_t b = 0; b < 2; ++b) {
        for (int64_t i = 0; i < nq; ++i) {
          for (int64_t c = 0; c < 3; ++c) l += d_out(b, i, c) * r.output(b, i, c);
          if (std::isfinite(r.lse(b, i))) l += d_lse(b, i) * r.lse(b, i);
        }
      }
      return l;
    };
    const Tensor<double> fd_q = numerical_gradient([&](const Tensor<double>& x) { return loss(x, k); }, q);
    const Tensor<double> fd_k = numerical_gradient([&](const Tensor<double>& x) { return loss(q, x); }, k);
    const AttentionResult<double> fwd = scaled_dot_product_attention(q, k, v, lens, opt);
    for (const bool use_ref : {false, true}) {
      SCOPED_TRACE(use_ref ? "ref" : "fast");
      const DotProductGrads<double> g =
          use_ref ? ref::scaled_dot_product_attention_backward(q, k, v, lens, opt,
                                                               {fwd.output, fwd.lse}, d_out, d_lse)
                  : scaled_dot_product_attention_backward(q, k, v, lens, opt,
                                                          {fwd.output, fwd.lse}, d_out, d_lse);
      expect_close(g.d_queries, fd_q, kFiniteDiff, "dQ vs finite differences", "b q d");
      expect_close(g.d_keys, fd_k, kFiniteDiff, "dK vs finite differences", "b k d");
    }

    // Cross-entropy's half through the kernel: d_output = 0, d_lse = 1.
    const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
    const NaiveForward naive = naive_sdpa<double>(q, k, v, lens, scale, {});
    Tensor<double> want_dq(q.shape()), want_dk(k.shape());
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t i = 0; i < nq; ++i) {
        for (int64_t j = 0; j < nk; ++j) {
          const double p = naive.weight_at(b, i, j) * scale;
          for (int64_t c = 0; c < dim; ++c) {
            want_dq(b, i, c) += p * k(b, j, c);
            want_dk(b, j, c) += p * q(b, i, c);
          }
        }
      }
    }
    const Tensor<float> qf = cast<float>(q), kf = cast<float>(k), vf = cast<float>(v);
    const AttentionResult<float> ff = scaled_dot_product_attention(qf, kf, vf, lens, opt);
    const DotProductGrads<float> gf = scaled_dot_product_attention_backward(
        qf, kf, vf, lens, opt, {ff.output, ff.lse}, Tensor<float>(Shape{2, nq, 3}),
        Tensor<float>(Shape{2, nq}, 1.0f));
    expect_close(gf.d_queries, want_dq, kSdpaBackward, "float dQ of the lse vs float64 loop", "b q d");
    expect_close(gf.d_keys, want_dk, kSdpaBackward, "float dK of the lse vs float64 loop", "b k d");
    expect_close(gf.d_values, Tensor<double>(v.shape()), kSdpaBackward, "float dV (d_output = 0)",
                 "b k d");
  }
}

// d_lse with bf16 inputs (what qkv.torch's return_lse runs for
// torch.bfloat16): with d_output = 0 the gradients are d_lse's term alone,
// against the float backward on the widened inputs given the same d_lse.
// The bf16 products round dS to bf16 (2^-8 relative) where the native
// kernel runs; d_lse of another shape is refused by name.
TEST(SdpaGradient, LseGradientBf16) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  AttentionOptions opt;
  opt.return_lse = true;
  opt.causal = Causal::kBottomRight;
  const Tensor<float> q = random_tensor<float>(rng, {2, 2, 37, 64}, -2, 2);
  const Tensor<float> k = random_tensor<float>(rng, {2, 2, 300, 64}, -2, 2);
  const Tensor<float> v = random_tensor<float>(rng, {2, 2, 300, 16});
  Tensor<bfloat16> qb(q.shape()), kb(k.shape()), vb(v.shape());
  Tensor<float> qw(q.shape()), kw(k.shape()), vw(v.shape());
  for (const auto& [src, dst, wide] : {std::tuple{&q, &qb, &qw}, {&k, &kb, &kw}, {&v, &vb, &vw}}) {
    for (int64_t e = 0; e < src->numel(); ++e) {
      dst->data()[e] = bfloat16(src->data()[e]);
      wide->data()[e] = static_cast<float>(dst->data()[e]);
    }
  }
  const Tensor<float> d_out(Shape{2, 2, 37, 16});
  const Tensor<float> d_lse = random_tensor<float>(rng, {2, 2, 37});
  const AttentionResult<float> fb = scaled_dot_product_attention(qb, kb, vb, {}, opt);
  const AttentionResult<float> fw = scaled_dot_product_attention(qw, kw, vw, {}, opt);
  const DotProductGrads<float> got =
      scaled_dot_product_attention_backward(qb, kb, vb, {}, opt, {fb.output, fb.lse}, d_out, d_lse);
  const DotProductGrads<float> want =
      scaled_dot_product_attention_backward(qw, kw, vw, {}, opt, {fw.output, fw.lse}, d_out, d_lse);
  for (const auto& [g, w, what] :
       {std::tuple{&got.d_queries, &want.d_queries, "dQ"}, {&got.d_keys, &want.d_keys, "dK"}}) {
    double max_want = 0;
    for (const float x : w->values()) max_want = std::max(max_want, std::abs(double{x}));
    ASSERT_GT(max_want, 1e-3) << what << ": d_lse's term is not zero";
    expect_close(*g, *w, Tol{.atol = (0x1p-8 + 1e-5) * max_want, .rtol = 0},
                 std::string("bf16 ") + what + " of the lse vs float on widened inputs");
  }
  for (const float x : got.d_values.values()) EXPECT_EQ(x, 0.0f) << "dV (d_output = 0)";
  expect_error(
      [&] {
        scaled_dot_product_attention_backward(qb, kb, vb, {}, opt, {fb.output, fb.lse}, d_out,
                                              Tensor<float>(Shape{2, 2, 36}));
      },
      {"scaled_dot_product_attention_backward", "d_lse", "[2, 2, 36]"});
}

// ---- bad input (the rest is in test_attention.cc's AttentionErrors) ------------

// Keys and queries must share their feature size D, in the forward and the
// backward.
TEST(SdpaErrors, FeatureSizes) {
  const ErrorFixture<SdpaScoring> f;
  const AttentionOptions opt;
  constexpr const char* kFn = SdpaScoring::kFunction;
  constexpr const char* kFnBackward = SdpaScoring::kFunctionBackward;
  // Keys D = 11 vs queries D = 4; the chapter's D = 3 vs 2.
  const Tensor<float> k11(Shape{2, 5, 11});
  expect_forward_error<SdpaScoring>(f.with(1, k11), {}, opt, {kFn, "keys", "11", "4"});
  const Tensor<float> q2(Shape{2, 1, 2}), k3(Shape{2, 10, 3}), v4(Shape{2, 10, 4});
  expect_forward_error<SdpaScoring>(Args<float>{q2, k3, v4, {}}, {}, opt, {kFn, "3", "2"});
  expect_error(
      [&] {
        scaled_dot_product_attention_backward(f.in.q, k11, f.in.v, {}, opt, {f.out, f.lse},
                                              f.d_out);
      },
      {kFnBackward, "11", "4"});
  // d_lse must have the lse's shape (B, Nq).
  const Tensor<float> d_lse(Shape{2, 7});
  expect_error(
      [&] {
        scaled_dot_product_attention_backward(f.in.q, f.in.k, f.in.v, {}, opt, {f.out, f.lse},
                                              f.d_out, d_lse);
      },
      {kFnBackward, "d_lse", "[2, 7]", "[2, 3]"});
}

}  // namespace
}  // namespace qkv::test
