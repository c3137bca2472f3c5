// GoogleTest suite of additive attention (qkv/attention.h): the chapter's
// worked example, the fast version against qkv::ref and both against the
// plain loops of attention_testing.h over many shapes (Dq != Dk, H != Dq, w_v
// as (H) and (1, H)), masking, dropout, the lse merge identity, the write-into
// form, strided inputs and parameters, thread-count determinism, gradients
// (reference and finite differences for all six), the fused kernels' pieces
// (tanh accuracy, tile scores, tile edges, large features, NaN keys seen by
// one query only) and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <source_location>
#include <sstream>
#include <string>
#include <vector>

#include "attention_testing.h"
#include "kernels/additive_tile.h"
#include "test_util.h"
#include "tolerances.h"

namespace qkv::test {
namespace {

template <class T>
class Additive : public ::testing::Test {};
using ElementTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Additive, ElementTypes, TypeNames);

template <class T>
constexpr Tol kOut = tol_for<T>(kAdditive, kAdditiveDouble);
template <class T>
constexpr Tol kWeights = tol_for<T>(kAdditiveWeights, kSoftmaxDouble);
// lse of additive scores: the score error of kAdditive plus the log-sum-exp.
template <class T>
constexpr Tol kLse = tol_for<T>(kAdditive, kAdditiveDouble);
template <class T>
constexpr Tol kGrad = tol_for<T>(kAdditiveBackward, kAdditiveBackwardDouble);

// One additive attention problem.
struct Case {
  int64_t batch = 2, nq = 3, nk = 5, dq = 4, dk = 3, dv = 2, hidden = 6;
  bool wv_row = false;  // w_v given as (1, H) instead of (H)
  LensForm lens_form = LensForm::kNone;
  bool lens32 = false;
  double dropout = 0.0;
  bool training = false;
  bool want_weights = true, want_lse = true;
  bool strided = false;  // inputs and parameters in non-contiguous memory

  Shape wv_shape() const { return wv_row ? Shape{1, hidden} : Shape{hidden}; }
  AttentionOptions options(uint64_t seed) const {
    AttentionOptions o;
    o.dropout = dropout;
    o.training = training;
    o.seed = seed;
    o.want_weights = want_weights;
    o.want_lse = want_lse;
    return o;
  }
  NaiveDropout naive_dropout(uint64_t seed) const { return {dropout, training, seed}; }
  std::string str() const {
    std::ostringstream os;
    os << "B=" << batch << " Nq=" << nq << " Nk=" << nk << " Dq=" << dq << " Dk=" << dk
       << " Dv=" << dv << " H=" << hidden << ", w_v " << wv_shape().str() << ", "
       << to_string(lens_form) << (lens32 ? " int32" : " int64") << ", dropout " << dropout
       << (training ? " training" : " eval") << ", want_weights " << want_weights << ", want_lse "
       << want_lse << (strided ? ", strided" : ", contiguous");
    return os.str();
  }
};

// Random inputs and parameters of a case, owned contiguously, plus the views
// the calls get.
template <class T>
struct Inputs {
  Tensor<T> q, k, v, w_q, w_k, w_v;
  OwnedLens lens;
  std::vector<std::unique_ptr<Strided<T>>> strided;
  ConstView<T> qv, kv, vv, wqv, wkv, wvv;

  Inputs(Rng& rng, const Case& c) {
    q = random_tensor<T>(rng, {c.batch, c.nq, c.dq});
    k = random_tensor<T>(rng, {c.batch, c.nk, c.dk});
    v = random_tensor<T>(rng, {c.batch, c.nk, c.dv});
    // Features W_q q + W_k k of order 1 so tanh is neither linear nor flat.
    const double bq = 2.0 / std::sqrt(double(c.dq)), bk = 2.0 / std::sqrt(double(c.dk));
    w_q = random_tensor<T>(rng, {c.hidden, c.dq}, -bq, bq);
    w_k = random_tensor<T>(rng, {c.hidden, c.dk}, -bk, bk);
    w_v = random_tensor<T>(rng, c.wv_shape(), -1.5, 1.5);
    lens = make_lens(rng, c.lens_form, c.lens32, c.batch, c.nq, c.nk);
    ConstView<T>* views[] = {&qv, &kv, &vv, &wqv, &wkv, &wvv};
    const Tensor<T>* owned[] = {&q, &k, &v, &w_q, &w_k, &w_v};
    for (int n = 0; n < 6; ++n) {
      *views[n] = *owned[n];
      if (!c.strided) continue;
      typename Strided<T>::Layout layout;
      layout.step = 1 + n % 3;
      layout.pad = n % 2;
      layout.offset = n;
      layout.reversed = n % 2 == 1;  // e.g. W_k stored transposed
      strided.push_back(std::make_unique<Strided<T>>(owned[n]->view(), layout));
      *views[n] = strided.back()->const_view();
    }
  }
  ValidLens valid_lens() const { return lens.get(); }
};

// Forward: fast (T) vs ref (double), ref (double) vs the plain loop, ref (T)
// vs the plain loop; the want_* flags; exact masking.
template <class T>
void check_forward(Rng& rng, const Case& c) {
  SCOPED_TRACE(c.str());
  const Inputs<T> in(rng, c);
  const ValidLens lens = in.valid_lens();
  const uint64_t seed = rng.next();
  const AttentionOptions opt = c.options(seed);

  const AttentionResult<T> fast =
      additive_attention(in.qv, in.kv, in.vv, {in.wqv, in.wkv, in.wvv}, lens, opt);
  const Tensor<double> qd = cast<double>(in.qv), kd = cast<double>(in.kv), vd = cast<double>(in.vv),
                       wqd = cast<double>(in.wqv), wkd = cast<double>(in.wkv),
                       wvd = cast<double>(in.wvv);
  const AttentionResult<double> ref =
      ref::additive_attention(qd, kd, vd, {wqd, wkd, wvd}, lens, opt);
  const AttentionResult<T> ref_t =
      ref::additive_attention(in.qv, in.kv, in.vv, {in.wqv, in.wkv, in.wvv}, lens, opt);
  const NaiveForward loop =
      naive_additive<T>(in.qv, in.kv, in.vv, in.wqv, in.wkv, in.wvv, lens, c.naive_dropout(seed));
  const Tensor<double> loop_out = as_tensor({c.batch, c.nq, c.dv}, loop.out);
  const Tensor<double> loop_w = as_tensor({c.batch, c.nq, c.nk}, loop.weights);
  const Tensor<double> loop_lse = as_tensor({c.batch, c.nq}, loop.lse);

  ASSERT_EQ(fast.output.shape(), Shape({c.batch, c.nq, c.dv}));
  if (c.want_weights) {
    ASSERT_EQ(fast.weights.shape(), Shape({c.batch, c.nq, c.nk}));
  } else {
    EXPECT_TRUE(fast.weights.empty()) << "weights returned although want_weights is off";
  }
  if (c.want_lse) {
    ASSERT_EQ(fast.lse.shape(), Shape({c.batch, c.nq}));
  } else {
    EXPECT_TRUE(fast.lse.empty()) << "lse returned although want_lse is off";
  }
  ASSERT_EQ(ref.weights.shape(), Shape({c.batch, c.nq, c.nk}));
  ASSERT_EQ(ref.lse.shape(), Shape({c.batch, c.nq}));
  ASSERT_EQ(ref_t.weights.shape(), Shape({c.batch, c.nq, c.nk}));
  ASSERT_EQ(ref_t.lse.shape(), Shape({c.batch, c.nq}));

  expect_close(fast.output, ref.output, kOut<T>, "fast output vs ref", "b q d");
  if (c.want_weights) expect_close(fast.weights, ref.weights, kWeights<T>, "fast weights vs ref");
  if (c.want_lse) expect_close(fast.lse, ref.lse, kLse<T>, "fast lse vs ref", "b q");
  expect_close(ref.output, loop_out, kAdditiveDouble, "ref output vs loop", "b q d");
  expect_close(ref.weights, loop_w, kSoftmaxDouble, "ref weights vs loop");
  expect_close(ref.lse, loop_lse, kAdditiveDouble, "ref lse vs loop", "b q");
  expect_close(ref_t.output, loop_out, kOut<T>, "ref<T> output vs loop", "b q d");
  expect_close(ref_t.weights, loop_w, kWeights<T>, "ref<T> weights vs loop");
  expect_close(ref_t.lse, loop_lse, kLse<T>, "ref<T> lse vs loop", "b q");

  expect_exact_masking(fast.output, fast.weights, fast.lse, in.lens, c.nk, "fast");
  expect_exact_masking(ref.output, ref.weights, ref.lse, in.lens, c.nk, "ref");
}

const int64_t kSizes[] = {1, 3, 17, 64, 65, 129, 300};
const int64_t kQueryDims[] = {1, 2, 7, 16, 20};
const int64_t kKeyDims[] = {2, 1, 5, 9, 3};
const int64_t kHidden[] = {8, 5, 1, 33, 16};
const int64_t kValueDims[] = {3, 1, 16, 5, 4};

TYPED_TEST(Additive, ChapterExample) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  // keys: ones (2, 10, 2); values: arange(40) as (1, 10, 4) repeated for 2
  // batches; valid_lens [2, 6]; queries ~ N(0, 1) (2, 1, 20); H = 8 with
  // parameters uniform in ±1/sqrt(fan_in) like nn.Linear.
  const Tensor<T> keys(Shape{2, 10, 2}, T(1));
  Tensor<T> values(Shape{2, 10, 4});
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t j = 0; j < 10; ++j) {
      for (int64_t d = 0; d < 4; ++d) values(b, j, d) = static_cast<T>(4 * j + d);
    }
  }
  const Tensor<T> queries = normal_tensor<T>(rng, {2, 1, 20});
  const Tensor<T> w_q = random_tensor<T>(rng, {8, 20}, -1 / std::sqrt(20.0), 1 / std::sqrt(20.0));
  const Tensor<T> w_k = random_tensor<T>(rng, {8, 2}, -1 / std::sqrt(2.0), 1 / std::sqrt(2.0));
  const Tensor<T> w_v = random_tensor<T>(rng, {1, 8}, -1 / std::sqrt(8.0), 1 / std::sqrt(8.0));
  const Tensor<int64_t> lens(Shape{2}, std::vector<int64_t>{2, 6});
  // Mean of rows 0-1 and of rows 0-5 of arange(40).reshape(10, 4).
  const Tensor<double> expected = as_tensor({2, 1, 4}, {2, 3, 4, 5, 10, 11, 12, 13});
  Tensor<double> expected_w(Shape{2, 1, 10});
  for (int64_t j = 0; j < 2; ++j) expected_w(0, 0, j) = 0.5;
  for (int64_t j = 0; j < 6; ++j) expected_w(1, 0, j) = 1.0 / 6.0;
  AttentionOptions opt;
  opt.want_weights = true;
  opt.dropout = 0.1;  // AdditiveAttention(..., dropout=0.1) in eval mode
  const Tol tol = tol_for<T>(kAverage, kPoolingDouble);
  const AttentionResult<T> fast =
      additive_attention(queries, keys, values, {w_q, w_k, w_v}, lens, opt);
  const AttentionResult<T> ref =
      ref::additive_attention(queries, keys, values, {w_q, w_k, w_v}, lens, opt);
  expect_close(fast.output, expected, tol, "fast output", "b q d");
  expect_close(fast.weights, expected_w, kWeights<T>, "fast weights");
  expect_close(ref.output, expected, tol, "ref output", "b q d");
  expect_close(ref.weights, expected_w, kWeights<T>, "ref weights");
}

TYPED_TEST(Additive, FastMatchesRefAndLoopOverShapes) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  int n = 0;
  for (int ia = 0; ia < 7; ++ia) {
    for (int ib = 0; ib < 7; ++ib, ++n) {
      Case c;
      c.nq = kSizes[ia];
      c.nk = kSizes[ib];
      c.dq = kQueryDims[(ia + ib) % 5];
      c.dk = kKeyDims[(2 * ia + ib) % 5];
      c.hidden = kHidden[(ia + 3 * ib) % 5];
      c.dv = kValueDims[(ia + 2 * ib) % 5];
      c.batch = n % 3 == 0 ? 1 : 2;
      c.wv_row = n % 2 == 0;
      c.lens_form = kAllLensForms[(ia + 2 * ib) % 3];
      c.lens32 = n % 4 == 1;
      c.want_weights = n % 4 < 2;
      c.want_lse = n % 2 == 1;
      check_forward<T>(rng, c);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

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
  c.lens_form = LensForm::kPerQuery;
  const Inputs<T> in(rng, c);
  const Tensor<T> wv_row = in.w_v.reshaped({1, c.hidden});
  const AttentionOptions opt = c.options(0);
  const AttentionResult<T> a =
      additive_attention(in.q, in.k, in.v, {in.w_q, in.w_k, in.w_v}, in.valid_lens(), opt);
  const AttentionResult<T> b =
      additive_attention(in.q, in.k, in.v, {in.w_q, in.w_k, wv_row}, in.valid_lens(), opt);
  expect_close(a.output, b.output, kOut<T>, "w_v (H) vs (1, H) output", "b q d");
  expect_close(a.weights, b.weights, kWeights<T>, "w_v (H) vs (1, H) weights");
}

// Key positions at or past every query's valid length are never read (DESIGN
// §3: masked positions are never read): NaN keys and values there change
// nothing, forward or backward, and their gradients are exactly 0.
TYPED_TEST(Additive, MaskedKeysAreNeverRead) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (const int64_t nk : {5, 70, 200}) {
    Case c;
    c.batch = 3;
    c.nq = 6;
    c.nk = nk;
    c.dq = 7;
    c.dk = 4;
    c.hidden = 9;
    c.dv = 5;
    c.lens_form = LensForm::kPerBatch;
    c.dropout = 0.2;
    c.training = true;
    SCOPED_TRACE(c.str());
    const Inputs<T> in(rng, c);
    const ValidLens lens = in.valid_lens();
    Tensor<T> k_nan = in.k, v_nan = in.v;
    for (int64_t b = 0; b < c.batch; ++b) {
      for (int64_t j = in.lens.at(b, 0, nk); j < nk; ++j) {
        for (int64_t d = 0; d < c.dk; ++d) k_nan(b, j, d) = nan;
        for (int64_t d = 0; d < c.dv; ++d) v_nan(b, j, d) = nan;
      }
    }
    const AttentionOptions opt = c.options(rng.next());
    const Tensor<T> d_out = random_tensor<T>(rng, {c.batch, c.nq, c.dv});
    const AttentionResult<T> clean =
        additive_attention(in.q, in.k, in.v, {in.w_q, in.w_k, in.w_v}, lens, opt);
    const AttentionResult<T> fast =
        additive_attention(in.q, k_nan, v_nan, {in.w_q, in.w_k, in.w_v}, lens, opt);
    const AttentionResult<T> ref =
        ref::additive_attention(in.q, k_nan, v_nan, {in.w_q, in.w_k, in.w_v}, lens, opt);
    expect_close(fast.output, clean.output, kOut<T>, "fast output, NaN past L", "b q d");
    expect_close(fast.lse, clean.lse, kLse<T>, "fast lse, NaN past L", "b q");
    expect_close(ref.output, clean.output, kOut<T>, "ref output, NaN past L", "b q d");
    const AdditiveGrads<T> g_clean = additive_attention_backward(
        in.q, in.k, in.v, {in.w_q, in.w_k, in.w_v}, lens, opt, {clean.output, clean.lse}, d_out);
    const AdditiveGrads<T> g_fast = additive_attention_backward(
        in.q, k_nan, v_nan, {in.w_q, in.w_k, in.w_v}, lens, opt, {fast.output, fast.lse}, d_out);
    const AdditiveGrads<T> g_ref = ref::additive_attention_backward(
        in.q, k_nan, v_nan, {in.w_q, in.w_k, in.w_v}, lens, opt, {ref.output, ref.lse}, d_out);
    for (const AdditiveGrads<T>* g : {&g_fast, &g_ref}) {
      SCOPED_TRACE(g == &g_fast ? "fast" : "ref");
      expect_close(g->d_queries, g_clean.d_queries, kGrad<T>, "d_queries, NaN past L", "b q d");
      expect_close(g->d_keys, g_clean.d_keys, kGrad<T>, "d_keys, NaN past L", "b k d");
      expect_close(g->d_values, g_clean.d_values, kGrad<T>, "d_values, NaN past L", "b k d");
      expect_close(g->d_w_q, g_clean.d_w_q, kGrad<T>, "d_w_q, NaN past L", "h d");
      expect_close(g->d_w_k, g_clean.d_w_k, kGrad<T>, "d_w_k, NaN past L", "h d");
      expect_close(g->d_w_v, g_clean.d_w_v, kGrad<T>, "d_w_v, NaN past L");
      for (int64_t b = 0; b < c.batch; ++b) {
        for (int64_t j = in.lens.at(b, 0, nk); j < nk; ++j) {
          for (int64_t d = 0; d < c.dk; ++d) {
            ASSERT_EQ(g->d_keys(b, j, d), T(0)) << "d_keys past L, b=" << b << " k=" << j;
          }
          for (int64_t d = 0; d < c.dv; ++d) {
            ASSERT_EQ(g->d_values(b, j, d), T(0)) << "d_values past L, b=" << b << " k=" << j;
          }
        }
      }
    }
  }
}

// Sizes of zero: Nk = 0 makes every row empty (output 0, lse -inf, zero
// gradients); H = 0 makes every score 0 (average pooling).
TYPED_TEST(Additive, ZeroSizes) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  AttentionOptions opt;
  opt.want_weights = true;
  opt.want_lse = true;
  for (const bool use_ref : {false, true}) {
    SCOPED_TRACE(use_ref ? "ref" : "fast");
    {
      SCOPED_TRACE("Nk = 0");
      const Tensor<T> q = random_tensor<T>(rng, {2, 3, 4});
      const Tensor<T> k(Shape{2, 0, 2}), v(Shape{2, 0, 5});
      const Tensor<T> w_q = random_tensor<T>(rng, {6, 4}), w_k = random_tensor<T>(rng, {6, 2}),
                      w_v = random_tensor<T>(rng, {1, 6});
      const AttentionResult<T> r = use_ref
                                       ? ref::additive_attention(q, k, v, {w_q, w_k, w_v}, {}, opt)
                                       : additive_attention(q, k, v, {w_q, w_k, w_v}, {}, opt);
      expect_close(r.output, Tensor<double>(Shape{2, 3, 5}), kExact, "output", "b q d");
      expect_close(r.lse, Tensor<double>(Shape{2, 3}, -std::numeric_limits<double>::infinity()),
                   kExact, "lse", "b q");
      const Tensor<T> d_out = random_tensor<T>(rng, {2, 3, 5});
      const AdditiveGrads<T> g =
          use_ref ? ref::additive_attention_backward(q, k, v, {w_q, w_k, w_v}, {}, opt,
                                                     {r.output, r.lse}, d_out)
                  : additive_attention_backward(q, k, v, {w_q, w_k, w_v}, {}, opt,
                                                {r.output, r.lse}, d_out);
      expect_close(g.d_queries, Tensor<double>(Shape{2, 3, 4}), kExact, "d_queries", "b q d");
      expect_close(g.d_w_q, Tensor<double>(Shape{6, 4}), kExact, "d_w_q", "h d");
      expect_close(g.d_w_k, Tensor<double>(Shape{6, 2}), kExact, "d_w_k", "h d");
      expect_close(g.d_w_v, Tensor<double>(Shape{1, 6}), kExact, "d_w_v");
    }
    {
      SCOPED_TRACE("H = 0");
      const Tensor<T> q = random_tensor<T>(rng, {2, 3, 4}), k = random_tensor<T>(rng, {2, 5, 2}),
                      v = random_tensor<T>(rng, {2, 5, 3});
      const Tensor<T> w_q(Shape{0, 4}), w_k(Shape{0, 2}), w_v(Shape{0});
      const AttentionResult<T> r = use_ref
                                       ? ref::additive_attention(q, k, v, {w_q, w_k, w_v}, {}, opt)
                                       : additive_attention(q, k, v, {w_q, w_k, w_v}, {}, opt);
      Tensor<double> mean(Shape{2, 3, 3});
      for (int64_t b = 0; b < 2; ++b) {
        for (int64_t i = 0; i < 3; ++i) {
          for (int64_t d = 0; d < 3; ++d) {
            for (int64_t j = 0; j < 5; ++j) mean(b, i, d) += double(v(b, j, d)) / 5.0;
          }
        }
      }
      expect_close(r.output, mean, tol_for<T>(kAverage, kPoolingDouble), "output", "b q d");
      expect_close(r.weights, Tensor<double>(Shape{2, 3, 5}, 0.2), kWeights<T>, "weights");
    }
  }
}

TYPED_TEST(Additive, Dropout) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  int n = 0;
  for (const double p : {0.1, 0.5, 0.9}) {
    for (const int64_t nk : {1, 17, 65}) {
      Case c;
      c.nq = kSizes[n % 6];
      c.nk = nk;
      c.dq = kQueryDims[n % 5];
      c.dk = kKeyDims[n % 5];
      c.hidden = kHidden[n % 5];
      c.dv = kValueDims[n % 5];
      c.wv_row = n % 2 == 1;
      c.dropout = p;
      c.training = true;
      c.lens_form = kAllLensForms[n % 3];
      check_forward<T>(rng, c);
      ++n;
    }
  }
}

TYPED_TEST(Additive, DropoutOnlyWhenTraining) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  Case c;
  c.nq = 10;
  c.nk = 40;
  c.dq = 7;
  c.dk = 5;
  c.hidden = 9;
  c.dv = 6;
  c.lens_form = LensForm::kPerQuery;  // 20 lengths: some rows are not empty
  const Inputs<T> in(rng, c);
  const ValidLens lens = in.valid_lens();
  auto run = [&](double p, bool training, uint64_t s) {
    AttentionOptions o = c.options(s);
    o.dropout = p;
    o.training = training;
    return additive_attention(in.q, in.k, in.v, {in.w_q, in.w_k, in.w_v}, lens, o);
  };
  const uint64_t s = rng.next();
  const AttentionResult<T> base = run(0.0, false, s);
  expect_close(run(0.5, false, s).output, base.output, kOut<T>, "eval with dropout", "b q d");
  expect_close(run(0.0, true, s).output, base.output, kOut<T>, "training with p = 0", "b q d");
  const AttentionResult<T> all = run(1.0, true, s);
  expect_close(all.output, Tensor<double>(all.output.shape()), kExact, "p = 1 output", "b q d");
  expect_close(all.weights, base.weights, kWeights<T>, "p = 1 weights (before dropout)");
  const AttentionResult<T> half = run(0.5, true, s);
  EXPECT_GT(max_abs_diff(half.output, base.output), 1e-3)
      << "training with p = 0.5 gave the output without dropout";
  EXPECT_GT(max_abs_diff(half.output, run(0.5, true, s + 1).output), 1e-3)
      << "two dropout seeds gave the same output";
}

TYPED_TEST(Additive, StridedInputsAndParameters) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int n = 0; n < 6; ++n) {
    Case c;
    c.batch = 3;
    c.nq = kSizes[n % 6];
    c.nk = kSizes[(n + 3) % 6];
    c.dq = kQueryDims[n % 5];
    c.dk = kKeyDims[n % 5];
    c.hidden = kHidden[n % 5];
    c.dv = kValueDims[n % 5];
    c.wv_row = n % 2 == 0;
    c.lens_form = kAllLensForms[n % 3];
    c.strided = true;
    if (n % 3 == 2) {
      c.dropout = 0.3;
      c.training = true;
    }
    check_forward<T>(rng, c);
  }
}

TYPED_TEST(Additive, WriteIntoCallerBuffers) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (int which = 0; which < 4; ++which) {
    Case c;
    c.nq = 5 + which;
    c.nk = 17 + 16 * which;
    c.dq = 6;
    c.dk = 3;
    c.hidden = 7;
    c.dv = 4;
    c.lens_form = kAllLensForms[which % 3];
    c.dropout = which % 2 ? 0.25 : 0.0;
    c.training = true;
    const bool give_w = which & 1, give_lse = which & 2;
    SCOPED_TRACE(c.str() + (give_w ? ", weights given" : ", no weights") +
                 (give_lse ? ", lse given" : ", no lse"));
    const Inputs<T> in(rng, c);
    const ValidLens lens = in.valid_lens();
    AttentionOptions opt = c.options(rng.next());
    opt.want_weights = !give_w;
    opt.want_lse = !give_lse;
    const int64_t guard = 4;
    const int64_t n_out = c.batch * c.nq * c.dv, n_w = c.batch * c.nq * c.nk,
                  n_lse = c.batch * c.nq;
    std::vector<T> buf_out(static_cast<size_t>(n_out + 2 * guard), nan);
    std::vector<T> buf_w(static_cast<size_t>(n_w + 2 * guard), nan);
    std::vector<T> buf_lse(static_cast<size_t>(n_lse + 2 * guard), nan);
    AttentionOutputs<T> outs;
    outs.output = TensorView<T>(buf_out.data() + guard, Shape{c.batch, c.nq, c.dv});
    if (give_w) outs.weights = TensorView<T>(buf_w.data() + guard, Shape{c.batch, c.nq, c.nk});
    if (give_lse) outs.lse = TensorView<T>(buf_lse.data() + guard, Shape{c.batch, c.nq});
    additive_attention(in.q, in.k, in.v, {in.w_q, in.w_k, in.w_v}, lens, opt, outs);
    const AttentionResult<double> ref = ref::additive_attention(
        cast<double>(in.q), cast<double>(in.k), cast<double>(in.v),
        {cast<double>(in.w_q), cast<double>(in.w_k), cast<double>(in.w_v)}, lens, opt);
    expect_close(outs.output, ref.output, kOut<T>, "written output vs ref", "b q d");
    if (give_w) expect_close(*outs.weights, ref.weights, kWeights<T>, "written weights vs ref");
    if (give_lse) expect_close(*outs.lse, ref.lse, kLse<T>, "written lse vs ref", "b q");
    for (int64_t g = 0; g < guard; ++g) {
      EXPECT_TRUE(std::isnan(buf_out[static_cast<size_t>(g)]) &&
                  std::isnan(buf_out[static_cast<size_t>(guard + n_out + g)]))
          << "wrote outside the output buffer";
    }
    if (!give_w) {
      for (const T x : buf_w) ASSERT_TRUE(std::isnan(x)) << "wrote weights that were not given";
    }
    if (!give_lse) {
      for (const T x : buf_lse) ASSERT_TRUE(std::isnan(x)) << "wrote an lse that was not given";
    }
  }
}

// Attention over disjoint key sets merges exactly into attention over all:
// lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s.
TYPED_TEST(Additive, LseMergesDisjointKeySets) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (const int64_t nk : {2, 9, 70}) {
    Case c;
    c.nq = 6;
    c.nk = nk;
    c.dq = 5;
    c.dk = 3;
    c.hidden = 7;
    c.dv = 4;
    SCOPED_TRACE(c.str());
    const Inputs<T> in(rng, c);
    std::vector<int64_t> perm(static_cast<size_t>(nk));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng.engine());
    const int64_t n1 = rng.uniform_int(1, nk - 1);
    const int64_t sizes[2] = {n1, nk - n1};
    AttentionOptions opt;
    opt.want_lse = true;
    AttentionResult<T> part[2];
    for (int s = 0; s < 2; ++s) {
      Tensor<T> ks(Shape{c.batch, sizes[s], c.dk}), vs(Shape{c.batch, sizes[s], c.dv});
      for (int64_t b = 0; b < c.batch; ++b) {
        for (int64_t t = 0; t < sizes[s]; ++t) {
          const int64_t j = perm[static_cast<size_t>(s == 0 ? t : n1 + t)];
          for (int64_t d = 0; d < c.dk; ++d) ks(b, t, d) = in.k(b, j, d);
          for (int64_t d = 0; d < c.dv; ++d) vs(b, t, d) = in.v(b, j, d);
        }
      }
      part[s] = additive_attention(in.q, ks, vs, {in.w_q, in.w_k, in.w_v}, {}, opt);
    }
    Tensor<double> merged(Shape{c.batch, c.nq, c.dv}), merged_lse(Shape{c.batch, c.nq});
    for (int64_t b = 0; b < c.batch; ++b) {
      for (int64_t i = 0; i < c.nq; ++i) {
        const double l0 = part[0].lse(b, i), l1 = part[1].lse(b, i);
        const double m = std::max(l0, l1);
        const double lse = m + std::log(std::exp(l0 - m) + std::exp(l1 - m));
        merged_lse(b, i) = lse;
        for (int64_t d = 0; d < c.dv; ++d) {
          merged(b, i, d) = std::exp(l0 - lse) * double(part[0].output(b, i, d)) +
                            std::exp(l1 - lse) * double(part[1].output(b, i, d));
        }
      }
    }
    const AttentionResult<T> full =
        additive_attention(in.q, in.k, in.v, {in.w_q, in.w_k, in.w_v}, {}, opt);
    expect_close(merged, full.output, kOut<T>, "merged output vs attention over all keys", "b q d");
    expect_close(merged_lse, full.lse, kLse<T>, "merged lse vs attention over all keys", "b q");
  }
}

// The same inputs and seed give bitwise-identical results with 1, 2 or 3
// threads.
TYPED_TEST(Additive, DeterministicAcrossThreadCounts) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  Case c;
  c.batch = 3;
  c.nq = 65;
  c.nk = 129;
  c.dq = 20;
  c.dk = 9;
  c.hidden = 33;
  c.dv = 17;
  c.lens_form = LensForm::kPerQuery;
  c.dropout = 0.2;
  c.training = true;
  const Inputs<T> in(rng, c);
  const ValidLens lens = in.valid_lens();
  const AttentionOptions opt = c.options(rng.next());
  const Tensor<T> d_out = random_tensor<T>(rng, {c.batch, c.nq, c.dv});
  AttentionResult<T> r[3];
  AdditiveGrads<T> g[3];
  for (int t = 0; t < 3; ++t) {
    const ThreadCount threads(t + 1);
    r[t] = additive_attention(in.q, in.k, in.v, {in.w_q, in.w_k, in.w_v}, lens, opt);
    g[t] = additive_attention_backward(in.q, in.k, in.v, {in.w_q, in.w_k, in.w_v}, lens, opt,
                                       {r[t].output, r[t].lse}, d_out);
  }
  for (int t = 1; t < 3; ++t) {
    SCOPED_TRACE("1 vs " + std::to_string(t + 1) + " threads");
    expect_bitwise_equal(r[0].output, r[t].output, "output", "b q d");
    expect_bitwise_equal(r[0].weights, r[t].weights, "weights");
    expect_bitwise_equal(r[0].lse, r[t].lse, "lse", "b q");
    expect_bitwise_equal(g[0].d_queries, g[t].d_queries, "d_queries", "b q d");
    expect_bitwise_equal(g[0].d_keys, g[t].d_keys, "d_keys", "b k d");
    expect_bitwise_equal(g[0].d_values, g[t].d_values, "d_values", "b k d");
    expect_bitwise_equal(g[0].d_w_q, g[t].d_w_q, "d_w_q", "h d");
    expect_bitwise_equal(g[0].d_w_k, g[t].d_w_k, "d_w_k", "h d");
    expect_bitwise_equal(g[0].d_w_v, g[t].d_w_v, "d_w_v");
  }
}

// ---- backward -------------------------------------------------------------------

template <class T>
void check_backward(Rng& rng, const Case& c) {
  SCOPED_TRACE(c.str());
  const Inputs<T> in(rng, c);
  const ValidLens lens = in.valid_lens();
  const uint64_t seed = rng.next();
  const AttentionOptions opt = c.options(seed);
  const Tensor<T> d_out = random_tensor<T>(rng, {c.batch, c.nq, c.dv});

  const AttentionResult<T> fwd =
      additive_attention(in.qv, in.kv, in.vv, {in.wqv, in.wkv, in.wvv}, lens, opt);
  const AdditiveGrads<T> fast = additive_attention_backward(
      in.qv, in.kv, in.vv, {in.wqv, in.wkv, in.wvv}, lens, opt, {fwd.output, fwd.lse}, d_out);
  const Tensor<double> qd = cast<double>(in.qv), kd = cast<double>(in.kv), vd = cast<double>(in.vv),
                       wqd = cast<double>(in.wqv), wkd = cast<double>(in.wkv),
                       wvd = cast<double>(in.wvv), god = cast<double>(d_out);
  const AttentionResult<double> rfwd =
      ref::additive_attention(qd, kd, vd, {wqd, wkd, wvd}, lens, opt);
  const AdditiveGrads<double> ref = ref::additive_attention_backward(
      qd, kd, vd, {wqd, wkd, wvd}, lens, opt, {rfwd.output, rfwd.lse}, god);
  const AttentionResult<T> rfwd_t =
      ref::additive_attention(in.qv, in.kv, in.vv, {in.wqv, in.wkv, in.wvv}, lens, opt);
  const AdditiveGrads<T> ref_t = ref::additive_attention_backward(
      in.qv, in.kv, in.vv, {in.wqv, in.wkv, in.wvv}, lens, opt, {rfwd_t.output, rfwd_t.lse}, d_out);
  const NaiveAdditiveGrads loop = naive_additive_backward<T>(
      in.qv, in.kv, in.vv, in.wqv, in.wkv, in.wvv, lens, c.naive_dropout(seed), d_out.view());
  const Tensor<double> lq = as_tensor({c.batch, c.nq, c.dq}, loop.d_queries);
  const Tensor<double> lk = as_tensor({c.batch, c.nk, c.dk}, loop.d_keys);
  const Tensor<double> lv = as_tensor({c.batch, c.nk, c.dv}, loop.d_values);
  const Tensor<double> lwq = as_tensor({c.hidden, c.dq}, loop.d_w_q);
  const Tensor<double> lwk = as_tensor({c.hidden, c.dk}, loop.d_w_k);
  const Tensor<double> lwv = as_tensor(c.wv_shape(), loop.d_w_v);

  // d_w_v has the shape of the w_v given.
  ASSERT_EQ(fast.d_w_v.shape(), c.wv_shape());
  ASSERT_EQ(ref.d_w_v.shape(), c.wv_shape());
  ASSERT_EQ(ref_t.d_w_v.shape(), c.wv_shape());

  expect_close(fast.d_queries, ref.d_queries, kGrad<T>, "fast d_queries vs ref", "b q d");
  expect_close(fast.d_keys, ref.d_keys, kGrad<T>, "fast d_keys vs ref", "b k d");
  expect_close(fast.d_values, ref.d_values, kGrad<T>, "fast d_values vs ref", "b k d");
  expect_close(fast.d_w_q, ref.d_w_q, kGrad<T>, "fast d_w_q vs ref", "h d");
  expect_close(fast.d_w_k, ref.d_w_k, kGrad<T>, "fast d_w_k vs ref", "h d");
  expect_close(fast.d_w_v, ref.d_w_v, kGrad<T>, "fast d_w_v vs ref");

  expect_close(ref.d_queries, lq, kAdditiveBackwardDouble, "ref d_queries vs loop", "b q d");
  expect_close(ref.d_keys, lk, kAdditiveBackwardDouble, "ref d_keys vs loop", "b k d");
  expect_close(ref.d_values, lv, kAdditiveBackwardDouble, "ref d_values vs loop", "b k d");
  expect_close(ref.d_w_q, lwq, kAdditiveBackwardDouble, "ref d_w_q vs loop", "h d");
  expect_close(ref.d_w_k, lwk, kAdditiveBackwardDouble, "ref d_w_k vs loop", "h d");
  expect_close(ref.d_w_v, lwv, kAdditiveBackwardDouble, "ref d_w_v vs loop");

  expect_close(ref_t.d_queries, lq, kGrad<T>, "ref<T> d_queries vs loop", "b q d");
  expect_close(ref_t.d_keys, lk, kGrad<T>, "ref<T> d_keys vs loop", "b k d");
  expect_close(ref_t.d_values, lv, kGrad<T>, "ref<T> d_values vs loop", "b k d");
  expect_close(ref_t.d_w_q, lwq, kGrad<T>, "ref<T> d_w_q vs loop", "h d");
  expect_close(ref_t.d_w_k, lwk, kGrad<T>, "ref<T> d_w_k vs loop", "h d");
  expect_close(ref_t.d_w_v, lwv, kGrad<T>, "ref<T> d_w_v vs loop");
}

TYPED_TEST(Additive, BackwardMatchesRefAndLoop) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t shapes[][2] = {{1, 1}, {3, 17}, {17, 3}, {64, 65}, {65, 129}, {1, 300}};
  int n = 0;
  for (const auto& s : shapes) {
    for (int variant = 0; variant < 3; ++variant, ++n) {
      Case c;
      c.nq = s[0];
      c.nk = s[1];
      c.dq = kQueryDims[n % 5];
      c.dk = kKeyDims[(n + 2) % 5];
      c.hidden = kHidden[(n + 1) % 5];
      c.dv = kValueDims[(n + 3) % 5];
      c.wv_row = n % 2 == 1;
      c.lens_form = kAllLensForms[variant];
      c.lens32 = n % 3 == 0;
      if (n % 3 == 2) {
        c.dropout = 0.3;
        c.training = true;
      }
      c.strided = n % 4 == 3;
      check_backward<T>(rng, c);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// Every gradient against central differences of loss = sum(G * output), in
// double, through the fast and the reference backward.
void check_finite_differences(Rng& rng, const Case& c) {
  SCOPED_TRACE(c.str());
  const Inputs<double> in(rng, c);
  const ValidLens lens = in.valid_lens();
  const AttentionOptions opt = c.options(rng.next());
  const Tensor<double> g = random_tensor<double>(rng, {c.batch, c.nq, c.dv});
  const AttentionResult<double> fwd =
      additive_attention(in.q, in.k, in.v, {in.w_q, in.w_k, in.w_v}, lens, opt);
  const AdditiveGrads<double> fast = additive_attention_backward(
      in.q, in.k, in.v, {in.w_q, in.w_k, in.w_v}, lens, opt, {fwd.output, fwd.lse}, g);
  const AttentionResult<double> rfwd =
      ref::additive_attention(in.q, in.k, in.v, {in.w_q, in.w_k, in.w_v}, lens, opt);
  const AdditiveGrads<double> ref = ref::additive_attention_backward(
      in.q, in.k, in.v, {in.w_q, in.w_k, in.w_v}, lens, opt, {rfwd.output, rfwd.lse}, g);

  // Tensors 0-5: q, k, v, w_q, w_k, w_v; loss with tensor n replaced by x.
  const Tensor<double>* args[] = {&in.q, &in.k, &in.v, &in.w_q, &in.w_k, &in.w_v};
  auto loss_with = [&](int n, const Tensor<double>& x) {
    const Tensor<double>* a[6] = {args[0], args[1], args[2], args[3], args[4], args[5]};
    a[n] = &x;
    return sum_product(
        additive_attention(*a[0], *a[1], *a[2], {*a[3], *a[4], *a[5]}, lens, opt).output, g);
  };
  const Tensor<double>* fast_grads[] = {&fast.d_queries, &fast.d_keys, &fast.d_values,
                                        &fast.d_w_q,     &fast.d_w_k,  &fast.d_w_v};
  const Tensor<double>* ref_grads[] = {&ref.d_queries, &ref.d_keys, &ref.d_values,
                                       &ref.d_w_q,     &ref.d_w_k,  &ref.d_w_v};
  const char* names[] = {"d_queries", "d_keys", "d_values", "d_w_q", "d_w_k", "d_w_v"};
  // Hundreds of tiny calls: one thread spares the fork-join cost (the results
  // do not depend on the thread count; DeterministicAcrossThreadCounts).
  const ThreadCount one_thread(1);
  for (int n = 0; n < 6; ++n) {
    const Tensor<double> fd =
        numerical_gradient([&](const Tensor<double>& x) { return loss_with(n, x); }, *args[n]);
    expect_close(*fast_grads[n], fd, kFiniteDiff,
                 std::string("fast ") + names[n] + " vs finite differences");
    expect_close(*ref_grads[n], fd, kFiniteDiff,
                 std::string("ref ") + names[n] + " vs finite differences");
  }
}

TEST(AdditiveGradient, FiniteDifferences) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int variant = 0; variant < 6; ++variant) {
    Case c;
    c.batch = 2;
    c.nq = 3;
    c.nk = 4;
    c.dq = 5;
    c.dk = 3;
    c.dv = 2;
    c.hidden = 6;
    switch (variant) {
      case 0:
        break;
      case 1:
        c.wv_row = true;
        c.lens_form = LensForm::kPerBatch;
        break;
      case 2:
        c.lens_form = LensForm::kPerQuery;  // includes zeros
        c.hidden = 1;
        break;
      case 3:
        c.dropout = 0.4;
        c.training = true;
        c.wv_row = true;
        break;
      case 4:
        c.nq = 1;
        c.nk = 1;
        c.dq = 1;
        c.dk = 1;
        c.dv = 1;
        c.hidden = 2;
        break;
      case 5:
        c.lens_form = LensForm::kPerQuery;
        c.lens32 = true;
        c.dropout = 0.3;
        c.training = true;
        c.nk = 7;
        c.hidden = 4;
        break;
    }
    check_finite_differences(rng, c);
  }
}

// ---- bad input ------------------------------------------------------------------

constexpr const char* kFn = "additive_attention";
constexpr const char* kFnBackward = "additive_attention_backward";

// A valid problem: queries (2, 3, 4), keys (2, 5, 3), values (2, 5, 6),
// W_q (7, 4), W_k (7, 3), w_v (7).
struct ErrorFixture {
  Tensor<float> q{Shape{2, 3, 4}}, k{Shape{2, 5, 3}}, v{Shape{2, 5, 6}};
  Tensor<float> w_q{Shape{7, 4}}, w_k{Shape{7, 3}}, w_v{Shape{7}};
  Tensor<float> out{Shape{2, 3, 6}}, lse{Shape{2, 3}}, d_out{Shape{2, 3, 6}};
};

struct Args {
  ConstView<float> q, k, v, w_q, w_k, w_v;
  explicit Args(const ErrorFixture& f)
      : q(f.q), k(f.k), v(f.v), w_q(f.w_q), w_k(f.w_k), w_v(f.w_v) {}
};

// Expects the fast and the reference forward (and the double overload) to
// reject the arguments.
void expect_forward_error(const Args& a, const ValidLens& lens, const AttentionOptions& opt,
                          std::initializer_list<std::string_view> fragments,
                          std::source_location loc = std::source_location::current()) {
  expect_error(
      [&] {
        additive_attention(a.q, a.k, a.v, {a.w_q, a.w_k, a.w_v}, lens, opt);
      },
      fragments, loc);
  expect_error(
      [&] {
        ref::additive_attention(a.q, a.k, a.v, {a.w_q, a.w_k, a.w_v}, lens, opt);
      },
      fragments, loc);
  expect_error(
      [&] {
        additive_attention(cast<double>(a.q), cast<double>(a.k), cast<double>(a.v),
                           {cast<double>(a.w_q), cast<double>(a.w_k), cast<double>(a.w_v)}, lens,
                           opt);
      },
      fragments, loc);
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
      for (const double spread : {1.0, 30.0}) {
        const int64_t keys = rng.uniform_int(1, 70), ldk = (keys + 15) / 16 * 16;
        SCOPED_TRACE("H=" + std::to_string(hidden) + " rows=" + std::to_string(rows) +
                     " keys=" + std::to_string(keys) + " feature spread " + std::to_string(spread));
        std::vector<float> fq(static_cast<size_t>(rows * hidden)), wv(static_cast<size_t>(hidden));
        std::vector<float> fkt(static_cast<size_t>(hidden * ldk), 0.0f);
        for (float& x : fq) x = static_cast<float>(rng.uniform(-spread, spread));
        for (float& x : wv) x = static_cast<float>(rng.uniform(-1.5, 1.5));
        for (int64_t h = 0; h < hidden; ++h) {
          for (int64_t j = 0; j < keys; ++j) {
            fkt[h * ldk + j] = static_cast<float>(rng.uniform(-2.0, 2.0));
          }
        }
        std::vector<int64_t> lens(static_cast<size_t>(rows));
        for (int64_t& l : lens) l = rng.uniform_int(0, keys);
        lens[0] = keys;
        const float sentinel = -12345.0f;
        std::vector<float> s(static_cast<size_t>(rows * ldk), sentinel);
        const kernels::fast::AdditiveFeatures<float> f{fq.data(), hidden,    fkt.data(),
                                                       ldk,       wv.data(), hidden};
        kernels::fast::additive_scores(f, rows, lens.data(), s.data(), ldk);
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
      check_forward<T>(rng, c);
      check_backward<T>(rng, c);
      if (::testing::Test::HasFatalFailure()) return;
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
    SCOPED_TRACE(c.str() + ", W_q and W_k scaled by " + std::to_string(scale));
    Inputs<T> in(rng, c);
    // Half the hidden units get features of tens; the rest stay of order 1.
    for (int64_t h = 0; h < c.hidden; h += 2) {
      for (int64_t d = 0; d < c.dq; ++d) in.w_q(h, d) *= static_cast<T>(scale);
      for (int64_t d = 0; d < c.dk; ++d) in.w_k(h, d) *= static_cast<T>(scale);
    }
    const ValidLens lens = in.valid_lens();
    const AttentionOptions opt = c.options(0);
    const Tensor<T> d_out = random_tensor<T>(rng, {c.batch, c.nq, c.dv});
    const AttentionResult<T> fast =
        additive_attention(in.q, in.k, in.v, {in.w_q, in.w_k, in.w_v}, lens, opt);
    const Tensor<double> qd = cast<double>(in.q), kd = cast<double>(in.k),
                         vd = cast<double>(in.v), wqd = cast<double>(in.w_q),
                         wkd = cast<double>(in.w_k), wvd = cast<double>(in.w_v);
    const AttentionResult<double> ref =
        ref::additive_attention(qd, kd, vd, {wqd, wkd, wvd}, lens, opt);
    expect_close(fast.output, ref.output, kOut<T>, "output", "b q d");
    expect_close(fast.lse, ref.lse, kLse<T>, "lse", "b q");
    const AdditiveGrads<T> g = additive_attention_backward(
        in.q, in.k, in.v, {in.w_q, in.w_k, in.w_v}, lens, opt, {fast.output, fast.lse}, d_out);
    const AdditiveGrads<double> gr = ref::additive_attention_backward(
        qd, kd, vd, {wqd, wkd, wvd}, lens, opt, {ref.output, ref.lse}, cast<double>(d_out));
    expect_close(g.d_queries, gr.d_queries, kGrad<T>, "d_queries", "b q d");
    expect_close(g.d_keys, gr.d_keys, kGrad<T>, "d_keys", "b k d");
    expect_close(g.d_values, gr.d_values, kGrad<T>, "d_values", "b k d");
    expect_close(g.d_w_q, gr.d_w_q, kGrad<T>, "d_w_q", "h d");
    expect_close(g.d_w_k, gr.d_w_k, kGrad<T>, "d_w_k", "h d");
    expect_close(g.d_w_v, gr.d_w_v, kGrad<T>, "d_w_v");
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
  const Tensor<T> w_q = random_tensor<T>(rng, {hidden, dq}), w_k = random_tensor<T>(rng, {hidden, dk}),
                  w_v = random_tensor<T>(rng, {hidden});
  const Tensor<T> d_out = random_tensor<T>(rng, {1, nq, dv});
  // Even queries see 37 keys, odd ones 20; key 30 is NaN.
  Tensor<int64_t> lens(Shape{1, nq});
  for (int64_t i = 0; i < nq; ++i) lens(0, i) = i % 2 == 0 ? 37 : 20;
  Tensor<T> k_nan = k;
  for (int64_t d = 0; d < dk; ++d) k_nan(0, 30, d) = std::numeric_limits<T>::quiet_NaN();
  AttentionOptions opt;
  opt.want_lse = true;
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
    const Tol lse_tol = kLse<T>, out_tol = kOut<T>, grad_tol = kGrad<T>;
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

TEST(AdditiveErrors, InputShapes) {
  const ErrorFixture f;
  const AttentionOptions opt;
  const Tensor<float> q2(Shape{3, 4}), k4(Shape{2, 5, 3, 1}), v2(Shape{5, 6}),
      k_batch(Shape{8, 5, 3}), v_batch(Shape{9, 5, 6}), v_nk(Shape{2, 11, 6});
  {
    Args a(f);
    a.q = q2;
    expect_forward_error(a, {}, opt, {kFn, "queries", "[3, 4]"});
  }
  {
    Args a(f);
    a.k = k4;
    expect_forward_error(a, {}, opt, {kFn, "keys", "[2, 5, 3, 1]"});
  }
  {
    Args a(f);
    a.v = v2;
    expect_forward_error(a, {}, opt, {kFn, "values", "[5, 6]"});
  }
  {
    Args a(f);
    a.k = k_batch;
    expect_forward_error(a, {}, opt, {kFn, "keys", "8"});
  }
  {
    Args a(f);
    a.v = v_batch;
    expect_forward_error(a, {}, opt, {kFn, "values", "9"});
  }
  {
    Args a(f);
    a.v = v_nk;
    expect_forward_error(a, {}, opt, {kFn, "values", "11", "5"});
  }
}

TEST(AdditiveErrors, ParameterShapes) {
  const ErrorFixture f;
  const AttentionOptions opt;
  // W_q (H, Dq): wrong Dq, wrong rank.
  const Tensor<float> wq_dq(Shape{7, 13}), wq_rank(Shape{7}), wq_rank3(Shape{1, 7, 4});
  // W_k (H, Dk): wrong Dk, H differing from W_q's.
  const Tensor<float> wk_dk(Shape{7, 10}), wk_h(Shape{12, 3});
  // w_v (H) or (1, H): wrong H, (2, H), (H, 1), rank 3.
  const Tensor<float> wv_h(Shape{6}), wv_rows(Shape{2, 7}), wv_col(Shape{7, 1}),
      wv_rank3(Shape{1, 1, 7});
  auto with = [&](int which, const Tensor<float>& t) {
    Args a(f);
    (which == 0 ? a.w_q : which == 1 ? a.w_k : a.w_v) = t;
    return a;
  };
  expect_forward_error(with(0, wq_dq), {}, opt, {kFn, "w_q", "13"});
  expect_forward_error(with(0, wq_rank), {}, opt, {kFn, "w_q", "[7]"});
  expect_forward_error(with(0, wq_rank3), {}, opt, {kFn, "w_q", "[1, 7, 4]"});
  expect_forward_error(with(1, wk_dk), {}, opt, {kFn, "w_k", "10"});
  expect_forward_error(with(1, wk_h), {}, opt, {kFn, "w_k", "12"});
  expect_forward_error(with(2, wv_h), {}, opt, {kFn, "w_v", "6"});
  expect_forward_error(with(2, wv_rows), {}, opt, {kFn, "w_v", "[2, 7]"});
  expect_forward_error(with(2, wv_col), {}, opt, {kFn, "w_v", "[7, 1]"});
  expect_forward_error(with(2, wv_rank3), {}, opt, {kFn, "w_v", "[1, 1, 7]"});
}

TEST(AdditiveErrors, OptionsAndValidLens) {
  const ErrorFixture f;
  const Args a(f);
  AttentionOptions scaled;
  scaled.scale = 0.5;
  expect_forward_error(a, {}, scaled, {kFn, "scale"});
  for (const double p : {-0.5, 1.01, std::numeric_limits<double>::quiet_NaN()}) {
    AttentionOptions opt;
    opt.dropout = p;
    opt.training = true;
    expect_forward_error(a, {}, opt, {kFn, "dropout"});
  }
  const AttentionOptions opt;
  const Tensor<int64_t> wrong_batch(Shape{4}, int64_t{1});
  expect_forward_error(a, wrong_batch, opt, {kFn, "valid_lens", "[4]"});
  const Tensor<int32_t> wrong_queries(Shape{2, 5}, int32_t{1});
  expect_forward_error(a, wrong_queries, opt, {kFn, "valid_lens", "[2, 5]"});
  const Tensor<int64_t> too_long(Shape{2, 3}, std::vector<int64_t>{0, 1, 2, 3, 4, 6});
  expect_forward_error(a, too_long, opt, {kFn, "valid_lens", "6"});
  const Tensor<int32_t> negative(Shape{2}, std::vector<int32_t>{-3, 2});
  expect_forward_error(a, negative, opt, {kFn, "valid_lens", "-3"});
}

TEST(AdditiveErrors, WriteIntoBuffers) {
  const ErrorFixture f;
  const AttentionOptions opt;
  Tensor<float> out(Shape{2, 3, 6}), bad_out(Shape{3, 3, 6}), bad_w(Shape{2, 3, 6}),
      bad_lse(Shape{3});
  auto call = [&](const AttentionOutputs<float>& outs) {
    additive_attention(f.q, f.k, f.v, {f.w_q, f.w_k, f.w_v}, {}, opt, outs);
  };
  expect_error(
      [&] {
        call({bad_out.view(), std::nullopt, std::nullopt});
      },
      {kFn, "output", "[3, 3, 6]"});
  expect_error(
      [&] {
        call({out.view(), bad_w.view(), std::nullopt});
      },
      {kFn, "weights", "[2, 3, 6]"});
  expect_error([&] { call({out.view(), std::nullopt, bad_lse.view()}); }, {kFn, "lse", "[3]"});
}

TEST(AdditiveErrors, Backward) {
  const ErrorFixture f;
  const AttentionOptions opt;
  const Tensor<float> bad_out(Shape{2, 3, 5}), bad_lse(Shape{3, 2}), bad_d_out(Shape{2, 4, 6});
  auto check = [&](auto&& call) {
    expect_error([&] { call(bad_out, f.lse, f.d_out); }, {kFnBackward, "output", "[2, 3, 5]"});
    expect_error([&] { call(f.out, bad_lse, f.d_out); }, {kFnBackward, "lse", "[3, 2]"});
    expect_error([&] { call(f.out, ConstView<float>(), f.d_out); }, {kFnBackward, "lse"});
    expect_error([&] { call(f.out, f.lse, bad_d_out); }, {kFnBackward, "d_output", "[2, 4, 6]"});
  };
  check([&](ConstView<float> out, ConstView<float> lse, ConstView<float> d_out) {
    additive_attention_backward(f.q, f.k, f.v, {f.w_q, f.w_k, f.w_v}, {}, opt, {out, lse}, d_out);
  });
  check([&](ConstView<float> out, ConstView<float> lse, ConstView<float> d_out) {
    ref::additive_attention_backward(f.q, f.k, f.v, {f.w_q, f.w_k, f.w_v}, {}, opt, {out, lse},
                                     d_out);
  });
  // The backward validates the inputs and options like the forward.
  const Tensor<float> wk_dk(Shape{7, 10});
  expect_error(
      [&] {
        additive_attention_backward(f.q, f.k, f.v, {f.w_q, wk_dk, f.w_v}, {}, opt, {f.out, f.lse},
                                    f.d_out);
      },
      {kFnBackward, "w_k", "10"});
  AttentionOptions scaled;
  scaled.scale = 2.0;
  expect_error(
      [&] {
        additive_attention_backward(f.q, f.k, f.v, {f.w_q, f.w_k, f.w_v}, {}, scaled,
                                    {f.out, f.lse}, f.d_out);
      },
      {kFnBackward, "scale"});
}

}  // namespace
}  // namespace qkv::test
