// Tests of the fused small-dimension attention kernel
// (src/kernels/attention/small_dim_attention.h) against a float64 plain loop written
// here: random shapes around the SIMD widths, both score kinds, with and
// without key bias, every form of valid lengths, DESIGN.md §3's non-finite
// rows, masked keys never read, thread-count independence and the exp's
// error. CTest runs them once per SIMD target (the exp has three forms:
// AVX-512's 16-entry table, AVX2's 8-entry table and the generic one).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/attention/small_dim_attention.h"
#include "qkv/simd.h"
#include "test_util.h"

namespace qkv::test {
namespace {

using kernels::fast::ScoreKind;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---- tolerances ------------------------------------------------------------------
// float: scores of D <= 8 terms (inputs in [-1, 1], |score| <= ~40) err by
// ~|score| 2^-24 <= 3e-6 absolute, which the exp turns into a relative error
// of the weight; sums over Nk <= ~100 keys add ~sqrt(Nk) 2^-24; the output is
// a convex combination of values in [-1, 1].
constexpr Tol kOutFloat{.atol = 2e-5, .rtol = 1e-4};
// lse = m + log(sum): the max's error (~|m| 2^-24 <= 3e-6) plus the sum's.
constexpr Tol kLseFloat{.atol = 1e-5, .rtol = 1e-5};
// double: the same chain at 2^-53, with an exp of ~1 ulp.
constexpr Tol kOutDouble{.atol = 1e-13, .rtol = 1e-12};
constexpr Tol kLseDouble{.atol = 1e-13, .rtol = 1e-13};

template <class T>
Tol out_tol() {
  return tol_for<T>(kOutFloat, kOutDouble);
}
template <class T>
Tol lse_tol() {
  return tol_for<T>(kLseFloat, kLseDouble);
}

std::string kind_name(ScoreKind kind) {
  return kind == ScoreKind::kDotProduct ? "dot product" : "negative squared distance";
}

// ---- the plain loop --------------------------------------------------------------

struct Expected {
  Tensor<double> out;  // (B, Nq, Dv)
  Tensor<double> lse;  // (B, Nq)
};

// DESIGN.md §3 in double, from the inputs' values: scores over the valid
// keys j < L, L = 0 or all -inf -> output 0 and lse -inf, a NaN or +inf
// score -> NaN row; else softmax weights times values (a weight-0 key still
// multiplies its value: 0 * NaN is NaN, as in any plain loop).
template <class T>
Expected plain_attention(const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v,
                         const Tensor<T>* bias, ScoreKind kind, double scale,
                         const ValidLens& lens) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), dim = q.size(2);
  const int64_t dv = v.size(2);
  Expected e{Tensor<double>(Shape{batch, nq, dv}), Tensor<double>(Shape{batch, nq})};
  std::vector<double> s(static_cast<size_t>(nk));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t len = lens(b, i, nk);
      double m = -kInf;
      bool bad = false;
      for (int64_t j = 0; j < len; ++j) {
        double acc = 0;
        for (int64_t c = 0; c < dim; ++c) {
          const double qc = q(b, i, c), kc = k(b, j, c);
          acc += kind == ScoreKind::kDotProduct ? qc * kc : (qc - kc) * (qc - kc);
        }
        s[j] = kind == ScoreKind::kDotProduct ? scale * acc : -scale * acc;
        if (bias) s[j] += static_cast<double>((*bias)(b, j));
        if (std::isnan(s[j]) || s[j] == kInf) bad = true;
        m = std::max(m, s[j]);
      }
      if (bad || m == -kInf) {
        for (int64_t c = 0; c < dv; ++c) e.out(b, i, c) = bad ? kNaN : 0.0;
        e.lse(b, i) = bad ? kNaN : -kInf;
        continue;
      }
      double sum = 0;
      for (int64_t j = 0; j < len; ++j) sum += std::exp(s[j] - m);
      for (int64_t c = 0; c < dv; ++c) {
        double acc = 0;
        for (int64_t j = 0; j < len; ++j) acc += std::exp(s[j] - m) / sum * v(b, j, c);
        e.out(b, i, c) = acc;
      }
      e.lse(b, i) = m + std::log(sum);
    }
  }
  return e;
}

struct Got {
  Tensor<double> out, lse;
};

// Runs the kernel; outputs converted to double for the comparison.
template <class T>
Got run_kernel(const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v, const Tensor<T>* bias,
               ScoreKind kind, double scale, const ValidLens& lens, bool return_lse = true) {
  const int64_t batch = q.size(0), nq = q.size(1), dv = v.size(2);
  Tensor<T> out(Shape{batch, nq, dv}), lse(Shape{batch, nq});
  // NaN sentinels: every element must be written.
  std::fill(out.values().begin(), out.values().end(), std::numeric_limits<T>::quiet_NaN());
  const kernels::AttentionConfig config{
      .valid_lens = lens, .scale = scale, .dropout = 0.0, .seed = 0};
  EXPECT_TRUE(kernels::fast::small_dim_applies(q.size(2), dv, config));
  // Exactly the queried scratch, from an odd word (so the kernel's own
  // 64-byte alignment is exercised), with guard words after it that must
  // come back untouched.
  const size_t words =
      kernels::fast::small_dim_workspace_size<T>(batch, k.size(1), q.size(2), dv, bias != nullptr);
  constexpr size_t kGuard = 16;
  constexpr double kSentinel = -1234.5;
  std::vector<double> workspace(1 + words + kGuard, kSentinel);
  kernels::fast::small_dim_forward<T>(
      q.view(), k.view(), v.view(), bias ? bias->data() : nullptr, kind, config, out.view(),
      return_lse ? lse.view() : TensorView<T>(), {.data = workspace.data() + 1, .num_threads = 1});
  EXPECT_EQ(workspace[0], kSentinel) << "scratch written before its start";
  for (size_t g = 0; g < kGuard; ++g) {
    EXPECT_EQ(workspace[1 + words + g], kSentinel) << "scratch written past its size, word " << g;
  }
  return {cast<double>(out), cast<double>(lse)};
}

// Sizes around the vector widths (2, 4, 8 doubles; 4, 8, 16 floats).
int64_t random_size(Rng& rng, int64_t max_size) {
  static const int64_t kSizes[] = {1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 50, 67};
  const int64_t pick = kSizes[rng.uniform_int(0, std::size(kSizes) - 1)];
  return std::min(pick, max_size);
}

// One random problem of the given sizes and options, checked against the
// plain loop. Returns false after the first failing comparison.
template <class T>
bool check_random_case(Rng& rng, int64_t batch, int64_t nq, int64_t nk, int64_t dim, int64_t dv,
                       ScoreKind kind, bool with_bias, LensForm form) {
  const double scale = kind == ScoreKind::kDotProduct
                           ? (rng.bernoulli(0.5) ? 1.0 / std::sqrt(static_cast<double>(dim)) : 3.0)
                           : (rng.bernoulli(0.5) ? 0.5 : 4.0);
  SCOPED_TRACE(kind_name(kind) + (with_bias ? " + key bias" : "") + ", " + to_string(form) +
               ", B " + std::to_string(batch) + " Nq " + std::to_string(nq) + " Nk " +
               std::to_string(nk) + " D " + std::to_string(dim) + " Dv " + std::to_string(dv) +
               " scale " + std::to_string(scale));
  const Tensor<T> q = random_tensor<T>(rng, Shape{batch, nq, dim});
  const Tensor<T> k = random_tensor<T>(rng, Shape{batch, nk, dim});
  const Tensor<T> v = random_tensor<T>(rng, Shape{batch, nk, dv});
  const Tensor<T> bias = random_tensor<T>(rng, Shape{batch, nk}, -5, 5);
  const Tensor<int64_t> lens_t = random_lens(rng, form, batch, nq, nk);
  const ValidLens lens = as_valid_lens(lens_t);
  const Tensor<T>* b = with_bias ? &bias : nullptr;
  const Expected want = plain_attention(q, k, v, b, kind, scale, lens);
  const Got got = run_kernel(q, k, v, b, kind, scale, lens);
  return expect_close(got.out, want.out, out_tol<T>(), "output", "b q d") &&
         expect_close(got.lse, want.lse, lse_tol<T>(), "lse", "b q");
}

template <class T>
class SmallDimAttention : public ::testing::Test {};
using ElementTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(SmallDimAttention, ElementTypes);

// Every (D, Dv) pair, both kinds, bias or not, every lens form.
TYPED_TEST(SmallDimAttention, MatchesPlainLoopOnRandomShapes) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int64_t dim = 1; dim <= kernels::fast::kSmallDimMaxDim; ++dim) {
    for (int64_t dv = 1; dv <= kernels::fast::kSmallDimMaxValueDim; ++dv) {
      for (ScoreKind kind : {ScoreKind::kDotProduct, ScoreKind::kNegSquaredDistance}) {
        for (bool with_bias : {false, true}) {
          if (with_bias && kind != ScoreKind::kDotProduct) continue;
          for (LensForm form : kAllLensForms) {
            const int64_t batch = rng.uniform_int(1, 3);
            if (!check_random_case<T>(rng, batch, random_size(rng, 67), random_size(rng, 67), dim,
                                      dv, kind, with_bias, form)) {
              return;
            }
          }
        }
      }
    }
  }
}

// Longer key sequences (many vectors per row) and logits near 90, where a
// softmax that skips the max subtraction overflows in float.
TYPED_TEST(SmallDimAttention, LongRowsAndLargeLogits) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (LensForm form : kAllLensForms) {
    ASSERT_TRUE(check_random_case<T>(rng, 2, 37, 1001, 3, 2, ScoreKind::kDotProduct, true, form));
    ASSERT_TRUE(
        check_random_case<T>(rng, 1, 21, 3001, 1, 1, ScoreKind::kNegSquaredDistance, false, form));
  }
  // Scores in [85, 95] through the bias.
  const int64_t nk = 77;
  const Tensor<T> q = random_tensor<T>(rng, Shape{1, 9, 2});
  const Tensor<T> k = random_tensor<T>(rng, Shape{1, nk, 2}, -0.01, 0.01);
  const Tensor<T> v = random_tensor<T>(rng, Shape{1, nk, 3});
  const Tensor<T> bias = random_tensor<T>(rng, Shape{1, nk}, 85, 95);
  const ValidLens lens;
  const Expected want = plain_attention(q, k, v, &bias, ScoreKind::kDotProduct, 1.0, lens);
  const Got got = run_kernel(q, k, v, &bias, ScoreKind::kDotProduct, 1.0, lens);
  expect_close(got.out, want.out, out_tol<T>(), "output", "b q d");
  // lse ~ 95 + log(sum): float's relative lse tolerance covers |lse| 2^-24.
  expect_close(got.lse, want.lse, lse_tol<T>(), "lse", "b q");
  for (double l : want.lse.values()) EXPECT_GT(l, 85.0);
}

// DESIGN.md §3: L = 0 and all -inf give zeros and lse -inf; a NaN or +inf
// valid score gives a NaN row and nothing else; some -inf is fine; NaN or
// inf at masked keys (past a query's length) is never read.
TYPED_TEST(SmallDimAttention, NonFiniteRowsFollowDesign) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const T inf = std::numeric_limits<T>::infinity(), nan = std::numeric_limits<T>::quiet_NaN();
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t batch = rng.uniform_int(1, 3), nq = random_size(rng, 40) + 1;
    const int64_t nk = random_size(rng, 40) + 1, dim = rng.uniform_int(1, 8);
    const int64_t dv = rng.uniform_int(1, 8);
    SCOPED_TRACE("trial " + std::to_string(trial) + " B " + std::to_string(batch) + " Nq " +
                 std::to_string(nq) + " Nk " + std::to_string(nk) + " D " + std::to_string(dim) +
                 " Dv " + std::to_string(dv));
    Tensor<T> q = random_tensor<T>(rng, Shape{batch, nq, dim});
    Tensor<T> k = random_tensor<T>(rng, Shape{batch, nk, dim});
    Tensor<T> v = random_tensor<T>(rng, Shape{batch, nk, dv});
    Tensor<T> bias = random_tensor<T>(rng, Shape{batch, nk}, -3, 3);
    const Tensor<int64_t> lens_t = random_lens(rng, LensForm::kPerQuery, batch, nq, nk);
    const ValidLens lens = as_valid_lens(lens_t);
    // Bias: mostly -inf in some batches (all -inf rows), sprinkled -inf,
    // +inf and NaN elsewhere.
    for (int64_t b = 0; b < batch; ++b) {
      const double p_minus_inf = rng.bernoulli(0.3) ? 1.0 : 0.3;
      for (int64_t j = 0; j < nk; ++j) {
        const double u = rng.uniform();
        if (u < p_minus_inf)
          bias(b, j) = -inf;
        else if (u < p_minus_inf + 0.03)
          bias(b, j) = inf;
        else if (u < p_minus_inf + 0.06)
          bias(b, j) = nan;
      }
    }
    // NaN and inf at keys past every query's length (never read), and NaN
    // in a few values (0 * NaN where the weight is 0, as the plain loop).
    for (int64_t b = 0; b < batch; ++b) {
      int64_t longest = 0;
      for (int64_t i = 0; i < nq; ++i) longest = std::max(longest, lens(b, i, nk));
      for (int64_t j = longest; j < nk; ++j) {
        for (int64_t c = 0; c < dim; ++c) k(b, j, c) = rng.bernoulli(0.5) ? nan : inf;
        for (int64_t c = 0; c < dv; ++c) v(b, j, c) = nan;
        bias(b, j) = rng.bernoulli(0.5) ? nan : inf;
      }
      if (rng.bernoulli(0.2) && longest > 0) v(b, rng.uniform_int(0, longest - 1), 0) = nan;
    }
    for (ScoreKind kind : {ScoreKind::kDotProduct, ScoreKind::kNegSquaredDistance}) {
      SCOPED_TRACE(kind_name(kind));
      const Tensor<T>* b = kind == ScoreKind::kDotProduct ? &bias : nullptr;
      // For the distance kind, non-finite scores come from the queries (whole
      // rows) and from single keys that some rows' lengths cover: a NaN
      // among finite distances (the kernel finds it in its max pass) or an
      // infinite one (score -inf, weight 0).
      Tensor<T> qk = q, kk = k;
      if (kind == ScoreKind::kNegSquaredDistance) {
        for (T& x : qk.values()) {
          const double u = rng.uniform();
          if (u < 0.03)
            x = nan;
          else if (u < 0.06)
            x = inf;
        }
        for (int64_t bb = 0; bb < batch; ++bb) {
          int64_t longest = 0;
          for (int64_t i = 0; i < nq; ++i) longest = std::max(longest, lens(bb, i, nk));
          if (longest == 0 || rng.bernoulli(0.5)) continue;
          kk(bb, rng.uniform_int(0, longest - 1), rng.uniform_int(0, dim - 1)) =
              rng.bernoulli(0.5) ? nan : inf;
        }
      }
      const Expected want = plain_attention(qk, kk, v, b, kind, 0.7, lens);
      const Got got = run_kernel(qk, kk, v, b, kind, 0.7, lens);
      if (!expect_close(got.out, want.out, out_tol<T>(), "output", "b q d")) return;
      if (!expect_close(got.lse, want.lse, lse_tol<T>(), "lse", "b q")) return;
    }
  }
  // Named cases, one row each: L = 0; all -inf; NaN among -inf; +inf; a
  // finite row with some -inf.
  const Tensor<T> q = random_tensor<T>(rng, Shape{5, 1, 2});
  const Tensor<T> k = random_tensor<T>(rng, Shape{5, 3, 2});
  const Tensor<T> v = random_tensor<T>(rng, Shape{5, 3, 1});
  Tensor<T> bias(Shape{5, 3});
  const T rows[5][3] = {
      {1, 2, 3}, {-inf, -inf, -inf}, {-inf, nan, -inf}, {0, inf, 0}, {-inf, 1, -inf}};
  for (int64_t b = 0; b < 5; ++b) {
    for (int64_t j = 0; j < 3; ++j) bias(b, j) = rows[b][j];
  }
  Tensor<int64_t> lens_t(Shape{5});
  for (int64_t b = 0; b < 5; ++b) lens_t(b) = b == 0 ? 0 : 3;
  const ValidLens lens(lens_t);
  const Got got = run_kernel(q, k, v, &bias, ScoreKind::kDotProduct, 1.0, lens);
  EXPECT_EQ(got.out(0, 0, 0), 0.0);
  EXPECT_EQ(got.lse(0, 0), -kInf);
  EXPECT_EQ(got.out(1, 0, 0), 0.0);
  EXPECT_EQ(got.lse(1, 0), -kInf);
  EXPECT_TRUE(std::isnan(got.out(2, 0, 0)) && std::isnan(got.lse(2, 0)));
  EXPECT_TRUE(std::isnan(got.out(3, 0, 0)) && std::isnan(got.lse(3, 0)));
  // Only key 1 counts: the output is its value, exactly (weight 1).
  EXPECT_EQ(got.out(4, 0, 0), static_cast<double>(v(4, 1, 0)));
  EXPECT_NEAR(got.lse(4, 0),
              static_cast<double>(q(4, 0, 0) * k(4, 1, 0) + q(4, 0, 1) * k(4, 1, 1)) + 1.0, 1e-6);
}

// Bitwise the same for 1, 2 and 3 threads, with and without lse, for
// shapes that make several tasks (short and long key sequences).
TYPED_TEST(SmallDimAttention, ThreadCountsGiveTheSameBits) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  struct Case {
    int64_t batch, nq, nk, dim, dv;
    ScoreKind kind;
  };
  for (const Case& c : {Case{2, 1503, 101, 4, 3, ScoreKind::kDotProduct},
                        Case{1, 301, 4099, 1, 1, ScoreKind::kNegSquaredDistance},
                        Case{3, 257, 517, 8, 8, ScoreKind::kNegSquaredDistance}}) {
    SCOPED_TRACE(kind_name(c.kind) + " Nq " + std::to_string(c.nq) + " Nk " + std::to_string(c.nk));
    const Tensor<T> q = random_tensor<T>(rng, Shape{c.batch, c.nq, c.dim});
    const Tensor<T> k = random_tensor<T>(rng, Shape{c.batch, c.nk, c.dim});
    const Tensor<T> v = random_tensor<T>(rng, Shape{c.batch, c.nk, c.dv});
    const Tensor<T> bias = random_tensor<T>(rng, Shape{c.batch, c.nk});
    const Tensor<T>* b = c.kind == ScoreKind::kDotProduct ? &bias : nullptr;
    const Tensor<int64_t> lens_t = random_lens(rng, LensForm::kPerQuery, c.batch, c.nq, c.nk);
    const ValidLens lens = as_valid_lens(lens_t);
    Got one, two, three;
    {
      ThreadCount threads(1);
      one = run_kernel(q, k, v, b, c.kind, 0.9, lens);
    }
    {
      ThreadCount threads(2);
      two = run_kernel(q, k, v, b, c.kind, 0.9, lens);
    }
    {
      ThreadCount threads(3);
      three = run_kernel(q, k, v, b, c.kind, 0.9, lens, /*return_lse=*/false);
    }
    expect_bitwise_equal(two.out, one.out, "output, 2 vs 1 threads", "b q d");
    expect_bitwise_equal(two.lse, one.lse, "lse, 2 vs 1 threads", "b q");
    expect_bitwise_equal(three.out, one.out, "output, 3 vs 1 threads (no lse)", "b q d");
    const Expected want = plain_attention(q, k, v, b, c.kind, 0.9, lens);
    expect_close(one.out, want.out, out_tol<T>(), "output", "b q d");
  }
}

// The exp's error, measured through the kernel: keys k = (0, 1), values
// (0, 1), query x <= 0, dot product with scale 1: scores (0, x), so the
// output is e^x / (1 + e^x) and lse = log(1 + e^x). Where 1 + e^x rounds to
// 1 (x < -37 in double, x < -17 in float) the output is the exp itself.
// Bounds: 2 ulp relative (2^-51 double, 2^-22 float; seen: 2.0e-16, 1.1e-7).
TYPED_TEST(SmallDimAttention, ExpErrorIsAboutOneUlp) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const bool is_float = sizeof(T) == 4;
  const double lowest_normal = is_float ? -87.0 : -708.0;  // below: weight 0
  const double pure_below = is_float ? -17.0 : -37.0;
  const double bound = is_float ? 0x1p-22 : 0x1p-51;
  const int64_t nq = 200001;
  Tensor<T> q(Shape{1, nq, 1}), k(Shape{1, 2, 1}), v(Shape{1, 2, 1});
  k(0, 0, 0) = 0;
  k(0, 1, 0) = 1;
  v(0, 0, 0) = 0;
  v(0, 1, 0) = 1;
  // x uniform in [1.2 lowest_normal, 0], a tenth of them in [-1, 0], and the cut itself.
  for (int64_t i = 0; i < nq; ++i) {
    q(0, i, 0) = static_cast<T>(rng.bernoulli(0.1) ? rng.uniform(-1, 0)
                                                   : rng.uniform(1.2 * lowest_normal, 0));
  }
  q(0, 0, 0) = static_cast<T>(lowest_normal);
  q(0, 1, 0) = std::nextafter(static_cast<T>(lowest_normal), T(0));
  q(0, 2, 0) = std::nextafter(static_cast<T>(lowest_normal), T(-1000));
  q(0, 3, 0) = 0;
  const ValidLens lens;
  const Got got = run_kernel<T>(q, k, v, nullptr, ScoreKind::kDotProduct, 1.0, lens);
  double worst_pure = 0, worst_mixed = 0;
  for (int64_t i = 0; i < nq; ++i) {
    const long double x = q(0, i, 0);
    const long double e = std::exp(x);
    const double out = got.out(0, i, 0);
    if (x < lowest_normal) {
      ASSERT_EQ(out, 0.0) << "x = " << static_cast<double>(x);
      continue;
    }
    if (x < pure_below) {
      worst_pure = std::max(worst_pure, static_cast<double>(std::abs(out - e) / e));
    } else {
      const long double want = e / (1 + e);
      worst_mixed = std::max(worst_mixed, static_cast<double>(std::abs(out - want) / want));
      const long double return_lse = std::log1p(e);
      ASSERT_NEAR(got.lse(0, i), static_cast<double>(return_lse), 4 * bound)
          << "x = " << static_cast<double>(x);
    }
  }
  std::printf("exp relative error: %.3g (pure), %.3g (through e / (1 + e))\n", worst_pure,
              worst_mixed);
  EXPECT_LE(worst_pure, bound);
  // e / (1 + e) adds the sum's and the division's roundings.
  EXPECT_LE(worst_mixed, 3 * bound);
  EXPECT_GT(got.out(0, 0, 0), 0.0);  // x = lowest_normal itself still counts
}

// exp_non_positive, the kernels' exp on its own (what bench_nw_exact times
// as the Gaussian kernel's floor): the bound above against a long double
// exp, exactly 1 at 0, exactly 0 below the normal range and at -inf, NaN
// kept, a length no target's lanes divide (the tail), and in place.
TYPED_TEST(SmallDimAttention, ExpAloneIsAboutOneUlpOverItsRange) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  SCOPED_TRACE("SIMD target " + simd_target());
  Rng rng(seed);
  const bool is_float = sizeof(T) == 4;
  const T lowest_normal = is_float ? T(-87) : T(-708);
  const double bound = is_float ? 0x1p-22 : 0x1p-51;
  const T inf = std::numeric_limits<T>::infinity(), nan = std::numeric_limits<T>::quiet_NaN();
  const int64_t n = 100003;
  std::vector<T> x(static_cast<size_t>(n));
  for (T& v : x) {
    v = static_cast<T>(rng.bernoulli(0.1) ? rng.uniform(-1, 0)
                                          : rng.uniform(1.2 * lowest_normal, 0));
  }
  const std::vector<T> named = {T(0),
                                lowest_normal,
                                std::nextafter(lowest_normal, T(0)),
                                std::nextafter(lowest_normal, T(-1000)),
                                -inf,
                                nan,
                                T(-1e30)};
  for (size_t i = 0; i < named.size(); ++i) {
    x[i] = named[i];
    x[static_cast<size_t>(n) - 1 - i] = named[i];  // and in the tail
  }
  std::vector<T> out(x.size(), T(-1));
  kernels::fast::exp_non_positive(x.data(), out.data(), n);
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i])) {
      ASSERT_TRUE(std::isnan(out[i])) << "i = " << i;
    } else if (x[i] < lowest_normal) {
      ASSERT_EQ(out[i], T(0)) << "x = " << x[i];
    } else {
      const long double e = std::exp(static_cast<long double>(x[i]));
      ASSERT_GT(out[i], T(0)) << "x = " << x[i];
      worst = std::max(worst, static_cast<double>(std::abs(out[i] - e) / e));
    }
  }
  std::printf("exp alone, relative error: %.3g\n", worst);
  EXPECT_LE(worst, bound);
  EXPECT_EQ(out[0], T(1));
  std::vector<T> in_place = x;
  kernels::fast::exp_non_positive(in_place.data(), in_place.data(), n);
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(out[i])) {
      ASSERT_TRUE(std::isnan(in_place[i])) << "i = " << i;
    } else {
      ASSERT_EQ(in_place[i], out[i]) << "i = " << i;
    }
  }
}

// The random check and the exp over its whole range with -inf and NaN
// scores, on the SIMD target of this run (CTest runs it once per target:
// AVX-512 and AVX2 take their table-driven exps, SSE4 and scalar the
// generic one).
TYPED_TEST(SmallDimAttention, RandomCasesAndExpRangeOnThisTarget) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  SCOPED_TRACE("SIMD target " + simd_target());
  Rng rng(seed);
  for (ScoreKind kind : {ScoreKind::kDotProduct, ScoreKind::kNegSquaredDistance}) {
    for (LensForm form : kAllLensForms) {
      ASSERT_TRUE(check_random_case<T>(rng, 2, random_size(rng, 67), random_size(rng, 67) + 40,
                                       rng.uniform_int(1, 8), rng.uniform_int(1, 8), kind,
                                       kind == ScoreKind::kDotProduct, form));
    }
  }
  const int64_t nq = 4001;
  Tensor<T> q(Shape{1, nq, 1}), k(Shape{1, 3, 1}), v(Shape{1, 3, 1}), bias(Shape{1, 3});
  for (int64_t i = 0; i < nq; ++i) q(0, i, 0) = static_cast<T>(-800.0 * i / (nq - 1));
  k(0, 0, 0) = 0;
  k(0, 1, 0) = 1;
  k(0, 2, 0) = 0;
  v(0, 0, 0) = 0;
  v(0, 1, 0) = 1;
  v(0, 2, 0) = 5;
  bias(0, 0) = 0;
  bias(0, 1) = 0;
  bias(0, 2) = -std::numeric_limits<T>::infinity();
  const ValidLens lens;
  const Expected want = plain_attention(q, k, v, &bias, ScoreKind::kDotProduct, 1.0, lens);
  const Got got = run_kernel(q, k, v, &bias, ScoreKind::kDotProduct, 1.0, lens);
  // Relative to e^x / (1 + e^x) itself (down to 1e-300): the exp's error.
  const Tol rel = tol_for<T>({.atol = 1e-37, .rtol = 0x1p-21}, {.atol = 1e-300, .rtol = 0x1p-50});
  expect_close(got.out, want.out, rel, "e^x / (1 + e^x)", "b q d");
  bias(0, 2) = std::numeric_limits<T>::quiet_NaN();
  const Got nan_row = run_kernel(q, k, v, &bias, ScoreKind::kDotProduct, 1.0, lens);
  for (double o : nan_row.out.values()) ASSERT_TRUE(std::isnan(o));
}

TEST(SmallDimAttentionApplies, SizesAndDropout) {
  const ValidLens lens;
  kernels::AttentionConfig config{.valid_lens = lens, .scale = 1.0, .dropout = 0.0, .seed = 0};
  EXPECT_TRUE(kernels::fast::small_dim_applies(1, 1, config));
  EXPECT_TRUE(kernels::fast::small_dim_applies(8, 8, config));
  EXPECT_FALSE(kernels::fast::small_dim_applies(9, 8, config));
  EXPECT_FALSE(kernels::fast::small_dim_applies(8, 9, config));
  EXPECT_FALSE(kernels::fast::small_dim_applies(64, 64, config));
  config.dropout = 0.1;
  EXPECT_FALSE(kernels::fast::small_dim_applies(4, 4, config));
}

}  // namespace
}  // namespace qkv::test
