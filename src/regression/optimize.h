// Minimisers for the bandwidth search of kernel regression
// (src/regression/kernel_regression.cc): quasi-Newton (BFGS) with a backtracking line
// search, and a golden-section search along one coordinate. Small p (one
// variable per feature); every point tried is offered to a BestPoint, so a
// search never ends worse than where it started.
#pragma once

#include <cstddef>
#include <functional>
#include <limits>
#include <vector>

namespace qkv {

// f(theta) and, when grad is not null, its gradient (resized to theta's
// size). May return +inf (a point outside the domain).
using Objective =
    std::function<double(const std::vector<double>& theta, std::vector<double>* grad)>;

// The best point seen so far (theta empty until a finite value is offered).
struct BestPoint {
  std::vector<double> theta;
  double f = std::numeric_limits<double>::infinity();
  void offer(const std::vector<double>& t, double v) {
    if (v < f) {
      f = v;
      theta = t;
    }
  }
};

// BFGS on the inverse Hessian from best.theta, with an Armijo backtracking
// line search; the first step at most 0.5 in any coordinate, every step at
// most 2 (made for theta = log h: factors e^0.5 and e^2). At most 200
// iterations; stops when the gradient is zero to rounding, the step below
// 1e-10 or the decrease below 1e-15 relative. Returns the iterations made.
int minimize_bfgs(const Objective& f, BestPoint& best);

// Golden-section search of coordinate c on [lo, hi] from best.theta (the
// other coordinates fixed), 40 steps (the bracket shrinks to 0.618^40 ~
// 4e-9 of its width).
void golden_section_search(const Objective& f, BestPoint& best, size_t c, double lo, double hi);

// Nelder-Mead on x = exp(theta) (for theta = log h: on h itself), from x0 =
// exp(theta0) with the initial simplex x0 and x0 with one coordinate times
// 1.05, and the usual coefficients (reflect 1, expand 2, contract 1/2,
// shrink 1/2): scipy's optimize.fmin, which statsmodels' cv_ls runs on h, so
// a search that includes this start finds its basin. A vertex with some
// x <= 0 is +inf. Every point tried is offered to `best`. At most max_evals
// evaluations; stops sooner when the simplex spans less than 1e-10 of x0 in
// every coordinate and its values agree to 1e-13 relative. Returns the
// evaluations made.
int minimize_nelder_mead(const Objective& f, const std::vector<double>& theta0, BestPoint& best,
                         int max_evals);

}  // namespace qkv
