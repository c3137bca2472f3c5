// Tests for the few-row products of the SDPA forward (src/kernels/simd/row_products.h)
// and vecmath.h's bf16 widening and softcap, all Highway code whose vector widths
// differ by SIMD target (CTest runs this file once per target): row_scores and
// row_accumulate against a float64 loop for 0 to 4 rows, over feature sizes
// around every vector width, with float, double and bf16 keys and values, each
// input in a buffer of exactly its size (ASan sees any read past it) and every
// output element outside the product left as it was; to_float on every bf16;
// softcap against a float64 formula, and alike at every place in a row.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/simd/row_products.h"
#include "kernels/simd/vecmath.h"
#include "test_util.h"

namespace qkv::test {
namespace {

using kernels::fast::kRowProductRows;

// Feature sizes around the vector widths (2, 4, 8, 16 lanes) and their
// multiples, the scalar tails, and row_accumulate's column blocks of 2, 4 and
// 8 vectors (up to 128 floats on AVX-512).
constexpr int64_t kFeatures[] = {1,  2,  3,  4,  5,  7,  8,   9,   15,  16,  17,  31,
                                 32, 33, 63, 64, 65, 96, 127, 128, 129, 130, 200, 256};
constexpr int64_t kKeys[] = {0, 1, 2, 3, 4, 5, 17, 64, 255, 256};

template <class T>
T pick(Rng& rng, const T* xs, size_t n) {
  return xs[static_cast<size_t>(rng.uniform_int(0, static_cast<int64_t>(n) - 1))];
}

// Keys and values as stored (In) and as the products see them (double).
template <class In>
struct Stored {
  std::vector<In> x;
  std::vector<double> wide;
};

template <class In>
Stored<In> random_stored(Rng& rng, size_t n) {
  Stored<In> s;
  s.x.resize(n);
  s.wide.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const double u = rng.uniform(-1.0, 1.0);
    if constexpr (std::is_same_v<In, bfloat16>) {
      s.x[i] = bfloat16(static_cast<float>(u));
      s.wide[i] = static_cast<double>(static_cast<float>(s.x[i]));
    } else {
      s.x[i] = static_cast<In>(u);
      s.wide[i] = static_cast<double>(s.x[i]);
    }
  }
  return s;
}

// Pass if |got - ref| <= rel * (sum of the absolute terms): float sums of up
// to 256 products (k u ~ 1.5e-5 in the worst case, about sqrt(k) u in
// practice); double likewise with its u.
template <class Acc>
constexpr double kRel = std::is_same_v<Acc, float> ? 2e-5 : 4e-14;

template <class Acc, class In>
void check_scores(Rng& rng) {
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t rows = rng.uniform_int(0, kRowProductRows);
    const int64_t cols = pick(rng, kKeys, std::size(kKeys));
    const int64_t d = pick(rng, kFeatures, std::size(kFeatures));
    const int64_t lds = cols + rng.uniform_int(0, 3);
    // Rows of q and k further apart than d (heads of a (B, N, H, d) tensor).
    const int64_t ldq = d + rng.uniform_int(0, 2) * 7, ldk = d + rng.uniform_int(0, 2) * 5;
    const Acc alpha = static_cast<Acc>(rng.uniform(0.1, 2.0));
    SCOPED_TRACE("rows=" + std::to_string(rows) + " cols=" + std::to_string(cols) +
                 " d=" + std::to_string(d) + " lds=" + std::to_string(lds) +
                 " ldq=" + std::to_string(ldq) + " ldk=" + std::to_string(ldk));
    std::vector<Acc> q(static_cast<size_t>(rows * ldq));
    for (Acc& e : q) e = static_cast<Acc>(rng.uniform(-1.0, 1.0));
    const Stored<In> k = random_stored<In>(rng, static_cast<size_t>(cols * ldk));
    constexpr Acc kUntouched = Acc(-777);
    std::vector<Acc> s(static_cast<size_t>(rows * lds), kUntouched);
    kernels::fast::row_scores(rows, cols, d, alpha, q.data(), ldq, k.x.data(), ldk, s.data(), lds);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < lds; ++j) {
        const Acc got = s[static_cast<size_t>(r * lds + j)];
        if (j >= cols) {
          ASSERT_EQ(got, kUntouched) << "r=" << r << " j=" << j << " outside the product";
          continue;
        }
        double ref = 0, size = 0;
        for (int64_t e = 0; e < d; ++e) {
          const double term = static_cast<double>(q[static_cast<size_t>(r * ldq + e)]) *
                              k.wide[static_cast<size_t>(j * ldk + e)];
          ref += term;
          size += std::abs(term);
        }
        ref *= static_cast<double>(alpha);
        size *= static_cast<double>(alpha);
        ASSERT_NEAR(static_cast<double>(got), ref, kRel<Acc> * size + 1e-300)
            << "r=" << r << " j=" << j;
      }
    }
  }
}

template <class Acc, class In>
void check_accumulate(Rng& rng) {
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t rows = rng.uniform_int(0, kRowProductRows);
    const int64_t cols = pick(rng, kKeys, std::size(kKeys));
    const int64_t dv = pick(rng, kFeatures, std::size(kFeatures));
    const int64_t ldp = cols + rng.uniform_int(0, 3);
    const int64_t ldv = dv + rng.uniform_int(0, 2) * 3, ldo = dv + rng.uniform_int(0, 2) * 9;
    SCOPED_TRACE("rows=" + std::to_string(rows) + " cols=" + std::to_string(cols) +
                 " dv=" + std::to_string(dv) + " ldp=" + std::to_string(ldp) +
                 " ldv=" + std::to_string(ldv) + " ldo=" + std::to_string(ldo));
    // Weights as the softmax leaves them: in [0, 1], some exactly 0.
    std::vector<Acc> p(static_cast<size_t>(rows == 0 ? 0 : (rows - 1) * ldp + cols));
    for (Acc& e : p) e = rng.bernoulli(0.2) ? Acc(0) : static_cast<Acc>(rng.uniform(0.0, 1.0));
    const Stored<In> v = random_stored<In>(rng, static_cast<size_t>(cols * ldv));
    std::vector<Acc> o(static_cast<size_t>(rows * ldo));
    for (Acc& e : o) e = static_cast<Acc>(rng.uniform(-2.0, 2.0));
    const std::vector<Acc> before = o;
    kernels::fast::row_accumulate(rows, cols, dv, p.data(), ldp, v.x.data(), ldv, o.data(), ldo);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < dv; ++c) {
        double ref = static_cast<double>(before[static_cast<size_t>(r * ldo + c)]);
        double size = std::abs(ref);
        for (int64_t j = 0; j < cols; ++j) {
          const double term = static_cast<double>(p[static_cast<size_t>(r * ldp + j)]) *
                              v.wide[static_cast<size_t>(j * ldv + c)];
          ref += term;
          size += std::abs(term);
        }
        ASSERT_NEAR(static_cast<double>(o[static_cast<size_t>(r * ldo + c)]), ref,
                    kRel<Acc> * size + 1e-300)
            << "r=" << r << " c=" << c;
      }
      for (int64_t c = dv; c < ldo; ++c) {  // between the rows: untouched
        ASSERT_EQ(o[static_cast<size_t>(r * ldo + c)], before[static_cast<size_t>(r * ldo + c)]);
      }
    }
  }
}

// check(acc, in) for each pair of accumulation and storage types, traced.
template <class Check>
void for_each_type(Check&& check) {
  {
    SCOPED_TRACE("float");
    check(float{}, float{});
  }
  {
    SCOPED_TRACE("bf16 keys and values, float accumulation");
    check(float{}, bfloat16{});
  }
  {
    SCOPED_TRACE("double");
    check(double{}, double{});
  }
}

TEST(RowProducts, ScoresMatchFloat64Loop) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for_each_type([&](auto acc, auto in) { check_scores<decltype(acc), decltype(in)>(rng); });
}

TEST(RowProducts, AccumulateMatchesFloat64Loop) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for_each_type([&](auto acc, auto in) { check_accumulate<decltype(acc), decltype(in)>(rng); });
}

// A product's bits do not depend on the row's position in the batch of rows
// (a query's result must not change with how many share its task, nor with
// grouped heads: sdpa_fast.cc's grouped_rows_per_task) nor on the key's
// position (pairs of keys and the odd last one share a summation order).
// Feature sizes with scalar tails at every target (67, 45): those tails once
// rounded differently for different row counts in the float instantiations.
template <class Acc, class In>
void check_same_bits_alone(Rng& rng) {
  const int64_t cols = 7, d = 67, dv = 45;
  std::vector<Acc> q(static_cast<size_t>(kRowProductRows * d));
  for (Acc& e : q) e = static_cast<Acc>(rng.uniform(-1.0, 1.0));
  const Stored<In> k = random_stored<In>(rng, static_cast<size_t>(cols * d));
  const Stored<In> v = random_stored<In>(rng, static_cast<size_t>(cols * dv));
  std::vector<Acc> all(static_cast<size_t>(kRowProductRows * cols));
  kernels::fast::row_scores(kRowProductRows, cols, d, Acc(0.5), q.data(), d, k.x.data(), d,
                            all.data(), cols);
  std::vector<Acc> o_all(static_cast<size_t>(kRowProductRows * dv), Acc(0.25));
  kernels::fast::row_accumulate(kRowProductRows, cols, dv, all.data(), cols, v.x.data(), dv,
                                o_all.data(), dv);
  for (int64_t r = 0; r < kRowProductRows; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      Acc one = 0;
      kernels::fast::row_scores(1, 1, d, Acc(0.5), q.data() + r * d, d, k.x.data() + j * d, d,
                                &one, 1);
      ASSERT_EQ(std::memcmp(&one, &all[r * cols + j], sizeof(Acc)), 0) << "r=" << r << " j=" << j;
    }
    for (int64_t rows = 1; rows + r <= kRowProductRows; ++rows) {
      std::vector<Acc> o_some(static_cast<size_t>(rows * dv), Acc(0.25));
      kernels::fast::row_accumulate(rows, cols, dv, all.data() + r * cols, cols, v.x.data(), dv,
                                    o_some.data(), dv);
      ASSERT_EQ(std::memcmp(o_some.data(), o_all.data() + r * dv, sizeof(Acc) * dv), 0)
          << "row " << r << " in a task of " << rows << " rows";
    }
  }
}

// A row whose weights end early (zeros past its valid length, as the
// softmax leaves them) gets the same bits in a task whose other rows reach
// further (more columns) as alone over its own columns.
template <class Acc, class In>
void check_short_row_same_bits(Rng& rng) {
  for (const int64_t dv : {3, 5, 16, 45}) {
    const int64_t cols = 168, len = 31;
    const Stored<In> v = random_stored<In>(rng, static_cast<size_t>(cols * dv));
    std::vector<Acc> p(static_cast<size_t>(2 * cols));
    for (Acc& e : p) e = static_cast<Acc>(rng.uniform(0.0, 1.0));
    std::fill(p.begin() + cols + len, p.end(), Acc(0));
    std::vector<Acc> o_task(static_cast<size_t>(2 * dv)), o_alone(static_cast<size_t>(dv));
    for (Acc& e : o_task) e = static_cast<Acc>(rng.uniform(-1.0, 1.0));
    std::copy_n(o_task.begin() + dv, dv, o_alone.begin());
    kernels::fast::row_accumulate(2, cols, dv, p.data(), cols, v.x.data(), dv, o_task.data(), dv);
    kernels::fast::row_accumulate(1, len, dv, p.data() + cols, cols, v.x.data(), dv,
                                  o_alone.data(), dv);
    ASSERT_EQ(std::memcmp(o_task.data() + dv, o_alone.data(), sizeof(Acc) * dv), 0)
        << "dv=" << dv;
  }
}

TEST(RowProducts, ShortRowsGetTheirBitsAlone) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for_each_type(
      [&](auto acc, auto in) { check_short_row_same_bits<decltype(acc), decltype(in)>(rng); });
}

TEST(RowProducts, EachRowAndKeyGivesTheSameBitsAlone) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for_each_type([&](auto acc, auto in) { check_same_bits_alone<decltype(acc), decltype(in)>(rng); });
}

TEST(Bf16Widen, ToFloatIsExactOnEveryBf16) {
  std::vector<bfloat16> x(1 << 16);
  for (uint32_t b = 0; b < (1u << 16); ++b) x[b] = bfloat16::from_bits(static_cast<uint16_t>(b));
  std::vector<float> got(x.size());
  kernels::fast::to_float(x.data(), got.data(), static_cast<int64_t>(x.size()));
  for (uint32_t b = 0; b < (1u << 16); ++b) {
    ASSERT_EQ(std::bit_cast<uint32_t>(got[b]), b << 16) << "bf16 bits 0x" << std::hex << b;
  }
}

// Lengths around every vector width at misaligned addresses: exactly n
// elements read and written.
TEST(Bf16Widen, TailsWriteExactlyN) {
  for (int64_t n : {0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 50}) {
    for (int64_t offset : {0, 1, 3}) {
      SCOPED_TRACE("n=" + std::to_string(n) + " offset=" + std::to_string(offset));
      std::vector<bfloat16> x(static_cast<size_t>(offset + n));
      for (int64_t i = 0; i < offset + n; ++i) {
        x[static_cast<size_t>(i)] = bfloat16::from_bits(static_cast<uint16_t>(0x3f80 + i));
      }
      std::vector<float> out(static_cast<size_t>(offset + n + 2), -7.0f);
      kernels::fast::to_float(x.data() + offset, out.data() + offset, n);
      for (int64_t i = 0; i < offset + n + 2; ++i) {
        const bool inside = i >= offset && i < offset + n;
        ASSERT_EQ(out[static_cast<size_t>(i)],
                  inside ? static_cast<float>(x[static_cast<size_t>(i)]) : -7.0f)
            << "i=" << i;
      }
    }
  }
}

// FlashAttention's softcap, cap tanh(x / cap) and 1 - tanh², against float64:
// as exact as float32 torch's x / cap, tanhf and product (0.51 units in the
// last place on average, 3.4 at most, at x ~ N(0, 50), cap 50; the rational
// fit this replaced: 0.76 and 5.3); and an element's bits the same wherever
// it falls in a row (the forward's and the backward's tiles differ).
TEST(Softcap, AsExactAsFloat32TorchAndAlikeAnywhere) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> normal(0.0, 50.0);
  const double cap = 50.0;
  const int64_t n = 100000;
  std::vector<float> x(n), capped, grad(n);
  for (float& e : x) e = static_cast<float>(normal(gen));
  capped = x;
  kernels::fast::softcap(capped.data(), cap, grad.data(), n);
  double worst = 0, sum = 0, worst_grad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double t = std::tanh(static_cast<double>(x[i]) / cap);
    const double want = cap * t;
    const float rounded = static_cast<float>(want);
    const double ulp = std::nextafter(std::abs(rounded), INFINITY) - std::abs(rounded);
    const double err = std::abs(capped[i] - want) / ulp;
    worst = std::max(worst, err);
    sum += err;
    worst_grad = std::max(worst_grad, std::abs(grad[i] - (1.0 - t * t)));
  }
  EXPECT_LT(sum / n, 0.6) << "mean error in units in the last place";
  EXPECT_LT(worst, 4.5) << "largest error in units in the last place";
  // 1 - t² from a t within 4 ulp: about 2 x 4 x 6e-8 at most.
  EXPECT_LT(worst_grad, 6e-7);
  // Every piece of the row alone, at every length around the vector widths.
  for (int64_t len : {1, 2, 3, 5, 8, 15, 16, 17, 33}) {
    for (int64_t start = 0; start + len <= 200; start += len) {
      std::vector<float> piece(x.begin() + start, x.begin() + start + len), piece_grad(len);
      kernels::fast::softcap(piece.data(), cap, piece_grad.data(), len);
      for (int64_t i = 0; i < len; ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(piece[i]), std::bit_cast<uint32_t>(capped[start + i]))
            << "element " << start + i << " in a piece of " << len;
        ASSERT_EQ(piece_grad[i], grad[start + i]) << "element " << start + i;
      }
    }
  }
  // float64: Highway's tanh in double, 4 units in the last place of a double.
  std::vector<double> xd(x.begin(), x.begin() + 1000);
  kernels::fast::softcap(xd.data(), cap, nullptr, 1000);
  for (int64_t i = 0; i < 1000; ++i) {
    EXPECT_NEAR(xd[i], cap * std::tanh(static_cast<double>(x[i]) / cap), 1e-13) << i;
  }
}

}  // namespace
}  // namespace qkv::test
