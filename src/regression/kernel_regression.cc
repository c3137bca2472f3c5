// Nadaraya–Watson kernel regression, front end (qkv/kernel_regression.h):
// argument checks, the rules of thumb, leave-one-out cross-validation, the
// chapter's parametric model and average pooling. The sums themselves live
// in src/kernels/regression/nadaraya_watson_{ref,fast}.cc and gauss1d_fast.cc.
#include "qkv/kernel_regression.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "core/check.h"
#include "kernels/regression/gauss1d_fast.h"
#include "kernels/regression/nadaraya_watson.h"
#include "qkv/threads.h"
#include "regression/optimize.h"

namespace qkv {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// The smallest normal double: a bandwidth below it is subnormal (or 0), its
// 1/h overflows past 1/h = 4.5e307 and 1/h^2 long before; it cannot be
// represented sensibly, so it is an error.
constexpr double kMinBandwidth = std::numeric_limits<double>::min();

// Work (n * t kernel evaluations) from which predict() hands 1-D Gaussian
// problems to the fast algorithm: below it, exact evaluation takes a few
// milliseconds and the fast algorithm's set-up would not pay off.
constexpr double kFastPathMinWork = 1e6;
// The error bound predict() promises for the fast algorithm (relative to the
// weighted mean of |y|, see kernels/regression/gauss1d_fast.h).
constexpr double kFastPathRelTol = 1e-7;

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

// Rank 1 (n) or 2 (n, k); names the axes in the message.
void check_rank_1_or_2(std::string_view fn, std::string_view name, const ConstView<double>& v,
                       std::string_view axes1, std::string_view axes2) {
  if (v.rank() != 1 && v.rank() != 2) {
    fail(fn, std::string(name) + " has shape " + v.shape().str() + "; expected rank 1 " +
                 std::string(axes1) + " or 2 " + std::string(axes2));
  }
}

// Throws naming the first NaN or infinite element: "x[3, 1] is nan".
void check_finite(std::string_view fn, std::string_view name, const ConstView<double>& v) {
  const int64_t rows = v.size(0), cols = v.rank() == 2 ? v.size(1) : 1;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < cols; ++c) {
      const double e = v.rank() == 2 ? v(i, c) : v(i);
      if (!std::isfinite(e)) {
        const std::string index =
            v.rank() == 2 ? std::to_string(i) + ", " + std::to_string(c) : std::to_string(i);
        fail(fn, std::string(name) + "[" + index + "] is " + num(e) + " (" + std::string(name) +
                     " has shape " + v.shape().str() + "); every element must be finite");
      }
    }
  }
}

// A contiguous (rows, cols) copy of a rank 1 or 2 view.
Tensor<double> as_matrix(const ConstView<double>& v) {
  const int64_t rows = v.size(0), cols = v.rank() == 2 ? v.size(1) : 1;
  Tensor<double> out(Shape{rows, cols});
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < cols; ++c) out(i, c) = v.rank() == 2 ? v(i, c) : v(i);
  }
  return out;
}

// Training data shared by the constructor and the free functions: x (n) or
// (n, p) and y (n) or (n, m), finite, n >= min_points.
void check_training_data(std::string_view fn, const ConstView<double>& x,
                         const ConstView<double>& y, int64_t min_points) {
  check_rank_1_or_2(fn, "x", x, "(n)", "(n, p)");
  check_rank_1_or_2(fn, "y", y, "(n)", "(n, m)");
  if (y.size(0) != x.size(0)) {
    fail(fn, "y has " + std::to_string(y.size(0)) + " points but x has " +
                 std::to_string(x.size(0)) + " (x " + x.shape().str() + ", y " + y.shape().str() +
                 ")");
  }
  if (x.size(0) < min_points) {
    fail(fn, "x has shape " + x.shape().str() + "; expected at least " +
                 std::to_string(min_points) + (min_points == 1 ? " point" : " points"));
  }
  if (x.rank() == 2 && x.size(1) == 0) {
    fail(fn, "x has shape " + x.shape().str() + "; expected at least one feature");
  }
  if (y.rank() == 2 && y.size(1) == 0) {
    fail(fn, "y has shape " + y.shape().str() + "; expected at least one output column");
  }
  check_finite(fn, "x", x);
  check_finite(fn, "y", y);
}

// Queries (t) for 1-D data or (t, p), finite; returns a (t, p) copy.
Tensor<double> checked_queries(std::string_view fn, const ConstView<double>& queries, int64_t p,
                               const Shape& x_shape) {
  check_rank_1_or_2(fn, "queries", queries, "(t)", "(t, p)");
  const int64_t qp = queries.rank() == 2 ? queries.size(1) : 1;
  if (qp != p) {
    fail(fn, "queries has " + std::to_string(qp) + (qp == 1 ? " feature" : " features") +
                 " but x has " + std::to_string(p) + " (queries " + queries.shape().str() + ", x " +
                 x_shape.str() + ")");
  }
  check_finite(fn, "queries", queries);
  return as_matrix(queries);
}

// Why a bandwidth value is not one, or empty: finite, > 0 and normal.
std::string bandwidth_problem(double h) {
  if (!(h > 0.0) || !std::isfinite(h)) return "expected a finite value > 0";
  if (h < kMinBandwidth) {
    return "expected a value >= 2.2250738585072014e-308, the smallest normal double (a "
           "subnormal bandwidth cannot be represented sensibly: 1/h^2 overflows)";
  }
  return {};
}

void check_bandwidth(std::string_view fn, const std::vector<double>& h, int64_t p) {
  if (static_cast<int64_t>(h.size()) != p) {
    fail(fn, "bandwidth has " + std::to_string(h.size()) + " values but x has " +
                 std::to_string(p) + (p == 1 ? " feature" : " features") +
                 "; expected one per feature");
  }
  for (size_t c = 0; c < h.size(); ++c) {
    const std::string problem = bandwidth_problem(h[c]);
    if (!problem.empty())
      fail(fn, "bandwidth[" + std::to_string(c) + "] = " + num(h[c]) + "; " + problem);
  }
}

// max |v| over a contiguous array.
double max_abs(const double* v, int64_t n) {
  double m = 0.0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::abs(v[i]));
  return m;
}

// A copy of v times 2^-exponent (exact).
Tensor<double> scaled_copy(const Tensor<double>& v, int exponent) {
  Tensor<double> out = v;
  if (exponent != 0) {
    for (double& e : out.values()) e = std::ldexp(e, -exponent);
  }
  return out;
}

// The power of two that brings a magnitude m > 0 to [1, 2) when it lies
// outside [2^-limit, 2^limit], else 0: scaling by powers of two is exact, so
// data of ordinary size are used as given, bit for bit.
int scale_exponent(double m, int limit) {
  if (!(m > 0.0)) return 0;
  return (m > std::ldexp(1.0, limit) || m < std::ldexp(1.0, -limit)) ? std::ilogb(m) : 0;
}

std::vector<double> inverse(const std::vector<double>& h) {
  std::vector<double> inv(h.size());
  for (size_t c = 0; c < h.size(); ++c) inv[c] = 1.0 / h[c];
  return inv;
}

// The kernels' view of training data x (n, p) and y (n, m), contiguous, with
// inverse bandwidths inv_h (p); every kernel call's NwData is built here.
kernels::NwData nw_data(const Tensor<double>& x, const Tensor<double>& y,
                        const std::vector<double>& inv_h, Kernel kernel) {
  return {.x = x.data(),
          .y = y.data(),
          .n = x.size(0),
          .p = x.size(1),
          .m = y.size(1),
          .inv_h = inv_h.data(),
          .kernel = kernel};
}

// The exact fast kernel, its workspace allocated here: predictions at q
// (t, p) into out (t, m), the weights (t, n) too when not null. Returns the
// number of undefined (NaN) rows.
int64_t predict_exact(const kernels::NwData& d, const Tensor<double>& q, double* out,
                      double* weights) {
  const int threads = num_threads();
  std::vector<double> workspace(
      kernels::fast::nadaraya_watson_workspace_size(d, q.size(0), threads));
  return kernels::fast::nadaraya_watson(d, q.data(), q.size(0), out, weights,
                                        {.data = workspace.data(), .num_threads = threads});
}

// The chapter's parametric loss of x (n, p), y (n, m) at w, its workspace
// allocated here.
double parametric_loss_of(const Tensor<double>& x, const Tensor<double>& y, double w,
                          double* grad) {
  const int threads = num_threads();
  const int64_t n = x.size(0), p = x.size(1), m = y.size(1);
  std::vector<double> workspace(
      kernels::fast::parametric_loss_workspace_size(n, p, m, grad != nullptr, threads));
  return kernels::fast::parametric_loss(x.data(), y.data(), n, p, m, w, grad,
                                        {.data = workspace.data(), .num_threads = threads});
}

// The 1-D Gaussian fast algorithm: keys sorted ascending, y (n, m) in the
// same order, q (t, 1), out (t, m); its workspace, sized from the same data
// (gauss1d_workspace_size counts the Taylor boxes), allocated here.
void predict_gauss1d(const std::vector<double>& sorted_x, const Tensor<double>& sorted_y,
                     const Tensor<double>& q, double h, Tensor<double>& out) {
  const int threads = num_threads();
  const int64_t n = sorted_y.size(0), m = sorted_y.size(1), t = q.size(0);
  std::vector<double> workspace(kernels::fast::gauss1d_workspace_size(
      sorted_x.data(), n, m, q.data(), t, h, kFastPathRelTol, threads));
  kernels::fast::gauss1d(sorted_x.data(), sorted_y.data(), n, m, q.data(), t, h, kFastPathRelTol,
                         out.data(), {.data = workspace.data(), .num_threads = threads});
}

// The power of two by which predictions divide y first (and multiply the
// results after, both exact): a weighted sum of n values of y must not
// overflow (max |y| n beyond 2^1000), and weights times tiny y should not
// lose digits in the subnormal range (max |y| below 2^-500). Data in
// between, all ordinary data, are used as given.
int prediction_y_exponent(const Tensor<double>& y) {
  const double m = max_abs(y.data(), y.numel());
  if (!(m > 0.0)) return 0;
  return (m * static_cast<double>(y.size(0)) > 0x1p1000 || m < 0x1p-500) ? std::ilogb(m) : 0;
}

// Drops the column axis when y was 1-D.
Tensor<double> shaped_output(Tensor<double> out, bool y_was_1d) {
  if (!y_was_1d) return out;
  const int64_t t = out.size(0);
  return std::move(out).reshaped(Shape{t});
}

// ---- rules of thumb ------------------------------------------------------------

enum class Rule { kSilverman, kScott };

// numpy.percentile(v, 100 * f) with its default linear interpolation; v sorted.
double percentile_sorted(const std::vector<double>& v, double f) {
  const double pos = f * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  const double frac = pos - static_cast<double>(lo);
  return v[lo] + frac * (v[hi] - v[lo]);
}

std::vector<double> rule_of_thumb(std::string_view fn, const ConstView<double>& x, Rule rule) {
  check_rank_1_or_2(fn, "x", x, "(n)", "(n, p)");
  const int64_t n = x.size(0), p = x.rank() == 2 ? x.size(1) : 1;
  if (n < 2) {
    fail(fn, "x has shape " + x.shape().str() +
                 "; expected at least 2 points (the standard deviation divides by n - 1)");
  }
  if (p == 0) fail(fn, "x has shape " + x.shape().str() + "; expected at least one feature");
  check_finite(fn, "x", x);
  const Tensor<double> xm = as_matrix(x);
  std::vector<double> h(static_cast<size_t>(p));
  std::vector<double> col(static_cast<size_t>(n));
  for (int64_t c = 0; c < p; ++c) {
    for (int64_t i = 0; i < n; ++i) col[i] = xm(i, c);
    const auto [lo_it, hi_it] = std::minmax_element(col.begin(), col.end());
    const double lo = *lo_it, hi = *hi_it;
    if (lo == hi) {  // (the rounded mean may leave s a hair above 0)
      fail(fn, "feature " + std::to_string(c) + " of x (shape " + x.shape().str() +
                   ") is constant (standard deviation 0); a rule of thumb needs spread");
    }
    // Features beyond 2^+-400 in magnitude are scaled to [1, 2) first (by a
    // power of two, exactly), so the squares of the deviations neither
    // overflow (x up to 1.8e308) nor underflow (a subnormal spread).
    const int k = scale_exponent(std::max(std::abs(lo), std::abs(hi)), 400);
    for (double& v : col) v = std::ldexp(v, -k);
    const double mean = std::accumulate(col.begin(), col.end(), 0.0) / static_cast<double>(n);
    double ss = 0.0;
    for (double v : col) ss += (v - mean) * (v - mean);
    const double s = std::sqrt(ss / static_cast<double>(n - 1));
    const double dn = static_cast<double>(n);
    if (rule == Rule::kScott) {
      h[c] = 1.059 * s * std::pow(dn, -1.0 / (static_cast<double>(p) + 4.0));
    } else {
      std::sort(col.begin(), col.end());
      const double iqr = percentile_sorted(col, 0.75) - percentile_sorted(col, 0.25);
      const double spread = iqr > 0.0 ? std::min(s, iqr / 1.349) : s;
      h[c] = 0.9 * spread * std::pow(dn, -0.2);
    }
    h[c] = std::ldexp(h[c], k);
    if (!(h[c] >= kMinBandwidth) || !std::isfinite(h[c])) {
      const bool tiny = !(h[c] >= kMinBandwidth);
      fail(fn, "feature " + std::to_string(c) + " of x (shape " + x.shape().str() + ") spans " +
                   num(lo) + " to " + num(hi) + ", so its " +
                   (rule == Rule::kScott ? "Scott" : "Silverman") + " bandwidth, " + num(h[c]) +
                   (tiny ? ", is below the smallest normal double (2.2250738585072014e-308): "
                           "a bandwidth for so small a spread cannot be represented sensibly "
                           "(1/h^2 overflows)"
                         : ", exceeds the largest double") +
                   "; rescale x");
    }
  }
  return h;
}

// ---- cross-validation ------------------------------------------------------------

// Evaluations of the leave-one-out error cv_bandwidth typically makes after
// its scan of 49 bandwidths, the last at the result included, for its
// progress estimate: 1-D Gaussian, 15 (6 BFGS iterations at n = 3000, of
// values and gradients); compact kernels' line searches, 1 + 33 + 40 per
// sweep and feature; several features, Nelder-Mead and up to 3 more scans of
// 48 (a guess on the high side: the estimate only grows if it is short).
int64_t typical_search_evaluations(Kernel kernel, size_t p) {
  const int64_t features = static_cast<int64_t>(p);
  if (kernel == Kernel::kGaussian) return p == 1 ? 15 : 100 + 48 * features;
  return 74 * features * (p == 1 ? 1 : 2);
}

// The leave-one-out objective: mean squared error over the defined
// points (+inf if none) and, for the Gaussian, its gradient. It works on
// scaled copies: y times 2^-y_exponent() (brought to [1, 2) when its largest
// |y| lies outside 2^+-400: squared errors of y ~ 1e160 would overflow, of
// y ~ 1e-160 underflow), so the value and the gradient are those of the data
// as given times 4^-y_exponent(), and, with scale_x (cross-validation),
// feature c times 2^-x_exponent(c) on the same rule, the bandwidths then
// being in those units (the gradient's squared differences stay finite). Scaling
// by powers of two is exact: data of ordinary size are used bit for bit.
class LooObjective {
 public:
  LooObjective(const Tensor<double>& x, const Tensor<double>& y, Kernel kernel, bool scale_x)
      : kernel_(kernel), p_(x.size(1)), x_exp_(static_cast<size_t>(p_), 0) {
    y_exp_ = scale_exponent(max_abs(y.data(), y.numel()), 400);
    y_ = scaled_copy(y, y_exp_);
    x_ = x;
    for (int64_t c = 0; scale_x && c < p_; ++c) {
      double m = 0.0;
      for (int64_t i = 0; i < x.size(0); ++i) m = std::max(m, std::abs(x(i, c)));
      x_exp_[c] = scale_exponent(m, 400);
      for (int64_t i = 0; i < x.size(0); ++i) x_(i, c) = std::ldexp(x(i, c), -x_exp_[c]);
    }
  }

  int y_exponent() const { return y_exp_; }
  int x_exponent(size_t c) const { return x_exp_[c]; }

  // Called with the number of points done after each piece of an
  // evaluation (cv_bandwidth's progress); unset, an evaluation is one call.
  void on_points(std::function<void(int64_t)> hook) { on_points_ = std::move(hook); }

  // The objective at inverse bandwidths inv_h (in the scaled units of x), and
  // its gradient with respect to log h.
  double operator()(const std::vector<double>& inv_h, std::vector<double>* grad) const {
    const kernels::NwData d = nw_data(x_, y_, inv_h, kernel_);
    const int threads = num_threads();
    std::vector<double> g(grad ? inv_h.size() : 0);
    std::vector<double> workspace(
        kernels::fast::loo_sums_workspace_size(d, grad != nullptr, threads));
    const kernels::Workspace ws{.data = workspace.data(), .num_threads = threads};
    kernels::LooSums sums;
    if (!on_points_) {
      sums = kernels::fast::loo_sums(d, grad ? g.data() : nullptr, ws);
    } else {
      // Pieces of at least 2^26 kernel evaluations (0.1-0.5 s here), whole
      // tasks each, so the sums are the same bits as one call's: at
      // n = 200,000 an evaluation (4e10 pairs, minutes) reports 600 times;
      // below n = 8192 it is one piece.
      const int64_t n = d.n, task = kernels::fast::loo_rows_per_task(n);
      const int64_t piece = std::max<int64_t>(1, ((int64_t{1} << 26) / n) / task) * task;
      for (int64_t begin = 0; begin < n; begin += piece) {
        const int64_t end = std::min(n, begin + piece);
        kernels::fast::loo_sums_rows(d, begin, end, grad ? g.data() : nullptr, sums, ws);
        on_points_(end - begin);
      }
    }
    if (sums.defined == 0) return kInf;
    const double scale = 1.0 / static_cast<double>(sums.defined);
    if (grad) {
      grad->resize(inv_h.size());
      for (size_t c = 0; c < inv_h.size(); ++c) (*grad)[c] = g[c] * inv_h[c] * inv_h[c] * scale;
    }
    return sums.sum_sq * scale;
  }

 private:
  Kernel kernel_;
  int64_t p_;
  Tensor<double> x_, y_;
  std::vector<int> x_exp_;
  int y_exp_ = 0;
  std::function<void(int64_t)> on_points_;
};

// The relative tolerance cv_bandwidth_fast_1d asks of gauss1d: each of its
// sums is then within 2.5e-10 of exact (a quarter of it; the kernel's
// guarantee holds from 1e-9), which with kFastLooMinOthers keeps every
// leave-one-out estimate within about 1e-9 max|y| of the exact path's.
constexpr double kFastLooRelTol = 1e-9;
// Points whose other points weigh less than this together, relative to the
// point's own weight (W_i - 1 from the fast path), are summed exactly: W_i -
// 1 loses digits as it falls (its error is relative to W_i), and such points,
// whose nearest neighbour is beyond about 1.2 bandwidths, have few keys in reach.
constexpr double kFastLooMinOthers = 0.5;

// The 1-D Gaussian leave-one-out objective through the fast path, for
// cv_bandwidth_fast_1d: one gauss1d call with the sorted keys as the queries
// gives out_i and W_i for every point, then f_{-i}(x_i) = (out_i W_i - y_i) /
// (W_i - 1); points with W_i - 1 below kFastLooMinOthers are summed exactly
// over the keys in reach (the nearest other key, plus 746 e-folds: beyond,
// float64 weights are 0). y is scaled as LooObjective scales it.
class FastLooObjective {
 public:
  FastLooObjective(const std::vector<double>& sorted_x, const Tensor<double>& sorted_y)
      : x_(sorted_x), n_(sorted_y.size(0)), m_(sorted_y.size(1)) {
    y_exp_ = scale_exponent(max_abs(sorted_y.data(), sorted_y.numel()), 400);
    y_ = scaled_copy(sorted_y, y_exp_);
  }
  int y_exponent() const { return y_exp_; }

  // The mean squared leave-one-out error at bandwidth h (of the scaled y).
  double operator()(double h) const {
    const int threads = num_threads();
    std::vector<double> out(static_cast<size_t>(n_ * m_)), w(static_cast<size_t>(n_));
    std::vector<double> workspace(kernels::fast::gauss1d_workspace_size(
        x_.data(), n_, m_, x_.data(), n_, h, kFastLooRelTol, threads));
    kernels::fast::gauss1d(x_.data(), y_.data(), n_, m_, x_.data(), n_, h, kFastLooRelTol,
                           out.data(), {.data = workspace.data(), .num_threads = threads},
                           w.data());
    std::vector<double> f(static_cast<size_t>(m_));
    double sum_sq = 0.0;
    for (int64_t i = 0; i < n_; ++i) {
      const double others = w[i] - 1.0;
      if (others >= kFastLooMinOthers) {
        for (int64_t c = 0; c < m_; ++c) f[c] = (out[i * m_ + c] * w[i] - y_(i, c)) / others;
      } else {
        exact_point(i, h, f.data());
      }
      for (int64_t c = 0; c < m_; ++c) sum_sq += (f[c] - y_(i, c)) * (f[c] - y_(i, c));
    }
    return sum_sq / static_cast<double>(n_);
  }

 private:
  // f_{-i}(x_i) from the keys in reach, weights relative to the nearest other.
  void exact_point(int64_t i, double h, double* f) const {
    const double xi = x_[i], inv_2h2 = 0.5 / h / h;
    const auto exponent = [&](int64_t j) { return (xi - x_[j]) * (xi - x_[j]) * inv_2h2; };
    double e_min = std::numeric_limits<double>::infinity();
    if (i > 0) e_min = exponent(i - 1);
    if (i + 1 < n_) e_min = std::min(e_min, exponent(i + 1));
    double total = 0.0;
    std::fill(f, f + m_, 0.0);
    const auto add = [&](int64_t j) {
      const double e = exponent(j) - e_min;
      if (!(e <= 746.0)) return false;  // sorted: the keys further out weigh 0 too
      const double wj = std::exp(-e);
      total += wj;
      for (int64_t c = 0; c < m_; ++c) f[c] += wj * y_(j, c);
      return true;
    };
    for (int64_t j = i - 1; j >= 0 && add(j); --j) {
    }
    for (int64_t j = i + 1; j < n_ && add(j); ++j) {
    }
    for (int64_t c = 0; c < m_; ++c) f[c] /= total;
  }

  const std::vector<double>& x_;
  int64_t n_, m_;
  Tensor<double> y_;
  int y_exp_ = 0;
};

}  // namespace

// ---- kernels by name ---------------------------------------------------------------

Kernel kernel_from_name(std::string_view name) {
  if (name == "gaussian") return Kernel::kGaussian;
  if (name == "boxcar" || name == "uniform") return Kernel::kBoxcar;
  if (name == "epanechnikov") return Kernel::kEpanechnikov;
  if (name == "triangular") return Kernel::kTriangular;
  fail("kernel_from_name", "unknown kernel \"" + std::string(name) +
                               "\"; expected gaussian, boxcar (or uniform), epanechnikov or "
                               "triangular");
}

std::string_view kernel_name(Kernel kernel) {
  switch (kernel) {
    case Kernel::kGaussian:
      return "gaussian";
    case Kernel::kBoxcar:
      return "boxcar";
    case Kernel::kEpanechnikov:
      return "epanechnikov";
    case Kernel::kTriangular:
      return "triangular";
  }
  fail("kernel_name", "unknown kernel value " + std::to_string(static_cast<int>(kernel)));
}

// ---- KernelRegression --------------------------------------------------------------

KernelRegression::KernelRegression(ConstView<double> x, ConstView<double> y, Kernel kernel)
    : kernel_(kernel) {
  constexpr std::string_view kFn = "KernelRegression";
  check_training_data(kFn, x, y, 1);
  if (kernel != Kernel::kGaussian && kernel != Kernel::kBoxcar && kernel != Kernel::kEpanechnikov &&
      kernel != Kernel::kTriangular) {
    fail(kFn, "kernel has value " + std::to_string(static_cast<int>(kernel)) +
                  "; expected Kernel::kGaussian, kBoxcar, kEpanechnikov or kTriangular");
  }
  x_ = as_matrix(x);
  y_ = as_matrix(y);
  n_ = x_.size(0);
  p_ = x_.size(1);
  m_ = y_.size(1);
  y_was_1d_ = y.rank() == 1;
  bandwidth_.assign(static_cast<size_t>(p_), 1.0);
  if (p_ == 1) {
    std::vector<int64_t> order(static_cast<size_t>(n_));
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return x_(a, 0) < x_(b, 0); });
    sorted_x_.resize(static_cast<size_t>(n_));
    sorted_y_ = Tensor<double>(Shape{n_, m_});
    for (int64_t i = 0; i < n_; ++i) {
      sorted_x_[i] = x_(order[i], 0);
      for (int64_t k = 0; k < m_; ++k) sorted_y_(i, k) = y_(order[i], k);
    }
  }
}

int64_t KernelRegression::num_points() const { return n_; }
int64_t KernelRegression::num_features() const { return p_; }
int64_t KernelRegression::num_outputs() const { return m_; }

void KernelRegression::set_bandwidth(double h) {
  const std::string problem = bandwidth_problem(h);
  if (!problem.empty()) fail("KernelRegression::set_bandwidth", "h = " + num(h) + "; " + problem);
  bandwidth_.assign(static_cast<size_t>(p_), h);
}

void KernelRegression::set_bandwidth(const std::vector<double>& h) {
  check_bandwidth("KernelRegression::set_bandwidth", h, p_);
  bandwidth_ = h;
}

KernelPrediction KernelRegression::predict(ConstView<double> queries, bool exact) const {
  constexpr std::string_view kFn = "KernelRegression::predict";
  const Tensor<double> q = checked_queries(kFn, queries, p_, x_.shape());
  const int64_t t = q.size(0);
  KernelPrediction result;
  Tensor<double> out(Shape{t, m_});
  const bool fast_1d = kernels::fast::gauss1d_supports(kernel_, p_) && !exact &&
                       static_cast<double>(n_) * static_cast<double>(t) > kFastPathMinWork;
  const int y_exp = prediction_y_exponent(y_);
  if (fast_1d) {
    predict_gauss1d(sorted_x_, y_exp == 0 ? sorted_y_ : scaled_copy(sorted_y_, y_exp), q,
                    bandwidth_[0], out);
    result.used_fast_path = true;
  } else {
    const Tensor<double> y_scaled = y_exp == 0 ? Tensor<double>() : scaled_copy(y_, y_exp);
    const std::vector<double> inv_h = inverse(bandwidth_);
    const kernels::NwData d = nw_data(x_, y_exp == 0 ? y_ : y_scaled, inv_h, kernel_);
    result.num_undefined = predict_exact(d, q, out.data(), nullptr);
  }
  if (y_exp != 0) {
    for (double& v : out.values()) v = std::ldexp(v, y_exp);
  }
  result.values = shaped_output(std::move(out), y_was_1d_);
  return result;
}

Tensor<double> KernelRegression::weights(ConstView<double> queries) const {
  constexpr std::string_view kFn = "KernelRegression::weights";
  const Tensor<double> q = checked_queries(kFn, queries, p_, x_.shape());
  const int64_t t = q.size(0);
  Tensor<double> w(Shape{t, n_});
  Tensor<double> out(Shape{t, m_});
  const std::vector<double> inv_h = inverse(bandwidth_);
  predict_exact(nw_data(x_, y_, inv_h, kernel_), q, out.data(), w.data());
  return w;
}

double KernelRegression::loo_error() const { return loo_error(bandwidth_); }

double KernelRegression::loo_error(const std::vector<double>& bandwidth) const {
  check_bandwidth("KernelRegression::loo_error", bandwidth, p_);
  const LooObjective f(x_, y_, kernel_, false);
  // Back to y's own scale: +inf when the mean square exceeds DBL_MAX.
  return std::ldexp(f(inverse(bandwidth), nullptr), 2 * f.y_exponent());
}

// ---- bandwidth selection -------------------------------------------------------------

std::vector<double> silverman_bandwidth(ConstView<double> x) {
  return rule_of_thumb("silverman_bandwidth", x, Rule::kSilverman);
}

std::vector<double> scott_bandwidth(ConstView<double> x) {
  return rule_of_thumb("scott_bandwidth", x, Rule::kScott);
}

// 1. Scott's rule, then a scan of common factors 2^(k/4), k = -24..24, of it
//    (the objective can have several local minima; this picks the basin).
// 2. Gaussian: BFGS on log h from the best scan point, analytic gradient;
//    for p > 1 then Nelder-Mead from statsmodels' cv_ls start (its own
//    search, BFGS again from any improvement), and per-feature scans of the
//    same factors, restarting BFGS from any improvement (up to 3 rounds).
//    Compact kernels: coordinate descent, per feature a scan of +-2 in log h
//    at steps of ln 2 / 8, then golden section between the best point's
//    neighbours; up to 4 sweeps (1 for p = 1).
// Every candidate goes through BestPoint (src/regression/optimize.h), so the
// result is never worse than the start. iterations: BFGS iterations, or
// coordinate line searches.
CvResult cv_bandwidth(const KernelRegression& model, const CvProgress& progress) {
  constexpr std::string_view kFn = "cv_bandwidth";
  if (model.n_ < 2) {
    fail(kFn, "x has shape " + model.x_.shape().str() +
                  "; leave-one-out cross-validation needs at least 2 points");
  }
  const std::vector<double> h0 = rule_of_thumb(kFn, model.x_.view(), Rule::kScott);
  LooObjective scaled(model.x_, model.y_, model.kernel_, true);
  const size_t p = h0.size();
  // Progress in points of the leave-one-out evaluations (n each). Their
  // number is known only as the search ends: the estimate is the scan's 49
  // plus what the search after it typically takes (kTypicalSearchEvaluations),
  // raised to one more whenever the search runs past it.
  const int64_t n = model.n_;
  int64_t points_done = 0, evaluations_started = 0;
  int64_t evaluations_expected = 49 + typical_search_evaluations(model.kernel_, p);
  if (progress) {
    scaled.on_points([&](int64_t points) {
      points_done += points;
      progress(points_done, evaluations_expected * n);
    });
  }
  // The search variable is u = log(h / h0), h0 Scott's bandwidth: with x
  // scaled by 2^e, h0 and every 1/h tried scale by 2^-e exactly, so the
  // search visits the same u and returns h times 2^e bit for bit (a search on
  // log h itself rounds differently at each scale, and the compact kernels'
  // piecewise objective then settles on another piece: seen 0.138 against
  // 0.078 at 2^1000). Bandwidths outside the normal doubles in x's own units
  // are never candidates (+inf).
  const double log_h_min = std::log(kMinBandwidth);
  const double log_h_max = std::log(std::numeric_limits<double>::max());
  std::vector<double> log_h0(p), inv_h0(p);
  for (size_t c = 0; c < p; ++c) {
    log_h0[c] = std::log(h0[c]);
    inv_h0[c] = 1.0 / std::ldexp(h0[c], -scaled.x_exponent(c));
  }
  auto inverse_bandwidths = [&](const std::vector<double>& u) {
    std::vector<double> inv_h(p);
    for (size_t c = 0; c < p; ++c) inv_h[c] = inv_h0[c] * std::exp(-u[c]);
    return inv_h;
  };
  const Objective f = [&](const std::vector<double>& u, std::vector<double>* grad) {
    for (size_t c = 0; c < p; ++c) {
      const double log_h = log_h0[c] + u[c];
      if (!(log_h >= log_h_min + 1e-9 && log_h <= log_h_max - 1e-9)) {
        if (grad) grad->assign(p, 0.0);
        return kInf;
      }
    }
    evaluations_expected = std::max(evaluations_expected, ++evaluations_started + 1);
    return scaled(inverse_bandwidths(u), grad);
  };
  const std::vector<double> theta0(p, 0.0);
  BestPoint best;
  best.offer(theta0, f(theta0, nullptr));
  const double kQuarterLn2 = 0.25 * std::log(2.0);
  std::vector<double> t(p);
  for (int k = -24; k <= 24; ++k) {
    if (k == 0) continue;
    for (size_t c = 0; c < p; ++c) t[c] = theta0[c] + k * kQuarterLn2;
    best.offer(t, f(t, nullptr));
  }
  if (best.theta.empty()) {
    // Only compact kernels get here (the scaled Gaussian objective is finite
    // at every normal bandwidth): no point has a neighbour within reach.
    fail(kFn, "the leave-one-out error is undefined at all 49 bandwidths tried (Scott's " +
                  num(h0[0]) + (p > 1 ? " (feature 0)" : "") +
                  " times 2^(k/4), |k| <= 24): with the " +
                  std::string(kernel_name(model.kernel_)) +
                  " kernel no training point has another within reach (x has shape " +
                  model.x_.shape().str() + ")");
  }
  CvResult result;
  if (model.kernel_ == Kernel::kGaussian) {
    result.iterations = minimize_bfgs(f, best);
    if (p > 1) {
      // statsmodels' cv_ls search as one more start: Nelder-Mead on h from
      // 1.06 sd n^(-1/(4+p)) (sd with divisor n; Scott's rule here is 1.059
      // sd n^(-1/(4+p)) with divisor n - 1). With p > 1 the objective can
      // have basins joined only diagonally, which the scans and BFGS above
      // miss (seen: 2-D scales 2 and 0.05, n = 150, 0.5 % above cv_ls, twice
      // in about 20 draws); with this start qkv's search contains cv_ls's.
      const double n = static_cast<double>(model.n_);
      const double u_statsmodels = std::log(1.06 / 1.059) + 0.5 * std::log((n - 1.0) / n);
      const double f_before = best.f;
      minimize_nelder_mead(f, std::vector<double>(p, u_statsmodels), best, 1000);
      if (best.f < f_before) result.iterations += minimize_bfgs(f, best);
    }
    // With p > 1 the common-factor scan can pick the wrong basin for one
    // feature (seen: a 2-D case 3.6 % above a fine grid's best). Scan each
    // feature alone around the optimum and restart BFGS from any improvement.
    for (int round = 0; p > 1 && round < 3; ++round) {
      const double f_start = best.f;
      for (size_t c = 0; c < p; ++c) {
        const std::vector<double> center = best.theta;
        t = center;
        for (int k = -24; k <= 24; ++k) {
          if (k == 0) continue;
          t[c] = center[c] + k * kQuarterLn2;
          best.offer(t, f(t, nullptr));
        }
      }
      if (!(best.f < f_start * (1.0 - 1e-12))) break;
      result.iterations += minimize_bfgs(f, best);
    }
  } else {
    const double step = std::log(2.0) / 8.0;
    const int sweeps = p == 1 ? 1 : 4;
    for (int sweep = 0; sweep < sweeps; ++sweep) {
      const double f_start = best.f;
      for (size_t c = 0; c < p; ++c) {
        const std::vector<double> center = best.theta;
        t = center;
        for (int k = -16; k <= 16; ++k) {
          t[c] = center[c] + k * step;
          best.offer(t, f(t, nullptr));
        }
        const double mid = best.theta[c];
        golden_section_search(f, best, c, mid - step, mid + step);
        ++result.iterations;
      }
      if (!(best.f < f_start * (1.0 - 1e-12))) break;
    }
  }
  result.bandwidth.resize(p);
  const std::vector<double> inv_h = inverse_bandwidths(best.theta);
  for (size_t c = 0; c < p; ++c) {
    result.bandwidth[c] = std::ldexp(1.0 / inv_h[c], scaled.x_exponent(c));
  }
  // The error at the result, in y's own units (KernelRegression::loo_error),
  // reporting progress as the search's evaluations did.
  LooObjective unscaled(model.x_, model.y_, model.kernel_, false);
  if (progress) {
    unscaled.on_points([&](int64_t points) {
      points_done += points;
      progress(points_done, std::max(evaluations_expected * n, points_done + (points_done < n)));
    });
  }
  result.loo_error =
      std::ldexp(unscaled(inverse(result.bandwidth), nullptr), 2 * unscaled.y_exponent());
  if (progress) progress(points_done, points_done);
  return result;
}

// The scan of cv_bandwidth (Scott's rule times 2^(k/4), |k| <= 24), then a
// golden-section search between the best point's neighbours: 49 + 42
// evaluations of the fast objective, O(n log n) each, no gradient (the fast
// path gives none).
CvResult cv_bandwidth_fast_1d(const KernelRegression& model, const CvProgress& progress) {
  constexpr std::string_view kFn = "cv_bandwidth_fast_1d";
  if (!kernels::fast::gauss1d_supports(model.kernel_, model.p_)) {
    fail(kFn, "the fast path takes one feature and the Gaussian kernel; the model has " +
                  std::to_string(model.p_) + " feature" + (model.p_ == 1 ? "" : "s") + " and the " +
                  std::string(kernel_name(model.kernel_)) + " kernel (use cv_bandwidth)");
  }
  if (model.n_ < 2) {
    fail(kFn, "x has shape " + model.x_.shape().str() +
                  "; leave-one-out cross-validation needs at least 2 points");
  }
  const double h0 = rule_of_thumb(kFn, model.x_.view(), Rule::kScott)[0];
  const FastLooObjective loo(model.sorted_x_, model.sorted_y_);
  const int64_t n = model.n_, total = 91 * n;
  int64_t done = 0;
  const Objective f = [&](const std::vector<double>& u, std::vector<double>*) {
    const double h = h0 * std::exp(u[0]);
    if (!(h >= kMinBandwidth && h <= std::numeric_limits<double>::max())) return kInf;
    const double value = loo(h);
    done += n;
    if (progress) progress(std::min(done, total - 1), total);
    return value;
  };
  BestPoint best;
  const double kQuarterLn2 = 0.25 * std::log(2.0);
  for (int k = -24; k <= 24; ++k) best.offer({k * kQuarterLn2}, f({k * kQuarterLn2}, nullptr));
  const double mid = best.theta[0];
  golden_section_search(f, best, 0, mid - kQuarterLn2, mid + kQuarterLn2);
  CvResult result;
  result.bandwidth = {h0 * std::exp(best.theta[0])};
  result.loo_error = std::ldexp(best.f, 2 * loo.y_exponent());
  result.iterations = 1;
  if (progress) progress(total, total);
  return result;
}

// ---- the chapter's estimators ----------------------------------------------------------

Tensor<double> average_pooling_regression(ConstView<double> y, int64_t num_queries) {
  constexpr std::string_view kFn = "average_pooling_regression";
  check_rank_1_or_2(kFn, "y", y, "(n)", "(n, m)");
  if (y.size(0) < 1) fail(kFn, "y has shape " + y.shape().str() + "; expected at least 1 point");
  if (num_queries < 0) {
    fail(kFn, "num_queries = " + std::to_string(num_queries) + "; expected >= 0");
  }
  check_finite(kFn, "y", y);
  const Tensor<double> ym = as_matrix(y);
  const int64_t n = ym.size(0), m = ym.size(1);
  std::vector<double> mean(static_cast<size_t>(m), 0.0);
  for (int64_t k = 0; k < m; ++k) {
    for (int64_t i = 0; i < n; ++i) mean[k] += ym(i, k);
    mean[k] /= static_cast<double>(n);
  }
  Tensor<double> out(Shape{num_queries, m});
  for (int64_t i = 0; i < num_queries; ++i) {
    for (int64_t k = 0; k < m; ++k) out(i, k) = mean[k];
  }
  return shaped_output(std::move(out), y.rank() == 1);
}

double parametric_loss(ConstView<double> x, ConstView<double> y, double w, double* grad) {
  constexpr std::string_view kFn = "parametric_loss";
  check_training_data(kFn, x, y, 2);
  if (!std::isfinite(w)) fail(kFn, "w = " + num(w) + "; expected a finite value");
  const Tensor<double> xm = as_matrix(x), ym = as_matrix(y);
  return parametric_loss_of(xm, ym, w, grad);
}

ParametricResult train_parametric(ConstView<double> x, ConstView<double> y,
                                  const ParametricOptions& options) {
  constexpr std::string_view kFn = "train_parametric";
  check_training_data(kFn, x, y, 2);
  if (options.epochs < 0) {
    fail(kFn, "options.epochs = " + std::to_string(options.epochs) + "; expected >= 0");
  }
  if (!std::isfinite(options.lr)) {
    fail(kFn, "options.lr = " + num(options.lr) + "; expected a finite value");
  }
  if (options.initial_w && !std::isfinite(*options.initial_w)) {
    fail(kFn, "options.initial_w = " + num(*options.initial_w) + "; expected a finite value");
  }
  const Tensor<double> xm = as_matrix(x), ym = as_matrix(y);
  double w;
  if (options.initial_w) {
    w = *options.initial_w;
  } else {
    // U(0, 1) from the seed: 53 random bits of a splitmix64 step.
    uint64_t z = options.seed + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    w = static_cast<double>(z >> 11) * 0x1.0p-53;
  }
  ParametricResult result;
  for (int epoch = 0; epoch < options.epochs; ++epoch) {
    double grad = 0.0;
    const double loss = parametric_loss_of(xm, ym, w, &grad);
    if (!std::isfinite(loss) || !std::isfinite(grad)) {
      // The loss sums squared errors of y, its gradient those times squared
      // differences of x: in float64 they overflow for |y| or |x_i - x_j|
      // beyond ~1e154. SGD's steps depend on the loss's scale, so rescaling
      // inside would train another model: the caller has to rescale.
      fail(kFn, "the loss at epoch " + std::to_string(epoch + 1) + " is " + num(loss) +
                    " and its gradient " + num(grad) + " (w = " + num(w) +
                    "): not finite in float64, where squared errors of y (max |y| = " +
                    num(max_abs(ym.data(), ym.numel())) + ") and squared differences of x (" +
                    "max |x| = " + num(max_abs(xm.data(), xm.numel())) +
                    ") overflow beyond ~1e154; rescale y or x");
    }
    result.losses.push_back(loss);
    result.ws.push_back(w);
    w -= options.lr * grad;
    if (!std::isfinite(w)) {
      fail(kFn, "w diverged to " + num(w) + " at epoch " + std::to_string(epoch + 1) + " (lr " +
                    num(options.lr) + "); use a smaller learning rate");
    }
  }
  result.w = w;
  return result;
}

Tensor<double> parametric_predict(ConstView<double> x, ConstView<double> y, double w,
                                  ConstView<double> queries) {
  constexpr std::string_view kFn = "parametric_predict";
  check_training_data(kFn, x, y, 1);
  if (!std::isfinite(w)) fail(kFn, "w = " + num(w) + "; expected a finite value");
  const Tensor<double> xm = as_matrix(x), ym = as_matrix(y);
  const int64_t p = xm.size(1), m = ym.size(1);
  const Tensor<double> q = checked_queries(kFn, queries, p, x.shape());
  const std::vector<double> inv_h(static_cast<size_t>(p), std::abs(w));
  const int y_exp = prediction_y_exponent(ym);
  const Tensor<double> y_scaled = scaled_copy(ym, y_exp);
  Tensor<double> out(Shape{q.size(0), m});
  predict_exact(nw_data(xm, y_scaled, inv_h, Kernel::kGaussian), q, out.data(), nullptr);
  if (y_exp != 0) {
    for (double& v : out.values()) v = std::ldexp(v, y_exp);
  }
  return shaped_output(std::move(out), y.rank() == 1);
}

}  // namespace qkv
