// GoogleTest suite of scaled dot-product attention (qkv/attention.h): the
// chapter's worked example, the fast version against qkv::ref and both against
// the plain loops of attention_testing.h over many shapes, masking, dropout,
// the lse merge identity, the write-into form, strided inputs, thread-count
// determinism, gradients (reference and finite differences), the exercise's
// Jacobian = covariance identity, and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <source_location>
#include <sstream>
#include <string>
#include <vector>

#include "attention_testing.h"
#include "test_util.h"
#include "tolerances.h"

namespace qkv::test {
namespace {

template <class T>
class Sdpa : public ::testing::Test {};
using ElementTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Sdpa, ElementTypes, TypeNames);

template <class T>
constexpr Tol kOut = tol_for<T>(kSdpa, kSdpaDouble);
template <class T>
constexpr Tol kWeights = tol_for<T>(kSoftmax, kSoftmaxDouble);
template <class T>
constexpr Tol kLse = tol_for<T>(kSdpaLse, kSdpaLseDouble);
template <class T>
constexpr Tol kGrad = tol_for<T>(kSdpaBackward, kSdpaBackwardDouble);

// How the inputs are laid out in memory.
enum class Layout { kContiguous, kStrided, kStridedReversed, kBroadcastValues };

const char* to_string(Layout layout) {
  switch (layout) {
    case Layout::kContiguous:
      return "contiguous";
    case Layout::kStrided:
      return "strided";
    case Layout::kStridedReversed:
      return "strided, axes reversed";
    case Layout::kBroadcastValues:
      return "values broadcast over the batch (stride 0)";
  }
  return "?";
}

// One scaled dot-product attention problem.
struct Case {
  int64_t batch = 2, nq = 3, nk = 5, dim = 4, dv = 3;
  LensForm lens_form = LensForm::kNone;
  bool lens32 = false;
  std::optional<double> scale;
  double dropout = 0.0;
  bool training = false;
  bool want_weights = true, want_lse = true;
  Layout layout = Layout::kContiguous;

  double effective_scale() const { return scale.value_or(1.0 / std::sqrt(double(dim))); }
  AttentionOptions options(uint64_t seed) const {
    AttentionOptions o;
    o.scale = scale;
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
    os << "B=" << batch << " Nq=" << nq << " Nk=" << nk << " D=" << dim << " Dv=" << dv << ", "
       << to_string(lens_form) << (lens32 ? " int32" : " int64") << ", scale "
       << (scale ? std::to_string(*scale) : std::string("default")) << ", dropout " << dropout
       << (training ? " training" : " eval") << ", want_weights " << want_weights << ", want_lse "
       << want_lse << ", " << to_string(layout);
    return os.str();
  }
};

// Random inputs of a case, owned contiguously, plus the views the calls get.
template <class T>
struct Inputs {
  Tensor<T> q, k, v;
  OwnedLens lens;
  std::unique_ptr<Strided<T>> sq, sk, sv;
  ConstView<T> qv, kv, vv;

  // Queries and keys uniform in [lo, hi), rounded to multiples of `quantum`
  // if it is positive (so that scores can be exact in float).
  Inputs(Rng& rng, const Case& c, double lo = -1.0, double hi = 1.0, double quantum = 0.0) {
    q = random_tensor<T>(rng, {c.batch, c.nq, c.dim}, lo, hi);
    k = random_tensor<T>(rng, {c.batch, c.nk, c.dim}, lo, hi);
    if (quantum > 0) {
      for (Tensor<T>* t : {&q, &k}) {
        for (T& x : t->values()) x = static_cast<T>(quantum * std::round(double(x) / quantum));
      }
    }
    v = random_tensor<T>(rng, {c.batch, c.nk, c.dv});
    lens = make_lens(rng, c.lens_form, c.lens32, c.batch, c.nq, c.nk);
    qv = q;
    kv = k;
    vv = v;
    if (c.layout == Layout::kStrided || c.layout == Layout::kStridedReversed) {
      typename Strided<T>::Layout layout;
      layout.reversed = c.layout == Layout::kStridedReversed;
      sq = std::make_unique<Strided<T>>(q.view(), layout);
      layout.step = 3;
      sk = std::make_unique<Strided<T>>(k.view(), layout);
      layout.pad = 1;
      sv = std::make_unique<Strided<T>>(v.view(), layout);
      qv = sq->const_view();
      kv = sk->const_view();
      vv = sv->const_view();
    } else if (c.layout == Layout::kBroadcastValues) {
      // Every batch element sees the values of batch 0.
      for (int64_t b = 1; b < c.batch; ++b) {
        for (int64_t j = 0; j < c.nk; ++j) {
          for (int64_t d = 0; d < c.dv; ++d) v(b, j, d) = v(0, j, d);
        }
      }
      vv = ConstView<T>(v.data(), v.shape(), Shape{0, c.dv, 1});
    }
  }
  ValidLens valid_lens() const { return lens.get(); }
};

template <class T>
void expect_exact_masking(const AttentionResult<T>& r, const Case& c, const OwnedLens& lens,
                          const char* what) {
  test::expect_exact_masking(r.output, r.weights, r.lse, lens, c.nk, what);
}

// Forward: fast (T) vs ref (double), ref (double) vs the plain loop, ref (T)
// vs the plain loop; the want_* flags; exact masking.
template <class T>
void check_forward(Rng& rng, const Case& c, double lo = -1.0, double hi = 1.0,
                   double quantum = 0.0) {
  SCOPED_TRACE(c.str());
  const Inputs<T> in(rng, c, lo, hi, quantum);
  const ValidLens lens = in.valid_lens();
  const uint64_t seed = rng.next();
  const AttentionOptions opt = c.options(seed);

  const AttentionResult<T> fast = scaled_dot_product_attention(in.qv, in.kv, in.vv, lens, opt);
  const Tensor<double> qd = cast<double>(in.qv), kd = cast<double>(in.kv), vd = cast<double>(in.vv);
  const AttentionResult<double> ref = ref::scaled_dot_product_attention(qd, kd, vd, lens, opt);
  const AttentionResult<T> ref_t =
      ref::scaled_dot_product_attention(in.qv, in.kv, in.vv, lens, opt);
  const NaiveForward loop =
      naive_sdpa<T>(in.qv, in.kv, in.vv, lens, c.effective_scale(), c.naive_dropout(seed));
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
  // The reference returns weights and lse whatever the flags say.
  ASSERT_EQ(ref.weights.shape(), Shape({c.batch, c.nq, c.nk}));
  ASSERT_EQ(ref.lse.shape(), Shape({c.batch, c.nq}));
  ASSERT_EQ(ref_t.weights.shape(), Shape({c.batch, c.nq, c.nk}));
  ASSERT_EQ(ref_t.lse.shape(), Shape({c.batch, c.nq}));

  expect_close(fast.output, ref.output, kOut<T>, "fast output vs ref", "b q d");
  if (c.want_weights) expect_close(fast.weights, ref.weights, kWeights<T>, "fast weights vs ref");
  if (c.want_lse) expect_close(fast.lse, ref.lse, kLse<T>, "fast lse vs ref", "b q");

  expect_close(ref.output, loop_out, kSdpaDouble, "ref output vs loop", "b q d");
  expect_close(ref.weights, loop_w, kSoftmaxDouble, "ref weights vs loop");
  expect_close(ref.lse, loop_lse, kSdpaLseDouble, "ref lse vs loop", "b q");
  expect_close(ref_t.output, loop_out, kOut<T>, "ref<T> output vs loop", "b q d");
  expect_close(ref_t.weights, loop_w, kWeights<T>, "ref<T> weights vs loop");
  expect_close(ref_t.lse, loop_lse, kLse<T>, "ref<T> lse vs loop", "b q");

  expect_exact_masking(fast, c, in.lens, "fast");
  expect_exact_masking(ref, c, in.lens, "ref");
}

const int64_t kSizes[] = {1, 3, 17, 64, 65, 129, 300};
const int64_t kDims[] = {1, 2, 7, 16, 64};
const int64_t kValueDims[] = {3, 1, 16, 5, 33};

TYPED_TEST(Sdpa, ChapterExample) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  // keys: ones (2, 10, 2); values: arange(40) as (1, 10, 4) repeated for 2
  // batches; valid_lens [2, 6]; queries ~ N(0, 1) (2, 1, 2).
  const Tensor<T> keys(Shape{2, 10, 2}, T(1));
  Tensor<T> values(Shape{2, 10, 4});
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t j = 0; j < 10; ++j) {
      for (int64_t d = 0; d < 4; ++d) values(b, j, d) = static_cast<T>(4 * j + d);
    }
  }
  const Tensor<T> queries = normal_tensor<T>(rng, {2, 1, 2});
  // Mean of rows 0-1 and of rows 0-5 of arange(40).reshape(10, 4).
  const Tensor<double> expected = as_tensor({2, 1, 4}, {2, 3, 4, 5, 10, 11, 12, 13});
  Tensor<double> expected_w(Shape{2, 1, 10});
  for (int64_t j = 0; j < 2; ++j) expected_w(0, 0, j) = 0.5;
  for (int64_t j = 0; j < 6; ++j) expected_w(1, 0, j) = 1.0 / 6.0;
  // All scores of a row equal s = (q0 + q1) / sqrt(2), so lse = s + log L.
  Tensor<double> expected_lse(Shape{2, 1});
  const double lengths[] = {2, 6};
  for (int64_t b = 0; b < 2; ++b) {
    expected_lse(b, 0) = (double(queries(b, 0, 0)) + double(queries(b, 0, 1))) / std::sqrt(2.0) +
                         std::log(lengths[b]);
  }
  const Tol tol = tol_for<T>(kAverage, kPoolingDouble);

  for (const bool use32 : {false, true}) {
    SCOPED_TRACE(use32 ? "int32 valid_lens" : "int64 valid_lens");
    const Tensor<int32_t> lens32(Shape{2}, std::vector<int32_t>{2, 6});
    const Tensor<int64_t> lens64(Shape{2}, std::vector<int64_t>{2, 6});
    const ValidLens lens = use32 ? ValidLens(lens32) : ValidLens(lens64);
    AttentionOptions opt;
    opt.want_weights = true;
    opt.want_lse = true;
    opt.dropout = 0.5;  // DotProductAttention(dropout=0.5) in eval mode
    opt.training = false;
    const AttentionResult<T> fast = scaled_dot_product_attention(queries, keys, values, lens, opt);
    const AttentionResult<T> ref =
        ref::scaled_dot_product_attention(queries, keys, values, lens, opt);
    expect_close(fast.output, expected, tol, "fast output", "b q d");
    expect_close(fast.weights, expected_w, kWeights<T>, "fast weights");
    expect_close(fast.lse, expected_lse, kLse<T>, "fast lse", "b q");
    expect_close(ref.output, expected, tol, "ref output", "b q d");
    expect_close(ref.weights, expected_w, kWeights<T>, "ref weights");
    expect_close(ref.lse, expected_lse, kLse<T>, "ref lse", "b q");
  }
}

TYPED_TEST(Sdpa, FastMatchesRefAndLoopOverShapes) {
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
      c.dim = kDims[(ia + ib) % 5];
      c.dv = kValueDims[(2 * ia + ib) % 5];
      c.batch = (n % 3 == 0) ? 1 : 2;
      c.lens_form = kAllLensForms[(ia + 2 * ib) % 3];
      c.lens32 = n % 2 == 1;
      c.want_weights = n % 4 < 2;
      c.want_lse = n % 2 == 0;
      if (n % 5 == 2) c.scale = rng.uniform(0.05, 2.0);
      check_forward<T>(rng, c);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TYPED_TEST(Sdpa, ZeroLengthsAndFullLengths) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (const LensForm form : {LensForm::kPerBatch, LensForm::kPerQuery}) {
    for (const int64_t nk : {1, 4, 65}) {
      Case c;
      c.batch = 3;
      c.nq = 5;
      c.nk = nk;
      c.dim = 7;
      c.dv = 6;
      c.lens_form = form;
      SCOPED_TRACE(c.str());
      Inputs<T> in(rng, c);
      // Half the lengths zero (the rest random), then compare to the loop.
      for (int64_t& len : in.lens.lens64.values()) {
        len = rng.bernoulli(0.5) ? 0 : rng.uniform_int(0, nk);
      }
      in.lens.lens64.values()[0] = 0;
      const ValidLens lens = in.valid_lens();
      const AttentionOptions opt = c.options(0);
      const AttentionResult<T> fast = scaled_dot_product_attention(in.qv, in.kv, in.vv, lens, opt);
      const AttentionResult<T> ref =
          ref::scaled_dot_product_attention(in.qv, in.kv, in.vv, lens, opt);
      expect_exact_masking(fast, c, in.lens, "fast");
      expect_exact_masking(ref, c, in.lens, "ref");
      const NaiveForward loop =
          naive_sdpa<T>(in.qv, in.kv, in.vv, lens, c.effective_scale(), NaiveDropout{});
      expect_close(fast.output, as_tensor({c.batch, c.nq, c.dv}, loop.out), kOut<T>,
                   "fast output vs loop", "b q d");
      expect_close(fast.lse, as_tensor({c.batch, c.nq}, loop.lse), kLse<T>, "fast lse vs loop",
                   "b q");
    }
  }
}

// Key positions at or past every query's valid length are never read (DESIGN
// §3: masked positions are never read): NaN keys and values there change
// nothing, forward or backward, and their gradients are exactly 0.
TYPED_TEST(Sdpa, MaskedKeysAreNeverRead) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (const int64_t nk : {5, 70, 300}) {
    Case c;
    c.batch = 3;
    c.nq = 6;
    c.nk = nk;
    c.dim = 16;
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
        for (int64_t d = 0; d < c.dim; ++d) k_nan(b, j, d) = nan;
        for (int64_t d = 0; d < c.dv; ++d) v_nan(b, j, d) = nan;
      }
    }
    const AttentionOptions opt = c.options(rng.next());
    const Tensor<T> d_out = random_tensor<T>(rng, {c.batch, c.nq, c.dv});
    const AttentionResult<T> clean = scaled_dot_product_attention(in.q, in.k, in.v, lens, opt);
    const AttentionResult<T> fast = scaled_dot_product_attention(in.q, k_nan, v_nan, lens, opt);
    const AttentionResult<T> ref = ref::scaled_dot_product_attention(in.q, k_nan, v_nan, lens, opt);
    expect_close(fast.output, clean.output, kOut<T>, "fast output, NaN past L", "b q d");
    expect_close(fast.lse, clean.lse, kLse<T>, "fast lse, NaN past L", "b q");
    expect_close(ref.output, clean.output, kOut<T>, "ref output, NaN past L", "b q d");
    const DotProductGrads<T> g_clean = scaled_dot_product_attention_backward(
        in.q, in.k, in.v, lens, opt, {clean.output, clean.lse}, d_out);
    const DotProductGrads<T> g_fast = scaled_dot_product_attention_backward(
        in.q, k_nan, v_nan, lens, opt, {fast.output, fast.lse}, d_out);
    const DotProductGrads<T> g_ref = ref::scaled_dot_product_attention_backward(
        in.q, k_nan, v_nan, lens, opt, {ref.output, ref.lse}, d_out);
    for (const DotProductGrads<T>* g : {&g_fast, &g_ref}) {
      const char* what = g == &g_fast ? "fast" : "ref";
      SCOPED_TRACE(what);
      // g_clean already has exact zeros past L if the contract holds.
      expect_close(g->d_queries, g_clean.d_queries, kGrad<T>, "d_queries, NaN past L", "b q d");
      expect_close(g->d_keys, g_clean.d_keys, kGrad<T>, "d_keys, NaN past L", "b k d");
      expect_close(g->d_values, g_clean.d_values, kGrad<T>, "d_values, NaN past L", "b k d");
      for (int64_t b = 0; b < c.batch; ++b) {
        for (int64_t j = in.lens.at(b, 0, nk); j < nk; ++j) {
          for (int64_t d = 0; d < c.dim; ++d) {
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

// Sizes of zero (docs/semantics.md): Nk = 0 makes every row empty (output 0,
// lse -inf, zero gradients); Nq = 0 or B = 0 give empty results; D = 0 with
// an explicit scale makes every score 0 (average pooling), and without one is
// an error; Dv = 0 still gives the weights.
TYPED_TEST(Sdpa, ZeroSizes) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  AttentionOptions opt;
  opt.want_weights = true;
  opt.want_lse = true;
  for (const bool use_ref : {false, true}) {
    SCOPED_TRACE(use_ref ? "ref" : "fast");
    auto attend = [&](const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v,
                      const AttentionOptions& o) {
      return use_ref ? ref::scaled_dot_product_attention(q, k, v, {}, o)
                     : scaled_dot_product_attention(q, k, v, {}, o);
    };
    {
      SCOPED_TRACE("Nk = 0");
      const Tensor<T> q = random_tensor<T>(rng, {2, 3, 4});
      const Tensor<T> k(Shape{2, 0, 4}), v(Shape{2, 0, 5});
      const AttentionResult<T> r = attend(q, k, v, opt);
      expect_close(r.output, Tensor<double>(Shape{2, 3, 5}), kExact, "output", "b q d");
      EXPECT_EQ(r.weights.shape(), Shape({2, 3, 0}));
      expect_close(r.lse, Tensor<double>(Shape{2, 3}, -std::numeric_limits<double>::infinity()),
                   kExact, "lse", "b q");
      const Tensor<T> d_out = random_tensor<T>(rng, {2, 3, 5});
      const DotProductGrads<T> g = use_ref ? ref::scaled_dot_product_attention_backward(
                                                 q, k, v, {}, opt, {r.output, r.lse}, d_out)
                                           : scaled_dot_product_attention_backward(
                                                 q, k, v, {}, opt, {r.output, r.lse}, d_out);
      expect_close(g.d_queries, Tensor<double>(Shape{2, 3, 4}), kExact, "d_queries", "b q d");
      EXPECT_EQ(g.d_keys.shape(), Shape({2, 0, 4}));
      EXPECT_EQ(g.d_values.shape(), Shape({2, 0, 5}));
    }
    {
      SCOPED_TRACE("Nq = 0 and B = 0");
      const AttentionResult<T> r =
          attend(Tensor<T>(Shape{2, 0, 4}), random_tensor<T>(rng, {2, 3, 4}),
                 random_tensor<T>(rng, {2, 3, 5}), opt);
      EXPECT_EQ(r.output.shape(), Shape({2, 0, 5}));
      EXPECT_EQ(r.weights.shape(), Shape({2, 0, 3}));
      EXPECT_EQ(r.lse.shape(), Shape({2, 0}));
      const AttentionResult<T> e = attend(Tensor<T>(Shape{0, 2, 4}), Tensor<T>(Shape{0, 3, 4}),
                                          Tensor<T>(Shape{0, 3, 5}), opt);
      EXPECT_EQ(e.output.shape(), Shape({0, 2, 5}));
    }
    {
      SCOPED_TRACE("D = 0");
      const Tensor<T> q(Shape{2, 3, 0}), k(Shape{2, 4, 0});
      const Tensor<T> v = random_tensor<T>(rng, {2, 4, 3});
      AttentionOptions scaled = opt;
      scaled.scale = 1.0;
      const AttentionResult<T> r = attend(q, k, v, scaled);
      Tensor<double> mean(Shape{2, 3, 3});
      for (int64_t b = 0; b < 2; ++b) {
        for (int64_t i = 0; i < 3; ++i) {
          for (int64_t d = 0; d < 3; ++d) {
            for (int64_t j = 0; j < 4; ++j) mean(b, i, d) += double(v(b, j, d)) / 4.0;
          }
        }
      }
      expect_close(r.output, mean, tol_for<T>(kAverage, kPoolingDouble), "output", "b q d");
      expect_close(r.weights, Tensor<double>(Shape{2, 3, 4}, 0.25), kWeights<T>, "weights");
      expect_close(r.lse, Tensor<double>(Shape{2, 3}, std::log(4.0)), kLse<T>, "lse", "b q");
      expect_error([&] { attend(q, k, v, opt); }, {"scaled_dot_product_attention", "scale"});
    }
    {
      SCOPED_TRACE("Dv = 0");
      const Tensor<T> q = random_tensor<T>(rng, {1, 2, 3}), k = random_tensor<T>(rng, {1, 5, 3});
      const AttentionResult<T> r = attend(q, k, Tensor<T>(Shape{1, 5, 0}), opt);
      EXPECT_EQ(r.output.shape(), Shape({1, 2, 0}));
      const AttentionResult<double> want = ref::scaled_dot_product_attention(
          cast<double>(q), cast<double>(k), Tensor<double>(Shape{1, 5, 1}), {}, opt);
      expect_close(r.weights, want.weights, kWeights<T>, "weights");
    }
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
    c.dim = 16;
    c.dv = 9;
    c.scale = scale;
    c.lens_form = LensForm::kPerQuery;
    check_forward<T>(rng, c);
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
  c.dim = 5;
  c.dv = 3;
  c.scale = 0.0;
  c.lens_form = LensForm::kPerQuery;
  const Inputs<T> in(rng, c);
  const AttentionResult<T> r =
      scaled_dot_product_attention(in.qv, in.kv, in.vv, in.valid_lens(), c.options(0));
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
      c.dim = 8;
      c.dv = 5;
      c.scale = scale;
      c.lens_form = LensForm::kPerBatch;
      check_forward<T>(rng, c, 0.75, 2.25, 0.5);
    }
  }
}

TYPED_TEST(Sdpa, Dropout) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  int n = 0;
  for (const double p : {0.1, 0.5, 0.9}) {
    for (const int64_t nk : {1, 17, 65, 129}) {
      Case c;
      c.nq = kSizes[n % 7];
      c.nk = nk;
      c.dim = kDims[n % 5];
      c.dv = kValueDims[n % 5];
      c.dropout = p;
      c.training = true;
      c.lens_form = kAllLensForms[n % 3];
      c.want_weights = n % 2 == 0;
      if (n % 3 == 1) c.scale = 0.8;
      check_forward<T>(rng, c);
      ++n;
    }
  }
}

// In eval mode dropout does nothing; p = 0 in training does nothing; p = 1 in
// training drops every weight.
TYPED_TEST(Sdpa, DropoutOnlyWhenTraining) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  Case c;
  c.nq = 13;
  c.nk = 70;
  c.dim = 16;
  c.dv = 8;
  c.lens_form = LensForm::kPerQuery;
  const Inputs<T> in(rng, c);
  const ValidLens lens = in.valid_lens();
  AttentionOptions plain = c.options(rng.next());
  const AttentionResult<T> base = scaled_dot_product_attention(in.qv, in.kv, in.vv, lens, plain);

  AttentionOptions eval = plain;
  eval.dropout = 0.5;
  eval.training = false;
  const AttentionResult<T> r_eval = scaled_dot_product_attention(in.qv, in.kv, in.vv, lens, eval);
  expect_close(r_eval.output, base.output, kOut<T>, "eval with dropout vs no dropout", "b q d");
  expect_close(r_eval.weights, base.weights, kWeights<T>, "eval weights vs no dropout");

  AttentionOptions zero = plain;
  zero.dropout = 0.0;
  zero.training = true;
  const AttentionResult<T> r_zero = scaled_dot_product_attention(in.qv, in.kv, in.vv, lens, zero);
  expect_close(r_zero.output, base.output, kOut<T>, "training with p = 0 vs no dropout", "b q d");

  AttentionOptions all = plain;
  all.dropout = 1.0;
  all.training = true;
  const AttentionResult<T> r_all = scaled_dot_product_attention(in.qv, in.kv, in.vv, lens, all);
  expect_close(r_all.output, Tensor<double>(r_all.output.shape()), kExact, "p = 1 output", "b q d");
  // The weights are reported before dropout.
  expect_close(r_all.weights, base.weights, kWeights<T>, "p = 1 weights (before dropout)");

  AttentionOptions half = plain;
  half.dropout = 0.5;
  half.training = true;
  const AttentionResult<T> r_half = scaled_dot_product_attention(in.qv, in.kv, in.vv, lens, half);
  double diff = max_abs_diff(r_half.output, base.output);
  EXPECT_GT(diff, 1e-3) << "training with p = 0.5 gave the output without dropout";
  // A different seed gives a different mask.
  half.seed = plain.seed + 1;
  const AttentionResult<T> r_other = scaled_dot_product_attention(in.qv, in.kv, in.vv, lens, half);
  diff = max_abs_diff(r_half.output, r_other.output);
  EXPECT_GT(diff, 1e-3) << "two dropout seeds gave the same output";
}

TYPED_TEST(Sdpa, StridedInputs) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  int n = 0;
  for (const Layout layout :
       {Layout::kStrided, Layout::kStridedReversed, Layout::kBroadcastValues}) {
    for (const int64_t nk : {1, 17, 65}) {
      Case c;
      c.batch = 3;
      c.nq = kSizes[(n + 2) % 6];
      c.nk = nk;
      c.dim = kDims[n % 5];
      c.dv = kValueDims[n % 5];
      c.layout = layout;
      c.lens_form = kAllLensForms[n % 3];
      c.lens32 = true;
      if (n % 2 == 1) {
        c.dropout = 0.3;
        c.training = true;
      }
      check_forward<T>(rng, c);
      ++n;
    }
  }
}

// Valid lengths given as a strided view (a column of a bigger int tensor).
TYPED_TEST(Sdpa, StridedValidLens) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  Case c;
  c.batch = 3;
  c.nq = 4;
  c.nk = 9;
  c.lens_form = LensForm::kPerQuery;
  const Inputs<T> in(rng, c);
  const Tensor<int64_t>& dense = in.lens.lens64;
  Tensor<int64_t> wide(Shape{c.batch, c.nq, 2}, int64_t{-1});
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t i = 0; i < c.nq; ++i) wide(b, i, 1) = dense(b, i);
  }
  const ConstView<int64_t> column(wide.data() + 1, Shape{c.batch, c.nq}, Shape{2 * c.nq, 2});
  const AttentionOptions opt = c.options(0);
  const AttentionResult<T> got = scaled_dot_product_attention(in.qv, in.kv, in.vv, column, opt);
  const AttentionResult<T> want = scaled_dot_product_attention(in.qv, in.kv, in.vv, dense, opt);
  expect_close(got.output, want.output, kOut<T>, "strided lens output", "b q d");
  expect_close(got.weights, want.weights, kWeights<T>, "strided lens weights");
}

TYPED_TEST(Sdpa, WriteIntoCallerBuffers) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const T nan = std::numeric_limits<T>::quiet_NaN();
  int n = 0;
  for (const int64_t nk : {1, 17, 129}) {
    for (const int which : {0, 1, 2, 3}) {  // which of weights / lse are given
      Case c;
      c.nq = kSizes[n % 5];
      c.nk = nk;
      c.dim = kDims[n % 5];
      c.dv = kValueDims[n % 5];
      c.lens_form = kAllLensForms[n % 3];
      c.dropout = n % 2 ? 0.25 : 0.0;
      c.training = true;
      ++n;
      const bool give_w = which & 1, give_lse = which & 2;
      SCOPED_TRACE(c.str() + (give_w ? ", weights given" : ", no weights") +
                   (give_lse ? ", lse given" : ", no lse"));
      const Inputs<T> in(rng, c);
      const ValidLens lens = in.valid_lens();
      AttentionOptions opt = c.options(rng.next());
      // The flags are ignored in favour of the buffers given.
      opt.want_weights = !give_w;
      opt.want_lse = !give_lse;
      // Each destination sits inside a bigger buffer whose guard elements must
      // stay untouched.
      const int64_t guard = 5;
      const int64_t n_out = c.batch * c.nq * c.dv, n_w = c.batch * c.nq * c.nk,
                    n_lse = c.batch * c.nq;
      std::vector<T> buf_out(static_cast<size_t>(n_out + 2 * guard), nan);
      std::vector<T> buf_w(static_cast<size_t>(n_w + 2 * guard), nan);
      std::vector<T> buf_lse(static_cast<size_t>(n_lse + 2 * guard), nan);
      AttentionOutputs<T> outs;
      outs.output = TensorView<T>(buf_out.data() + guard, Shape{c.batch, c.nq, c.dv});
      if (give_w) outs.weights = TensorView<T>(buf_w.data() + guard, Shape{c.batch, c.nq, c.nk});
      if (give_lse) outs.lse = TensorView<T>(buf_lse.data() + guard, Shape{c.batch, c.nq});
      scaled_dot_product_attention(in.qv, in.kv, in.vv, lens, opt, outs);

      const AttentionResult<double> ref = ref::scaled_dot_product_attention(
          cast<double>(in.qv), cast<double>(in.kv), cast<double>(in.vv), lens, opt);
      expect_close(outs.output, ref.output, kOut<T>, "written output vs ref", "b q d");
      if (give_w) expect_close(*outs.weights, ref.weights, kWeights<T>, "written weights vs ref");
      if (give_lse) expect_close(*outs.lse, ref.lse, kLse<T>, "written lse vs ref", "b q");
      for (int64_t g = 0; g < guard; ++g) {
        EXPECT_TRUE(std::isnan(buf_out[static_cast<size_t>(g)]) &&
                    std::isnan(buf_out[static_cast<size_t>(guard + n_out + g)]))
            << "wrote outside the output buffer";
        EXPECT_TRUE(std::isnan(buf_w[static_cast<size_t>(g)]) &&
                    std::isnan(buf_w[static_cast<size_t>(guard + n_w + g)]))
            << "wrote outside the weights buffer";
        EXPECT_TRUE(std::isnan(buf_lse[static_cast<size_t>(g)]) &&
                    std::isnan(buf_lse[static_cast<size_t>(guard + n_lse + g)]))
            << "wrote outside the lse buffer";
      }
      if (!give_w) {
        for (const T x : buf_w) ASSERT_TRUE(std::isnan(x)) << "wrote weights that were not given";
      }
      if (!give_lse) {
        for (const T x : buf_lse) ASSERT_TRUE(std::isnan(x)) << "wrote an lse that was not given";
      }
    }
  }
}

// Attention over disjoint key sets merges exactly into attention over all:
// lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s.
TYPED_TEST(Sdpa, LseMergesDisjointKeySets) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (const int64_t nk : {2, 5, 66, 200}) {
    Case c;
    c.batch = 2;
    c.nq = 7;
    c.nk = nk;
    c.dim = 16;
    c.dv = 5;
    SCOPED_TRACE(c.str());
    const Inputs<T> in(rng, c);
    // A random split: the first n1 keys of a random permutation, and the rest.
    std::vector<int64_t> perm(static_cast<size_t>(nk));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng.engine());
    const int64_t n1 = rng.uniform_int(1, nk - 1);
    const int64_t sizes[2] = {n1, nk - n1};
    AttentionResult<T> part[2];
    for (int s = 0; s < 2; ++s) {
      Tensor<T> ks(Shape{c.batch, sizes[s], c.dim}), vs(Shape{c.batch, sizes[s], c.dv});
      for (int64_t b = 0; b < c.batch; ++b) {
        for (int64_t t = 0; t < sizes[s]; ++t) {
          const int64_t j = perm[static_cast<size_t>(s == 0 ? t : n1 + t)];
          for (int64_t d = 0; d < c.dim; ++d) ks(b, t, d) = in.k(b, j, d);
          for (int64_t d = 0; d < c.dv; ++d) vs(b, t, d) = in.v(b, j, d);
        }
      }
      AttentionOptions opt;
      opt.want_lse = true;
      part[s] = scaled_dot_product_attention(in.q, ks, vs, {}, opt);
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
    AttentionOptions opt;
    opt.want_lse = true;
    const AttentionResult<T> full = scaled_dot_product_attention(in.q, in.k, in.v, {}, opt);
    const AttentionResult<double> ref = ref::scaled_dot_product_attention(
        cast<double>(in.q), cast<double>(in.k), cast<double>(in.v), {}, opt);
    expect_close(merged, full.output, kOut<T>, "merged output vs attention over all keys", "b q d");
    expect_close(merged_lse, full.lse, kLse<T>, "merged lse vs attention over all keys", "b q");
    expect_close(merged, ref.output, kOut<T>, "merged output vs ref", "b q d");
    expect_close(merged_lse, ref.lse, kLse<T>, "merged lse vs ref", "b q");
  }
}

// The same inputs and seed give bitwise-identical results with 1, 2 or 3
// threads.
TYPED_TEST(Sdpa, DeterministicAcrossThreadCounts) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  Case c;
  c.batch = 3;
  c.nq = 129;
  c.nk = 300;
  c.dim = 64;
  c.dv = 33;
  c.lens_form = LensForm::kPerQuery;
  c.dropout = 0.2;
  c.training = true;
  const Inputs<T> in(rng, c);
  const ValidLens lens = in.valid_lens();
  const AttentionOptions opt = c.options(rng.next());
  const Tensor<T> d_out = random_tensor<T>(rng, {c.batch, c.nq, c.dv});
  AttentionResult<T> r[3];
  DotProductGrads<T> g[3];
  for (int t = 0; t < 3; ++t) {
    const ThreadCount threads(t + 1);
    r[t] = scaled_dot_product_attention(in.qv, in.kv, in.vv, lens, opt);
    g[t] = scaled_dot_product_attention_backward(in.qv, in.kv, in.vv, lens, opt,
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
  }
}

// ---- backward -------------------------------------------------------------------

// Backward: fast (T) vs ref (double), ref (double) and ref (T) vs the loop.
template <class T>
void check_backward(Rng& rng, const Case& c) {
  SCOPED_TRACE(c.str());
  const Inputs<T> in(rng, c);
  const ValidLens lens = in.valid_lens();
  const uint64_t seed = rng.next();
  const AttentionOptions opt = c.options(seed);
  const Tensor<T> d_out = random_tensor<T>(rng, {c.batch, c.nq, c.dv});

  const AttentionResult<T> fwd = scaled_dot_product_attention(in.qv, in.kv, in.vv, lens, opt);
  const DotProductGrads<T> fast = scaled_dot_product_attention_backward(
      in.qv, in.kv, in.vv, lens, opt, {fwd.output, fwd.lse}, d_out);

  const Tensor<double> qd = cast<double>(in.qv), kd = cast<double>(in.kv), vd = cast<double>(in.vv),
                       god = cast<double>(d_out);
  const AttentionResult<double> rfwd = ref::scaled_dot_product_attention(qd, kd, vd, lens, opt);
  const DotProductGrads<double> ref = ref::scaled_dot_product_attention_backward(
      qd, kd, vd, lens, opt, {rfwd.output, rfwd.lse}, god);
  const AttentionResult<T> rfwd_t =
      ref::scaled_dot_product_attention(in.qv, in.kv, in.vv, lens, opt);
  const DotProductGrads<T> ref_t = ref::scaled_dot_product_attention_backward(
      in.qv, in.kv, in.vv, lens, opt, {rfwd_t.output, rfwd_t.lse}, d_out);
  const NaiveDotGrads loop = naive_sdpa_backward<T>(in.qv, in.kv, in.vv, lens, c.effective_scale(),
                                                    c.naive_dropout(seed), d_out.view());
  const Tensor<double> lq = as_tensor({c.batch, c.nq, c.dim}, loop.d_queries);
  const Tensor<double> lk = as_tensor({c.batch, c.nk, c.dim}, loop.d_keys);
  const Tensor<double> lv = as_tensor({c.batch, c.nk, c.dv}, loop.d_values);

  expect_close(fast.d_queries, ref.d_queries, kGrad<T>, "fast d_queries vs ref", "b q d");
  expect_close(fast.d_keys, ref.d_keys, kGrad<T>, "fast d_keys vs ref", "b k d");
  expect_close(fast.d_values, ref.d_values, kGrad<T>, "fast d_values vs ref", "b k d");
  expect_close(ref.d_queries, lq, kSdpaBackwardDouble, "ref d_queries vs loop", "b q d");
  expect_close(ref.d_keys, lk, kSdpaBackwardDouble, "ref d_keys vs loop", "b k d");
  expect_close(ref.d_values, lv, kSdpaBackwardDouble, "ref d_values vs loop", "b k d");
  expect_close(ref_t.d_queries, lq, kGrad<T>, "ref<T> d_queries vs loop", "b q d");
  expect_close(ref_t.d_keys, lk, kGrad<T>, "ref<T> d_keys vs loop", "b k d");
  expect_close(ref_t.d_values, lv, kGrad<T>, "ref<T> d_values vs loop", "b k d");
}

TYPED_TEST(Sdpa, BackwardMatchesRefAndLoop) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t shapes[][2] = {{1, 1}, {3, 17}, {17, 3}, {64, 65}, {65, 129}, {129, 64}, {1, 300}};
  int n = 0;
  for (const auto& s : shapes) {
    for (int variant = 0; variant < 3; ++variant, ++n) {
      Case c;
      c.nq = s[0];
      c.nk = s[1];
      c.dim = kDims[n % 5];
      c.dv = kValueDims[(n + 1) % 5];
      c.lens_form = kAllLensForms[variant];
      c.lens32 = n % 2 == 0;
      if (n % 4 == 1) c.scale = rng.uniform(0.1, 2.0);
      if (n % 3 == 2) {
        c.dropout = 0.3;
        c.training = true;
      }
      if (n % 5 == 3) c.layout = Layout::kStrided;
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
  const AttentionResult<double> fwd = scaled_dot_product_attention(in.q, in.k, in.v, lens, opt);
  const DotProductGrads<double> fast =
      scaled_dot_product_attention_backward(in.q, in.k, in.v, lens, opt, {fwd.output, fwd.lse}, g);
  const AttentionResult<double> rfwd =
      ref::scaled_dot_product_attention(in.q, in.k, in.v, lens, opt);
  const DotProductGrads<double> ref = ref::scaled_dot_product_attention_backward(
      in.q, in.k, in.v, lens, opt, {rfwd.output, rfwd.lse}, g);

  auto loss = [&](const Tensor<double>& q, const Tensor<double>& k, const Tensor<double>& v) {
    return sum_product(scaled_dot_product_attention(q, k, v, lens, opt).output, g);
  };
  // Hundreds of tiny calls: one thread spares the fork-join cost (the results
  // do not depend on the thread count; DeterministicAcrossThreadCounts).
  const ThreadCount one_thread(1);
  const Tensor<double> fd_q =
      numerical_gradient([&](const Tensor<double>& x) { return loss(x, in.k, in.v); }, in.q);
  const Tensor<double> fd_k =
      numerical_gradient([&](const Tensor<double>& x) { return loss(in.q, x, in.v); }, in.k);
  const Tensor<double> fd_v =
      numerical_gradient([&](const Tensor<double>& x) { return loss(in.q, in.k, x); }, in.v);
  expect_close(fast.d_queries, fd_q, kFiniteDiff, "fast d_queries vs finite differences", "b q d");
  expect_close(fast.d_keys, fd_k, kFiniteDiff, "fast d_keys vs finite differences", "b k d");
  expect_close(fast.d_values, fd_v, kFiniteDiff, "fast d_values vs finite differences", "b k d");
  expect_close(ref.d_queries, fd_q, kFiniteDiff, "ref d_queries vs finite differences", "b q d");
  expect_close(ref.d_keys, fd_k, kFiniteDiff, "ref d_keys vs finite differences", "b k d");
  expect_close(ref.d_values, fd_v, kFiniteDiff, "ref d_values vs finite differences", "b k d");
}

TEST(SdpaGradient, FiniteDifferences) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int variant = 0; variant < 6; ++variant) {
    Case c;
    c.batch = 2;
    c.nq = 3;
    c.nk = 5;
    c.dim = 4;
    c.dv = 3;
    switch (variant) {
      case 0:
        break;
      case 1:
        c.lens_form = LensForm::kPerBatch;
        break;
      case 2:
        c.lens_form = LensForm::kPerQuery;  // includes zeros
        break;
      case 3:
        c.dropout = 0.4;
        c.training = true;
        break;
      case 4:
        c.scale = 0.9;
        c.nq = 1;
        c.dim = 7;
        break;
      case 5:
        c.lens_form = LensForm::kPerQuery;
        c.lens32 = true;
        c.dropout = 0.3;
        c.training = true;
        c.scale = 1.7;
        c.nk = 9;
        break;
    }
    check_finite_differences(rng, c);
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
    opt.want_lse = true;

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

// ---- bad input ------------------------------------------------------------------

// A valid problem: queries (2, 3, 4), keys (2, 5, 4), values (2, 5, 6).
struct ErrorFixture {
  Tensor<float> q{Shape{2, 3, 4}}, k{Shape{2, 5, 4}}, v{Shape{2, 5, 6}};
  Tensor<float> out{Shape{2, 3, 6}}, lse{Shape{2, 3}}, d_out{Shape{2, 3, 6}};
};

constexpr const char* kFn = "scaled_dot_product_attention";
constexpr const char* kFnBackward = "scaled_dot_product_attention_backward";

// Expects the fast and the reference forward to reject the arguments.
void expect_forward_error(const ConstView<float>& q, const ConstView<float>& k,
                          const ConstView<float>& v, const ValidLens& lens,
                          const AttentionOptions& opt,
                          std::initializer_list<std::string_view> fragments,
                          std::source_location loc = std::source_location::current()) {
  expect_error([&] { scaled_dot_product_attention(q, k, v, lens, opt); }, fragments, loc);
  expect_error([&] { ref::scaled_dot_product_attention(q, k, v, lens, opt); }, fragments, loc);
  // The double overloads validate alike.
  const Tensor<double> qd = cast<double>(q), kd = cast<double>(k), vd = cast<double>(v);
  expect_error([&] { scaled_dot_product_attention(qd, kd, vd, lens, opt); }, fragments, loc);
}

TEST(SdpaErrors, Shapes) {
  const ErrorFixture f;
  const AttentionOptions opt;
  expect_forward_error(Tensor<float>(Shape{3, 4}), f.k, f.v, {}, opt, {kFn, "queries", "[3, 4]"});
  expect_forward_error(f.q, Tensor<float>(Shape{2, 5, 4, 1}), f.v, {}, opt,
                       {kFn, "keys", "[2, 5, 4, 1]"});
  expect_forward_error(f.q, f.k, Tensor<float>(Shape{5, 6}), {}, opt, {kFn, "values", "[5, 6]"});
  // Batch mismatches.
  expect_forward_error(f.q, Tensor<float>(Shape{7, 5, 4}), Tensor<float>(Shape{7, 5, 6}), {}, opt,
                       {kFn, "keys", "7"});
  expect_forward_error(f.q, f.k, Tensor<float>(Shape{9, 5, 6}), {}, opt, {kFn, "values", "9"});
  // Keys and values disagree on Nk.
  expect_forward_error(f.q, f.k, Tensor<float>(Shape{2, 8, 6}), {}, opt, {kFn, "values", "8", "5"});
  // Feature sizes: keys D = 11 vs queries D = 4; the chapter's D = 3 vs 2.
  expect_forward_error(f.q, Tensor<float>(Shape{2, 5, 11}), f.v, {}, opt, {kFn, "keys", "11", "4"});
  expect_forward_error(Tensor<float>(Shape{2, 1, 2}), Tensor<float>(Shape{2, 10, 3}),
                       Tensor<float>(Shape{2, 10, 4}), {}, opt, {kFn, "3", "2"});
}

TEST(SdpaErrors, ValidLens) {
  const ErrorFixture f;
  const AttentionOptions opt;
  const Tensor<int64_t> wrong_batch(Shape{3}, std::vector<int64_t>{1, 1, 1});
  expect_forward_error(f.q, f.k, f.v, wrong_batch, opt, {kFn, "valid_lens", "[3]"});
  const Tensor<int64_t> wrong_queries(Shape{2, 4}, int64_t{1});
  expect_forward_error(f.q, f.k, f.v, wrong_queries, opt, {kFn, "valid_lens", "[2, 4]"});
  const Tensor<int32_t> rank3(Shape{2, 3, 1}, int32_t{1});
  expect_forward_error(f.q, f.k, f.v, rank3, opt, {kFn, "valid_lens", "[2, 3, 1]"});
  const Tensor<int64_t> too_long(Shape{2}, std::vector<int64_t>{2, 6});
  expect_forward_error(f.q, f.k, f.v, too_long, opt, {kFn, "valid_lens", "6"});
  const Tensor<int32_t> negative(Shape{2, 3}, std::vector<int32_t>{1, 2, 3, 0, -1, 5});
  expect_forward_error(f.q, f.k, f.v, negative, opt, {kFn, "valid_lens", "-1"});
}

TEST(SdpaErrors, DropoutProbability) {
  const ErrorFixture f;
  for (const double p : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    SCOPED_TRACE("p = " + std::to_string(p));
    AttentionOptions opt;
    opt.dropout = p;
    opt.training = true;
    expect_forward_error(f.q, f.k, f.v, {}, opt, {kFn, "dropout"});
    expect_error(
        [&] {
          scaled_dot_product_attention_backward(f.q, f.k, f.v, {}, opt, {f.out, f.lse}, f.d_out);
        },
        {kFnBackward, "dropout"});
  }
}

TEST(SdpaErrors, WriteIntoBuffers) {
  const ErrorFixture f;
  const AttentionOptions opt;
  Tensor<float> out(Shape{2, 3, 6}), bad_out(Shape{2, 3, 7}), w(Shape{2, 3, 5}),
      bad_w(Shape{2, 3, 4}), lse(Shape{2, 3}), bad_lse(Shape{2, 4});
  auto call = [&](const AttentionOutputs<float>& outs) {
    scaled_dot_product_attention(f.q, f.k, f.v, {}, opt, outs);
  };
  expect_error(
      [&] {
        call({bad_out.view(), std::nullopt, std::nullopt});
      },
      {kFn, "output", "[2, 3, 7]"});
  expect_error(
      [&] {
        call({out.view(), bad_w.view(), std::nullopt});
      },
      {kFn, "weights", "[2, 3, 4]"});
  expect_error([&] { call({out.view(), w.view(), bad_lse.view()}); }, {kFn, "lse", "[2, 4]"});
  // A non-contiguous destination (every other element of a bigger buffer).
  std::vector<float> spread(2 * 3 * 6 * 2);
  const TensorView<float> strided_out(spread.data(), Shape{2, 3, 6}, Shape{36, 12, 2});
  expect_error([&] { call({strided_out, std::nullopt, std::nullopt}); }, {kFn, "output"});
}

TEST(SdpaErrors, Backward) {
  const ErrorFixture f;
  const AttentionOptions opt;
  const Tensor<float> bad_out(Shape{2, 3, 5}), bad_lse(Shape{2, 4}), bad_d_out(Shape{2, 3, 7});
  auto check = [&](auto&& call) {
    expect_error([&] { call(bad_out, f.lse, f.d_out); }, {kFnBackward, "output", "[2, 3, 5]"});
    expect_error([&] { call(f.out, bad_lse, f.d_out); }, {kFnBackward, "lse", "[2, 4]"});
    expect_error([&] { call(f.out, ConstView<float>(), f.d_out); }, {kFnBackward, "lse"});
    expect_error([&] { call(f.out, f.lse, bad_d_out); }, {kFnBackward, "d_output", "[2, 3, 7]"});
  };
  check([&](ConstView<float> out, ConstView<float> lse, ConstView<float> d_out) {
    scaled_dot_product_attention_backward(f.q, f.k, f.v, {}, opt, {out, lse}, d_out);
  });
  check([&](ConstView<float> out, ConstView<float> lse, ConstView<float> d_out) {
    ref::scaled_dot_product_attention_backward(f.q, f.k, f.v, {}, opt, {out, lse}, d_out);
  });
  // The backward validates the inputs like the forward.
  const Tensor<float> bad_k(Shape{2, 5, 11});
  expect_error(
      [&] {
        scaled_dot_product_attention_backward(f.q, bad_k, f.v, {}, opt, {f.out, f.lse}, f.d_out);
      },
      {kFnBackward, "11", "4"});
  const Tensor<int64_t> too_long(Shape{2}, std::vector<int64_t>{2, 6});
  expect_error(
      [&] {
        scaled_dot_product_attention_backward(f.q, f.k, f.v, too_long, opt, {f.out, f.lse},
                                              f.d_out);
      },
      {kFnBackward, "valid_lens", "6"});
}

}  // namespace
}  // namespace qkv::test
