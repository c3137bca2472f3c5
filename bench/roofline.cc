// Roofline: this machine's own ceilings, measured in the same run as the ops
// (bench/bench_perf.cc; bench/performance.py runs both and writes
// docs/performance.md), at 1 and 2 threads:
//   - compute peaks from register-resident loops (no memory traffic): float32
//     FMA (AVX-512, else AVX2 + FMA), float64 FMA, the bf16 dot product
//     `vdpbf16ps` (AVX512_BF16 only) and AMX `tdpbf16ps` (AMX-TILE + AMX-BF16
//     only); on a CPU without an instruction the benchmark reports the error
//     "absent: ..." and the page shows "absent";
//   - memory bandwidth over arrays far beyond the last-level cache: reading
//     alone (a sum), copy (two forms) and the STREAM triad;
//   - OpenBLAS sgemm at the square and the attention shapes: a second,
//     labelled reference (a library's rate, not the machine's ceiling: an
//     OpenBLAS that misreads the CPU runs far below the FMA peak).
// One binary runs everywhere: each peak loop is compiled for its instruction
// set with a target attribute and runs only where __builtin_cpu_supports
// says so.
//
//   build/perf/bench/roofline --benchmark_format=json
#include <benchmark/benchmark.h>
#include <cblas.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
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

// ---- compute peaks: register-resident loops --------------------------------------

// Each loop updates kAccumulators independent vector accumulators once per
// step, one instruction each, from operands that stay in registers: no loads
// or stores, only the arithmetic units. The accumulators must cover latency
// times issue rate: an FMA takes 4 cycles on 2 ports (Intel since Skylake,
// AMD Zen 4/5), so 8 in flight keep both busy; 16 (AVX-512, 32 registers) or
// 12 (AVX2, 16 registers less the two operands) leave margin. The values stay
// normal floats: acc = acc a + b with a < 1 tends to b / (1 - a), no overflow,
// no denormals; the dot products add a small positive step and stay far below
// float's range over one call.
constexpr int64_t kFmaSteps = int64_t{1} << 22;  // ~8 ms a call per thread at 4 GHz
// A tdpbf16ps takes 16 cycles on Sapphire/Emerald Rapids: fewer steps.
constexpr int64_t kAmxSteps = int64_t{1} << 18;

__attribute__((target("avx512f"))) float fma32_avx512(int64_t steps) {
  constexpr int kAccumulators = 16;
  __m512 acc[kAccumulators];
  for (int j = 0; j < kAccumulators; ++j) acc[j] = _mm512_set1_ps(static_cast<float>(j));
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.001f);
  for (int64_t i = 0; i < steps; ++i) {
    for (int j = 0; j < kAccumulators; ++j) acc[j] = _mm512_fmadd_ps(acc[j], a, b);
  }
  for (int j = 1; j < kAccumulators; ++j) acc[0] = _mm512_add_ps(acc[0], acc[j]);
  alignas(64) float lanes[16];  // not _mm512_reduce_add_ps: GCC 12 warns inside it
  _mm512_store_ps(lanes, acc[0]);
  return std::accumulate(lanes, lanes + 16, 0.0f);
}

__attribute__((target("avx2,fma"))) float fma32_avx2(int64_t steps) {
  constexpr int kAccumulators = 12;
  __m256 acc[kAccumulators];
  for (int j = 0; j < kAccumulators; ++j) acc[j] = _mm256_set1_ps(static_cast<float>(j));
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(0.001f);
  for (int64_t i = 0; i < steps; ++i) {
    for (int j = 0; j < kAccumulators; ++j) acc[j] = _mm256_fmadd_ps(acc[j], a, b);
  }
  for (int j = 1; j < kAccumulators; ++j) acc[0] = _mm256_add_ps(acc[0], acc[j]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc[0]);
  return std::accumulate(lanes, lanes + 8, 0.0f);
}

__attribute__((target("avx512f"))) float fma64_avx512(int64_t steps) {
  constexpr int kAccumulators = 16;
  __m512d acc[kAccumulators];
  for (int j = 0; j < kAccumulators; ++j) acc[j] = _mm512_set1_pd(static_cast<double>(j));
  const __m512d a = _mm512_set1_pd(0.999), b = _mm512_set1_pd(0.001);
  for (int64_t i = 0; i < steps; ++i) {
    for (int j = 0; j < kAccumulators; ++j) acc[j] = _mm512_fmadd_pd(acc[j], a, b);
  }
  for (int j = 1; j < kAccumulators; ++j) acc[0] = _mm512_add_pd(acc[0], acc[j]);
  alignas(64) double lanes[8];
  _mm512_store_pd(lanes, acc[0]);
  return static_cast<float>(std::accumulate(lanes, lanes + 8, 0.0));
}

__attribute__((target("avx2,fma"))) float fma64_avx2(int64_t steps) {
  constexpr int kAccumulators = 12;
  __m256d acc[kAccumulators];
  for (int j = 0; j < kAccumulators; ++j) acc[j] = _mm256_set1_pd(static_cast<double>(j));
  const __m256d a = _mm256_set1_pd(0.999), b = _mm256_set1_pd(0.001);
  for (int64_t i = 0; i < steps; ++i) {
    for (int j = 0; j < kAccumulators; ++j) acc[j] = _mm256_fmadd_pd(acc[j], a, b);
  }
  for (int j = 1; j < kAccumulators; ++j) acc[0] = _mm256_add_pd(acc[0], acc[j]);
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, acc[0]);
  return static_cast<float>(lanes[0] + lanes[1] + lanes[2] + lanes[3]);
}

// vdpbf16ps: acc (16 floats) += the products of 16 pairs of bf16 pairs.
// 1/64 is exact in bf16; each step adds 2/4096 to a lane.
__attribute__((target("avx512f,avx512bf16"))) float bf16_dot_avx512(int64_t steps) {
  constexpr int kAccumulators = 16;
  __m512 acc[kAccumulators];
  for (int j = 0; j < kAccumulators; ++j) acc[j] = _mm512_setzero_ps();
  const __m512 x = _mm512_set1_ps(1.0f / 64);
  const __m512bh a = _mm512_cvtne2ps_pbh(x, x);
  for (int64_t i = 0; i < steps; ++i) {
    for (int j = 0; j < kAccumulators; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, a);
  }
  for (int j = 1; j < kAccumulators; ++j) acc[0] = _mm512_add_ps(acc[0], acc[j]);
  alignas(64) float lanes[16];  // not _mm512_reduce_add_ps: GCC 12 warns inside it
  _mm512_store_ps(lanes, acc[0]);
  return std::accumulate(lanes, lanes + 16, 0.0f);
}

// AMX palette 1 (Intel SDM vol. 1 §18.2, the intrinsics guide's
// _tile_loadconfig): 8 tiles of up to 16 rows x 64 bytes, configured by this
// 64-byte block.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row, tiles 0-15 (palette 1 has 8)
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

// Linux hands out the 8 KiB of tile state only on request (once per process,
// for all its threads; src/kernels/simd/gemm_bf16.cc does the same): without
// it the first tile instruction faults.
bool request_amx_state() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// tdpbf16ps C (16 x 16 float32) += A (16 rows x 32 bf16) B (16 rows of 16
// bf16 pairs): 16 * 16 * 32 multiply-adds, 16384 flops. Four accumulator
// tiles (0-3) fed by two A tiles (4, 5) and two B tiles (6, 7), the 2 x 2
// blocking a gemm uses: four independent products cover the instruction's
// latency. 1/64 in every bf16: each step adds 32/4096 to an element.
__attribute__((target("amx-tile,amx-bf16"))) float amx_bf16(int64_t steps) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  alignas(64) uint16_t operand[16 * 32];
  std::fill(operand, operand + 16 * 32, uint16_t{0x3c80});  // bf16 1/64
  alignas(64) float result[16 * 16];
  _tile_loadconfig(&config);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  for (int64_t i = 0; i < steps; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  float sum = 0;
  _tile_stored(0, result, 64);
  sum += result[0];
  _tile_stored(1, result, 64);
  sum += result[0];
  _tile_stored(2, result, 64);
  sum += result[0];
  _tile_stored(3, result, 64);
  sum += result[0];
  _tile_release();
  return sum;
}

using PeakLoop = float (*)(int64_t steps);

// Runs loop(steps) on every one of `threads` OpenMP threads at once;
// FLOP/s counts all threads' work. The label names the instruction set.
void run_peak(benchmark::State& state, PeakLoop loop, int64_t steps, double flops_per_step,
              const char* label) {
  const int threads = static_cast<int>(state.range(0));
  float sink = 0;
  for (auto _ : state) {
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += loop(steps);
  }
  benchmark::DoNotOptimize(sink);
  state.SetLabel(label);
  state.counters["FLOP/s"] =
      benchmark::Counter(flops_per_step * static_cast<double>(steps) * threads *
                             static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
}

bool has_avx512() { return __builtin_cpu_supports("avx512f"); }
bool has_avx2_fma() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// float32 FMA: 16 (AVX-512) or 8 (AVX2) lanes x 2 flops per accumulator and step.
void BM_PeakFma32(benchmark::State& state) {
  if (has_avx512()) return run_peak(state, fma32_avx512, kFmaSteps, 16 * 2 * 16, "avx512");
  if (has_avx2_fma()) return run_peak(state, fma32_avx2, kFmaSteps, 12 * 2 * 8, "avx2+fma");
  state.SkipWithError("absent: the CPU has neither AVX-512F nor AVX2 + FMA");
}

// float64 FMA (the Nadaraya-Watson kernel's arithmetic): half the lanes.
void BM_PeakFma64(benchmark::State& state) {
  if (has_avx512()) return run_peak(state, fma64_avx512, kFmaSteps, 16 * 2 * 8, "avx512");
  if (has_avx2_fma()) return run_peak(state, fma64_avx2, kFmaSteps, 12 * 2 * 4, "avx2+fma");
  state.SkipWithError("absent: the CPU has neither AVX-512F nor AVX2 + FMA");
}

// vdpbf16ps: 16 lanes x 2 products x 2 flops = 64 flops per accumulator and step.
void BM_PeakBf16Dot(benchmark::State& state) {
  if (!has_avx512() || !__builtin_cpu_supports("avx512bf16")) {
    state.SkipWithError("absent: the CPU has no AVX512_BF16");
    return;
  }
  run_peak(state, bf16_dot_avx512, kFmaSteps, 16 * 64, "avx512bf16");
}

// tdpbf16ps: 4 per step, 16 * 16 * 32 * 2 flops each.
void BM_PeakAmxBf16(benchmark::State& state) {
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) {
    state.SkipWithError("absent: the CPU has no AMX-TILE + AMX-BF16");
    return;
  }
  static const bool granted = request_amx_state();
  if (!granted) {
    state.SkipWithError("absent: Linux refused the AMX tile state (arch_prctl)");
    return;
  }
  run_peak(state, amx_bf16, kAmxSteps, 4 * 16 * 16 * 32 * 2, "amx");
}

BENCHMARK(BM_PeakFma32)->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime();
BENCHMARK(BM_PeakFma64)->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime();
BENCHMARK(BM_PeakBf16Dot)->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime();
BENCHMARK(BM_PeakAmxBf16)->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime();

// ---- sgemm: a second, labelled reference ----------------------------------------

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
    for (const std::vector<int64_t>& how :
         std::vector<std::vector<int64_t>>{{1, 0}, {2, 0}, {2, 1}}) {
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

// Per array: 512 MiB, or 4 times the last-level cache the CPU reports where
// that is larger (one AVX-512 machine reported 480 MiB of L3), so nearly every
// byte comes from DRAM. Each thread streams one contiguous slice, the way
// qkv's kernels split rows.
int64_t stream_floats() {
  static const int64_t floats = [] {
    const int64_t l3 = std::max<long>(sysconf(_SC_LEVEL3_CACHE_SIZE), 0);
    return std::max<int64_t>(int64_t{512} << 20, 4 * l3) / 4;
  }();
  return floats;
}

// dst = src with std::copy (glibc memmove). Bytes: read + write, 8 per float
// (the write-allocate read of dst, if the CPU does one, is not counted — as in
// STREAM).
void BM_StreamCopy(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const int64_t floats = stream_floats();
  const std::vector<float> src(static_cast<size_t>(floats), 2.0f);
  std::vector<float> dst(static_cast<size_t>(floats), 1.0f);

  for (auto _ : state) {
#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), parts = omp_get_num_threads();
      const int64_t i0 = floats * t / parts, i1 = floats * (t + 1) / parts;
      std::copy(src.data() + i0, src.data() + i1, dst.data() + i0);
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(2 * floats * static_cast<int64_t>(sizeof(float)) * state.iterations());
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
  const int64_t floats = stream_floats();
  const std::vector<uint32_t> src(static_cast<size_t>(floats), 3u);
  for (auto _ : state) {
    uint32_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
      const int64_t t = omp_get_thread_num(), parts = omp_get_num_threads();
      const int64_t i0 = floats * t / parts, i1 = floats * (t + 1) / parts;
      total += std::accumulate(src.data() + i0, src.data() + i1, uint32_t{0});
    }
    benchmark::DoNotOptimize(total);
  }
  state.SetBytesProcessed(floats * static_cast<int64_t>(sizeof(uint32_t)) * state.iterations());
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
  const int64_t floats = stream_floats();
  const std::vector<float> src(static_cast<size_t>(floats), 2.0f);
  std::vector<float> dst(static_cast<size_t>(floats), 1.0f);

  for (auto _ : state) {
#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), parts = omp_get_num_threads();
      const int64_t i0 = floats * t / parts, i1 = floats * (t + 1) / parts;
      copy_streaming(src.data() + i0, dst.data() + i0, i1 - i0);
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(2 * floats * static_cast<int64_t>(sizeof(float)) * state.iterations());
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
  const int64_t floats = stream_floats();
  const std::vector<float> b(static_cast<size_t>(floats), 2.0f);
  const std::vector<float> c(static_cast<size_t>(floats), 0.5f);
  std::vector<float> a(static_cast<size_t>(floats), 1.0f);
  const float s = 3.0f;

  for (auto _ : state) {
#pragma omp parallel for simd num_threads(threads) schedule(static)
    for (int64_t i = 0; i < floats; ++i) a[i] = b[i] + s * c[i];
    benchmark::DoNotOptimize(a.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(3 * floats * static_cast<int64_t>(sizeof(float)) * state.iterations());
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
