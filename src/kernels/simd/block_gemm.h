// Float block products of the fused SDPA forward (sdpa_fast.cc): register-
// blocked Highway micro-kernels, compiled for every x86 target and dispatched
// at run time. bench/block_gemm_choice.cc measured this design ~1.3x faster
// than single-threaded OpenBLAS sgemm at the forward's block shapes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace qkv::kernels::fast {

// Row-major, single-threaded; m, n or k may be 0, leading dimensions may
// exceed the row lengths. Each element of C is a sum over k in increasing
// order whose grouping depends only on the shape, so the same inputs give the
// same bits on any thread (on a given SIMD target): block_scores sums each
// group of kBlockScoreGroup terms from 0 (from k = 0 on) and adds the groups'
// sums in order, then multiplies by alpha; block_accumulate sums each pass of
// up to 128 terms from 0 and adds it to C.

// Both take `pack`, scratch for packed panels of B: block_gemm_scratch_floats(k)
// floats, 64-byte aligned (kernels/runtime/workspace.h's slices are). Panels are at
// most kBlockGemmMaxPanel floats wide on every target (16 lanes x 4 vectors
// on AVX-512), so k x 64 floats: 16 KiB at k = 64.
inline constexpr int64_t kBlockGemmMaxPanel = 64;
size_t block_gemm_scratch_floats(int64_t k);

// The scores' group: one FMA chain over all of d = 256 erred 1.4x torch's
// float32 einsum (which sums groups of 128 there) and failed FlashAttention's
// rule (error <= 2x torch's) in ~3 % of its cases. Root-mean-square errors
// against float64 (normal inputs, float64 emulation of the orders): groups
// of 32 err 0.41x one chain at d = 256, 0.55x at 128, 0.73x at 64; groups of
// 16 would err 0.91x, 0.85x, 0.79x of 32's, for twice the adds; 64, 1.28x
// of 32's at d = 128 and 256 and nothing at 64. tests/test_block_gemm.cc
// holds the error to the groups' model.
inline constexpr int64_t kBlockScoreGroup = 32;

// C (m x n, ldc) = alpha * A (m x k, lda) * Bᵀ, B stored n x k (ldb).
// Overwrites C without reading it.
void block_scores(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                  const float* b, int64_t ldb, float* c, int64_t ldc, float* pack);

// C (m x n, ldc) += A (m x k, lda) * B (k x n, ldb).
void block_accumulate(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                      int64_t ldb, float* c, int64_t ldc, float* pack);

}  // namespace qkv::kernels::fast
