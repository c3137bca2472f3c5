// Fast 1-D Gaussian Nadaraya–Watson (fast version; the exact path in this file
// is the float64 spec it is tested against). Per sorted query: a cut-off window
// of keys summed directly, or a Taylor expansion about box centres over the
// same window. Derivation of every constant: docs/regression-fast-path.md.
#include "kernels/gauss1d_fast.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "kernels/parallel.h"
#include "kernels/vecmath.h"

namespace qkv::kernels::fast {
namespace {

// Problems with n * t at most this (or n at most kExactMaxKeys) take the
// exact path: the fast paths' set-up (sorting, boxes) does not pay off there.
constexpr int64_t kExactMaxWork = int64_t{1} << 16;
constexpr int64_t kExactMaxKeys = 32;
// Sorted queries per parallel task: 256 queries of a window or Taylor
// evaluation are 0.1-1 ms of work, so 2 threads balance and tasks stay cheap.
constexpr int64_t kQueryBlock = 256;
// Keys per chunk of a direct sum: args and weights of a chunk stay in L1
// (2 x 8 KiB), and the chunk totals are added in a second level, so the
// rounding of a sum over k keys is about (1024 + k / 1024) ulps, not k.
constexpr int64_t kChunk = 1024;
// Box width in units of h. Half-width r = 0.25 h keeps z = |s| r small
// (about 2.5 for the boxes a query needs), which keeps the Taylor order near
// 20 and the cancellation factor e^{2z} of the Horner sums near 150.
constexpr double kBoxWidth = 0.5;
// Extra e-folds in the cut-off beyond ln(n / delta): makes the numerator test
// e^{-L} sum|v| <= delta |N| / 2 pass unless |out| < ~1e-5 mean|v| / W_rel.
constexpr double kCutoffMargin = 10.0;
// exp(-746) rounds to 0 in float64: keys beyond this cut-off get weight
// exactly 0 in the float64 evaluation too. The per-query fallback uses it.
constexpr double kUnderflowCutoff = 746.0;
constexpr int kMaxOrder = 60;
// Coordinates below this in magnitude, and below it in units of h, keep
// every intermediate of rel_exponent finite: differences < 2^1021, their
// sum < 2^1022, the TwoSum steps < 3 * 2^1021, the factors times inv_h
// < 2^1022. Beyond, the careful variant (and no Taylor boxes) is used.
constexpr double kPlainLimit = 0x1p1020;
// Added to the window's radii: 64 subnormal ulps, more than the rounding of
// a radius that falls in the subnormal range (or is formed from quarters
// of the coordinates), so such rounding never drops a key.
constexpr double kRadiusSlack = 0x1p-1068;

// a - b = hi + lo exactly (Knuth's TwoSum with -b).
struct TwoDiff {
  double hi;
  double lo;
};
inline TwoDiff two_diff(double a, double b) {
  const double s = a - b;
  const double bb = s - a;
  return {s, (a - (s - bb)) - (b + bb)};
}

// -log of the weight of key x relative to the nearest key xa, for query q:
//   ((q - x)^2 - (q - xa)^2) / (2 h^2) = (xa - x) (2q - x - xa) / (2 h^2).
// The second factor is formed from exact differences, so the result has a
// relative error of a few ulps even for a query 10^6 bandwidths away (the
// naive difference of squares loses everything there).
inline double rel_exponent(double x, double xa, TwoDiff qa, double q, double inv_h) {
  const TwoDiff qx = two_diff(q, x);
  const double sum = (qx.hi + qa.hi) + (qx.lo + qa.lo);
  return 0.5 * ((xa - x) * inv_h) * (sum * inv_h);
}

// The same exponent for any finite keys, query and inv_h (the calls where
// kPlainLimit does not hold). A difference or the sum that overflows is
// formed from quarters: it can only overflow when both operands exceed
// 2^970, where quarters are exact (a small third operand's quarter is off
// by < 2^-1075, nothing next to a sum > 2^1022). The factors are combined
// as magnitudes (the exponent is >= 0), overflowing to +inf (weight 0);
// x == xa or a zero sum give 0, never 0 * inf.
inline double rel_exponent_careful(double x, double xa, TwoDiff qa, double q, double inv_h) {
  if (x == xa) return 0.0;
  double a = xa - x, scale = 0.5;
  if (!std::isfinite(a)) {
    a = 0.25 * xa - 0.25 * x;
    scale *= 4.0;
  }
  const TwoDiff qx = two_diff(q, x);
  double sum = (qx.hi + qa.hi) + (qx.lo + qa.lo);  // NaN if a TwoDiff overflowed
  if (!std::isfinite(sum)) {
    const TwoDiff qx4 = two_diff(0.25 * q, 0.25 * x), qa4 = two_diff(0.25 * q, 0.25 * xa);
    sum = (qx4.hi + qa4.hi) + (qx4.lo + qa4.lo);
    scale *= 4.0;
  }
  if (sum == 0.0) return 0.0;
  return std::abs(a * inv_h) * std::abs(sum * inv_h) * scale;
}

struct Problem {
  const double* keys;
  const double* values;
  int64_t n;
  int64_t m;
  double h;
  double inv_h;
  bool careful;  // kPlainLimit does not hold: rel_exponent_careful, no Taylor boxes
};

struct Boxes {
  int64_t count = 0;
  int order = 0;                // P: Taylor terms 0 .. P-1
  double z_limit = 0;           // queries with max |s| r above it use the window
  std::vector<int64_t> first;   // first key of each box, plus n at the end
  std::vector<int32_t> of_key;  // box of each key
  std::vector<double> centre;
  std::vector<double> radius;  // max |x - centre| / h over the box, rounded up
  // coef[(col * P + k) * count + b] = sum_{x in b} v_col e^{-t^2/2} t^k / k!,
  // t = (x - centre) / h, col 0 the weights (v = 1), col 1..m the values.
  std::vector<double> coef;
};

struct Scratch {
  std::vector<double> a;  // exponents, then weights
  std::vector<double> b;
  std::vector<double> acc;
};

// W = sum_j w_j and N[c] = sum_j w_j v[j, c] over keys [lo, hi), with the
// weights relative to the nearest key xa. sums has m + 1 entries.
void window_sums(const Problem& p, double q, double xa, int64_t lo, int64_t hi, Scratch& s,
                 double* sums) {
  const int64_t m = p.m;
  std::fill(sums, sums + m + 1, 0.0);
  s.a.resize(kChunk);
  s.acc.resize(static_cast<size_t>(m));
  const TwoDiff qa = two_diff(q, xa);
  for (int64_t j0 = lo; j0 < hi; j0 += kChunk) {
    const int64_t len = std::min(kChunk, hi - j0);
    double* w = s.a.data();
    if (p.careful) {
      for (int64_t j = 0; j < len; ++j) {
        w[j] = -rel_exponent_careful(p.keys[j0 + j], xa, qa, q, p.inv_h);
      }
    } else {
      for (int64_t j = 0; j < len; ++j) w[j] = -rel_exponent(p.keys[j0 + j], xa, qa, q, p.inv_h);
    }
    sums[0] += fast::exp_shift_sum(w, 0.0, w, len);
    if (m == 1) {
      sums[1] += fast::dot(w, p.values + j0, len);
    } else {
      std::fill(s.acc.begin(), s.acc.end(), 0.0);
      const double* v = p.values + j0 * m;
      for (int64_t j = 0; j < len; ++j) {
        for (int64_t c = 0; c < m; ++c) s.acc[c] += w[j] * v[j * m + c];
      }
      for (int64_t c = 0; c < m; ++c) sums[1 + c] += s.acc[c];
    }
  }
}

// Index of a key nearest to q (the lower one on a tie).
int64_t nearest_key(const double* keys, int64_t n, double q) {
  const int64_t j = std::lower_bound(keys, keys + n, q) - keys;
  if (j == 0) return 0;
  if (j == n) return n - 1;
  return (q - keys[j - 1] <= keys[j] - q) ? j - 1 : j;
}

// Keys [lo, hi) holding every key whose relative exponent is <= cutoff (and
// a few more). Keys on xa's far side are bounded by xa -/+ delta, with
// delta (2 dmin + delta) = 2 h^2 cutoff solved without cancellation; keys
// past q by q +/- R with R^2 = dmin^2 + 2 h^2 cutoff. Rounding is monotone,
// so a key inside the exact bound is inside the rounded one; the cut-off is
// raised by 1 and the radii by 1e-12 (and kRadiusSlack) to cover the
// rounding of the radii. When 2 h^2 cutoff or dmin^2 would leave the normal
// range (h below ~1e-150 or above ~1e150, a query ~1e150 from its nearest
// key, or one beyond the coordinates' overflow), the same bounds come from
// hs = h sqrt(2 (cutoff + 1)) without squares: R = hypot(dmin, hs),
// delta = hs (hs / R) / (1 + dmin / R), formed at a quarter of the scale
// so that nothing overflows for any finite q, xa and h.
std::pair<int64_t, int64_t> window_range(const Problem& p, double q, int64_t a, double cutoff) {
  const double xa = p.keys[a];
  const double dmin = std::abs(q - xa);
  const double two_c = 2.0 * p.h * p.h * (cutoff + 1.0);
  double radius, delta;
  if (two_c >= 0x1p-1000 && two_c <= 0x1p1000 && dmin <= 0x1p500) {
    const double root = std::sqrt(dmin * dmin + two_c);
    radius = root * (1.0 + 1e-12);
    delta = two_c / (dmin + root) * (1.0 + 1e-12) + kRadiusSlack;
  } else {
    const double d4 = std::abs(0.25 * q - 0.25 * xa);
    const double hs4 = p.h * (0.25 * std::sqrt(2.0 * (cutoff + 1.0)));
    const double r4 = std::hypot(d4, hs4);
    if (!std::isfinite(r4)) return {0, p.n};  // a kernel wider than the double range
    radius = 4.0 * r4 * (1.0 + 1e-9) + kRadiusSlack;
    delta = 4.0 * (hs4 * (hs4 / r4) / (1.0 + d4 / r4)) * (1.0 + 1e-9) + kRadiusSlack;
  }
  const double* k = p.keys;
  int64_t lo, hi;
  if (q >= xa) {
    lo = std::lower_bound(k, k + a + 1, xa - delta) - k;
    hi = std::upper_bound(k + a, k + p.n, q + radius) - k;
  } else {
    lo = std::lower_bound(k, k + a + 1, q - radius) - k;
    hi = std::upper_bound(k + a, k + p.n, xa + delta) - k;
  }
  return {lo, hi};
}

// Greedy boxes of width kBoxWidth * h over the sorted keys, their Taylor
// moments, the order P and the z limit for a truncation error <= tau per key.
Boxes build_boxes(const Problem& p, double cutoff, double tau) {
  Boxes bx;
  const double width = kBoxWidth * p.h;
  for (int64_t j = 0; j < p.n;) {
    const int64_t j0 = j;
    const double end = p.keys[j0] + width;
    while (j < p.n && p.keys[j] <= end) ++j;
    bx.first.push_back(j0);
  }
  bx.count = static_cast<int64_t>(bx.first.size());
  bx.first.push_back(p.n);
  bx.of_key.resize(static_cast<size_t>(p.n));
  bx.centre.resize(static_cast<size_t>(bx.count));
  bx.radius.resize(static_cast<size_t>(bx.count));
  for (int64_t b = 0; b < bx.count; ++b) {
    const double lo = p.keys[bx.first[b]], hi = p.keys[bx.first[b + 1] - 1];
    const double c = lo + 0.5 * (hi - lo);
    bx.centre[b] = c;
    bx.radius[b] = std::max(c - lo, hi - c) * p.inv_h * (1.0 + 1e-15);
    for (int64_t j = bx.first[b]; j < bx.first[b + 1]; ++j) bx.of_key[j] = static_cast<int32_t>(b);
  }
  // A query whose nearest key is within h sees box centres up to
  // sqrt(1 + 2 (cutoff + 1)) + 1.5 width/h away, of half-width <= width/2h.
  const double reach = std::sqrt(1.0 + 2.0 * (cutoff + 1.0)) + 1.5 * kBoxWidth;
  bx.z_limit = reach * 0.5 * kBoxWidth;
  // P: smallest with z^P / P! e^z <= tau (Lagrange remainder of e^{z} relative
  // to e^{z}, worst sign). With rel_tol >= 1e-12 and n <= 2^40, z <= 3.2 and
  // P <= 32; past kMaxOrder the limit shrinks instead (queries then fall to
  // the window), so the bound holds for any tau.
  int order = 0;
  for (;;) {
    double term = std::exp(bx.z_limit);  // z^0/0! e^z
    order = 0;
    while (term > tau && order < kMaxOrder) {
      ++order;
      term *= bx.z_limit / order;
    }
    if (term <= tau) break;
    bx.z_limit *= 0.5;
  }
  bx.order = std::max(order, 1);
  const int P = bx.order;
  const int64_t cols = p.m + 1, nb = bx.count;
  bx.coef.assign(static_cast<size_t>(cols * P * nb), 0.0);
  // 64 boxes per task; inside a box, keys in blocks of 256 summed apart and
  // then added (rounding ~ (256 + keys/256) ulps instead of keys).
  constexpr int64_t kBoxesPerTask = 64, kKeyBlock = 256;
  kernels::parallel_for((nb + kBoxesPerTask - 1) / kBoxesPerTask, [&](int64_t task) {
    std::vector<double> total(static_cast<size_t>(cols * P)), part(total.size());
    const int64_t b_end = std::min(nb, (task + 1) * kBoxesPerTask);
    for (int64_t b = task * kBoxesPerTask; b < b_end; ++b) {
      std::fill(total.begin(), total.end(), 0.0);
      for (int64_t j0 = bx.first[b]; j0 < bx.first[b + 1]; j0 += kKeyBlock) {
        const int64_t j1 = std::min(bx.first[b + 1], j0 + kKeyBlock);
        std::fill(part.begin(), part.end(), 0.0);
        for (int64_t j = j0; j < j1; ++j) {
          const double t = (p.keys[j] - bx.centre[b]) * p.inv_h;
          double pw = std::exp(-0.5 * t * t);
          const double* v = p.values + j * p.m;
          for (int k = 0; k < P; ++k) {
            part[k] += pw;
            for (int64_t c = 0; c < p.m; ++c) part[(1 + c) * P + k] += pw * v[c];
            pw *= t / (k + 1);
          }
        }
        for (size_t i = 0; i < total.size(); ++i) total[i] += part[i];
      }
      for (int64_t col = 0; col < cols; ++col) {
        for (int k = 0; k < P; ++k) bx.coef[(col * P + k) * nb + b] = total[col * P + k];
      }
    }
  });
  return bx;
}

// acc[i] = sum_k cf[k * nb + i] sv[i]^k for k < P, by Horner, vectorised over
// the boxes i. This loop is the Taylor path's hot spot (about 35 boxes x 20
// terms x (Dv + 1) per query); target_clones compiles it for AVX-512 and AVX2
// as well, chosen at load time (n = t = 10^6, h = 0.001 x spread: 1.75 s ->
// 1.65 s; the rest is exp, binary searches and the sort).
__attribute__((target_clones("avx512f", "avx2", "default"))) void horner_boxes(
    const double* cf, int64_t nb, int P, const double* sv, int64_t nbq, double* acc) {
  for (int64_t i = 0; i < nbq; ++i) acc[i] = cf[(P - 1) * nb + i];
  for (int k = P - 2; k >= 0; --k) {
    const double* ck = cf + k * nb;
    for (int64_t i = 0; i < nbq; ++i) acc[i] = acc[i] * sv[i] + ck[i];
  }
}

// Taylor evaluation over boxes [b0, b1]: the same sums as window_sums over
// those boxes' keys, each weight within a factor (1 +/- tau) when it returns
// true; false (nothing written) when a box is too far for the bound.
bool taylor_sums(const Problem& p, const Boxes& bx, double q, double xa, int64_t b0, int64_t b1,
                 Scratch& s, double* sums) {
  const int64_t nbq = b1 - b0 + 1, m = p.m, nb = bx.count;
  const int P = bx.order;
  s.a.resize(static_cast<size_t>(nbq));
  s.b.resize(static_cast<size_t>(nbq));
  s.acc.resize(static_cast<size_t>(nbq));
  double* e = s.a.data();
  double* sv = s.b.data();
  double* acc = s.acc.data();
  const TwoDiff qa = two_diff(q, xa);
  for (int64_t i = 0; i < nbq; ++i) {
    const double c = bx.centre[b0 + i];
    sv[i] = (q - c) * p.inv_h;
    if (std::abs(sv[i]) * bx.radius[b0 + i] > bx.z_limit) return false;
    e[i] = -rel_exponent(c, xa, qa, q, p.inv_h);
  }
  // A handful of boxes (large h): scalar exp and sums, not the SIMD dispatch.
  const bool few = nbq < 8;
  if (few) {
    for (int64_t i = 0; i < nbq; ++i) e[i] = std::exp(e[i]);
  } else {
    fast::exp_shift_sum(e, 0.0, e, nbq);
  }
  for (int64_t col = 0; col <= m; ++col) {
    const double* cf = bx.coef.data() + col * P * nb + b0;
    horner_boxes(cf, nb, P, sv, nbq, acc);
    if (few) {
      double total = 0;
      for (int64_t i = 0; i < nbq; ++i) total += e[i] * acc[i];
      sums[col] = total;
    } else {
      sums[col] = fast::dot(e, acc, nbq);
    }
  }
  return true;
}

}  // namespace

// keys: (Nk) sorted   values: (Nk, Dv)   queries: (Nq)   out: (Nq, Dv)
const char* gauss1d(const double* keys, const double* values, int64_t n, int64_t m,
                    const double* queries, int64_t t, double h, double rel_tol, double* out) {
  // The largest coordinate decides between rel_exponent and its careful
  // variant (one pass over the queries; keys are sorted).
  double coord_max = std::max(std::abs(keys[0]), std::abs(keys[n - 1]));
  for (int64_t i = 0; i < t; ++i) {
    if (std::isfinite(queries[i])) coord_max = std::max(coord_max, std::abs(queries[i]));
  }
  const double inv_h = 1.0 / h;
  if (!(coord_max < kPlainLimit) && h >= 0x1p-1000 && coord_max * inv_h < kPlainLimit) {
    // Coordinates beyond 2^1020 but an h that is not tiny: the same problem
    // at 1/16 of the scale (exact for coordinates above 2^-1018; below, the
    // scaling moves u by < 2^-1070 / h <= 2^-70) keeps the plain path and
    // its Taylor boxes.
    std::vector<double> k16(keys, keys + n), q16(queries, queries + t);
    for (double& v : k16) v *= 0.0625;
    for (double& v : q16) v *= 0.0625;
    return gauss1d(k16.data(), values, n, m, q16.data(), t, h * 0.0625, rel_tol, out);
  }
  const bool careful = !(coord_max < kPlainLimit && coord_max * inv_h < kPlainLimit);
  const Problem p{keys, values, n, m, h, inv_h, careful};
  const bool exact = !(rel_tol >= 1e-12) || n <= kExactMaxKeys || n * t <= kExactMaxWork;
  const double tol = std::min(rel_tol, 0.5);
  // Analytic budget: tau for the Taylor remainder and tau for the dropped
  // keys, each a relative perturbation of both sums; the ratio then moves by
  // at most 2 (2 tau) / (1 - 2 tau) <= rel_tol / 2 of sum w|v| / sum w.
  const double tau = tol / 8.0;
  const double cutoff = std::log(static_cast<double>(n) / tau) + kCutoffMargin;
  const double drop_factor = std::exp(-cutoff);

  // Queries in ascending order with their positions (NaN ones apart: their
  // outputs are NaN). Sorting (value, position) pairs, not positions, keeps
  // the query loop's reads sequential: the indirect version spent 60% of a
  // 1.1 s run at h = 10 x spread on cache misses reading queries[order[i]].
  // Two halves sort in parallel and merge; ties break by position, so the
  // order is the same for any thread count.
  std::vector<std::pair<double, int64_t>> order;
  order.reserve(static_cast<size_t>(t));
  for (int64_t i = 0; i < t; ++i) {
    if (std::isnan(queries[i])) {
      std::fill(out + i * m, out + (i + 1) * m, std::numeric_limits<double>::quiet_NaN());
    } else {
      order.emplace_back(queries[i], i);
    }
  }
  if (!exact) {
    const auto mid = order.begin() + static_cast<std::ptrdiff_t>(order.size() / 2);
    kernels::parallel_for(2, [&](int64_t half) {
      if (half == 0) {
        std::sort(order.begin(), mid);
      } else {
        std::sort(mid, order.end());
      }
    });
    std::inplace_merge(order.begin(), mid, order.end());
  }
  const int64_t tq = static_cast<int64_t>(order.size());

  // sum_j |v[j, c]|, for the numerator's share of the dropped keys.
  std::vector<double> abs_sum(static_cast<size_t>(m), 0.0);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t c = 0; c < m; ++c) abs_sum[c] += std::abs(values[j * m + c]);
  }

  Boxes bx;
  bool use_taylor = false;
  if (!exact && !careful) {
    // Boxes are worth building only if they hold several keys each: count
    // them first (cheap), then build the moments when count * P <= 2 n.
    // Careful calls (h below 2^-1020 of the largest coordinate) skip the
    // boxes: their moments' t = (x - c) / h and Horner sums are formed
    // plainly; they sum windows, exact but slow only if many keys lie within
    // a few such bandwidths (keys packed near 0 far below the largest).
    int64_t count = 0;
    for (int64_t j = 0; j < n;) {
      const double end = keys[j] + kBoxWidth * h;
      ++count;
      j = std::upper_bound(keys + j, keys + n, end) - keys;
    }
    if (count * 24 <= 2 * n) {
      bx = build_boxes(p, cutoff, tau);
      use_taylor = bx.count * bx.order <= 2 * n;
    }
  }

  const int64_t tasks = (tq + kQueryBlock - 1) / kQueryBlock;
  std::vector<int64_t> taylor_count(static_cast<size_t>(tasks), 0);
  kernels::parallel_for(tasks, [&](int64_t task) {
    Scratch s;
    std::vector<double> sums(static_cast<size_t>(m + 1));
    const int64_t i_end = std::min(tq, (task + 1) * kQueryBlock);
    for (int64_t i = task * kQueryBlock; i < i_end; ++i) {
      const auto [q, qi] = order[i];
      double* o = out + qi * m;
      if (std::isinf(q)) {  // the limit: the extreme key and its duplicates
        const double x = q > 0 ? keys[n - 1] : keys[0];
        const int64_t lo = std::lower_bound(keys, keys + n, x) - keys;
        const int64_t hi = std::upper_bound(keys, keys + n, x) - keys;
        for (int64_t c = 0; c < m; ++c) {
          double acc = 0;
          for (int64_t j = lo; j < hi; ++j) acc += values[j * m + c];
          o[c] = acc / static_cast<double>(hi - lo);
        }
        continue;
      }
      const int64_t a = nearest_key(keys, n, q);
      const double xa = keys[a];
      bool done = false;
      if (exact) {
        window_sums(p, q, xa, 0, n, s, sums.data());
        done = true;
      } else {
        const auto [lo, hi] = window_range(p, q, a, cutoff);
        const double window_cost = static_cast<double>(hi - lo) * static_cast<double>(m + 6);
        bool ok = false;
        if (use_taylor) {
          const int64_t b0 = bx.of_key[lo], b1 = bx.of_key[hi - 1];
          const double taylor_cost =
              static_cast<double>(b1 - b0 + 1) * static_cast<double>((m + 1) * bx.order + 12);
          if (taylor_cost < window_cost) {
            ok = taylor_sums(p, bx, q, xa, b0, b1, s, sums.data());
            if (ok) ++taylor_count[task];
          }
        }
        if (!ok) window_sums(p, q, xa, lo, hi, s, sums.data());
        // The dropped keys' share of the numerator, e^{-L} sum|v|, must be
        // <= tau sum w|v|; |N| / 2 is a lower bound of that sum.
        done = true;
        for (int64_t c = 0; c < m; ++c) {
          if (!(drop_factor * abs_sum[c] <= 0.5 * tau * std::abs(sums[1 + c]))) done = false;
        }
      }
      if (!done) {  // every key whose float64 weight is not 0
        const auto [lo, hi] = window_range(p, q, a, kUnderflowCutoff);
        window_sums(p, q, xa, lo, hi, s, sums.data());
      }
      for (int64_t c = 0; c < m; ++c) o[c] = sums[1 + c] / sums[0];
    }
  });
  if (exact) return "exact";
  const int64_t taylor = std::accumulate(taylor_count.begin(), taylor_count.end(), int64_t{0});
  return taylor > 0 ? "taylor" : "window";
}

}  // namespace qkv::kernels::fast
