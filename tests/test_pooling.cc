// Tests of attention pooling with given weights (qkv/pooling.h) and its named
// special cases: uniform weights (average pooling) and one-hot weights (an
// exact database lookup), against plain double loops written here.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "test_util.h"

namespace qkv::test {
namespace {

// output[b, i, d] = sum_j w[b, i, j] * v[b, j, d], in long double.
Tensor<double> plain_pooling(ConstView<double> w, ConstView<double> v) {
  const int64_t batch = w.size(0), num_queries = w.size(1), num_keys = w.size(2),
                value_dim = v.size(2);
  Tensor<double> out(Shape{batch, num_queries, value_dim});
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < num_queries; ++i) {
      for (int64_t d = 0; d < value_dim; ++d) {
        long double sum = 0;
        for (int64_t j = 0; j < num_keys; ++j) {
          sum += static_cast<long double>(w(b, i, j)) * v(b, j, d);
        }
        out(b, i, d) = static_cast<double>(sum);
      }
    }
  }
  return out;
}

template <class I>
int64_t row_len(const Tensor<I>& lens, int64_t b, int64_t i, int64_t num_keys) {
  if (lens.empty()) return num_keys;
  return static_cast<int64_t>(lens.rank() == 1 ? lens(b) : lens(b, i));
}

// The mean of the first L values for every query (0 when L = 0).
template <class I>
Tensor<double> plain_average(ConstView<double> v, int64_t num_queries, const Tensor<I>& lens) {
  const int64_t batch = v.size(0), num_keys = v.size(1), value_dim = v.size(2);
  Tensor<double> out(Shape{batch, num_queries, value_dim});
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < num_queries; ++i) {
      const int64_t len = row_len(lens, b, i, num_keys);
      for (int64_t d = 0; d < value_dim; ++d) {
        long double sum = 0;
        for (int64_t j = 0; j < len; ++j) sum += v(b, j, d);
        out(b, i, d) = len == 0 ? 0.0 : static_cast<double>(sum / len);
      }
    }
  }
  return out;
}

template <class T>
class Pooling : public ::testing::Test {};
using FloatTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Pooling, FloatTypes);

// ---- attention_pooling ---------------------------------------------------------

TYPED_TEST(Pooling, MatchesPlainLoopForAnyWeights) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tol tol = tol_for<T>(kPooling, kPoolingDouble);
  for (int64_t num_keys : {1, 7, 8, 17, 64, 257, 1000}) {
    for (int64_t value_dim : {1, 3, 8, 17, 64}) {
      const Shape wshape{rng.uniform_int(1, 4), rng.uniform_int(1, 6), num_keys};
      const Shape vshape{wshape[0], num_keys, value_dim};
      SCOPED_TRACE("weights " + wshape.str() + ", values " + vshape.str());
      // Non-convex: signed weights that do not sum to 1.
      const Tensor<T> w = random_tensor<T>(rng, wshape);
      const Tensor<T> v = random_tensor<T>(rng, vshape);
      const Tensor<T> out = attention_pooling(w, v);
      const Tensor<double> expected = plain_pooling(cast<double>(w).view(), cast<double>(v).view());
      if (!expect_close(out, expected, tol, "attention_pooling", "b q d")) return;
    }
  }
}

TYPED_TEST(Pooling, StridedInputs) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tensor<T> w = random_tensor<T>(rng, Shape{3, 5, 19});
  const Tensor<T> v = random_tensor<T>(rng, Shape{3, 19, 6});
  const Tensor<double> expected = plain_pooling(cast<double>(w).view(), cast<double>(v).view());
  const Strided<T> sw(w.view(), {.reversed = true});
  const Strided<T> sv(v.view(), {.step = 3, .pad = 2});
  const Tol tol = tol_for<T>(kPooling, kPoolingDouble);
  expect_close(attention_pooling(sw.const_view(), v), expected, tol, "strided weights", "b q d");
  expect_close(attention_pooling(w, sv.const_view()), expected, tol, "strided values", "b q d");
  expect_close(attention_pooling(sw.const_view(), sv.const_view()), expected, tol, "both strided",
               "b q d");
}

// Convex weights keep the output inside the values' range, per coordinate.
TYPED_TEST(Pooling, ConvexWeightsStayInTheValuesRange) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Shape shape{2, 4, 33};
  const Tensor<T> w = masked_softmax(random_tensor<T>(rng, shape, -3.0, 3.0));
  const Tensor<T> v = random_tensor<T>(rng, Shape{2, 33, 5});
  const Tensor<T> out = attention_pooling(w, v);
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t d = 0; d < 5; ++d) {
      double lo = 1e300, hi = -1e300;
      for (int64_t j = 0; j < 33; ++j) {
        lo = std::min<double>(lo, v(b, j, d));
        hi = std::max<double>(hi, v(b, j, d));
      }
      for (int64_t i = 0; i < 4; ++i) {
        EXPECT_GE(out(b, i, d), lo - 1e-6) << "b=" << b << " q=" << i << " d=" << d;
        EXPECT_LE(out(b, i, d), hi + 1e-6) << "b=" << b << " q=" << i << " d=" << d;
      }
    }
  }
}

// ---- uniform weights and average pooling --------------------------------------

TEST(UniformWeights, OneOverLOverTheFirstLKeys) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int64_t num_keys : {1, 7, 16, 33, 1000}) {
    for (LensForm form : kAllLensForms) {
      const int64_t batch = rng.uniform_int(1, 4), num_queries = rng.uniform_int(1, 5);
      SCOPED_TRACE("B=" + std::to_string(batch) + " Nq=" + std::to_string(num_queries) +
                   " Nk=" + std::to_string(num_keys) + ", " + to_string(form));
      const Tensor<int32_t> lens = random_lens<int32_t>(rng, form, batch, num_queries, num_keys);
      const Tensor<float> w = uniform_weights(batch, num_queries, num_keys, as_valid_lens(lens));
      ASSERT_EQ(w.shape(), (Shape{batch, num_queries, num_keys}));
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t i = 0; i < num_queries; ++i) {
          const int64_t len = row_len(lens, b, i, num_keys);
          // 1/L in float: within one rounding of the exact value.
          const double expected = len == 0 ? 0.0 : 1.0 / static_cast<double>(len);
          for (int64_t j = 0; j < num_keys; ++j) {
            const double want = j < len ? expected : 0.0;
            if (j >= len) {
              ASSERT_EQ(w(b, i, j), 0.0f) << "b=" << b << " q=" << i << " k=" << j;
            } else {
              ASSERT_NEAR(w(b, i, j), want, want * 6e-8)
                  << "b=" << b << " q=" << i << " k=" << j << " L=" << len;
            }
          }
        }
      }
    }
  }
}

TEST(UniformWeights, ZeroLengthGivesAZeroRow) {
  const Tensor<int64_t> lens(Shape{2, 2}, std::vector<int64_t>{0, 3, 4, 0});
  const Tensor<float> w = uniform_weights(2, 2, 4, lens);
  const Tensor<double> expected(Shape{2, 2, 4}, std::vector<double>{0, 0, 0, 0,                 //
                                                                    1. / 3, 1. / 3, 1. / 3, 0,  //
                                                                    .25, .25, .25, .25,         //
                                                                    0, 0, 0, 0});
  expect_close(w, expected, Tol{.atol = 0, .rtol = 6e-8}, "uniform_weights");
}

TYPED_TEST(Pooling, AveragePoolingIsTheMeanOfTheFirstLValues) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tol tol = tol_for<T>(kAverage, kPoolingDouble);
  for (int64_t num_keys : {1, 8, 9, 33, 257, 1000}) {
    for (LensForm form : kAllLensForms) {
      const int64_t batch = rng.uniform_int(1, 4), num_queries = rng.uniform_int(1, 5),
                    value_dim = rng.uniform_int(1, 9);
      const Shape vshape{batch, num_keys, value_dim};
      SCOPED_TRACE("values " + vshape.str() + ", Nq=" + std::to_string(num_queries) + ", " +
                   to_string(form));
      const Tensor<T> v = random_tensor<T>(rng, vshape);
      const Tensor<int64_t> lens = random_lens(rng, form, batch, num_queries, num_keys);
      const ValidLens valid_lens = as_valid_lens(lens);
      const Tensor<T> avg = average_pooling(v, num_queries, valid_lens);
      ASSERT_EQ(avg.shape(), (Shape{batch, num_queries, value_dim}));
      const Tensor<double> expected = plain_average(cast<double>(v).view(), num_queries, lens);
      bool ok = expect_close(avg, expected, tol, "average_pooling", "b q d");
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t i = 0; i < num_queries; ++i) {
          if (row_len(lens, b, i, num_keys) != 0) continue;
          for (int64_t d = 0; d < value_dim; ++d) {
            ASSERT_EQ(avg(b, i, d), T(0)) << "L = 0 at b=" << b << " q=" << i << " d=" << d;
          }
        }
      }
      // The same as pooling with uniform weights.
      const Tensor<T> via_weights =
          attention_pooling(cast<T>(uniform_weights(batch, num_queries, num_keys, valid_lens)), v);
      // kAverage for double too: uniform_weights are float, 1/L rounded to 2^-24.
      ok = expect_close(avg, via_weights, kAverage, "average vs uniform", "b q d") && ok;
      if (!ok) return;
    }
  }
}

TYPED_TEST(Pooling, AveragePoolingOfStridedValues) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tensor<T> v = random_tensor<T>(rng, Shape{2, 13, 4});
  const Tensor<int32_t> lens = random_lens<int32_t>(rng, LensForm::kPerQuery, 2, 3, 13);
  const Strided<T> sv(v.view(), {.reversed = true});
  expect_close(average_pooling(sv.const_view(), 3, lens),
               plain_average(cast<double>(v).view(), 3, lens), tol_for<T>(kAverage, kPoolingDouble),
               "strided values", "b q d");
}

// ---- one-hot weights and lookup ------------------------------------------------

TYPED_TEST(Pooling, OneHotLookupGathersExactly) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int64_t num_keys : {1, 6, 17, 100}) {
    const int64_t batch = rng.uniform_int(1, 4), num_queries = rng.uniform_int(1, 7),
                  value_dim = rng.uniform_int(1, 9);
    SCOPED_TRACE("B=" + std::to_string(batch) + " Nq=" + std::to_string(num_queries) +
                 " Nk=" + std::to_string(num_keys) + " Dv=" + std::to_string(value_dim));
    Tensor<int64_t> index(Shape{batch, num_queries});
    for (int64_t& k : index.values()) k = rng.uniform_int(0, num_keys - 1);
    const Tensor<T> v = random_tensor<T>(rng, Shape{batch, num_keys, value_dim}, -100.0, 100.0);

    const Tensor<float> w = one_hot_weights(index, num_keys);
    ASSERT_EQ(w.shape(), (Shape{batch, num_queries, num_keys}));
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < num_queries; ++i) {
        for (int64_t j = 0; j < num_keys; ++j) {
          ASSERT_EQ(w(b, i, j), j == index(b, i) ? 1.0f : 0.0f)
              << "b=" << b << " q=" << i << " k=" << j;
        }
      }
    }

    const Tensor<T> looked_up = one_hot_lookup(index, v);
    ASSERT_EQ(looked_up.shape(), (Shape{batch, num_queries, value_dim}));
    Tensor<T> expected(looked_up.shape());
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < num_queries; ++i) {
        for (int64_t d = 0; d < value_dim; ++d) expected(b, i, d) = v(b, index(b, i), d);
      }
    }
    expect_bitwise_equal(looked_up, expected, "one_hot_lookup", "b q d");
    // Pooling with one-hot weights is exact too: every product is v or 0.
    expect_close(attention_pooling(cast<T>(w), v), expected, kExact, "pooling with one-hot weights",
                 "b q d");
    const Strided<int64_t> strided_index(index.view(), {.reversed = true});
    const Strided<T> strided_values(v.view());
    expect_bitwise_equal(one_hot_lookup(strided_index.const_view(), strided_values.const_view()),
                         expected, "strided one_hot_lookup", "b q d");
    expect_bitwise_equal(one_hot_weights(strided_index.const_view(), num_keys), w,
                         "strided one_hot_weights");
  }
}

// ---- errors --------------------------------------------------------------------

TEST(PoolingErrors, IndexOutOfRangeNamesTheIndex) {
  const Tensor<int64_t> too_big(Shape{2, 3}, std::vector<int64_t>{0, 1, 2, 4, 9, 0});
  const Tensor<int64_t> negative(Shape{1, 2}, std::vector<int64_t>{0, -3});
  const Tensor<float> v(Shape{2, 5, 3});
  const Tensor<double> vd(Shape{1, 5, 3});
  expect_error([&] { (void)one_hot_weights(too_big, 5); }, {"one_hot_weights", "9", "5"});
  expect_error([&] { (void)one_hot_weights(negative, 5); }, {"one_hot_weights", "-3"});
  expect_error([&] { (void)one_hot_lookup(too_big, v); }, {"one_hot_lookup", "9", "5"});
  expect_error([&] { (void)one_hot_lookup(negative, vd); }, {"one_hot_lookup", "-3"});
  const Tensor<int64_t> at_num_keys(Shape{1, 1}, std::vector<int64_t>{5});
  expect_error([&] { (void)one_hot_weights(at_num_keys, 5); }, {"one_hot_weights", "5"});
}

TEST(PoolingErrors, ShapeMismatches) {
  const Tensor<float> w(Shape{2, 3, 4});
  const Tensor<float> v_keys(Shape{2, 5, 6});
  const Tensor<float> v_batch(Shape{3, 4, 6});
  const Tensor<float> v_rank2(Shape{4, 6});
  expect_error([&] { (void)attention_pooling(w, v_keys); },
               {"attention_pooling", "[2, 3, 4]", "[2, 5, 6]"});
  expect_error([&] { (void)attention_pooling(w, v_batch); },
               {"attention_pooling", "[2, 3, 4]", "[3, 4, 6]"});
  expect_error([&] { (void)attention_pooling(w, v_rank2); }, {"attention_pooling", "[4, 6]"});
  const Tensor<double> w_rank4(Shape{1, 2, 3, 4});
  const Tensor<double> vd(Shape{1, 4, 2});
  expect_error([&] { (void)attention_pooling(w_rank4, vd); },
               {"attention_pooling", "[1, 2, 3, 4]"});

  const Tensor<int64_t> index(Shape{2, 3});
  expect_error([&] { (void)one_hot_lookup(index, v_batch); },
               {"one_hot_lookup", "[2, 3]", "[3, 4, 6]"});
  const Tensor<int64_t> index_rank1(Shape{3});
  expect_error([&] { (void)one_hot_lookup(index_rank1, v_keys); }, {"one_hot_lookup", "[3]"});
  expect_error([&] { (void)one_hot_weights(index_rank1, 4); }, {"one_hot_weights", "[3]"});

  const Tensor<int64_t> lens(Shape{3}, std::vector<int64_t>{1, 2, 3});
  expect_error([&] { (void)average_pooling(v_keys, 4, lens); },
               {"average_pooling", "valid_lens", "[3]"});
  const Tensor<int64_t> too_long(Shape{2}, std::vector<int64_t>{1, 6});
  expect_error([&] { (void)average_pooling(v_keys, 4, too_long); },
               {"average_pooling", "valid_lens", "6"});
  expect_error([&] { (void)average_pooling(v_rank2, 4); }, {"average_pooling", "[4, 6]"});
  expect_error([&] { (void)uniform_weights(2, 4, 5, too_long); },
               {"uniform_weights", "valid_lens", "6"});
  const Tensor<int32_t> wrong_queries(Shape{2, 3});
  expect_error([&] { (void)uniform_weights(2, 4, 5, wrong_queries); },
               {"uniform_weights", "valid_lens", "[2, 3]"});
}

}  // namespace
}  // namespace qkv::test
