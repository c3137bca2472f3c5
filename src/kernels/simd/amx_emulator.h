// An emulator of the AMX tile instructions gemm_bf16's AMX path uses
// (LDTILECFG, STTILECFG, TILERELEASE, TILELOADD, TILESTORED, TILEZERO,
// TDPBF16PS), palette 1 only: a reference, plain and slow (~8,000 scalar
// FMAs per TDPBF16PS), so that every machine runs the AMX kernel in its tests
// and an AMX machine can check the native kernel against it bit for bit.
// Private to kernels/simd (and tests).
//
// Source: the Intel SDM's instruction pages (Vol. 2, "TDPBF16PS", "LDTILECFG",
// "TILELOADD", "TILESTORED", "TILEZERO", "TILERELEASE", and Section 2.10's
// exception classes AMX-E1 to E5), followed line by line below; what the
// pseudo-code leaves open is said where it is decided.
//
// TDPBF16PS, per the SDM: for each row m of the destination, two float32
// temporaries per output column n (temp1[2n] for the even bf16 of each pair,
// temp1[2n+1] for the odd one) start at 0 and each accumulates over k with
// "FP32 FMA with DAZ=FTZ=1, RNE rounding" -- fused: one rounding per
// product-and-add; then tmp = temp1[2n] + temp1[2n+1] and
// dst[m][n] = dst[m][n] + tmp, each rounded (RNE, DAZ, FTZ). MXCSR is
// neither read nor written. The intrinsics guide's pseudo-code for
// _tile_dpbf16ps is a different, looser sketch (it adds each product
// straight into dst, even then odd, and says nothing of rounding or
// denormals); the SDM is the architectural definition, so it is the one
// emulated. Whether silicon rounds exactly so is what the native-versus-
// emulated test on an AMX machine finds out.
#pragma once

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace qkv::kernels::amx_emulator {

// Palette 1, the only non-INIT palette (SDM, LDTILECFG): 8 tiles of at most
// 16 rows of 64 bytes; TMUL limits max_m = 16 rows, max_k = 16 dwords,
// max_n = 16 dwords.
constexpr int kMaxNames = 8;
constexpr int kMaxRows = 16;
constexpr int kBytesPerRow = 64;

// The 64-byte memory image LDTILECFG reads and STTILECFG writes.
struct TileConfig {
  uint8_t palette_id = 0;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row; tiles 8-15 must be 0 in palette 1
  uint8_t rows[16] = {};    // tiles 8-15 must be 0 in palette 1
};
static_assert(sizeof(TileConfig) == 64);

// ---- arithmetic: float32 with DAZ, FTZ and round-to-nearest-even -----------------

// DAZ: a denormal input counts as a zero of its sign.
inline float daz(float x) {
  return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x;
}

// make_fp32: a bf16 (its 16 bits) is the upper half of a float.
inline float make_fp32(uint16_t bf16) { return std::bit_cast<float>(uint32_t{bf16} << 16); }

// FTZ on a result r rounded the IEEE way (onto the denormal grid): zero of the
// result's sign when it underflows. x86 calls a result tiny when, rounded to
// 24 bits with an unbounded exponent, it is below 2^-126 ("after rounding",
// SDM Vol. 1, 4.9.1.5). A denormal r is always tiny so; r = ±2^-126 may come
// from an exact value that rounds to 24 bits just below it (the one case the
// grids disagree on), which fma_daz_ftz settles.
inline float ftz(float r) {
  return std::fpclassify(r) == FP_SUBNORMAL ? std::copysign(0.0f, r) : r;
}

// "FP32 FMA with DAZ=FTZ=1, RNE rounding": c + a b, one rounding (the host's
// default round-to-nearest-even, denormals kept, then FTZ as above).
inline float fma_daz_ftz(float a, float b, float c) {
  a = daz(a);
  b = daz(b);
  c = daz(c);
  const float r = std::fma(a, b, c);
  if (std::fabs(r) != FLT_MIN) return ftz(r);
  if (a == 0.0f || b == 0.0f) return r;  // r = c exactly, a normal float
  // |r| = 2^-126: the exact x = ab + c is within 2^-149 of it. Then |ab| and
  // |c| are both below 2^-99: were both at least 2^-100, x would be a
  // multiple of 2^-123 (a bf16 product has at most 16 significant bits, a
  // float 24), so 0 or above 2^-124. Hence |a| < 2^27 (|b| >= 2^-126 after
  // DAZ), a and c scaled by 2^24 neither overflow nor lose a bit, and u is
  // x 2^24 rounded to 24 bits: the unbounded-exponent rounding, scaled.
  const float u = std::fma(a * 0x1p24f, b, c * 0x1p24f);
  return std::fabs(u) < FLT_MIN * 0x1p24f ? std::copysign(0.0f, r) : r;
}

// a + b with DAZ=FTZ=1, RNE. After DAZ both are 0 or at least 2^-126 in
// magnitude, so both are multiples of 2^-149 and so is their sum: a sum below
// 2^-126 is exact on the denormal grid, and tiny however it is rounded.
inline float add_daz_ftz(float a, float b) { return ftz(daz(a) + daz(b)); }

// ---- the tile state (per thread, as the hardware's is per logical CPU) -------------

struct TileState {
  bool configured = false;  // TILES_CONFIGURED
  TileConfig config;        // all zero in the INIT state
  alignas(64) uint8_t data[kMaxNames][kMaxRows][kBytesPerRow] = {};
};

inline TileState& state() {
  thread_local TileState s;
  return s;
}

// A #GP or #UD: the hardware raises it (SIGSEGV or SIGILL); the emulator
// says which rule was broken and aborts, in every build type.
[[noreturn]] inline void fault(const char* instruction, const char* exception, const char* rule) {
  std::fprintf(stderr, "amx_emulator: %s: %s: %s\n", instruction, exception, rule);
  std::abort();
}

// LDTILECFG's #GP conditions on a 64-byte image: null when it loads, else the
// rule it breaks. (xcr0_supports_palette: the emulator supports palettes 0, 1.)
inline const char* config_error(const void* mem) {
  TileConfig c;
  std::memcpy(&c, mem, sizeof c);
  if (c.palette_id > 1) return "palette_id > 1 (max_palette)";
  if (c.palette_id == 0) return nullptr;  // INIT: the other bytes are ignored
  for (uint8_t b : c.reserved) {
    if (b != 0) return "bytes 2-15 are reserved and must be zero";
  }
  for (int n = 0; n < 16; ++n) {
    if (n < kMaxNames) {
      if (c.colsb[n] > kBytesPerRow) return "colsb > 64 (bytes_per_row)";
      if (c.rows[n] > kMaxRows) return "rows > 16 (max_rows)";
      if ((c.rows[n] == 0) != (c.colsb[n] == 0)) return "one of rows and colsb is 0 but not both";
    } else if (c.colsb[n] != 0 || c.rows[n] != 0) {
      return "tiles 8-15 (past max_names) must have colsb and rows 0";
    }
  }
  return nullptr;
}

inline void zero_all_tile_data() { std::memset(state().data, 0, sizeof state().data); }

inline void ldtilecfg(const void* mem) {
  if (const char* rule = config_error(mem)) fault("LDTILECFG", "#GP", rule);
  TileState& s = state();
  TileConfig c;
  std::memcpy(&c, mem, sizeof c);
  if (c.palette_id == 0) {
    s.configured = false;
    s.config = TileConfig{};
  } else {
    s.config = c;
    s.configured = true;
  }
  zero_all_tile_data();
}

inline void sttilecfg(void* mem) {
  const TileState& s = state();
  const TileConfig c = s.configured ? s.config : TileConfig{};
  std::memcpy(mem, &c, sizeof c);
}

// Back to the INIT state: no configuration, tiles zero.
inline void tilerelease() {
  state().configured = false;
  state().config = TileConfig{};
  zero_all_tile_data();
}

inline bool tiles_configured() { return state().configured; }

// The #UD checks every tile operand goes through (AMX-E3 to E5): the tiles
// are configured and the name is one of the palette's, configured with rows.
inline const char* tile_error(int t) {
  const TileState& s = state();
  if (!s.configured) return "tiles are not configured (TILES_CONFIGURED = 0)";
  if (t < 0 || t >= kMaxNames) return "tile name >= max_names (8)";
  if (s.config.rows[t] == 0) return "tile is not valid (rows = colsb = 0)";
  return nullptr;
}

// TDPBF16PS's #UD conditions (AMX-E4): null when it runs, else the rule.
inline const char* dpbf16ps_error(int dst, int src1, int src2) {
  if (dst == src1 || dst == src2 || src1 == src2) return "tiles are not all different";
  for (int t : {dst, src1, src2}) {
    if (const char* rule = tile_error(t)) return rule;
  }
  const TileConfig& c = state().config;
  if (c.colsb[dst] % 4 || c.colsb[src1] % 4 || c.colsb[src2] % 4)
    return "colsb not a multiple of 4";
  if (c.colsb[dst] != c.colsb[src2]) return "srcdest.colsb != src2.colsb";
  if (c.rows[dst] != c.rows[src1]) return "srcdest.rows != src1.rows";
  if (c.colsb[src1] / 4 != c.rows[src2]) return "src1.colsb / 4 != src2.rows";
  return nullptr;  // the TMUL limits (16 rows, 16 dwords) are palette 1's own
}

inline void check_tile(const char* instruction, int t) {
  if (const char* rule = tile_error(t)) fault(instruction, "#UD", rule);
}

// zero_upper_rows(t, n): rows n .. 15 of tile t to zero.
inline void zero_upper_rows(int t, int n) {
  for (int r = n; r < kMaxRows; ++r) std::memset(state().data[t][r], 0, kBytesPerRow);
}

// write_row_and_zero(t, r, bytes, n): row r of tile t is n bytes, then zeros.
inline void write_row_and_zero(int t, int r, const void* bytes, int n) {
  std::memcpy(state().data[t][r], bytes, static_cast<size_t>(n));
  std::memset(state().data[t][r] + n, 0, static_cast<size_t>(kBytesPerRow - n));
}

// TILELOADD t, [base + stride * row]: rows start_row .. rows - 1 of colsb
// bytes each; the rest of the tile zero.
inline void tileloadd(int t, const void* base, int64_t stride) {
  check_tile("TILELOADD", t);
  TileState& s = state();
  int start = s.config.start_row;
  zero_upper_rows(t, start);
  const int nbytes = s.config.colsb[t];
  for (; start < s.config.rows[t]; ++start) {
    write_row_and_zero(t, start, static_cast<const char*>(base) + start * stride, nbytes);
  }
  s.config.start_row = 0;  // zero_tilecfg_start
}

// TILESTORED [base + stride * row], t: rows start_row .. rows - 1, colsb
// bytes each; nothing else of memory is written.
inline void tilestored(int t, void* base, int64_t stride) {
  check_tile("TILESTORED", t);
  TileState& s = state();
  for (int start = s.config.start_row; start < s.config.rows[t]; ++start) {
    std::memcpy(static_cast<char*>(base) + start * stride, s.data[t][start], s.config.colsb[t]);
  }
  s.config.start_row = 0;
}

inline void tilezero(int t) {
  check_tile("TILEZERO", t);
  zero_upper_rows(t, 0);
  state().config.start_row = 0;
}

// TDPBF16PS dst, src1, src2: dst (m x n floats) += src1 (m x k bf16 pairs)
// times src2 (k x n bf16 pairs), in the SDM's order (file header).
inline void tdpbf16ps(int dst, int src1, int src2) {
  if (const char* rule = dpbf16ps_error(dst, src1, src2)) fault("TDPBF16PS", "#UD", rule);
  TileState& s = state();
  const int rows = s.config.rows[dst];
  const int elements_src1 = s.config.colsb[src1] / 4;  // k: pairs
  const int elements_dest = s.config.colsb[dst] / 4;   // n: floats
  const auto bf16 = [&](int t, int r, int i) {
    uint16_t x;
    std::memcpy(&x, s.data[t][r] + 2 * i, 2);
    return make_fp32(x);
  };
  for (int m = 0; m < rows; ++m) {
    float temp1[2 * 16] = {};
    for (int k = 0; k < elements_src1; ++k) {
      for (int n = 0; n < elements_dest; ++n) {
        temp1[2 * n] = fma_daz_ftz(bf16(src1, m, 2 * k), bf16(src2, k, 2 * n), temp1[2 * n]);
        temp1[2 * n + 1] =
            fma_daz_ftz(bf16(src1, m, 2 * k + 1), bf16(src2, k, 2 * n + 1), temp1[2 * n + 1]);
      }
    }
    float row[16];
    std::memcpy(row, s.data[dst][m], sizeof row);
    for (int n = 0; n < elements_dest; ++n) {
      const float tmp = add_daz_ftz(temp1[2 * n], temp1[2 * n + 1]);
      row[n] = add_daz_ftz(row[n], tmp);
    }
    write_row_and_zero(dst, m, row, s.config.colsb[dst]);
  }
  zero_upper_rows(dst, rows);
  s.config.start_row = 0;
}

}  // namespace qkv::kernels::amx_emulator
