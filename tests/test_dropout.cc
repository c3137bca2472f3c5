// Tests of dropout on attention weights (qkv/dropout.h): the keep/drop decision
// is a pure function of (seed, b, i, j) with keep rate 1 - p, and
// apply_dropout zeroes exactly the dropped weights and scales the kept ones.
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "test_util.h"

namespace qkv::test {
namespace {

// The relative error of w / (1 - p) computed in T: at most two roundings.
template <class T>
constexpr double kScaleRtol = 2.5 * std::numeric_limits<T>::epsilon() / 2;

TEST(DropoutKeep, IsAPureFunctionOfItsArguments) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int trial = 0; trial < 2000; ++trial) {
    const uint64_t s = rng.next();
    const double p = rng.uniform();
    const int64_t b = rng.uniform_int(0, 1000), i = rng.uniform_int(0, 100000),
                  j = rng.uniform_int(0, 100000);
    const bool first = dropout_keep(s, p, b, i, j);
    // Interleave other calls: no hidden state may leak between them.
    (void)dropout_keep(rng.next(), rng.uniform(), j, b, i);
    ASSERT_EQ(dropout_keep(s, p, b, i, j), first)
        << "seed " << s << " p " << p << " b=" << b << " i=" << i << " j=" << j;
  }
}

// Two seeds give independent masks: about half the decisions differ at p = 0.5.
TEST(DropoutKeep, DifferentSeedsGiveDifferentMasks) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const uint64_t s0 = rng.next();
  for (uint64_t s1 : {s0 + 1, s0 ^ (uint64_t{1} << 40), s0 ^ (uint64_t{1} << 63), rng.next()}) {
    SCOPED_TRACE("seeds " + std::to_string(s0) + " and " + std::to_string(s1));
    int64_t differ = 0, n = 0;
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t i = 0; i < 16; ++i) {
        for (int64_t j = 0; j < 256; ++j, ++n) {
          differ += dropout_keep(s0, 0.5, b, i, j) != dropout_keep(s1, 0.5, b, i, j);
        }
      }
    }
    const double sigma = std::sqrt(0.25 * static_cast<double>(n));
    EXPECT_NEAR(static_cast<double>(differ), 0.5 * static_cast<double>(n), 5 * sigma)
        << differ << " of " << n << " decisions differ";
  }
}

// Rows (b, i) and columns j get independent decisions too.
TEST(DropoutKeep, RowsAndColumnsAreIndependent) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  const uint64_t s = Rng(seed).next();
  const int64_t n = 4096;
  const auto differing = [&](int64_t b0, int64_t i0, int64_t b1, int64_t i1) {
    int64_t differ = 0;
    for (int64_t j = 0; j < n; ++j) {
      differ += dropout_keep(s, 0.5, b0, i0, j) != dropout_keep(s, 0.5, b1, i1, j);
    }
    return static_cast<double>(differ);
  };
  const double sigma = std::sqrt(0.25 * n);
  EXPECT_NEAR(differing(0, 0, 0, 1), 0.5 * n, 5 * sigma) << "rows (0, 0) and (0, 1)";
  EXPECT_NEAR(differing(0, 0, 1, 0), 0.5 * n, 5 * sigma) << "rows (0, 0) and (1, 0)";
  EXPECT_NEAR(differing(1, 2, 2, 1), 0.5 * n, 5 * sigma) << "rows (1, 2) and (2, 1)";
  // Neighbouring columns, including across the groups of four of one counter.
  for (int64_t shift : {1, 2, 3, 4, 5}) {
    int64_t differ = 0;
    for (int64_t j = 0; j < n; ++j) {
      differ += dropout_keep(s, 0.5, 3, 7, j) != dropout_keep(s, 0.5, 3, 7, j + shift);
    }
    EXPECT_NEAR(static_cast<double>(differ), 0.5 * n, 5 * sigma) << "columns j and j+" << shift;
  }
}

TEST(DropoutKeep, ZeroKeepsAllAndOneDropsAll) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int trial = 0; trial < 20000; ++trial) {
    const uint64_t s = rng.next();
    const int64_t b = rng.uniform_int(0, 64), i = rng.uniform_int(0, 5000),
                  j = rng.uniform_int(0, 5000);
    ASSERT_TRUE(dropout_keep(s, 0.0, b, i, j))
        << "p=0 dropped (" << b << ", " << i << ", " << j << ") with seed " << s;
    ASSERT_FALSE(dropout_keep(s, 1.0, b, i, j))
        << "p=1 kept (" << b << ", " << i << ", " << j << ") with seed " << s;
  }
}

// The kept fraction over 10^6 elements is within 5 sigma of 1 - p, overall
// and for each position j mod 4 (the four words of one Philox block).
TEST(DropoutKeep, KeepsAFractionOneMinusP) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (double p : {0.1, 0.5, 0.9}) {
    const uint64_t s = rng.next();
    SCOPED_TRACE("p = " + std::to_string(p) + ", seed " + std::to_string(s));
    const int64_t batch = 4, num_queries = 250, num_keys = 1000;
    int64_t kept = 0;
    int64_t kept_lane[4] = {0, 0, 0, 0};
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < num_queries; ++i) {
        for (int64_t j = 0; j < num_keys; ++j) {
          const bool keep = dropout_keep(s, p, b, i, j);
          kept += keep;
          kept_lane[j % 4] += keep;
        }
      }
    }
    const double n = static_cast<double>(batch * num_queries * num_keys);
    const double sigma = std::sqrt(p * (1 - p) / n);
    EXPECT_NEAR(static_cast<double>(kept) / n, 1 - p, 5 * sigma) << kept << " of " << n;
    for (int lane = 0; lane < 4; ++lane) {
      EXPECT_NEAR(static_cast<double>(kept_lane[lane]) / (n / 4), 1 - p, 5 * 2 * sigma)
          << "j mod 4 = " << lane;
    }
  }
}

// ---- apply_dropout -------------------------------------------------------------

template <class T>
class ApplyDropout : public ::testing::Test {};
using FloatTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(ApplyDropout, FloatTypes);

// Checks that `out` is `in` with the dropped elements zeroed and the kept
// ones scaled by 1/(1 - p), element (b, i, j) decided by dropout_keep.
template <class T>
bool expect_dropout_applied(ConstView<T> out, ConstView<T> in, uint64_t seed, double p) {
  int64_t bad = 0;
  for (int64_t b = 0; b < in.size(0); ++b) {
    for (int64_t i = 0; i < in.size(1); ++i) {
      for (int64_t j = 0; j < in.size(2); ++j) {
        const double got = out(b, i, j);
        const std::string where =
            "b=" + std::to_string(b) + " q=" + std::to_string(i) + " k=" + std::to_string(j) + ": ";
        if (!dropout_keep(seed, p, b, i, j)) {
          if (got != 0 && bad++ < 5) ADD_FAILURE() << where << "dropped but holds " << got;
        } else {
          const double want = static_cast<double>(in(b, i, j)) / (1 - p);
          const bool ok = std::isnan(want) ? std::isnan(got)
                          : std::isinf(want)
                              ? got == want
                              : std::abs(got - want) <= kScaleRtol<T> * std::abs(want);
          if (!ok) {
            if (bad++ < 5) {
              ADD_FAILURE() << where << "kept: got " << format_value(out(b, i, j)) << ", want "
                            << format_value(want) << " (" << format_value(in(b, i, j)) << " / "
                            << 1 - p << ")";
            }
          }
        }
      }
    }
  }
  return bad == 0;
}

TYPED_TEST(ApplyDropout, ZeroesTheDroppedAndScalesTheKept) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (double p : {0.1, 0.25, 0.5, 0.9, 0.999}) {
    const Shape shape{rng.uniform_int(1, 3), rng.uniform_int(1, 9), rng.uniform_int(1, 70)};
    const uint64_t s = rng.next();
    SCOPED_TRACE("p = " + std::to_string(p) + ", seed " + std::to_string(s) + ", " + shape.str());
    // Weights in (0, 1]: never 0, so a kept weight is never 0 either.
    const Tensor<T> w = random_tensor<T>(rng, shape, 1e-3, 1.0);
    Tensor<T> out = w;
    apply_dropout(out.view(), s, p);
    if (!expect_dropout_applied<T>(out, w, s, p)) return;
    for (size_t n = 0; n < w.values().size(); ++n) ASSERT_GT(w.values()[n], T(0));
  }
}

TYPED_TEST(ApplyDropout, ZeroKeepsEverythingOneZeroesEverything) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tensor<T> w = random_tensor<T>(rng, Shape{2, 5, 37});
  Tensor<T> kept = w;
  apply_dropout(kept.view(), rng.next(), 0.0);
  expect_bitwise_equal(kept, w, "p = 0");
  Tensor<T> dropped = w;
  dropped(1, 4, 36) = std::numeric_limits<T>::quiet_NaN();
  dropped(0, 0, 0) = std::numeric_limits<T>::infinity();
  apply_dropout(dropped.view(), rng.next(), 1.0);
  for (T v : dropped.values()) ASSERT_EQ(v, T(0)) << "p = 1 left " << v;
}

// A dropped element becomes 0 whatever it held (NaN, inf).
TYPED_TEST(ApplyDropout, DroppedNonFiniteWeightsBecomeZero) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  Tensor<T> w = random_tensor<T>(rng, Shape{3, 4, 21});
  for (T& v : w.values()) {
    if (rng.bernoulli(0.3)) v = std::numeric_limits<T>::quiet_NaN();
    if (rng.bernoulli(0.1)) v = -std::numeric_limits<T>::infinity();
  }
  const uint64_t s = rng.next();
  Tensor<T> out = w;
  apply_dropout(out.view(), s, 0.5);
  expect_dropout_applied<T>(out, w, s, 0.5);
}

TYPED_TEST(ApplyDropout, StridedWeights) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tensor<T> w = random_tensor<T>(rng, Shape{3, 6, 29}, 0.01, 1.0);
  const uint64_t s = rng.next();
  for (bool reversed : {false, true}) {
    SCOPED_TRACE(reversed ? "column-major" : "padded");
    const Strided<T> strided(w.view(), {.step = 2, .pad = 3, .offset = 1, .reversed = reversed});
    apply_dropout(strided.view(), s, 0.3);
    expect_dropout_applied<T>(strided.const_view(), w, s, 0.3);
    std::set<const T*> inside;
    for_each_index(w.shape(), [&](const std::array<int64_t, kMaxRank>& index) {
      inside.insert(strided.view().data() + offset_of(strided.view().strides(), index, 3));
    });
    for (const T& v : strided.storage()) {
      if (!inside.count(&v)) {
        ASSERT_TRUE(std::isnan(v)) << "wrote outside the view";
      }
    }
  }
}

// The fraction of zeroed weights of a 10^6-element tensor is within 5 sigma of p.
TYPED_TEST(ApplyDropout, DropsAFractionP) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (double p : {0.1, 0.5, 0.9}) {
    Tensor<T> w(Shape{4, 250, 1000}, T(1));
    apply_dropout(w.view(), rng.next(), p);
    int64_t zeros = 0;
    for (T v : w.values()) zeros += v == T(0);
    const double n = static_cast<double>(w.numel());
    EXPECT_NEAR(static_cast<double>(zeros) / n, p, 5 * std::sqrt(p * (1 - p) / n)) << "p = " << p;
  }
}

// ---- errors --------------------------------------------------------------------

TYPED_TEST(ApplyDropout, InvalidProbabilityIsAnError) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  const Tensor<T> w = random_tensor<T>(seed, Shape{2, 3, 4});
  for (double p : {-0.1, 1.5, -1e-12, std::numeric_limits<double>::quiet_NaN(),
                   std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE("p = " + std::to_string(p));
    Tensor<T> out = w;
    expect_error([&] { apply_dropout(out.view(), 1, p); }, {"apply_dropout"});
    expect_bitwise_equal(out, w, "weights after a rejected call");
    expect_error([&] { (void)dropout_keep(1, p, 0, 0, 0); }, {"dropout_keep"});
  }
  Tensor<T> out = w;
  expect_error([&] { apply_dropout(out.view(), 1, -0.1); }, {"apply_dropout", "-0.1"});
  expect_error([&] { apply_dropout(out.view(), 1, 1.5); }, {"apply_dropout", "1.5"});
  expect_error([&] { (void)dropout_keep(1, 1.5, 0, 0, 0); }, {"dropout_keep", "1.5"});
}

TYPED_TEST(ApplyDropout, RankOtherThanThreeIsAnError) {
  using T = TypeParam;
  for (const Shape& shape : {Shape{4, 5}, Shape{2, 3, 4, 5}, Shape{7}}) {
    Tensor<T> w(shape, T(1));
    expect_error([&] { apply_dropout(w.view(), 0, 0.5); }, {"apply_dropout", shape.str()});
    for (T v : w.values()) ASSERT_EQ(v, T(1)) << "wrote before validating";
  }
}

}  // namespace
}  // namespace qkv::test
