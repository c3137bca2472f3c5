// Products of a few query rows with keys and values read in place: the block
// products of the fused SDPA forward when a task has at most kRowProductRows
// queries (decoding: one new token's query against a long cache). Highway,
// compiled for every x86 target and dispatched at run time.
//
// Why not block_gemm.h for these: it packs each block of K and V into panels
// before multiplying, which pays when a panel serves many rows but for one row
// reads and writes every key twice more than the product does; and why not
// gemm_bf16.h: without AVX-512 BF16 it widens whole blocks to float in memory.
// Here every key and value row is read once, straight from the caller's
// tensor, bf16 widened in registers. B=8, Nq=1, Nk=131072, d=64, 2 threads:
// see docs/perf-findings.md for the rates before and after.
#pragma once

#include <cstdint>

#include "qkv/bfloat16.h"

namespace qkv::kernels::fast {

// Rows a direct product handles; more go to the packed block products. Each
// key and value row is read once for all rows, and the scores sum four
// scores' lanes together instead of one horizontal sum per key
// (row_products.cc): B=1, H=Hkv=8, Nk=65536, d=128, 8 and 16 query rows per
// head ran at 10.7 and 9.1 GB/s of K and V on the packed products, at 18.0 and
// 12.9 here (AVX-512, 2 threads, medians of 5 alternating runs).
inline constexpr int64_t kRowProductRows = 16;

// s[r * lds + j] = alpha * (q_r . k_j) for r < rows <= kRowProductRows,
// j < cols: q is rows x d (rows ldq apart, in the accumulation type), k is
// cols x d (rows ldk apart, each row contiguous). Each sum runs over d in a
// fixed order that depends only on d and the SIMD target.
void row_scores(int64_t rows, int64_t cols, int64_t d, float alpha, const float* q, int64_t ldq,
                const float* k, int64_t ldk, float* s, int64_t lds);
void row_scores(int64_t rows, int64_t cols, int64_t d, float alpha, const float* q, int64_t ldq,
                const bfloat16* k, int64_t ldk, float* s, int64_t lds);
void row_scores(int64_t rows, int64_t cols, int64_t d, double alpha, const double* q, int64_t ldq,
                const double* k, int64_t ldk, double* s, int64_t lds);

// o_r += sum_j p[r * ldp + j] * v_j for r < rows <= kRowProductRows: v is
// cols x dv (rows ldv apart), o is rows x dv (rows ldo apart). The sum over j
// runs in increasing j in groups of 32 keys from the first, each group summed
// from 0 and then added to o.
void row_accumulate(int64_t rows, int64_t cols, int64_t dv, const float* p, int64_t ldp,
                    const float* v, int64_t ldv, float* o, int64_t ldo);
void row_accumulate(int64_t rows, int64_t cols, int64_t dv, const float* p, int64_t ldp,
                    const bfloat16* v, int64_t ldv, float* o, int64_t ldo);
void row_accumulate(int64_t rows, int64_t cols, int64_t dv, const double* p, int64_t ldp,
                    const double* v, int64_t ldv, double* o, int64_t ldo);

}  // namespace qkv::kernels::fast
