// Vectorised row primitives for the fast kernels: Google Highway, compiled for
// every x86 target (SSE4 .. AVX-512) and dispatched at run time to the best
// one the CPU has. Each works on n contiguous elements; sums run in a fixed
// lane order, so a row's result never depends on the thread computing it.
#pragma once

#include <cstdint>

#include "qkv/bfloat16.h"

namespace qkv::kernels::fast {

// max of x[0..n) (-inf when n = 0); *nan_or_plus_inf is true if some
// element is NaN or +inf (then the max is meaningless and the caller takes
// its exact scalar path). -inf is an ordinary element: its weight is exactly
// 0 on the fast exp (kernels/simd/row_max-inl.h, the same pass as the online
// softmax tile's).
float max_of(const float* x, int64_t n, bool* nan_or_plus_inf);
double max_of(const double* x, int64_t n, bool* nan_or_plus_inf);

// out[j] = exp(x[j] - shift); returns the sum of out. out may alias x.
// float: for softmax rows, x[j] - shift <= 0 up to rounding (kernels/simd/exp-inl.h:
// a few ulp, results below 2^-126 are 0); double: any argument (hn::Exp).
float exp_shift_sum(const float* x, float shift, float* out, int64_t n);
double exp_shift_sum(const double* x, double shift, double* out, int64_t n);

// FlashAttention's softcap of a row of scores: x[j] = cap tanh(x[j] / cap),
// and grad[j] = 1 - tanh(x[j] / cap)^2 where grad is not null (the
// backward's d x_new / d x); about as exact as float32 torch's (vecmath.cc).
// Every element alike, tail included, so a score's bits do not depend on the
// tile it falls in.
void softcap(float* x, double cap, float* grad, int64_t n);
void softcap(double* x, double cap, double* grad, int64_t n);

// x[j] *= s.
void scale(float* x, float s, int64_t n);
void scale(double* x, double s, int64_t n);

// x[r][j] = x[r][j] * factor[r] + y[r][j] for rows r < rows, j < n (rows
// ldx and ldy apart): an online softmax's output rescaled and a block's sum
// added, one multiply-add per element (fused where the target has FMA).
void scale_add_rows(float* x, int64_t ldx, const float* factor, const float* y, int64_t ldy,
                    int64_t rows, int64_t n);

// x[j] += y[j] (a bias row added to a row of scores).
void add(float* x, const float* y, int64_t n);
void add(double* x, const double* y, int64_t n);

// sum[j] += x[j] with Kahan's compensation: lost[j] keeps what each addition
// lost (start it at 0; scale it with sum) and gives it back at the next.
void add_compensated(float* sum, float* lost, const float* x, int64_t n);
void add_compensated(double* sum, double* lost, const double* x, int64_t n);

// sum_j a[j] * b[j].
float dot(const float* a, const float* b, int64_t n);
double dot(const double* a, const double* b, int64_t n);

// out[j] = w[j] * (g[j] - c): the softmax backward for one row.
void softmax_grad(const float* w, const float* g, float c, float* out, int64_t n);
void softmax_grad(const double* w, const double* g, double c, double* out, int64_t n);

// out[j] = float(x[j]), exact (a bf16's bits are a float's upper half).
void to_float(const bfloat16* x, float* out, int64_t n);
// The rows x cols matrix x (leading dimension ld) as contiguous floats.
inline void widen_rows(const bfloat16* x, int64_t ld, int64_t rows, int64_t cols, float* out) {
  for (int64_t r = 0; r < rows; ++r) to_float(x + r * ld, out + r * cols, cols);
}

// ---- memory-bound masked softmax --------------------------------------------

// The softmax of one row for the memory-bound op: x[0, len) is read from
// memory once (the max pass), exp(x - max) goes to scratch (len elements,
// stays in L1), and w[0, n) is written once: w[j] = scratch[j] / sum for
// j < len, 0 past it. With `stream` the writes bypass the cache
// (non-temporal stores), which saves reading w's lines before writing them.
// Returns the log-sum-exp; returns NaN without writing anything when x[0,
// len) holds NaN or +inf, or only -inf (the caller applies DESIGN.md §3
// then); a -inf among finite scores gets weight exactly 0 here. len >= 1.
float softmax_row_once(const float* x, int64_t len, int64_t n, float* w, float* scratch,
                       bool stream);
double softmax_row_once(const double* x, int64_t len, int64_t n, double* w, double* scratch,
                        bool stream);

// The softmax backward of one row in one read of w and g: out[j] = w[j] (g[j]
// - sum_j' w[j'] g[j']) for j < len, 0 for len <= j < n; `stream` as above.
void softmax_grad_row_once(const float* w, const float* g, int64_t len, int64_t n, float* out,
                           bool stream);
void softmax_grad_row_once(const double* w, const double* g, int64_t len, int64_t n, double* out,
                           bool stream);

// Makes non-temporal stores of this thread visible to others: call once
// after a task's last streaming store.
void flush_streams();

}  // namespace qkv::kernels::fast
