// The fast 1-D Gaussian Nadaraya–Watson kernel at n = t = 10^6: time per
// bandwidth (0.001 .. 10 x the data's spread) and the max relative error on
// 1000 sampled queries against exact float64 evaluation over all n keys.
//   nw_fast_scale [rel_tol=1e-7] [n=1000000] [threads=0 (qkv default)]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "kernels/regression/gauss1d_fast.h"
#include "qkv/simd.h"
#include "qkv/threads.h"

namespace {

// gauss1d as KernelRegression::predict calls it: the size query, a workspace
// allocated for the call, the kernel. Timed whole, as when the kernel
// allocated its own scratch.
const char* gauss1d(const std::vector<double>& keys, const std::vector<double>& values,
                    const double* queries, int64_t t, double h, double rel_tol, double* out) {
  const int64_t n = static_cast<int64_t>(keys.size());
  const int threads = qkv::num_threads();
  std::vector<double> workspace(qkv::kernels::fast::gauss1d_workspace_size(
      keys.data(), n, 1, queries, t, h, rel_tol, threads));
  return qkv::kernels::fast::gauss1d(keys.data(), values.data(), n, 1, queries, t, h, rel_tol, out,
                                     {.data = workspace.data(), .num_threads = threads});
}

// Exact softmax-form evaluation of one query over all keys: exponents
// relative to the nearest key, (xa - x)(2q - x - xa) / 2h^2 in long double,
// sums in long double. Returns the prediction and sum w|v| / sum w.
void exact_one(const std::vector<double>& keys, const std::vector<double>& values, double q,
               double h, double* pred, double* scale) {
  const int64_t n = static_cast<int64_t>(keys.size());
  const int64_t j = std::lower_bound(keys.begin(), keys.end(), q) - keys.begin();
  int64_t a = j == n ? n - 1 : j;
  if (j > 0 && (j == n || q - keys[j - 1] <= keys[j] - q)) a = j - 1;
  const long double xa = keys[a], lq = q;
  const long double inv = 1.0L / (2.0L * static_cast<long double>(h) * h);
  long double den = 0, num = 0, mag = 0;
  for (int64_t k = 0; k < n; ++k) {
    const long double x = keys[k];
    const double w = std::exp(-static_cast<double>((xa - x) * ((lq - x) + (lq - xa)) * inv));
    den += w;
    num += w * static_cast<long double>(values[k]);
    mag += w * std::abs(static_cast<long double>(values[k]));
  }
  *pred = static_cast<double>(num / den);
  *scale = static_cast<double>(mag / den);
}

}  // namespace

int main(int argc, char** argv) {
  qkv::set_simd_target_from_env();  // QKV_SIMD_TARGET caps the kernels' SIMD target
  const double rel_tol = argc > 1 ? std::atof(argv[1]) : 1e-7;
  const int64_t n = argc > 2 ? std::atoll(argv[2]) : 1000000;
  if (argc > 3) qkv::set_num_threads(std::atoi(argv[3]));
  const int64_t t = n;
  // The chapter's data at scale: x ~ U(0, 5) sorted, y = 2 sin x + x^0.8 + N(0, 0.5).
  std::mt19937_64 rng(20240611);
  std::uniform_real_distribution<double> ux(0.0, 5.0);
  std::normal_distribution<double> noise(0.0, 0.5);
  std::vector<double> keys(static_cast<size_t>(n)), values(keys.size()), queries(keys.size());
  for (double& x : keys) x = ux(rng);
  std::sort(keys.begin(), keys.end());
  for (int64_t j = 0; j < n; ++j) {
    values[j] = 2 * std::sin(keys[j]) + std::pow(keys[j], 0.8) + noise(rng);
  }
  for (double& q : queries) q = ux(rng);  // unsorted, inside the data
  const double spread = keys.back() - keys.front();
  std::vector<int64_t> sample(1000);
  for (int64_t& i : sample) i = std::uniform_int_distribution<int64_t>(0, t - 1)(rng);

  std::printf("n = t = %lld, spread %.4f, rel_tol %.1e, %d threads\n", static_cast<long long>(n),
              spread, rel_tol, qkv::num_threads());
  std::printf(
      "| h / spread | method | time (s) | max rel error (1000 queries) | exact path, "
      "extrapolated (s) |\n");
  std::printf("|---|---|---|---|---|\n");
  std::vector<double> sample_q(sample.size()), sample_out(sample.size());
  for (size_t s = 0; s < sample.size(); ++s) sample_q[s] = queries[sample[s]];
  std::vector<double> out(static_cast<size_t>(t));
  bool all_ok = true;
  for (double factor : {0.001, 0.01, 0.1, 1.0, 10.0}) {
    const double h = factor * spread;
    const auto start = std::chrono::steady_clock::now();
    const char* method = gauss1d(keys, values, queries.data(), t, h, rel_tol, out.data());
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    double worst = 0;
#pragma omp parallel for reduction(max : worst) schedule(dynamic, 8)
    for (size_t s = 0; s < sample.size(); ++s) {
      const int64_t i = sample[s];
      double pred, scale;
      exact_one(keys, values, queries[i], h, &pred, &scale);
      const double err = std::abs(out[i] - pred) / scale;
      worst = std::max(worst, std::isnan(err) ? INFINITY : err);
    }
    all_ok = all_ok && worst <= rel_tol;
    // The library's exact path (threaded, SIMD) on the sampled queries, scaled
    // to all t queries: what the fast paths save.
    const auto exact_start = std::chrono::steady_clock::now();
    gauss1d(keys, values, sample_q.data(), static_cast<int64_t>(sample_q.size()), h, 0.0,
            sample_out.data());
    const double exact_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - exact_start).count() *
        static_cast<double>(t) / static_cast<double>(sample_q.size());
    std::printf("| %g | %s | %.3f | %.2e | %.0f |\n", factor, method, seconds, worst,
                exact_seconds);
    std::fflush(stdout);
  }
  if (!all_ok) std::printf("FAILED: an error above rel_tol\n");
  return all_ok ? 0 : 1;
}
