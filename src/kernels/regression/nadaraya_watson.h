// Nadaraya–Watson kernel regression kernels (DESIGN.md §3): exact evaluation
// in two versions with one contract, ref (plain loops, double, the spec) and
// fast (SIMD + threads), plus the leave-one-out objective with its analytic
// gradient (fast only). Front end: src/regression/kernel_regression.cc; kernels only
// assert. Kernels allocate nothing: each op's scratch is sized by its
// *_workspace_size function for the threads the call may use and handed in
// (Workspace, kernels/runtime/workspace.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/runtime/workspace.h"
#include "qkv/kernel_regression_types.h"

namespace qkv::kernels {

// Training data and the kernel: keys x (n, p) and values y (n, m), row-major
// and contiguous; inv_h (p) the inverse bandwidths 1 / h_c (0 allowed: that
// feature is ignored, h = inf). Scores u_c = (q_c - x_c) * inv_h_c.
struct NwData {
  const double* x = nullptr;
  const double* y = nullptr;
  int64_t n = 0, p = 0, m = 0;
  const double* inv_h = nullptr;
  Kernel kernel = Kernel::kGaussian;
};

// q: (t, p)   out: (t, m)   weights: (t, n) or null (not wanted)
// Gaussian rows are softmax(-sum_c u_c^2 / 2) for any finite q, x and inv_h:
// scores are float64 sums; a row where they overflow is evaluated by
// gaussian_row_far below, so a query far from every key gets its nearest
// keys' values and a Gaussian row is never NaN (n >= 1). Compact rows are
// prod_c k(u_c) / sum, or NaN (weights and out) when the sum is 0.
// Returns the number of NaN rows. The fast version covers every input.
namespace ref {
size_t nadaraya_watson_workspace_size(const NwData& data, int64_t t, int num_threads);
int64_t nadaraya_watson(const NwData& data, const double* q, int64_t t, double* out,
                        double* weights, Workspace workspace);
}  // namespace ref
namespace fast {
size_t nadaraya_watson_workspace_size(const NwData& data, int64_t t, int num_threads);
int64_t nadaraya_watson(const NwData& data, const double* q, int64_t t, double* out,
                        double* weights, Workspace workspace);
}  // namespace fast

// True if every |v[i]| of the n values is below 2^1023, so that no
// difference of two of them overflows (|a - b| <= DBL_MAX).
bool differences_fit(const double* v, int64_t n);

// Gaussian rows whose log-sum-exp is below this (every key more than
// sqrt(2^30) = 32768 bandwidths away: float64 scores ~ -2^29 carry a
// rounding of ~2^-23, enough to move weight between near-tied keys) or not
// finite (scores overflowed) are evaluated by gaussian_row_far. Rows of
// ordinary queries never come near it.
inline constexpr double kFarRowLse = -0x1p29;

// The Gaussian row of query q (p) from exact score differences, for rows
// far from every key or whose float64 scores overflow: relative to a key a,
// (D_j - D_a) / 2 = sum_c (x_ac - x_jc) (2 q_c - x_jc - x_ac) inv_h_c^2 / 2,
// the second factor from exact two-term differences (TwoSum), every factor
// split into mantissa and power of two and the terms summed at the largest
// power, so nothing overflows for any finite q, x and inv_h (a difference
// that overflows is formed from quarters, exact there). A first pass finds
// the nearest key a by the sign of that difference; then
// w[j] = exp(-(D_j - D_a) / 2), w[a] = 1: a query 1e308 away from keys
// 0 and 5 gets the nearer one's value, where float64 distances tie. Key j,
// feature c is x[j * key_stride + c * feature_stride]; key `skip` (none if
// < 0) gets weight 0. Returns sum_j w[j] (0 when no key is left).
// prune (only where no difference q_c - x_jc overflows): a float64 pass
// over the squared distances first, so that only keys within rounding of
// the nearest plus 1500 (weight exp(-750) and below are 0) take the exact
// passes; a row then costs about a plain row plus its near-ties.
double gaussian_row_far(const NwData& d, const double* x, int64_t key_stride,
                        int64_t feature_stride, const double* q, int64_t skip, bool prune,
                        double* w);

// The leave-one-out sums: f_{-i}(x_i) from the other n - 1 points.
struct LooSums {
  double sum_sq = 0;    // sum over defined i of ||f_{-i}(x_i) - y_i||^2
  int64_t defined = 0;  // points whose leave-one-out estimate is defined
};

namespace fast {

// O(n^2 p), threaded over blocks of points, deterministic. With `gradient`
// (p, written; Gaussian only; every point is defined when n >= 2), the
// derivative through the scores s_ij = -sum_c E_ijc v_c / 2,
// E_ijc = (x_ic - x_jc)^2, v_c = inv_h_c^2. With a_ij the leave-one-out
// softmax weights (a_ii = 0), f_i = f_{-i}(x_i) and r_i = f_i - y_i,
// ds_ij / dv_c = -E_ijc / 2 gives
//   g[c] = -2 d sum_sq / d v_c = sum_i 2 r_i . sum_j a_ij E_ijc (y_j - f_i),
// a weighted covariance of E and y under each point's weights. The chain rule
// through v_c = h_c^-2 then gives d sum_sq / d log h_c = g[c] * v_c.
size_t loo_sums_workspace_size(const NwData& data, bool gradient, int num_threads);
LooSums loo_sums(const NwData& data, double* gradient, Workspace workspace);

// The same sums over points [row_begin, row_end) only, added into `total` and
// `gradient` (p; not zeroed). Both ends are multiples of loo_rows_per_task(n)
// (row_end may be n); consecutive ranges from 0 to n add the tasks' partial
// sums in the same order as one call, so a caller that cuts a call into
// ranges (to report progress between them) gets the same bits. The
// workspace is loo_sums_workspace_size's.
int64_t loo_rows_per_task(int64_t n);
void loo_sums_rows(const NwData& data, int64_t row_begin, int64_t row_end, double* gradient,
                   LooSums& total, Workspace workspace);

// The chapter's parametric loss sum_i ||f_{-i}(x_i) - y_i||^2 with scores
// -w^2 ||x_i - x_j||^2 / 2 and d loss / d w (ds_ij / dw = -w ||x_i - x_j||^2);
// x (n, p), y (n, m) contiguous, n >= 2.
size_t parametric_loss_workspace_size(int64_t n, int64_t p, int64_t m, bool gradient,
                                      int num_threads);
double parametric_loss(const double* x, const double* y, int64_t n, int64_t p, int64_t m, double w,
                       double* grad, Workspace workspace);

}  // namespace fast
}  // namespace qkv::kernels
