// Nadaraya–Watson regression, reference version: plain loops in double, any
// kernel, the Gaussian in softmax form (DESIGN.md §3). The spec the fast
// version (nadaraya_watson_fast.cc) is held to. Also the evaluation of a
// Gaussian row from exact score differences that both versions use for rows
// far from every key, where float64 scores round or overflow.
#include <algorithm>
#include <cassert>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/regression/nadaraya_watson.h"

namespace qkv::kernels {

bool differences_fit(const double* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (!(std::abs(v[i]) < 0x1p1023)) return false;
  }
  return true;
}

namespace {

// v = m 2^e with |m| in [1/2, 1), or m = 0.
struct Split {
  double m;
  int e;
};

Split split(double v) {
  int e = 0;
  const double m = std::frexp(v, &e);
  return {m, e};
}

// a - b = hi + lo exactly (Knuth's TwoSum with -b); lo is NaN if hi overflowed.
struct TwoDiff {
  double hi, lo;
};
TwoDiff two_diff(double a, double b) {
  const double s = a - b;
  const double bb = s - a;
  return {s, (a - (s - bb)) - (b + bb)};
}

// a - b, from quarters when it overflows: then |a| + |b| > DBL_MAX, both
// exceed 2^970 and their quarters are exact.
Split diff(double a, double b) {
  const double v = a - b;
  if (std::isfinite(v)) return split(v);
  Split s = split(0.25 * a - 0.25 * b);
  s.e += 2;
  return s;
}

// (q - x) + (q - xa) from exact differences (a relative error of a few ulps
// however far q is), from quarters when a step overflows (a small operand's
// quarter is off by < 2^-1075, nothing next to a sum beyond 2^1022).
Split diff_sum(double q, double x, double xa) {
  const TwoDiff qx = two_diff(q, x), qa = two_diff(q, xa);
  const double v = (qx.hi + qa.hi) + (qx.lo + qa.lo);
  if (std::isfinite(v)) return split(v);
  const TwoDiff qx4 = two_diff(0.25 * q, 0.25 * x), qa4 = two_diff(0.25 * q, 0.25 * xa);
  Split s = split((qx4.hi + qa4.hi) + (qx4.lo + qa4.lo));
  s.e += 2;
  return s;
}

// (D_j - D_a) / 2 for keys xj, xa (strided by fs) and query q: the terms
// (xa_c - xj_c) inv_h_c ((q_c - xj_c) + (q_c - xa_c)) inv_h_c / 2 as
// mantissa products (in [1/16, 1)) and exponent sums, added at the largest
// exponent (two passes over the features); +-inf when the sum overflows.
double half_gap(const NwData& d, const double* xj, const double* xa, int64_t fs, const double* q) {
  const auto term = [&](int64_t c, int* e) {
    const Split a = diff(xa[c * fs], xj[c * fs]);
    if (a.m == 0.0) return 0.0;
    const Split b = diff_sum(q[c], xj[c * fs], xa[c * fs]);
    const Split ih = split(d.inv_h[c]);
    *e = a.e + b.e + 2 * ih.e - 1;
    return a.m * b.m * ih.m * ih.m;
  };
  int e_max = INT_MIN;
  for (int64_t c = 0; c < d.p; ++c) {
    int e = 0;
    if (term(c, &e) != 0.0) e_max = std::max(e_max, e);
  }
  if (e_max == INT_MIN) return 0.0;
  double sum = 0.0;
  for (int64_t c = 0; c < d.p; ++c) {
    int e = 0;
    const double m = term(c, &e);
    if (m != 0.0) sum += std::ldexp(m, e - e_max);
  }
  return std::ldexp(sum, e_max);
}

// |v| = m 2^e with m in [1/2, 1): from the bits for a normal v (a few
// instructions, where frexp is a call), frexp for 0 and subnormals.
double mantissa(double v, int* e) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof bits);
  const int biased = static_cast<int>((bits >> 52) & 0x7ff);
  if (biased == 0) return std::abs(std::frexp(v, e));
  *e = biased - 1022;
  bits = (bits & ((uint64_t{1} << 52) - 1)) | (uint64_t{1022} << 52);
  double m = 0.0;
  std::memcpy(&m, &bits, sizeof m);
  return m;
}

// 2^k, 0 below the normal range and +inf above it (exact in between).
double pow2(int k) {
  if (k < -1022) return 0.0;
  if (k > 1023) return std::numeric_limits<double>::infinity();
  const uint64_t bits = static_cast<uint64_t>(k + 1023) << 52;
  double v = 0.0;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// The squared distances D_j 4^-e into w (key `skip` +inf), for rows whose
// float64 D overflowed (no difference overflows: the caller prunes only
// then): u_jc = m 2^k from the mantissas of q_c - x_jc and inv_h_c, e the
// smallest over keys of the largest k (so the nearest key's scaled D lies
// in [2^-4, p], others overflow only when truly beyond DBL_MAX 4^e), terms
// below 2^-1022 dropped (next to a nearest D of at least 2^-4). Returns
// the smallest scaled D.
double scaled_squared_distances(const NwData& d, const double* x, int64_t key_stride,
                                int64_t feature_stride, const double* q, int64_t skip, double* w) {
  const auto diff = [&](int64_t j, int64_t c) {
    return q[c] - x[j * key_stride + c * feature_stride];
  };
  int e_min = INT_MAX;
  for (int64_t j = 0; j < d.n; ++j) {
    if (j == skip) continue;
    int e_key = INT_MIN;
    for (int64_t c = 0; c < d.p; ++c) {
      const double v = diff(j, c);
      int e_d = 0, e_i = 0;
      if (v == 0.0 || d.inv_h[c] == 0.0) continue;
      mantissa(v, &e_d);
      mantissa(d.inv_h[c], &e_i);
      e_key = std::max(e_key, e_d + e_i);
    }
    e_min = std::min(e_min, e_key);
  }
  const int e = std::max(0, e_min == INT_MAX ? 0 : e_min);
  double d_min = std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < d.n; ++j) {
    if (j == skip) {
      w[j] = std::numeric_limits<double>::infinity();
      continue;
    }
    double s = 0.0;
    for (int64_t c = 0; c < d.p; ++c) {
      int e_d = 0, e_i = 0;
      const double m = mantissa(diff(j, c), &e_d) * mantissa(d.inv_h[c], &e_i);
      s += m * m * pow2(2 * (e_d + e_i - e));
    }
    w[j] = s;
    d_min = std::min(d_min, s);
  }
  return d_min;
}

}  // namespace

double gaussian_row_far(const NwData& d, const double* x, int64_t key_stride,
                        int64_t feature_stride, const double* q, int64_t skip, bool prune,
                        double* w) {
  const auto key = [&](int64_t j) { return x + j * key_stride; };
  const double inf = std::numeric_limits<double>::infinity();
  // With pruning, w first holds the float64 squared distances D'_j. Each has
  // a relative error below eps = (p + 8) 2^-52 (1/h, the difference, u and
  // u^2 rounded once each, p terms summed), so a key with D'_j above
  // (1 + eps) (1500 + D'_min (1 + 2 eps)) is more than 1500 beyond the
  // nearest in exact terms: weight exp(-750), 0 in float64. Only the rest,
  // the near-ties, go through the exact passes. (No pruning when a
  // difference may overflow, or once the bound nears the overflow.)
  double bound = inf;
  if (prune) {
    double d_min = inf;
    for (int64_t j = 0; j < d.n; ++j) {
      double s = 0.0;
      for (int64_t c = 0; c < d.p; ++c) {
        const double u = (q[c] - key(j)[c * feature_stride]) * d.inv_h[c];
        s += u * u;
      }
      w[j] = j == skip ? inf : s;
      d_min = std::min(d_min, w[j]);
    }
    const double eps = static_cast<double>(d.p + 8) * 0x1p-52;
    bound = (1 + eps) * (1500 + d_min * (1 + 2 * eps));
    if (d_min == inf) {
      // Every D'_j overflowed: the same bound on D scaled by 4^-e, where
      // 1500 4^-e is below the rounding of D'_min (D_min > DBL_MAX).
      d_min = scaled_squared_distances(d, x, key_stride, feature_stride, q, skip, w);
      bound = (1 + eps) * d_min * (1 + 2 * eps) * (1 + 1e-12);
    }
    if (!(bound < 0x1p1020)) bound = inf;
  }
  const auto candidate = [&](int64_t j) { return j != skip && (!prune || w[j] <= bound); };
  int64_t a = -1;
  for (int64_t j = 0; j < d.n; ++j) {
    if (!candidate(j)) continue;
    if (a < 0 || half_gap(d, key(j), key(a), feature_stride, q) < 0.0) a = j;
  }
  if (a < 0) {  // no key left
    std::fill(w, w + d.n, 0.0);
    return 0.0;
  }
  double sum = 0.0;
  for (int64_t j = 0; j < d.n; ++j) {
    w[j] = candidate(j) ? std::exp(-half_gap(d, key(j), key(a), feature_stride, q)) : 0.0;
    sum += w[j];
  }
  return sum;
}

}  // namespace qkv::kernels

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

// One row of weights (n).
size_t nadaraya_watson_workspace_size(const NwData& d, int64_t, int) {
  return static_cast<size_t>(d.n);
}

// q: (t, p)   x: (n, p)   y: (n, m)   ->   out: (t, m), weights: (t, n) or null
int64_t nadaraya_watson(const NwData& d, const double* q, int64_t t, double* out, double* weights,
                        Workspace workspace) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  double* const w = workspace.data;  // (n)
  int64_t undefined = 0;
  for (int64_t i = 0; i < t; ++i) {
    const double* qi = q + i * d.p;
    double sum = 0.0;
    if (d.kernel == Kernel::kGaussian) {
      // softmax of s_j = -sum_c u_c^2 / 2: the largest score's weight is 1.
      double smax = -std::numeric_limits<double>::infinity();
      bool overflow = false;  // a difference q_c - x_jc beyond DBL_MAX
      for (int64_t j = 0; j < d.n; ++j) {
        double s = 0.0;
        for (int64_t c = 0; c < d.p; ++c) {
          const double diff = qi[c] - d.x[j * d.p + c];
          overflow = overflow || !std::isfinite(diff);
          const double u = diff * d.inv_h[c];
          s -= 0.5 * u * u;
        }
        w[j] = s;
        smax = std::max(smax, s);
      }
      if (!overflow && smax > -std::numeric_limits<double>::infinity()) {
        for (int64_t j = 0; j < d.n; ++j) {
          w[j] = std::exp(w[j] - smax);
          sum += w[j];
        }
      }
      // Every score overflowed (-inf - -inf would be NaN), a difference did
      // (its key's weight need not be 0), or the row is far from every key.
      if (overflow || !(smax + std::log(sum) >= kFarRowLse)) {
        sum = gaussian_row_far(d, d.x, d.p, 1, qi, -1, !overflow, w);
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
    if (weights) std::copy(w, w + d.n, weights + i * d.n);
  }
  return undefined;
}

}  // namespace qkv::kernels::ref
