// Tests of the tensor vocabulary: Shape, Tensor, TensorView (strides, slices,
// const conversion) and ValidLens (both forms, both integer types, and the
// check every op runs on them).
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "test_util.h"

namespace qkv::test {
namespace {

// True if `message` contains any of the spellings.
bool contains_any(const std::string& message, std::initializer_list<std::string_view> spellings) {
  for (std::string_view s : spellings) {
    if (message.find(s) != std::string::npos) return true;
  }
  return false;
}

// ---- Shape ---------------------------------------------------------------------

TEST(Shape, RankNumelAndSizes) {
  const Shape scalar;
  EXPECT_EQ(scalar.rank(), 0);
  EXPECT_EQ(scalar.numel(), 1);

  const Shape s{2, 4, 5};
  EXPECT_EQ(s.rank(), 3);
  EXPECT_EQ(s[0], 2);
  EXPECT_EQ(s[1], 4);
  EXPECT_EQ(s[2], 5);
  EXPECT_EQ(s.numel(), 40);
  EXPECT_EQ(std::vector<int64_t>(s.begin(), s.end()), (std::vector<int64_t>{2, 4, 5}));

  EXPECT_EQ((Shape{7, 0, 3}).numel(), 0);
  EXPECT_EQ((Shape{1, 2, 3, 4}).numel(), 24);
}

TEST(Shape, RandomShapesHaveTheProductOfTheirSizes) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int trial = 0; trial < 50; ++trial) {
    const int rank = static_cast<int>(rng.uniform_int(0, kMaxRank));
    std::vector<int64_t> sizes;
    int64_t product = 1;
    for (int a = 0; a < rank; ++a) {
      sizes.push_back(rng.uniform_int(0, 9));
      product *= sizes.back();
    }
    const Shape s(sizes.begin(), sizes.end());
    EXPECT_EQ(s.rank(), rank);
    EXPECT_EQ(s.numel(), product);
    EXPECT_EQ(std::vector<int64_t>(s.begin(), s.end()), sizes);
  }
}

TEST(Shape, FromAnyIntegerRange) {
  const std::vector<int> ints{3, 1, 2};
  const Shape s(ints.begin(), ints.end());
  EXPECT_EQ(s, (Shape{3, 1, 2}));
  const std::vector<int64_t> none;
  EXPECT_EQ(Shape(none.begin(), none.end()), Shape{});
}

TEST(Shape, Str) {
  EXPECT_EQ(Shape{}.str(), "[]");
  EXPECT_EQ((Shape{7}).str(), "[7]");
  EXPECT_EQ((Shape{2, 4, 5}).str(), "[2, 4, 5]");
  EXPECT_EQ((Shape{1, 0, 12, 3}).str(), "[1, 0, 12, 3]");
}

TEST(Shape, Equality) {
  EXPECT_TRUE((Shape{2, 3}) == (Shape{2, 3}));
  EXPECT_FALSE((Shape{2, 3}) == (Shape{3, 2}));
  EXPECT_FALSE((Shape{2, 3}) == (Shape{2, 3, 1}));
  EXPECT_FALSE((Shape{2}) == Shape{});
  EXPECT_TRUE(Shape{} == Shape{});
  Shape s{2, 3};
  s[1] = 4;
  EXPECT_EQ(s, (Shape{2, 4}));
  s.push_back(9);
  EXPECT_EQ(s, (Shape{2, 4, 9}));
}

TEST(Shape, RankAboveTheLimitIsAnError) {
  static_assert(kMaxRank == 4);
  expect_error([] { Shape s{1, 2, 3, 4, 5}; }, {"rank"});
  Shape s{1, 2, 3, 4};
  expect_error([&] { s.push_back(5); }, {"rank"});
  EXPECT_EQ(s, (Shape{1, 2, 3, 4}));
  const std::vector<int64_t> five{1, 1, 1, 1, 1};
  expect_error([&] { Shape t(five.begin(), five.end()); }, {"rank"});
}

TEST(Shape, RowMajorStrides) {
  EXPECT_EQ(row_major_strides(Shape{2, 3, 4}), (Shape{12, 4, 1}));
  EXPECT_EQ(row_major_strides(Shape{5}), (Shape{1}));
  EXPECT_EQ(row_major_strides(Shape{2, 1, 3, 7}), (Shape{21, 21, 7, 1}));
  EXPECT_EQ(row_major_strides(Shape{}), Shape{});
}

// ---- Tensor --------------------------------------------------------------------

TEST(Tensor, ConstructionZeroesOrFills) {
  const Tensor<float> zeros(Shape{2, 3});
  EXPECT_EQ(zeros.shape(), (Shape{2, 3}));
  EXPECT_EQ(zeros.rank(), 2);
  EXPECT_EQ(zeros.numel(), 6);
  EXPECT_EQ(zeros.size(1), 3);
  ASSERT_EQ(zeros.values().size(), 6u);
  for (float x : zeros.values()) EXPECT_EQ(x, 0.0f);
  EXPECT_FALSE(zeros.empty());

  const Tensor<double> filled(Shape{4, 1, 2}, -2.5);
  ASSERT_EQ(filled.values().size(), 8u);
  for (double x : filled.values()) EXPECT_EQ(x, -2.5);

  const Tensor<int64_t> ints(Shape{3}, 7);
  EXPECT_EQ(ints(2), 7);

  const Tensor<float> none;
  EXPECT_TRUE(none.empty());
  EXPECT_EQ(none.rank(), 0);
  const Tensor<float> scalar(Shape{}, 1.5f);
  EXPECT_FALSE(scalar.empty());
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar(), 1.5f);
}

TEST(Tensor, ValuesAreRowMajor) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t n0 = rng.uniform_int(1, 4), n1 = rng.uniform_int(1, 5), n2 = rng.uniform_int(1, 6),
                n3 = rng.uniform_int(1, 3);
  std::vector<double> values(static_cast<size_t>(n0 * n1 * n2 * n3));
  for (double& v : values) v = rng.uniform(-1, 1);
  const Tensor<double> t(Shape{n0, n1, n2, n3}, values);
  for (int64_t a = 0; a < n0; ++a) {
    for (int64_t b = 0; b < n1; ++b) {
      for (int64_t c = 0; c < n2; ++c) {
        for (int64_t d = 0; d < n3; ++d) {
          ASSERT_EQ(t(a, b, c, d), values[static_cast<size_t>(((a * n1 + b) * n2 + c) * n3 + d)])
              << "a=" << a << " b=" << b << " c=" << c << " d=" << d;
        }
      }
    }
  }
  Tensor<double> u = t;
  u(n0 - 1, n1 - 1, n2 - 1, n3 - 1) = 42.0;
  EXPECT_EQ(u.values().back(), 42.0);
  EXPECT_EQ(t.values().back(), values.back());  // a copy owns its elements
  EXPECT_EQ(t.data(), t.values().data());
}

TEST(Tensor, WrongNumberOfValuesIsAnError) {
  expect_error([] { Tensor<float> t(Shape{2, 3}, std::vector<float>(5, 1.0f)); }, {"[2, 3]", "5"});
  expect_error([] { Tensor<double> t(Shape{4}, std::vector<double>(7, 0.0)); }, {"[4]", "7"});
  expect_error([] { Tensor<int64_t> t(Shape{1, 1}, std::vector<int64_t>{}); }, {"[1, 1]"});
}

TEST(Tensor, NegativeOrOverflowingSizesAreAnError) {
  expect_error([] { Tensor<float> t(Shape{2, -3}); }, {"-3"});
  expect_error([] { Tensor<double> t(Shape{-1}, 0.5); }, {"-1"});
  const int64_t big = int64_t{1} << 40;
  expect_error([&] { Tensor<float> t(Shape{big, big}); }, {});
}

TEST(Tensor, Reshaped) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  const Tensor<float> t = random_tensor<float>(seed, Shape{2, 3, 4});
  const Tensor<float> r = t.reshaped(Shape{6, 4});
  EXPECT_EQ(r.shape(), (Shape{6, 4}));
  EXPECT_EQ(r.values(), t.values());
  EXPECT_EQ(t.shape(), (Shape{2, 3, 4}));  // the const& form leaves the source alone
  EXPECT_EQ(t.values().size(), 24u);

  Tensor<float> moved = t;
  const Tensor<float> flat = std::move(moved).reshaped(Shape{24});
  EXPECT_EQ(flat.shape(), (Shape{24}));
  EXPECT_EQ(flat.values(), t.values());

  expect_error([&] { (void)t.reshaped(Shape{5, 5}); }, {"[2, 3, 4]", "[5, 5]"});
  Tensor<float> other = t;
  expect_error([&] { (void)std::move(other).reshaped(Shape{23}); }, {"[2, 3, 4]", "[23]"});
}

TEST(Tensor, ViewSharesTheElements) {
  Tensor<double> t(Shape{2, 3});
  TensorView<double> v = t.view();
  EXPECT_EQ(v.data(), t.data());
  EXPECT_EQ(v.shape(), t.shape());
  EXPECT_EQ(v.strides(), (Shape{3, 1}));
  EXPECT_TRUE(v.is_contiguous());
  v(1, 2) = 5.0;
  EXPECT_EQ(t(1, 2), 5.0);
  EXPECT_EQ(t.values()[5], 5.0);
  const Tensor<double>& ct = t;
  ConstView<double> cv = ct;  // implicit conversion
  EXPECT_EQ(cv(1, 2), 5.0);
  TensorView<double> mv = t;
  mv(0, 0) = -1.0;
  EXPECT_EQ(t(0, 0), -1.0);
}

TEST(Tensor, CopyOfStridedViews) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int rank = 1; rank <= kMaxRank; ++rank) {
    std::vector<int64_t> sizes;
    for (int a = 0; a < rank; ++a) sizes.push_back(rng.uniform_int(1, 5));
    const Shape shape(sizes.begin(), sizes.end());
    SCOPED_TRACE("shape " + shape.str());
    const Tensor<float> src = random_tensor<float>(rng, shape);
    for (bool reversed : {false, true}) {
      const Strided<float> strided(src.view(),
                                   {.step = 3, .pad = 2, .offset = 1, .reversed = reversed});
      if (src.numel() > 1) {
        EXPECT_FALSE(strided.view().is_contiguous()) << strided.view().strides().str();
      }
      const Tensor<float> copy = Tensor<float>::copy_of(strided.const_view());
      EXPECT_EQ(copy.shape(), shape);
      EXPECT_EQ(copy.values(), src.values()) << (reversed ? "column-major" : "padded");
    }
    const Tensor<float> plain = Tensor<float>::copy_of(src.view());
    EXPECT_EQ(plain.values(), src.values());
    EXPECT_NE(plain.data(), src.data());
  }
}

TEST(Tensor, CopyOfBroadcastAndSlicedViews) {
  const std::vector<double> row{1.0, 2.0, 3.0};
  // Stride 0 on the first axis: the same row three times.
  const ConstView<double> broadcast(row.data(), Shape{3, 3}, Shape{0, 1});
  const Tensor<double> copy = Tensor<double>::copy_of(broadcast);
  EXPECT_EQ(copy.values(), (std::vector<double>{1, 2, 3, 1, 2, 3, 1, 2, 3}));

  // Column 1 of a 4x3 matrix, seen as a (4) view with stride 3.
  const Tensor<int32_t> m(Shape{4, 3}, std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
  const ConstView<int32_t> column(m.data() + 1, Shape{4}, Shape{3});
  EXPECT_EQ(Tensor<int32_t>::copy_of(column).values(), (std::vector<int32_t>{1, 4, 7, 10}));
}

// ---- TensorView ----------------------------------------------------------------

TEST(TensorView, DefaultIsEmpty) {
  const TensorView<float> v;
  EXPECT_EQ(v.rank(), 0);
  EXPECT_EQ(v.data(), nullptr);
}

TEST(TensorView, StridesAndIndexing) {
  std::vector<float> buffer(64);
  for (size_t n = 0; n < buffer.size(); ++n) buffer[n] = static_cast<float>(n);
  // A (2, 3, 4) view with strides (20, 6, 1): rows of 4 padded to 6, blocks padded to 20.
  const TensorView<float> v(buffer.data() + 2, Shape{2, 3, 4}, Shape{20, 6, 1});
  EXPECT_EQ(v.rank(), 3);
  EXPECT_EQ(v.size(0), 2);
  EXPECT_EQ(v.stride(1), 6);
  EXPECT_EQ(v.numel(), 24);
  EXPECT_FALSE(v.is_contiguous());
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t i = 0; i < 3; ++i) {
      for (int64_t j = 0; j < 4; ++j) {
        EXPECT_EQ(v(b, i, j), static_cast<float>(2 + 20 * b + 6 * i + j));
      }
    }
  }
  const TensorView<float> v1(buffer.data(), Shape{5}, Shape{7});
  EXPECT_EQ(v1(4), 28.0f);
  const TensorView<float> v4(buffer.data(), Shape{2, 2, 2, 2});
  EXPECT_EQ(v4(1, 0, 1, 1), 11.0f);
  EXPECT_EQ(v4.strides(), (Shape{8, 4, 2, 1}));
  v4(1, 1, 1, 1) = -3.0f;
  EXPECT_EQ(buffer[15], -3.0f);
  const TensorView<float> v0(buffer.data() + 9, Shape{});
  EXPECT_EQ(v0(), 9.0f);
}

TEST(TensorView, IsContiguous) {
  std::vector<double> buffer(100);
  EXPECT_TRUE(TensorView<double>(buffer.data(), Shape{3, 4, 5}).is_contiguous());
  EXPECT_TRUE(TensorView<double>(buffer.data(), Shape{3, 4}, Shape{4, 1}).is_contiguous());
  EXPECT_FALSE(TensorView<double>(buffer.data(), Shape{3, 4}, Shape{5, 1}).is_contiguous());
  EXPECT_FALSE(TensorView<double>(buffer.data(), Shape{3, 4}, Shape{1, 3}).is_contiguous());
  EXPECT_FALSE(TensorView<double>(buffer.data(), Shape{4}, Shape{2}).is_contiguous());
  // Size-1 axes may have any stride.
  EXPECT_TRUE(TensorView<double>(buffer.data(), Shape{1, 4, 1}, Shape{99, 1, 7}).is_contiguous());
  EXPECT_FALSE(TensorView<double>(buffer.data(), Shape{3, 3}, Shape{0, 1}).is_contiguous());
}

TEST(TensorView, SliceDropsTheFirstAxis) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tensor<double> t = random_tensor<double>(rng, Shape{3, 4, 5});
  const Strided<double> strided(t.view(), {.reversed = true});
  for (const ConstView<double>& v : {t.view(), strided.const_view()}) {
    for (int64_t b = 0; b < 3; ++b) {
      const ConstView<double> s = v.slice(b);
      ASSERT_EQ(s.shape(), (Shape{4, 5}));
      EXPECT_EQ(s.strides(), (Shape{v.stride(1), v.stride(2)}));
      for (int64_t i = 0; i < 4; ++i) {
        for (int64_t j = 0; j < 5; ++j) EXPECT_EQ(s(i, j), t(b, i, j)) << b << i << j;
      }
      const ConstView<double> row = s.slice(2);
      ASSERT_EQ(row.shape(), (Shape{5}));
      for (int64_t j = 0; j < 5; ++j) EXPECT_EQ(row(j), t(b, 2, j));
    }
  }
  EXPECT_TRUE(t.view().slice(1).is_contiguous());
}

TEST(TensorView, Unsqueeze0AddsABatchOfOne) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  const Tensor<float> t = random_tensor<float>(seed, Shape{4, 6});
  const ConstView<float> u = t.view().unsqueeze0();
  EXPECT_EQ(u.shape(), (Shape{1, 4, 6}));
  EXPECT_EQ(u.data(), t.data());
  EXPECT_TRUE(u.is_contiguous());
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t j = 0; j < 6; ++j) EXPECT_EQ(u(0, i, j), t(i, j));
  }
  const Strided<float> strided(t.view());
  const ConstView<float> us = strided.const_view().unsqueeze0();
  EXPECT_EQ(us.shape(), (Shape{1, 4, 6}));
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t j = 0; j < 6; ++j) EXPECT_EQ(us(0, i, j), t(i, j));
  }
  EXPECT_EQ(Tensor<float>::copy_of(us).values(), t.values());
}

// The batch-of-one rule of the CLI and the Python bindings: a view of the
// unbatched rank gains a leading axis of 1 only for a batch of one, any other
// rank passes through for the op's check to name, and outputs lose the axis.
TEST(TensorView, WithBatchAxisOnlyForABatchOfOneOfTheUnbatchedRank) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Tensor<float> t = random_tensor<float>(seed, Shape{3, 5});
  const ConstView<float> one = with_batch_axis(std::as_const(t).view(), true, 2);
  EXPECT_EQ(one.shape(), (Shape{1, 3, 5}));
  EXPECT_EQ(one.data(), t.data());
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t j = 0; j < 5; ++j) EXPECT_EQ(one(0, i, j), t(i, j));
  }
  const TensorView<float> mutable_one = with_batch_axis(t.view(), true, 2);
  mutable_one(0, 2, 4) = 7.5f;
  EXPECT_EQ(t(2, 4), 7.5f) << "a mutable view stays a view of the same elements";
  EXPECT_EQ(with_batch_axis(std::as_const(t).view(), false, 2).shape(), (Shape{3, 5}));
  EXPECT_EQ(with_batch_axis(std::as_const(t).view(), true, 1).shape(), (Shape{3, 5}))
      << "a view of another rank is left for the op's shape check";
  const Tensor<int64_t> lens(Shape{4});
  EXPECT_EQ(with_batch_axis(lens.view(), true, 1).shape(), (Shape{1, 4}));

  EXPECT_EQ(without_batch_axis(Shape{1, 3, 5}, true), (Shape{3, 5}));
  EXPECT_EQ(without_batch_axis(Shape{1, 3, 5}, false), (Shape{1, 3, 5}));
  EXPECT_EQ(without_batch_axis(Shape{1}, true), Shape{});
}

TEST(TensorView, MutableConvertsToConstOnly) {
  static_assert(std::is_convertible_v<TensorView<float>, ConstView<float>>);
  static_assert(!std::is_convertible_v<ConstView<float>, TensorView<float>>);
  static_assert(!std::is_convertible_v<TensorView<float>, ConstView<double>>);
  static_assert(std::is_convertible_v<Tensor<double>&, TensorView<double>>);
  static_assert(std::is_convertible_v<const Tensor<double>&, ConstView<double>>);
  static_assert(!std::is_convertible_v<const Tensor<double>&, TensorView<double>>);
  std::vector<float> buffer{1, 2, 3, 4, 5, 6};
  const TensorView<float> v(buffer.data(), Shape{3}, Shape{2});
  const ConstView<float> c = v;
  EXPECT_EQ(c.data(), v.data());
  EXPECT_EQ(c.shape(), v.shape());
  EXPECT_EQ(c.strides(), v.strides());
  EXPECT_EQ(c(2), 5.0f);
}

// ---- ValidLens -----------------------------------------------------------------

TEST(ValidLens, AbsentMeansEveryKey) {
  const ValidLens lens;
  EXPECT_FALSE(lens.present());
  EXPECT_EQ(lens.rank(), 0);
  EXPECT_EQ(lens.shape(), Shape{});
  EXPECT_EQ(lens(0, 0, 17), 17);
  EXPECT_EQ(lens(3, 5, 0), 0);
  EXPECT_TRUE(lens.to_tensor().empty());
  lens.check("masked_softmax", "scores", Shape{2, 4, 5}, 2, 4, 5);
}

template <class I>
class ValidLensTyped : public ::testing::Test {};
using LenTypes = ::testing::Types<int32_t, int64_t>;
TYPED_TEST_SUITE(ValidLensTyped, LenTypes);

TYPED_TEST(ValidLensTyped, PerBatch) {
  using I = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t batch = rng.uniform_int(2, 6), num_queries = rng.uniform_int(1, 5), num_keys = 9;
  const Tensor<I> t = random_lens<I>(rng, LensForm::kPerBatch, batch, num_queries, num_keys);
  for (const ValidLens& lens : {ValidLens(t), ValidLens(t.view())}) {
    EXPECT_TRUE(lens.present());
    EXPECT_EQ(lens.rank(), 1);
    EXPECT_EQ(lens.shape(), Shape{batch});
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < num_queries; ++i) {
        EXPECT_EQ(lens(b, i, num_keys), static_cast<int64_t>(t(b))) << "b=" << b << " i=" << i;
      }
    }
    const Tensor<int64_t> owned = lens.to_tensor();
    ASSERT_EQ(owned.shape(), Shape{batch});
    for (int64_t b = 0; b < batch; ++b) EXPECT_EQ(owned(b), static_cast<int64_t>(t(b)));
    lens.check("f", "scores", Shape{batch, num_queries, num_keys}, batch, num_queries, num_keys);
  }
}

TYPED_TEST(ValidLensTyped, PerQuery) {
  using I = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t batch = rng.uniform_int(1, 4), num_queries = rng.uniform_int(2, 6), num_keys = 11;
  const Tensor<I> t = random_lens<I>(rng, LensForm::kPerQuery, batch, num_queries, num_keys);
  // The same lengths through a strided (column-major) view.
  const Strided<I> strided(t.view(), {.reversed = true});
  for (const ValidLens& lens : {ValidLens(t), ValidLens(strided.const_view())}) {
    EXPECT_TRUE(lens.present());
    EXPECT_EQ(lens.rank(), 2);
    EXPECT_EQ(lens.shape(), (Shape{batch, num_queries}));
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < num_queries; ++i) {
        EXPECT_EQ(lens(b, i, num_keys), static_cast<int64_t>(t(b, i))) << "b=" << b << " i=" << i;
      }
    }
    const Tensor<int64_t> owned = lens.to_tensor();
    ASSERT_EQ(owned.shape(), (Shape{batch, num_queries}));
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < num_queries; ++i) {
        EXPECT_EQ(owned(b, i), static_cast<int64_t>(t(b, i)));
      }
    }
    lens.check("f", "scores", Shape{batch, num_queries, num_keys}, batch, num_queries, num_keys);
  }
}

TYPED_TEST(ValidLensTyped, BoundsZeroAndNumKeysAreValid) {
  using I = TypeParam;
  const Tensor<I> t(Shape{2, 3}, std::vector<I>{0, 5, 5, 0, 0, 1});
  ValidLens(t).check("masked_softmax", "scores", Shape{2, 3, 5}, 2, 3, 5);
  const Tensor<I> per_batch(Shape{2}, std::vector<I>{5, 0});
  ValidLens(per_batch).check("masked_softmax", "scores", Shape{2, 3, 5}, 2, 3, 5);
}

TYPED_TEST(ValidLensTyped, WrongShapeIsAnError) {
  using I = TypeParam;
  const Tensor<I> three(Shape{3}, std::vector<I>{1, 2, 3});
  const std::string message = expect_error(
      [&] {
        ValidLens(three).check("masked_softmax", "scores", Shape{2, 4, 5}, 2, 4, 5);
      },
      {"masked_softmax", "valid_lens", "[3]", "scores", "[2, 4, 5]", "[2]", "[2, 4]"});
  // The documented message (STYLE.md "Errors").
  EXPECT_EQ(message,
            "masked_softmax: valid_lens has shape [3] but scores has shape [2, 4, 5]; expected [2] "
            "or [2, 4]");

  const Tensor<I> wrong_queries(Shape{2, 3});
  expect_error(
      [&] {
        ValidLens(wrong_queries).check("attend", "queries", Shape{2, 4, 5}, 2, 4, 5);
      },
      {"attend", "valid_lens", "[2, 3]", "queries", "[2, 4, 5]"});
  const Tensor<I> rank3(Shape{2, 4, 1});
  expect_error(
      [&] {
        ValidLens(rank3).check("masked_softmax", "scores", Shape{2, 4, 5}, 2, 4, 5);
      },
      {"masked_softmax", "[2, 4, 1]", "[2, 4, 5]"});
  const Tensor<I> transposed(Shape{4, 2});
  expect_error(
      [&] {
        ValidLens(transposed).check("masked_softmax", "scores", Shape{2, 4, 5}, 2, 4, 5);
      },
      {"masked_softmax", "[4, 2]", "[2, 4, 5]"});
}

TYPED_TEST(ValidLensTyped, NegativeLengthIsAnError) {
  using I = TypeParam;
  const Tensor<I> per_batch(Shape{4}, std::vector<I>{2, 0, 5, -4});
  const std::string m1 = expect_error(
      [&] {
        ValidLens(per_batch).check("masked_softmax", "scores", Shape{4, 6, 5}, 4, 6, 5);
      },
      {"masked_softmax", "valid_lens", "-4"});
  EXPECT_TRUE(contains_any(m1, {"[3]", "(3)", "b=3", "index 3"})) << m1;

  const Tensor<I> per_query(Shape{3, 4}, std::vector<I>{1, 2, 3, 4, 0, 0, 0, 0, 5, 5, -1, 5});
  const std::string m2 = expect_error(
      [&] {
        ValidLens(per_query).check("masked_softmax", "scores", Shape{3, 4, 5}, 3, 4, 5);
      },
      {"masked_softmax", "valid_lens", "-1"});
  EXPECT_TRUE(contains_any(m2, {"[2, 2]", "(2, 2)", "b=2 q=2", "b=2 i=2"})) << m2;
}

TYPED_TEST(ValidLensTyped, LengthAboveNumKeysIsAnError) {
  using I = TypeParam;
  const Tensor<I> per_query(Shape{3, 4}, std::vector<I>{1, 2, 3, 4, 0, 0, 0, 0, 5, 5, 5, 9});
  const std::string m = expect_error(
      [&] {
        ValidLens(per_query).check("masked_softmax", "scores", Shape{3, 4, 5}, 3, 4, 5);
      },
      {"masked_softmax", "valid_lens", "9", "5"});
  EXPECT_TRUE(contains_any(m, {"[2, 3]", "(2, 3)", "b=2 q=3", "b=2 i=3"})) << m;

  const Tensor<I> per_batch(Shape{2}, std::vector<I>{6, 1});
  const std::string m1 = expect_error(
      [&] {
        ValidLens(per_batch).check("masked_softmax", "scores", Shape{2, 3, 5}, 2, 3, 5);
      },
      {"masked_softmax", "valid_lens", "6"});
  EXPECT_TRUE(contains_any(m1, {"[0]", "(0)", "b=0", "index 0"})) << m1;
}

TEST(ValidLens, ToTensorWidensInt32) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tensor<int32_t> t32 = random_lens<int32_t>(rng, LensForm::kPerQuery, 3, 5, 1 << 30);
  const Tensor<int64_t> t64 = ValidLens(t32).to_tensor();
  ASSERT_EQ(t64.shape(), t32.shape());
  for (size_t n = 0; n < t32.values().size(); ++n) {
    EXPECT_EQ(t64.values()[n], static_cast<int64_t>(t32.values()[n]));
  }
}

}  // namespace
}  // namespace qkv::test
