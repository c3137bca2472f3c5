// Nadaraya–Watson regression, fast exact version. Gaussian predictions with
// p, m <= 8 (weights not wanted) go through the fused small-dimension
// attention kernel (kernels/attention/small_dim_attention.h): scores -|q' - x'|^2 / 2
// formed from differences in registers, never stored, ~2 G kernel
// evaluations/s per core in float64. Everything else: tasks of query rows
// run on qkv's threads; per row the scores are direct differences
// (q_c - x_jc) over keys stored feature-major, so the inner loop is
// unit-stride and vectorises, the exponentials use Highway's SIMD exp, and a
// BLAS GEMM pools the values. Also the leave-one-out objective with its
// analytic gradient.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>

#include "kernels/attention/small_dim_attention.h"
#include "kernels/regression/nadaraya_watson.h"
#include "kernels/runtime/blas.h"
#include "kernels/runtime/parallel.h"
#include "kernels/simd/vecmath.h"

namespace qkv::kernels {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Scores relative to the row's best are clamped here before the exp: far
// below exp's underflow (-745) so the weight is exactly 0, inside the SIMD
// exp's valid range, and -inf (an excluded key) becomes finite.
constexpr double kScoreFloor = -800.0;

// Rows per task: the task's weights (rows x n doubles) stay within 256 KiB,
// so they are still in L2 for the GEMM that pools them, and a task holds at
// least ~2^15 kernel evaluations (~0.1 ms), so thread start-up does not
// dominate small problems. Depends on n only (determinism).
int64_t rows_per_task(int64_t n) {
  return std::clamp<int64_t>((int64_t{1} << 15) / std::max<int64_t>(n, 1), 1, 4096);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Keys feature-major into xt (n * p): xt[c * n + j] = x[j * p + c].
void transpose_keys(const NwData& d, double* xt) {
  for (int64_t j = 0; j < d.n; ++j) {
    for (int64_t c = 0; c < d.p; ++c) xt[c * d.n + j] = d.x[j * d.p + c];
  }
}

// Runs body(task, slot) for every task in [0, num_tasks): the tasks are dealt
// round-robin to min(slots, num_tasks) groups that run in parallel, slot
// being the group's share of the workspace. Task boundaries depend on the
// shapes only, never on the slots, so neither do the results.
template <class Body>
void for_each_task(int64_t num_tasks, int slots, Body&& body) {
  const int64_t groups = std::min<int64_t>(std::max(slots, 1), num_tasks);
  kernels::parallel_for(groups, [&](int64_t g) {
    for (int64_t task = g; task < num_tasks; task += groups) body(task, g);
  });
}

size_t as_size(int64_t v) { return static_cast<size_t>(v); }

// The unnormalised kernel row of query qi (p) over all keys, key `skip`
// (or none if < 0) left out with weight 0: Gaussian exp(s_j - max s), so the
// nearest key has weight 1 and the row can never sum to 0 while any key is
// left; compact prod_c k(u_c). The compact profiles are the same expressions
// as the reference's, so both agree exactly on which keys are in reach (a
// difference or u that overflows is out of reach, as it truly is). Gaussian
// rows go to gaussian_row_far when `far` (some difference q_c - x_jc of the
// call may overflow), when every squared distance overflowed, or when the
// row's log-sum-exp is below kFarRowLse: checks after the loops, which stay
// branch-free. Returns the row's sum.
double kernel_row(const NwData& d, const double* xt, const double* qi, int64_t skip, bool far,
                  double* w) {
  const int64_t n = d.n;
  if (d.kernel == Kernel::kGaussian) {
    if (far) return gaussian_row_far(d, xt, 1, n, qi, skip, false, w);
    std::fill(w, w + n, 0.0);
    for (int64_t c = 0; c < d.p; ++c) {
      const double qc = qi[c], ih = d.inv_h[c];
      const double* xc = xt + c * n;
      for (int64_t j = 0; j < n; ++j) {
        const double u = (qc - xc[j]) * ih;
        w[j] += u * u;
      }
    }
    if (skip >= 0) w[skip] = kInf;
    double best = kInf;
    for (int64_t j = 0; j < n; ++j) best = std::min(best, w[j]);
    if (best == kInf) {  // every D_j overflowed, or no key is left
      return gaussian_row_far(d, xt, 1, n, qi, skip, true, w);
    }
    for (int64_t j = 0; j < n; ++j) w[j] = std::max(-0.5 * (w[j] - best), kScoreFloor);
    const double sum = fast::exp_shift_sum(w, 0.0, w, n);
    if (!(-0.5 * best + std::log(sum) >= kFarRowLse)) {
      return gaussian_row_far(d, xt, 1, n, qi, skip, true, w);
    }
    return sum;
  }
  std::fill(w, w + n, 1.0);
  for (int64_t c = 0; c < d.p; ++c) {
    const double qc = qi[c], ih = d.inv_h[c];
    const double* xc = xt + c * n;
    switch (d.kernel) {
      case Kernel::kBoxcar:
        for (int64_t j = 0; j < n; ++j) {
          const double u = (qc - xc[j]) * ih;
          w[j] = std::abs(u) <= 1.0 ? w[j] : 0.0;
        }
        break;
      case Kernel::kEpanechnikov:
        for (int64_t j = 0; j < n; ++j) {
          const double u = (qc - xc[j]) * ih;
          w[j] *= std::abs(u) <= 1.0 ? 1.0 - u * u : 0.0;
        }
        break;
      case Kernel::kTriangular:
        for (int64_t j = 0; j < n; ++j) {
          const double u = (qc - xc[j]) * ih;
          const double a = std::abs(u);
          w[j] *= a <= 1.0 ? 1.0 - a : 0.0;
        }
        break;
      case Kernel::kGaussian:
        assert(false);
        break;
    }
  }
  if (skip >= 0) w[skip] = 0.0;
  double sum = 0.0;
  for (int64_t j = 0; j < n; ++j) sum += w[j];
  return sum;
}

// Whether gaussian_fused serves the call: the Gaussian kernel, p and m up to
// 8, no difference q_c - x_jc that may overflow (`far`), and a normal,
// finite scale max_c(1/h_c)^2 / 2.
bool gaussian_fused_applies(const NwData& d, bool far) {
  if (d.kernel != Kernel::kGaussian || d.p > fast::kSmallDimMaxDim ||
      d.m > fast::kSmallDimMaxValueDim || far) {
    return false;
  }
  double inv_max = 0.0;
  for (int64_t c = 0; c < d.p; ++c) inv_max = std::max(inv_max, d.inv_h[c]);
  const double scale = 0.5 * inv_max * inv_max;
  return scale >= std::numeric_limits<double>::min() && std::isfinite(scale);
}

// Workspace of gaussian_fused: ratio and center (p each), the transformed
// keys (n, p) and queries (t, p), lse (t), a row of weights (n) per slot and
// a count per task, then small_dim_forward's own scratch.
size_t gaussian_fused_workspace_size(const NwData& d, int64_t t, int slots) {
  const int64_t tasks = ceil_div(t, rows_per_task(d.n));
  return as_size(2 * d.p + d.n * d.p + t * d.p + t + slots * d.n + tasks) +
         fast::small_dim_workspace_size<double>(1, d.n, d.p, d.m, false);
}

// The Gaussian estimator through fast::small_dim_forward, or false (nothing
// written) when it does not apply: p or m above 8, `far` (a difference
// q_c - x_jc may overflow), or bandwidths so small that 1 / h^2 overflows
// (or so large that it is not normal). Scores are -scale |q' - x'|^2 with
// scale = max_c(1/h_c)^2 / 2 and x'_c = x_c r_c, r_c = (1/h_c) / max_c(1/h_c):
// for one feature, or equal bandwidths, r_c = 1 and the data go in as given,
// so the differences q - x are formed before any scaling, as in the
// reference (no cancellation at any bandwidth). Features with other
// bandwidths are centred on their keys' midrange first, then scaled, so a
// rounding error stays ~2^-53 of the spread / h_c in u_c. Rows whose
// log-sum-exp is below kFarRowLse (queries > 32768 bandwidths from every
// key) or not finite (the nearest squared distance, or that times scale,
// overflowed: the kernel then returns a zero row) are evaluated again by
// gaussian_row_far, in parallel: the same rule as the reference's.
bool gaussian_fused(const NwData& d, const double* q, int64_t t, bool far, double* out,
                    int64_t* undefined, Workspace ws) {
  if (!gaussian_fused_applies(d, far)) return false;
  double inv_max = 0.0;
  for (int64_t c = 0; c < d.p; ++c) inv_max = std::max(inv_max, d.inv_h[c]);
  const double scale = 0.5 * inv_max * inv_max;
  const int64_t per_task = rows_per_task(d.n);
  const int64_t tasks = ceil_div(t, per_task);
  double* const ratio = ws.data;                      // (p)
  double* const center = ratio + d.p;                 // (p)
  double* const xs = center + d.p;                    // (n, p)
  double* const qs = xs + d.n * d.p;                  // (t, p)
  double* const lse = qs + t * d.p;                   // (t)
  double* const rows = lse + t;                       // (slots, n)
  double* const empty = rows + ws.num_threads * d.n;  // (tasks), then small_dim_forward's
  bool rescale = false;
  for (int64_t c = 0; c < d.p; ++c) {
    ratio[c] = d.inv_h[c] / inv_max;
    center[c] = 0.0;
    if (ratio[c] == 1.0) continue;
    rescale = true;
    double lo = kInf, hi = -kInf;
    for (int64_t j = 0; j < d.n; ++j) {
      lo = std::min(lo, d.x[j * d.p + c]);
      hi = std::max(hi, d.x[j * d.p + c]);
    }
    center[c] = 0.5 * lo + 0.5 * hi;  // (hi - lo could overflow)
  }
  const double* x = d.x;
  const double* qp = q;
  if (rescale) {
    auto transform = [&](const double* src, int64_t num_rows, double* dst) {
      for (int64_t i = 0; i < num_rows; ++i) {
        for (int64_t c = 0; c < d.p; ++c) {
          const double v = src[i * d.p + c];
          dst[i * d.p + c] = ratio[c] == 1.0 ? v : (v - center[c]) * ratio[c];
        }
      }
    };
    transform(d.x, d.n, xs);
    transform(q, t, qs);
    x = xs;
    qp = qs;
  }
  const ValidLens all_keys;
  const AttentionConfig config{.valid_lens = all_keys, .scale = scale, .dropout = 0.0, .seed = 0};
  fast::small_dim_forward<double>(
      ConstView<double>(qp, Shape{1, t, d.p}), ConstView<double>(x, Shape{1, d.n, d.p}),
      ConstView<double>(d.y, Shape{1, d.n, d.m}), nullptr, fast::ScoreKind::kNegSquaredDistance,
      config, TensorView<double>(out, Shape{1, t, d.m}), TensorView<double>(lse, Shape{1, t}),
      {.data = empty + tasks, .num_threads = ws.num_threads});
  // Rows far from every key (or whose scores overflowed) again, exactly;
  // ordinary queries have none, and then no threads are started.
  *undefined = 0;
  const auto is_far = [&](int64_t i) { return !(std::isfinite(lse[i]) && lse[i] >= kFarRowLse); };
  bool any_far = false;
  for (int64_t i = 0; i < t && !any_far; ++i) any_far = is_far(i);
  if (!any_far) return true;
  for_each_task(tasks, ws.num_threads, [&](int64_t task, int64_t slot) {
    double* const w = rows + slot * d.n;
    empty[task] = 0;
    for (int64_t i = task * per_task; i < std::min(t, (task + 1) * per_task); ++i) {
      if (!is_far(i)) continue;
      const double sum = gaussian_row_far(d, d.x, d.p, 1, q + i * d.p, -1, true, w);
      double* o = out + i * d.m;
      if (sum == 0.0) {  // n = 0
        ++empty[task];
        std::fill(o, o + d.m, std::numeric_limits<double>::quiet_NaN());
        continue;
      }
      for (int64_t k = 0; k < d.m; ++k) {
        double acc = 0.0;
        for (int64_t j = 0; j < d.n; ++j) acc += w[j] * d.y[j * d.m + k];
        o[k] = acc / sum;
      }
    }
  });
  for (int64_t task = 0; task < tasks; ++task) *undefined += static_cast<int64_t>(empty[task]);
  return true;
}

// Workspace of the general path: the keys feature-major (n, p); per slot a
// task's weight rows (rows, n) when the caller wants none, and their sums
// (rows); a count per task.
size_t general_workspace_size(const NwData& d, int64_t t, int slots) {
  const int64_t rows = rows_per_task(d.n);
  return as_size(d.n * d.p + slots * (rows * d.n + rows) + ceil_div(t, rows));
}

}  // namespace

namespace fast {

size_t nadaraya_watson_workspace_size(const NwData& d, int64_t t, int num_threads) {
  const int slots = std::max(num_threads, 1);
  return std::max(gaussian_fused_workspace_size(d, t, slots), general_workspace_size(d, t, slots));
}

// q: (t, p)   x: (n, p)   y: (n, m)   ->   out: (t, m), weights: (t, n) or null
int64_t nadaraya_watson(const NwData& d, const double* q, int64_t t, double* out, double* weights,
                        Workspace ws) {
  assert(ws.num_threads >= 1);
  if (t == 0) return 0;
  // One pass over the inputs decides whether a difference can overflow
  // (coordinates beyond +-2^1023); then every Gaussian row is a far one.
  const bool far = !differences_fit(d.x, d.n * d.p) || !differences_fit(q, t * d.p);
  int64_t fused_undefined = 0;
  if (!weights && gaussian_fused(d, q, t, far, out, &fused_undefined, ws)) return fused_undefined;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const int64_t rows = rows_per_task(d.n);
  const int64_t tasks = ceil_div(t, rows);
  double* const xt = ws.data;            // (n, p)
  double* const slots = xt + d.n * d.p;  // (threads, rows (n + 1))
  double* const undefined = slots + ws.num_threads * (rows * d.n + rows);  // (tasks)
  transpose_keys(d, xt);
  for_each_task(tasks, ws.num_threads, [&](int64_t task, int64_t slot) {
    const int64_t i0 = task * rows, r_end = std::min(rows, t - i0);
    double* const scratch = slots + slot * (rows * d.n + rows);
    double* const w = weights ? weights + i0 * d.n : scratch;
    double* const sums = scratch + rows * d.n;
    for (int64_t r = 0; r < r_end; ++r) {
      sums[r] = kernel_row(d, xt, q + (i0 + r) * d.p, -1, far, w + r * d.n);
    }
    double* o = out + i0 * d.m;
    kernels::gemm(false, false, r_end, d.m, d.n, 1.0, w, d.n, d.y, d.m, 0.0, o, d.m);
    undefined[task] = 0;
    for (int64_t r = 0; r < r_end; ++r) {
      if (sums[r] == 0.0) {
        ++undefined[task];
        std::fill(o + r * d.m, o + (r + 1) * d.m, nan);
        if (weights) std::fill(w + r * d.n, w + (r + 1) * d.n, nan);
        continue;
      }
      const double inv = 1.0 / sums[r];
      fast::scale(o + r * d.m, inv, d.m);
      if (weights) fast::scale(w + r * d.n, inv, d.n);
    }
  });
  int64_t total = 0;
  for (int64_t task = 0; task < tasks; ++task) total += static_cast<int64_t>(undefined[task]);
  return total;
}

// One task = rows points (>= 2^16 pairs, so small problems run as one task
// without thread start-up); per task partial sums, added in task order, so
// the result does not depend on the thread count.
int64_t loo_rows_per_task(int64_t n) {
  return std::max<int64_t>(16, (int64_t{1} << 16) / std::max<int64_t>(n, 1));
}

// The keys feature-major (n, p); per slot a row of weights and of b (n each),
// f and r (m each); per task its partial sums: sum_sq, defined, g (p).
size_t loo_sums_workspace_size(const NwData& d, bool, int num_threads) {
  const int64_t tasks = ceil_div(d.n, loo_rows_per_task(d.n));
  return as_size(d.n * d.p + std::max(num_threads, 1) * (2 * d.n + 2 * d.m) + tasks * (2 + d.p));
}

LooSums loo_sums(const NwData& d, double* gradient, Workspace ws) {
  LooSums total;
  if (gradient != nullptr) std::fill(gradient, gradient + d.p, 0.0);
  loo_sums_rows(d, 0, d.n, gradient, total, ws);
  return total;
}

void loo_sums_rows(const NwData& d, int64_t row_begin, int64_t row_end, double* gradient,
                   LooSums& total, Workspace ws) {
  assert(ws.num_threads >= 1);
  const bool want_gradient = gradient != nullptr;
  const int64_t rows = loo_rows_per_task(d.n);
  assert(row_begin % rows == 0 && (row_end % rows == 0 || row_end == d.n));
  assert(0 <= row_begin && row_begin <= row_end && row_end <= d.n);
  assert(!want_gradient || d.kernel == Kernel::kGaussian);
  const int64_t n = d.n, p = d.p, m = d.m;
  double* const xt = ws.data;                                      // (n, p)
  double* const slots = xt + n * p;                                // (threads, 2n + 2m)
  double* const parts = slots + ws.num_threads * (2 * n + 2 * m);  // (tasks, 2 + p)
  transpose_keys(d, xt);
  const bool far = !differences_fit(d.x, n * p);
  const int64_t first_task = row_begin / rows, tasks = ceil_div(row_end, rows) - first_task;
  for_each_task(tasks, ws.num_threads, [&](int64_t task_in_range, int64_t slot) {
    const int64_t task = first_task + task_in_range;
    // sum_sq, defined (a count, exact in a double), then g.
    double* const part = parts + task * (2 + p);
    double* const g = part + 2;
    std::fill(part, part + 2 + p, 0.0);
    double* const w = slots + slot * (2 * n + 2 * m);
    double* const b = w + n;
    double* const f = b + n;
    double* const r = f + m;
    const int64_t i_end = std::min(n, (task + 1) * rows);
    for (int64_t i = task * rows; i < i_end; ++i) {
      const double* xi = d.x + i * p;
      const double* yi = d.y + i * m;
      const double sum = kernel_row(d, xt, xi, i, far, w);
      if (sum == 0.0) continue;
      const double inv = 1.0 / sum;
      fast::scale(w, inv, n);  // a_ij
      std::fill(f, f + m, 0.0);
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t k = 0; k < m; ++k) f[k] += w[j] * d.y[j * m + k];
      }
      double sq = 0.0;
      for (int64_t k = 0; k < m; ++k) {
        r[k] = f[k] - yi[k];
        sq += r[k] * r[k];
      }
      part[0] += sq;
      part[1] += 1.0;
      if (!want_gradient) continue;
      // b_j = 2 a_ij (y_j - f_i) . r_i, then g[c] += sum_j b_j E_ijc.
      for (int64_t j = 0; j < n; ++j) {
        double dot = 0.0;
        for (int64_t k = 0; k < m; ++k) dot += (d.y[j * m + k] - f[k]) * r[k];
        b[j] = 2.0 * w[j] * dot;
      }
      for (int64_t c = 0; c < p; ++c) {
        const double* xc = xt + c * n;
        const double xic = xi[c];
        double acc = 0.0;
        for (int64_t j = 0; j < n; ++j) {
          // A key of weight 0 adds nothing, even where diff overflowed.
          const double diff = xic - xc[j];
          acc += b[j] == 0.0 ? 0.0 : b[j] * diff * diff;
        }
        g[c] += acc;
      }
    }
  });
  for (int64_t task = first_task; task < first_task + tasks; ++task) {
    const double* part = parts + task * (2 + p);
    total.sum_sq += part[0];
    total.defined += static_cast<int64_t>(part[1]);
    for (int64_t c = 0; want_gradient && c < p; ++c) gradient[c] += part[2 + c];
  }
}

// inv_h and g (p each), then loo_sums' workspace.
size_t parametric_loss_workspace_size(int64_t n, int64_t p, int64_t m, bool gradient,
                                      int num_threads) {
  const NwData d{.n = n, .p = p, .m = m};
  return as_size(2 * p) + loo_sums_workspace_size(d, gradient, num_threads);
}

// d loss / d w: every v_c = w^2, so d loss / d w = sum_c (d loss / d v_c) 2 w
// = -w sum_c g[c] with loo_sums' g (regular at w = 0, unlike going through h).
double parametric_loss(const double* x, const double* y, int64_t n, int64_t p, int64_t m, double w,
                       double* grad, Workspace ws) {
  double* const inv_h = ws.data;
  double* const g = inv_h + p;
  std::fill(inv_h, inv_h + p, std::abs(w));
  const NwData d{
      .x = x, .y = y, .n = n, .p = p, .m = m, .inv_h = inv_h, .kernel = Kernel::kGaussian};
  const LooSums sums =
      loo_sums(d, grad ? g : nullptr, {.data = g + p, .num_threads = ws.num_threads});
  if (grad) {
    double total = 0.0;
    for (int64_t c = 0; c < p; ++c) total += g[c];
    *grad = -w * total;
  }
  return sums.sum_sq;
}

}  // namespace fast
}  // namespace qkv::kernels
