// Distance scores as dot products, shared by distance attention (attention.cc)
// and Gaussian scoring over a store (store_attention.cc): with c the mean of
// some keys, q' = q - c, k' = k - c,
//   -scale/2 |q - k|^2 = scale q'.k' - scale/2 |k'|^2 - scale/2 |q'|^2,
// a scaled dot product, a bias per key and a term per query (which only
// shifts the lse). Centring first keeps the products accurate when the rows
// sit far from the origin (docs/regression.md: the uncentred form cancels
// |q|^2 + |k|^2 against 2 q.k, losing |q|^2 * 2^-24 in float).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/runtime/parallel.h"

namespace qkv::kernels {

// The mean of rows [0, n) of an (n, d) matrix read by at(j, c) -> double;
// zeros when n = 0.
template <class At>
std::vector<double> row_mean(int64_t n, int64_t d, At&& at) {
  std::vector<double> mean(static_cast<size_t>(d), 0.0);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t c = 0; c < d; ++c) mean[static_cast<size_t>(c)] += at(j, c);
  }
  if (n > 0) {
    for (double& m : mean) m /= static_cast<double>(n);
  }
  return mean;
}

// Rows [0, n) of at(j, c) centred: out[j * d + c] = x[j, c] - centre[c]
// (rounded to Out) and term[j] = -scale/2 |x_j - centre|^2 (in double, then
// rounded to Term). Rows in tasks of 4096 (whole rows per task, so the bits do
// not depend on the thread count).
template <class Out, class Term, class At>
void centre_rows(int64_t n, int64_t d, At&& at, const std::vector<double>& centre, double scale,
                 Out* out, Term* term) {
  constexpr int64_t kRowsPerTask = 4096;
  parallel_for((n + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t task) {
    const int64_t end = std::min(n, (task + 1) * kRowsPerTask);
    for (int64_t j = task * kRowsPerTask; j < end; ++j) {
      double norm = 0;
      for (int64_t c = 0; c < d; ++c) {
        const double x = at(j, c) - centre[static_cast<size_t>(c)];
        out[j * d + c] = static_cast<Out>(x);
        norm += x * x;
      }
      term[j] = static_cast<Term>(-0.5 * scale * norm);
    }
  });
}

}  // namespace qkv::kernels
