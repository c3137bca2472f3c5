// Fused attention for small feature sizes (D <= kSmallDimMaxDim, Dv <= kSmallDimMaxValueDim):
// scores formed in SIMD registers, never stored, softmax in two passes per
// query (max, then exp-sum and the weighted sum of values). BLAS block
// products cannot reach a useful rate at D = 1..8, where the exp dominates;
// this serves scaled dot-product attention with small heads and the exact
// Gaussian Nadaraya-Watson estimator (kernel_regression.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/kernels.h"
#include "kernels/runtime/workspace.h"

namespace qkv::kernels::fast {

inline constexpr int64_t kSmallDimMaxDim = 8;
inline constexpr int64_t kSmallDimMaxValueDim = 8;

enum class ScoreKind {
  // score[i, j] = config.scale * (q_i . k_j) + key_bias[j] (key_bias may be null)
  kDotProduct,
  // score[i, j] = -config.scale * |q_i - k_j|^2, formed from the differences
  // (no cancellation: the Gaussian kernel's exponent at any bandwidth);
  // config.scale must be positive and finite
  kNegSquaredDistance,
};

// True when small_dim_forward() below serves a problem with these sizes and options:
// D <= kSmallDimMaxDim, Dv <= kSmallDimMaxValueDim, no dropout.
bool small_dim_applies(int64_t d, int64_t dv, const AttentionConfig& config);

// q: (B, Nq, D)   k: (B, Nk, D)   v: (B, Nk, Dv)   all contiguous
// key_bias: (B, Nk) contiguous or null (kDotProduct only)
// output: (B, Nq, Dv)   lse: (B, Nq) or null data
// Valid lengths as everywhere (1-D or 2-D; keys past a query's length are
// never read for it); DESIGN.md §3's rules for empty and non-finite rows.
// Results do not depend on the thread count.
// Scratch (Workspace, workspace.h): feature-major, zero-padded copies of the
// keys and values (and of key_bias when given), about the inputs' size.
template <class T>
size_t small_dim_workspace_size(int64_t batch, int64_t nk, int64_t d, int64_t dv, bool key_bias);
template <class T>
void small_dim_forward(ConstView<T> q, ConstView<T> k, ConstView<T> v, const T* key_bias,
                       ScoreKind kind, const AttentionConfig& config, TensorView<T> output,
                       TensorView<T> lse, Workspace workspace);

// out[i] = exp(x[i]) by the kernel's exp (kernels/simd/exp-inl.h) on this run's
// SIMD target, for x[i] <= ~0: below -708 (float: -87), incl. -inf, exactly
// 0; NaN stays NaN. For the tests of its error and the benchmark of its cost
// (bench_nw_exact). out may alias x.
void exp_non_positive(const float* x, float* out, int64_t n);
void exp_non_positive(const double* x, double* out, int64_t n);

}  // namespace qkv::kernels::fast
