// GoogleTest suite of additive attention's own behaviour (qkv/attention.h);
// the contract every scoring function meets is in test_attention.cc. Here:
// w_v as (H) and (1, H), H = 0, the fused kernels' pieces (tanh accuracy,
// tile scores, tile edges, large features, NaN keys seen by one query only),
// the kernels' workspace size query and the parameters' errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attention_suite.h"
#include "attention_testing.h"
#include "kernels/attention/additive_tile.h"
#include "kernels/kernels.h"
#include "test_util.h"
#include "tolerances.h"

namespace qkv::test {
namespace {

template <class T>
class Additive : public ::testing::Test {};
using ElementTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Additive, ElementTypes, TypeNames);

// The op's tolerances (attention_suite.h).
template <class T>
constexpr Tols kTol = tols<AdditiveScoring, T>();

// w_v as (H) and as (1, H) holding the same numbers give the same result.
TYPED_TEST(Additive, WvShapesAgree) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  Case c;
  c.nq = 9;
  c.nk = 21;
  c.dq = 6;
  c.dk = 4;
  c.hidden = 11;
  c.dv = 2;
  c.lens_form = LensForm::kPerQuery;
  const Inputs<AdditiveScoring, T> in(rng, c);
  const Tensor<T>&w_q = in.params[0], &w_k = in.params[1], &w_v = in.params[2];
  const Tensor<T> wv_row = w_v.reshaped({1, c.hidden});
  const AttentionOptions opt = c.options(0);
  const AttentionResult<T> a =
      additive_attention(in.q, in.k, in.v, {w_q, w_k, w_v}, in.valid_lens(), opt);
  const AttentionResult<T> b =
      additive_attention(in.q, in.k, in.v, {w_q, w_k, wv_row}, in.valid_lens(), opt);
  expect_close(a.output, b.output, kTol<T>.out, "w_v (H) vs (1, H) output", "b q d");
  expect_close(a.weights, b.weights, kTol<T>.weights, "w_v (H) vs (1, H) weights");
}

// H = 0 makes every score 0: average pooling.
TYPED_TEST(Additive, ZeroHiddenSize) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  AttentionOptions opt;
  opt.return_weights = true;
  opt.return_lse = true;
  for (const bool use_ref : {false, true}) {
    SCOPED_TRACE(use_ref ? "ref" : "fast");
    const Tensor<T> q = random_tensor<T>(rng, {2, 3, 4}), k = random_tensor<T>(rng, {2, 5, 2}),
                    v = random_tensor<T>(rng, {2, 5, 3});
    const Tensor<T> w_q(Shape{0, 4}), w_k(Shape{0, 2}), w_v(Shape{0});
    const AttentionResult<T> r = use_ref
                                     ? ref::additive_attention(q, k, v, {w_q, w_k, w_v}, {}, opt)
                                     : additive_attention(q, k, v, {w_q, w_k, w_v}, {}, opt);
    expect_close(r.output, mean_over_keys(v, 3), tol_for<T>(kAverage, kPoolingDouble), "output",
                 "b q d");
    expect_close(r.weights, Tensor<double>(Shape{2, 3, 5}, 0.2), kTol<T>.weights, "weights");
  }
}

// ---- the fused kernels' own pieces ------------------------------------------------

// kernels::fast::tanh_row against std::tanh in long double over a dense sweep: the
// float rational approximation within 3e-7 relative (4e-7 on targets without
// FMA; plus the smallest subnormal, for subnormal results), double within 4
// units in the last place; ±0 keep their sign, ±inf give ±1, NaN stays NaN.
TEST(AdditiveTanh, AccuracyOverADenseSweep) {
  std::vector<float> xf;
  std::vector<double> xd;
  // Every 4096th float from 2^-149 to 3e38 with both signs (covers subnormals,
  // the small-x regime, the clamp at 7.9 and saturation), plus a fine linear
  // sweep of [-12, 12].
  for (uint32_t bits = 1; bits < 0x7f7fffffu; bits += 4096) {
    float x;
    std::memcpy(&x, &bits, sizeof x);
    xf.push_back(x);
    xf.push_back(-x);
  }
  for (int i = -1200000; i <= 1200000; ++i) xf.push_back(static_cast<float>(i * 1e-5));
  const float inf = std::numeric_limits<float>::infinity();
  for (const float x : {0.0f, -0.0f, inf, -inf, 7.9053111f, -7.9053111f, 9.0f, 1e-30f}) {
    xf.push_back(x);
  }
  for (const float x : xf) xd.push_back(static_cast<double>(x) * (1.0 + 1e-9));
  std::vector<float> tf(xf.size());
  std::vector<double> td(xd.size());
  kernels::fast::tanh_row(xf.data(), tf.data(), static_cast<int64_t>(xf.size()));
  kernels::fast::tanh_row(xd.data(), td.data(), static_cast<int64_t>(xd.size()));
  // Without fused multiply-adds (targets below AVX2) each Horner step rounds
  // twice: the worst seen there is 3.7e-7 (at x = -5.78), against 2.7e-7 with
  // FMA (3.4 M points, one run each).
  const bool fma = simd_target() == "avx2" || simd_target().rfind("avx512", 0) == 0;
  const double float_bound = fma ? 3e-7 : 4e-7;
  double worst_f = 0, worst_d = 0;
  float worst_fx = 0;
  for (size_t n = 0; n < xf.size(); ++n) {
    const long double ref = std::tanh(static_cast<long double>(xf[n]));
    const double err = static_cast<double>(std::fabs(tf[n] - ref));
    ASSERT_LE(err, float_bound * std::fabs(static_cast<double>(ref)) + 1.5e-45)
        << "float tanh(" << xf[n] << ") = " << tf[n] << ", expected " << static_cast<double>(ref);
    if (ref != 0 && err / std::fabs(static_cast<double>(ref)) > worst_f) {
      worst_f = err / std::fabs(static_cast<double>(ref));
      worst_fx = xf[n];
    }
    const long double ref_d = std::tanh(static_cast<long double>(xd[n]));
    const double err_d = static_cast<double>(std::fabs(td[n] - ref_d));
    ASSERT_LE(err_d, 4 * std::numeric_limits<double>::epsilon() * std::fabs(double(ref_d)) + 5e-324)
        << "double tanh(" << xd[n] << ") = " << td[n] << ", expected " << double(ref_d);
    if (ref_d != 0) worst_d = std::max(worst_d, err_d / std::fabs(static_cast<double>(ref_d)));
  }
  std::cout << "tanh over " << xf.size() << " points: worst relative error float " << worst_f
            << " (at x = " << worst_fx << "), double " << worst_d << "\n";
  // Signs of zero, and NaN.
  const float zeros[2] = {0.0f, -0.0f};
  float tz[2];
  kernels::fast::tanh_row(zeros, tz, 2);
  EXPECT_FALSE(std::signbit(tz[0]));
  EXPECT_TRUE(std::signbit(tz[1]));
  const float nans[3] = {std::numeric_limits<float>::quiet_NaN(), 1.0f,
                         -std::numeric_limits<float>::quiet_NaN()};
  float tn[3];
  kernels::fast::tanh_row(nans, tn, 3);
  EXPECT_TRUE(std::isnan(tn[0]));
  EXPECT_FALSE(std::isnan(tn[1]));
  EXPECT_TRUE(std::isnan(tn[2]));
  const double nan_d = std::numeric_limits<double>::quiet_NaN();
  double tnd = 0;
  kernels::fast::tanh_row(&nan_d, &tnd, 1);
  EXPECT_TRUE(std::isnan(tnd));
}

// kernels::fast::additive_scores straight against a long double loop: the float
// fast path (exp(2 fq) exp(2 fk)) holds the score to 3e-7 sum_h |w_v| plus
// the sum's rounding; features past ±20 (the tanh path) too. Rows of
// different lengths and sizes around the 16-key vectors and 4-query groups.
TEST(AdditiveTile, ScoresMatchALongDoubleLoop) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (const int64_t hidden : {1, 7, 16, 17, 64}) {
    for (const int64_t rows : {1, 3, 4, 5, 9}) {
      // Features past kExpRange (20) on the query side, or on a few keys
      // (their blocks of 16 keys take the tanh path, the others do not; past
      // 44.4, exp(2 fk) overflows float).
      for (const auto [spread, key_spread] : {std::pair{1.0, 2.0}, {30.0, 2.0}, {1.0, 60.0}}) {
        const int64_t keys = rng.uniform_int(1, 70), ldk = (keys + 15) / 16 * 16;
        SCOPED_TRACE("H=" + std::to_string(hidden) + " rows=" + std::to_string(rows) +
                     " keys=" + std::to_string(keys) + " feature spread " + std::to_string(spread) +
                     " far keys' spread " + std::to_string(key_spread));
        std::vector<float> fq(static_cast<size_t>(rows * hidden)), wv(static_cast<size_t>(hidden));
        std::vector<float> fkt(static_cast<size_t>(hidden * ldk), 0.0f);
        for (float& x : fq) x = static_cast<float>(rng.uniform(-spread, spread));
        for (float& x : wv) x = static_cast<float>(rng.uniform(-1.5, 1.5));
        for (int64_t h = 0; h < hidden; ++h) {
          for (int64_t j = 0; j < keys; ++j) {
            const double far = j % 19 == 5 ? key_spread : 2.0;
            fkt[h * ldk + j] = static_cast<float>(rng.uniform(-far, far));
          }
        }
        std::vector<int64_t> lens(static_cast<size_t>(rows));
        for (int64_t& l : lens) l = rng.uniform_int(0, keys);
        lens[0] = keys;
        const float sentinel = -12345.0f;
        std::vector<float> s(static_cast<size_t>(rows * ldk), sentinel);
        std::vector<float> ekt(fkt.size());
        std::vector<uint8_t> block_ok(static_cast<size_t>(ldk / kernels::fast::kAdditivePad));
        kernels::fast::additive_key_exps(fkt.data(), hidden, ldk, ekt.data(), block_ok.data());
        const kernels::fast::AdditiveFeatures<float> f{
            fq.data(), hidden, fkt.data(), ldk, wv.data(), hidden, ekt.data(), block_ok.data()};
        std::vector<double> scratch(kernels::fast::additive_scores_scratch_words<float>(hidden));
        kernels::fast::additive_scores(f, rows, lens.data(), s.data(), ldk, scratch.data());
        double wv_abs = 0;
        for (const float w : wv) wv_abs += std::fabs(w);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < ldk; ++j) {
            const float got = s[static_cast<size_t>(r * ldk + j)];
            if (j >= lens[r]) {
              ASSERT_EQ(got, sentinel) << "wrote past the length: q=" << r << " k=" << j;
              continue;
            }
            long double ref = 0;
            for (int64_t h = 0; h < hidden; ++h) {
              ref += static_cast<long double>(wv[h]) *
                     std::tanh(static_cast<long double>(fq[r * hidden + h]) +
                               static_cast<long double>(fkt[h * ldk + j]));
            }
            ASSERT_NEAR(got, static_cast<double>(ref), 4e-7 * wv_abs + 1e-6)
                << "q=" << r << " k=" << j;
          }
        }
      }
    }
  }
}

// Tile edges of the fused kernels, forward and backward against the
// reference: query counts around the 4-query groups and 64-query blocks, key
// counts around the 16-key vectors and the backward's key chunks, H = 1 and H
// around the lane count, per-query lengths that vary inside a group.
TYPED_TEST(Additive, FusedTileEdges) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t queries[] = {1, 4, 5, 63, 65, 130};
  const int64_t keys[] = {1, 15, 16, 17, 33, 100, 257};
  const int64_t hiddens[] = {1, 15, 16, 17, 64};
  int n = 0;
  for (const int64_t nq : queries) {
    for (const int64_t nk : keys) {
      Case c;
      c.batch = 2;
      c.nq = nq;
      c.nk = nk;
      c.dq = 3 + n % 4;
      c.dk = 2 + n % 3;
      c.dv = 1 + n % 5;
      c.hidden = hiddens[n % 5];
      c.lens_form = n % 3 == 0 ? LensForm::kPerBatch : LensForm::kPerQuery;
      if (n % 4 == 1) {
        c.dropout = 0.3;
        c.training = true;
      }
      ++n;
      check_forward<AdditiveScoring, T>(rng, c);
      check_backward<AdditiveScoring, T>(rng, c);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// The fast kernels called directly, as the front end calls them, on a
// workspace of exactly the size their query asks for between guard words:
// the guards stay untouched; the workspace starts as NaN (the front end's
// zeroed vector would hide a slice read before it is written); the results
// are bitwise those of the public call and close to the reference. Odd
// shapes, weights wanted or not, dropout, slots for 1 thread (one slot, so
// any overrun of it reaches the trailing guard) and for 3.
TYPED_TEST(Additive, WorkspaceSizeIsHonoured) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  constexpr size_t kGuard = 32;
  const double guard = -1.2345678e300;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // Runs `kernel` on a workspace of `size` doubles and checks the guards.
  const auto run_guarded = [&](size_t size, int threads, const auto& kernel) {
    std::vector<double> buf(size + 2 * kGuard, nan);
    std::fill_n(buf.begin(), kGuard, guard);
    std::fill_n(buf.end() - kGuard, kGuard, guard);
    kernel(kernels::Workspace{buf.data() + kGuard, threads});
    for (size_t g = 0; g < kGuard; ++g) {
      EXPECT_EQ(std::memcmp(&buf[g], &guard, sizeof guard), 0)
          << "guard word " << kGuard - g << " before the workspace was written";
      EXPECT_EQ(std::memcmp(&buf[kGuard + size + g], &guard, sizeof guard), 0)
          << "guard word " << g << " after the workspace (" << size << " doubles) was written";
    }
  };
  struct Dims {
    int64_t batch, nq, nk, hidden;
  };
  const Dims shapes[] = {
      {1, 1, 1, 1}, {2, 5, 17, 13}, {3, 65, 37, 17}, {1, 70, 100, 7}, {2, 3, 130, 16}};
  int n = 0;
  for (const Dims& s : shapes) {
    for (const bool return_weights : {false, true}) {
      for (const double dropout : {0.0, 0.3}) {
        Case c;
        c.batch = s.batch;
        c.nq = s.nq;
        c.nk = s.nk;
        c.hidden = s.hidden;
        c.dq = 3 + n % 3;
        c.dk = 2 + n % 4;
        c.dv = 1 + n % 3;
        c.lens_form = static_cast<LensForm>(n % 3);
        c.dropout = dropout;
        c.training = dropout > 0.0;
        c.return_weights = return_weights;
        ++n;
        SCOPED_TRACE(AdditiveScoring::describe(c));
        const Inputs<AdditiveScoring, T> in(rng, c);
        const Tensor<T>&w_q = in.params[0], &w_k = in.params[1], &w_v = in.params[2];
        const ValidLens lens = in.valid_lens();
        const AttentionOptions opt = c.options(rng.next());
        const kernels::AttentionConfig config{lens, 1.0, dropout, opt.seed};
        const kernels::AdditiveParams<T> params{w_q.view(), w_k.view(), w_v.view()};
        const Tensor<T> d_out = random_tensor<T>(rng, {c.batch, c.nq, c.dv});
        const Tensor<double> qd = cast<double>(in.q), kd = cast<double>(in.k),
                             vd = cast<double>(in.v), wqd = cast<double>(w_q),
                             wkd = cast<double>(w_k), wvd = cast<double>(w_v);
        const AttentionResult<double> ref =
            ref::additive_attention(qd, kd, vd, {wqd, wkd, wvd}, lens, opt);
        const AdditiveGrads<double> ref_g = ref::additive_attention_backward(
            qd, kd, vd, {wqd, wkd, wvd}, lens, opt, {ref.output, ref.lse}, cast<double>(d_out));
        for (const int threads : {1, 3}) {
          SCOPED_TRACE("workspace for " + std::to_string(threads) + " threads");
          const ThreadCount count(threads);
          const T t_nan = std::numeric_limits<T>::quiet_NaN();
          Tensor<T> out(Shape{c.batch, c.nq, c.dv}, t_nan), lse(Shape{c.batch, c.nq}, t_nan);
          Tensor<T> weights(Shape{c.batch, c.nq, c.nk}, t_nan);
          const kernels::ForwardViews<T> views{
              out.view(), return_weights ? weights.view() : TensorView<T>(), lse.view()};
          run_guarded(kernels::fast::additive_workspace_size<T>(in.q, in.k, in.v, params, config,
                                                                views, threads),
                      threads, [&](kernels::Workspace ws) {
                        kernels::fast::additive<T>(in.q, in.k, in.v, params, config, views, ws);
                      });
          const AttentionResult<T> pub =
              additive_attention(in.q, in.k, in.v, {w_q, w_k, w_v}, lens, opt);
          EXPECT_TRUE(bitwise_equal(out, pub.output, "output vs the public call", "b q d"));
          expect_close(out, ref.output, kTol<T>.out, "output", "b q d");
          expect_close(lse, ref.lse, kTol<T>.lse, "lse", "b q");
          if (return_weights) {
            EXPECT_TRUE(bitwise_equal(weights, pub.weights, "weights vs the public call", "b q k"));
            expect_close(weights, ref.weights, kTol<T>.weights, "weights", "b q k");
          }

          AdditiveGrads<T> g{Tensor<T>(in.q.shape(), t_nan), Tensor<T>(in.k.shape(), t_nan),
                             Tensor<T>(in.v.shape(), t_nan), Tensor<T>(w_q.shape(), t_nan),
                             Tensor<T>(w_k.shape(), t_nan),  Tensor<T>(w_v.shape(), t_nan)};
          const kernels::SavedViews<T> saved{out.view(), lse.view()};
          const kernels::AdditiveGradViews<T> grads{g.d_queries.view(), g.d_keys.view(),
                                                    g.d_values.view(),  g.d_w_q.view(),
                                                    g.d_w_k.view(),     g.d_w_v.view()};
          run_guarded(kernels::fast::additive_backward_workspace_size<T>(
                          in.q, in.k, in.v, params, config, saved, d_out, grads, threads),
                      threads, [&](kernels::Workspace ws) {
                        kernels::fast::additive_backward<T>(in.q, in.k, in.v, params, config, saved,
                                                            d_out, grads, ws);
                      });
          const AdditiveGrads<T> pub_g = additive_attention_backward(
              in.q, in.k, in.v, {w_q, w_k, w_v}, lens, opt, {out, lse}, d_out);
          EXPECT_TRUE(bitwise_equal(g.d_queries, pub_g.d_queries, "d_queries vs public", "b q d"));
          EXPECT_TRUE(bitwise_equal(g.d_keys, pub_g.d_keys, "d_keys vs public", "b k d"));
          EXPECT_TRUE(bitwise_equal(g.d_values, pub_g.d_values, "d_values vs public", "b k d"));
          EXPECT_TRUE(bitwise_equal(g.d_w_q, pub_g.d_w_q, "d_w_q vs public", "h d"));
          EXPECT_TRUE(bitwise_equal(g.d_w_k, pub_g.d_w_k, "d_w_k vs public", "h d"));
          EXPECT_TRUE(bitwise_equal(g.d_w_v, pub_g.d_w_v, "d_w_v vs public", "h"));
          expect_close(g.d_queries, ref_g.d_queries, kTol<T>.grad, "d_queries", "b q d");
          expect_close(g.d_keys, ref_g.d_keys, kTol<T>.grad, "d_keys", "b k d");
          expect_close(g.d_values, ref_g.d_values, kTol<T>.grad, "d_values", "b k d");
          expect_close(g.d_w_q, ref_g.d_w_q, kTol<T>.grad, "d_w_q", "h d");
          expect_close(g.d_w_k, ref_g.d_w_k, kTol<T>.grad, "d_w_k", "h d");
          expect_close(g.d_w_v, ref_g.d_w_v, kTol<T>.grad, "d_w_v", "h");
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  }
}

// Features far outside ±20 (weights scaled up) take the exact tanh path
// inside the fused kernels; forward and backward still match the reference.
TYPED_TEST(Additive, LargeFeatures) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (const double scale : {12.0, 40.0}) {
    Case c;
    c.nq = 37;
    c.nk = 50;
    c.dq = 6;
    c.dk = 5;
    c.dv = 3;
    c.hidden = 20;
    c.lens_form = LensForm::kPerQuery;
    SCOPED_TRACE(AdditiveScoring::describe(c) + ", W_q and W_k scaled by " + std::to_string(scale));
    Inputs<AdditiveScoring, T> in(rng, c);
    Tensor<T>&w_q = in.params[0], &w_k = in.params[1], &w_v = in.params[2];
    // Half the hidden units get features of tens; the rest stay of order 1.
    for (int64_t h = 0; h < c.hidden; h += 2) {
      for (int64_t d = 0; d < c.dq; ++d) w_q(h, d) *= static_cast<T>(scale);
      for (int64_t d = 0; d < c.dk; ++d) w_k(h, d) *= static_cast<T>(scale);
    }
    const ValidLens lens = in.valid_lens();
    const AttentionOptions opt = c.options(0);
    const Tensor<T> d_out = random_tensor<T>(rng, {c.batch, c.nq, c.dv});
    const AttentionResult<T> fast =
        additive_attention(in.q, in.k, in.v, {w_q, w_k, w_v}, lens, opt);
    const Tensor<double> qd = cast<double>(in.q), kd = cast<double>(in.k), vd = cast<double>(in.v),
                         wqd = cast<double>(w_q), wkd = cast<double>(w_k), wvd = cast<double>(w_v);
    const AttentionResult<double> ref =
        ref::additive_attention(qd, kd, vd, {wqd, wkd, wvd}, lens, opt);
    expect_close(fast.output, ref.output, kTol<T>.out, "output", "b q d");
    expect_close(fast.lse, ref.lse, kTol<T>.lse, "lse", "b q");
    const AdditiveGrads<T> g = additive_attention_backward(in.q, in.k, in.v, {w_q, w_k, w_v}, lens,
                                                           opt, {fast.output, fast.lse}, d_out);
    const AdditiveGrads<double> gr = ref::additive_attention_backward(
        qd, kd, vd, {wqd, wkd, wvd}, lens, opt, {ref.output, ref.lse}, cast<double>(d_out));
    expect_close(g.d_queries, gr.d_queries, kTol<T>.grad, "d_queries", "b q d");
    expect_close(g.d_keys, gr.d_keys, kTol<T>.grad, "d_keys", "b k d");
    expect_close(g.d_values, gr.d_values, kTol<T>.grad, "d_values", "b k d");
    expect_close(g.d_w_q, gr.d_w_q, kTol<T>.grad, "d_w_q", "h d");
    expect_close(g.d_w_k, gr.d_w_k, kTol<T>.grad, "d_w_k", "h d");
    expect_close(g.d_w_v, gr.d_w_v, kTol<T>.grad, "d_w_v");
  }
}

// With per-query lengths, a NaN key that one query may see does not reach a
// neighbouring query (same 4-query group, same 16-key vector) that may not:
// that query's output, lse and d_queries equal those of a run with the key
// clean.
TYPED_TEST(Additive, NaNKeySeenByOneQueryOnly) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t nq = 8, nk = 40, dq = 5, dk = 4, dv = 3, hidden = 12;
  const Tensor<T> q = random_tensor<T>(rng, {1, nq, dq}), k = random_tensor<T>(rng, {1, nk, dk}),
                  v = random_tensor<T>(rng, {1, nk, dv});
  const Tensor<T> w_q = random_tensor<T>(rng, {hidden, dq}),
                  w_k = random_tensor<T>(rng, {hidden, dk}), w_v = random_tensor<T>(rng, {hidden});
  const Tensor<T> d_out = random_tensor<T>(rng, {1, nq, dv});
  // Even queries see 37 keys, odd ones 20; key 30 is NaN.
  Tensor<int64_t> lens(Shape{1, nq});
  for (int64_t i = 0; i < nq; ++i) lens(0, i) = i % 2 == 0 ? 37 : 20;
  Tensor<T> k_nan = k;
  for (int64_t d = 0; d < dk; ++d) k_nan(0, 30, d) = std::numeric_limits<T>::quiet_NaN();
  AttentionOptions opt;
  opt.return_lse = true;
  const ValidLens vl(lens);
  const AttentionResult<T> clean = additive_attention(q, k, v, {w_q, w_k, w_v}, vl, opt);
  const AttentionResult<T> dirty = additive_attention(q, k_nan, v, {w_q, w_k, w_v}, vl, opt);
  const AdditiveGrads<T> g_clean = additive_attention_backward(q, k, v, {w_q, w_k, w_v}, vl, opt,
                                                               {clean.output, clean.lse}, d_out);
  const AdditiveGrads<T> g_dirty = additive_attention_backward(
      q, k_nan, v, {w_q, w_k, w_v}, vl, opt, {dirty.output, dirty.lse}, d_out);
  // The clean and the dirty run may take different paths through the tile
  // (a NaN feature sends its 16 keys down the exact tanh path), so compare
  // within the float tolerances: a leak would give NaN.
  for (int64_t i = 0; i < nq; ++i) {
    if (i % 2 == 0) {
      EXPECT_TRUE(std::isnan(dirty.output(0, i, 0))) << "query " << i << " sees the NaN key";
      continue;
    }
    const Tol lse_tol = kTol<T>.lse, out_tol = kTol<T>.out, grad_tol = kTol<T>.grad;
    const auto close = [](double got, double want, const Tol& tol) {
      return std::fabs(got - want) <= tol.atol + tol.rtol * std::fabs(want);
    };
    EXPECT_TRUE(close(dirty.lse(0, i), clean.lse(0, i), lse_tol))
        << "lse of query " << i << ": " << dirty.lse(0, i) << " vs " << clean.lse(0, i);
    for (int64_t d = 0; d < dv; ++d) {
      EXPECT_TRUE(close(dirty.output(0, i, d), clean.output(0, i, d), out_tol))
          << "output q=" << i << " d=" << d << ": " << dirty.output(0, i, d) << " vs "
          << clean.output(0, i, d);
    }
    for (int64_t d = 0; d < dq; ++d) {
      EXPECT_TRUE(close(g_dirty.d_queries(0, i, d), g_clean.d_queries(0, i, d), grad_tol))
          << "d_queries q=" << i << " d=" << d << ": " << g_dirty.d_queries(0, i, d) << " vs "
          << g_clean.d_queries(0, i, d);
    }
  }
}

// ---- bad input (the rest is in test_attention.cc's AttentionErrors) ------------

constexpr const char* kFn = AdditiveScoring::kFunction;
constexpr const char* kFnBackward = AdditiveScoring::kFunctionBackward;

TEST(AdditiveErrors, ParameterShapes) {
  const ErrorFixture<AdditiveScoring> f;
  const AttentionOptions opt;
  // W_q (H, Dq): wrong Dq, wrong rank.
  const Tensor<float> wq_dq(Shape{7, 13}), wq_rank(Shape{7}), wq_rank3(Shape{1, 7, 4});
  // W_k (H, Dk): wrong Dk, H differing from W_q's.
  const Tensor<float> wk_dk(Shape{7, 10}), wk_h(Shape{12, 3});
  // w_v (H) or (1, H): wrong H, (2, H), (H, 1), rank 3.
  const Tensor<float> wv_h(Shape{6}), wv_rows(Shape{2, 7}), wv_col(Shape{7, 1}),
      wv_rank3(Shape{1, 1, 7});
  // Parameters 0, 1, 2: W_q, W_k, w_v (arguments 3, 4, 5).
  auto with = [&](int which, const Tensor<float>& t) { return f.with(3 + which, t); };
  expect_forward_error<AdditiveScoring>(with(0, wq_dq), {}, opt, {kFn, "w_q", "13"});
  expect_forward_error<AdditiveScoring>(with(0, wq_rank), {}, opt, {kFn, "w_q", "[7]"});
  expect_forward_error<AdditiveScoring>(with(0, wq_rank3), {}, opt, {kFn, "w_q", "[1, 7, 4]"});
  expect_forward_error<AdditiveScoring>(with(1, wk_dk), {}, opt, {kFn, "w_k", "10"});
  expect_forward_error<AdditiveScoring>(with(1, wk_h), {}, opt, {kFn, "w_k", "12"});
  expect_forward_error<AdditiveScoring>(with(2, wv_h), {}, opt, {kFn, "w_v", "6"});
  expect_forward_error<AdditiveScoring>(with(2, wv_rows), {}, opt, {kFn, "w_v", "[2, 7]"});
  expect_forward_error<AdditiveScoring>(with(2, wv_col), {}, opt, {kFn, "w_v", "[7, 1]"});
  expect_forward_error<AdditiveScoring>(with(2, wv_rank3), {}, opt, {kFn, "w_v", "[1, 1, 7]"});
  // The backward validates the parameters like the forward.
  expect_error(
      [&] {
        const Args<float> a = with(1, wk_dk);
        additive_attention_backward(a.q, a.k, a.v, {a.params[0], a.params[1], a.params[2]}, {}, opt,
                                    {f.out, f.lse}, f.d_out);
      },
      {kFnBackward, "w_k", "10"});
}

// Additive attention has no scale: setting one is an error, forward and backward.
TEST(AdditiveErrors, Scale) {
  const ErrorFixture<AdditiveScoring> f;
  AttentionOptions scaled;
  scaled.scale = 0.5;
  expect_forward_error<AdditiveScoring>(f.in.args(), {}, scaled, {kFn, "scale"});
  scaled.scale = 2.0;
  const Tensors<float>& in = f.in;
  expect_error(
      [&] {
        additive_attention_backward(in.q, in.k, in.v, {in.params[0], in.params[1], in.params[2]},
                                    {}, scaled, {f.out, f.lse}, f.d_out);
      },
      {kFnBackward, "scale"});
}

}  // namespace
}  // namespace qkv::test
