// The AMX tile instructions as two policies with one interface, so that a
// kernel written once against `Tiles` compiles twice: NativeTiles (the
// instructions, x86-64 only) and EmulatedTiles (kernels/simd/amx_emulator.h,
// any CPU: every machine's tests run the AMX code, and an AMX machine checks
// the native kernel against it bit for bit). Users: gemm_bf16.cc (the block
// products) and amx_attention.cc (the fused bf16 attention forward). Private
// to kernels/simd.
//
// The interface: configure(config) and release(); load<T>(base, stride),
// store<T>(base, stride), zero<T>(), dpbf16ps<Dst, Src1, Src2>() with the
// tile names as template arguments.
#pragma once

#include <cstdint>

#include "kernels/simd/amx_emulator.h"

namespace qkv::kernels::amx {

// Palette 1 with tiles 0-7 all 16 rows of 64 bytes: a float accumulator
// tile is 16 x 16 floats, an operand tile 16 rows of 16 bf16 pairs.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
static_assert(sizeof(TileConfig) == 64);
// Static storage: LDTILECFG reads all 64 bytes.
inline const TileConfig kAllTiles16x64{};

// Keeps ordinary loads and stores on their side of this point: the tile
// instructions' asm below declares no memory effects (like GCC's intrinsics),
// so operands written by vector or scalar stores must be fenced before a
// tile load reads them, and tile stores before vector code reads theirs.
inline void compiler_barrier() { __asm__ volatile("" ::: "memory"); }

#if defined(__x86_64__)
// GCC's _tile_loadd, _tile_stored, _tile_zero and _tile_dpbf16ps are macros
// that paste their tile numbers into the asm text, so they take only literal
// numbers; these are the same asm statements (immintrin.h's, both syntaxes)
// with the numbers as immediate operands ("%c": printed bare), so a kernel
// can name tiles by template arguments. They need no target attribute: they
// are only asm.
struct NativeTiles {
  static void configure(const TileConfig* config) {
    __asm__ volatile("ldtilecfg\t%0" ::"m"(*config));
  }
  static void release() { __asm__ volatile("tilerelease" ::); }
  template <int T>
  static void load(const void* base, int64_t stride) {
    __asm__ volatile("{tileloadd\t(%0,%1,1), %%tmm%c2|tileloadd\t%%tmm%c2, [%0+%1*1]}" ::"r"(base),
                     "r"(static_cast<long>(stride)), "i"(T));
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    __asm__ volatile(
        "{tilestored\t%%tmm%c2, (%0,%1,1)|tilestored\t[%0+%1*1], %%tmm%c2}" ::"r"(base),
        "r"(static_cast<long>(stride)), "i"(T));
  }
  template <int T>
  static void zero() {
    __asm__ volatile("tilezero\t%%tmm%c0" ::"i"(T));
  }
  template <int Dst, int Src1, int Src2>
  static void dpbf16ps() {
    __asm__ volatile(
        "{tdpbf16ps\t%%tmm%c2, %%tmm%c1, %%tmm%c0|tdpbf16ps\t%%tmm%c0, %%tmm%c1, %%tmm%c2}" ::"i"(
            Dst),
        "i"(Src1), "i"(Src2));
  }
};
#endif

// The emulated tiles: any CPU, per thread (amx_emulator.h).
struct EmulatedTiles {
  static void configure(const TileConfig* config) { amx_emulator::ldtilecfg(config); }
  static void release() { amx_emulator::tilerelease(); }
  template <int T>
  static void load(const void* base, int64_t stride) {
    amx_emulator::tileloadd(T, base, stride);
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    amx_emulator::tilestored(T, base, stride);
  }
  template <int T>
  static void zero() {
    amx_emulator::tilezero(T);
  }
  template <int Dst, int Src1, int Src2>
  static void dpbf16ps() {
    amx_emulator::tdpbf16ps(Dst, Src1, Src2);
  }
};

}  // namespace qkv::kernels::amx
