// Fast 1-D Gaussian Nadaraya–Watson regression (DESIGN.md §3, issue #3 "Scale"):
// O(n + t) work up to logs for n keys and t queries, with a guaranteed relative
// error. Algorithms, bounds and measured figures: docs/regression-fast-path.md.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/runtime/workspace.h"
#include "qkv/kernel_regression_types.h"

namespace qkv::kernels::fast {

// Whether gauss1d serves this problem: the Gaussian kernel on one feature.
// Other kernels and dimensions take the exact kernels (nadaraya_watson.h).
inline bool gauss1d_supports(Kernel kernel, int64_t num_features) {
  return kernel == Kernel::kGaussian && num_features == 1;
}

// Gaussian Nadaraya–Watson in 1-D, softmax form: out[i, c] = sum_j w_ij values[j, c] / sum_j w_ij,
// w_ij = exp(-(queries[i] - keys[j])^2 / (2 h^2)). keys sorted ascending (n >= 1), values (n x m)
// row-major in the same order, queries (t) any order, out (t x m). Max relative error <= rel_tol
// (relative to sum_j w_ij |values[j,c]| / sum_j w_ij) against exact float64 evaluation.
// Returns the name of the method used ("window", "taylor", "exact").
//
// The weights are taken relative to each query's largest weight (its nearest
// key), so a query far from every key returns its nearest keys' values, never
// NaN; a query at +-inf returns the extreme key's (mean over its duplicates),
// a NaN query NaN. Keys and queries anywhere in the double range: with
// coordinates beyond 2^1020, or h below 2^-1020 of the largest, the
// exponents are formed without overflow (see the .cc). Guarantee, for finite
// sorted keys, finite values (n max |v| <= DBL_MAX), any normal h (>=
// 2.2250738585072014e-308), n <= 10^7 and rel_tol in [1e-9, 1): every output satisfies
// |out - exact| <= rel_tol * sum_j w_ij |values[j,c]| / sum_j w_ij, where exact is
// the float64 softmax-form evaluation. The dropped keys and the Taylor
// remainder account for at most rel_tol / 2 (derivation in the doc); float64
// rounding (below 1e-10 by analysis, about 1e-15 measured) has the other half;
// for rel_tol in [1e-12, 1e-9) only the analytic half is proven. rel_tol < 1e-12
// (or NaN), n <= 32 or n * t <= 65536 take the exact path.
// Deterministic for any thread count; throws nothing.
//
// Scratch: allocates nothing. The caller asks gauss1d_workspace_size, with the
// same keys, queries, h, rel_tol and the thread count, and hands in a
// Workspace of that many doubles (any 8-byte alignment). The query does the
// cheap part of the kernel's set-up again: a pass over the queries (their
// range decides a 1/16 rescaling) and, when the fast paths may build Taylor
// boxes, counting them (O(boxes log n)). Its size, for t queries, n keys, m
// value columns, B boxes, P Taylor terms (P = 19 at n = 10^6 and rel_tol =
// 1e-7; at most 60) and T threads, in doubles, plus up to 9 words of
// alignment slack per slice:
//   4 t          the sorted (query, position) pairs and their merge (2 t on
//                the exact path)
//   n + t        the keys and queries at 1/16 (only for coordinates beyond
//                2^1020)
//   m + t / 256  the sums of |values|, a count per task
//   n / 2 + B ((m + 1) P + 3) + T 2 (m + 1) P
//                the boxes, only when the Taylor path is taken, which needs
//                B <= n / 12 and B P <= 2 n: the moments are at most 2 (m + 1) n
//   T (max(1024, B) + B + max(m, B) + m + 1)
//                a query's exponents, weights and sums per thread
// At n = t = 10^6, m = 1, T = 2, h = 0.01 x spread (B = 200): 36 MB, of which
// 32 MB the sorted queries, 4 MB the keys' box numbers and 0.06 MB the
// moments (h = 0.001 x spread, B = 2000: 36.8 MB).
size_t gauss1d_workspace_size(const double* keys, int64_t n, int64_t m, const double* queries,
                              int64_t t, double h, double rel_tol, int num_threads);
// gauss1d's weight_sums (t), when not null, gets each query's W = sum_j w_ij with the
// weights relative to its nearest key's (so W >= 1; the count of the extreme
// key's copies for a query at +-inf, NaN for a NaN query), within the same
// relative perturbation as the two sums the output divides: what
// leave-one-out estimates at the keys need (KernelRegression's fast cv:
// f_{-i}(x_i) = (out_i W_i - y_i) / (W_i - 1), the query x_i's own weight 1).
const char* gauss1d(const double* keys, const double* values, int64_t n, int64_t m,
                    const double* queries, int64_t t, double h, double rel_tol, double* out,
                    Workspace workspace, double* weight_sums = nullptr);

}  // namespace qkv::kernels::fast
