// Nadaraya–Watson regression, reference version: plain loops in double, any
// kernel, the Gaussian in softmax form (DESIGN.md §3). The spec the fast
// version (nadaraya_watson_fast.cc) is held to.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/nadaraya_watson.h"

namespace qkv::kernels::ref {
namespace {

// The compact profiles k(u); the Gaussian is handled by its scores.
double profile(Kernel kernel, double u) {
  const double a = std::abs(u);
  switch (kernel) {
    case Kernel::kBoxcar:
      return a <= 1.0 ? 1.0 : 0.0;
    case Kernel::kEpanechnikov:
      return a <= 1.0 ? 1.0 - u * u : 0.0;
    case Kernel::kTriangular:
      return a <= 1.0 ? 1.0 - a : 0.0;
    case Kernel::kGaussian:
      break;
  }
  assert(false);
  return 0.0;
}

}  // namespace

// q: (t, p)   x: (n, p)   y: (n, m)   ->   out: (t, m), weights: (t, n) or null
int64_t nadaraya_watson(const NwData& d, const double* q, int64_t t, double* out, double* weights) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> w(static_cast<size_t>(d.n));
  int64_t undefined = 0;
  for (int64_t i = 0; i < t; ++i) {
    const double* qi = q + i * d.p;
    double sum = 0.0;
    if (d.kernel == Kernel::kGaussian) {
      // softmax of s_j = -sum_c u_c^2 / 2: the largest score's weight is 1.
      double smax = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < d.n; ++j) {
        double s = 0.0;
        for (int64_t c = 0; c < d.p; ++c) {
          const double u = (qi[c] - d.x[j * d.p + c]) * d.inv_h[c];
          s -= 0.5 * u * u;
        }
        w[j] = s;
        smax = std::max(smax, s);
      }
      for (int64_t j = 0; j < d.n; ++j) {
        w[j] = std::exp(w[j] - smax);
        sum += w[j];
      }
    } else {
      for (int64_t j = 0; j < d.n; ++j) {
        double k = 1.0;
        for (int64_t c = 0; c < d.p; ++c) {
          k *= profile(d.kernel, (qi[c] - d.x[j * d.p + c]) * d.inv_h[c]);
        }
        w[j] = k;
        sum += k;
      }
    }
    if (sum == 0.0) {  // compact kernel, no key in reach
      ++undefined;
      for (int64_t k = 0; k < d.m; ++k) out[i * d.m + k] = nan;
      if (weights) std::fill(weights + i * d.n, weights + (i + 1) * d.n, nan);
      continue;
    }
    for (int64_t j = 0; j < d.n; ++j) w[j] /= sum;
    for (int64_t k = 0; k < d.m; ++k) {
      double acc = 0.0;
      for (int64_t j = 0; j < d.n; ++j) acc += w[j] * d.y[j * d.m + k];
      out[i * d.m + k] = acc;
    }
    if (weights) std::copy(w.begin(), w.end(), weights + i * d.n);
  }
  return undefined;
}

}  // namespace qkv::kernels::ref
