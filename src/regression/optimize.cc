// Minimisers for the bandwidth search (src/regression/optimize.h): BFGS with an Armijo
// line search, and golden-section search along one coordinate.
#include "regression/optimize.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace qkv {
namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();
}  // namespace

int minimize_bfgs(const Objective& f, BestPoint& best) {
  const size_t p = best.theta.size();
  std::vector<double> theta = best.theta, g, g_new, theta_new(p), s(p), yv(p), d(p), hy(p);
  double fx = f(theta, &g);
  best.offer(theta, fx);
  std::vector<double> hinv(p * p, 0.0);
  for (size_t c = 0; c < p; ++c) hinv[c * p + c] = 1.0;
  bool scaled = false;
  int iter = 0;
  for (; iter < 200; ++iter) {
    double gmax = 0.0;
    for (double gc : g) gmax = std::max(gmax, std::abs(gc));
    if (gmax <= 1e-12 * std::max(fx, 1e-300)) break;  // stationary to rounding
    double slope = 0.0;
    for (size_t a = 0; a < p; ++a) {
      d[a] = 0.0;
      for (size_t b = 0; b < p; ++b) d[a] -= hinv[a * p + b] * g[b];
      slope += d[a] * g[a];
    }
    if (!(slope < 0.0)) {  // lost descent: restart from steepest descent
      std::fill(hinv.begin(), hinv.end(), 0.0);
      for (size_t c = 0; c < p; ++c) hinv[c * p + c] = 1.0;
      scaled = false;
      for (size_t a = 0; a < p; ++a) d[a] = -g[a];
      slope = 0.0;
      for (size_t a = 0; a < p; ++a) slope += d[a] * g[a];
    }
    double dmax = 0.0;
    for (double v : d) dmax = std::max(dmax, std::abs(v));
    if (!scaled && dmax > 0.0) {  // first step: at most a factor e^0.5 in h
      const double k = std::min(1.0, 0.5 / dmax);
      for (double& v : d) v *= k;
      slope *= k;
      dmax *= k;
    }
    if (dmax > 2.0) {
      const double k = 2.0 / dmax;
      for (double& v : d) v *= k;
      slope *= k;
    }
    double alpha = 1.0, f_new = kInf;
    bool accepted = false;
    for (int back = 0; back < 60; ++back) {
      for (size_t a = 0; a < p; ++a) theta_new[a] = theta[a] + alpha * d[a];
      f_new = f(theta_new, nullptr);
      best.offer(theta_new, f_new);
      if (f_new <= fx + 1e-4 * alpha * slope) {
        accepted = true;
        break;
      }
      alpha *= 0.5;
    }
    if (!accepted) break;
    f(theta_new, &g_new);
    double sy = 0.0, yy = 0.0, smax = 0.0;
    for (size_t a = 0; a < p; ++a) {
      s[a] = theta_new[a] - theta[a];
      yv[a] = g_new[a] - g[a];
      sy += s[a] * yv[a];
      yy += yv[a] * yv[a];
      smax = std::max(smax, std::abs(s[a]));
    }
    const double f_old = fx;
    theta = theta_new;
    fx = f_new;
    g = g_new;
    if (sy > 1e-300 && yy > 0.0) {
      if (!scaled) {  // Nocedal & Wright (6.20): H0 = (s.y / y.y) I
        std::fill(hinv.begin(), hinv.end(), 0.0);
        for (size_t c = 0; c < p; ++c) hinv[c * p + c] = sy / yy;
        scaled = true;
      }
      // H <- (I - rho s y') H (I - rho y s') + rho s s'
      const double rho = 1.0 / sy;
      double yhy = 0.0;
      for (size_t a = 0; a < p; ++a) {
        hy[a] = 0.0;
        for (size_t b = 0; b < p; ++b) hy[a] += hinv[a * p + b] * yv[b];
        yhy += yv[a] * hy[a];
      }
      for (size_t a = 0; a < p; ++a) {
        for (size_t b = 0; b < p; ++b) {
          hinv[a * p + b] +=
              -rho * (s[a] * hy[b] + hy[a] * s[b]) + (rho * rho * yhy + rho) * s[a] * s[b];
        }
      }
    }
    if (smax < 1e-10 || f_old - fx <= 1e-15 * f_old) {
      ++iter;
      break;
    }
  }
  return iter;
}

void golden_section_search(const Objective& f, BestPoint& best, size_t c, double lo, double hi) {
  const double kInvPhi = 0.6180339887498949;
  std::vector<double> t = best.theta;
  auto eval = [&](double v) {
    t[c] = v;
    const double fv = f(t, nullptr);
    best.offer(t, fv);
    return fv;
  };
  double a = lo, b = hi;
  double x1 = b - kInvPhi * (b - a), x2 = a + kInvPhi * (b - a);
  double f1 = eval(x1), f2 = eval(x2);
  for (int it = 0; it < 40; ++it) {
    if (f1 <= f2) {
      b = x2;
      x2 = x1;
      f2 = f1;
      x1 = b - kInvPhi * (b - a);
      f1 = eval(x1);
    } else {
      a = x1;
      x1 = x2;
      f1 = f2;
      x2 = a + kInvPhi * (b - a);
      f2 = eval(x2);
    }
  }
}

int minimize_nelder_mead(const Objective& f, const std::vector<double>& theta0, BestPoint& best,
                         int max_evals) {
  const size_t p = theta0.size();
  int evals = 0;
  // The objective at x (> 0 in every coordinate) through theta = log x.
  std::vector<double> theta(p);
  auto value = [&](const std::vector<double>& x) {
    ++evals;
    for (size_t c = 0; c < p; ++c) {
      if (!(x[c] > 0.0)) return kInf;
      theta[c] = std::log(x[c]);
    }
    const double v = f(theta, nullptr);
    best.offer(theta, v);
    return std::isnan(v) ? kInf : v;
  };
  std::vector<std::vector<double>> simplex(p + 1, std::vector<double>(p));
  for (size_t c = 0; c < p; ++c) simplex[0][c] = std::exp(theta0[c]);
  for (size_t k = 0; k < p; ++k) {
    simplex[k + 1] = simplex[0];
    simplex[k + 1][k] *= 1.05;
  }
  std::vector<double> fs(p + 1);
  for (size_t i = 0; i <= p; ++i) fs[i] = value(simplex[i]);
  std::vector<size_t> order(p + 1);
  std::vector<double> centroid(p), xr(p), xe(p), xc(p);
  auto point = [&](double t, std::vector<double>& out) {  // centroid + t (centroid - worst)
    for (size_t c = 0; c < p; ++c) out[c] = centroid[c] + t * (centroid[c] - simplex[order[p]][c]);
  };
  while (evals < max_evals) {
    for (size_t i = 0; i <= p; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return fs[a] < fs[b]; });
    const std::vector<double>& lowest = simplex[order[0]];
    double spread = 0.0, fspread = 0.0;
    for (size_t i = 1; i <= p; ++i) {
      for (size_t c = 0; c < p; ++c) {
        spread = std::max(spread, std::abs(simplex[order[i]][c] - lowest[c]) / std::exp(theta0[c]));
      }
      fspread = std::max(fspread, std::abs(fs[order[i]] - fs[order[0]]));
    }
    if (spread <= 1e-10 && fspread <= 1e-13 * std::abs(fs[order[0]])) break;
    std::fill(centroid.begin(), centroid.end(), 0.0);
    for (size_t i = 0; i < p; ++i) {
      for (size_t c = 0; c < p; ++c) centroid[c] += simplex[order[i]][c] / static_cast<double>(p);
    }
    const size_t worst = order[p];
    point(1.0, xr);
    const double fr = value(xr);
    if (fr < fs[order[0]]) {
      point(2.0, xe);
      const double fe = value(xe);
      if (fe < fr) {
        simplex[worst] = xe;
        fs[worst] = fe;
      } else {
        simplex[worst] = xr;
        fs[worst] = fr;
      }
      continue;
    }
    if (fr < fs[order[p - 1]]) {
      simplex[worst] = xr;
      fs[worst] = fr;
      continue;
    }
    // Contract: outside when the reflection beat the worst, else inside.
    const bool outside = fr < fs[worst];
    point(outside ? 0.5 : -0.5, xc);
    const double fc = value(xc);
    if (outside ? fc <= fr : fc < fs[worst]) {
      simplex[worst] = xc;
      fs[worst] = fc;
      continue;
    }
    // Shrink towards the lowest vertex.
    for (size_t i = 1; i <= p; ++i) {
      std::vector<double>& v = simplex[order[i]];
      for (size_t c = 0; c < p; ++c) v[c] = lowest[c] + 0.5 * (v[c] - lowest[c]);
      fs[order[i]] = value(v);
    }
  }
  return evals;
}

}  // namespace qkv
