// BLAS calls and the OpenBLAS thread setting (see blas.h, parallel.h).
#include "kernels/blas.h"

#include <cblas.h>

#include <algorithm>
#include <mutex>

#include "qkv/threads.h"

namespace qkv::kernels {

namespace {

// The live guards and the OpenBLAS thread count before the first of them.
std::mutex blas_threads_mutex;
int blas_guards = 0;
int blas_threads_before = 1;

}  // namespace

BlasSingleThreaded::BlasSingleThreaded() {
  const std::lock_guard<std::mutex> lock(blas_threads_mutex);
  if (blas_guards++ == 0) {
    blas_threads_before = openblas_get_num_threads();
    if (blas_threads_before != 1) openblas_set_num_threads(1);
  }
}

BlasSingleThreaded::~BlasSingleThreaded() {
  const std::lock_guard<std::mutex> lock(blas_threads_mutex);
  if (--blas_guards == 0 && blas_threads_before != 1) {
    openblas_set_num_threads(blas_threads_before);
  }
}

namespace {
thread_local int serial_scopes = 0;  // live SerialScopes of this thread
}  // namespace

SerialScope::SerialScope() { ++serial_scopes; }
SerialScope::~SerialScope() { --serial_scopes; }

const char* blas_config() { return openblas_get_config(); }

int current_num_threads() { return serial_scopes > 0 ? 1 : qkv::num_threads(); }

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
