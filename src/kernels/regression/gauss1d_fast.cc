// Fast 1-D Gaussian Nadaraya–Watson (fast version; the exact path in this file
// is the float64 spec it is tested against). Per sorted query: a cut-off window
// of keys summed directly, or a Taylor expansion about box centres over the
// same window. Derivation of every constant: docs/regression-fast-path.md.
#include "kernels/regression/gauss1d_fast.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#include "kernels/runtime/parallel.h"
#include "kernels/runtime/workspace.h"
#include "kernels/simd/vecmath.h"

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

// The largest |coordinate| among the end keys and the finite queries, each
// taken times `scale` (1, or 1/16 for the size query of a rescaled call, so
// that it sees the very numbers the rescaled call computes).
double coord_max_of(const double* keys, int64_t n, const double* queries, int64_t t, double scale) {
  double coord_max = std::max(std::abs(keys[0] * scale), std::abs(keys[n - 1] * scale));
  for (int64_t i = 0; i < t; ++i) {
    if (std::isfinite(queries[i])) coord_max = std::max(coord_max, std::abs(queries[i] * scale));
  }
  return coord_max;
}

// Coordinates beyond 2^1020 but an h that is not tiny: the same problem at
// 1/16 of the scale (exact for coordinates above 2^-1018; below, the scaling
// moves u by < 2^-1070 / h <= 2^-70) keeps the plain path and its Taylor
// boxes. At 1/16 the coordinates are below 2^1020, so it is never needed twice.
bool needs_rescale(double coord_max, double h, double inv_h) {
  return !(coord_max < kPlainLimit) && h >= 0x1p-1000 && coord_max * inv_h < kPlainLimit;
}

// Greedy boxes of width `width` over the sorted keys (each times `scale`, as
// in coord_max_of): how many there are. O(boxes log n).
int64_t count_boxes(const double* keys, int64_t n, double width, double scale) {
  int64_t count = 0;
  for (int64_t j = 0; j < n;) {
    const double end = keys[j] * scale + width;
    ++count;
    j = std::upper_bound(keys + j, keys + n, end,
                         [scale](double e, double k) { return e < k * scale; }) -
        keys;
  }
  return count;
}

// The Taylor order P and the z limit for a truncation error <= tau per key:
// smallest P with z^P / P! e^z <= tau (Lagrange remainder of e^{z} relative
// to e^{z}, worst sign). A query whose nearest key is within h sees box
// centres up to sqrt(1 + 2 (cutoff + 1)) + 1.5 width/h away, of half-width
// <= width/2h. With rel_tol >= 1e-12 and n <= 2^40, z <= 3.2 and P <= 32;
// past kMaxOrder the limit shrinks instead (queries then fall to the window),
// so the bound holds for any tau. Depends on n and rel_tol alone.
int taylor_order(double cutoff, double tau, double* z_limit) {
  const double reach = std::sqrt(1.0 + 2.0 * (cutoff + 1.0)) + 1.5 * kBoxWidth;
  *z_limit = reach * 0.5 * kBoxWidth;
  int order = 0;
  for (;;) {
    double term = std::exp(*z_limit);  // z^0/0! e^z
    order = 0;
    while (term > tau && order < kMaxOrder) {
      ++order;
      term *= *z_limit / order;
    }
    if (term <= tau) break;
    *z_limit *= 0.5;
  }
  return std::max(order, 1);
}

// What a call does, decided from the arguments and a cheap look at the data
// (the coordinates' range, the number of boxes): shared by the kernel and
// gauss1d_workspace_size, so the two cannot disagree on the scratch.
struct Plan {
  bool careful = false;
  bool exact = false;
  double tau = 0;
  double cutoff = 0;
  int64_t num_boxes = 0;  // Taylor boxes built (0: none, the windows serve)
  int order = 0;          // P: Taylor terms 0 .. P-1, when num_boxes > 0
  double z_limit = 0;     // queries with max |s| r above it use the window
};

// keys times key_scale are the call's keys (see coord_max_of); h and inv_h
// the call's own.
Plan make_plan(const double* keys, int64_t n, int64_t t, double coord_max, double h, double inv_h,
               double rel_tol, double key_scale) {
  Plan plan;
  plan.careful = !(coord_max < kPlainLimit && coord_max * inv_h < kPlainLimit);
  plan.exact = !(rel_tol >= 1e-12) || n <= kExactMaxKeys || n * t <= kExactMaxWork;
  const double tol = std::min(rel_tol, 0.5);
  // Analytic budget: tau for the Taylor remainder and tau for the dropped
  // keys, each a relative perturbation of both sums; the ratio then moves by
  // at most 2 (2 tau) / (1 - 2 tau) <= rel_tol / 2 of sum w|v| / sum w.
  plan.tau = tol / 8.0;
  plan.cutoff = std::log(static_cast<double>(n) / plan.tau) + kCutoffMargin;
  if (!plan.exact && !plan.careful) {
    // Boxes are worth building only if they hold several keys each: count
    // them first (cheap), then build the moments when count * 12 <= n and
    // count * P <= 2 n (the Taylor path's condition: boxes that fail it are
    // not built, and would not be used). Careful calls (h below 2^-1020 of
    // the largest coordinate) skip the boxes: their moments' t = (x - c) / h
    // and Horner sums are formed plainly; they sum windows, exact but slow
    // only if many keys lie within a few such bandwidths (keys packed near 0
    // far below the largest).
    const int64_t count = count_boxes(keys, n, kBoxWidth * h, key_scale);
    if (count * 24 <= 2 * n) {
      const int order = taylor_order(plan.cutoff, plan.tau, &plan.z_limit);
      if (count * order <= 2 * n) {
        plan.num_boxes = count;
        plan.order = order;
      }
    }
  }
  return plan;
}

// A query and its position, ordered as std::pair orders them (ties by
// position, so the order is the same for any thread count); trivially
// copyable, to live in a workspace slice.
struct SortedQuery {
  double q;
  int64_t pos;
};
inline bool operator<(const SortedQuery& a, const SortedQuery& b) {
  return a.q < b.q || (!(b.q < a.q) && a.pos < b.pos);
}

// Per-slot scratch of the query loop: a chunk's (or the boxes') exponents
// and weights, the boxes' scaled distances, accumulators, and the sums.
size_t query_slot_words(int64_t m, int64_t num_boxes) {
  return slice_words<double>(std::max(kChunk, num_boxes)) + slice_words<double>(num_boxes) +
         slice_words<double>(std::max(m, num_boxes)) + slice_words<double>(m + 1);
}

// Per-slot scratch of build_boxes: a box's moment totals and a key block's
// partial moments, (m + 1) P each.
size_t box_slot_words(int64_t m, int order) { return 2 * slice_words<double>((m + 1) * order); }

// Scratch of a call that needs no rescaling (gauss1d_workspace_size's
// accounting of gauss1d_plain, slice by slice in the same order).
size_t plain_workspace_words(const Plan& plan, int64_t n, int64_t m, int64_t t, int slots) {
  const int64_t tasks = (t + kQueryBlock - 1) / kQueryBlock;
  size_t words = slice_words<SortedQuery>(t);             // order
  if (!plan.exact) words += slice_words<SortedQuery>(t);  // the merged order
  words += slice_words<double>(m);                        // abs_sum
  words += slice_words<int64_t>(tasks);                   // taylor_count
  const int64_t nb = plan.num_boxes;
  if (nb > 0) {
    words += slice_words<int64_t>(nb + 1) + slice_words<int32_t>(n) + 2 * slice_words<double>(nb) +
             slice_words<double>((m + 1) * plan.order * nb);
    words += static_cast<size_t>(slots) * box_slot_words(m, plan.order);
  }
  words += static_cast<size_t>(slots) * query_slot_words(m, nb);
  return words;
}

struct Boxes {
  int64_t count = 0;
  int order = 0;              // P: Taylor terms 0 .. P-1
  double z_limit = 0;         // queries with max |s| r above it use the window
  int64_t* first = nullptr;   // first key of each box, plus n at the end (count + 1)
  int32_t* of_key = nullptr;  // box of each key (n)
  double* centre = nullptr;   // (count)
  double* radius = nullptr;   // max |x - centre| / h over the box, rounded up (count)
  // coef[(col * P + k) * count + b] = sum_{x in b} v_col e^{-t^2/2} t^k / k!,
  // t = (x - centre) / h, col 0 the weights (v = 1), col 1..m the values.
  double* coef = nullptr;  // ((m + 1) P count)
};

// The query loop's per-slot scratch (query_slot_words), written before read.
struct Scratch {
  double* a;    // exponents, then weights: max(kChunk, boxes)
  double* b;    // boxes
  double* acc;  // max(m, boxes)
};

// W = sum_j w_j and N[c] = sum_j w_j v[j, c] over keys [lo, hi), with the
// weights relative to the nearest key xa. sums has m + 1 entries.
void window_sums(const Problem& p, double q, double xa, int64_t lo, int64_t hi, const Scratch& s,
                 double* sums) {
  const int64_t m = p.m;
  std::fill(sums, sums + m + 1, 0.0);
  const TwoDiff qa = two_diff(q, xa);
  for (int64_t j0 = lo; j0 < hi; j0 += kChunk) {
    const int64_t len = std::min(kChunk, hi - j0);
    double* w = s.a;
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
      std::fill(s.acc, s.acc + m, 0.0);
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

// Greedy boxes of width kBoxWidth * h over the sorted keys (plan.num_boxes of
// them, as count_boxes found) and their Taylor moments, into bx's slices;
// `slots` holds num_slots box_slot_words regions.
void build_boxes(const Problem& p, Boxes& bx, double* slots, int num_slots) {
  const double width = kBoxWidth * p.h;
  int64_t b = 0;
  for (int64_t j = 0; j < p.n; ++b) {
    const int64_t j0 = j;
    const double end = p.keys[j0] + width;
    while (j < p.n && p.keys[j] <= end) ++j;
    bx.first[b] = j0;
  }
  assert(b == bx.count);
  bx.first[bx.count] = p.n;
  for (b = 0; b < bx.count; ++b) {
    const double lo = p.keys[bx.first[b]], hi = p.keys[bx.first[b + 1] - 1];
    const double c = lo + 0.5 * (hi - lo);
    bx.centre[b] = c;
    bx.radius[b] = std::max(c - lo, hi - c) * p.inv_h * (1.0 + 1e-15);
    for (int64_t j = bx.first[b]; j < bx.first[b + 1]; ++j) bx.of_key[j] = static_cast<int32_t>(b);
  }
  const int P = bx.order;
  const int64_t cols = p.m + 1, nb = bx.count;
  std::fill(bx.coef, bx.coef + cols * P * nb, 0.0);
  // 64 boxes per task; inside a box, keys in blocks of 256 summed apart and
  // then added (rounding ~ (256 + keys/256) ulps instead of keys).
  constexpr int64_t kBoxesPerTask = 64, kKeyBlock = 256;
  const size_t slot_words = box_slot_words(p.m, P);
  const int64_t size = cols * P;
  parallel_for_slots((nb + kBoxesPerTask - 1) / kBoxesPerTask, num_slots,
                     [&](int64_t task, int slot) {
                       double* cursor = slots + static_cast<size_t>(slot) * slot_words;
                       double* const total = take_slice<double>(&cursor, size);
                       double* const part = take_slice<double>(&cursor, size);
                       const int64_t b_end = std::min(nb, (task + 1) * kBoxesPerTask);
                       for (int64_t bi = task * kBoxesPerTask; bi < b_end; ++bi) {
                         std::fill(total, total + size, 0.0);
                         for (int64_t j0 = bx.first[bi]; j0 < bx.first[bi + 1]; j0 += kKeyBlock) {
                           const int64_t j1 = std::min(bx.first[bi + 1], j0 + kKeyBlock);
                           std::fill(part, part + size, 0.0);
                           for (int64_t j = j0; j < j1; ++j) {
                             const double t = (p.keys[j] - bx.centre[bi]) * p.inv_h;
                             double pw = std::exp(-0.5 * t * t);
                             const double* v = p.values + j * p.m;
                             for (int k = 0; k < P; ++k) {
                               part[k] += pw;
                               for (int64_t c = 0; c < p.m; ++c) part[(1 + c) * P + k] += pw * v[c];
                               pw *= t / (k + 1);
                             }
                           }
                           for (int64_t i = 0; i < size; ++i) total[i] += part[i];
                         }
                         for (int64_t col = 0; col < cols; ++col) {
                           for (int k = 0; k < P; ++k) {
                             bx.coef[(col * P + k) * nb + bi] = total[col * P + k];
                           }
                         }
                       }
                     });
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
// true; false (nothing written to sums) when a box is too far for the bound.
bool taylor_sums(const Problem& p, const Boxes& bx, double q, double xa, int64_t b0, int64_t b1,
                 const Scratch& s, double* sums) {
  const int64_t nbq = b1 - b0 + 1, m = p.m, nb = bx.count;
  const int P = bx.order;
  double* e = s.a;
  double* sv = s.b;
  double* acc = s.acc;
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
    const double* cf = bx.coef + col * P * nb + b0;
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

// gauss1d for coordinates that need no rescaling (needs_rescale false).
const char* gauss1d_plain(const double* keys, const double* values, int64_t n, int64_t m,
                          const double* queries, int64_t t, double h, double* out, const Plan& plan,
                          Workspace workspace, double* weight_sums) {
  const double inv_h = 1.0 / h;
  const Problem p{keys, values, n, m, h, inv_h, plan.careful};
  const bool exact = plan.exact;
  const double tau = plan.tau, cutoff = plan.cutoff;
  const double drop_factor = std::exp(-cutoff);
  const int slots = workspace.num_threads;
  double* cursor = workspace.data;

  // Queries in ascending order with their positions (NaN ones apart: their
  // outputs are NaN). Sorting (value, position) pairs, not positions, keeps
  // the query loop's reads sequential: the indirect version spent 60% of a
  // 1.1 s run at h = 10 x spread on cache misses reading queries[order[i]].
  // Two halves sort in parallel and merge into a second slice; ties break by
  // position, so the order is the same for any thread count.
  SortedQuery* order = take_slice<SortedQuery>(&cursor, t);
  int64_t tq = 0;
  for (int64_t i = 0; i < t; ++i) {
    if (std::isnan(queries[i])) {
      std::fill(out + i * m, out + (i + 1) * m, std::numeric_limits<double>::quiet_NaN());
      if (weight_sums) weight_sums[i] = std::numeric_limits<double>::quiet_NaN();
    } else {
      order[tq++] = {queries[i], i};
    }
  }
  if (!exact) {
    SortedQuery* const mid = order + tq / 2;
    kernels::parallel_for(2, [&](int64_t half) {
      if (half == 0) {
        std::sort(order, mid);
      } else {
        std::sort(mid, order + tq);
      }
    });
    SortedQuery* const merged = take_slice<SortedQuery>(&cursor, t);
    std::merge(order, mid, mid, order + tq, merged);
    order = merged;
  }

  // sum_j |v[j, c]|, for the numerator's share of the dropped keys.
  double* const abs_sum = take_slice<double>(&cursor, m);
  std::fill(abs_sum, abs_sum + m, 0.0);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t c = 0; c < m; ++c) abs_sum[c] += std::abs(values[j * m + c]);
  }
  int64_t* const taylor_count = take_slice<int64_t>(&cursor, (t + kQueryBlock - 1) / kQueryBlock);

  Boxes bx;
  const bool use_taylor = plan.num_boxes > 0;
  if (use_taylor) {
    bx.count = plan.num_boxes;
    bx.order = plan.order;
    bx.z_limit = plan.z_limit;
    bx.first = take_slice<int64_t>(&cursor, bx.count + 1);
    bx.of_key = take_slice<int32_t>(&cursor, n);
    bx.centre = take_slice<double>(&cursor, bx.count);
    bx.radius = take_slice<double>(&cursor, bx.count);
    bx.coef = take_slice<double>(&cursor, (m + 1) * bx.order * bx.count);
    double* const box_slots = cursor;
    cursor += static_cast<size_t>(slots) * box_slot_words(m, bx.order);
    build_boxes(p, bx, box_slots, slots);
  }

  double* const query_slots = cursor;
  const size_t slot_words = query_slot_words(m, plan.num_boxes);
  const int64_t tasks = (tq + kQueryBlock - 1) / kQueryBlock;
  parallel_for_slots(tasks, slots, [&](int64_t task, int slot) {
    double* slot_cursor = query_slots + static_cast<size_t>(slot) * slot_words;
    Scratch s;
    s.a = take_slice<double>(&slot_cursor, std::max(kChunk, plan.num_boxes));
    s.b = take_slice<double>(&slot_cursor, plan.num_boxes);
    s.acc = take_slice<double>(&slot_cursor, std::max(m, plan.num_boxes));
    double* const sums = take_slice<double>(&slot_cursor, m + 1);
    taylor_count[task] = 0;
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
        if (weight_sums) weight_sums[qi] = static_cast<double>(hi - lo);
        continue;
      }
      const int64_t a = nearest_key(keys, n, q);
      const double xa = keys[a];
      bool done = false;
      if (exact) {
        window_sums(p, q, xa, 0, n, s, sums);
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
            ok = taylor_sums(p, bx, q, xa, b0, b1, s, sums);
            if (ok) ++taylor_count[task];
          }
        }
        if (!ok) window_sums(p, q, xa, lo, hi, s, sums);
        // The dropped keys' share of the numerator, e^{-L} sum|v|, must be
        // <= tau sum w|v|; |N| / 2 is a lower bound of that sum.
        done = true;
        for (int64_t c = 0; c < m; ++c) {
          if (!(drop_factor * abs_sum[c] <= 0.5 * tau * std::abs(sums[1 + c]))) done = false;
        }
      }
      if (!done) {  // every key whose float64 weight is not 0
        const auto [lo, hi] = window_range(p, q, a, kUnderflowCutoff);
        window_sums(p, q, xa, lo, hi, s, sums);
      }
      for (int64_t c = 0; c < m; ++c) o[c] = sums[1 + c] / sums[0];
      if (weight_sums) weight_sums[qi] = sums[0];
    }
  });
  if (exact) return "exact";
  int64_t taylor = 0;
  for (int64_t task = 0; task < tasks; ++task) taylor += taylor_count[task];
  return taylor > 0 ? "taylor" : "window";
}

}  // namespace

size_t gauss1d_workspace_size(const double* keys, int64_t n, int64_t m, const double* queries,
                              int64_t t, double h, double rel_tol, int num_threads) {
  const int slots = std::max(num_threads, 1);
  double scale = 1.0;
  size_t words = 0;
  if (needs_rescale(coord_max_of(keys, n, queries, t, 1.0), h, 1.0 / h)) {
    // The keys and queries at 1/16 (k16, q16), then the rescaled call's.
    words = slice_words<double>(n) + slice_words<double>(t);
    scale = 0.0625;
    h *= 0.0625;
  }
  const Plan plan =
      make_plan(keys, n, t, coord_max_of(keys, n, queries, t, scale), h, 1.0 / h, rel_tol, scale);
  return words + plain_workspace_words(plan, n, m, t, slots);
}

// keys: (Nk) sorted   values: (Nk, Dv)   queries: (Nq)   out: (Nq, Dv)
const char* gauss1d(const double* keys, const double* values, int64_t n, int64_t m,
                    const double* queries, int64_t t, double h, double rel_tol, double* out,
                    Workspace workspace, double* weight_sums) {
  assert(workspace.num_threads >= 1 && n >= 1);
  // The largest coordinate decides between rel_exponent and its careful
  // variant (one pass over the queries; keys are sorted).
  double coord_max = coord_max_of(keys, n, queries, t, 1.0);
  if (needs_rescale(coord_max, h, 1.0 / h)) {
    double* cursor = workspace.data;
    double* const k16 = take_slice<double>(&cursor, n);
    double* const q16 = take_slice<double>(&cursor, t);
    for (int64_t j = 0; j < n; ++j) k16[j] = keys[j] * 0.0625;
    for (int64_t i = 0; i < t; ++i) q16[i] = queries[i] * 0.0625;
    keys = k16;
    queries = q16;
    h *= 0.0625;
    coord_max = coord_max_of(keys, n, queries, t, 1.0);
    workspace.data = cursor;
  }
  const Plan plan = make_plan(keys, n, t, coord_max, h, 1.0 / h, rel_tol, 1.0);
  return gauss1d_plain(keys, values, n, m, queries, t, h, out, plan, workspace, weight_sums);
}

}  // namespace qkv::kernels::fast
