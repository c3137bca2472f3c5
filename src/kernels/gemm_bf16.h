// Matrix products with bfloat16 operands and float32 accumulation, the block
// products of bf16 scaled dot-product attention. On CPUs with AVX-512 BF16
// (vdpbf16ps: two bf16 products per float lane per instruction) a
// register-blocked micro-kernel; elsewhere the operands are widened to float
// and multiplied by the float path. Chosen at run time.
#pragma once

#include <cstdint>

#include "qkv/bfloat16.h"

namespace qkv::kernels::bf16 {

// Row-major C (m x n, float) = alpha * op(A) op(B) + beta * C, single-threaded.
// op(A) is m x k (A stored k x m when trans_a), op(B) is k x n (stored n x k
// when trans_b). beta = 0 overwrites C without reading it. m, n or k may be 0.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const bfloat16* a, int64_t lda, const bfloat16* b, int64_t ldb, float beta, float* c,
          int64_t ldc);

// out[i] = bfloat16(x[i]) (round to nearest even), and back.
void to_bf16(const float* x, bfloat16* out, int64_t n);
void to_float(const bfloat16* x, float* out, int64_t n);

// True when gemm runs on the AVX-512 BF16 instructions.
bool native();

}  // namespace qkv::kernels::bf16
