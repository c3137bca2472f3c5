// Masks of scaled dot-product attention (AttentionOptions::mask, key_mask,
// window_left/right; docs/semantics.md, "Masks and windows"): the fused
// kernels against the float64 reference, which gives a masked score -inf
// before its softmax, forward and backward, on random cases across mask
// broadcast forms, key masks, windows, lengths, causal alignments, dropout,
// heads (grouped too) and Nq != Nk; exact masking (weight exactly 0 where
// masked, a query with no key left all zeros with lse -inf and zero
// gradients); the same results as the equivalent lengths and causal masks;
// the same bits for any thread count; bf16; every error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attention_testing.h"
#include "qkv/qkv.h"
#include "test_util.h"
#include "tolerances.h"

namespace qkv::test {
namespace {

// The broadcast forms of a mask against scores (B, H, Nq, Nk).
enum class MaskForm { kNone, kFull, kQueriesKeys, kPerBatch, kPerHeadKeys, kPerQuery };

Shape mask_shape(MaskForm form, int64_t b, int64_t h, int64_t nq, int64_t nk) {
  switch (form) {
    case MaskForm::kNone:
      return Shape{};
    case MaskForm::kFull:
      return Shape{b, h, nq, nk};
    case MaskForm::kQueriesKeys:
      return Shape{nq, nk};
    case MaskForm::kPerBatch:
      return Shape{b, 1, nq, nk};
    case MaskForm::kPerHeadKeys:
      return Shape{1, h, 1, nk};
    case MaskForm::kPerQuery:  // one value per query row, the same for every key
      return Shape{b, 1, nq, 1};
  }
  return Shape{};
}

struct MaskCase {
  int64_t batch, heads, kv_heads, nq, nk, d, dv;
  MaskForm mask;
  bool key_mask;
  int64_t window_left, window_right;
  LensForm lens;
  Causal causal;
  double dropout;
  bool weights;
  MaskForm bias = MaskForm::kNone;  // a float bias of this form, with its gradient
};

std::string describe(const MaskCase& c) {
  return "B=" + std::to_string(c.batch) + " H=" + std::to_string(c.heads) +
         " Hkv=" + std::to_string(c.kv_heads) + " Nq=" + std::to_string(c.nq) +
         " Nk=" + std::to_string(c.nk) + " D=" + std::to_string(c.d) +
         " Dv=" + std::to_string(c.dv) + " mask=" + std::to_string(static_cast<int>(c.mask)) +
         " key_mask=" + std::to_string(c.key_mask) + " window=(" + std::to_string(c.window_left) +
         ", " + std::to_string(c.window_right) +
         ") lens=" + std::to_string(static_cast<int>(c.lens)) +
         " causal=" + std::to_string(static_cast<int>(c.causal)) +
         " dropout=" + std::to_string(c.dropout) + " weights=" + std::to_string(c.weights) +
         " bias=" + std::to_string(static_cast<int>(c.bias));
}

template <class T>
struct MaskProblem {
  Tensor<T> q, k, v;
  Tensor<uint8_t> mask, key_mask;
  Tensor<T> bias;
  OwnedLens lens;
  AttentionOptions options;
};

Tensor<uint8_t> random_bits(Rng& rng, const Shape& shape, double keep) {
  Tensor<uint8_t> t(shape);
  for (uint8_t& x : t.values()) x = rng.bernoulli(keep) ? 1 : 0;
  return t;
}

template <class T>
MaskProblem<T> make_problem(Rng& rng, const MaskCase& c) {
  MaskProblem<T> p;
  p.q = random_tensor<T>(rng, {c.batch, c.heads, c.nq, c.d});
  p.k = random_tensor<T>(rng, {c.batch, c.kv_heads, c.nk, c.d});
  p.v = random_tensor<T>(rng, {c.batch, c.kv_heads, c.nk, c.dv});
  if (c.mask != MaskForm::kNone) {
    p.mask = random_bits(rng, mask_shape(c.mask, c.batch, c.heads, c.nq, c.nk), 0.5);
    p.options.mask = p.mask.view();
  }
  if (c.key_mask) {
    p.key_mask = random_bits(rng, Shape{c.batch, c.nk}, 0.7);
    p.options.key_mask = p.key_mask.view();
  }
  if (c.bias != MaskForm::kNone) {
    // N(0, 2) (ALiBi-like magnitudes) with a tenth of the keys -inf.
    p.bias = random_tensor<T>(rng, mask_shape(c.bias, c.batch, c.heads, c.nq, c.nk));
    for (T& x : p.bias.values()) {
      x = rng.bernoulli(0.1) ? -std::numeric_limits<T>::infinity() : T(2) * x;
    }
    p.options.bias = ConstView<T>(p.bias.view());
    p.options.want_bias_grad = true;
  }
  p.options.window_left = c.window_left;
  p.options.window_right = c.window_right;
  p.lens = make_lens(rng, c.lens, rng.bernoulli(0.5), c.batch, c.nq, c.nk, 0.1);
  p.options.causal = c.causal;
  p.options.dropout_p = c.dropout;
  p.options.training = c.dropout > 0.0;
  p.options.seed = rng.next();
  p.options.return_weights = c.weights;
  p.options.return_lse = true;
  return p;
}

// Whether query i of head (b, h) sees key j: the lengths, causal, window and
// both masks, written out from their definitions.
template <class T>
bool sees(const MaskCase& c, const MaskProblem<T>& p, int64_t b, int64_t h, int64_t i, int64_t j) {
  int64_t len = p.lens.at(b, i, c.nk);
  if (c.causal == Causal::kTopLeft) len = std::min(len, std::clamp<int64_t>(i + 1, 0, c.nk));
  if (c.causal == Causal::kBottomRight) {
    len = std::min(len, std::clamp<int64_t>(i + 1 + c.nk - c.nq, 0, c.nk));
  }
  if (j >= len) return false;
  const int64_t diagonal = i + c.nk - c.nq;
  if (c.window_left >= 0 && j < diagonal - c.window_left) return false;
  if (c.window_right >= 0 && j > diagonal + c.window_right) return false;
  if (c.key_mask && p.key_mask(b, j) == 0) return false;
  if (c.mask != MaskForm::kNone) {
    const Shape s = p.mask.shape();
    const auto at = [&](int64_t idx, int axis) { return s[axis] == 1 ? 0 : idx; };
    const uint8_t m = s.rank() == 2 ? p.mask(i, j) : p.mask(at(b, 0), at(h, 1), at(i, 2), at(j, 3));
    if (m == 0) return false;
  }
  if (c.bias != MaskForm::kNone) {  // a -inf bias leaves the key out too
    const Shape s = p.bias.shape();
    const auto at = [&](int64_t idx, int axis) { return s[axis] == 1 ? 0 : idx; };
    const T x =
        s.rank() == 2 ? p.bias(at(i, 0), at(j, 1)) : p.bias(at(b, 0), at(h, 1), at(i, 2), at(j, 3));
    if (x == -std::numeric_limits<T>::infinity()) return false;
  }
  return true;
}

template <class T>
void check_case(Rng& rng, const MaskCase& c) {
  SCOPED_TRACE(describe(c));
  const MaskProblem<T> p = make_problem<T>(rng, c);
  const ValidLens lens = p.lens.get();
  const AttentionResult<T> got = scaled_dot_product_attention(p.q, p.k, p.v, lens, p.options);
  const AttentionResult<T> ref = ref::scaled_dot_product_attention(p.q, p.k, p.v, lens, p.options);
  constexpr bool kFloat = std::is_same_v<T, float>;
  ASSERT_TRUE(expect_close(got.output, ref.output, kFloat ? kSdpa : kSdpaDouble, "output"));
  ASSERT_TRUE(expect_close(got.lse, ref.lse, kFloat ? kSdpaLse : kSdpaLseDouble, "lse"));
  // Exact masking, from the definitions: weight exactly 0 where a key is not
  // seen; a query that sees none has output 0 and lse -inf.
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.heads; ++h)
      for (int64_t i = 0; i < c.nq; ++i) {
        bool any = false;
        for (int64_t j = 0; j < c.nk; ++j) {
          const bool seen = sees(c, p, b, h, i, j);
          any = any || seen;
          if (c.weights && !seen) {
            ASSERT_EQ(got.weights(b, h, i, j), T(0))
                << "masked weight b=" << b << " h=" << h << " i=" << i << " j=" << j;
          }
        }
        if (!any) {
          ASSERT_EQ(got.lse(b, h, i), -std::numeric_limits<T>::infinity()) << "i=" << i;
          for (int64_t e = 0; e < c.dv; ++e) ASSERT_EQ(got.output(b, h, i, e), T(0));
        }
      }
  if (c.weights) {
    ASSERT_TRUE(
        expect_close(got.weights, ref.weights, kFloat ? kSoftmax : kSoftmaxDouble, "weights"));
  }
  const Tensor<T> d_out = random_tensor<T>(rng, {c.batch, c.heads, c.nq, c.dv});
  const DotProductGrads<T> g = scaled_dot_product_attention_backward(p.q, p.k, p.v, lens, p.options,
                                                                     {got.output, got.lse}, d_out);
  const DotProductGrads<T> r = ref::scaled_dot_product_attention_backward(
      p.q, p.k, p.v, lens, p.options, {ref.output, ref.lse}, d_out);
  const Tol back = kFloat ? kSdpaBackward : kSdpaBackwardDouble;
  expect_close(g.d_queries, r.d_queries, back, "d_queries");
  expect_close(g.d_keys, r.d_keys, back, "d_keys");
  expect_close(g.d_values, r.d_values, back, "d_values");
  if (c.bias != MaskForm::kNone) {
    ASSERT_EQ(g.d_bias.shape(), p.bias.shape());
    expect_close(g.d_bias, r.d_bias, back, "d_bias");
  }
}

MaskCase random_case(Rng& rng) {
  static const int64_t kGroups[][2] = {{1, 1}, {4, 4}, {4, 2}, {6, 1}};
  const auto& g = kGroups[rng.uniform_int(0, 3)];
  const int64_t nq = rng.bernoulli(0.2) ? rng.uniform_int(1, 3) : rng.uniform_int(1, 520);
  const int64_t nk = rng.uniform_int(1, 700);
  static const int64_t kDims[] = {1, 8, 16, 64};
  const bool window = rng.bernoulli(0.4);
  return MaskCase{
      rng.uniform_int(1, 2),
      g[0],
      g[1],
      nq,
      nk,
      kDims[rng.uniform_int(0, 3)],
      kDims[rng.uniform_int(0, 3)],
      static_cast<MaskForm>(rng.uniform_int(0, 5)),
      rng.bernoulli(0.4),
      window ? rng.uniform_int(-1, 300) : -1,
      window ? rng.uniform_int(-1, 40) : -1,
      static_cast<LensForm>(rng.uniform_int(0, 2)),
      static_cast<Causal>(rng.uniform_int(0, 2)),
      rng.bernoulli(0.3) ? 0.2 : 0.0,
      rng.bernoulli(0.3),
      rng.bernoulli(0.5) ? static_cast<MaskForm>(rng.uniform_int(1, 5)) : MaskForm::kNone};
}

template <class T>
class Masks : public ::testing::Test {};
using MaskTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Masks, MaskTypes, TypeNames);

TYPED_TEST(Masks, MatchTheReferenceForwardAndBackward) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  std::vector<MaskCase> cases = {
      // Every form once: half the keys masked at random (several query and
      // key blocks), a key mask, a sliding window of 256 with lengths, heads
      // per batch, grouped heads decoding against a padded cache.
      {2, 2, 2, 300, 600, 32, 16, MaskForm::kFull, false, -1, -1, LensForm::kNone, Causal::kNone,
       0.0, true},
      {1, 4, 2, 520, 520, 16, 16, MaskForm::kQueriesKeys, true, -1, -1, LensForm::kPerQuery,
       Causal::kTopLeft, 0.2, false},
      {2, 1, 1, 600, 600, 8, 8, MaskForm::kNone, false, 256, 0, LensForm::kPerBatch, Causal::kNone,
       0.0, true},
      {2, 3, 3, 40, 900, 16, 8, MaskForm::kPerBatch, true, 100, 20, LensForm::kNone,
       Causal::kBottomRight, 0.0, false},
      {1, 8, 2, 1, 3000, 64, 64, MaskForm::kPerHeadKeys, true, -1, -1, LensForm::kPerBatch,
       Causal::kNone, 0.0, false},
      // Masks that leave some queries no key at all.
      {2, 2, 1, 50, 30, 8, 4, MaskForm::kFull, true, 2, 1, LensForm::kPerQuery, Causal::kNone, 0.0,
       true},
      // Biases: full; (Nq, Nk) shared by batch elements and grouped heads,
      // with causal and dropout; per head and key against a long cache
      // (decoding); constant along the keys (no effect, gradient 0).
      {2, 2, 2, 300, 600, 32, 16, MaskForm::kNone, false, -1, -1, LensForm::kNone, Causal::kNone,
       0.0, true, MaskForm::kFull},
      {2, 4, 2, 520, 520, 16, 16, MaskForm::kNone, false, -1, -1, LensForm::kPerQuery,
       Causal::kTopLeft, 0.2, false, MaskForm::kQueriesKeys},
      {2, 8, 2, 1, 3000, 64, 64, MaskForm::kNone, true, -1, -1, LensForm::kPerBatch, Causal::kNone,
       0.0, false, MaskForm::kPerHeadKeys},
      {2, 2, 1, 50, 300, 8, 4, MaskForm::kQueriesKeys, false, -1, -1, LensForm::kNone,
       Causal::kNone, 0.2, true, MaskForm::kPerQuery},
  };
  const int random_cases = kSanitized ? 4 : 30;
  for (int n = 0; n < random_cases; ++n) cases.push_back(random_case(rng));
  for (const MaskCase& c : cases) {
    check_case<TypeParam>(rng, c);
    if (::testing::Test::HasFailure()) return;
  }
}

// The masks that say what lengths and causal say give their results.
TYPED_TEST(Masks, EqualTheLengthsAndCausalTheyRestate) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t batch = 2, heads = 2, nq = 300, nk = 500, d = 16;
  const Tensor<T> q = random_tensor<T>(rng, {batch, heads, nq, d});
  const Tensor<T> k = random_tensor<T>(rng, {batch, heads, nk, d});
  const Tensor<T> v = random_tensor<T>(rng, {batch, heads, nk, d});
  const Tol tol = tol_for<T>(kSdpa, kSdpaDouble);
  // tril(Nq, Nk) as a mask == Causal::kTopLeft.
  Tensor<uint8_t> tril(Shape{nq, nk});
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t j = 0; j < nk; ++j) tril(i, j) = j <= i ? 1 : 0;
  AttentionOptions masked, causal;
  masked.mask = tril.view();
  causal.causal = Causal::kTopLeft;
  expect_close(scaled_dot_product_attention(q, k, v, {}, masked).output,
               scaled_dot_product_attention(q, k, v, {}, causal).output, tol, "tril mask");
  // A key mask of prefixes == valid_lens (B).
  const Tensor<int64_t> lens(Shape{batch}, std::vector<int64_t>{137, 444});
  Tensor<uint8_t> prefixes(Shape{batch, nk});
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < nk; ++j) prefixes(b, j) = j < lens.data()[b] ? 1 : 0;
  AttentionOptions keys;
  keys.key_mask = prefixes.view();
  expect_close(scaled_dot_product_attention(q, k, v, {}, keys).output,
               scaled_dot_product_attention(q, k, v, ValidLens(lens)).output, tol, "key mask");
}

// window (-1, 0) is Causal::kBottomRight, bit for bit (the window's right
// side is a cap on the lengths: pipeline.h's kernel_lens), forward and
// backward, for Nq below, at and above Nk and with lengths; window (-1, r) is
// the cap at Nk - Nq + r, and with causal the tighter of the two caps.
TYPED_TEST(Masks, WindowRightSideIsTheCausalCapBitForBit) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (const auto& [nq, nk] : {std::pair<int64_t, int64_t>{300, 500}, {257, 257}, {500, 300}}) {
    SCOPED_TRACE("Nq=" + std::to_string(nq) + " Nk=" + std::to_string(nk));
    const int64_t batch = 2, heads = 2, d = 16;
    const Tensor<T> q = random_tensor<T>(rng, {batch, heads, nq, d});
    const Tensor<T> k = random_tensor<T>(rng, {batch, heads, nk, d});
    const Tensor<T> v = random_tensor<T>(rng, {batch, heads, nk, d});
    const Tensor<T> d_out = random_tensor<T>(rng, {batch, heads, nq, d});
    const Tensor<int64_t> lens(Shape{batch}, std::vector<int64_t>{nk - 37, nk});
    const auto same = [&](AttentionOptions a, AttentionOptions b, const char* what) {
      SCOPED_TRACE(what);
      a.return_lse = b.return_lse = true;  // the backward reads it
      for (const bool with_lens : {false, true}) {
        const ValidLens vl = with_lens ? ValidLens(lens) : ValidLens();
        const AttentionResult<T> ra = scaled_dot_product_attention(q, k, v, vl, a);
        const AttentionResult<T> rb = scaled_dot_product_attention(q, k, v, vl, b);
        expect_bitwise_equal(ra.output, rb.output, "output");
        expect_bitwise_equal(ra.lse, rb.lse, "lse");
        const DotProductGrads<T> ga =
            scaled_dot_product_attention_backward(q, k, v, vl, a, {ra.output, ra.lse}, d_out);
        const DotProductGrads<T> gb =
            scaled_dot_product_attention_backward(q, k, v, vl, b, {rb.output, rb.lse}, d_out);
        expect_bitwise_equal(ga.d_queries, gb.d_queries, "d_queries");
        expect_bitwise_equal(ga.d_keys, gb.d_keys, "d_keys");
        expect_bitwise_equal(ga.d_values, gb.d_values, "d_values");
      }
    };
    AttentionOptions window, bottom_right;
    window.window_right = 0;
    bottom_right.causal = Causal::kBottomRight;
    same(window, bottom_right, "window (-1, 0) against kBottomRight");
    // window (-1, 7) against a mask of the same keys (another path: close).
    AttentionOptions right7, mask7;
    right7.window_right = 7;
    Tensor<uint8_t> band(Shape{nq, nk});
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t j = 0; j < nk; ++j) band(i, j) = j <= i + nk - nq + 7 ? 1 : 0;
    mask7.mask = band.view();
    expect_close(scaled_dot_product_attention(q, k, v, {}, right7).output,
                 scaled_dot_product_attention(q, k, v, {}, mask7).output,
                 tol_for<T>(kSdpa, kSdpaDouble), "window (-1, 7) against its mask");
    // Both caps: the tighter wins.
    AttentionOptions both = bottom_right;
    both.window_right = 7;
    same(both, bottom_right, "kBottomRight with window (-1, 7) against kBottomRight");
    AttentionOptions top_left = both;
    top_left.causal = Causal::kTopLeft;
    AttentionOptions top_left_only;
    top_left_only.causal = Causal::kTopLeft;
    if (nq <= nk) same(top_left, top_left_only, "kTopLeft with window (-1, 7) against kTopLeft");
  }
}

TYPED_TEST(Masks, SameBitsForAnyThreadCount) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const MaskCase c{2,
                   4,
                   2,
                   300,
                   700,
                   32,
                   32,
                   MaskForm::kFull,
                   true,
                   200,
                   10,
                   LensForm::kPerBatch,
                   Causal::kNone,
                   0.3,
                   false,
                   MaskForm::kQueriesKeys};
  const MaskProblem<T> p = make_problem<T>(rng, c);
  const Tensor<T> d_out = random_tensor<T>(rng, {c.batch, c.heads, c.nq, c.dv});
  expect_sdpa_same_bits_for_thread_counts(p.q, p.k, p.v, p.lens.get(), p.options, d_out);
}

// The bias gradient against central differences of sum(output * d_out) in
// float64, for a bias of each broadcast form (the reference's dS is checked
// the same way, so both are held to the definition, not to each other).
TEST(BiasGradient, MatchesFiniteDifferences) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t batch = 2, heads = 2, kv_heads = 1, nq = 5, nk = 7, d = 4;
  const Tensor<double> q = random_tensor<double>(rng, {batch, heads, nq, d});
  const Tensor<double> k = random_tensor<double>(rng, {batch, kv_heads, nk, d});
  const Tensor<double> v = random_tensor<double>(rng, {batch, kv_heads, nk, d});
  const Tensor<double> d_out = random_tensor<double>(rng, {batch, heads, nq, d});
  for (const MaskForm form : {MaskForm::kFull, MaskForm::kQueriesKeys, MaskForm::kPerBatch,
                              MaskForm::kPerHeadKeys, MaskForm::kPerQuery}) {
    SCOPED_TRACE("bias form " + std::to_string(static_cast<int>(form)));
    Tensor<double> bias = random_tensor<double>(rng, mask_shape(form, batch, heads, nq, nk));
    AttentionOptions o;
    o.causal = Causal::kBottomRight;
    o.bias = ConstView<double>(bias.view());
    o.want_bias_grad = true;
    o.return_lse = true;
    const auto loss = [&] { return sdpa_dot_loss(q, k, v, o, d_out); };
    const AttentionResult<double> fwd = scaled_dot_product_attention(q, k, v, {}, o);
    const Tensor<double> got =
        scaled_dot_product_attention_backward(q, k, v, {}, o, {fwd.output, fwd.lse}, d_out).d_bias;
    const Tensor<double> ref =
        ref::scaled_dot_product_attention_backward(q, k, v, {}, o, {fwd.output, fwd.lse}, d_out)
            .d_bias;
    ASSERT_EQ(got.shape(), bias.shape());
    const double h = 1e-6;
    for (int64_t e = 0; e < bias.numel(); ++e) {
      const double x = bias.data()[e];
      bias.data()[e] = x + h;
      const double up = loss();
      bias.data()[e] = x - h;
      const double down = loss();
      bias.data()[e] = x;
      const double numeric = (up - down) / (2 * h);
      EXPECT_NEAR(got.data()[e], numeric, 1e-8) << "element " << e;
      EXPECT_NEAR(ref.data()[e], numeric, 1e-8) << "element " << e;
    }
    if (form == MaskForm::kPerQuery) {  // constant along the keys: exactly 0
      for (const double g : got.values()) EXPECT_EQ(g, 0.0);
    }
  }
}

// A bias constant along the keys moves the lse by itself: with a gradient
// d_lse at the lse, its gradient is d_lse summed over the heads it is
// shared by (0 without one, as above), fast and reference alike.
TEST(BiasGradient, KeyConstantBiasGetsTheLseGradient) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t batch = 2, heads = 3, nq = 300, nk = 400, d = 16;
  const Tensor<double> q = random_tensor<double>(rng, {batch, heads, nq, d});
  const Tensor<double> k = random_tensor<double>(rng, {batch, heads, nk, d});
  const Tensor<double> v = random_tensor<double>(rng, {batch, heads, nk, d});
  const Tensor<double> d_out = random_tensor<double>(rng, {batch, heads, nq, d});
  const Tensor<double> d_lse = random_tensor<double>(rng, {batch, heads, nq});
  const Tensor<double> bias = random_tensor<double>(rng, {batch, 1, nq, 1});
  AttentionOptions o;
  o.bias = ConstView<double>(bias.view());
  o.want_bias_grad = true;
  o.return_lse = true;
  const AttentionResult<double> fwd = scaled_dot_product_attention(q, k, v, {}, o);
  Tensor<double> want(bias.shape(), 0.0);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < nq; ++i) want(b, 0, i, 0) += d_lse(b, h, i);
  for (const bool fast : {true, false}) {
    SCOPED_TRACE(fast ? "fast" : "reference");
    const Tensor<double> got = fast ? scaled_dot_product_attention_backward(
                                          q, k, v, {}, o, {fwd.output, fwd.lse}, d_out, d_lse)
                                          .d_bias
                                    : ref::scaled_dot_product_attention_backward(
                                          q, k, v, {}, o, {fwd.output, fwd.lse}, d_out, d_lse)
                                          .d_bias;
    expect_close(got, want, kSdpaBackwardDouble, "d_bias");
  }
}

// bf16 inputs with masks against the float reference on the widened inputs
// (docs/semantics.md's bound: 2^-8 max|v| / (1 - p) plus float rounding).
TEST(MasksBf16, MatchTheFloatReferenceOnWidenedInputs) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const MaskCase cases[] = {
      {2, 4, 2, 300, 600, 64, 64, MaskForm::kFull, true, -1, -1, LensForm::kNone, Causal::kNone,
       0.0, false},
      {1, 8, 1, 1, 2000, 64, 64, MaskForm::kPerHeadKeys, true, 500, 0, LensForm::kNone,
       Causal::kNone, 0.0, false, MaskForm::kPerHeadKeys},
      {1, 4, 4, 200, 300, 64, 64, MaskForm::kNone, false, -1, -1, LensForm::kNone, Causal::kTopLeft,
       0.0, false, MaskForm::kQueriesKeys},
  };
  for (const MaskCase& c : cases) {
    SCOPED_TRACE(describe(c));
    const MaskProblem<float> p = make_problem<float>(rng, c);
    Tensor<bfloat16> qb(p.q.shape()), kb(p.k.shape()), vb(p.v.shape());
    Tensor<float> qw(p.q.shape()), kw(p.k.shape()), vw(p.v.shape());
    double max_v = 0;
    for (const auto& [src, dst, wide] :
         {std::tuple{&p.q, &qb, &qw}, {&p.k, &kb, &kw}, {&p.v, &vb, &vw}}) {
      for (int64_t e = 0; e < src->numel(); ++e) {
        dst->data()[e] = bfloat16(src->data()[e]);
        wide->data()[e] = static_cast<float>(dst->data()[e]);
      }
    }
    for (const float x : vw.values()) max_v = std::max(max_v, std::abs(static_cast<double>(x)));
    const AttentionResult<float> got =
        scaled_dot_product_attention(qb, kb, vb, p.lens.get(), p.options);
    const AttentionResult<float> ref =
        ref::scaled_dot_product_attention(qw, kw, vw, p.lens.get(), p.options);
    expect_close(got.output, ref.output, Tol{.atol = (0x1p-8 + 1e-5) * max_v, .rtol = 0}, "output");
    expect_close(got.lse, ref.lse, kSdpaLse, "lse");
  }
}

// No batch (B = 0) or no heads with a bias: nothing to compute, and the
// bias gradient of a (Nq, Nk) bias is all zeros (every element written).
TEST(BiasGradient, EmptyBatchGivesZeros) {
  for (const int64_t batch : {0, 2}) {
    const int64_t heads = batch == 0 ? 2 : 0;
    const Tensor<float> q(Shape{batch, heads, 3, 4}), k(Shape{batch, heads, 5, 4});
    const Tensor<float> v(Shape{batch, heads, 5, 2}), d_out(Shape{batch, heads, 3, 2});
    const Tensor<float> bias(Shape{3, 5}, 1.0f);
    AttentionOptions o;
    o.bias = ConstView<float>(bias.view());
    o.want_bias_grad = true;
    o.return_lse = true;
    const AttentionResult<float> r = scaled_dot_product_attention(q, k, v, {}, o);
    for (const bool fast : {true, false}) {
      const DotProductGrads<float> g =
          fast ? scaled_dot_product_attention_backward(q, k, v, {}, o, {r.output, r.lse}, d_out)
               : ref::scaled_dot_product_attention_backward(q, k, v, {}, o, {r.output, r.lse},
                                                            d_out);
      ASSERT_EQ(g.d_bias.shape(), bias.shape());
      for (const float x : g.d_bias.values()) EXPECT_EQ(x, 0.0f) << "fast " << fast;
    }
  }
}

TEST(MasksErrors, NameTheShapes) {
  const Tensor<float> q(Shape{2, 4, 5, 8}), k(Shape{2, 2, 7, 8}), v(Shape{2, 2, 7, 3});
  const Tensor<uint8_t> wrong(Shape{2, 3, 5, 7}), keys_wrong(Shape{2, 6}), good(Shape{5, 7});
  AttentionOptions o;
  o.mask = wrong.view();
  expect_error([&] { scaled_dot_product_attention(q, k, v, {}, o); },
               {"scaled_dot_product_attention",
                "options.mask has shape [2, 3, 5, 7], which does not broadcast to the scores "
                "[2, 4, 5, 7]"});
  o = AttentionOptions{};
  o.key_mask = keys_wrong.view();
  expect_error([&] { scaled_dot_product_attention(q, k, v, {}, o); },
               {"options.key_mask has shape [2, 6]; expected [2, 7]"});
  o = AttentionOptions{};
  const Tensor<float> bias_wrong(Shape{3, 1, 7});
  o.bias = ConstView<float>(bias_wrong.view());
  expect_error([&] { scaled_dot_product_attention(q, k, v, {}, o); },
               {"options.bias has shape [3, 1, 7], which does not broadcast to the scores "
                "[2, 4, 5, 7]"});
  const Tensor<double> bias64(Shape{5, 7});
  o.bias = ConstView<double>(bias64.view());
  expect_error([&] { scaled_dot_product_attention(q, k, v, {}, o); },
               {"options.bias is float64 but the inputs compute in float32"});
  o = AttentionOptions{};
  o.want_bias_grad = true;
  {
    const Tensor<float> out(Shape{2, 4, 5, 3}), lse(Shape{2, 4, 5});
    expect_error(
        [&] {
          scaled_dot_product_attention_backward(q, k, v, {}, o, {out, lse}, out);
        },
        {"scaled_dot_product_attention_backward",
         "options.want_bias_grad is set but options.bias is empty"});
  }
  o = AttentionOptions{};
  o.window_left = -2;
  expect_error([&] { scaled_dot_product_attention(q, k, v, {}, o); },
               {"options.window_left = -2 is below -1"});
  // 3-D scores (B, Nq, Nk): a mask of rank 4 does not fit.
  const Tensor<float> q3(Shape{2, 5, 8}), k3(Shape{2, 7, 8}), v3(Shape{2, 7, 3});
  const Tensor<uint8_t> rank4(Shape{2, 1, 5, 7});
  o = AttentionOptions{};
  o.mask = rank4.view();
  expect_error([&] { scaled_dot_product_attention(q3, k3, v3, {}, o); }, {"scores [2, 5, 7]"});
  // The backward checks the same.
  o = AttentionOptions{};
  o.mask = wrong.view();
  const Tensor<float> out(Shape{2, 4, 5, 3}), lse(Shape{2, 4, 5});
  expect_error(
      [&] {
        scaled_dot_product_attention_backward(q, k, v, {}, o, {out, lse}, out);
      },
      {"scaled_dot_product_attention_backward", "options.mask"});
  // Additive attention takes none of them.
  const Tensor<float> w_q(Shape{4, 8}), w_k(Shape{4, 8}), w_v(Shape{4});
  o = AttentionOptions{};
  o.mask = good.view();
  expect_error(
      [&] {
        additive_attention(q3, k3, v3, {w_q, w_k, w_v}, {}, o);
      },
      {"additive_attention", "are for scaled dot-product attention"});
  const Tensor<float> bias_good(Shape{5, 7});
  o = AttentionOptions{};
  o.bias = ConstView<float>(bias_good.view());
  expect_error(
      [&] {
        additive_attention(q3, k3, v3, {w_q, w_k, w_v}, {}, o);
      },
      {"additive_attention", "are for scaled dot-product attention"});
}

}  // namespace
}  // namespace qkv::test
