// Exact Gaussian Nadaraya–Watson at issue 5's shape: 1-D, n = t = 30000,
// the chapter's data. Times KernelRegression::predict(q, exact = true)
// (median of `reps`), the fused small-dimension kernel it runs on in float64
// and float32, and reports the peak RSS growth and the max relative error of
// predict on 500 sampled queries against a long double plain loop.
// docs/regression.md (Exact evaluation) has the d2l PyTorch formulation it
// is compared with. Last, the kernels' exp alone on n * t arguments: the
// fused kernel's floor, since it makes one exp per (query, key).
//   bench_nw_exact [n=30000] [threads=0 (qkv default)] [reps=5] [h=1]
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "kernels/attention/small_dim_attention.h"
#include "qkv/kernel_regression.h"
#include "qkv/simd.h"
#include "qkv/threads.h"

namespace {

double peak_rss_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

// Process CPU time (all threads): with other jobs on the machine the wall
// time varies by 2x, the CPU time much less.
double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Timing {
  double wall = 0, cpu = 0;  // medians, seconds
};

template <class F>
Timing median_seconds(int reps, F&& f) {
  std::vector<double> walls, cpus;
  for (int r = 0; r < reps; ++r) {
    const double cpu0 = cpu_seconds();
    const auto start = std::chrono::steady_clock::now();
    f();
    walls.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    cpus.push_back(cpu_seconds() - cpu0);
  }
  std::sort(walls.begin(), walls.end());
  std::sort(cpus.begin(), cpus.end());
  return {walls[walls.size() / 2], cpus[cpus.size() / 2]};
}

// The fused kernel alone in type T: keys and queries (1, n, 1), scores
// -|q - k|^2 / (2 h^2).
template <class T>
Timing time_kernel(const std::vector<double>& x, const std::vector<double>& y,
                   const std::vector<double>& q, double h, int reps) {
  using namespace qkv;
  const int64_t n = static_cast<int64_t>(x.size()), t = static_cast<int64_t>(q.size());
  std::vector<T> xs(x.begin(), x.end()), ys(y.begin(), y.end()), qs(q.begin(), q.end());
  std::vector<T> out(static_cast<size_t>(t));
  const ValidLens lens;
  const kernels::AttentionConfig config{
      .valid_lens = lens, .scale = 0.5 / (h * h), .dropout = 0.0, .seed = 0};
  // The kernel's scratch, allocated once outside the timed calls.
  std::vector<double> workspace(kernels::fast::small_dim_workspace_size<T>(1, n, 1, 1, false));
  return median_seconds(reps, [&] {
    kernels::fast::small_dim_forward<T>(ConstView<T>(qs.data(), Shape{1, t, 1}),
                                        ConstView<T>(xs.data(), Shape{1, n, 1}),
                                        ConstView<T>(ys.data(), Shape{1, n, 1}), nullptr,
                                        kernels::fast::ScoreKind::kNegSquaredDistance, config,
                                        TensorView<T>(out.data(), Shape{1, t, 1}), TensorView<T>(),
                                        {.data = workspace.data(), .num_threads = 1});
  });
}

// The kernels' exp alone (kernels::fast::exp_non_positive, one thread) on
// count arguments in [-12.5, 0] (the range of the chapter's -|q - k|^2 / 2),
// 4096 at a time from L1: the exact kernel makes one exp per (query, key),
// so this is its floor at D = 1.
template <class T>
Timing time_exp(int64_t count, int reps) {
  constexpr int64_t kChunk = 4096;
  std::vector<T> args(kChunk), out(kChunk);
  for (int64_t i = 0; i < kChunk; ++i)
    args[i] = static_cast<T>(-12.5 * static_cast<double>(i) / kChunk);
  return median_seconds(reps, [&] {
    for (int64_t done = 0; done < count; done += kChunk) {
      qkv::kernels::fast::exp_non_positive(args.data(), out.data(), std::min(kChunk, count - done));
    }
  });
}

}  // namespace

int main(int argc, char** argv) {
  qkv::set_simd_target_from_env();  // QKV_SIMD_TARGET caps the kernels' SIMD target
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 30000;
  if (argc > 2 && std::atoi(argv[2]) > 0) qkv::set_num_threads(std::atoi(argv[2]));
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  const double h = argc > 4 ? std::atof(argv[4]) : 1.0;
  const int64_t t = n;
  // d2l §11.2: x ~ U(0, 5) sorted, y = 2 sin x + x^0.8 + N(0, 0.5), queries
  // arange(0, 5, 5 / t).
  std::mt19937_64 rng(20240611);
  std::uniform_real_distribution<double> ux(0.0, 5.0);
  std::normal_distribution<double> noise(0.0, 0.5);
  std::vector<double> x(static_cast<size_t>(n)), y(x.size()), q(static_cast<size_t>(t));
  for (double& v : x) v = ux(rng);
  std::sort(x.begin(), x.end());
  for (int64_t j = 0; j < n; ++j) y[j] = 2 * std::sin(x[j]) + std::pow(x[j], 0.8) + noise(rng);
  for (int64_t i = 0; i < t; ++i) q[i] = 5.0 * static_cast<double>(i) / static_cast<double>(t);

  const double rss_before = peak_rss_mib();
  qkv::KernelRegression model(qkv::ConstView<double>(x.data(), qkv::Shape{n}),
                              qkv::ConstView<double>(y.data(), qkv::Shape{n}));
  model.set_bandwidth(h);
  const qkv::ConstView<double> queries(q.data(), qkv::Shape{t});
  qkv::Tensor<double> pred;
  const Timing predict_s =
      median_seconds(reps, [&] { pred = model.predict(queries, true).values; });
  const double rss_after = peak_rss_mib();

  // Max relative error (to the weighted mean of |y|) on sampled queries.
  double worst = 0.0;
  for (int s = 0; s < 500; ++s) {
    const int64_t i = (static_cast<int64_t>(s) * 7919) % t;
    long double best = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      const long double u = (static_cast<long double>(q[i]) - x[j]) / h;
      best = std::max(best, -u * u / 2);
    }
    long double den = 0, num = 0, mag = 0;
    for (int64_t j = 0; j < n; ++j) {
      const long double u = (static_cast<long double>(q[i]) - x[j]) / h;
      const long double w = std::exp(-u * u / 2 - best);
      den += w;
      num += w * y[j];
      mag += w * std::abs(static_cast<long double>(y[j]));
    }
    worst = std::max(worst, static_cast<double>(std::abs(pred(i) - num / den) / (mag / den)));
  }

  const Timing kernel64_s = time_kernel<double>(x, y, q, h, reps);
  const Timing kernel32_s = time_kernel<float>(x, y, q, h, reps);
  const int64_t count = n * t;
  const Timing exp64_s = time_exp<double>(count, reps);
  const Timing exp32_s = time_exp<float>(count, reps);
  const double evals = static_cast<double>(n) * static_cast<double>(t);
  std::printf("n = t = %lld, h = %g, threads %d, median of %d\n", static_cast<long long>(n), h,
              qkv::num_threads(), reps);
  std::printf(
      "predict(exact) float64: %.4f s wall, %.4f s cpu (%.2f G kernel evaluations/s), max rel "
      "err %.2g\n",
      predict_s.wall, predict_s.cpu, evals / predict_s.wall * 1e-9, worst);
  std::printf("peak RSS growth over predict: %.1f MiB (data x, y, q: %.1f MiB)\n",
              rss_after - rss_before, 3.0 * static_cast<double>(n) * 8.0 / (1 << 20));
  std::printf("kernels::fast::small_dim_forward float64: %.4f s wall, %.4f s cpu (%.2f G/s)\n",
              kernel64_s.wall, kernel64_s.cpu, evals / kernel64_s.wall * 1e-9);
  std::printf("kernels::fast::small_dim_forward float32: %.4f s wall, %.4f s cpu (%.2f G/s)\n",
              kernel32_s.wall, kernel32_s.cpu, evals / kernel32_s.wall * 1e-9);
  // One thread whatever the setting: compare with the kernels' lines above.
  std::printf(
      "its exp alone, n * t calls, one thread: float64 %.4f s cpu (%.2f ns each), "
      "float32 %.4f s cpu (%.2f ns each)\n",
      exp64_s.cpu, exp64_s.cpu / evals * 1e9, exp32_s.cpu, exp32_s.cpu / evals * 1e9);
  return 0;
}
