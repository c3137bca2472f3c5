// Nadaraya–Watson kernel regression: attention pooling by similarity
// (d2l §11.2). Queries are where we predict, keys (x) where we observed,
// values (y) what we observed:
//   f(q) = sum_i K((q - x_i) / h) y_i / sum_j K((q - x_j) / h)
// Everything here is float64: statistics users compare against float64 tools.
//   x: (n) or (n, p)   y: (n) or (n, m)   queries: (t) or (t, p)
//   predictions: (t) when y is (n), else (t, m)   weights: (t, n)
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>
#include <vector>

#include "qkv/kernel_regression_types.h"
#include "qkv/tensor.h"

namespace qkv {

// Kernel (gaussian, boxcar, epanechnikov, triangular): qkv/kernel_regression_types.h.

// "gaussian", "boxcar" (also "uniform"), "epanechnikov", "triangular";
// throws Error naming the accepted names otherwise.
Kernel kernel_from_name(std::string_view name);
std::string_view kernel_name(Kernel kernel);

struct KernelPrediction {
  Tensor<double> values;        // (t) or (t, m)
  int64_t num_undefined = 0;    // compact kernels: queries with no key in reach (NaN rows)
  bool used_fast_path = false;  // true if the 1-D Gaussian fast algorithm served the call
};

struct CvResult;
using CvProgress = std::function<void(int64_t done, int64_t total)>;

class KernelRegression {
 public:
  // Copies x and y. Throws Error for mismatched n, n = 0, ranks other than 1
  // or 2, or NaN/inf anywhere in x or y (naming the first bad index).
  KernelRegression(ConstView<double> x, ConstView<double> y, Kernel kernel = Kernel::kGaussian);

  int64_t num_points() const;    // n
  int64_t num_features() const;  // p (1 for 1-D x)
  int64_t num_outputs() const;   // m (1 for 1-D y)
  Kernel kernel() const { return kernel_; }

  // Bandwidth h: finite and at least the smallest normal double,
  // 2.2250738585072014e-308 (a subnormal h is an Error: 1/h^2 overflows),
  // one value for every feature, or one per feature. Initially 1.0.
  void set_bandwidth(double h);
  void set_bandwidth(const std::vector<double>& h);
  const std::vector<double>& bandwidth() const { return bandwidth_; }

  // Predictions at the queries with the current bandwidth. The Gaussian
  // kernel is evaluated as a softmax of -sum_c u_c^2 / 2, so a query far from
  // every key gets its nearest keys' values, never 0/0, for any finite data
  // and bandwidth: a query more than ~32768 bandwidths from every key (or
  // whose scores overflow, up to |q - x| / h ~ 1e616) is evaluated from
  // exact differences of the scores, so the truly nearest key wins even
  // where float64 distances tie (a query at 1e308, keys 0 and 5). y of any
  // magnitude: weighted sums are formed on y scaled by a power of two when
  // they could overflow (max |y| n beyond 2^1000). For 1-D x with the
  // Gaussian kernel and no `exact`, an O((n + t) log n) algorithm with max
  // relative error <= 1e-7 (docs/regression.md) serves large problems
  // (n * t > 1e6); used_fast_path says when it did.
  KernelPrediction predict(ConstView<double> queries, bool exact = false) const;

  // The attention weights (t, n), columns in the order x was given; rows sum
  // to 1, or are NaN for compact-kernel queries with no key in reach.
  Tensor<double> weights(ConstView<double> queries) const;

  // Leave-one-out squared error: mean over i of ||f_{-i}(x_i) - y_i||^2,
  // where f_{-i} leaves out point i (statsmodels' cv_ls objective, divided by
  // n). Points whose leave-one-out estimate is undefined (compact kernels)
  // are skipped; if all are, the result is +inf. It is also +inf when the
  // error exceeds the largest double (|y| beyond ~1e154): the squares are
  // summed for y scaled by a power of two and scaled back.
  double loo_error() const;
  double loo_error(const std::vector<double>& bandwidth) const;

 private:
  friend CvResult cv_bandwidth(const KernelRegression& model, const CvProgress& progress);
  friend CvResult cv_bandwidth_fast_1d(const KernelRegression& model, const CvProgress& progress);

  Kernel kernel_;
  int64_t n_ = 0, p_ = 0, m_ = 0;
  bool y_was_1d_ = false;
  Tensor<double> x_;  // (n, p)
  Tensor<double> y_;  // (n, m)
  std::vector<double> bandwidth_;
  // 1-D x only: the keys sorted ascending (stable) and y permuted alike, for
  // the 1-D Gaussian fast algorithm.
  std::vector<double> sorted_x_;
  Tensor<double> sorted_y_;  // (n, m)
};

// ---- bandwidth selection ------------------------------------------------------

// Rules of thumb, one bandwidth per feature, from the feature's standard
// deviation s and interquartile range IQR:
//   silverman: 0.9 * min(s, IQR / 1.349) * n^(-1/5)   (Silverman 1986, eq. 3.31)
//   scott:     1.059 * s * n^(-1/(p + 4))            (Scott 1992)
// s divides by n - 1; IQR is the difference of the 75th and 25th percentiles
// with linear interpolation (numpy.percentile's default). Silverman uses s
// alone when IQR = 0. Needs n >= 2; a constant feature is an Error naming it,
// and so is one whose bandwidth would be subnormal (a spread like 2e-320)
// or beyond the largest double. Exact for x of any magnitude (computed on
// the feature scaled by a power of two).
std::vector<double> silverman_bandwidth(ConstView<double> x);
std::vector<double> scott_bandwidth(ConstView<double> x);

struct CvResult {
  std::vector<double> bandwidth;  // the minimiser
  double loo_error = 0;           // KernelRegression::loo_error at it
  int iterations = 0;  // quasi-Newton iterations (Gaussian), coordinate line searches (compact)
};

// Leave-one-out cross-validation (statsmodels' cv_ls): minimises loo_error
// over the bandwidth, starting from Scott's rule, by a quasi-Newton search on
// log h with the analytic gradient (Gaussian) — not a grid of refits. A scan
// of common factors 2^(k/4), |k| <= 24, of Scott's bandwidth picks the start;
// compact kernels (piecewise smooth objective) use coordinate descent with a
// golden-section search per feature instead. Never worse than Scott's rule.
// The search runs on x (per feature) and y scaled by powers of two when they
// lie beyond 2^+-400 in magnitude, so it finds the same bandwidth for y ~
// 1e160 (whose squared errors overflow) as for y ~ 1; CvResult::loo_error is
// then +inf if the error itself exceeds the largest double. Only normal
// bandwidths are candidates. Needs n >= 2 and Scott's rule (an Error for a
// constant feature or a subnormal spread); an Error too if the error is
// undefined at every bandwidth scanned (compact kernels, no neighbours).
// Each evaluation of the error costs n^2 kernel evaluations (about 65 of them
// for 1-D data: 64 at n = 3000 took 3.25 s of CPU time, 5.6 ns a pair). `progress`, when given, is
// called on the calling thread every 2^26 kernel evaluations or so with the
// points done and an estimate of the total (n per evaluation of the error;
// the number of evaluations is known only when the search ends, so the total
// is the scan's 49 plus a typical search, raised as the search runs past
// it); the last call has done == total. The result is the same bits with or
// without it.
CvResult cv_bandwidth(const KernelRegression& model, const CvProgress& progress = {});

// The same objective for one feature and the Gaussian kernel through the fast
// 1-D path (docs/regression.md): every point's leave-one-out estimate from
// one O(n log n) evaluation at all the keys (points whose neighbours are
// far, summed exactly), each within about 1e-9 max|y| of cv_bandwidth's, so
// the errors agree to about that and the bandwidths closely (2e-8 relative at
// n = 3000; the tests hold them within 2e-3, the minimum being flat, and the
// exact error at this one within 1e-7 of cv_bandwidth's). No gradient: the
// scan of cv_bandwidth, then a golden-section search between the best scan
// point's neighbours (91 evaluations; n = 200,000 in seconds where
// cv_bandwidth takes hours). loo_error is the fast objective's at the result.
// An Error for other kernels or several features, and as cv_bandwidth's.
CvResult cv_bandwidth_fast_1d(const KernelRegression& model, const CvProgress& progress = {});

// ---- the chapter's estimators ---------------------------------------------------

// Average pooling: every query gets the mean of y. (t) or (t, m).
Tensor<double> average_pooling_regression(ConstView<double> y, int64_t num_queries);

// The chapter's parametric model: Gaussian scores -((q - x_i) w)^2 / 2, i.e.
// h = 1/|w|, with w learned by full-batch SGD on the leave-one-out loss
// sum_i ||f_{-i}(x_i) - y_i||^2 (each training point's own pair excluded).
struct ParametricOptions {
  int epochs = 5;
  double lr = 0.5;
  // Initial w; d2l draws torch.rand(1), U(0, 1): by default so do we, from seed.
  std::optional<double> initial_w;
  uint64_t seed = 0;
};

struct ParametricResult {
  double w = 0;                // the learned weight (bandwidth 1/|w|)
  std::vector<double> losses;  // the loss at the start of each epoch, before its step
  std::vector<double> ws;      // w at the start of each epoch
};

// The parametric loss sum_i ||f_{-i}(x_i) - y_i||^2 at w and its exact
// analytic derivative d loss / d w (written to *grad if not null). n >= 2.
// Non-finite when the squares overflow float64 (|y| or |x_i - x_j| beyond
// ~1e154); train_parametric then throws an Error saying so.
double parametric_loss(ConstView<double> x, ConstView<double> y, double w, double* grad = nullptr);

ParametricResult train_parametric(ConstView<double> x, ConstView<double> y,
                                  const ParametricOptions& options = {});

// Predictions of the parametric model with weight w at the queries (the
// Gaussian estimator with h = 1/|w|).
Tensor<double> parametric_predict(ConstView<double> x, ConstView<double> y, double w,
                                  ConstView<double> queries);

}  // namespace qkv
