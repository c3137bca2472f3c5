// Vectorised row primitives for the fast kernels: Google Highway, compiled for
// every x86 target (SSE4 .. AVX-512) and dispatched at run time to the best
// one the CPU has. Each works on n contiguous elements; sums run in a fixed
// lane order, so a row's result never depends on the thread computing it.
#pragma once

#include <cstdint>

namespace qkv::vecmath {

// max of x[0..n); *all_finite is false if any element is NaN or ±inf (then
// the max is meaningless and the caller takes its careful scalar path).
float max_of(const float* x, int64_t n, bool* all_finite);
double max_of(const double* x, int64_t n, bool* all_finite);

// out[j] = exp(x[j] - shift); returns the sum of out. out may alias x.
float exp_shift_sum(const float* x, float shift, float* out, int64_t n);
double exp_shift_sum(const double* x, double shift, double* out, int64_t n);

// x[j] *= s.
void scale(float* x, float s, int64_t n);
void scale(double* x, double s, int64_t n);

// sum_j a[j] * b[j].
float dot(const float* a, const float* b, int64_t n);
double dot(const double* a, const double* b, int64_t n);

// out[j] = w[j] * (g[j] - c): the softmax backward for one row.
void softmax_grad(const float* w, const float* g, float c, float* out, int64_t n);
void softmax_grad(const double* w, const double* g, double c, double* out, int64_t n);

// The additive score sum_h wv[h] * tanh(fq[h] + fk[h]).
float additive_score(const float* fq, const float* fk, const float* wv, int64_t h);
double additive_score(const double* fq, const double* fk, const double* wv, int64_t h);

// With t = tanh(fq + fk): d_f[h] += ds * wv[h] * (1 - t[h]^2), and if d_wv is
// not null, d_wv[h] += ds * t[h].
void additive_score_grad(const float* fq, const float* fk, const float* wv, int64_t h, float ds,
                         float* d_f, float* d_wv);
void additive_score_grad(const double* fq, const double* fk, const double* wv, int64_t h, double ds,
                         double* d_f, double* d_wv);

}  // namespace qkv::vecmath
