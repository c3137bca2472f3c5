// Tests of masked softmax (qkv/masked_softmax.h), forward and backward: the
// fast version against the reference, the reference against a plain double
// loop written here from DESIGN.md §3, the chapter's examples, the numerics
// of §3 (exact masking, -inf, NaN, +inf, large logits) and the error messages.
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "test_util.h"

namespace qkv::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Key counts around the SIMD widths (4, 8 and 16 lanes) plus large ones.
constexpr int64_t kNumKeys[] = {1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 65, 257, 1000};

// The valid length of row (b, i), read straight from the test's own tensor.
template <class I>
int64_t row_len(const Tensor<I>& lens, int64_t b, int64_t i, int64_t num_keys) {
  if (lens.empty()) return num_keys;
  return static_cast<int64_t>(lens.rank() == 1 ? lens(b) : lens(b, i));
}

// DESIGN.md §3 written out in double: for j < L, w_j = exp(x_j - m) / sum,
// m = max_{j<L} x_j; masked positions are never read; L = 0 or all -inf
// gives zeros; NaN or +inf among the valid scores gives NaN for j < L.
template <class I>
Tensor<double> plain_masked_softmax(ConstView<double> x, const Tensor<I>& lens) {
  const int64_t batch = x.size(0), num_queries = x.size(1), num_keys = x.size(2);
  Tensor<double> w(x.shape(), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < num_queries; ++i) {
      const int64_t len = row_len(lens, b, i, num_keys);
      bool poisoned = false;
      double m = -kInf;
      for (int64_t j = 0; j < len; ++j) {
        const double xj = x(b, i, j);
        if (std::isnan(xj) || xj == kInf) poisoned = true;
        if (xj > m) m = xj;
      }
      if (poisoned) {
        for (int64_t j = 0; j < len; ++j) w(b, i, j) = kNaN;
        continue;
      }
      if (m == -kInf) continue;  // L = 0, or every valid score is -inf
      long double sum = 0;
      for (int64_t j = 0; j < len; ++j) sum += std::exp(x(b, i, j) - m);
      for (int64_t j = 0; j < len; ++j) {
        w(b, i, j) = static_cast<double>(std::exp(x(b, i, j) - m) / sum);
      }
    }
  }
  return w;
}

// d_x[j] = w[j] * (g[j] - sum_{k<L} w[k] g[k]) for j < L, 0 past L.
template <class I>
Tensor<double> plain_masked_softmax_backward(ConstView<double> w, ConstView<double> g,
                                             const Tensor<I>& lens) {
  const int64_t batch = w.size(0), num_queries = w.size(1), num_keys = w.size(2);
  Tensor<double> dx(w.shape(), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < num_queries; ++i) {
      const int64_t len = row_len(lens, b, i, num_keys);
      long double dot = 0;
      for (int64_t j = 0; j < len; ++j) {
        dot += static_cast<long double>(w(b, i, j)) * g(b, i, j);
      }
      for (int64_t j = 0; j < len; ++j) {
        dx(b, i, j) = static_cast<double>(w(b, i, j) * (g(b, i, j) - dot));
      }
    }
  }
  return dx;
}

// Positions j >= L must hold exactly 0 (not a tiny number): masking is exact.
template <class W, class I>
bool expect_masked_zero(const W& w_in, const Tensor<I>& lens, std::string_view name) {
  const auto w = as_const_view(w_in);
  int64_t bad = 0;
  for (int64_t b = 0; b < w.size(0); ++b) {
    for (int64_t i = 0; i < w.size(1); ++i) {
      const int64_t len = row_len(lens, b, i, w.size(2));
      for (int64_t j = len; j < w.size(2); ++j) {
        if (w(b, i, j) != 0 && bad++ < 5) {
          ADD_FAILURE() << name << ": masked position b=" << b << " q=" << i << " k=" << j
                        << " (valid_len " << len << ") holds " << format_value(w(b, i, j));
        }
      }
    }
  }
  return bad == 0;
}

// Rows with L > 0 and finite weights sum to 1.
template <class T, class I>
void expect_rows_sum_to_one(ConstView<T> w, const Tensor<I>& lens, double tol,
                            std::string_view name) {
  for (int64_t b = 0; b < w.size(0); ++b) {
    for (int64_t i = 0; i < w.size(1); ++i) {
      const int64_t len = row_len(lens, b, i, w.size(2));
      if (len == 0) continue;
      double sum = 0;
      for (int64_t j = 0; j < w.size(2); ++j) sum += static_cast<double>(w(b, i, j));
      EXPECT_NEAR(sum, 1.0, tol) << name << ": row b=" << b << " q=" << i << " (valid_len " << len
                                 << ")";
    }
  }
}

std::string case_label(const Shape& shape, LensForm form, bool int32_lens) {
  return "scores " + shape.str() + ", " + to_string(form) +
         (form == LensForm::kNone ? "" : (int32_lens ? " int32" : " int64"));
}

// Runs fast and reference forwards on x and holds them to each other and to
// the plain loop. Returns false on the first failing comparison.
template <class T, class I>
bool check_forward(const Tensor<T>& x, const Tensor<I>& lens) {
  const Tol tol = tol_for<T>(kSoftmax, kSoftmaxDouble);
  const ValidLens valid_lens = as_valid_lens(lens);
  const Tensor<T> fast = masked_softmax(x, valid_lens);
  const Tensor<T> ref_t = ref::masked_softmax(x, valid_lens);
  const Tensor<double> xd = cast<double>(x);
  const Tensor<double> ref_d = ref::masked_softmax(xd, valid_lens);
  const Tensor<double> plain = plain_masked_softmax(xd.view(), lens);
  bool ok = expect_close(ref_d, plain, kSoftmaxRefVsLoop, "ref<double> vs plain loop");
  ok = expect_close(fast, ref_d, tol, "fast vs ref<double>") && ok;
  ok = expect_close(ref_t, ref_d, tol, "ref<T> vs ref<double>") && ok;
  ok = expect_masked_zero(fast, lens, "fast") && ok;
  ok = expect_masked_zero(ref_t, lens, "ref") && ok;
  return ok;
}

template <class T>
class MaskedSoftmax : public ::testing::Test {};
using FloatTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(MaskedSoftmax, FloatTypes);

// ---- the chapter's examples ------------------------------------------------------

// d2l: masked_softmax(torch.rand(2, 2, 4), torch.tensor([2, 3])).
TEST(MaskedSoftmaxChapter, PerBatchLengths) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  const Tensor<float> x = random_tensor<float>(seed, Shape{2, 2, 4}, 0.0, 1.0);
  const Tensor<int64_t> lens(Shape{2}, std::vector<int64_t>{2, 3});
  const Tensor<float> w = masked_softmax(x, lens);
  ASSERT_EQ(w.shape(), (Shape{2, 2, 4}));
  for (int64_t i = 0; i < 2; ++i) {
    SCOPED_TRACE("query " + std::to_string(i));
    EXPECT_GT(w(0, i, 0), 0.0f);
    EXPECT_GT(w(0, i, 1), 0.0f);
    EXPECT_EQ(w(0, i, 2), 0.0f);
    EXPECT_EQ(w(0, i, 3), 0.0f);
    EXPECT_NEAR(w(0, i, 0) + w(0, i, 1), 1.0, 1e-6);
    for (int64_t j = 0; j < 3; ++j) EXPECT_GT(w(1, i, j), 0.0f) << "j=" << j;
    EXPECT_EQ(w(1, i, 3), 0.0f);
    EXPECT_NEAR(w(1, i, 0) + w(1, i, 1) + w(1, i, 2), 1.0, 1e-6);
  }
  // Inputs in [0, 1) keep every valid weight within a factor e of 1/L.
  for (int64_t i = 0; i < 2; ++i) {
    for (int64_t j = 0; j < 2; ++j) {
      EXPECT_GT(w(0, i, j), 1.0 / (1.0 + std::exp(1.0)) - 1e-6);
    }
  }
  expect_close(w, plain_masked_softmax(cast<double>(x).view(), lens), kSoftmax, "chapter (B)");
  check_forward(x, lens);
}

// d2l: masked_softmax(torch.rand(2, 2, 4), torch.tensor([[1, 3], [2, 4]])).
TEST(MaskedSoftmaxChapter, PerQueryLengths) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  const Tensor<float> x = random_tensor<float>(seed, Shape{2, 2, 4}, 0.0, 1.0);
  const Tensor<int64_t> lens(Shape{2, 2}, std::vector<int64_t>{1, 3, 2, 4});
  const Tensor<float> w = masked_softmax(x, lens);
  ASSERT_EQ(w.shape(), (Shape{2, 2, 4}));
  EXPECT_NEAR(w(0, 0, 0), 1.0, 1e-7);
  for (int64_t j = 1; j < 4; ++j) EXPECT_EQ(w(0, 0, j), 0.0f) << "j=" << j;
  for (int64_t j = 0; j < 3; ++j) EXPECT_GT(w(0, 1, j), 0.0f) << "j=" << j;
  EXPECT_EQ(w(0, 1, 3), 0.0f);
  EXPECT_GT(w(1, 0, 0), 0.0f);
  EXPECT_GT(w(1, 0, 1), 0.0f);
  EXPECT_EQ(w(1, 0, 2), 0.0f);
  EXPECT_EQ(w(1, 0, 3), 0.0f);
  for (int64_t j = 0; j < 4; ++j) EXPECT_GT(w(1, 1, j), 0.0f) << "j=" << j;
  expect_rows_sum_to_one<float>(w, lens, 1e-6, "chapter (B, Nq)");
  expect_close(w, plain_masked_softmax(cast<double>(x).view(), lens), kSoftmax, "chapter (B, Nq)");
  const Tensor<int32_t> lens32(Shape{2, 2}, std::vector<int32_t>{1, 3, 2, 4});
  expect_bitwise_equal(masked_softmax(x, lens32), w, "int32 lens vs int64 lens");
  check_forward(x, lens);
}

// ---- fast vs reference vs plain loop -------------------------------------------

TYPED_TEST(MaskedSoftmax, MatchesReferenceOverShapes) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int64_t num_keys : kNumKeys) {
    for (LensForm form : kAllLensForms) {
      const int64_t batch = rng.uniform_int(1, 5), num_queries = rng.uniform_int(1, 5);
      const Shape shape{batch, num_queries, num_keys};
      const Tensor<T> x = random_tensor<T>(rng, shape, -8.0, 8.0);
      const bool int32_lens = rng.bernoulli(0.5);
      SCOPED_TRACE(case_label(shape, form, int32_lens));
      const bool ok =
          int32_lens
              ? check_forward(x, random_lens<int32_t>(rng, form, batch, num_queries, num_keys))
              : check_forward(x, random_lens<int64_t>(rng, form, batch, num_queries, num_keys));
      if (!ok) return;
    }
  }
}

TYPED_TEST(MaskedSoftmax, RowsSumToOne) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int64_t num_keys : {1, 9, 33, 1000}) {
    const Tensor<T> x = random_tensor<T>(rng, Shape{3, 5, num_keys}, -10.0, 10.0);
    const Tensor<int64_t> lens = random_lens(rng, LensForm::kPerQuery, 3, 5, num_keys);
    const Tensor<T> w = masked_softmax(x, lens);
    expect_rows_sum_to_one<T>(w, lens, sizeof(T) == 4 ? 2e-5 : 1e-12, "fast");
  }
}

TYPED_TEST(MaskedSoftmax, ZeroLengthRowsAreZero) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int64_t num_keys : {1, 8, 17, 65}) {
    const Tensor<T> x = random_tensor<T>(rng, Shape{2, 3, num_keys}, -5.0, 5.0);
    // Every row masked, in both forms.
    const Tensor<int32_t> none_b(Shape{2}, 0);
    const Tensor<int64_t> none_bq(Shape{2, 3}, 0);
    for (const Tensor<T>& w :
         {masked_softmax(x, none_b), masked_softmax(x, none_bq), ref::masked_softmax(x, none_b)}) {
      for (T v : w.values()) ASSERT_EQ(v, T(0)) << "Nk=" << num_keys;
    }
    // A mix: (b=0, q=1) and all of b=1 have L = 0.
    const Tensor<int64_t> mix(Shape{2, 3},
                              std::vector<int64_t>{num_keys, 0, num_keys / 2 + 1, 0, 0, 0});
    const Tensor<T> w = masked_softmax(x, mix);
    for (int64_t j = 0; j < num_keys; ++j) {
      EXPECT_EQ(w(0, 1, j), T(0));
      for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(w(1, i, j), T(0));
    }
    expect_close(w, plain_masked_softmax(cast<double>(x).view(), mix),
                 tol_for<T>(kSoftmax, kSoftmaxDouble), "mixed zero lengths");
  }
}

TYPED_TEST(MaskedSoftmax, EmptyShapes) {
  using T = TypeParam;
  for (const Shape& shape : {Shape{0, 3, 4}, Shape{2, 0, 4}, Shape{2, 3, 0}}) {
    SCOPED_TRACE(shape.str());
    const Tensor<T> x(shape);
    EXPECT_EQ(masked_softmax(x).shape(), shape);
    EXPECT_EQ(ref::masked_softmax(x).shape(), shape);
    const Tensor<T> g(shape);
    EXPECT_EQ(masked_softmax_backward(x, g).shape(), shape);
  }
  const Tensor<T> x(Shape{2, 3, 0});
  const Tensor<int64_t> zero_lens(Shape{2}, 0);
  EXPECT_EQ(masked_softmax(x, zero_lens).shape(), (Shape{2, 3, 0}));
}

// ---- numerics of DESIGN.md §3 -------------------------------------------------

// d2l's -1e6 sentinel would make these scores indistinguishable from masked
// ones; exact masking keeps them.
TYPED_TEST(MaskedSoftmax, ScoresBelowTheSentinelStillCount) {
  using T = TypeParam;
  const Tensor<T> x(Shape{1, 3, 4}, std::vector<T>{-2e6, -2e6 + 1, 5, 7,  //
                                                   -2e6, 3, 7, 9,         //
                                                   -3e6, -3e6, -2e6, 0});
  const Tensor<int64_t> lens(Shape{1, 3}, std::vector<int64_t>{2, 1, 3});
  const double s1 = 1.0 / (1.0 + std::exp(-1.0));                                      // sigmoid(1)
  const Tensor<double> expected(Shape{1, 3, 4}, std::vector<double>{1 - s1, s1, 0, 0,  //
                                                                    1, 0, 0, 0,        //
                                                                    0, 0, 1, 0});
  const Tol tol = tol_for<T>(kSoftmax, kSoftmaxDouble);
  expect_close(masked_softmax(x, lens), expected, tol, "fast");
  expect_close(ref::masked_softmax(x, lens), expected, tol, "ref");
  expect_masked_zero(masked_softmax(x, lens), lens, "fast");
}

// Logits in [90, 100]: exp(x) overflows float (and a softmax that skips the
// max subtraction returns inf/inf = NaN); exp(x - max) does not.
TYPED_TEST(MaskedSoftmax, LargeLogitsDoNotOverflow) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int64_t num_keys : {1, 7, 16, 33, 1000}) {
    for (LensForm form : kAllLensForms) {
      const Shape shape{rng.uniform_int(1, 3), rng.uniform_int(1, 5), num_keys};
      SCOPED_TRACE(case_label(shape, form, false));
      const Tensor<T> x = random_tensor<T>(rng, shape, 90.0, 100.0);
      const Tensor<int64_t> lens = random_lens(rng, form, shape[0], shape[1], num_keys);
      const Tensor<T> w = masked_softmax(x, as_valid_lens(lens));
      for (T v : w.values()) ASSERT_TRUE(std::isfinite(v)) << v;
      if (!check_forward(x, lens)) return;
    }
  }
  // Far beyond: 1e4 and 3e38 (float's max is 3.4e38).
  const Tensor<T> huge(Shape{1, 2, 3}, std::vector<T>{1e4, 1e4 - 1, 1e4 - 2, 3e38, 3e38, 0});
  const Tensor<T> w = masked_softmax(huge);
  const double e1 = std::exp(-1.0), e2 = std::exp(-2.0);
  const Tensor<double> expected(
      Shape{1, 2, 3},
      std::vector<double>{1 / (1 + e1 + e2), e1 / (1 + e1 + e2), e2 / (1 + e1 + e2), 0.5, 0.5, 0});
  expect_close(w, expected, tol_for<T>(kSoftmax, kSoftmaxDouble), "huge logits");
}

// Logits around -1e4: exp(x) underflows to 0 (0/0 without the max
// subtraction); exp(x - max) does not.
TYPED_TEST(MaskedSoftmax, VeryNegativeLogitsDoNotUnderflow) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int64_t num_keys : {1, 9, 64, 257}) {
    const Tensor<T> x = random_tensor<T>(rng, Shape{2, 3, num_keys}, -1e4, -1e4 + 10);
    const Tensor<int64_t> lens = random_lens(rng, LensForm::kPerBatch, 2, 3, num_keys);
    SCOPED_TRACE("Nk=" + std::to_string(num_keys));
    if (!check_forward(x, lens)) return;
  }
}

TYPED_TEST(MaskedSoftmax, NegativeInfinityScoresGetWeightZero) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const T minus_inf = -std::numeric_limits<T>::infinity();
  for (int64_t num_keys : {1, 5, 8, 17, 33, 100}) {
    for (LensForm form : kAllLensForms) {
      const int64_t batch = 3, num_queries = 4;
      const Shape shape{batch, num_queries, num_keys};
      SCOPED_TRACE(case_label(shape, form, false));
      Tensor<T> x = random_tensor<T>(rng, shape, -3.0, 3.0);
      for (T& v : x.values()) {
        if (rng.bernoulli(0.3)) v = minus_inf;
      }
      // Query 0 of batch 0: every score -inf.
      for (int64_t j = 0; j < num_keys; ++j) x(0, 0, j) = minus_inf;
      const Tensor<int64_t> lens = random_lens(rng, form, batch, num_queries, num_keys);
      const ValidLens valid_lens = as_valid_lens(lens);
      for (const Tensor<T>& w :
           {masked_softmax(x, valid_lens), ref::masked_softmax(x, valid_lens)}) {
        for (int64_t b = 0; b < batch; ++b) {
          for (int64_t i = 0; i < num_queries; ++i) {
            for (int64_t j = 0; j < num_keys; ++j) {
              if (x(b, i, j) == minus_inf) {
                ASSERT_EQ(w(b, i, j), T(0)) << "b=" << b << " q=" << i << " k=" << j;
              }
            }
          }
        }
        for (int64_t j = 0; j < num_keys; ++j) ASSERT_EQ(w(0, 0, j), T(0)) << "all -inf row";
      }
      if (!check_forward(x, lens)) return;
    }
  }
}

// NaN or +inf among a row's valid scores makes that row's valid weights NaN,
// its masked weights 0, and leaves every other row exactly as it was.
TYPED_TEST(MaskedSoftmax, NaNOrPlusInfPoisonsOnlyItsRow) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int64_t num_keys : {1, 5, 17, 64, 300}) {
    for (LensForm form : {LensForm::kNone, LensForm::kPerBatch, LensForm::kPerQuery}) {
      const int64_t batch = 3, num_queries = 4;
      const Shape shape{batch, num_queries, num_keys};
      SCOPED_TRACE(case_label(shape, form, false));
      const Tensor<T> clean = random_tensor<T>(rng, shape, -4.0, 4.0);
      Tensor<int64_t> lens = random_lens(rng, form, batch, num_queries, num_keys);
      // Rows (0, 1) and (2, 3) get a poison, so they need L >= 1.
      if (form == LensForm::kPerBatch) lens(0) = lens(2) = rng.uniform_int(1, num_keys);
      if (form == LensForm::kPerQuery) lens(0, 1) = lens(2, 3) = rng.uniform_int(1, num_keys);
      Tensor<T> x = clean;
      x(0, 1, rng.uniform_int(0, row_len(lens, 0, 1, num_keys) - 1)) =
          std::numeric_limits<T>::quiet_NaN();
      // Row (2, 3): +inf, and -inf at position 0 when there is room (+inf wins).
      const int64_t len_inf = row_len(lens, 2, 3, num_keys);
      x(2, 3, rng.uniform_int(len_inf >= 2 ? 1 : 0, len_inf - 1)) =
          std::numeric_limits<T>::infinity();
      if (len_inf >= 2) x(2, 3, 0) = -std::numeric_limits<T>::infinity();

      const ValidLens valid_lens = as_valid_lens(lens);
      const Tensor<T> fast_clean = masked_softmax(clean, valid_lens);
      const Tensor<T> ref_clean = ref::masked_softmax(clean, valid_lens);
      const Tensor<T> fast = masked_softmax(x, valid_lens);
      const Tensor<T> refw = ref::masked_softmax(x, valid_lens);
      for (const auto& [w, w_clean, name] :
           {std::tuple{&fast, &fast_clean, "fast"}, std::tuple{&refw, &ref_clean, "ref"}}) {
        for (int64_t b = 0; b < batch; ++b) {
          for (int64_t i = 0; i < num_queries; ++i) {
            const bool poisoned = (b == 0 && i == 1) || (b == 2 && i == 3);
            const int64_t len = row_len(lens, b, i, num_keys);
            const std::string where = std::string(name) + " b=" + std::to_string(b) +
                                      " q=" + std::to_string(i) + " L=" + std::to_string(len);
            if (poisoned) {
              for (int64_t j = 0; j < len; ++j) {
                EXPECT_TRUE(std::isnan((*w)(b, i, j)))
                    << where << " k=" << j << ": " << (*w)(b, i, j);
              }
              for (int64_t j = len; j < num_keys; ++j) {
                EXPECT_EQ((*w)(b, i, j), T(0)) << where << " k=" << j;
              }
            } else {
              const ConstView<T> row = w->view().slice(b).slice(i);
              const ConstView<T> row_clean = w_clean->view().slice(b).slice(i);
              if (!expect_bitwise_equal(row, row_clean, where + " vs the clean input")) return;
            }
          }
        }
      }
      expect_close(fast, plain_masked_softmax(cast<double>(x).view(), lens),
                   tol_for<T>(kSoftmax, kSoftmaxDouble), "fast vs plain loop");
    }
  }
  // +inf with -inf in one row, and +inf only at a masked position.
  const T inf = std::numeric_limits<T>::infinity();
  const Tensor<T> x(Shape{1, 2, 3}, std::vector<T>{inf, -inf, 2, 1, inf, inf});
  const Tensor<int32_t> lens(Shape{1, 2}, std::vector<int32_t>{3, 1});
  for (const Tensor<T>& w : {masked_softmax(x, lens), ref::masked_softmax(x, lens)}) {
    for (int64_t j = 0; j < 3; ++j) EXPECT_TRUE(std::isnan(w(0, 0, j))) << "k=" << j;
    EXPECT_EQ(w(0, 1, 0), T(1));
    EXPECT_EQ(w(0, 1, 1), T(0));
    EXPECT_EQ(w(0, 1, 2), T(0));
  }
}

// Masked positions are never read: NaN, +inf or -inf there changes nothing.
TYPED_TEST(MaskedSoftmax, GarbageAtMaskedPositionsIsIgnored) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const T garbage[] = {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity(),
                       -std::numeric_limits<T>::infinity(), std::numeric_limits<T>::max()};
  for (int64_t num_keys : {2, 8, 9, 31, 65, 1000}) {
    for (LensForm form : {LensForm::kPerBatch, LensForm::kPerQuery}) {
      const int64_t batch = 2, num_queries = 5;
      const Shape shape{batch, num_queries, num_keys};
      SCOPED_TRACE(case_label(shape, form, true));
      const Tensor<T> clean = random_tensor<T>(rng, shape, -4.0, 4.0);
      const Tensor<int32_t> lens = random_lens<int32_t>(rng, form, batch, num_queries, num_keys);
      Tensor<T> x = clean;
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t i = 0; i < num_queries; ++i) {
          for (int64_t j = row_len(lens, b, i, num_keys); j < num_keys; ++j) {
            x(b, i, j) = garbage[rng.uniform_int(0, 3)];
          }
        }
      }
      const Tensor<T> fast = masked_softmax(x, lens);
      for (T v : fast.values()) ASSERT_TRUE(std::isfinite(v));
      if (!expect_bitwise_equal(fast, masked_softmax(clean, lens), "fast vs clean input")) return;
      expect_bitwise_equal(ref::masked_softmax(x, lens), ref::masked_softmax(clean, lens),
                           "ref vs clean input");
      if (!check_forward(x, lens)) return;
    }
  }
}

// ---- views and buffers ---------------------------------------------------------

TYPED_TEST(MaskedSoftmax, StridedInputs) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tol tol = tol_for<T>(kSoftmax, kSoftmaxDouble);
  for (int64_t num_keys : {1, 7, 16, 33, 257}) {
    const int64_t batch = rng.uniform_int(1, 4), num_queries = rng.uniform_int(1, 5);
    const Shape shape{batch, num_queries, num_keys};
    SCOPED_TRACE(shape.str());
    const Tensor<T> x = random_tensor<T>(rng, shape, -6.0, 6.0);
    const Tensor<int32_t> lens =
        random_lens<int32_t>(rng, LensForm::kPerQuery, batch, num_queries, num_keys);
    const Strided<int32_t> strided_lens(lens.view(), {.step = 3, .pad = 1, .offset = 2});
    const Tensor<double> expected = plain_masked_softmax(cast<double>(x).view(), lens);
    for (bool reversed : {false, true}) {
      const Strided<T> sx(x.view(), {.step = 2, .pad = 5, .offset = 1, .reversed = reversed});
      const std::string how = reversed ? "column-major scores" : "padded scores";
      const Tensor<T> w = masked_softmax(sx.const_view(), ValidLens(strided_lens.const_view()));
      expect_close(w, expected, tol, how + ", fast");
      expect_masked_zero(w, lens, how + ", fast");
      expect_close(ref::masked_softmax(sx.const_view(), lens), expected, tol, how + ", ref");
    }
  }
}

TYPED_TEST(MaskedSoftmax, WritesIntoCallerBuffers) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tol tol = tol_for<T>(kSoftmax, kSoftmaxDouble);
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (int64_t num_keys : {1, 9, 32, 65, 1000}) {
    for (LensForm form : kAllLensForms) {
      const Shape shape{rng.uniform_int(1, 4), rng.uniform_int(1, 5), num_keys};
      SCOPED_TRACE(case_label(shape, form, false));
      const Tensor<T> x = random_tensor<T>(rng, shape, -6.0, 6.0);
      const Tensor<int64_t> lens = random_lens(rng, form, shape[0], shape[1], num_keys);
      const ValidLens valid_lens = as_valid_lens(lens);
      const Tensor<double> expected = plain_masked_softmax(cast<double>(x).view(), lens);

      // A contiguous buffer full of NaN: every element must be written.
      Tensor<T> out(shape, nan);
      masked_softmax(x, valid_lens, out.view());
      expect_close(out, expected, tol, "into a buffer");
      expect_masked_zero(out, lens, "into a buffer");
      expect_bitwise_equal(out, masked_softmax(x, valid_lens), "buffer vs returned");

      // In place: the weights overwrite the scores.
      Tensor<T> in_place = x;
      masked_softmax(in_place.view(), valid_lens, in_place.view());
      expect_close(in_place, expected, tol, "in place");
      expect_masked_zero(in_place, lens, "in place");
    }
  }
}

// A strided buffer whose storage was filled with NaN: every element outside
// the view must still be NaN (nothing written into the gaps).
template <class T>
void expect_gaps_untouched(const Strided<T>& strided) {
  std::set<int64_t> inside;
  const TensorView<T> sv = strided.view();
  for_each_index(sv.shape(), [&](const std::array<int64_t, kMaxRank>& index) {
    inside.insert(sv.data() - strided.storage().data() + offset_of(sv.strides(), index, 3));
  });
  for (size_t n = 0; n < strided.storage().size(); ++n) {
    if (!inside.count(static_cast<int64_t>(n))) {
      ASSERT_TRUE(std::isnan(strided.storage()[n])) << "wrote outside the view at " << n;
    }
  }
}

// The weights view may be strided like any other view (masked_softmax.h puts
// no contiguity requirement on it).
TYPED_TEST(MaskedSoftmax, WritesIntoStridedBuffers) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tol tol = tol_for<T>(kSoftmax, kSoftmaxDouble);
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (int64_t num_keys : {1, 9, 32, 65, 1000}) {
    for (LensForm form : kAllLensForms) {
      const Shape shape{rng.uniform_int(1, 4), rng.uniform_int(1, 5), num_keys};
      SCOPED_TRACE(case_label(shape, form, false));
      const Tensor<T> x = random_tensor<T>(rng, shape, -6.0, 6.0);
      const Tensor<int64_t> lens = random_lens(rng, form, shape[0], shape[1], num_keys);
      const ValidLens valid_lens = as_valid_lens(lens);
      const Tensor<double> expected = plain_masked_softmax(cast<double>(x).view(), lens);

      // A strided buffer: the view gets the weights, the gaps stay untouched.
      const Strided<T> strided_out(Tensor<T>(shape, nan).view(), {.step = 2, .pad = 3});
      masked_softmax(x, valid_lens, strided_out.view());
      expect_close(strided_out.view(), expected, tol, "into a strided buffer");
      expect_gaps_untouched(strided_out);

      // In place through a strided view.
      const Strided<T> strided_in_place(x.view(), {.reversed = true});
      masked_softmax(strided_in_place.const_view(), valid_lens, strided_in_place.view());
      expect_close(strided_in_place.view(), expected, tol, "in place, strided");
    }
  }
}

// ---- backward ------------------------------------------------------------------

TYPED_TEST(MaskedSoftmax, BackwardMatchesReference) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tol tol = tol_for<T>(kSoftmaxBackward, kSoftmaxBackwardDouble);
  for (int64_t num_keys : kNumKeys) {
    for (LensForm form : kAllLensForms) {
      const int64_t batch = rng.uniform_int(1, 5), num_queries = rng.uniform_int(1, 5);
      const Shape shape{batch, num_queries, num_keys};
      SCOPED_TRACE(case_label(shape, form, false));
      const Tensor<int64_t> lens = random_lens(rng, form, batch, num_queries, num_keys);
      const ValidLens valid_lens = as_valid_lens(lens);
      const Tensor<T> w = ref::masked_softmax(random_tensor<T>(rng, shape, -5.0, 5.0), valid_lens);
      const Tensor<T> g = random_tensor<T>(rng, shape);
      const Tensor<T> fast = masked_softmax_backward(w, g, valid_lens);
      const Tensor<T> ref_t = ref::masked_softmax_backward(w, g, valid_lens);
      const Tensor<double> wd = cast<double>(w), gd = cast<double>(g);
      const Tensor<double> ref_d = ref::masked_softmax_backward(wd, gd, valid_lens);
      const Tensor<double> plain = plain_masked_softmax_backward(wd.view(), gd.view(), lens);
      bool ok = expect_close(ref_d, plain, kSoftmaxBackwardRefVsLoop, "ref<double> vs plain loop");
      ok = expect_close(fast, ref_d, tol, "fast vs ref<double>") && ok;
      ok = expect_close(ref_t, ref_d, tol, "ref<T> vs ref<double>") && ok;
      ok = expect_masked_zero(fast, lens, "fast backward") && ok;
      ok = expect_masked_zero(ref_t, lens, "ref backward") && ok;
      if (!ok) return;
    }
  }
}

TYPED_TEST(MaskedSoftmax, BackwardOfStridedViews) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Shape shape{2, 3, 19};
  const Tensor<int32_t> lens = random_lens<int32_t>(rng, LensForm::kPerBatch, 2, 3, 19);
  const Tensor<T> w = ref::masked_softmax(random_tensor<T>(rng, shape, -3.0, 3.0), lens);
  const Tensor<T> g = random_tensor<T>(rng, shape);
  const Strided<T> sw(w.view(), {.reversed = true});
  const Strided<T> sg(g.view(), {.step = 3, .pad = 1});
  const Tensor<double> plain =
      plain_masked_softmax_backward(cast<double>(w).view(), cast<double>(g).view(), lens);
  const Tol tol = tol_for<T>(kSoftmaxBackward, kSoftmaxBackwardDouble);
  expect_close(masked_softmax_backward(sw.const_view(), sg.const_view(), lens), plain, tol, "fast");
  expect_close(ref::masked_softmax_backward(sw.const_view(), sg.const_view(), lens), plain, tol,
               "ref");
}

// The write-into form of the backward: every element of a NaN-filled buffer
// written, the same bits as the returning form, in place over either input,
// and through a strided buffer without touching the gaps.
TYPED_TEST(MaskedSoftmax, BackwardWritesIntoCallerBuffers) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tol tol = tol_for<T>(kSoftmaxBackward, kSoftmaxBackwardDouble);
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (int64_t num_keys : {1, 9, 32, 65, 1000}) {
    for (LensForm form : kAllLensForms) {
      const Shape shape{rng.uniform_int(1, 4), rng.uniform_int(1, 5), num_keys};
      SCOPED_TRACE(case_label(shape, form, false));
      const Tensor<int64_t> lens = random_lens(rng, form, shape[0], shape[1], num_keys);
      const ValidLens valid_lens = as_valid_lens(lens);
      const Tensor<T> w = ref::masked_softmax(random_tensor<T>(rng, shape, -5.0, 5.0), valid_lens);
      const Tensor<T> g = random_tensor<T>(rng, shape);
      const Tensor<double> expected =
          plain_masked_softmax_backward(cast<double>(w).view(), cast<double>(g).view(), lens);

      Tensor<T> out(shape, nan);
      masked_softmax_backward(w, g, valid_lens, out.view());
      expect_close(out, expected, tol, "into a buffer");
      expect_masked_zero(out, lens, "into a buffer");
      expect_bitwise_equal(out, masked_softmax_backward(w, g, valid_lens), "buffer vs returned");

      Tensor<T> over_w = w;
      masked_softmax_backward(over_w.view(), g, valid_lens, over_w.view());
      expect_bitwise_equal(over_w, out, "in place over the weights");
      Tensor<T> over_g = g;
      masked_softmax_backward(w, over_g.view(), valid_lens, over_g.view());
      expect_bitwise_equal(over_g, out, "in place over d_weights");

      const Strided<T> strided_out(Tensor<T>(shape, nan).view(), {.step = 2, .pad = 3});
      masked_softmax_backward(w, g, valid_lens, strided_out.view());
      expect_close(strided_out.view(), expected, tol, "into a strided buffer");
      expect_gaps_untouched(strided_out);
    }
  }
}

// The gradient of a random linear loss sum(G * softmax(X)) with respect to X,
// by central differences of the plain loop, against both backwards.
TEST(MaskedSoftmaxGradient, MatchesFiniteDifferences) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int64_t num_keys : {1, 5, 9, 17}) {
    for (LensForm form : kAllLensForms) {
      const Shape shape{2, 3, num_keys};
      SCOPED_TRACE(case_label(shape, form, false));
      const Tensor<double> x = random_tensor<double>(rng, shape, -2.0, 2.0);
      const Tensor<double> g = random_tensor<double>(rng, shape);
      const Tensor<int64_t> lens = random_lens(rng, form, 2, 3, num_keys);
      const auto loss = [&](const Tensor<double>& xs) {
        return sum_product(g, plain_masked_softmax(xs.view(), lens));
      };
      const Tensor<double> numeric = numerical_gradient(loss, x);
      const ValidLens valid_lens = as_valid_lens(lens);
      const Tensor<double> w = masked_softmax(x, valid_lens);
      const Tensor<double> fast = masked_softmax_backward(w, g, valid_lens);
      const Tensor<double> refg = ref::masked_softmax_backward(w, g, valid_lens);
      bool ok = expect_close(fast, numeric, kFiniteDiff, "fast backward vs finite differences");
      ok = expect_close(refg, numeric, kFiniteDiff, "ref backward vs finite differences") && ok;
      ok = expect_masked_zero(fast, lens, "fast backward") && ok;
      ok = expect_masked_zero(numeric, lens, "finite differences") && ok;
      if (!ok) return;
    }
  }
}

// ---- errors --------------------------------------------------------------------

// Outputs of 8 MiB and more go out through non-temporal stores: rows of an
// odd length (so most rows start off a vector boundary), 1-D and 2-D lengths
// with zeros, rows poisoned with NaN, +inf and all -inf, forward and backward
// against the reference, and bitwise the same with 1, 2 and 3 threads.
TYPED_TEST(MaskedSoftmax, LargeOutputsStreamPastTheCache) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t batch = sizeof(T) == 4 ? 4 : 2, num_queries = 520, num_keys = 1031;
  const Shape shape{batch, num_queries, num_keys};
  ASSERT_GE(shape.numel() * static_cast<int64_t>(sizeof(T)), int64_t{8} << 20);
  for (const LensForm form : {LensForm::kPerBatch, LensForm::kPerQuery}) {
    SCOPED_TRACE(case_label(shape, form, false));
    Tensor<T> x = random_tensor<T>(rng, shape, -8.0, 8.0);
    const Tensor<int64_t> lens = random_lens(rng, form, batch, num_queries, num_keys);
    const auto inf = std::numeric_limits<T>::infinity();
    x(0, 3, 0) = std::numeric_limits<T>::quiet_NaN();
    x(batch - 1, 100, 7) = inf;
    for (int64_t j = 0; j < num_keys; ++j) x(0, 5, j) = -inf;
    if (!check_forward(x, lens)) return;
    const ValidLens valid_lens = as_valid_lens(lens);
    const Tensor<T> w = ref::masked_softmax(random_tensor<T>(rng, shape, -5.0, 5.0), valid_lens);
    const Tensor<T> g = random_tensor<T>(rng, shape);
    const Tensor<double> wd = cast<double>(w), gd = cast<double>(g);
    const Tensor<double> back_ref = ref::masked_softmax_backward(wd, gd, valid_lens);
    Tensor<T> fwd[3], back[3];
    for (int t = 0; t < 3; ++t) {
      const ThreadCount threads(t + 1);
      fwd[t] = masked_softmax(x, valid_lens);
      back[t] = masked_softmax_backward(w, g, valid_lens);
    }
    expect_close(back[0], back_ref, tol_for<T>(kSoftmaxBackward, kSoftmaxBackwardDouble),
                 "fast backward vs ref<double>");
    expect_masked_zero(back[0], lens, "fast backward");
    for (int t = 1; t < 3; ++t) {
      SCOPED_TRACE("1 vs " + std::to_string(t + 1) + " threads");
      expect_bitwise_equal(fwd[0], fwd[t], "weights");
      expect_bitwise_equal(back[0], back[t], "d_scores");
    }
  }
}

TYPED_TEST(MaskedSoftmax, ScoresOfRankOtherThanThreeAreAnError) {
  using T = TypeParam;
  for (const Shape& shape : {Shape{3, 4}, Shape{1, 2, 3, 4}, Shape{5}}) {
    const Tensor<T> x(shape);
    SCOPED_TRACE(shape.str());
    expect_error([&] { (void)masked_softmax(x); }, {"masked_softmax", "scores", shape.str()});
    expect_error([&] { (void)ref::masked_softmax(x); }, {"masked_softmax", shape.str()});
    expect_error([&] { (void)masked_softmax_backward(x, x); },
                 {"masked_softmax_backward", shape.str()});
    expect_error([&] { (void)ref::masked_softmax_backward(x, x); },
                 {"masked_softmax_backward", shape.str()});
  }
}

TYPED_TEST(MaskedSoftmax, ValidLensOfTheWrongShapeAreAnError) {
  using T = TypeParam;
  const Tensor<T> x(Shape{2, 4, 5});
  const Tensor<int64_t> three(Shape{3}, std::vector<int64_t>{1, 2, 3});
  const std::initializer_list<std::string_view> fragments = {
      "masked_softmax", "valid_lens", "[3]", "[2, 4, 5]", "[2]", "[2, 4]"};
  expect_error([&] { (void)masked_softmax(x, three); }, fragments);
  expect_error([&] { (void)ref::masked_softmax(x, three); }, fragments);
  Tensor<T> out(x.shape());
  expect_error([&] { masked_softmax(x, three, out.view()); }, fragments);
  expect_error([&] { (void)masked_softmax_backward(x, x, three); },
               {"masked_softmax_backward", "valid_lens", "[3]", "[2, 4, 5]"});
  expect_error([&] { (void)ref::masked_softmax_backward(x, x, three); },
               {"masked_softmax_backward", "valid_lens", "[3]", "[2, 4, 5]"});
  const Tensor<int32_t> per_query(Shape{2, 5});
  expect_error([&] { (void)masked_softmax(x, per_query); },
               {"masked_softmax", "valid_lens", "[2, 5]", "[2, 4, 5]"});
}

TYPED_TEST(MaskedSoftmax, ValidLensOutOfRangeAreAnError) {
  using T = TypeParam;
  const Tensor<T> x(Shape{2, 3, 5});
  const Tensor<int64_t> negative(Shape{2}, std::vector<int64_t>{3, -2});
  const Tensor<int32_t> too_long(Shape{2, 3}, std::vector<int32_t>{1, 2, 3, 4, 5, 6});
  for (const auto* fn : {"fast", "ref"}) {
    SCOPED_TRACE(fn);
    const bool fast = std::string(fn) == "fast";
    expect_error(
        [&] { (void)(fast ? masked_softmax(x, negative) : ref::masked_softmax(x, negative)); },
        {"masked_softmax", "valid_lens", "-2"});
    expect_error(
        [&] { (void)(fast ? masked_softmax(x, too_long) : ref::masked_softmax(x, too_long)); },
        {"masked_softmax", "valid_lens", "6", "[2, 3, 5]"});
    expect_error(
        [&] {
          (void)(fast ? masked_softmax_backward(x, x, too_long)
                      : ref::masked_softmax_backward(x, x, too_long));
        },
        {"masked_softmax_backward", "valid_lens", "6"});
  }
}

TYPED_TEST(MaskedSoftmax, OutputBufferOfTheWrongShapeIsAnError) {
  using T = TypeParam;
  const Tensor<T> x(Shape{2, 4, 5}, T(1));
  Tensor<T> wide(Shape{2, 4, 6}, T(42));
  expect_error([&] { masked_softmax(x, {}, wide.view()); },
               {"masked_softmax", "[2, 4, 6]", "[2, 4, 5]"});
  for (T v : wide.values()) ASSERT_EQ(v, T(42)) << "wrote into a rejected buffer";
  Tensor<T> flat(Shape{8, 5});
  expect_error([&] { masked_softmax(x, {}, flat.view()); },
               {"masked_softmax", "[8, 5]", "[2, 4, 5]"});
}

// Arguments are validated before any data is touched.
TYPED_TEST(MaskedSoftmax, RejectedCallsLeaveTheBufferAlone) {
  using T = TypeParam;
  const Tensor<T> x(Shape{2, 3, 5}, T(0.5));
  const Tensor<int64_t> bad(Shape{2, 3}, std::vector<int64_t>{5, 5, 5, 5, 5, 7});
  Tensor<T> out(x.shape(), T(42));
  expect_error([&] { masked_softmax(x, bad, out.view()); }, {"masked_softmax", "valid_lens", "7"});
  for (T v : out.values()) ASSERT_EQ(v, T(42)) << "wrote before validating valid_lens";
  Tensor<T> in_place = x;
  expect_error([&] { masked_softmax(in_place.view(), bad, in_place.view()); }, {"masked_softmax"});
  EXPECT_EQ(in_place.values(), x.values());
}

TYPED_TEST(MaskedSoftmax, BackwardOutputBufferOfTheWrongShapeIsAnError) {
  using T = TypeParam;
  const Tensor<T> w(Shape{2, 4, 5}, T(0.2)), g(Shape{2, 4, 5}, T(1));
  Tensor<T> wide(Shape{2, 4, 6}, T(42));
  expect_error([&] { masked_softmax_backward(w, g, {}, wide.view()); },
               {"masked_softmax_backward", "d_scores", "[2, 4, 6]", "[2, 4, 5]"});
  for (T v : wide.values()) ASSERT_EQ(v, T(42)) << "wrote into a rejected buffer";
  // Bad lengths are caught before the buffer is touched.
  const Tensor<int64_t> bad(Shape{2}, std::vector<int64_t>{5, 6});
  Tensor<T> out(w.shape(), T(42));
  expect_error([&] { masked_softmax_backward(w, g, bad, out.view()); },
               {"masked_softmax_backward", "valid_lens", "6"});
  for (T v : out.values()) ASSERT_EQ(v, T(42)) << "wrote before validating valid_lens";
}

TYPED_TEST(MaskedSoftmax, BackwardShapeMismatchIsAnError) {
  using T = TypeParam;
  const Tensor<T> w(Shape{2, 4, 5});
  const Tensor<T> g_wide(Shape{2, 4, 6});
  const Tensor<T> g_batch(Shape{3, 4, 5});
  expect_error([&] { (void)masked_softmax_backward(w, g_wide); },
               {"masked_softmax_backward", "[2, 4, 5]", "[2, 4, 6]"});
  expect_error([&] { (void)ref::masked_softmax_backward(w, g_wide); },
               {"masked_softmax_backward", "[2, 4, 5]", "[2, 4, 6]"});
  expect_error([&] { (void)masked_softmax_backward(g_batch, w); },
               {"masked_softmax_backward", "[3, 4, 5]", "[2, 4, 5]"});
}

}  // namespace
}  // namespace qkv::test
