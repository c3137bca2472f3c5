// Matrix products with bfloat16 operands and float32 accumulation, the block
// products of bf16 scaled dot-product attention. On CPUs with AVX-512 BF16
// (vdpbf16ps: two bf16 products per float lane per instruction) a
// register-blocked micro-kernel; elsewhere the operands are widened to float
// and multiplied by the float path. Chosen at run time.
#pragma once

#include <cstddef>
#include <cstdint>

#include "qkv/bfloat16.h"

namespace qkv::kernels::fast {

// Row-major C (m x n, float) = alpha * op(A) op(B) + beta * C, single-threaded.
// op(A) is m x k (A stored k x m when trans_a), op(B) is k x n (stored n x k
// when trans_b). beta = 0 overwrites C without reading it. m, n or k may be 0.
// `scratch` holds gemm_bf16_scratch_words(m, n, k) doubles (any alignment:
// the operands packed, or widened to float, are cut 64-byte aligned from it).
size_t gemm_bf16_scratch_words(int64_t m, int64_t n, int64_t k);
void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
               const bfloat16* a, int64_t lda, const bfloat16* b, int64_t ldb, float beta, float* c,
               int64_t ldc, double* scratch);

// op(B) packed once for several products with different A (one key block of
// K or V against every query block of attention), in the layout of the path
// gemm runs on. A view: the packed words or floats live in the caller's
// storage (pack_b_bf16_words doubles, any alignment). Fields are the
// implementation's.
struct PackedBf16 {
  int64_t n = 0, k = 0;             // op(B) is k x n
  int64_t kp = 0;                   // native paths: pairs of k per panel row, padded
  int path = 0;                     // the path it was packed for
  const uint32_t* words = nullptr;  // native paths: 16-column panels of kp x 16 words
  const float* wide = nullptr;      // widening path: op(B) as float, k x n
};
size_t pack_b_bf16_words(int64_t n, int64_t k);
PackedBf16 pack_b_bf16(bool trans_b, int64_t n, int64_t k, const bfloat16* b, int64_t ldb,
                       double* storage);

// C (m x b.n) = alpha * A B + beta * C with A row-major m x b.k (lda) and B
// packed by pack_b_bf16: the same result as gemm_bf16(false, trans_b, ...) on the
// unpacked B, bit for bit. `scratch`: gemm_bf16_packed_scratch_words(m, b.k)
// doubles, for A.
size_t gemm_bf16_packed_scratch_words(int64_t m, int64_t k);
void gemm_bf16(int64_t m, float alpha, const bfloat16* a, int64_t lda, const PackedBf16& b,
               float beta, float* c, int64_t ldc, double* scratch);

// out[i] = bfloat16(x[i]) (round to nearest even); the way back is
// vecmath.h's to_float.
void to_bf16(const float* x, bfloat16* out, int64_t n);

// The AMX tiles the bf16 products run on now: none, the instructions (bf16_path
// "amx") or the tile emulator ("amx_emulated", forced by a test); and those an
// operand packed by pack_b_bf16 was made for (its words are then panels of 16
// columns, kp rows of 16 words: a tile row per pair of k, as
// amx_attention.cc loads them).
enum class AmxTiles { kNone, kNative, kEmulated };
AmxTiles bf16_amx_tiles();
AmxTiles amx_tiles_of(const PackedBf16& packed);

// True when gemm_bf16 runs on the AVX-512 BF16 instructions.
bool bf16_native();
// The path the bf16 products take now: "amx", "avx512_bf16" or "widen"
// (bf16 widened to float32 for the float32 kernels).
const char* bf16_path();
// Why that path, in a few words (qkv info): e.g. on an Intel CPU with
// AVX512_BF16 but no AMX the float32 kernels are faster than VDPBF16PS.
const char* bf16_path_reason();

}  // namespace qkv::kernels::fast
