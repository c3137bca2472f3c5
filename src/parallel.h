// Threading and BLAS for the fast kernels. qkv owns the parallelism: work is
// cut into tasks whose boundaries depend only on the shapes, the tasks run on
// qkv::num_threads() OpenMP threads, and every BLAS call inside a task is
// single-threaded. So results are bitwise the same for any thread count, and
// OpenBLAS's own threads never oversubscribe our two cores.
#pragma once

#include <cstdint>

namespace qkv::detail {

// Runs body(task) for task in [0, num_tasks), in parallel when there is more
// than one thread. body must not throw.
template <class Body>
void parallel_for(int64_t num_tasks, Body&& body);

// Row-major C (m x n) = alpha * op(A) op(B) + beta * C, single-threaded.
// op(A) is m x k (A stored k x m when trans_a), op(B) is k x n (stored n x k
// when trans_b). Handles m, n or k = 0.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc);

// The same, with the rows of C split into fixed blocks computed in parallel.
template <class T>
void parallel_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
                   int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

// Makes OpenBLAS single-threaded (once per process); called before any task runs.
void init_blas_threads();
int current_num_threads();

template <class Body>
void parallel_for(int64_t num_tasks, Body&& body) {
  init_blas_threads();
  const int threads = current_num_threads();
  if (threads <= 1 || num_tasks <= 1) {
    for (int64_t t = 0; t < num_tasks; ++t) body(t);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t t = 0; t < num_tasks; ++t) body(t);
}

// Rows of C per parallel_gemm task: enough work per BLAS call to reach its
// full rate, small enough that 2 threads balance on a few hundred rows.
inline constexpr int64_t kGemmRowBlock = 64;

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

}  // namespace qkv::detail
