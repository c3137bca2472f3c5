// Float block products of the fused SDPA forward (sdpa_fast.cc): register-
// blocked Highway micro-kernels, compiled for every x86 target and dispatched
// at run time. bench/block_gemm_choice.cc measured this design ~1.3x faster
// than single-threaded OpenBLAS sgemm at the forward's block shapes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace qkv::kernels::fast {

// Row-major, single-threaded; m, n or k may be 0, leading dimensions may
// exceed the row lengths. Each element of C is one sum over k in increasing
// order whose grouping depends only on the shape, so the same inputs give the
// same bits on any thread (on a given SIMD target).

// Both take `pack`, scratch for packed panels of B: block_gemm_scratch_floats(k)
// floats, 64-byte aligned (kernels/runtime/workspace.h's slices are). Panels are at
// most kBlockGemmMaxPanel floats wide on every target (16 lanes x 4 vectors
// on AVX-512), so k x 64 floats: 16 KiB at k = 64.
inline constexpr int64_t kBlockGemmMaxPanel = 64;
size_t block_gemm_scratch_floats(int64_t k);

// C (m x n, ldc) = alpha * A (m x k, lda) * Bᵀ, B stored n x k (ldb).
// Overwrites C without reading it.
void block_scores(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                  const float* b, int64_t ldb, float* c, int64_t ldc, float* pack);

// C (m x n, ldc) += A (m x k, lda) * B (k x n, ldb).
void block_accumulate(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                      int64_t ldb, float* c, int64_t ldc, float* pack);

}  // namespace qkv::kernels::fast
