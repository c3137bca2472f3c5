// The performance suite's qkv side: qkv's fast kernels at 2 threads on every
// row of docs/performance.md (one-head SDPA, heads with masks, a window, a
// bias, bf16, forward + backward at d = 64 and 128, decoding, grouped-query
// decoding, additive attention, masked softmax, Nadaraya-Watson), an unfused
// sgemm + masked softmax + sgemm composition beside fused SDPA, and the SDPA
// scaling sweep. bench/performance.py runs it together with bench/roofline.cc
// (the machine's roofs), bench/perf_torch.py (the book's PyTorch code, same
// names) and bench/perf_torch2.py (torch 2's SDPA, same names) and writes
// docs/performance.md.
//
//   build/perf/bench/bench_perf --perf_sdpa_lens=L0,L1 --perf_softmax_lens=L0,...,L31
//
// Benchmark names are <op>/<implementation>/<shape>. Counters: FLOP/s (over
// valid keys only; each op states its count) and bytes_per_second
// (memory-bound ops). Peak memory is measured separately, one op per fresh
// process (see measure_memory):
//   build/perf/bench/bench_perf --perf_memory=sdpa_fwd/fused/B1_N16384 --perf_sdpa_lens=...
#include <benchmark/benchmark.h>
#include <cblas.h>
#include <malloc.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "qkv/kernel_regression.h"
#include "qkv/qkv.h"
#include "qkv/simd.h"

namespace {

using qkv::ConstView;
using qkv::Tensor;
using qkv::ValidLens;

// ---- peak memory ---------------------------------------------------------------

// A field of /proc/self/status ("VmRSS", "VmHWM"), in bytes.
int64_t status_bytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.compare(0, field.size() + 1, field + ":") == 0) {
      return std::stoll(line.substr(field.size() + 1)) * 1024;  // "VmHWM:   123 kB"
    }
  }
  std::fprintf(stderr, "bench_perf: no %s in /proc/self/status\n", field.c_str());
  std::exit(1);
}

// Resets the peak-RSS mark (VmHWM) to the current RSS and returns that RSS.
// malloc_trim first hands free heap pages back to the kernel, so memory the
// op reuses from earlier frees is faulted in again and counted.
int64_t reset_peak_rss() {
  malloc_trim(0);
  std::ofstream("/proc/self/clear_refs") << "5";  // closed (written) at the end of the statement
  return status_bytes("VmRSS");
}

template <class T>
int64_t bytes_of(const Tensor<T>& t) {
  return static_cast<int64_t>(t.values().size() * sizeof(T));  // 0 for an empty (not asked for) one
}

// One call of an op on inputs built beforehand; returns the bytes of
// everything the op returned (outputs, lse, gradients).
using OpCall = std::function<int64_t()>;
// What to do with an op once its inputs are built: time it or measure its
// memory. flops and bytes are per call (0: not rated that way).
using Runner = std::function<void(const OpCall& call, double flops, double bytes)>;

// What a paired op (gqa_decode_paired) timed inside each call: the seconds of
// a plain read of its bytes and of the op itself on the same bytes.
struct PairedTimes {
  double bytes = 0;
  std::vector<double> read_seconds, op_seconds;
};
PairedTimes g_paired;

template <class T>
double median_of(std::vector<T> x) {
  std::sort(x.begin(), x.end());
  return x.empty() ? 0.0 : static_cast<double>(x[x.size() / 2]);
}

// Google Benchmark's timed loop. A paired op also gets its medians as
// counters: read_bytes_per_second, op_bytes_per_second and read_fraction
// (the median over calls of read seconds / op seconds).
void time_op(benchmark::State& state, const OpCall& call, double flops, double bytes) {
  g_paired = PairedTimes{};
  for (auto _ : state) {
    call();
    benchmark::ClobberMemory();
  }
  const auto iterations = static_cast<double>(state.iterations());
  state.counters["FLOP/s"] = benchmark::Counter(flops * iterations, benchmark::Counter::kIsRate);
  if (bytes > 0) state.SetBytesProcessed(static_cast<int64_t>(bytes * iterations));
  if (!g_paired.op_seconds.empty()) {
    std::vector<double> fractions;
    for (size_t i = 0; i < g_paired.op_seconds.size(); ++i) {
      fractions.push_back(g_paired.read_seconds[i] / g_paired.op_seconds[i]);
    }
    state.counters["read_bytes_per_second"] = g_paired.bytes / median_of(g_paired.read_seconds);
    state.counters["op_bytes_per_second"] = g_paired.bytes / median_of(g_paired.op_seconds);
    state.counters["read_fraction"] = median_of(fractions);
  }
}

// Peak memory of one call beyond its inputs and outputs, in a process that
// has not run the op before. Not after a warm-up call of the op itself: qkv
// keeps per-thread scratch (thread_local) between calls, and a warm-up would
// make it resident before the reset, hiding it. Instead a generic warm-up
// starts the OpenMP threads and gives each an OpenBLAS buffer (a 512^3 sgemm
// per thread), the one-time costs any op of any library pays. What the first
// call still adds beyond the op's own memory is its code pages (well under a
// MiB). Then: reset the mark, call once,
//   extra = VmHWM - RSS at the reset - bytes returned.
int64_t measure_memory(const OpCall& call) {
  constexpr int64_t kWarm = 512;
  std::vector<float> a(kWarm * kWarm, 1.0f), b(kWarm * kWarm, 1.0f);
#pragma omp parallel num_threads(qkv::num_threads())
  {
    std::vector<float> c(kWarm * kWarm);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, kWarm, kWarm, kWarm, 1.0f, a.data(),
                kWarm, b.data(), kWarm, 0.0f, c.data(), kWarm);
  }
  const int64_t rss = reset_peak_rss();
  const int64_t returned = call();
  return status_bytes("VmHWM") - rss - returned;
}

// ---- inputs ----------------------------------------------------------------------

Tensor<float> random_normal(qkv::Shape shape, uint32_t seed) {
  Tensor<float> t(shape);
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (float& x : t.values()) x = dist(gen);
  return t;
}

// Like torch.nn.Linear's initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
Tensor<float> linear_weight(qkv::Shape shape, int64_t fan_in, uint32_t seed) {
  Tensor<float> t(shape);
  std::mt19937 gen(seed);
  const float bound = 1.0f / std::sqrt(static_cast<float>(fan_in));
  std::uniform_real_distribution<float> dist(-bound, bound);
  for (float& x : t.values()) x = dist(gen);
  return t;
}

Tensor<qkv::bfloat16> to_bf16(const Tensor<float>& t) {
  Tensor<qkv::bfloat16> out(t.shape());
  for (size_t i = 0; i < t.values().size(); ++i) out.values()[i] = qkv::bfloat16(t.values()[i]);
  return out;
}

// N(0, 1) inputs of type In (float32, or bf16 rounded from the same floats).
template <class In>
Tensor<In> random_input(const qkv::Shape& shape, uint32_t seed) {
  if constexpr (std::is_same_v<In, float>) {
    return random_normal(shape, seed);
  } else {
    return to_bf16(random_normal(shape, seed));
  }
}

// The valid lengths the driver passed (the same ones PyTorch gets), or an
// empty tensor for "no mask".
struct Lens {
  Tensor<int64_t> lens;  // (B) or empty
  ValidLens valid() const { return ValidLens(lens); }
  // (query, key) pairs whose key is valid: the work a masking kernel cannot skip.
  double pairs(int64_t batch, int64_t num_queries, int64_t num_keys) const {
    if (lens.empty()) return static_cast<double>(batch * num_queries * num_keys);
    double sum = 0;
    for (int64_t l : lens.values()) sum += static_cast<double>(num_queries * l);
    return sum;
  }
};

std::vector<int64_t> g_sdpa_lens;     // --perf_sdpa_lens: B = 2, in [1, 4096]
std::vector<int64_t> g_softmax_lens;  // --perf_softmax_lens: B = 32, in [1, 512]

Lens make_lens(const std::vector<int64_t>* values) {
  Lens l;
  if (values != nullptr) {
    l.lens = Tensor<int64_t>(qkv::Shape{static_cast<int64_t>(values->size())}, *values);
  }
  return l;
}

// ---- scaled dot-product attention ---------------------------------------------------

// q, k, v: (B, N, D), D = Dv = 64   valid_lens: absent or (B)   out: (B, N, D)
// FLOPs: 4 D per valid (query, key) pair (Q Kᵀ and W V).
void sdpa_forward(const Runner& run, int64_t batch, int64_t n,
                  const std::vector<int64_t>* lens_values, int threads) {
  constexpr int64_t kDim = 64;
  qkv::set_num_threads(threads);
  const Tensor<float> q = random_normal({batch, n, kDim}, 1);
  const Tensor<float> k = random_normal({batch, n, kDim}, 2);
  const Tensor<float> v = random_normal({batch, n, kDim}, 3);
  const Lens lens = make_lens(lens_values);
  const ValidLens valid_lens = lens.valid();
  auto call = [&] {
    const qkv::AttentionResult<float> r = qkv::scaled_dot_product_attention(q, k, v, valid_lens);
    benchmark::DoNotOptimize(r.output.data());
    return bytes_of(r.output);
  };
  run(call, 4.0 * kDim * lens.pairs(batch, n, n), 0);
}

// The same with bf16 queries, keys and values (converted once, outside the
// timing); the output is float32.
void sdpa_forward_bf16(const Runner& run, int64_t batch, int64_t n,
                       const std::vector<int64_t>* lens_values) {
  constexpr int64_t kDim = 64;
  qkv::set_num_threads(2);
  const Tensor<qkv::bfloat16> q = to_bf16(random_normal({batch, n, kDim}, 1));
  const Tensor<qkv::bfloat16> k = to_bf16(random_normal({batch, n, kDim}, 2));
  const Tensor<qkv::bfloat16> v = to_bf16(random_normal({batch, n, kDim}, 3));
  const Lens lens = make_lens(lens_values);
  const ValidLens valid_lens = lens.valid();
  auto call = [&] {
    const qkv::AttentionResult<float> r =
        qkv::scaled_dot_product_attention(ConstView<qkv::bfloat16>(q), ConstView<qkv::bfloat16>(k),
                                          ConstView<qkv::bfloat16>(v), valid_lens);
    benchmark::DoNotOptimize(r.output.data());
    return bytes_of(r.output);
  };
  run(call, 4.0 * kDim * lens.pairs(batch, n, n), 0);
}

// Issue 31's AMX rows: bf16 forward, B = 2, H = 1, N = 4096, no lengths, at
// d = Dv = `dim` (64 or 128), 2 threads; rated against the AMX bf16 peak on
// a CPU whose bf16 products run on AMX (the fused key loop,
// kernels/simd/amx_attention.h), against the path's own peak elsewhere.
void sdpa_forward_bf16_amx_shape(const Runner& run, int64_t dim) {
  constexpr int64_t kBatch = 2, kN = 4096;
  qkv::set_num_threads(2);
  const Tensor<qkv::bfloat16> q = to_bf16(random_normal({kBatch, kN, dim}, 1));
  const Tensor<qkv::bfloat16> k = to_bf16(random_normal({kBatch, kN, dim}, 2));
  const Tensor<qkv::bfloat16> v = to_bf16(random_normal({kBatch, kN, dim}, 3));
  auto call = [&] {
    const qkv::AttentionResult<float> r = qkv::scaled_dot_product_attention(
        ConstView<qkv::bfloat16>(q), ConstView<qkv::bfloat16>(k), ConstView<qkv::bfloat16>(v));
    benchmark::DoNotOptimize(r.output.data());
    return bytes_of(r.output);
  };
  run(call, 4.0 * static_cast<double>(dim * kBatch * kN * kN), 0);
}

// Decoding: one query per sequence against a long cache of keys and values,
// B = 8, Nk = 131072, d = Dv = 64, float32 or bf16 inputs (converted once,
// outside the timing), 2 threads. Memory-bound: the bytes counted are those
// of K and V, read once per call.
template <class In>
void sdpa_decode(const Runner& run) {
  constexpr int64_t kBatch = 8, kKeys = 131072, kDim = 64;
  qkv::set_num_threads(2);
  const Tensor<In> q = random_input<In>({kBatch, 1, kDim}, 1);
  const Tensor<In> k = random_input<In>({kBatch, kKeys, kDim}, 2);
  const Tensor<In> v = random_input<In>({kBatch, kKeys, kDim}, 3);
  auto call = [&] {
    const qkv::AttentionResult<float> r = qkv::scaled_dot_product_attention(
        ConstView<In>(q), ConstView<In>(k), ConstView<In>(v), ValidLens{});
    benchmark::DoNotOptimize(r.output.data());
    return bytes_of(r.output);
  };
  run(call, 4.0 * kDim * kBatch * kKeys, 2.0 * kDim * kBatch * kKeys * sizeof(In));
}

// ---- transformer attention (issue 15) --------------------------------------------------

// The forms of issue 15's rows, B = 2, H = 8, N = 4096, d = 64, float32 (or bf16).
enum class Heads {
  kPlain,    // (B, H, N, d), no mask
  kStrided,  // the same read from (B, N, H, d) memory, viewed as heads
  kCausal,   // is_causal (top-left)
  kMask,     // a random boolean (N, N) mask of half the keys (key 0 kept)
  kWindow,   // a causal sliding window of 256 keys (window_left 255, right 0)
  kBias,     // a float (N, N) bias, N(0, 1), broadcast over B and H
};

// (query, key) pairs each form keeps: the work it cannot skip.
double kept_pairs(Heads form, int64_t batch, int64_t heads, int64_t n) {
  const double rows = static_cast<double>(batch * heads);
  switch (form) {
    case Heads::kCausal:
      return rows * static_cast<double>(n) * static_cast<double>(n + 1) / 2;
    case Heads::kMask:
      return rows * static_cast<double>(n) * static_cast<double>(n) / 2;
    case Heads::kWindow: {
      double pairs = 0;
      for (int64_t i = 0; i < n; ++i) pairs += static_cast<double>(std::min<int64_t>(i + 1, 256));
      return rows * pairs;
    }
    default:
      return rows * static_cast<double>(n) * static_cast<double>(n);
  }
}

// Forward (or forward + backward) of one form, d = 64 (issue 15's rows) or
// 128 (the head size of most 7B-70B models; issue 31's peer rows). FLOPs: 4 d
// (forward) or 14 d (forward + backward) per kept pair.
template <class In>
void heads_attention(const Runner& run, Heads form, bool backward, int64_t dim = 64) {
  constexpr int64_t kBatch = 2, kHeads = 8, kN = 4096;
  qkv::set_num_threads(2);
  // (B, N, H, d) memory for the strided form, (B, H, N, d) otherwise.
  const bool strided = form == Heads::kStrided;
  const qkv::Shape shape =
      strided ? qkv::Shape{kBatch, kN, kHeads, dim} : qkv::Shape{kBatch, kHeads, kN, dim};
  const Tensor<In> q = random_input<In>(shape, 1);
  const Tensor<In> k = random_input<In>(shape, 2);
  const Tensor<In> v = random_input<In>(shape, 3);
  const auto heads_view = [&](const Tensor<In>& t) {
    return strided ? ConstView<In>(t.data(), {kBatch, kHeads, kN, dim},
                                   {kN * kHeads * dim, dim, kHeads * dim, 1})
                   : ConstView<In>(t);
  };
  const Tensor<float> d_out = random_normal({kBatch, kHeads, kN, dim}, 4);
  Tensor<uint8_t> mask;
  Tensor<float> bias;
  qkv::AttentionOptions options;
  options.return_lse = backward;
  if (form == Heads::kCausal) options.causal = qkv::Causal::kTopLeft;
  if (form == Heads::kMask) {
    mask = Tensor<uint8_t>({kN, kN});
    std::mt19937 gen(5);
    for (uint8_t& x : mask.values()) x = static_cast<uint8_t>(gen() & 1u);
    for (int64_t i = 0; i < kN; ++i) mask(i, 0) = 1;
    options.mask = mask.view();
  }
  if (form == Heads::kWindow) {
    options.window_left = 255;
    options.window_right = 0;
  }
  if (form == Heads::kBias) {
    bias = random_normal({kN, kN}, 6);
    options.bias = ConstView<float>(bias);
  }
  auto call = [&] {
    const qkv::AttentionResult<float> r = qkv::scaled_dot_product_attention(
        heads_view(q), heads_view(k), heads_view(v), ValidLens{}, options);
    benchmark::DoNotOptimize(r.output.data());
    int64_t returned = bytes_of(r.output) + bytes_of(r.lse);
    if (backward) {
      const qkv::DotProductGrads<float> g = qkv::scaled_dot_product_attention_backward(
          heads_view(q), heads_view(k), heads_view(v), ValidLens{}, options, {r.output, r.lse},
          d_out);
      benchmark::DoNotOptimize(g.d_queries.data());
      returned += bytes_of(g.d_queries) + bytes_of(g.d_keys) + bytes_of(g.d_values);
    }
    return returned;
  };
  run(call, (backward ? 14.0 : 4.0) * dim * kept_pairs(form, kBatch, kHeads, kN), 0);
}

// Decoding with grouped heads: one query per head, B = 1, H = 32, Hkv = 8,
// Nk = 65536, d = 128 (issue 15's shape, llama-style), float32 or bf16.
// Memory-bound: the bytes counted are those of K and V, read once per call.
template <class In>
struct GqaDecode {
  static constexpr int64_t kHeads = 32, kKvHeads = 8, kKeys = 65536, kDim = 128;
  static constexpr double kFlops = 4.0 * kDim * kHeads * kKeys;
  static constexpr double kBytes = 2.0 * kDim * kKvHeads * kKeys * sizeof(In);
  const Tensor<In> q = random_input<In>({1, kHeads, 1, kDim}, 1);
  const Tensor<In> k = random_input<In>({1, kKvHeads, kKeys, kDim}, 2);
  const Tensor<In> v = random_input<In>({1, kKvHeads, kKeys, kDim}, 3);

  // One call; returns the bytes of the output.
  int64_t operator()() const {
    const qkv::AttentionResult<float> r = qkv::scaled_dot_product_attention(
        ConstView<In>(q), ConstView<In>(k), ConstView<In>(v), ValidLens{});
    benchmark::DoNotOptimize(r.output.data());
    return bytes_of(r.output);
  }
};

template <class In>
void gqa_decode(const Runner& run) {
  qkv::set_num_threads(2);
  const GqaDecode<In> decode;
  run([&] { return decode(); }, decode.kFlops, decode.kBytes);
}

// The roofline's read (bench/roofline.cc, BM_StreamRead) over the given
// arrays: each of 2 threads sums its slice of every array as 32-bit words.
uint32_t read_words(const std::vector<std::pair<const uint32_t*, int64_t>>& arrays) {
  uint32_t total = 0;
#pragma omp parallel num_threads(2) reduction(+ : total)
  {
    const int64_t t = omp_get_thread_num(), parts = omp_get_num_threads();
    for (const auto& [words, count] : arrays) {
      total +=
          std::accumulate(words + count * t / parts, words + count * (t + 1) / parts, uint32_t{0});
    }
  }
  return total;
}

// gqa_decode's shape against the read roof, paired: each call first reads K
// and V with the roofline's plain read, then decodes the same K and V, and
// times both (time_op's counters). This machine's read bandwidth drifts by
// tens of percent within minutes (a virtual machine on shared memory: 43.6,
// 60 and 80 GB/s on one day), so a roof measured minutes apart from the op,
// on other pages of memory, does not bound it; this one is measured on the
// op's own bytes, a few milliseconds before it.
template <class In>
void gqa_decode_paired(const Runner& run) {
  qkv::set_num_threads(2);
  const GqaDecode<In> decode;
  const auto words = [](const Tensor<In>& t) {
    return std::make_pair(reinterpret_cast<const uint32_t*>(t.data()),
                          static_cast<int64_t>(t.values().size() * sizeof(In) / 4));
  };
  auto call = [&] {
    using Clock = std::chrono::steady_clock;
    const auto t0 = Clock::now();
    benchmark::DoNotOptimize(read_words({words(decode.k), words(decode.v)}));
    const auto t1 = Clock::now();
    const int64_t returned = decode();
    const auto t2 = Clock::now();
    g_paired.bytes = decode.kBytes;
    g_paired.read_seconds.push_back(std::chrono::duration<double>(t1 - t0).count());
    g_paired.op_seconds.push_back(std::chrono::duration<double>(t2 - t1).count());
    return returned;
  };
  run(call, 0, 0);
}

// Row-major C (m x n) = alpha A (m x k) op(B), the rows of C split into one
// contiguous block per thread, each a single-threaded OpenBLAS call (as qkv
// calls the BLAS; OpenBLAS's own threads stay at 1 in this process).
void sgemm_rows(bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc) {
#pragma omp parallel num_threads(qkv::num_threads())
  {
    const int64_t t = omp_get_thread_num(), parts = omp_get_num_threads();
    const int64_t r0 = m * t / parts, r1 = m * (t + 1) / parts;
    if (r1 > r0) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, r1 - r0, n, k,
                  alpha, a + r0 * lda, lda, b, ldb, 0.0f, c + r0 * ldc, ldc);
    }
  }
}

// The unfused path one would write with a BLAS and qkv's masked softmax (the
// d2l formulation in C++): the (B, N, N) scores by sgemm, masked softmax in
// place, then sgemm with V. With 1-D lengths only the first L_b columns of
// each batch element's scores are formed and multiplied, as a careful BLAS
// user would. The scores buffer is allocated per call, uninitialised (like
// torch.empty): that is the memory fusing saves.
void sdpa_forward_unfused(const Runner& run, int64_t batch, int64_t n,
                          const std::vector<int64_t>* lens_values) {
  constexpr int64_t kDim = 64;
  qkv::set_num_threads(2);
  const Tensor<float> q = random_normal({batch, n, kDim}, 1);
  const Tensor<float> k = random_normal({batch, n, kDim}, 2);
  const Tensor<float> v = random_normal({batch, n, kDim}, 3);
  const Lens lens = make_lens(lens_values);
  const ValidLens valid_lens = lens.valid();
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  auto call = [&] {
    std::unique_ptr<float[]> scores(new float[static_cast<size_t>(batch * n * n)]);
    Tensor<float> out({batch, n, kDim});
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = lens.lens.empty() ? n : lens.lens(b);
      sgemm_rows(true, n, len, kDim, scale, q.data() + b * n * kDim, kDim, k.data() + b * n * kDim,
                 kDim, scores.get() + b * n * n, n);
    }
    const qkv::TensorView<float> scores_view(scores.get(), {batch, n, n});
    qkv::masked_softmax(scores_view, valid_lens, scores_view);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = lens.lens.empty() ? n : lens.lens(b);
      sgemm_rows(false, n, kDim, len, 1.0f, scores.get() + b * n * n, n, v.data() + b * n * kDim,
                 kDim, out.data() + b * n * kDim, kDim);
    }
    benchmark::DoNotOptimize(out.data());
    return bytes_of(out);
  };
  run(call, 4.0 * kDim * lens.pairs(batch, n, n), 0);
}

// Forward (with lse) then backward, d_output fixed and random. Returns
// output, lse, dQ, dK, dV. FLOPs: 14 D per valid pair (forward 4 D; backward
// recomputes Q Kᵀ, then dV, dW, dQ, dK: 10 D).
void sdpa_forward_backward(const Runner& run, int64_t batch, int64_t n,
                           const std::vector<int64_t>* lens_values) {
  constexpr int64_t kDim = 64;
  qkv::set_num_threads(2);
  const Tensor<float> q = random_normal({batch, n, kDim}, 1);
  const Tensor<float> k = random_normal({batch, n, kDim}, 2);
  const Tensor<float> v = random_normal({batch, n, kDim}, 3);
  const Tensor<float> d_out = random_normal({batch, n, kDim}, 4);
  const Lens lens = make_lens(lens_values);
  const ValidLens valid_lens = lens.valid();
  qkv::AttentionOptions options;
  options.return_lse = true;
  auto call = [&] {
    const qkv::AttentionResult<float> r =
        qkv::scaled_dot_product_attention(q, k, v, valid_lens, options);
    const qkv::DotProductGrads<float> g = qkv::scaled_dot_product_attention_backward(
        q, k, v, valid_lens, options, {r.output, r.lse}, d_out);
    benchmark::DoNotOptimize(g.d_queries.data());
    benchmark::DoNotOptimize(g.d_keys.data());
    benchmark::DoNotOptimize(g.d_values.data());
    return bytes_of(r.output) + bytes_of(r.lse) + bytes_of(g.d_queries) + bytes_of(g.d_keys) +
           bytes_of(g.d_values);
  };
  run(call, 14.0 * kDim * lens.pairs(batch, n, n), 0);
}

// ---- additive attention ------------------------------------------------------------

// q: (B, N, Dq)  k: (B, N, Dk)  v: (B, N, Dv)  w_q: (H, Dq)  w_k: (H, Dk)
// w_v: (1, H), Dq = Dk = Dv = H = 64, no mask. FLOPs (tanh counted as one):
//   forward  B N² (4H + 2Dv) + 2 B (Nq + Nk) D H   (add, tanh, w_v product; W V;
//            the projections)
//   backward B N² (11H + 4Dv) + 4 B (Nq + Nk) D H  (recompute add + tanh, score;
//            dW = dO·V, dV; dS; d features (1 - t²) w_v dS; their sums per query
//            and per key; dw_v; dW_q, dq, dW_k, dk)
void additive(const Runner& run, int64_t batch, int64_t n, bool backward) {
  constexpr int64_t kDim = 64, kHidden = 64;
  qkv::set_num_threads(2);
  const Tensor<float> q = random_normal({batch, n, kDim}, 1);
  const Tensor<float> k = random_normal({batch, n, kDim}, 2);
  const Tensor<float> v = random_normal({batch, n, kDim}, 3);
  const Tensor<float> d_out = random_normal({batch, n, kDim}, 4);
  const Tensor<float> w_q = linear_weight({kHidden, kDim}, kDim, 5);
  const Tensor<float> w_k = linear_weight({kHidden, kDim}, kDim, 6);
  const Tensor<float> w_v = linear_weight({1, kHidden}, kHidden, 7);
  const ValidLens no_lens;
  qkv::AttentionOptions options;
  options.return_lse = backward;
  auto call = [&] {
    const qkv::AttentionResult<float> r =
        qkv::additive_attention(q, k, v, {w_q, w_k, w_v}, no_lens, options);
    benchmark::DoNotOptimize(r.output.data());
    int64_t returned = bytes_of(r.output) + bytes_of(r.lse);
    if (backward) {
      const qkv::AdditiveGrads<float> g = qkv::additive_attention_backward(
          q, k, v, {w_q, w_k, w_v}, no_lens, options, {r.output, r.lse}, d_out);
      benchmark::DoNotOptimize(g.d_queries.data());
      returned += bytes_of(g.d_queries) + bytes_of(g.d_keys) + bytes_of(g.d_values) +
                  bytes_of(g.d_w_q) + bytes_of(g.d_w_k) + bytes_of(g.d_w_v);
    }
    return returned;
  };
  const auto pairs = static_cast<double>(batch * n * n);
  const auto projections = static_cast<double>(batch * 2 * n * kDim * kHidden);
  double flops = pairs * (4 * kHidden + 2 * kDim) + 2 * projections;
  if (backward) flops += pairs * (11 * kHidden + 4 * kDim) + 4 * projections;
  run(call, flops, 0);
}

// ---- masked softmax ------------------------------------------------------------------

// scores: (B, Nq, Nk)   valid_lens: absent or (B)   weights: (B, Nq, Nk),
// written into a buffer allocated (and touched) once, outside the timing: the
// op is memory-bound and a fresh result per call would add page faults.
// Bytes: 8 per element (read one score, write one weight), counted over every
// element as the target does, although masked scores are never read.
void softmax_forward(const Runner& run, int64_t batch, int64_t n,
                     const std::vector<int64_t>* lens_values) {
  qkv::set_num_threads(2);
  const Tensor<float> scores = random_normal({batch, n, n}, 1);
  Tensor<float> weights(scores.shape(), 0.0f);
  const Lens lens = make_lens(lens_values);
  const ValidLens valid_lens = lens.valid();
  auto call = [&] {
    qkv::masked_softmax(scores, valid_lens, weights.view());
    benchmark::DoNotOptimize(weights.data());
    return int64_t{0};  // the output buffer was resident before the reset
  };
  run(call, 5.0 * lens.pairs(batch, n, n), 8.0 * static_cast<double>(scores.numel()));
}

// ---- Nadaraya–Watson ------------------------------------------------------------------

// The chapter's data (d2l 11.2): n sorted x ~ U(0, 5), y = 2 sin x + x^0.8 +
// N(0, 0.5); t queries evenly spread over [0, 5); Gaussian kernel, h = 1;
// float64; exact evaluation of all n t terms (predict(queries, true)).
void nadaraya_watson(const Runner& run, int64_t n) {
  qkv::set_num_threads(2);
  std::mt19937 gen(8);
  std::uniform_real_distribution<double> uniform(0.0, 5.0);
  std::normal_distribution<double> noise(0.0, 0.5);
  Tensor<double> x({n}), y({n}), queries({n});
  for (double& xi : x.values()) xi = uniform(gen);
  std::sort(x.values().begin(), x.values().end());
  for (int64_t i = 0; i < n; ++i) {
    y(i) = 2.0 * std::sin(x(i)) + std::pow(x(i), 0.8) + noise(gen);
    queries(i) = 5.0 * static_cast<double>(i) / static_cast<double>(n);
  }
  const qkv::KernelRegression model(x, y);
  auto call = [&] {
    const qkv::KernelPrediction p = model.predict(queries, /*exact=*/true);
    benchmark::DoNotOptimize(p.values.data());
    return bytes_of(p.values);
  };
  // 6 flops per (query, key) pair: the difference, its square, the exp
  // (counted as 1, as tanh is in additive), the sum of weights, the weighted
  // sum (2). float64, so rated against the float64 FMA peak.
  run(call, 6.0 * static_cast<double>(n) * static_cast<double>(n), 0);
}

// ---- registration ------------------------------------------------------------------------

using Op = std::function<void(const Runner&)>;
std::vector<std::pair<std::string, Op>> g_ops;  // in registration order

// Registers op as a timed benchmark and for --perf_memory. An op that throws
// (out of memory, say) becomes an error row on the page, not the end of the run.
void add(const std::string& name, Op op) {
  g_ops.emplace_back(name, op);
  benchmark::RegisterBenchmark(name.c_str(),
                               [op](benchmark::State& state) {
                                 try {
                                   op([&](const OpCall& call, double flops, double bytes) {
                                     time_op(state, call, flops, bytes);
                                   });
                                 } catch (const std::exception& e) {
                                   state.SkipWithError(e.what());
                                 }
                               })
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
}

void register_all() {
  // Issue 5's shapes: one head of two 4096-token sequences, d = 64.
  for (const bool masked : {false, true}) {
    const std::vector<int64_t>* lens = masked ? &g_sdpa_lens : nullptr;
    const std::string suffix = masked ? "B2_N4096_lens" : "B2_N4096_nomask";
    add("sdpa_fwd/fused/" + suffix,
        [=](const Runner& run) { sdpa_forward(run, 2, 4096, lens, 2); });
    add("sdpa_fwd/unfused_blas/" + suffix,
        [=](const Runner& run) { sdpa_forward_unfused(run, 2, 4096, lens); });
    add("sdpa_fwd/bf16/" + suffix,
        [=](const Runner& run) { sdpa_forward_bf16(run, 2, 4096, lens); });
    add("sdpa_fwdbwd/fused/" + suffix,
        [=](const Runner& run) { sdpa_forward_backward(run, 2, 4096, lens); });
  }
  // Decoding (issue 14: bf16 >= 1.3x float32 where memory-bound).
  add("sdpa_decode/fused/B8_Nk131072", [](const Runner& run) { sdpa_decode<float>(run); });
  add("sdpa_decode/bf16/B8_Nk131072", [](const Runner& run) { sdpa_decode<qkv::bfloat16>(run); });
  // Issue 15: heads (B=2, H=8, N=4096, d=64) with masks, a window, a bias,
  // a strided layout; bf16 causal; grouped-query decoding.
  const std::pair<Heads, const char*> forms[] = {{Heads::kPlain, "B2_H8_N4096"},
                                                 {Heads::kStrided, "B2_H8_N4096_bnhd"},
                                                 {Heads::kCausal, "B2_H8_N4096_causal"},
                                                 {Heads::kMask, "B2_H8_N4096_mask"},
                                                 {Heads::kWindow, "B2_H8_N4096_window256"},
                                                 {Heads::kBias, "B2_H8_N4096_bias"}};
  for (const auto& [form, shape] : forms) {
    const Heads f = form;
    add(std::string("mha_fwd/fused/") + shape,
        [=](const Runner& run) { heads_attention<float>(run, f, false); });
  }
  add("mha_fwdbwd/fused/B2_H8_N4096",
      [](const Runner& run) { heads_attention<float>(run, Heads::kPlain, true); });
  add("mha_fwdbwd/fused/B2_H8_N4096_causal",
      [](const Runner& run) { heads_attention<float>(run, Heads::kCausal, true); });
  add("mha_fwd/bf16/B2_H8_N4096_causal",
      [](const Runner& run) { heads_attention<qkv::bfloat16>(run, Heads::kCausal, false); });
  // Issue 31's prefill rows against torch 2's SDPA (bench/perf_torch2.py):
  // bf16 unmasked, forward + backward in bf16, and d = 128 in both types.
  add("mha_fwd/bf16/B2_H8_N4096",
      [](const Runner& run) { heads_attention<qkv::bfloat16>(run, Heads::kPlain, false); });
  add("mha_fwdbwd/bf16/B2_H8_N4096",
      [](const Runner& run) { heads_attention<qkv::bfloat16>(run, Heads::kPlain, true); });
  add("mha_fwd/fused/B2_H8_N4096_d128",
      [](const Runner& run) { heads_attention<float>(run, Heads::kPlain, false, 128); });
  add("mha_fwd/bf16/B2_H8_N4096_d128",
      [](const Runner& run) { heads_attention<qkv::bfloat16>(run, Heads::kPlain, false, 128); });
  add("mha_fwdbwd/fused/B2_H8_N4096_d128",
      [](const Runner& run) { heads_attention<float>(run, Heads::kPlain, true, 128); });
  add("mha_fwdbwd/bf16/B2_H8_N4096_d128",
      [](const Runner& run) { heads_attention<qkv::bfloat16>(run, Heads::kPlain, true, 128); });
  add("gqa_decode/fused/B1_H32_Hkv8_Nk65536", [](const Runner& run) { gqa_decode<float>(run); });
  add("gqa_decode/bf16/B1_H32_Hkv8_Nk65536",
      [](const Runner& run) { gqa_decode<qkv::bfloat16>(run); });
  add("gqa_decode_paired/fused/B1_H32_Hkv8_Nk65536",
      [](const Runner& run) { gqa_decode_paired<float>(run); });
  add("gqa_decode_paired/bf16/B1_H32_Hkv8_Nk65536",
      [](const Runner& run) { gqa_decode_paired<qkv::bfloat16>(run); });
  // Issue 31, item 4: the fused AMX forward's rows (AMX to a quarter of its peak).
  add("amx_fwd/bf16/B2_N4096_d64", [](const Runner& run) { sdpa_forward_bf16_amx_shape(run, 64); });
  add("amx_fwd/bf16/B2_N4096_d128",
      [](const Runner& run) { sdpa_forward_bf16_amx_shape(run, 128); });
  // The same at 1 thread: how well the 2 threads scale.
  add("sdpa_fwd/fused_1thread/B2_N4096_nomask",
      [](const Runner& run) { sdpa_forward(run, 2, 4096, nullptr, 1); });
  // Bahdanau-style scoring, 4 sequences of 512 tokens, all sizes 64.
  add("additive_fwd/fused/B4_N512", [](const Runner& run) { additive(run, 4, 512, false); });
  add("additive_fwdbwd/fused/B4_N512", [](const Runner& run) { additive(run, 4, 512, true); });
  // One head's scores for 32 sequences of 512 tokens (BERT-base's maximum).
  add("softmax_fwd/fused/B32_N512_lens",
      [](const Runner& run) { softmax_forward(run, 32, 512, &g_softmax_lens); });
  add("softmax_fwd/fused/B32_N512_nomask",
      [](const Runner& run) { softmax_forward(run, 32, 512, nullptr); });
  add("nw_exact/fused/N30000", [](const Runner& run) { nadaraya_watson(run, 30000); });
  // The scaling sweep, B = 1, d = 64, no mask (N = 16384 is also the memory row).
  for (int64_t n = 512; n <= 32768; n *= 2) {
    add("sdpa_fwd/fused/B1_N" + std::to_string(n),
        [=](const Runner& run) { sdpa_forward(run, 1, n, nullptr, 2); });
  }
}

// --perf_memory=NAME: builds that op's inputs, measures one call's peak
// memory (measure_memory) and prints {"name": ..., "extra_bytes": ...} or
// {"name": ..., "error": ...}.
int memory_mode(const std::string& name) {
  for (const auto& [op_name, op] : g_ops) {
    if (op_name != name) continue;
    try {
      op([&](const OpCall& call, double, double) {
        std::printf("{\"name\": \"%s\", \"extra_bytes\": %lld}\n", name.c_str(),
                    static_cast<long long>(measure_memory(call)));
      });
    } catch (const std::exception& e) {
      std::string message = e.what();
      for (char& c : message) {
        if (c == '"' || c == '\\' || c == '\n') c = ' ';
      }
      std::printf("{\"name\": \"%s\", \"error\": \"%s\"}\n", name.c_str(), message.c_str());
    }
    return 0;
  }
  std::fprintf(stderr, "bench_perf: no op named %s\n", name.c_str());
  return 1;
}

// "--flag=1,2,3" -> {1, 2, 3}; false if arg is not this flag.
bool parse_list_flag(const char* arg, const std::string& flag, std::vector<int64_t>& out) {
  const std::string prefix = "--" + flag + "=";
  if (std::strncmp(arg, prefix.c_str(), prefix.size()) != 0) return false;
  std::stringstream list(arg + prefix.size());
  std::string item;
  out.clear();
  while (std::getline(list, item, ',')) out.push_back(std::stoll(item));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  try {
    qkv::set_simd_target_from_env();  // QKV_SIMD_TARGET=avx2: the AVX2 code on any machine
  } catch (const qkv::Error& e) {
    std::fprintf(stderr, "bench_perf: %s\n", e.what());
    return 2;
  }
  benchmark::AddCustomContext("simd_target", qkv::simd_target());
  // The bf16 products' path ("amx", "avx512_bf16" or "widen"): which peak the
  // bf16 rows are rated against.
  const qkv::SimdInfo simd = qkv::simd_info();
  benchmark::AddCustomContext("bf16_products", simd.bf16_products);
  // OpenBLAS's kernels: what it chose as it loaded, from what, and what runs
  // (qkv's choice, or QKV_BLAS_CORE's).
  benchmark::AddCustomContext("blas_core", simd.blas_core);
  benchmark::AddCustomContext("blas_core_found", simd.blas_core_found);
  benchmark::AddCustomContext("blas_core_from", simd.blas_core_from);
  std::string memory_op;
  for (int i = 1; i < argc; ++i) {
    const std::string memory_flag = "--perf_memory=";
    if (std::strncmp(argv[i], memory_flag.c_str(), memory_flag.size()) == 0) {
      memory_op = argv[i] + memory_flag.size();
    } else if (!parse_list_flag(argv[i], "perf_sdpa_lens", g_sdpa_lens) &&
               !parse_list_flag(argv[i], "perf_softmax_lens", g_softmax_lens)) {
      std::fprintf(stderr, "bench_perf: unknown argument %s\n", argv[i]);
      return 1;
    }
  }
  if (g_sdpa_lens.size() != 2 || g_softmax_lens.size() != 32) {
    std::fprintf(
        stderr,
        "bench_perf: needs --perf_sdpa_lens (2 lengths in [1, 4096]) and "
        "--perf_softmax_lens (32 lengths in [1, 512]); bench/performance.py passes them\n");
    return 1;
  }
  // qkv makes OpenBLAS single-threaded on its first parallel call; the
  // unfused composition calls OpenBLAS directly, so do it here too.
  openblas_set_num_threads(1);
  benchmark::AddCustomContext("openblas_config", openblas_get_config());
  register_all();
  if (!memory_op.empty()) return memory_mode(memory_op);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
