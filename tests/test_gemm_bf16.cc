// Tests for the bf16 matrix products and conversions (src/kernels/simd/gemm_bf16.h):
// to_bf16 against bfloat16's constructor on all 2^32 floats (a sample under
// the sanitizers and without AVX-512), the round trip through vecmath.h's
// to_float (tested on every bf16 value and SIMD target in
// test_row_products.cc), and gemm on every path this machine runs ("amx",
// "avx512_bf16", "widen") and on the AMX kernel run on the tile emulator
// ("amx_emulated", every machine) against a float64 loop over the widened
// inputs; on an AMX machine, the native AMX kernel against the emulated one
// bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernels/runtime/dispatch.h"
#include "kernels/simd/gemm_bf16.h"
#include "kernels/simd/vecmath.h"
#include "test_util.h"

// Test hooks defined in gemm_bf16.cc (not in its header: not for the library).
namespace qkv::kernels::fast {
std::vector<std::string> bf16_paths();
void gemm_bf16_on_path(const std::string& path, bool trans_a, bool trans_b, int64_t m, int64_t n,
                       int64_t k, float alpha, const bfloat16* a, int64_t lda, const bfloat16* b,
                       int64_t ldb, float beta, float* c, int64_t ldc);
PackedBf16 pack_b_bf16_on_path(const std::string& path, bool trans_b, int64_t n, int64_t k,
                               const bfloat16* b, int64_t ldb, std::vector<double>& storage);
}  // namespace qkv::kernels::fast

namespace qkv::test {
namespace {

bfloat16 bits(uint16_t b) { return bfloat16::from_bits(b); }
float as_float(uint32_t u) { return std::bit_cast<float>(u); }
double widen(bfloat16 x) { return static_cast<double>(static_cast<float>(x)); }

// ---- conversions -----------------------------------------------------------------

// Every float, in chunks, through to_bf16 and bfloat16's constructor: the
// same bits, always. All 2^32 where to_bf16 takes its AVX-512 path; without
// AVX-512 to_bf16 is the constructor itself (all 2^32 would take 47 s to
// compare it with itself), and under the sanitizers all 2^32 take over ten
// minutes, so in both cases a sample that keeps every upper half and the
// lower halves rounding turns on: 0, 1, 0x7fff, 0x8000 (ties), 0x8001, 0xffff
// and one random value per upper half.
TEST(Bf16Convert, ToBf16MatchesConstructorOnEveryFloat) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const bool every_float = !kSanitized && simd_target().rfind("avx512", 0) == 0;
  constexpr int64_t kChunk = int64_t{1} << 20;
  std::vector<float> x(kChunk);
  std::vector<bfloat16> got(kChunk);
  std::vector<uint32_t> input_bits(kChunk);
  int64_t mismatches = 0, checked = 0;
  uint64_t next = 0;  // the next float (bits) of the sweep
  const auto fill = [&](int64_t i) -> bool {
    if (every_float) {
      if (next >> 32) return false;
      input_bits[i] = static_cast<uint32_t>(next++);
      return true;
    }
    // Sample: `next` counts (upper half, one of 7 lower halves).
    static constexpr uint32_t kLow[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff};
    if (next >= (uint64_t{1} << 16) * 7) return false;
    const uint32_t upper = static_cast<uint32_t>(next / 7), which = next % 7;
    const uint32_t low =
        which < 6 ? kLow[which] : static_cast<uint32_t>(rng.uniform_int(0, 0xffff));
    input_bits[i] = upper << 16 | low;
    ++next;
    return true;
  };
  for (;;) {
    int64_t n = 0;
    while (n < kChunk && fill(n)) ++n;
    if (n == 0) break;
    for (int64_t i = 0; i < n; ++i) x[i] = as_float(input_bits[i]);
    kernels::fast::to_bf16(x.data(), got.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t want = bfloat16(x[i]).bits;
      if (got[i].bits != want && ++mismatches <= 5) {
        ADD_FAILURE() << "float bits 0x" << std::hex << input_bits[i] << ": got 0x" << got[i].bits
                      << ", constructor 0x" << want;
      }
    }
    checked += n;
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(checked, every_float ? int64_t{1} << 32 : int64_t{7} << 16);
}

// The constructor's contract itself, on values worked out by hand.
TEST(Bf16Convert, RoundsToNearestEvenAndKeepsSpecials) {
  struct Case {
    uint32_t in;
    uint16_t out;
    const char* what;
  };
  const Case cases[] = {
      {0x3f800000, 0x3f80, "1"},
      {0x3f808000, 0x3f80, "1 + half an ulp: tie, to even (down)"},
      {0x3f818000, 0x3f82, "1 + 3 half ulps: tie, to even (up)"},
      {0x3f808001, 0x3f81, "just above the tie: up"},
      {0x3f807fff, 0x3f80, "just below the tie: down"},
      {0x80000000, 0x8000, "-0"},
      {0x7f800000, 0x7f80, "+inf"},
      {0xff800000, 0xff80, "-inf"},
      {0x7f7fffff, 0x7f80, "largest float rounds up to +inf"},
      {0x7f7f7fff, 0x7f7f, "largest bf16 stays"},
      {0xff7fffff, 0xff80, "most negative float rounds to -inf"},
      {0x7fc00000, 0x7fc0, "quiet NaN"},
      {0x7f800001, 0x7fc0, "signalling NaN, payload only in the low bits: stays NaN, quiet"},
      {0xffa50000, 0xffe5, "negative signalling NaN keeps sign and upper payload"},
      {0x00000001, 0x0000, "smallest denormal rounds to 0"},
      {0x00008000, 0x0000, "denormal tie, to even (0)"},
      {0x00018000, 0x0002, "denormal tie, to even (2)"},
      {0x00010000, 0x0001, "denormal bf16 kept (not flushed)"},
      {0x807fffff, 0x8080, "largest negative denormal rounds up to -2^-126"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const float x = as_float(c.in);
    EXPECT_EQ(bfloat16(x).bits, c.out);
    bfloat16 got;
    kernels::fast::to_bf16(&x, &got, 1);
    EXPECT_EQ(got.bits, c.out);
  }
}

// Lengths around the vector width (16) at misaligned addresses: the tails
// write exactly n elements.
TEST(Bf16Convert, TailsWriteExactlyN) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int64_t n : {0, 1, 7, 15, 16, 17, 31, 32, 33, 50}) {
    for (int64_t offset : {0, 1, 3}) {
      SCOPED_TRACE("n=" + std::to_string(n) + " offset=" + std::to_string(offset));
      std::vector<float> x(static_cast<size_t>(n + offset + 4));
      for (float& v : x) v = static_cast<float>(rng.uniform(-4, 4));
      std::vector<bfloat16> h(x.size(), bits(0x1234));
      kernels::fast::to_bf16(x.data() + offset, h.data() + offset, n);
      std::vector<float> back(x.size(), -7.0f);
      kernels::fast::to_float(h.data() + offset, back.data() + offset, n);
      for (int64_t i = 0; i < static_cast<int64_t>(x.size()); ++i) {
        const bool inside = i >= offset && i < offset + n;
        EXPECT_EQ(h[i].bits, inside ? bfloat16(x[i]).bits : 0x1234) << "i=" << i;
        EXPECT_EQ(back[i], inside ? static_cast<float>(h[i]) : -7.0f) << "i=" << i;
      }
    }
  }
}

// ---- gemm --------------------------------------------------------------------------

// A row-major bf16 matrix with leading dimension ld >= cols.
struct Matrix {
  int64_t rows = 0, cols = 0, ld = 1;
  std::vector<bfloat16> data;
  bfloat16 at(int64_t r, int64_t c) const { return data[static_cast<size_t>(r * ld + c)]; }
};

Matrix random_matrix(Rng& rng, int64_t rows, int64_t cols, int64_t extra_ld) {
  Matrix x;
  x.rows = rows;
  x.cols = cols;
  x.ld = std::max<int64_t>(cols + extra_ld, 1);
  // The gaps between rows hold NaN: a kernel that reads them poisons C.
  x.data.assign(static_cast<size_t>(std::max<int64_t>(rows, 1) * x.ld), bits(0x7fc0));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      x.data[static_cast<size_t>(r * x.ld + c)] = bfloat16(static_cast<float>(rng.uniform(-2, 2)));
    }
  }
  return x;
}

struct Problem {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  float alpha = 1.0f, beta = 0.0f;
  Matrix a, b;            // stored k x m when trans_a, n x k when trans_b
  std::vector<float> c0;  // C before the call (ldc * m, gaps included)
  int64_t ldc = 1;

  double op_a(int64_t i, int64_t kk) const { return widen(trans_a ? a.at(kk, i) : a.at(i, kk)); }
  double op_b(int64_t kk, int64_t j) const { return widen(trans_b ? b.at(j, kk) : b.at(kk, j)); }

  std::string str() const {
    return std::string(trans_a ? "T" : "N") + (trans_b ? "T" : "N") + " m=" + std::to_string(m) +
           " n=" + std::to_string(n) + " k=" + std::to_string(k) + " lda=" + std::to_string(a.ld) +
           " ldb=" + std::to_string(b.ld) + " ldc=" + std::to_string(ldc) +
           " alpha=" + format_value(alpha) + " beta=" + format_value(beta);
  }
};

// Shapes and strides as given; alpha and beta as given. beta = 0 fills C with
// NaN (the kernel must not read it); gaps of C hold a sentinel either way.
Problem make_problem(Rng& rng, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                     float alpha, float beta, int64_t extra_ld = 0) {
  Problem p;
  p.trans_a = trans_a;
  p.trans_b = trans_b;
  p.m = m;
  p.n = n;
  p.k = k;
  p.alpha = alpha;
  p.beta = beta;
  p.a = trans_a ? random_matrix(rng, k, m, extra_ld) : random_matrix(rng, m, k, extra_ld);
  p.b = trans_b ? random_matrix(rng, n, k, extra_ld) : random_matrix(rng, k, n, extra_ld);
  p.ldc = std::max<int64_t>(n + extra_ld, 1);
  p.c0.assign(static_cast<size_t>(std::max<int64_t>(m, 1) * p.ldc), -12345.0f);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      p.c0[static_cast<size_t>(i * p.ldc + j)] = beta == 0.0f
                                                     ? std::numeric_limits<float>::quiet_NaN()
                                                     : static_cast<float>(rng.uniform(-3, 3));
    }
  }
  return p;
}

// The accuracy contract. The result is the exact product of the bf16 inputs
// (each product of two bf16 values is exact in float) summed in float32 in
// some order, then alpha * sum + beta * c in float: at most k + 2 roundings,
// so |got - ref| <= (k + 2) 2^-24 (|alpha| sum_k |a||b| + |beta c|) (the
// standard gamma_k bound; 1.6e-5 relative at k = 256). The reference is the
// float64 loop below, exact to 2^-53 here.
struct Reference {
  double value;
  double bound;
};

Reference reference(const Problem& p, int64_t i, int64_t j) {
  double sum = 0, mag = 0;
  for (int64_t kk = 0; kk < p.k; ++kk) {
    const double prod = p.op_a(i, kk) * p.op_b(kk, j);
    sum += prod;
    mag += std::abs(prod);
  }
  const double c = p.beta == 0.0f ? 0.0 : p.beta * static_cast<double>(p.c0[i * p.ldc + j]);
  const double unit = std::ldexp(1.0, -24);
  return {p.alpha * sum + c,
          static_cast<double>(p.k + 2) * unit * (std::abs(p.alpha) * mag + std::abs(c))};
}

std::vector<float> run(const std::string& path, const Problem& p) {
  std::vector<float> c = p.c0;
  kernels::fast::gemm_bf16_on_path(path, p.trans_a, p.trans_b, p.m, p.n, p.k, p.alpha,
                                   p.a.data.data(), p.a.ld, p.b.data.data(), p.b.ld, p.beta,
                                   c.data(), p.ldc);
  return c;
}

// Every element of C against the reference; the gaps between C's rows unchanged.
void check(const std::string& path, const Problem& p) {
  SCOPED_TRACE(path + " " + p.str());
  const std::vector<float> c = run(path, p);
  int failures = 0;
  for (int64_t i = 0; i < std::max<int64_t>(p.m, 1); ++i) {
    for (int64_t j = 0; j < p.ldc; ++j) {
      const float got = c[static_cast<size_t>(i * p.ldc + j)];
      if (i >= p.m || j >= p.n) {
        if (got != -12345.0f && ++failures <= 5) {
          ADD_FAILURE() << "i=" << i << " j=" << j << " outside C was written: " << got;
        }
        continue;
      }
      const Reference ref = reference(p, i, j);
      const double err = std::abs(static_cast<double>(got) - ref.value);
      if (!(err <= ref.bound) && ++failures <= 5) {
        ADD_FAILURE() << "i=" << i << " j=" << j << ": got " << format_value(got) << ", ref "
                      << format_value(ref.value) << ", error " << format_short(err) << " > bound "
                      << format_short(ref.bound);
      }
    }
  }
}

class Bf16Gemm : public ::testing::TestWithParam<std::string> {};

// Random shapes up to 70 (tails of every tile size: 8, 16, 32 and k pairs),
// odd k, strided operands, alpha != 1, beta 0, 1 and other, all four
// transpose combinations.
TEST_P(Bf16Gemm, RandomShapesStridesAndScalars) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int trial = 0; trial < 200; ++trial) {
    const bool ta = trial & 1, tb = trial & 2;
    const int64_t m = rng.uniform_int(1, 70), n = rng.uniform_int(1, 70),
                  k = rng.uniform_int(1, 70);
    const float alpha = trial % 3 == 0 ? 1.0f : static_cast<float>(rng.uniform(-2, 2));
    const float beta = (trial / 4) % 3 == 0   ? 0.0f
                       : (trial / 4) % 3 == 1 ? 1.0f
                                              : static_cast<float>(rng.uniform(-2, 2));
    const int64_t extra_ld = trial % 5 == 0 ? 0 : rng.uniform_int(1, 9);
    check(GetParam(), make_problem(rng, ta, tb, m, n, k, alpha, beta, extra_ld));
    if (HasFailure()) return;
  }
}

// The block products of flash attention (head dim 64, query blocks of 64-128,
// key blocks of 128-512), and ragged versions of them (a key block cut by a
// valid length).
TEST_P(Bf16Gemm, AttentionBlockShapes) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  struct Shape3 {
    bool ta, tb;
    int64_t m, n, k;
    float beta;
  };
  const Shape3 shapes[] = {
      {false, true, 128, 256, 64, 0.0f},  // S = scale Q Kᵀ
      {false, true, 64, 512, 64, 0.0f},
      {false, false, 128, 64, 256, 1.0f},  // O += P V
      {false, true, 128, 256, 64, 0.0f},   // dP = dO Vᵀ
      {true, false, 256, 64, 128, 1.0f},   // dV += Pᵀ dO, dK += dSᵀ Q
      {false, false, 128, 64, 256, 1.0f},  // dQ += dS K
      {false, true, 128, 173, 64, 0.0f},   // ragged key block
      {false, false, 128, 64, 173, 1.0f},
      {true, false, 173, 64, 128, 1.0f},
      {true, true, 100, 90, 80, 0.5f},
      {false, false, 1, 64, 300, 0.0f},  // the single-row path
      {false, true, 1, 300, 64, 0.0f},
      {false, true, 48, 80, 64, 0.0f},  // 16-row and 16-column edge tiles
      {false, false, 80, 48, 96, 1.0f},
      {false, true, 64, 40, 48, 0.0f},  // whole row tiles, k not a whole k step
      {false, false, 32, 50, 80, 1.0f},
  };
  // alpha = 1 with beta 0 or 1 stores (or accumulates) tiles straight into C
  // on the AMX path; other scalars take the epilogue.
  for (const Shape3& s : shapes) {
    check(GetParam(), make_problem(rng, s.ta, s.tb, s.m, s.n, s.k, 0.125f, s.beta));
    check(GetParam(), make_problem(rng, s.ta, s.tb, s.m, s.n, s.k, 1.0f, 0.0f));
    check(GetParam(), make_problem(rng, s.ta, s.tb, s.m, s.n, s.k, 1.0f, 1.0f, 3));
  }
}

// Long k: the float accumulation over 1000 terms stays within the bound.
TEST_P(Bf16Gemm, LongInnerDimension) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  check(GetParam(), make_problem(rng, false, true, 40, 33, 1001, 1.0f, 0.0f, 3));
  check(GetParam(), make_problem(rng, true, false, 33, 40, 1024, 1.0f, 1.0f));
}

// k = 0: C = beta C (zeros for beta = 0, even over NaN); m or n = 0: nothing
// written at all.
TEST_P(Bf16Gemm, EmptyShapes) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      check(GetParam(), make_problem(rng, ta, tb, 5, 7, 0, 2.0f, 0.0f));
      check(GetParam(), make_problem(rng, ta, tb, 5, 7, 0, 2.0f, -1.5f, 2));
      check(GetParam(), make_problem(rng, ta, tb, 0, 7, 9, 1.0f, 1.0f));
      check(GetParam(), make_problem(rng, ta, tb, 5, 0, 9, 1.0f, 0.0f, 1));
      check(GetParam(), make_problem(rng, ta, tb, 1, 1, 1, 3.0f, 0.0f));
    }
  }
  // Null pointers are fine when nothing is read or written.
  kernels::fast::gemm_bf16_on_path(GetParam(), false, false, 0, 0, 0, 1.0f, nullptr, 1, nullptr, 1,
                                   0.0f, nullptr, 1);
}

// NaN and ±inf in the inputs give what float arithmetic gives: a NaN poisons
// its row (or column), inf * 0 is NaN, inf * finite stays inf.
TEST_P(Bf16Gemm, NonFiniteInputsPropagate) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (bool ta : {false, true}) {
    Problem p = make_problem(rng, ta, false, 40, 35, 37, 1.0f, 0.0f);
    const auto set_a = [&](int64_t i, int64_t kk, bfloat16 v) {
      p.a.data[static_cast<size_t>(ta ? kk * p.a.ld + i : i * p.a.ld + kk)] = v;
    };
    set_a(3, 5, bits(0x7fc0));    // NaN: row 3 all NaN
    set_a(20, 36, bits(0x7f80));  // +inf at the last (odd) k: row 20 ±inf
    for (int64_t j = 0; j < p.n; ++j) {
      p.b.data[static_cast<size_t>(36 * p.b.ld + j)] = bfloat16(j == 7 ? 0.0f : 1.0f + j);
    }
    const std::vector<float> c = run(GetParam(), p);
    for (int64_t j = 0; j < p.n; ++j) {
      EXPECT_TRUE(std::isnan(c[3 * p.ldc + j])) << "j=" << j;
      const float want =
          j == 7 ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
      if (j == 7) {
        EXPECT_TRUE(std::isnan(c[20 * p.ldc + j])) << "inf * 0 at j=7";
      } else {
        EXPECT_EQ(c[20 * p.ldc + j], want) << "j=" << j;
      }
      EXPECT_TRUE(std::isfinite(c[4 * p.ldc + j])) << "j=" << j;
    }
  }
}

// Denormal bf16 inputs (|x| < 2^-126). The widening path multiplies them
// exactly; the native paths (VDPBF16PS, TDPBF16PS) treat them as zero and
// flush denormal float results to zero, as the instructions define. Either
// way the difference is below 2^-126 * |the other factor|, inside the
// contract's bound for any row whose other terms are not themselves tiny.
TEST_P(Bf16Gemm, DenormalInputs) {
  const bool native_path = GetParam() != "widen";
  const bfloat16 denormal = bits(0x0040);  // 2^-127
  const bfloat16 big = bfloat16(std::ldexp(1.0f, 100));
  float c = -1.0f;
  kernels::fast::gemm_bf16_on_path(GetParam(), false, false, 1, 1, 1, 1.0f, &denormal, 1, &big, 1,
                                   0.0f, &c, 1);
  EXPECT_EQ(c, native_path ? 0.0f : std::ldexp(1.0f, -27));
  // Normal inputs whose product is a denormal float: 2^-70 * 2^-70 = 2^-140.
  const bfloat16 tiny = bfloat16(std::ldexp(1.0f, -70));
  kernels::fast::gemm_bf16_on_path(GetParam(), false, false, 1, 1, 1, 1.0f, &tiny, 1, &tiny, 1,
                                   0.0f, &c, 1);
  EXPECT_EQ(c, native_path ? 0.0f : std::ldexp(1.0f, -140));
}

// Two threads at once (the AMX tile state and the packing buffers are per
// thread): each gets the same bits as when it runs alone.
TEST_P(Bf16Gemm, ConcurrentCallsMatchSerialCalls) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Problem p0 = make_problem(rng, false, true, 128, 256, 64, 0.125f, 0.0f);
  const Problem p1 = make_problem(rng, true, false, 256, 64, 128, 1.0f, 1.0f);
  const std::vector<float> want0 = run(GetParam(), p0), want1 = run(GetParam(), p1);
  std::vector<float> got0, got1;
  std::thread t0([&] {
    for (int r = 0; r < 20; ++r) got0 = run(GetParam(), p0);
  });
  std::thread t1([&] {
    for (int r = 0; r < 20; ++r) got1 = run(GetParam(), p1);
  });
  t0.join();
  t1.join();
  EXPECT_TRUE(got0 == want0);
  EXPECT_TRUE(got1 == want1);
}

// B packed once (pack_b) and multiplied with several A: the same bits as the
// unpacked product, and within the reference's bound. Shapes cover A read in
// place (row-major, m a multiple of 8, even k and lda) and A packed (odd k,
// odd lda, ragged m), B stored either way, beta 0, 1 and other.
TEST_P(Bf16Gemm, PackedBMatchesUnpackedBitForBit) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int trial = 0; trial < 120; ++trial) {
    const bool tb = trial & 1;
    const bool a_in_place = trial & 2;
    const int64_t m = a_in_place ? 8 * rng.uniform_int(1, 9) : rng.uniform_int(1, 70);
    const int64_t n = rng.uniform_int(1, 70);
    const int64_t k = a_in_place ? 2 * rng.uniform_int(1, 40) : rng.uniform_int(1, 70);
    const int64_t extra_ld = a_in_place ? 2 * rng.uniform_int(0, 4) : rng.uniform_int(0, 9);
    const float alpha = trial % 3 == 0 ? 1.0f : static_cast<float>(rng.uniform(-2, 2));
    const float beta = (trial / 4) % 3 == 0   ? 0.0f
                       : (trial / 4) % 3 == 1 ? 1.0f
                                              : static_cast<float>(rng.uniform(-2, 2));
    Problem p = make_problem(rng, false, tb, m, n, k, alpha, beta, extra_ld);
    SCOPED_TRACE(GetParam() + " " + p.str());
    std::vector<double> storage;
    const kernels::fast::PackedBf16 packed =
        kernels::fast::pack_b_bf16_on_path(GetParam(), tb, n, k, p.b.data.data(), p.b.ld, storage);
    // Two different A against the one packed B.
    for (int round = 0; round < 2; ++round) {
      if (round == 1) p.a = random_matrix(rng, m, k, extra_ld);
      const std::vector<float> want = run(GetParam(), p);
      std::vector<float> got = p.c0;
      // Exactly the queried scratch, from an odd word, with guards after it.
      const size_t words = kernels::fast::gemm_bf16_packed_scratch_words(m, k);
      std::vector<double> scratch(1 + words + 8, -1234.5);
      kernels::fast::gemm_bf16(m, alpha, p.a.data.data(), p.a.ld, packed, beta, got.data(), p.ldc,
                               scratch.data() + 1);
      for (size_t g = 0; g < 8; ++g) ASSERT_EQ(scratch[1 + words + g], -1234.5) << "guard " << g;
      ASSERT_EQ(scratch[0], -1234.5);
      ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0)
          << "round " << round;
    }
    check(GetParam(), p);
    if (HasFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, Bf16Gemm, ::testing::ValuesIn(kernels::fast::bf16_paths()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });
// The AMX kernel on the tile emulator (kernels/simd/amx_emulator.h), on any
// CPU: the same source as "amx", scalar packing and epilogue.
INSTANTIATE_TEST_SUITE_P(Emulated, Bf16Gemm, ::testing::Values(std::string("amx_emulated")),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

// The public gemm runs the best available path the SIMD cap allows (under
// QKV_SIMD_TARGET below avx512 only the widening one), and native() says
// whether that is one of the BF16 instruction paths.
TEST(Bf16GemmDispatch, PublicGemmIsTheBestPath) {
  const std::vector<std::string> paths = kernels::fast::bf16_paths();
  ASSERT_FALSE(paths.empty());
  EXPECT_EQ(paths.back(), "widen");
  const std::string best = kernels::avx512_allowed() ? paths.front() : "widen";
  EXPECT_EQ(kernels::fast::bf16_native(), best != "widen");
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Problem p = make_problem(rng, false, true, 37, 45, 70, 0.5f, 1.0f, 2);
  std::vector<float> c = p.c0;
  const size_t words = kernels::fast::gemm_bf16_scratch_words(p.m, p.n, p.k);
  std::vector<double> scratch(1 + words + 8, -1234.5);
  kernels::fast::gemm_bf16(p.trans_a, p.trans_b, p.m, p.n, p.k, p.alpha, p.a.data.data(), p.a.ld,
                           p.b.data.data(), p.b.ld, p.beta, c.data(), p.ldc, scratch.data() + 1);
  EXPECT_TRUE(c == run(best, p));
  // The scratch is exactly the queried size: the guards around it are untouched.
  EXPECT_EQ(scratch[0], -1234.5);
  for (size_t g = 0; g < 8; ++g) EXPECT_EQ(scratch[1 + words + g], -1234.5) << "guard " << g;
}

// A path is offered exactly when the CPU has its instructions (and, for AMX,
// Linux granted the tile state): a build or detection fault that quietly
// dropped to a slower path would show here and nowhere else.
#if defined(__x86_64__) && defined(__linux__)
TEST(Bf16GemmDispatch, NativePathsFoundWhereTheCpuHasThem) {
  __builtin_cpu_init();
  const std::vector<std::string> paths = kernels::fast::bf16_paths();
  const auto has = [&](const char* name) {
    return std::find(paths.begin(), paths.end(), name) != paths.end();
  };
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  EXPECT_EQ(has("avx512_bf16"), avx512 && __builtin_cpu_supports("avx512bf16"));
  // ARCH_GET_XCOMP_PERM: the state components this process may use (bit 18:
  // AMX tile data, requested by the library when it looked for the paths).
  unsigned long permitted = 0;
  const bool known = syscall(SYS_arch_prctl, 0x1022, &permitted) == 0;
  const bool tiles = known && (permitted & (1ul << 18)) != 0;
  EXPECT_EQ(has("amx"), avx512 && __builtin_cpu_supports("amx-tile") &&
                            __builtin_cpu_supports("amx-bf16") && tiles);
}
#endif

// On a CPU with AMX: the native kernel and the emulated one give the same
// bits (the emulator follows the SDM's definition of TDPBF16PS; this is
// where silicon is held to it). On a CPU without AMX the native half cannot
// run: the test then checks that the dispatcher does not offer it, and says
// that only the emulated half ran (Bf16Gemm/Emulated.*).
TEST(Bf16GemmDispatch, NativeAmxMatchesEmulatedBitForBit) {
  const std::vector<std::string> paths = kernels::fast::bf16_paths();
  const bool offered = std::find(paths.begin(), paths.end(), "amx") != paths.end();
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool cpu_has_amx = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16");
#else
  const bool cpu_has_amx = false;
#endif
  if (!cpu_has_amx) {
    EXPECT_FALSE(offered) << "the native AMX path is offered on a CPU without AMX";
    EXPECT_NE(std::string(kernels::fast::bf16_path()), "amx");
    RecordProperty("amx", "absent: only the emulated AMX kernel ran (Bf16Gemm/Emulated.*)");
    std::printf(
        "[   NOTE   ] this CPU has no AMX: the native AMX kernel was not run, only the "
        "emulated one; native-vs-emulated needs an AMX machine\n");
    return;
  }
  ASSERT_TRUE(offered) << "the CPU has AMX but the path is not offered (tile state refused?)";
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  struct Shape3 {
    bool ta, tb;
    int64_t m, n, k;
    float alpha, beta;
  };
  const Shape3 shapes[] = {
      {false, true, 128, 256, 64, 0.125f, 0.0f}, {false, false, 128, 64, 256, 1.0f, 1.0f},
      {true, false, 256, 64, 128, 1.0f, 1.0f},   {false, true, 48, 80, 64, 1.0f, 0.0f},
      {true, true, 37, 45, 70, -0.5f, 1.5f},     {false, false, 1, 64, 300, 1.0f, 0.0f},
  };
  for (const Shape3& s : shapes) {
    const Problem p = make_problem(rng, s.ta, s.tb, s.m, s.n, s.k, s.alpha, s.beta, 3);
    SCOPED_TRACE(p.str());
    const std::vector<float> native = run("amx", p), emulated = run("amx_emulated", p);
    EXPECT_EQ(std::memcmp(native.data(), emulated.data(), native.size() * sizeof(float)), 0);
  }
}

TEST(Bf16GemmDispatch, UnknownPathThrows) {
  float c = 0;
  EXPECT_THROW(kernels::fast::gemm_bf16_on_path("sse9", false, false, 1, 1, 1, 1.0f, nullptr, 1,
                                                nullptr, 1, 0.0f, &c, 1),
               std::invalid_argument);
}

}  // namespace
}  // namespace qkv::test
