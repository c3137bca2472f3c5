// GoogleTest suite of linear (qkv/linear.h): x weightᵀ + bias against a
// float64 plain loop for ranks 1 to 4, strided inputs, empty axes and no
// bias; the bits at 1 and 2 threads; and every bad argument by name.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "attention_testing.h"
#include "qkv/linear.h"
#include "qkv/threads.h"
#include "test_util.h"
#include "tolerances.h"

namespace qkv::test {
namespace {

template <class T>
class Linear : public ::testing::Test {};
using ElementTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Linear, ElementTypes, TypeNames);

// The float64 loop: out[r, o] = sum_i x[r, i] w[o, i] + b[o], rows flattened.
template <class T>
Tensor<double> linear_loop(ConstView<T> x, ConstView<T> w, ConstView<T> b) {
  const Tensor<double> xd = cast<double>(x), wd = cast<double>(w);
  const int64_t in = w.size(1), out = w.size(0);
  Shape shape = x.shape();
  shape[shape.rank() - 1] = out;
  Tensor<double> y(shape, 0.0);
  const int64_t n = y.numel() / (out == 0 ? 1 : out);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double s = b.rank() == 0 ? 0.0 : static_cast<double>(b.data()[o * b.stride(0)]);
      for (int64_t i = 0; i < in; ++i) {
        s += xd.data()[r * in + i] * wd.data()[o * in + i];
      }
      y.data()[r * out + o] = s;
    }
  }
  return y;
}

TYPED_TEST(Linear, MatchesTheLoopForEveryRankAndSize) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Shape shapes[] = {{7}, {1, 1}, {65, 33}, {3, 130, 17}, {2, 3, 5, 300}, {0, 4}, {3, 0, 4}};
  for (const Shape& x_shape : shapes) {
    for (int64_t out : {1, 5, 64, 129}) {
      for (bool with_bias : {true, false}) {
        SCOPED_TRACE("x " + x_shape.str() + ", out " + std::to_string(out) +
                     (with_bias ? ", bias" : ", no bias"));
        const int64_t in = x_shape[x_shape.rank() - 1];
        const Tensor<T> x = random_tensor<T>(rng, x_shape);
        const Tensor<T> w = random_tensor<T>(rng, Shape{out, in});
        const Tensor<T> b = with_bias ? random_tensor<T>(rng, Shape{out}) : Tensor<T>();
        const ConstView<T> bias = with_bias ? b.view() : ConstView<T>();
        expect_close(linear(x.view(), w.view(), bias), linear_loop(x.view(), w.view(), bias),
                     tol_for<T>(kLinear, kLinearDouble), "linear");
      }
    }
  }
}

TYPED_TEST(Linear, ReadsStridedInputsAndWritesInto) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  // x: every other row of a (2, 10, 6) tensor; weight transposed in place;
  // bias every third element.
  const Tensor<T> x_base = random_tensor<T>(rng, Shape{2, 10, 6});
  const ConstView<T> x(x_base.data(), Shape{2, 5, 6}, Shape{60, 12, 1});
  const Tensor<T> w_base = random_tensor<T>(rng, Shape{6, 4});
  const ConstView<T> w(w_base.data(), Shape{4, 6}, Shape{1, 4});
  const Tensor<T> b_base = random_tensor<T>(rng, Shape{12});
  const ConstView<T> b(b_base.data(), Shape{4}, Shape{3});
  const Tensor<double> ref = linear_loop(x, w, b);
  expect_close(linear(x, w, b), ref, tol_for<T>(kLinear, kLinearDouble), "linear (strided)");
  Tensor<T> out(Shape{2, 5, 4});
  linear(x, w, b, out.view());
  expect_close(out, ref, tol_for<T>(kLinear, kLinearDouble), "linear (into out)");
}

TEST(LinearBits, TheSameAtOneAndTwoThreads) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tensor<float> x = random_tensor<float>(rng, Shape{3, 171, 96});
  const Tensor<float> w = random_tensor<float>(rng, Shape{200, 96});
  const Tensor<float> b = random_tensor<float>(rng, Shape{200});
  set_num_threads(1);
  const Tensor<float> one = linear(x.view(), w.view(), b.view());
  set_num_threads(2);
  const Tensor<float> two = linear(x.view(), w.view(), b.view());
  set_num_threads(0);
  expect_bitwise_equal(one, two, "linear at 1 and 2 threads");
}

TEST(LinearErrors, NameTheArgumentAndItsShape) {
  const Tensor<float> x(Shape{2, 3}, 1.0f), w(Shape{4, 3}, 1.0f), b(Shape{4}, 1.0f);
  expect_error([&] { linear(ConstView<float>(), w.view()); }, {"linear", "x has shape []"});
  expect_error(
      [&] {
        linear(x.view(), Tensor<float>(Shape{4, 2}).view());
      },
      {"linear", "weight has shape [4, 2]", "in = 3"});
  expect_error([&] { linear(x.view(), Tensor<float>(Shape{12}).view()); },
               {"linear", "weight has shape [12]"});
  expect_error([&] { linear(x.view(), w.view(), Tensor<float>(Shape{3}).view()); },
               {"linear", "bias has shape [3]", "(4)"});
  Tensor<float> wrong(Shape{2, 5});
  expect_error([&] { linear(x.view(), w.view(), b.view(), wrong.view()); },
               {"linear", "out has shape [2, 5]", "expected [2, 4]"});
  Tensor<float> wide(Shape{2, 8});
  const TensorView<float> strided(wide.data(), Shape{2, 4}, Shape{8, 2});
  expect_error([&] { linear(x.view(), w.view(), b.view(), strided); },
               {"linear", "(strided)", "contiguous"});
}

}  // namespace
}  // namespace qkv::test
