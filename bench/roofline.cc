// Roofline: this machine's ceilings, measured in the same run as the ops
// (bench/bench_perf.cc; bench/performance.py runs both and writes
// docs/performance.md): OpenBLAS sgemm GFLOP/s at 1 and 2 threads, at the
// square and the attention shapes, and stream copy and triad bandwidth.
//
//   build/perf/bench/roofline --benchmark_format=json
#include <benchmark/benchmark.h>
#include <cblas.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

std::vector<float> random_uniform(int64_t count, uint32_t seed) {
  std::vector<float> values(static_cast<size_t>(count));
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (float& x : values) x = dist(gen);
  return values;
}

// ---- sgemm -------------------------------------------------------------------

// Row-major C (m x n) = A (m x k) op(B), op(B) = Bᵀ with B stored n x k when
// trans_b (the scores Q Kᵀ), else B stored k x n (the weighted sum W V).
// Two ways to use 2 threads, measured side by side:
//   split 0: OpenBLAS's own threads (openblas_set_num_threads), one call;
//   split 1: OpenBLAS single-threaded, the rows of C cut into one contiguous
//            block per OpenMP thread — how qkv calls it (src/kernels/runtime/blas.h), at
//            its best: one large call per thread.
// FLOPs: 2 m n k.
void BM_Sgemm(benchmark::State& state) {
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  const bool trans_b = state.range(3) != 0;
  const int threads = static_cast<int>(state.range(4));
  const bool split = state.range(5) != 0;
  const std::vector<float> a = random_uniform(m * k, 1);
  const std::vector<float> b = random_uniform(k * n, 2);
  std::vector<float> c(static_cast<size_t>(m * n));
  const CBLAS_TRANSPOSE op_b = trans_b ? CblasTrans : CblasNoTrans;
  const int64_t ldb = trans_b ? k : n;
  openblas_set_num_threads(split ? 1 : threads);

  for (auto _ : state) {
    if (!split) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, op_b, m, n, k, 1.0f, a.data(), k, b.data(), ldb,
                  0.0f, c.data(), n);
    } else {
#pragma omp parallel num_threads(threads)
      {
        const int64_t t = omp_get_thread_num(), parts = omp_get_num_threads();
        const int64_t r0 = m * t / parts, r1 = m * (t + 1) / parts;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, op_b, r1 - r0, n, k, 1.0f, a.data() + r0 * k, k,
                    b.data(), ldb, 0.0f, c.data() + r0 * n, n);
      }
    }
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }

  state.counters["FLOP/s"] = benchmark::Counter(
      2.0 * static_cast<double>(m * n * k) * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate);
  openblas_set_num_threads(1);
}

const std::vector<std::string> kSgemmArgNames = {"m", "n", "k", "trans_b", "threads", "split"};

// Square 2048 (the usual sgemm figure), and the two products of attention at
// N = 2048, d = 64: scores Q Kᵀ (2048 x 2048 x 64) and W V (2048 x 64 x 2048).
void sgemm_shapes(benchmark::internal::Benchmark* bench) {
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{
           {2048, 2048, 2048, 0}, {2048, 2048, 64, 1}, {2048, 64, 2048, 0}}) {
    for (const std::vector<int64_t>& how : std::vector<std::vector<int64_t>>{
             {1, 0}, {2, 0}, {2, 1}}) {
      bench->Args({shape[0], shape[1], shape[2], shape[3], how[0], how[1]});
    }
  }
}
BENCHMARK(BM_Sgemm)
    ->ArgNames(kSgemmArgNames)
    ->Apply(sgemm_shapes)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// ---- memory bandwidth ---------------------------------------------------------

// 512 MiB per array: far beyond any cache this (virtual) CPU reports (L3 480
// MiB), so every byte comes from DRAM. Each thread streams one contiguous
// slice, the way qkv's kernels split rows.
constexpr int64_t kStreamFloats = int64_t{512} << 20 >> 2;

// dst = src with std::copy (glibc memmove). Bytes: read + write, 8 per float
// (the write-allocate read of dst, if the CPU does one, is not counted — as in
// STREAM).
void BM_StreamCopy(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const std::vector<float> src(static_cast<size_t>(kStreamFloats), 2.0f);
  std::vector<float> dst(static_cast<size_t>(kStreamFloats), 1.0f);

  for (auto _ : state) {
#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), parts = omp_get_num_threads();
      const int64_t i0 = kStreamFloats * t / parts, i1 = kStreamFloats * (t + 1) / parts;
      std::copy(src.data() + i0, src.data() + i1, dst.data() + i0);
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(2 * kStreamFloats * static_cast<int64_t>(sizeof(float)) *
                          state.iterations());
}
BENCHMARK(BM_StreamCopy)
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Reading alone: each thread sums its slice as 32-bit integers (integer
// adds vectorize at any SIMD width; four bytes a cycle is plenty). Bytes: 4 per
// float read. Decoding reads K and V and writes almost nothing, so this, not
// the copy, is its roof: on the AVX-512 machine of docs/performance.md a
// 2-thread read ran at 27-30 GB/s against a 40-44 GB/s copy.
void BM_StreamRead(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const std::vector<uint32_t> src(static_cast<size_t>(kStreamFloats), 3u);
  for (auto _ : state) {
    uint32_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
      const int64_t t = omp_get_thread_num(), parts = omp_get_num_threads();
      const int64_t i0 = kStreamFloats * t / parts, i1 = kStreamFloats * (t + 1) / parts;
      total += std::accumulate(src.data() + i0, src.data() + i1, uint32_t{0});
    }
    benchmark::DoNotOptimize(total);
  }
  state.SetBytesProcessed(kStreamFloats * static_cast<int64_t>(sizeof(uint32_t)) *
                          state.iterations());
}
BENCHMARK(BM_StreamRead)
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The same copy with non-temporal (cache-bypassing) AVX-512 stores: no
// write-allocate read of dst, so on most CPUs the higher of the two.
// glibc's memmove switches to such stores only above a threshold scaled from
// the reported L3 size (here 480 MiB), which these slices stay under.
__attribute__((target("avx512f"))) void copy_streaming(const float* src, float* dst,
                                                       int64_t count) {
  int64_t i = 0;
  for (; i < count && reinterpret_cast<uintptr_t>(dst + i) % 64 != 0; ++i) dst[i] = src[i];
  for (; i + 16 <= count; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
  for (; i < count; ++i) dst[i] = src[i];
  _mm_sfence();
}

void BM_StreamCopyNonTemporal(benchmark::State& state) {
  if (!__builtin_cpu_supports("avx512f")) {
    state.SkipWithError("needs AVX-512F");
    return;
  }
  const int threads = static_cast<int>(state.range(0));
  const std::vector<float> src(static_cast<size_t>(kStreamFloats), 2.0f);
  std::vector<float> dst(static_cast<size_t>(kStreamFloats), 1.0f);

  for (auto _ : state) {
#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), parts = omp_get_num_threads();
      const int64_t i0 = kStreamFloats * t / parts, i1 = kStreamFloats * (t + 1) / parts;
      copy_streaming(src.data() + i0, dst.data() + i0, i1 - i0);
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(2 * kStreamFloats * static_cast<int64_t>(sizeof(float)) *
                          state.iterations());
}
BENCHMARK(BM_StreamCopyNonTemporal)
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// STREAM triad a = b + s c. Bytes: 12 per float (two reads, one write).
void BM_StreamTriad(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const std::vector<float> b(static_cast<size_t>(kStreamFloats), 2.0f);
  const std::vector<float> c(static_cast<size_t>(kStreamFloats), 0.5f);
  std::vector<float> a(static_cast<size_t>(kStreamFloats), 1.0f);
  const float s = 3.0f;

  for (auto _ : state) {
#pragma omp parallel for simd num_threads(threads) schedule(static)
    for (int64_t i = 0; i < kStreamFloats; ++i) a[i] = b[i] + s * c[i];
    benchmark::DoNotOptimize(a.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(3 * kStreamFloats * static_cast<int64_t>(sizeof(float)) *
                          state.iterations());
}
BENCHMARK(BM_StreamTriad)
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  benchmark::AddCustomContext("openblas_config", openblas_get_config());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
