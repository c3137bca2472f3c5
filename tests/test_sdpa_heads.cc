// Scaled dot-product attention with heads (docs/semantics.md, "Heads"):
// queries (B, H, Nq, D), keys (B, Hkv, Nk, D), values (B, Hkv, Nk, Dv) as
// views of any strides, H a multiple of Hkv. The definition the tests hold
// the kernels to: heads are a batch of B H, each query head reading key
// head h / (H / Hkv), lengths repeated over the heads of a batch element,
// dropout drawn from (seed, b H + h, i, j). So the 4-D call must give the
// bits of the 3-D call on gathered copies (B H, N, D) whenever the two run
// the same tasks (no grouped heads in the backward, whose dK and dV sums
// over a group the 3-D call does not form), and the float64 reference
// otherwise. Layouts: contiguous, (B, N, H, D) memory as one fused
// projection leaves it, rows padded apart, heads and batch reversed
// (negative strides), and one that must be copied (D not unit stride).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "attention_testing.h"
#include "qkv/qkv.h"
#include "test_util.h"
#include "tolerances.h"

namespace qkv::test {
namespace {

enum class Layout { kContiguous, kTokenMajor, kPaddedRows, kReversedHeads, kReversedBatch, kCopied };

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kContiguous:
      return "contiguous";
    case Layout::kTokenMajor:
      return "(B, N, H, D) memory";
    case Layout::kPaddedRows:
      return "padded rows";
    case Layout::kReversedHeads:
      return "heads reversed";
    case Layout::kReversedBatch:
      return "batch reversed";
    case Layout::kCopied:
      return "D strided (copied)";
  }
  return "?";
}

// A (B, H, N, D) view of `layout` over memory owned here.
template <class T>
struct Strided {
  std::vector<T> memory;
  TensorView<T> view;
};

template <class T>
Strided<T> strided(const Shape& shape, Layout layout) {
  const int64_t b = shape[0], h = shape[1], n = shape[2], d = shape[3];
  Strided<T> s;
  Shape strides;
  int64_t offset = 0, size = b * h * n * d;
  switch (layout) {
    case Layout::kContiguous:
      strides = Shape{h * n * d, n * d, d, 1};
      break;
    case Layout::kTokenMajor:
      strides = Shape{n * h * d, d, h * d, 1};
      break;
    case Layout::kPaddedRows: {
      const int64_t row = d + 3;  // rows 3 elements apart, heads interleaved
      strides = Shape{n * h * row, row, h * row, 1};
      size = b * n * h * row;
      break;
    }
    case Layout::kReversedHeads:
      strides = Shape{h * n * d, -n * d, d, 1};
      offset = (h - 1) * n * d;
      break;
    case Layout::kReversedBatch:
      strides = Shape{-n * h * d, d, h * d, 1};
      offset = (b - 1) * n * h * d;
      break;
    case Layout::kCopied:
      strides = Shape{h * n * d, n * d, 1, n};  // (B, H, D, N) memory
      break;
  }
  s.memory.assign(static_cast<size_t>(std::max<int64_t>(size, 1)), T(0));
  s.view = TensorView<T>(s.memory.data() + std::max<int64_t>(offset, 0), shape, strides);
  return s;
}

template <class T>
Strided<T> random_strided(Rng& rng, const Shape& shape, Layout layout) {
  Strided<T> s = strided<T>(shape, layout);
  for (int64_t b = 0; b < shape[0]; ++b)
    for (int64_t h = 0; h < shape[1]; ++h)
      for (int64_t n = 0; n < shape[2]; ++n)
        for (int64_t c = 0; c < shape[3]; ++c) {
          const float x = static_cast<float>(rng.uniform(-1.0, 1.0));
          s.view(b, h, n, c) = static_cast<T>(x);
        }
  return s;
}

// (B, H, N, D) of any strides -> (B H, N, D) contiguous; with `repeat` > 1,
// each head repeated for that many consecutive query heads.
template <class T>
Tensor<T> gathered(ConstView<T> x, int64_t repeat) {
  const int64_t b = x.size(0), h = x.size(1), n = x.size(2), d = x.size(3);
  Tensor<T> out(Shape{b * h * repeat, n, d});
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t hi = 0; hi < h * repeat; ++hi)
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < d; ++c) out(bi * h * repeat + hi, r, c) = x(bi, hi / repeat, r, c);
  return out;
}

// (B H, N, D) -> (B, H, N, D), contiguous.
template <class T>
Tensor<T> with_heads(const Tensor<T>& x, int64_t batch, int64_t heads) {
  Shape shape{batch, heads};
  for (int a = 1; a < x.rank(); ++a) shape.push_back(x.size(a));
  return Tensor<T>::copy_of(ConstView<T>(x.data(), shape));
}

// Lengths of (B) or (B, Nq) repeated over H heads: (B H) or (B H, Nq).
Tensor<int64_t> repeated_lens(const OwnedLens& lens, LensForm form, int64_t batch, int64_t heads,
                              int64_t nq, int64_t nk) {
  if (form == LensForm::kNone) return Tensor<int64_t>();
  const bool per_query = form == LensForm::kPerQuery;
  Tensor<int64_t> out(per_query ? Shape{batch * heads, nq} : Shape{batch * heads});
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < (per_query ? nq : 1); ++i)
        out.data()[(b * heads + h) * (per_query ? nq : 1) + i] = lens.at(b, i, nk);
  return out;
}

struct HeadsCase {
  int64_t batch, heads, kv_heads, nq, nk, d, dv;
  LensForm lens;
  Causal causal;
  double dropout;
  bool weights;
  Layout layout;
};

std::string describe(const HeadsCase& c) {
  return "B=" + std::to_string(c.batch) + " H=" + std::to_string(c.heads) +
         " Hkv=" + std::to_string(c.kv_heads) + " Nq=" + std::to_string(c.nq) +
         " Nk=" + std::to_string(c.nk) + " D=" + std::to_string(c.d) +
         " Dv=" + std::to_string(c.dv) + " lens=" + std::to_string(static_cast<int>(c.lens)) +
         " causal=" + std::to_string(static_cast<int>(c.causal)) +
         " dropout=" + std::to_string(c.dropout) + " weights=" + std::to_string(c.weights) +
         " layout=" + layout_name(c.layout);
}

HeadsCase random_case(Rng& rng) {
  static const int64_t kRatios[][2] = {{1, 1}, {4, 4}, {4, 2}, {6, 2}, {8, 1}, {3, 3}};
  const auto& ratio = kRatios[rng.uniform_int(0, 5)];
  const int64_t nq = rng.bernoulli(0.25) ? rng.uniform_int(1, 4) : rng.uniform_int(1, 600);
  const int64_t nk = rng.uniform_int(1, 700);
  static const int64_t kDims[] = {1, 3, 8, 16, 32, 64};
  return HeadsCase{rng.uniform_int(1, 3),
                   ratio[0],
                   ratio[1],
                   nq,
                   nk,
                   kDims[rng.uniform_int(0, 5)],
                   kDims[rng.uniform_int(0, 5)],
                   static_cast<LensForm>(rng.uniform_int(0, 2)),
                   static_cast<Causal>(rng.uniform_int(0, 2)),
                   rng.bernoulli(0.3) ? 0.25 : 0.0,
                   rng.bernoulli(0.3),
                   static_cast<Layout>(rng.uniform_int(0, 5))};
}

template <class T>
struct HeadsProblem {
  Strided<T> q, k, v;
  OwnedLens lens;
  AttentionOptions options;
};

template <class T>
HeadsProblem<T> make_problem(Rng& rng, const HeadsCase& c) {
  HeadsProblem<T> p;
  p.q = random_strided<T>(rng, Shape{c.batch, c.heads, c.nq, c.d}, c.layout);
  p.k = random_strided<T>(rng, Shape{c.batch, c.kv_heads, c.nk, c.d}, c.layout);
  p.v = random_strided<T>(rng, Shape{c.batch, c.kv_heads, c.nk, c.dv}, c.layout);
  p.lens = make_lens(rng, c.lens, rng.bernoulli(0.5), c.batch, c.nq, c.nk, 0.1);
  p.options.dropout_p = c.dropout;
  p.options.training = c.dropout > 0.0;
  p.options.seed = rng.next();
  p.options.return_weights = c.weights;
  p.options.return_lse = true;
  p.options.causal = c.causal;
  return p;
}

// The 4-D call against the 3-D call on gathered copies (bits) and against the
// float64 reference (tolerances), forward and backward.
template <class T>
void check_case(Rng& rng, const HeadsCase& c) {
  SCOPED_TRACE(describe(c));
  const HeadsProblem<T> p = make_problem<T>(rng, c);
  const ConstView<T> q = as_const_view(p.q.view), k = as_const_view(p.k.view),
                     v = as_const_view(p.v.view);
  const ValidLens lens = p.lens.get();
  const int64_t group = c.heads / c.kv_heads;
  const AttentionResult<T> got = scaled_dot_product_attention(q, k, v, lens, p.options);
  ASSERT_EQ(got.output.shape(), (Shape{c.batch, c.heads, c.nq, c.dv}));
  ASSERT_EQ(got.lse.shape(), (Shape{c.batch, c.heads, c.nq}));
  if (c.weights) ASSERT_EQ(got.weights.shape(), (Shape{c.batch, c.heads, c.nq, c.nk}));

  const Tensor<T> q3 = gathered(q, 1), k3 = gathered(k, group), v3 = gathered(v, group);
  const Tensor<int64_t> lens3 = repeated_lens(p.lens, c.lens, c.batch, c.heads, c.nq, c.nk);
  const AttentionResult<T> flat =
      scaled_dot_product_attention(q3, k3, v3, as_valid_lens(lens3), p.options);
  // The 3-D call takes the small-dimension kernel for D, Dv <= 4 without
  // weights (one head per batch element only): the same results, not bits.
  constexpr bool kFloat = std::is_same_v<T, float>;
  if (c.d <= 4 && c.dv <= 4 && !c.weights) {
    expect_close(got.output, with_heads(flat.output, c.batch, c.heads),
                 kFloat ? kSdpa : kSdpaDouble, "output vs 3-D");
    expect_close(got.lse, with_heads(flat.lse, c.batch, c.heads),
                 kFloat ? kSdpaLse : kSdpaLseDouble, "lse vs 3-D");
  } else {
    expect_bitwise_equal(got.output, with_heads(flat.output, c.batch, c.heads), "output vs 3-D");
    expect_bitwise_equal(got.lse, with_heads(flat.lse, c.batch, c.heads), "lse vs 3-D");
  }
  if (c.weights) {
    expect_bitwise_equal(got.weights, with_heads(flat.weights, c.batch, c.heads), "weights vs 3-D");
  }

  const AttentionResult<T> ref = ref::scaled_dot_product_attention(q, k, v, lens, p.options);
  expect_close(got.output, ref.output, kFloat ? kSdpa : kSdpaDouble, "output vs ref");
  expect_close(got.lse, ref.lse, kFloat ? kSdpaLse : kSdpaLseDouble, "lse vs ref");
  if (c.weights) expect_close(got.weights, ref.weights, kFloat ? kSoftmax : kSoftmaxDouble, "weights");

  // Backward, d_output in the inputs' layout.
  const Strided<T> d_out = random_strided<T>(rng, Shape{c.batch, c.heads, c.nq, c.dv}, c.layout);
  const DotProductGrads<T> g = scaled_dot_product_attention_backward(
      q, k, v, lens, p.options, {got.output, got.lse}, as_const_view(d_out.view));
  ASSERT_EQ(g.d_queries.shape(), q.shape());
  ASSERT_EQ(g.d_keys.shape(), k.shape());
  ASSERT_EQ(g.d_values.shape(), v.shape());
  const DotProductGrads<T> r = ref::scaled_dot_product_attention_backward(
      q, k, v, lens, p.options, {ref.output, ref.lse}, as_const_view(d_out.view));
  const Tol back = kFloat ? kSdpaBackward : kSdpaBackwardDouble;
  expect_close(g.d_queries, r.d_queries, back, "d_queries vs ref");
  expect_close(g.d_keys, r.d_keys, back, "d_keys vs ref");
  expect_close(g.d_values, r.d_values, back, "d_values vs ref");
  if (group == 1) {
    const Tensor<T> d_out3 = gathered(as_const_view(d_out.view), 1);
    // Given the 4-D forward's output and lse, so the backwards alone are compared.
    const Tensor<T> out3 = gathered(as_const_view(got.output.view()), 1);
    const ConstView<T> lse3(got.lse.data(), Shape{c.batch * c.heads, c.nq});
    const DotProductGrads<T> g3 = scaled_dot_product_attention_backward(
        q3, k3, v3, as_valid_lens(lens3), p.options, {out3, lse3}, d_out3);
    expect_bitwise_equal(g.d_queries, with_heads(g3.d_queries, c.batch, c.heads), "dQ vs 3-D");
    expect_bitwise_equal(g.d_keys, with_heads(g3.d_keys, c.batch, c.heads), "dK vs 3-D");
    expect_bitwise_equal(g.d_values, with_heads(g3.d_values, c.batch, c.heads), "dV vs 3-D");
  }
}

template <class T>
class Heads : public ::testing::Test {};
using HeadTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Heads, HeadTypes, TypeNames);

TYPED_TEST(Heads, AreABatchOfTheirRowsInEveryLayout) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  // Every layout and grouping at least once, then random cases.
  std::vector<HeadsCase> cases = {
      {2, 4, 4, 130, 300, 16, 8, LensForm::kPerQuery, Causal::kNone, 0.0, true,
       Layout::kTokenMajor},
      {1, 8, 2, 300, 520, 32, 32, LensForm::kPerBatch, Causal::kTopLeft, 0.2, false,
       Layout::kPaddedRows},
      {2, 6, 3, 1, 2000, 64, 64, LensForm::kNone, Causal::kBottomRight, 0.0, false,
       Layout::kReversedHeads},
      {3, 2, 1, 40, 30, 8, 3, LensForm::kPerQuery, Causal::kNone, 0.3, true,
       Layout::kReversedBatch},
      {1, 4, 1, 3, 900, 16, 16, LensForm::kPerBatch, Causal::kNone, 0.0, false, Layout::kCopied},
      {2, 1, 1, 70, 90, 2, 2, LensForm::kNone, Causal::kNone, 0.0, false, Layout::kContiguous},
  };
  const int random_cases = kSanitized ? 4 : 30;
  for (int i = 0; i < random_cases; ++i) cases.push_back(random_case(rng));
  for (const HeadsCase& c : cases) {
    check_case<TypeParam>(rng, c);
    if (::testing::Test::HasFailure()) return;
  }
}

// bf16 heads: the forward's bits are those of the 3-D call on gathered
// copies (the key blocks packed once per key head serve every query head
// of its group, as the 3-D call packs them per batch element).
TEST(HeadsBf16, ForwardIsTheBatchOfItsHeads) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const HeadsCase cases[] = {
      {2, 4, 2, 300, 700, 64, 64, LensForm::kPerQuery, Causal::kNone, 0.0, false,
       Layout::kTokenMajor},
      {1, 8, 1, 1, 3000, 64, 32, LensForm::kNone, Causal::kNone, 0.0, false, Layout::kPaddedRows},
      {1, 4, 4, 520, 600, 32, 32, LensForm::kPerBatch, Causal::kTopLeft, 0.2, true,
       Layout::kReversedHeads},
  };
  for (const HeadsCase& c : cases) {
    SCOPED_TRACE(describe(c));
    const HeadsProblem<bfloat16> p = make_problem<bfloat16>(rng, c);
    const ConstView<bfloat16> q = as_const_view(p.q.view), k = as_const_view(p.k.view),
                              v = as_const_view(p.v.view);
    const int64_t group = c.heads / c.kv_heads;
    const AttentionResult<float> got =
        scaled_dot_product_attention(q, k, v, p.lens.get(), p.options);
    const Tensor<bfloat16> q3 = gathered(q, 1), k3 = gathered(k, group), v3 = gathered(v, group);
    const Tensor<int64_t> lens3 = repeated_lens(p.lens, c.lens, c.batch, c.heads, c.nq, c.nk);
    const AttentionResult<float> flat =
        scaled_dot_product_attention(q3, k3, v3, as_valid_lens(lens3), p.options);
    expect_bitwise_equal(got.output, with_heads(flat.output, c.batch, c.heads), "output vs 3-D");
    expect_bitwise_equal(got.lse, with_heads(flat.lse, c.batch, c.heads), "lse vs 3-D");
    if (c.weights) {
      expect_bitwise_equal(got.weights, with_heads(flat.weights, c.batch, c.heads), "weights");
    }
    // The backward against the float backward on the widened inputs (the
    // bf16 backward's bound: docs/semantics.md), per element of max |grad|.
    Tensor<float> d_out = random_tensor<float>(rng, {c.batch, c.heads, c.nq, c.dv});
    const DotProductGrads<float> g = scaled_dot_product_attention_backward(
        q, k, v, p.lens.get(), p.options, {got.output, got.lse}, d_out);
    const auto widened = [](ConstView<bfloat16> x) {
      Tensor<float> out(x.shape());
      for (int64_t b = 0; b < x.size(0); ++b)
        for (int64_t h = 0; h < x.size(1); ++h)
          for (int64_t n = 0; n < x.size(2); ++n)
            for (int64_t e = 0; e < x.size(3); ++e) out(b, h, n, e) = static_cast<float>(x(b, h, n, e));
      return out;
    };
    const Tensor<float> qw = widened(q), kw = widened(k), vw = widened(v);
    const AttentionResult<float> rf =
        ref::scaled_dot_product_attention(qw, kw, vw, p.lens.get(), p.options);
    const DotProductGrads<float> r = ref::scaled_dot_product_attention_backward(
        qw, kw, vw, p.lens.get(), p.options, {rf.output, rf.lse}, d_out);
    ASSERT_EQ(g.d_keys.shape(), k.shape());
    for (const auto& [name, a, b] : {std::tuple{"d_queries", &g.d_queries, &r.d_queries},
                                     std::tuple{"d_keys", &g.d_keys, &r.d_keys},
                                     std::tuple{"d_values", &g.d_values, &r.d_values}}) {
      double scale = 0;
      for (const float x : b->values()) scale = std::max(scale, std::abs(static_cast<double>(x)));
      expect_close(*a, *b, Tol{.atol = 3e-2 * scale + 1e-6, .rtol = 0}, name);
    }
  }
}

// The write-into form: an output in (B, Nq, H, Dv) memory (what the output
// projection reads with no transpose) gets the bits of a contiguous one.
TYPED_TEST(Heads, WritesIntoStridedOutputs) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const HeadsCase c{2, 4, 2, 200, 300, 16, 24, LensForm::kPerBatch, Causal::kTopLeft, 0.1, false,
                    Layout::kTokenMajor};
  const HeadsProblem<T> p = make_problem<T>(rng, c);
  const ConstView<T> q = as_const_view(p.q.view), k = as_const_view(p.k.view),
                     v = as_const_view(p.v.view);
  const AttentionResult<T> want = scaled_dot_product_attention(q, k, v, p.lens.get(), p.options);
  Strided<T> out = strided<T>(Shape{c.batch, c.heads, c.nq, c.dv}, Layout::kTokenMajor);
  Tensor<T> lse(Shape{c.batch, c.heads, c.nq});
  scaled_dot_product_attention(
      q, k, v, p.lens.get(), p.options,
      AttentionOutputs<T>{out.view, std::nullopt, lse.view(), std::nullopt});
  expect_bitwise_equal(Tensor<T>::copy_of(as_const_view(out.view)), want.output, "output");
  expect_bitwise_equal(lse, want.lse, "lse");
}

TEST(HeadsErrors, NameTheShapes) {
  const Tensor<float> q(Shape{2, 6, 5, 8}), k(Shape{2, 4, 7, 8}), v(Shape{2, 4, 7, 3});
  expect_error(
      [&] { scaled_dot_product_attention(q, k, v); },
      {"scaled_dot_product_attention", "queries has H = 6 heads, not a multiple of the Hkv = 4",
       "[2, 6, 5, 8]", "[2, 4, 7, 8]"});
  const Tensor<float> q4(Shape{2, 4, 5, 8}), v2(Shape{2, 2, 7, 3});
  expect_error([&] { scaled_dot_product_attention(q4, k, v2); },
                        {"values has Hkv = 2 but keys has Hkv = 4"});
  const Tensor<float> k3(Shape{2, 7, 8});
  expect_error([&] { scaled_dot_product_attention(q4, k3, v); },
                        {"keys has shape [2, 7, 8]; expected rank 4 (B, Hkv, Nk, D)"});
  const Tensor<float> q5(Shape{2, 4, 5, 9});
  expect_error([&] { scaled_dot_product_attention(q5, k, v); },
                        {"keys has D = 8 but queries has D = 9"});
  const Tensor<float> k_zero(Shape{2, 0, 7, 8}), v_zero(Shape{2, 0, 7, 3});
  expect_error([&] { scaled_dot_product_attention(q4, k_zero, v_zero); },
                        {"not a multiple of the Hkv = 0 heads"});
  // Lengths are per batch element (B) or (B, Nq), not per head.
  const Tensor<int64_t> lens_per_head(Shape{8}, std::vector<int64_t>(8, 3));
  expect_error(
      [&] { scaled_dot_product_attention(q4, k, v, ValidLens(lens_per_head)); },
      {"scaled_dot_product_attention", "valid_lens"});
  // Output destinations: shape, and rows that overlap or are not contiguous.
  Tensor<float> lse(Shape{2, 4, 5});
  std::vector<float> memory(2 * 4 * 5 * 3);
  const TensorView<float> overlapping(memory.data(), Shape{2, 4, 5, 3}, Shape{60, 15, 1, 1});
  expect_error(
      [&] {
        scaled_dot_product_attention(q4, k, v, {}, {},
                                     AttentionOutputs<float>{overlapping, std::nullopt, lse.view()});
      },
      {"outputs.output of shape [2, 4, 5, 3] has strides [60, 15, 1, 1]",
       "contiguous rows (stride 1 along Dv) that do not overlap"});
  const TensorView<float> wrong(memory.data(), Shape{2, 5, 4, 3});
  expect_error(
      [&] {
        scaled_dot_product_attention(q4, k, v, {}, {},
                                     AttentionOutputs<float>{wrong, std::nullopt, std::nullopt});
      },
      {"outputs.output has shape [2, 5, 4, 3]; expected [2, 4, 5, 3]"});
  // The backward checks the saved forward against the heads.
  const Tensor<float> out(Shape{2, 4, 5, 3}), lse3(Shape{2, 5});
  expect_error(
      [&] { scaled_dot_product_attention_backward(q4, k, v, {}, {}, {out, lse3}, out); },
      {"scaled_dot_product_attention_backward", "lse has shape [2, 5]; expected [2, 4, 5]"});
}

// No heads (H = Hkv = 0) and no batch are empty problems, not errors.
TEST(HeadsEdges, EmptyHeadsAndBatch) {
  for (const Shape& qs : {Shape{2, 0, 5, 8}, Shape{0, 4, 5, 8}}) {
    const Shape ks{qs[0], qs[1] == 0 ? 0 : 2, 7, 8}, vs{qs[0], qs[1] == 0 ? 0 : 2, 7, 3};
    const Tensor<float> q(qs), k(ks), v(vs);
    AttentionOptions o;
    o.return_lse = true;
    const AttentionResult<float> r = scaled_dot_product_attention(q, k, v, {}, o);
    EXPECT_EQ(r.output.shape(), (Shape{qs[0], qs[1], 5, 3}));
    const Tensor<float> d_out(r.output.shape());
    const DotProductGrads<float> g =
        scaled_dot_product_attention_backward(q, k, v, {}, o, {r.output, r.lse}, d_out);
    EXPECT_EQ(g.d_keys.shape(), ks);
  }
}

}  // namespace
}  // namespace qkv::test
