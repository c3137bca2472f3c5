// BLAS matrix products for the fast kernels, single-threaded inside a task
// (kernels/runtime/parallel.h: qkv owns the threads), and a row-blocked parallel form.
#pragma once

#include <cstdint>

#include "kernels/runtime/parallel.h"

namespace qkv::kernels {

// Row-major C (m x n) = alpha * op(A) op(B) + beta * C, single-threaded.
// op(A) is m x k (A stored k x m when trans_a), op(B) is k x n (stored n x k
// when trans_b). Handles m, n or k = 0.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc);

// The BLAS's description of itself (OpenBLAS: version, build options, the
// core type its kernels were chosen for).
const char* blas_config();

// Rows of C per parallel_gemm task: enough work per BLAS call to reach its
// full rate, small enough that 2 threads balance on a few hundred rows.
inline constexpr int64_t kGemmRowBlock = 64;

// The same, with the rows of C split into fixed blocks computed in parallel.
template <class T>
void parallel_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
                   int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  const int64_t blocks = (m + kGemmRowBlock - 1) / kGemmRowBlock;
  parallel_for(blocks, [&](int64_t blk) {
    const int64_t r0 = blk * kGemmRowBlock;
    const int64_t rows = m - r0 < kGemmRowBlock ? m - r0 : kGemmRowBlock;
    const T* a_blk = trans_a ? a + r0 : a + r0 * lda;
    gemm(trans_a, trans_b, rows, n, k, alpha, a_blk, lda, b, ldb, beta, c + r0 * ldc, ldc);
  });
}

}  // namespace qkv::kernels
