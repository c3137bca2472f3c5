// Google Benchmark for the bf16 block products (src/kernels/simd/gemm_bf16.h) of
// flash attention, single-threaded, next to OpenBLAS sgemm on the same shapes
// in float (what the float32 attention runs). Every path this machine offers
// is registered: "best" (the public gemm), "amx", "avx512_bf16", "widen".
//
//   build/<dir>/bench/bench_gemm_bf16 --benchmark_repetitions=5
//       --benchmark_report_aggregates_only=true   (one line)
//
// Arguments: ta, tb (0/1), m, n, k. Shapes: head dim d = dv = 64, query
// blocks Bq = 64..128, key blocks Bk = 128..512 (the lead's flash kernel):
//   NT (Bq, Bk, d)  S = scale Q Kᵀ, dP = dO Vᵀ
//   NN (Bq, dv, Bk) O += P V, dQ += dS K
//   TN (Bk, dv, Bq) dV += Pᵀ dO, dK += dSᵀ Q
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/runtime/blas.h"
#include "kernels/simd/gemm_bf16.h"

namespace qkv::kernels::fast {
std::vector<std::string> bf16_paths();
void gemm_bf16_on_path(const std::string& path, bool trans_a, bool trans_b, int64_t m, int64_t n,
                       int64_t k, float alpha, const bfloat16* a, int64_t lda, const bfloat16* b,
                       int64_t ldb, float beta, float* c, int64_t ldc);
}  // namespace qkv::kernels::fast

namespace {

struct Shape {
  bool ta, tb;
  int64_t m, n, k;
  float alpha, beta;
  int64_t lda() const { return ta ? m : k; }
  int64_t ldb() const { return tb ? k : n; }
};

// S = scale Q Kᵀ overwrites; the accumulating products add into C.
Shape shape_of(const benchmark::State& state) {
  Shape s{state.range(0) != 0,
          state.range(1) != 0,
          state.range(2),
          state.range(3),
          state.range(4),
          1.0f,
          1.0f};
  if (!s.ta && s.tb) {
    s.alpha = 0.125f;
    s.beta = 0.0f;
  }
  return s;
}

std::vector<float> random_floats(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = u(rng);
  return x;
}

void set_counters(benchmark::State& state, const Shape& s) {
  state.counters["GFLOP/s"] = benchmark::Counter(
      static_cast<double>(2 * s.m * s.n * s.k) * static_cast<double>(state.iterations()) * 1e-9,
      benchmark::Counter::kIsRate);
}

void BM_Sgemm(benchmark::State& state) {
  const Shape s = shape_of(state);
  const std::vector<float> a = random_floats(s.m * s.k, 1), b = random_floats(s.k * s.n, 2);
  std::vector<float> c(static_cast<size_t>(s.m * s.n), 0.0f);
  const qkv::kernels::BlasSingleThreaded blas;  // for the whole loop: each gemm then only counts
  for (auto _ : state) {
    qkv::kernels::gemm(s.ta, s.tb, s.m, s.n, s.k, s.alpha, a.data(), s.lda(), b.data(), s.ldb(),
                       s.beta, c.data(), s.n);
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, s);
}

void run_bf16(benchmark::State& state, const std::string& path) {
  const Shape s = shape_of(state);
  std::vector<qkv::bfloat16> a(static_cast<size_t>(s.m * s.k)), b(static_cast<size_t>(s.k * s.n));
  qkv::kernels::fast::to_bf16(random_floats(s.m * s.k, 1).data(), a.data(), s.m * s.k);
  qkv::kernels::fast::to_bf16(random_floats(s.k * s.n, 2).data(), b.data(), s.k * s.n);
  std::vector<float> c(static_cast<size_t>(s.m * s.n), 0.0f);
  const std::vector<std::string> paths = qkv::kernels::fast::bf16_paths();
  if (path != "best" && std::find(paths.begin(), paths.end(), path) == paths.end()) {
    state.SkipWithError(("path " + path + " not available here").c_str());
    return;
  }
  std::vector<double> scratch(qkv::kernels::fast::gemm_bf16_scratch_words(s.m, s.n, s.k));
  for (auto _ : state) {
    if (path == "best") {
      qkv::kernels::fast::gemm_bf16(s.ta, s.tb, s.m, s.n, s.k, s.alpha, a.data(), s.lda(), b.data(),
                                    s.ldb(), s.beta, c.data(), s.n, scratch.data());
    } else {
      qkv::kernels::fast::gemm_bf16_on_path(path, s.ta, s.tb, s.m, s.n, s.k, s.alpha, a.data(),
                                            s.lda(), b.data(), s.ldb(), s.beta, c.data(), s.n);
    }
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, s);
}

void BM_Bf16Best(benchmark::State& state) { run_bf16(state, "best"); }
void BM_Bf16Amx(benchmark::State& state) { run_bf16(state, "amx"); }
void BM_Bf16Avx512(benchmark::State& state) { run_bf16(state, "avx512_bf16"); }
void BM_Bf16Widen(benchmark::State& state) { run_bf16(state, "widen"); }

void attention_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"ta", "tb", "m", "n", "k"});
  b->Args({0, 1, 128, 256, 64});  // S = scale Q Kᵀ, Bq = 128, Bk = 256
  b->Args({0, 1, 64, 512, 64});
  b->Args({0, 1, 128, 512, 64});
  b->Args({0, 0, 128, 64, 256});  // O += P V
  b->Args({0, 0, 64, 64, 128});
  b->Args({0, 0, 128, 64, 512});
  b->Args({1, 0, 256, 64, 128});  // dV += Pᵀ dO
  b->Args({1, 0, 512, 64, 64});
}

BENCHMARK(BM_Sgemm)->Apply(attention_shapes);
BENCHMARK(BM_Bf16Best)->Apply(attention_shapes);
BENCHMARK(BM_Bf16Amx)->Apply(attention_shapes);
BENCHMARK(BM_Bf16Avx512)->Apply(attention_shapes);
BENCHMARK(BM_Bf16Widen)->Apply(attention_shapes);

// Rounding a (Bq, Bk) = (128, 256) block of probabilities to bf16 for P V.
void BM_ToBf16(benchmark::State& state) {
  const int64_t n = state.range(0);
  const std::vector<float> x = random_floats(n, 3);
  std::vector<qkv::bfloat16> out(static_cast<size_t>(n));
  for (auto _ : state) {
    qkv::kernels::fast::to_bf16(x.data(), out.data(), n);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * n * 6);
}
BENCHMARK(BM_ToBf16)->Arg(128 * 256);

}  // namespace
