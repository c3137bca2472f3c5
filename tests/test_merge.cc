// Tests of merge_attention (qkv/merge.h): against a long double loop written
// here; against scaled dot-product attention over all keys at once (3-D and
// grouped 4-D heads, every valid-lens form, keys split at random places,
// empty parts); the backward of a split key set through the merged output and
// lse (docs/semantics.md); DESIGN.md §3's rules for -inf, NaN and +inf; the
// in-place form; thread counts and strided parts; every error.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "test_util.h"
#include "tolerances.h"

namespace qkv::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The merge written out per row in long double: rows are every index but the
// outputs' last axis.
template <class T>
MergedAttention<double> plain_merge(const std::vector<Tensor<T>>& outputs,
                                    const std::vector<Tensor<T>>& lses) {
  const Shape shape = outputs[0].shape();
  const int64_t dv = shape[shape.rank() - 1], rows = lses[0].numel();
  MergedAttention<double> m{Tensor<double>(shape), Tensor<double>(lses[0].shape())};
  for (int64_t r = 0; r < rows; ++r) {
    bool nan = false;
    long double max = -kInf;
    for (const Tensor<T>& lse : lses) {
      const long double x = lse.data()[r];
      if (std::isnan(x) || x == kInf) nan = true;
      if (x > max) max = x;
    }
    if (nan || max == -kInf) {
      m.lse.data()[r] = nan ? kNaN : -kInf;
      for (int64_t d = 0; d < dv; ++d) m.output.data()[r * dv + d] = nan ? kNaN : 0.0;
      continue;
    }
    long double sum = 0;
    for (const Tensor<T>& lse : lses) sum += std::exp(lse.data()[r] - max);
    const long double lse = max + std::log(sum);
    m.lse.data()[r] = static_cast<double>(lse);
    for (int64_t d = 0; d < dv; ++d) {
      long double acc = 0;
      for (size_t s = 0; s < outputs.size(); ++s) {
        const long double w = std::exp(lses[s].data()[r] - lse);
        if (w > 0) acc += w * outputs[s].data()[r * dv + d];
      }
      m.output.data()[r * dv + d] = static_cast<double>(acc);
    }
  }
  return m;
}

template <class T>
std::vector<ConstView<T>> views(const std::vector<Tensor<T>>& tensors) {
  return {tensors.begin(), tensors.end()};
}

// The elements [a, b) of `axis` of x, copied.
template <class T>
Tensor<T> take(const Tensor<T>& x, int axis, int64_t a, int64_t b) {
  Shape shape = x.shape();
  shape[axis] = b - a;
  Tensor<T> out(shape);
  const TensorView<T> to = out.view();
  const ConstView<T> from_view = x.view();
  for_each_index(shape, [&](const std::array<int64_t, kMaxRank>& index) {
    std::array<int64_t, kMaxRank> from = index;
    from[static_cast<size_t>(axis)] += a;
    to.data()[offset_of(to.strides(), index, to.rank())] =
        from_view.data()[offset_of(from_view.strides(), from, from_view.rank())];
  });
  return out;
}

// Valid lengths of the keys [a, b) of a split, from the whole set's.
Tensor<int64_t> part_lens(const Tensor<int64_t>& lens, int64_t a, int64_t b) {
  if (lens.empty()) return {};
  Tensor<int64_t> part(lens.shape());
  for (int64_t i = 0; i < lens.numel(); ++i) {
    part.data()[i] = std::clamp<int64_t>(lens.data()[i] - a, 0, b - a);
  }
  return part;
}

// Cut points 0 = c_0 <= c_1 <= ... <= c_parts = nk, repeats (empty parts) allowed.
std::vector<int64_t> random_cuts(Rng& rng, int64_t nk, int64_t parts) {
  std::vector<int64_t> cuts{0, nk};
  for (int64_t s = 1; s < parts; ++s) cuts.push_back(rng.uniform_int(0, nk));
  std::sort(cuts.begin(), cuts.end());
  return cuts;
}

// Scaled dot-product attention with lse over each part [cuts[s], cuts[s+1])
// of the keys (along key_axis), each part's valid lengths clamped from lens.
template <class T>
struct Parts {
  std::vector<Tensor<T>> outputs, lses;
};
template <class T>
Parts<T> attend_parts(const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v,
                      const Tensor<int64_t>& lens, const std::vector<int64_t>& cuts, int key_axis) {
  AttentionOptions options;
  options.return_lse = true;
  Parts<T> parts;
  for (size_t s = 0; s + 1 < cuts.size(); ++s) {
    const int64_t a = cuts[s], b = cuts[s + 1];
    const Tensor<int64_t> lens_s = part_lens(lens, a, b);
    AttentionResult<T> r = scaled_dot_product_attention(
        q, take(k, key_axis, a, b), take(v, key_axis, a, b), as_valid_lens(lens_s), options);
    parts.outputs.push_back(std::move(r.output));
    parts.lses.push_back(std::move(r.lse));
  }
  return parts;
}

template <class T>
class Merge : public ::testing::Test {};
using FloatTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Merge, FloatTypes);

// Random parts, -inf parts and rows, NaN and +inf lses, against the loop.
TYPED_TEST(Merge, MatchesALongDoubleLoop) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int trial = 0; trial < 40; ++trial) {
    const int rank = static_cast<int>(rng.uniform_int(2, 4));
    Shape shape;
    for (int a = 0; a < rank; ++a) shape.push_back(rng.uniform_int(a + 1 == rank ? 1 : 0, 7));
    Shape lse_shape;
    for (int a = 0; a + 1 < rank; ++a) lse_shape.push_back(shape[a]);
    const auto parts = rng.uniform_int(1, 5);
    SCOPED_TRACE("outputs " + shape.str() + ", " + std::to_string(parts) + " parts");
    std::vector<Tensor<T>> outputs, lses;
    for (int64_t s = 0; s < parts; ++s) {
      outputs.push_back(random_tensor<T>(rng, shape));
      lses.push_back(random_tensor<T>(rng, lse_shape, -40.0, 40.0));
    }
    const int64_t rows = lses[0].numel(), dv = shape[rank - 1];
    for (int64_t r = 0; r < rows; ++r) {
      const double u = rng.uniform();
      for (int64_t s = 0; s < parts; ++s) {
        T& lse = lses[static_cast<size_t>(s)].data()[r];
        if (u < 0.1 || rng.bernoulli(0.2)) {
          lse = -std::numeric_limits<T>::infinity();  // every part of 1 row in 10: -inf
          // A part with no keys is never read, whatever its output holds.
          outputs[static_cast<size_t>(s)].data()[r * dv] = std::numeric_limits<T>::quiet_NaN();
        }
      }
      if (u > 0.95) lses[static_cast<size_t>(rng.uniform_int(0, parts - 1))].data()[r] = T(kNaN);
      if (u > 0.9 && u <= 0.95) {
        lses[static_cast<size_t>(rng.uniform_int(0, parts - 1))].data()[r] = T(kInf);
      }
    }
    const MergedAttention<T> got = merge_attention(views(outputs), views(lses));
    const MergedAttention<double> ref = plain_merge(outputs, lses);
    // One rounding of a double sum of <= 5 terms: 1 ulp of T plus double's error.
    const Tol tol = tol_for<T>({.atol = 1e-7, .rtol = 2e-7}, {.atol = 1e-15, .rtol = 1e-14});
    if (!expect_close(got.output, ref.output, tol, "output")) return;
    if (!expect_close(got.lse, ref.lse, tol, "lse")) return;
  }
}

// Attention over keys split at random places, merged, equals attention over
// all of them: output and lse, every valid-lens form, 3-D and grouped 4-D.
TYPED_TEST(Merge, SplitAttentionEqualsWholeAttention) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int trial = 0; trial < 24; ++trial) {
    for (const LensForm form : kAllLensForms) {
      const bool heads = trial % 2 == 1;  // (B, H, N, D) with H = 2 Hkv
      const int64_t batch = rng.uniform_int(1, 3), nq = rng.uniform_int(1, 9);
      const int64_t nk = rng.uniform_int(0, 70), dim = rng.uniform_int(1, 17);
      const int64_t dv = rng.uniform_int(1, 9), parts = rng.uniform_int(1, 5);
      const int64_t kv_heads = heads ? rng.uniform_int(1, 2) : 0;
      const Shape q_shape = heads ? Shape{batch, 2 * kv_heads, nq, dim} : Shape{batch, nq, dim};
      const Shape k_shape = heads ? Shape{batch, kv_heads, nk, dim} : Shape{batch, nk, dim};
      const Shape v_shape = heads ? Shape{batch, kv_heads, nk, dv} : Shape{batch, nk, dv};
      const int key_axis = heads ? 2 : 1;
      const Tensor<T> q = random_tensor<T>(rng, q_shape, -2.0, 2.0);
      const Tensor<T> k = random_tensor<T>(rng, k_shape, -2.0, 2.0);
      const Tensor<T> v = random_tensor<T>(rng, v_shape);
      const Tensor<int64_t> lens = random_lens(rng, form, batch, nq, nk);
      const std::vector<int64_t> cuts = random_cuts(rng, nk, parts);
      SCOPED_TRACE("queries " + q_shape.str() + ", keys " + k_shape.str() + ", " + to_string(form) +
                   ", " + std::to_string(parts) + " parts");
      AttentionOptions options;
      options.return_lse = true;
      const AttentionResult<T> whole =
          scaled_dot_product_attention(q, k, v, as_valid_lens(lens), options);
      const Parts<T> split = attend_parts(q, k, v, lens, cuts, key_axis);
      const MergedAttention<T> merged = merge_attention(views(split.outputs), views(split.lses));
      const Tol tol = tol_for<T>(kSdpa, kSdpaDouble);
      if (!expect_close(merged.output, whole.output, tol, "output")) return;
      if (!expect_close(merged.lse, whole.lse, tol_for<T>(kSdpaLse, kSdpaDouble), "lse")) return;
    }
  }
}

// The backward of attention over a split key set: each part's backward, given
// the merged output and lse (not its own), yields its keys' dK and dV and a
// share of dQ; the shares sum to dQ over all keys (docs/semantics.md).
TYPED_TEST(Merge, BackwardOfASplitKeySetThroughTheMergedResult) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int trial = 0; trial < 12; ++trial) {
    for (const LensForm form : kAllLensForms) {
      const int64_t batch = rng.uniform_int(1, 3), nq = rng.uniform_int(1, 9);
      const int64_t nk = rng.uniform_int(0, 60), dim = rng.uniform_int(1, 17);
      const int64_t dv = rng.uniform_int(1, 9), parts = rng.uniform_int(1, 4);
      const Tensor<T> q = random_tensor<T>(rng, {batch, nq, dim}, -2.0, 2.0);
      const Tensor<T> k = random_tensor<T>(rng, {batch, nk, dim}, -2.0, 2.0);
      const Tensor<T> v = random_tensor<T>(rng, {batch, nk, dv});
      const Tensor<T> d_out = random_tensor<T>(rng, {batch, nq, dv});
      const Tensor<int64_t> lens = random_lens(rng, form, batch, nq, nk);
      const std::vector<int64_t> cuts = random_cuts(rng, nk, parts);
      SCOPED_TRACE("B=" + std::to_string(batch) + " Nq=" + std::to_string(nq) +
                   " Nk=" + std::to_string(nk) + ", " + to_string(form) + ", " +
                   std::to_string(parts) + " parts");
      AttentionOptions options;
      options.return_lse = true;
      const AttentionResult<T> whole =
          scaled_dot_product_attention(q, k, v, as_valid_lens(lens), options);
      const DotProductGrads<T> want = scaled_dot_product_attention_backward(
          q, k, v, as_valid_lens(lens), options, {whole.output, whole.lse}, d_out);

      const Parts<T> split = attend_parts(q, k, v, lens, cuts, 1);
      const MergedAttention<T> merged = merge_attention(views(split.outputs), views(split.lses));
      Tensor<T> d_q(q.shape()), d_k(k.shape()), d_v(v.shape());
      for (int64_t s = 0; s < parts; ++s) {
        const int64_t a = cuts[static_cast<size_t>(s)], b = cuts[static_cast<size_t>(s) + 1];
        const Tensor<int64_t> lens_s = part_lens(lens, a, b);
        const DotProductGrads<T> g = scaled_dot_product_attention_backward(
            q, take(k, 1, a, b), take(v, 1, a, b), as_valid_lens(lens_s), options,
            {merged.output, merged.lse}, d_out);
        for (int64_t i = 0; i < d_q.numel(); ++i) d_q.data()[i] += g.d_queries.data()[i];
        for (int64_t bb = 0; bb < batch; ++bb) {
          for (int64_t j = a; j < b; ++j) {
            for (int64_t d = 0; d < dim; ++d) d_k(bb, j, d) = g.d_keys(bb, j - a, d);
            for (int64_t d = 0; d < dv; ++d) d_v(bb, j, d) = g.d_values(bb, j - a, d);
          }
        }
      }
      const Tol tol = tol_for<T>(kSdpaBackward, kSdpaBackwardDouble);
      if (!expect_close(d_q, want.d_queries, tol, "d_queries")) return;
      if (!expect_close(d_k, want.d_keys, tol, "d_keys")) return;
      if (!expect_close(d_v, want.d_values, tol, "d_values")) return;
    }
  }
}

// A running merge into the first part's own memory gives the same bits as a
// merge into fresh tensors; so do strided parts and any thread count.
TYPED_TEST(Merge, InPlaceStridedAndThreadsGiveTheSameBits) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  // 2 x 1500 rows: several tasks of rows.
  const Shape shape{2, 1500, 13}, lse_shape{2, 1500};
  std::vector<Tensor<T>> outputs, lses;
  for (int s = 0; s < 3; ++s) {
    outputs.push_back(random_tensor<T>(rng, shape));
    lses.push_back(random_tensor<T>(rng, lse_shape, -5.0, 5.0));
  }
  lses[1].data()[7] = -std::numeric_limits<T>::infinity();
  MergedAttention<T> one_thread;
  {
    ThreadCount threads(1);
    one_thread = merge_attention(views(outputs), views(lses));
  }
  ThreadCount threads(2);
  const MergedAttention<T> two_threads = merge_attention(views(outputs), views(lses));
  expect_bitwise_equal(two_threads.output, one_thread.output, "output, 2 threads vs 1");
  expect_bitwise_equal(two_threads.lse, one_thread.lse, "lse, 2 threads vs 1");

  const Strided<T> out1(outputs[1]), lse1(lses[1]);
  const MergedAttention<T> strided = merge_attention({outputs[0], out1.const_view(), outputs[2]},
                                                     {lses[0], lse1.const_view(), lses[2]});
  expect_bitwise_equal(strided.output, one_thread.output, "output, a strided part");
  expect_bitwise_equal(strided.lse, one_thread.lse, "lse, a strided part");

  Tensor<T> running = outputs[0], running_lse = lses[0];
  merge_attention({running, outputs[1], outputs[2]}, {running_lse, lses[1], lses[2]},
                  running.view(), running_lse.view());
  expect_bitwise_equal(running, one_thread.output, "output, in place");
  expect_bitwise_equal(running_lse, one_thread.lse, "lse, in place");
}

// A part with lse -inf adds nothing and is not read: the merge without it has
// the same bits. A single part comes back as it was (exactly, for finite lse).
TYPED_TEST(Merge, EmptyPartsAddNothingAndOnePartIsItself) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Shape shape{3, 5, 4}, lse_shape{3, 5};
  const Tensor<T> out0 = random_tensor<T>(rng, shape), lse0 = random_tensor<T>(rng, lse_shape);
  const Tensor<T> out1 = random_tensor<T>(rng, shape), lse1 = random_tensor<T>(rng, lse_shape);
  const Tensor<T> empty_out(shape, std::numeric_limits<T>::quiet_NaN());
  const Tensor<T> empty_lse(lse_shape, -std::numeric_limits<T>::infinity());
  const MergedAttention<T> two = merge_attention({out0, out1}, {lse0, lse1});
  const MergedAttention<T> with_empty =
      merge_attention({empty_out, out0, empty_out, out1}, {empty_lse, lse0, empty_lse, lse1});
  expect_bitwise_equal(with_empty.output, two.output, "output with empty parts");
  expect_bitwise_equal(with_empty.lse, two.lse, "lse with empty parts");
  const MergedAttention<T> one = merge_attention({out0}, {lse0});
  expect_bitwise_equal(one.output, out0, "one part's output");
  expect_bitwise_equal(one.lse, lse0, "one part's lse");
  const MergedAttention<T> none = merge_attention({empty_out}, {empty_lse});
  expect_bitwise_equal(none.output, Tensor<T>(shape), "no keys at all: output 0");
  expect_bitwise_equal(none.lse, empty_lse, "no keys at all: lse -inf");
}

TEST(Merge, ErrorsNameTheArgumentAndTheShapes) {
  const Tensor<float> out({2, 3, 4}), lse({2, 3}), out_other({2, 4, 4}), lse_other({2, 4});
  const Tensor<double> outd({2, 3, 4}), lsed({2, 3});
  expect_error([&] { (void)merge_attention(std::vector<ConstView<float>>{}, {}); },
               {"merge_attention", "outputs is empty"});
  expect_error(
      [&] {
        (void)merge_attention({out, out}, {lse});
      },
      {"merge_attention", "outputs has 2 parts but lses has 1"});
  expect_error([&] { (void)merge_attention({Tensor<float>({4})}, {Tensor<float>({1})}); },
               {"merge_attention", "outputs[0] has shape [4]", "rank >= 2"});
  expect_error(
      [&] {
        (void)merge_attention({out, out_other}, {lse, lse_other});
      },
      {"merge_attention", "outputs[1] has shape [2, 4, 4]", "outputs[0] has shape [2, 3, 4]"});
  expect_error(
      [&] {
        (void)merge_attention({outd, outd}, {lsed, Tensor<double>({2, 3, 1})});
      },
      {"merge_attention", "lses[1] has shape [2, 3, 1]", "expected [2, 3]"});
  Tensor<float> dest({2, 3, 4}), dest_lse({2, 3}), wrong({2, 3, 5}), wrong_lse({3});
  expect_error([&] { merge_attention({out}, {lse}, wrong.view(), dest_lse.view()); },
               {"merge_attention", "output has shape [2, 3, 5]", "expected [2, 3, 4]"});
  expect_error([&] { merge_attention({out}, {lse}, dest.view(), wrong_lse.view()); },
               {"merge_attention", "lse has shape [3]", "expected [2, 3]"});
  const Strided<float> strided_dest(dest);
  expect_error([&] { merge_attention({out}, {lse}, strided_dest.view(), dest_lse.view()); },
               {"merge_attention", "output", "must be contiguous"});
}

}  // namespace
}  // namespace qkv::test
