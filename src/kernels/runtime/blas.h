// BLAS matrix products for the fast kernels, single-threaded inside a task
// (kernels/runtime/parallel.h: qkv owns the threads), and a row-blocked parallel form.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

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
// core type its kernels run now).
const char* blas_config();

// OpenBLAS's kernels for this CPU. OpenBLAS (a DYNAMIC_ARCH build, as
// Debian's) picks its kernels, a "core type", once, when it loads: from
// OPENBLAS_CORETYPE, else from the CPUs it knows. Debian 12's 0.3.21 does not
// know CPUs newer than itself and runs its Prescott (SSE3) kernels on them:
// sgemm 29 GFLOP/s per core on an Emerald Rapids Xeon, against 88-120 with
// its SkylakeX kernels. So qkv compares that choice with what the CPU runs
// and, when OpenBLAS's is older, switches OpenBLAS to the better core type
// through OpenBLAS's own entry points for it (gotoblas_dynamic_quit and
// gotoblas_dynamic_init, with OPENBLAS_CORETYPE set for the call): on this
// project's AMD EPYC (AVX-512) with OPENBLAS_CORETYPE=Haswell, 1-thread sgemm
// at n = 1024 goes from 130 to 250 GFLOP/s. It never picks an older core type.
// QKV_BLAS_CORE=keep keeps OpenBLAS's choice; QKV_BLAS_CORE=NAME (an OpenBLAS
// core type, e.g. Haswell) runs that one. A SIMD cap (set_simd_target, or
// QKV_SIMD_TARGET when the library loads) caps the core type too: avx512
// at the CPU's best, avx2 at Haswell, sse4 and scalar at what OpenBLAS chose
// as it loaded.
struct BlasCoreChoice {
  std::string found;       // the core type OpenBLAS chose when it loaded
  std::string found_from;  // "OPENBLAS_CORETYPE=..." or "OpenBLAS's CPU detection"
  std::string best;        // the best core type for this CPU under the cap ("" when none)
  std::string running;     // the core type OpenBLAS runs now
  std::string action;      // what qkv did, one sentence
  std::string unknown;     // QKV_BLAS_CORE's value when it names no core type of this OpenBLAS
};
// The choice in force. Made when the library loads (before any thread of
// the caller's can be inside the BLAS) and again by choose_blas_core.
BlasCoreChoice blas_core_choice();
// Chooses again under the SIMD cap `cap` ("" for none, else a target name:
// avx512, avx2, sse4, scalar). Call it while no BLAS call runs.
void choose_blas_core(std::string_view cap);

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
