// bf16 x bf16 -> float32 matrix products (fast version; the widening path is
// the portable fallback, and tests/test_gemm_bf16.cc's float64 loop is the
// spec). Three paths, chosen at run time (within the SIMD
// cap of qkv/simd.h), best first:
//   amx          AMX tiles: TDPBF16PS does a 16 x 16 x 32 product per instruction
//   avx512_bf16  VDPBF16PS register tiles: two bf16 products per float lane
//   widen        bf16 -> float copies, then OpenBLAS sgemm
// and one the dispatcher never picks: amx_emulated, the AMX kernel's very
// source run on kernels/simd/amx_emulator.h (scalar packing and epilogue),
// so that every machine's tests run the AMX code, and an AMX machine checks
// its native kernel against it bit for bit (tests/test_amx.cc).
// Why AMX first: on Sapphire Rapids VDPBF16PS zmm issues one per 2 cycles,
// 103 GFLOP/s per core, half the 205 GFLOP/s of float FMAs, so it cannot
// beat sgemm; TDPBF16PS peaks at 3.3 TFLOP/s. Measured with
// bench/bench_gemm_bf16.cc at flash attention's block shapes, one thread:
// amx 3.0-6.3x OpenBLAS sgemm, avx512_bf16 0.5-1.0x (two runs, 2 cores shared).
// On AMD Zen 4 (no AMX) VDPBF16PS zmm issues one per cycle, twice the float
// FMA rate: avx512_bf16 ran at 180-200 GFLOP/s per core at the same shapes,
// about 2x the widening path (2026-11-24). The forward of bf16 attention
// packs B once per key block (pack_b) and reads A in place where it can.
// Numerics: every path sums exact bf16 products in float32 (in different
// orders). Both BF16 instructions treat denormal bf16 inputs (|x| < 2^-126)
// as 0 and flush denormal float results to 0, whatever MXCSR says; the
// widening path keeps both.
#include "kernels/simd/gemm_bf16.h"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__)
// GCC 12's AVX-512 headers build "undefined" vectors as `__m512i y = y;`,
// which -Wall reports at every inlined use (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernels/runtime/blas.h"
#include "kernels/runtime/dispatch.h"
#include "kernels/runtime/workspace.h"
#include "kernels/simd/amx_tiles.h"
#include "kernels/simd/vecmath.h"

namespace qkv::kernels::fast {
namespace {

enum class Path { kAmx, kAvx512Bf16, kWiden, kAmxEmulated };
constexpr Path kAllPaths[] = {Path::kAmx, Path::kAvx512Bf16, Path::kWiden, Path::kAmxEmulated};

const char* path_name(Path path) {
  switch (path) {
    case Path::kAmx:
      return "amx";
    case Path::kAvx512Bf16:
      return "avx512_bf16";
    case Path::kWiden:
      return "widen";
    case Path::kAmxEmulated:
      return "amx_emulated";
  }
  return "?";
}

// C = beta * C over m x n (beta = 0 writes zeros without reading C).
void scale_c(int64_t m, int64_t n, float beta, float* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
  }
}

// ---- widen: the portable path -------------------------------------------------

// op(A) and op(B) widened to float and multiplied by sgemm (multiply() below).
// The products of two bf16 values are exact in float, so this differs from
// the native paths only in summation order (and in keeping denormal inputs).

// ---- packed operands ----------------------------------------------------------
//
// Both BF16 instructions multiply pairs of adjacent k: a 32-bit word holds
// (x[2p], x[2p + 1]) in its low and high half. The packed operands:
//   A: m_pad rows of kp words; word (r, p) = (op(A)[r][2p], op(A)[r][2p + 1])
//   B: n_pad / 16 panels of kp rows of 16 words;
//      word (p, j) of panel q = (op(B)[2p][16q + j], op(B)[2p + 1][16q + j])
// m_pad and n_pad are multiples of 16, kp a multiple of 16 (k up to a multiple
// of 32), and the padding is zero, so the kernels run whole 16 x 16 tiles
// (an AMX tile row is 16 words, 64 bytes) and never test bounds. Packing is
// O((m + n) k) against O(m n k) products: 12 % of the AMX time of S = Q Kᵀ
// (128 x 256, k = 64; K transposed, Q read in place), less for longer k.

constexpr int64_t kTile = 16;

int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

// One operand as words w(r, p): r runs over the m rows of op(A) or the n
// columns of op(B), p over the pairs along k. k_contiguous: the operand is
// stored with k along its rows (A as is, or B transposed), so a word is one
// 32-bit load; otherwise its two halves come from two rows.
struct Operand {
  const uint16_t* x;
  int64_t ld;
  int64_t rows;
  int64_t k;
  bool k_contiguous;

  uint16_t at(int64_t r, int64_t kk) const {
    return k_contiguous ? x[r * ld + kk] : x[kk * ld + r];
  }
  // Zero outside the operand: padding rows, and pairs at or past k.
  uint32_t word(int64_t r, int64_t p) const {
    if (r >= rows) return 0;
    const uint32_t lo = 2 * p < k ? at(r, 2 * p) : 0;
    const uint32_t hi = 2 * p + 1 < k ? at(r, 2 * p + 1) : 0;
    return lo | hi << 16;
  }
};

// The packed index of word (r, p): r_major (the A layout) or in panels (B).
size_t packed_index(int64_t r, int64_t p, int64_t kp, bool r_major) {
  return static_cast<size_t>(r_major ? r * kp + p
                                     : (r / kTile) * kp * kTile + p * kTile + r % kTile);
}

// Packs an operand word by word: the portable packing (the AMX emulated
// path's), and the edges of the vector one.
void pack_scalar(const Operand& op, int64_t r_pad, int64_t kp, bool r_major, uint32_t* dst) {
  for (int64_t r = 0; r < r_pad; ++r) {
    for (int64_t p = 0; p < kp; ++p) dst[packed_index(r, p, kp, r_major)] = op.word(r, p);
  }
}

// The packed layouts' k: pairs of k, padded to whole 16-word tile rows.
int64_t packed_kp(int64_t k) { return round_up(k, 2 * kTile) / 2; }

// ---- amx: tile products, on the tiles or on the emulator ----------------------

// The tile registers (all 16 rows of 64 bytes, amx::kAllTiles16x64): 0-3
// accumulate a 32 x 32 block of C (2 x 2 tiles of 16 x 16 floats), 4-5 hold
// two 16-row A tiles, 6-7 two 16-column B tiles. One k step (32 k) is 4
// loads and 4 TDPBF16PS (16 cycles each), so every loaded tile is used twice.

// One product on the tiles. A is either the packed A or, when op(A) is A
// itself with whole tiles (m % 16 == 0, k % 32 == 0), A in place: row r of
// A tiles at a + r * a_stride bytes either way.
struct AmxProduct {
  const char* a;
  int64_t a_stride;
  const uint32_t* b;  // packed B
  int64_t kp;
  int64_t m, n;
  float alpha, beta;
  float* c;
  int64_t ldc;
};

// A 32 x 32 block of C whose tiles are in a buffer, waiting for its epilogue.
struct Pending {
  const float* tiles = nullptr;  // 32 x 32, row stride 32
  float* c = nullptr;
  int64_t rows = 0, cols = 0;
};

// The kernel below is written once against a Tiles policy: amx_tiles.h's
// instructions, and the epilogue finish(pending, alpha, beta, ldc). Two
// policies: NativeGemmTiles (the instructions; the AVX-512 epilogue) and
// EmulatedGemmTiles (amx_emulator.h; a scalar epilogue with the same
// roundings).

// The 16*RowTiles x 16*ColTiles block of C at (r0, c0). With alpha = 1,
// beta in {0, 1} and whole tiles, the accumulators start from C (beta = 1)
// or zero and are stored straight into C. Otherwise they go to `buffer`, and
// alpha * sum + beta * C is applied while the next block's products run
// (done right after the tile stores, it waited on them: a third of the
// time of S = scale Q Kᵀ).
template <class Tiles, int RowTiles, int ColTiles>
void amx_block(const AmxProduct& g, int64_t r0, int64_t c0, float* buffer, Pending& pending) {
  const int64_t rows = std::min<int64_t>(16 * RowTiles, g.m - r0);
  const int64_t cols = std::min<int64_t>(16 * ColTiles, g.n - c0);
  const bool in_place = g.alpha == 1.0f && (g.beta == 0.0f || g.beta == 1.0f) &&
                        rows == 16 * RowTiles && cols == 16 * ColTiles;
  float* const c = g.c + r0 * g.ldc + c0;
  const int64_t c_stride = g.ldc * 4;
  if (in_place && g.beta == 1.0f) {
    Tiles::template load<0>(c, c_stride);
    if constexpr (ColTiles == 2) Tiles::template load<1>(c + 16, c_stride);
    if constexpr (RowTiles == 2) Tiles::template load<2>(c + 16 * g.ldc, c_stride);
    if constexpr (RowTiles == 2 && ColTiles == 2)
      Tiles::template load<3>(c + 16 * g.ldc + 16, c_stride);
  } else {
    Tiles::template zero<0>();
    if constexpr (ColTiles == 2) Tiles::template zero<1>();
    if constexpr (RowTiles == 2) Tiles::template zero<2>();
    if constexpr (RowTiles == 2 && ColTiles == 2) Tiles::template zero<3>();
  }
  const char* a = g.a + r0 * g.a_stride;
  const uint32_t* b = g.b + (c0 / kTile) * g.kp * kTile;
  const int64_t b_panel = g.kp * kTile;
  for (int64_t p = 0; p < g.kp; p += kTile) {
    Tiles::template load<4>(a + p * 4, g.a_stride);
    Tiles::template load<6>(b + p * kTile, 64);
    if constexpr (ColTiles == 2) Tiles::template load<7>(b + b_panel + p * kTile, 64);
    Tiles::template dpbf16ps<0, 4, 6>();
    if constexpr (ColTiles == 2) Tiles::template dpbf16ps<1, 4, 7>();
    if constexpr (RowTiles == 2) {
      Tiles::template load<5>(a + kTile * g.a_stride + p * 4, g.a_stride);
      Tiles::template dpbf16ps<2, 5, 6>();
      if constexpr (ColTiles == 2) Tiles::template dpbf16ps<3, 5, 7>();
    }
  }
  // The previous block's epilogue, on the vector units while the tiles work.
  if (pending.c != nullptr) Tiles::finish(pending, g.alpha, g.beta, g.ldc);
  pending = Pending{};
  float* out = in_place ? c : buffer;
  const int64_t out_stride = in_place ? c_stride : 32 * 4;
  const int64_t out_rows = in_place ? g.ldc : 32;
  Tiles::template store<0>(out, out_stride);
  if constexpr (ColTiles == 2) Tiles::template store<1>(out + 16, out_stride);
  if constexpr (RowTiles == 2) Tiles::template store<2>(out + 16 * out_rows, out_stride);
  if constexpr (RowTiles == 2 && ColTiles == 2)
    Tiles::template store<3>(out + 16 * out_rows + 16, out_stride);
  if (!in_place) pending = Pending{buffer, c, rows, cols};
}

template <class Tiles>
void gemm_amx(const AmxProduct& g) {
  // The packed operands were written by ordinary stores, which the tile
  // loads' asm does not declare it reads: keep them before the loads.
  amx::compiler_barrier();
  Tiles::configure(&amx::kAllTiles16x64);
  alignas(64) float buffers[2][32 * 32];
  Pending pending;
  int next = 0;
  const auto block = [&](int64_t r0, int64_t c0) {
    const bool two_rows = g.m - r0 > kTile, two_cols = g.n - c0 > kTile;
    float* buffer = buffers[next];
    next ^= 1;  // the other buffer may still be pending
    if (two_rows && two_cols) {
      amx_block<Tiles, 2, 2>(g, r0, c0, buffer, pending);
    } else if (two_rows) {
      amx_block<Tiles, 2, 1>(g, r0, c0, buffer, pending);
    } else if (two_cols) {
      amx_block<Tiles, 1, 2>(g, r0, c0, buffer, pending);
    } else {
      amx_block<Tiles, 1, 1>(g, r0, c0, buffer, pending);
    }
  };
  // Row blocks outer: sweeping columns inner (B from L1 or L2, rows of C in
  // order) measured 1.4x faster at S = Q Kᵀ (128 x 256, k = 64) than
  // sweeping rows inner (A in L1, C written in 2 KiB strides).
  for (int64_t r0 = 0; r0 < g.m; r0 += 2 * kTile) {
    for (int64_t c0 = 0; c0 < g.n; c0 += 2 * kTile) block(r0, c0);
  }
  if (pending.c != nullptr) Tiles::finish(pending, g.alpha, g.beta, g.ldc);
  // Frees the tile state so context switches stop saving 8 KiB for us.
  Tiles::release();
}

// The emulated tiles: any CPU. The epilogue rounds as store_row does
// (alpha * acc, then one fused multiply-add with beta * c).
struct EmulatedGemmTiles : amx::EmulatedTiles {
  static void finish(Pending p, float alpha, float beta, int64_t ldc) {
    for (int64_t i = 0; i < p.rows; ++i) {
      for (int64_t j = 0; j < p.cols; ++j) {
        float& c = p.c[i * ldc + j];
        const float r = alpha * p.tiles[i * 32 + j];
        c = beta == 0.0f ? r : std::fma(beta, c, r);
      }
    }
  }
};

// Packing, defined below (vectors on the native paths).
void pack_b_words(Path path, bool trans_b, int64_t n, int64_t k, const bfloat16* b, int64_t ldb,
                  int64_t kp, uint32_t* dst);
const uint32_t* pack_a_words(Path path, bool trans_a, int64_t m, int64_t k, const bfloat16* a,
                             int64_t lda, int64_t kp, uint32_t* dst);

#if defined(__x86_64__)

// ---- which instructions this CPU (and OS) offers ------------------------------

struct Support {
  bool avx512 = false;       // F + BW + VL: packing, conversions, epilogues
  bool avx512_bf16 = false;  // VDPBF16PS
  bool amx = false;          // AMX-TILE + AMX-BF16, and the kernel lets us use the tiles
};

// Linux hands out the 8 KiB of AMX tile state only on request (once per
// process, for all threads); without it the first tile instruction faults.
bool request_amx_state() {
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

Support detect_support() {
  __builtin_cpu_init();
  Support s;
  s.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
  s.avx512_bf16 = s.avx512 && __builtin_cpu_supports("avx512bf16");
  s.amx = s.avx512 && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
          request_amx_state();
  return s;
}

// What the CPU offers; and of that, what the SIMD cap (qkv/simd.h) allows:
// a cap below avx512 leaves only the widening path and the plain conversions.
const Support& cpu_support() {
  static const Support cpu = detect_support();
  return cpu;
}
Support support() { return kernels::avx512_allowed() ? cpu_support() : Support{}; }

#define QKV_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define QKV_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define QKV_AMX __attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-bf16")))

// ---- conversions ---------------------------------------------------------------

// bfloat16's constructor in integer lanes, bit for bit. VCVTNEPS2BF16 would
// round the same way but flushes denormal inputs to ±0 (float 0x00010000
// gives bf16 0x0000 on this machine; the constructor keeps 0x0001), so it is
// not used; these integer ops run at ~5 G floats/s here.
QKV_AVX512 __m256i round_to_bf16(__m512i u) {
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  // A NaN keeps its upper 16 bits with the quiet bit set: (u >> 16) | 0x40.
  r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

QKV_AVX512 void to_bf16_avx512(const float* x, bfloat16* out, int64_t n) {
  auto* o = reinterpret_cast<uint16_t*>(out);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i u = _mm512_loadu_si512(x + i);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), round_to_bf16(u));
  }
  if (i < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512i u = _mm512_maskz_loadu_epi32(mask, x + i);
    _mm256_mask_storeu_epi16(o + i, mask, round_to_bf16(u));
  }
}

// Transposes a 16 x 16 block of 32-bit words held one row per vector.
QKV_AVX512 void transpose16(__m512i v[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  // u[4g + j]: column 4L + j of rows 4g .. 4g + 3, in 128-bit lane L.
  __m512i u[16];
  for (int g = 0; g < 4; ++g) {
    const __m512i* s = t + 4 * g;
    u[4 * g + 0] = _mm512_unpacklo_epi64(s[0], s[2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(s[0], s[2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(s[1], s[3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(s[1], s[3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i even01 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);  // lanes 0, 2 of g 0, 1
    const __m512i odd01 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);   // lanes 1, 3 of g 0, 1
    const __m512i even23 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i odd23 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
    v[0 + j] = _mm512_shuffle_i32x4(even01, even23, 0x88);
    v[8 + j] = _mm512_shuffle_i32x4(even01, even23, 0xdd);
    v[4 + j] = _mm512_shuffle_i32x4(odd01, odd23, 0x88);
    v[12 + j] = _mm512_shuffle_i32x4(odd01, odd23, 0xdd);
  }
}

// Packs an operand into the A layout (r_major) or the B panels. Whole
// 16 x 16 word blocks inside the operand are moved with vectors (loaded as
// rows w(r, .) or as pairs w(., p), whichever the storage gives, and
// transposed when the layout wants the other); edge blocks word by word.
QKV_AVX512 void pack_avx512(const Operand& op, int64_t r_pad, int64_t kp, bool r_major,
                            uint32_t* dst) {
  const auto dst_word = [&](int64_t r, int64_t p) -> uint32_t& {
    return dst[packed_index(r, p, kp, r_major)];
  };
  for (int64_t r0 = 0; r0 < r_pad; r0 += kTile) {
    for (int64_t p0 = 0; p0 < kp; p0 += kTile) {
      if (r0 + kTile > op.rows || 2 * (p0 + kTile) > op.k) {
        for (int64_t i = 0; i < kTile; ++i) {
          for (int64_t j = 0; j < kTile; ++j) dst_word(r0 + i, p0 + j) = op.word(r0 + i, p0 + j);
        }
        continue;
      }
      __m512i v[16];
      if (op.k_contiguous) {  // v[i] = w(r0 + i, p0 ..): 32 bf16 of one stored row
        for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_si512(op.x + (r0 + i) * op.ld + 2 * p0);
      } else {  // v[i] = w(r0 .., p0 + i): 16 bf16 of rows 2p and 2p + 1, interleaved
        for (int i = 0; i < 16; ++i) {
          const uint16_t* lo = op.x + 2 * (p0 + i) * op.ld + r0;
          const __m512i l =
              _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo)));
          const __m512i h = _mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + op.ld)));
          v[i] = _mm512_or_si512(l, _mm512_slli_epi32(h, 16));
        }
      }
      if (op.k_contiguous != r_major) transpose16(v);
      // v[i] is now 16 consecutive words of the layout: w(r0 + i, p0 ..) or w(r0 .., p0 + i).
      for (int i = 0; i < 16; ++i) {
        uint32_t* to = r_major ? &dst_word(r0 + i, p0) : &dst_word(r0, p0 + i);
        _mm512_storeu_si512(to, v[i]);
      }
    }
  }
}

// op(A) as stored is already the row layout (word p of row r = the pair
// (A[r][2p], A[r][2p + 1])) when A is row-major with even k and lda and
// 4-byte aligned: no packing, and k / 2 words per row are enough.
bool a_is_row_layout(bool trans_a, int64_t k, const bfloat16* a, int64_t lda) {
  return !trans_a && k % 2 == 0 && lda % 2 == 0 && reinterpret_cast<uintptr_t>(a) % 4 == 0;
}

// c[0 .. cols) = alpha * acc + beta * c, cols <= 16; beta = 0 never reads c.
QKV_AVX512 void store_row(float* c, __m512 acc, int64_t cols, float alpha, float beta) {
  const __mmask16 mask = cols >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << cols) - 1);
  __m512 r = _mm512_mul_ps(_mm512_set1_ps(alpha), acc);
  if (beta != 0.0f) r = _mm512_fmadd_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(mask, c), r);
  _mm512_mask_storeu_ps(c, mask, r);
}

// ---- avx512_bf16: VDPBF16PS register tiles ------------------------------------

// An 8-row x 16*Panels-column tile of C in 8 * Panels zmm accumulators (16
// for 2 panels: each B vector feeds 8 products, each broadcast A pair 2; the
// 8-cycle latency needs >= 4 independent chains at one per 2 cycles). A: 8
// rows of words a_stride apart; B: Panels panels b_stride words apart; kp
// pairs of k summed.
template <int Panels>
QKV_AVX512_BF16 void dot_tile(const uint32_t* pa, int64_t a_stride, const uint32_t* pb,
                              int64_t b_stride, int64_t kp, int64_t rows, int64_t cols, float alpha,
                              float beta, float* c, int64_t ldc) {
  constexpr int kRows = 8;
  __m512 acc[kRows][Panels];
  for (int i = 0; i < kRows; ++i) {
    for (int q = 0; q < Panels; ++q) acc[i][q] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < kp; ++p) {
    __m512bh bv[Panels];
    for (int q = 0; q < Panels; ++q)
      bv[q] = (__m512bh)_mm512_loadu_si512(pb + q * b_stride + p * kTile);
    for (int i = 0; i < kRows; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(pa[i * a_stride + p]));
      for (int q = 0; q < Panels; ++q) acc[i][q] = _mm512_dpbf16_ps(acc[i][q], av, bv[q]);
    }
  }
  for (int i = 0; i < kRows && i < rows; ++i) {
    for (int q = 0; q < Panels && 16 * q < cols; ++q) {
      store_row(c + i * ldc + 16 * q, acc[i][q], cols - 16 * q, alpha, beta);
    }
  }
}

// C = alpha op(A) B + beta C with B packed (kp words per panel row). A is
// read in place when it has the row layout and whole 8-row tiles (dot_tile
// reads 8 rows), else packed; only the k / 2 pairs A holds are summed (B's
// padding rows are zero).
QKV_AVX512_BF16 void gemm_avx512_bf16(bool trans_a, int64_t m, int64_t n, int64_t k, float alpha,
                                      const bfloat16* a, int64_t lda, const uint32_t* b, int64_t kp,
                                      float beta, float* c, int64_t ldc, uint32_t* a_words) {
  const bool in_place = a_is_row_layout(trans_a, k, a, lda) && m % 8 == 0;
  const uint32_t* pa = in_place
                           ? reinterpret_cast<const uint32_t*>(a)
                           : pack_a_words(Path::kAvx512Bf16, trans_a, m, k, a, lda, kp, a_words);
  const int64_t a_stride = in_place ? lda / 2 : kp;
  const int64_t pairs = in_place ? k / 2 : kp;
  for (int64_t r0 = 0; r0 < m; r0 += 8) {
    const uint32_t* pa_r = pa + r0 * a_stride;
    for (int64_t c0 = 0; c0 < n; c0 += 2 * kTile) {
      const uint32_t* pb = b + (c0 / kTile) * kp * kTile;
      float* ct = c + r0 * ldc + c0;
      if (n - c0 > kTile) {
        dot_tile<2>(pa_r, a_stride, pb, kp * kTile, pairs, m - r0, n - c0, alpha, beta, ct, ldc);
      } else {
        dot_tile<1>(pa_r, a_stride, pb, kp * kTile, pairs, m - r0, n - c0, alpha, beta, ct, ldc);
      }
    }
  }
}

// ---- amx: the native tiles ----------------------------------------------------

// By value: stores through c could alias a referenced Pending, which made
// the compiler reload its fields after every row.
QKV_AMX void finish_avx512(Pending p, float alpha, float beta, int64_t ldc) {
  for (int64_t i = 0; i < p.rows; ++i) {
    float* ci = p.c + i * ldc;
    store_row(ci, _mm512_load_ps(p.tiles + i * 32), p.cols, alpha, beta);
    if (p.cols > 16)
      store_row(ci + 16, _mm512_load_ps(p.tiles + i * 32 + 16), p.cols - 16, alpha, beta);
  }
}

// The instructions (amx_tiles.h) with the AVX-512 epilogue.
struct NativeGemmTiles : amx::NativeTiles {
  static void finish(Pending p, float alpha, float beta, int64_t ldc) {
    finish_avx512(p, alpha, beta, ldc);
  }
};

// Whether the CPU runs `path`, whatever the cap: for the tests' per-path hooks.
bool available(Path path) {
  switch (path) {
    case Path::kAmx:
      return cpu_support().amx;
    case Path::kAvx512Bf16:
      return cpu_support().avx512_bf16;
    case Path::kWiden:
    case Path::kAmxEmulated:
      return true;
  }
  return false;
}

// Whether VDPBF16PS outruns the float path on this CPU: a vendor rule, not a
// calibration, so every run takes the same path (and gives the same bits).
// Intel's cores (Cooper Lake, Sapphire and Emerald Rapids) issue it at half
// their FMA rate: on an Emerald Rapids Xeon without AMX the avx512_bf16 path
// ran bf16 SDPA at 0.6x qkv's float32. AMD's Zen 4 issues it at twice the
// float rate: bf16 SDPA there runs at 1.77x float32 (docs/performance.md).
bool bf16_dot_beats_float() { return !__builtin_cpu_is("intel"); }

Path best_native_path() {
  const Support s = support();
  return s.amx                                     ? Path::kAmx
         : s.avx512_bf16 && bf16_dot_beats_float() ? Path::kAvx512Bf16
                                                   : Path::kWiden;
}

const char* why_path(Path path) {
  const Support s = support();
  if (path == Path::kWiden && s.avx512_bf16) {
    return "AVX512_BF16 is present, but Intel cores issue VDPBF16PS at half the FMA rate, so the "
           "float32 kernels are faster";
  }
  if (path == Path::kWiden) {
    return kernels::avx512_allowed() ? "no BF16 instructions" : "the SIMD cap is below avx512";
  }
  if (path == Path::kAvx512Bf16) return "VDPBF16PS: not an Intel core, so it outruns float32 FMAs";
  if (path == Path::kAmxEmulated) return "the AMX tile emulator (forced by a test)";
  return "AMX tiles; bf16 attention's forward runs its key loop fused on them";
}

#else  // not x86-64: the widening path (and the emulated AMX one, for tests)

Path best_native_path() { return Path::kWiden; }
bool available(Path path) { return path == Path::kWiden || path == Path::kAmxEmulated; }
const char* why_path(Path) { return "no BF16 instructions"; }

#endif

// The tests' override of the path (test_amx.cc runs bf16 attention on the
// emulated AMX path): -1, none, or a Path. Set only between calls.
std::atomic<int> forced_path{-1};

Path best_path() {
  const int forced = forced_path.load(std::memory_order_relaxed);
  return forced >= 0 ? static_cast<Path>(forced) : best_native_path();
}

// Packs for `path`: with vectors on the native paths, word by word on the
// emulated one (which runs on any CPU).
void pack(Path path, const Operand& op, int64_t r_pad, int64_t kp, bool r_major, uint32_t* dst) {
#if defined(__x86_64__)
  if (path != Path::kAmxEmulated) return pack_avx512(op, r_pad, kp, r_major, dst);
#endif
  assert(path == Path::kAmxEmulated);
  pack_scalar(op, r_pad, kp, r_major, dst);
}

// op(B) (k x n) into the panel layout with kp words per panel row.
void pack_b_words(Path path, bool trans_b, int64_t n, int64_t k, const bfloat16* b, int64_t ldb,
                  int64_t kp, uint32_t* dst) {
  const Operand op_b{reinterpret_cast<const uint16_t*>(b), ldb, n, k, trans_b};
  pack(path, op_b, round_up(n, kTile), kp, /*r_major=*/false, dst);
}

// op(A) (m x k) into the row layout with kp words per row, in `dst`
// (round_up(m, kTile) * kp words, a_storage below).
const uint32_t* pack_a_words(Path path, bool trans_a, int64_t m, int64_t k, const bfloat16* a,
                             int64_t lda, int64_t kp, uint32_t* dst) {
  const Operand op_a{reinterpret_cast<const uint16_t*>(a), lda, m, k, !trans_a};
  pack(path, op_a, round_up(m, kTile), kp, /*r_major=*/true, dst);
  return dst;
}

// op(B) ready for a path: the panel words of the native paths, or op(B)
// widened to float (k x n) for the widening path.
struct ReadyB {
  const uint32_t* words = nullptr;
  int64_t kp = 0;
  const float* wide = nullptr;
};

// Storage for op(A) (m x k) on `path`: packed row words on the native
// paths, A widened to float on the widening path; cut from `slicer` (or
// counted). Sized for the larger of the two (both 4-byte elements), so the
// size queries need not know which path a packed B was made for.
struct AStorage {
  uint32_t* words = nullptr;
  float* wide = nullptr;
};
AStorage a_storage(Path path, int64_t m, int64_t k, Slicer& slicer) {
  uint32_t* p = slicer.take<uint32_t>(std::max(round_up(m, kTile) * packed_kp(k), m * k));
  AStorage st;
  if (path == Path::kWiden) {
    st.wide = reinterpret_cast<float*>(p);
  } else {
    st.words = p;
  }
  return st;
}

// C = alpha op(A) B + beta C for a B made ready for `path`; m, n, k > 0;
// op(A) packed or widened into `a_st` (a_storage) when the path needs it.
void multiply(Path path, bool trans_a, int64_t m, int64_t n, int64_t k, float alpha,
              const bfloat16* a, int64_t lda, const ReadyB& b, float beta, float* c, int64_t ldc,
              const AStorage& a_st) {
  if (path == Path::kAmx || path == Path::kAmxEmulated) {
    // A as stored already has the A-tile layout when its rows hold whole
    // 64-byte tile rows and whole tiles: no packing (the common case, Q or P
    // with k = 64, 128, 256).
    const bool a_in_place = !trans_a && m % kTile == 0 && k % (2 * kTile) == 0;
    const uint32_t* pa =
        a_in_place ? nullptr : pack_a_words(path, trans_a, m, k, a, lda, b.kp, a_st.words);
    const AmxProduct g{
        a_in_place ? reinterpret_cast<const char*>(a) : reinterpret_cast<const char*>(pa),
        a_in_place ? lda * 2 : b.kp * 4,
        b.words,
        b.kp,
        m,
        n,
        alpha,
        beta,
        c,
        ldc};
#if defined(__x86_64__)
    if (path == Path::kAmx) return gemm_amx<NativeGemmTiles>(g);
#endif
    return gemm_amx<EmulatedGemmTiles>(g);
  }
#if defined(__x86_64__)
  if (path == Path::kAvx512Bf16) {
    gemm_avx512_bf16(trans_a, m, n, k, alpha, a, lda, b.words, b.kp, beta, c, ldc, a_st.words);
    return;
  }
#endif
  widen_rows(a, lda, trans_a ? k : m, trans_a ? m : k, a_st.wide);
  kernels::gemm(trans_a, false, m, n, k, alpha, a_st.wide, trans_a ? m : k, b.wide, n, beta, c,
                ldc);
}

// The storage op(B) (k x n) made ready for `path` takes: panel words on the
// native paths, floats on the widening path; cut from `slicer` (or counted),
// the larger of the two, as a_storage.
void ready_storage(Path path, int64_t n, int64_t k, Slicer& slicer, uint32_t** words,
                   float** wide) {
  uint32_t* p = slicer.take<uint32_t>(std::max(round_up(n, kTile) * packed_kp(k), k * n));
  *words = path == Path::kWiden ? nullptr : p;
  *wide = path == Path::kWiden ? reinterpret_cast<float*>(p) : nullptr;
}

// Puts op(B) into the form `path` multiplies with, in `words` or `wide` (as
// sized by ready_storage).
ReadyB make_ready(Path path, bool trans_b, int64_t n, int64_t k, const bfloat16* b, int64_t ldb,
                  uint32_t* words, float* wide) {
  ReadyB ready;
  if (path == Path::kWiden) {
    if (trans_b) {  // stored n x k: transpose while widening
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t kk = 0; kk < k; ++kk) wide[kk * n + j] = static_cast<float>(b[j * ldb + kk]);
      }
    } else {
      for (int64_t kk = 0; kk < k; ++kk) to_float(b + kk * ldb, wide + kk * n, n);
    }
    ready.wide = wide;
    return ready;
  }
  ready.kp = packed_kp(k);
  pack_b_words(path, trans_b, n, k, b, ldb, ready.kp, words);
  ready.words = words;
  return ready;
}

// Scratch of a product on `path`: op(A) (m x k) packed or widened, then
// op(B) (k x n) made ready.
size_t gemm_scratch_words_on(Path path, int64_t m, int64_t n, int64_t k) {
  if (m <= 0 || n <= 0 || k <= 0) return 0;
  return counted_words([&](Slicer& count) {
    a_storage(path, m, k, count);
    uint32_t* words;
    float* wide;
    ready_storage(path, n, k, count, &words, &wide);
  });
}

void gemm_on(Path path, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
             const bfloat16* a, int64_t lda, const bfloat16* b, int64_t ldb, float beta, float* c,
             int64_t ldc, double* scratch) {
  assert(m >= 0 && n >= 0 && k >= 0);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    scale_c(m, n, beta, c, ldc);
    return;
  }
  Slicer slicer(scratch);
  const AStorage a_st = a_storage(path, m, k, slicer);
  uint32_t* words;
  float* wide;
  ready_storage(path, n, k, slicer, &words, &wide);
  const ReadyB ready = make_ready(path, trans_b, n, k, b, ldb, words, wide);
  multiply(path, trans_a, m, n, k, alpha, a, lda, ready, beta, c, ldc, a_st);
}

size_t pack_b_words_on(Path path, int64_t n, int64_t k) {
  if (n <= 0 || k <= 0) return 0;
  return counted_words([&](Slicer& count) {
    uint32_t* words;
    float* wide;
    ready_storage(path, n, k, count, &words, &wide);
  });
}

PackedBf16 pack_b_on(Path path, bool trans_b, int64_t n, int64_t k, const bfloat16* b, int64_t ldb,
                     double* storage) {
  assert(n >= 0 && k >= 0);
  PackedBf16 packed;
  packed.n = n;
  packed.k = k;
  packed.path = static_cast<int>(path);
  if (n > 0 && k > 0) {
    Slicer slicer(storage);
    uint32_t* words;
    float* wide;
    ready_storage(path, n, k, slicer, &words, &wide);
    const ReadyB ready = make_ready(path, trans_b, n, k, b, ldb, words, wide);
    packed.kp = ready.kp;
    packed.words = ready.words;
    packed.wide = ready.wide;
  }
  return packed;
}

void gemm_packed(int64_t m, float alpha, const bfloat16* a, int64_t lda, const PackedBf16& b,
                 float beta, float* c, int64_t ldc, double* scratch) {
  assert(m >= 0);
  if (m == 0 || b.n == 0) return;
  if (b.k == 0) {
    scale_c(m, b.n, beta, c, ldc);
    return;
  }
  const ReadyB ready{b.words, b.kp, b.wide};
  Slicer slicer(scratch);
  const AStorage a_st = a_storage(static_cast<Path>(b.path), m, b.k, slicer);
  multiply(static_cast<Path>(b.path), false, m, b.n, b.k, alpha, a, lda, ready, beta, c, ldc, a_st);
}

}  // namespace

size_t gemm_bf16_scratch_words(int64_t m, int64_t n, int64_t k) {
  return gemm_scratch_words_on(best_path(), m, n, k);
}

void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
               const bfloat16* a, int64_t lda, const bfloat16* b, int64_t ldb, float beta, float* c,
               int64_t ldc, double* scratch) {
  gemm_on(best_path(), trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, scratch);
}

size_t pack_b_bf16_words(int64_t n, int64_t k) { return pack_b_words_on(best_path(), n, k); }

PackedBf16 pack_b_bf16(bool trans_b, int64_t n, int64_t k, const bfloat16* b, int64_t ldb,
                       double* storage) {
  return pack_b_on(best_path(), trans_b, n, k, b, ldb, storage);
}

size_t gemm_bf16_packed_scratch_words(int64_t m, int64_t k) {
  if (m <= 0 || k <= 0) return 0;
  return counted_words([&](Slicer& count) { a_storage(best_path(), m, k, count); });
}

void gemm_bf16(int64_t m, float alpha, const bfloat16* a, int64_t lda, const PackedBf16& b,
               float beta, float* c, int64_t ldc, double* scratch) {
  gemm_packed(m, alpha, a, lda, b, beta, c, ldc, scratch);
}

void to_bf16(const float* x, bfloat16* out, int64_t n) {
#if defined(__x86_64__)
  if (support().avx512) return to_bf16_avx512(x, out, n);
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = bfloat16(x[i]);
}

bool bf16_native() { return best_path() != Path::kWiden; }

const char* bf16_path() { return path_name(best_path()); }

namespace {
AmxTiles amx_tiles(Path path) {
  return path == Path::kAmx           ? AmxTiles::kNative
         : path == Path::kAmxEmulated ? AmxTiles::kEmulated
                                      : AmxTiles::kNone;
}
}  // namespace

AmxTiles bf16_amx_tiles() { return amx_tiles(best_path()); }

AmxTiles amx_tiles_of(const PackedBf16& packed) {
  return packed.words ? amx_tiles(static_cast<Path>(packed.path)) : AmxTiles::kNone;
}

const char* bf16_path_reason() { return why_path(best_path()); }

// For tests and benchmarks: every path this CPU can run, on demand, whatever
// the SIMD cap. bf16_paths lists the ones the dispatcher may pick;
// "amx_emulated" runs everywhere and is named explicitly.

std::vector<std::string> bf16_paths() {
  std::vector<std::string> names;
  for (Path path : {Path::kAmx, Path::kAvx512Bf16, Path::kWiden}) {
    if (available(path)) names.emplace_back(path_name(path));
  }
  return names;
}

void gemm_bf16_on_path(const std::string& path, bool trans_a, bool trans_b, int64_t m, int64_t n,
                       int64_t k, float alpha, const bfloat16* a, int64_t lda, const bfloat16* b,
                       int64_t ldb, float beta, float* c, int64_t ldc) {
  for (Path p : kAllPaths) {
    if (path == path_name(p) && available(p)) {
      // A test and benchmark hook, not a kernel: it keeps the product's
      // scratch itself, grown once per thread, so timed loops do not allocate.
      thread_local std::vector<double> scratch;
      const size_t words = gemm_scratch_words_on(p, m, n, k);
      if (scratch.size() < words) scratch.resize(words);
      return gemm_on(p, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc,
                     scratch.data());
    }
  }
  throw std::invalid_argument("fast::gemm_bf16_on_path: path '" + path +
                              "' is not available on this machine");
}

PackedBf16 pack_b_bf16_on_path(const std::string& path, bool trans_b, int64_t n, int64_t k,
                               const bfloat16* b, int64_t ldb, std::vector<double>& storage) {
  for (Path p : kAllPaths) {
    if (path == path_name(p) && available(p)) {
      storage.assign(pack_b_words_on(p, n, k), 0.0);
      return pack_b_on(p, trans_b, n, k, b, ldb, storage.data());
    }
  }
  throw std::invalid_argument("fast::pack_b_bf16_on_path: path '" + path +
                              "' is not available on this machine");
}

// Every bf16 product (gemm_bf16, pack_b_bf16, bf16_path, bf16_native) takes
// `path` from now on, whatever the CPU offers; "" goes back to the CPU's
// best. For tests that run a whole kernel on one path (bf16 attention on
// "amx_emulated"): set between calls, never while a product runs.
void force_bf16_path_for_testing(const std::string& path) {
  if (path.empty()) {
    forced_path.store(-1);
    return;
  }
  for (Path p : kAllPaths) {
    if (path == path_name(p) && available(p)) {
      forced_path.store(static_cast<int>(p));
      return;
    }
  }
  throw std::invalid_argument("fast::force_bf16_path_for_testing: path '" + path +
                              "' is not available on this machine");
}

}  // namespace qkv::kernels::fast
