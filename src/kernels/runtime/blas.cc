// BLAS calls (see blas.h); the thread setting is in parallel.cc.
#include "kernels/runtime/blas.h"

#include <cblas.h>

#include <algorithm>

namespace qkv::kernels {

const char* blas_config() { return openblas_get_config(); }

namespace {

template <class T>
bool trivial_gemm(int64_t m, int64_t n, int64_t k, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return true;
  if (k != 0) return false;
  // An empty inner product: C = beta * C (BLAS would reject lda = 0).
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == T(0) ? T(0) : beta * c[i * ldc + j];
  }
  return true;
}

// BLAS requires leading dimensions >= the row length even when a stride of a
// size-1 axis is smaller; such strides are never used for addressing.
int64_t ld(int64_t given, int64_t row_length) { return std::max<int64_t>({given, row_length, 1}); }

}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (trivial_gemm(m, n, k, beta, c, ldc)) return;
  const BlasSingleThreaded blas;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, ld(lda, trans_a ? m : k), b,
              ld(ldb, trans_b ? k : n), beta, c, ld(ldc, n));
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc) {
  if (trivial_gemm(m, n, k, beta, c, ldc)) return;
  const BlasSingleThreaded blas;
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, ld(lda, trans_a ? m : k), b,
              ld(ldb, trans_b ? k : n), beta, c, ld(ldc, n));
}

}  // namespace qkv::kernels
