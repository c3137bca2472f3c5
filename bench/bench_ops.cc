// Google Benchmark for qkv's ops: masked softmax, scaled dot-product attention
// (forward, and forward + backward) and additive attention. Each op is one
// function templated on the version, registered for the reference
// (qkv::ref::X) and the fast (qkv::X) version side by side; the reference only
// on the smaller shapes, where it finishes in reasonable time.
//
//   build/<dir>/bench/bench_ops --benchmark_filter=Sdpa --benchmark_min_time=0.5
//
// Arguments of every benchmark: the shape, lens (0: none; 1: random 1-D valid
// lengths in [1, Nk], one per batch element) and threads (qkv::set_num_threads).
// Time threads:2 on an otherwise idle machine: with another process busy on
// one of 2 cores, OpenMP's default spin-waiting made threads:2 5-17x slower
// than threads:1 here (OMP_WAIT_POLICY=passive brought it back to 1x).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "qkv/qkv.h"

namespace {

using qkv::ConstView;
using qkv::Tensor;
using qkv::ValidLens;

// ---- the two versions ------------------------------------------------------

// Additive attention is timed with the lse on (the backward needs it; it costs
// one store per query).
qkv::AttentionOptions additive_options() {
  qkv::AttentionOptions options;
  options.return_lse = true;
  return options;
}

// The reference: plain loops, double accumulation, single-threaded. It only
// has the allocating form, so its softmax timing includes the allocation.
struct Ref {
  static void masked_softmax(ConstView<float> scores, const ValidLens& lens, Tensor<float>& out) {
    out = qkv::ref::masked_softmax(scores, lens);
  }
  static void masked_softmax_backward(ConstView<float> w, ConstView<float> d_w,
                                      const ValidLens& lens, Tensor<float>& out) {
    out = qkv::ref::masked_softmax_backward(w, d_w, lens);
  }
  static qkv::AttentionResult<float> sdpa(ConstView<float> q, ConstView<float> k,
                                          ConstView<float> v, const ValidLens& lens,
                                          const qkv::AttentionOptions& options) {
    return qkv::ref::scaled_dot_product_attention(q, k, v, lens, options);
  }
  static qkv::DotProductGrads<float> sdpa_backward(ConstView<float> q, ConstView<float> k,
                                                   ConstView<float> v, const ValidLens& lens,
                                                   const qkv::AttentionOptions& options,
                                                   ConstView<float> out, ConstView<float> lse,
                                                   ConstView<float> d_out) {
    return qkv::ref::scaled_dot_product_attention_backward(q, k, v, lens, options, {out, lse},
                                                           d_out);
  }
  static qkv::AttentionResult<float> additive(ConstView<float> q, ConstView<float> k,
                                              ConstView<float> v, ConstView<float> w_q,
                                              ConstView<float> w_k, ConstView<float> w_v,
                                              const ValidLens& lens) {
    return qkv::ref::additive_attention(q, k, v, {w_q, w_k, w_v}, lens, additive_options());
  }
  static qkv::AdditiveGrads<float> additive_backward(
      ConstView<float> q, ConstView<float> k, ConstView<float> v, ConstView<float> w_q,
      ConstView<float> w_k, ConstView<float> w_v, const ValidLens& lens, ConstView<float> out,
      ConstView<float> lse, ConstView<float> d_out) {
    return qkv::ref::additive_attention_backward(q, k, v, {w_q, w_k, w_v}, lens, additive_options(),
                                                 {out, lse}, d_out);
  }
};

// The fast version, as the public API serves it. Masked softmax and its
// backward write into a buffer allocated once: the op is memory-bound, and a
// fresh 32 MiB result per call would add page faults to the timing (glibc
// maps blocks that large anew on every allocation: ~20 ms at (32, 512, 512)).
struct Fast {
  static void masked_softmax(ConstView<float> scores, const ValidLens& lens, Tensor<float>& out) {
    qkv::masked_softmax(scores, lens, out.view());
  }
  static void masked_softmax_backward(ConstView<float> w, ConstView<float> d_w,
                                      const ValidLens& lens, Tensor<float>& out) {
    qkv::masked_softmax_backward(w, d_w, lens, out.view());
  }
  static qkv::AttentionResult<float> sdpa(ConstView<float> q, ConstView<float> k,
                                          ConstView<float> v, const ValidLens& lens,
                                          const qkv::AttentionOptions& options) {
    return qkv::scaled_dot_product_attention(q, k, v, lens, options);
  }
  static qkv::DotProductGrads<float> sdpa_backward(ConstView<float> q, ConstView<float> k,
                                                   ConstView<float> v, const ValidLens& lens,
                                                   const qkv::AttentionOptions& options,
                                                   ConstView<float> out, ConstView<float> lse,
                                                   ConstView<float> d_out) {
    return qkv::scaled_dot_product_attention_backward(q, k, v, lens, options, {out, lse}, d_out);
  }
  static qkv::AttentionResult<float> additive(ConstView<float> q, ConstView<float> k,
                                              ConstView<float> v, ConstView<float> w_q,
                                              ConstView<float> w_k, ConstView<float> w_v,
                                              const ValidLens& lens) {
    return qkv::additive_attention(q, k, v, {w_q, w_k, w_v}, lens, additive_options());
  }
  static qkv::AdditiveGrads<float> additive_backward(
      ConstView<float> q, ConstView<float> k, ConstView<float> v, ConstView<float> w_q,
      ConstView<float> w_k, ConstView<float> w_v, const ValidLens& lens, ConstView<float> out,
      ConstView<float> lse, ConstView<float> d_out) {
    return qkv::additive_attention_backward(q, k, v, {w_q, w_k, w_v}, lens, additive_options(),
                                            {out, lse}, d_out);
  }
};

// ---- inputs ----------------------------------------------------------------

Tensor<float> random_normal(qkv::Shape shape, uint32_t seed, float stddev = 1.0f) {
  Tensor<float> t(shape);
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  for (float& x : t.values()) x = dist(gen);
  return t;
}

// Random 1-D valid lengths in [1, num_keys], fixed by the seed.
Tensor<int64_t> random_lens(int64_t batch, int64_t num_keys, uint32_t seed) {
  Tensor<int64_t> lens(qkv::Shape{batch});
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int64_t> dist(1, num_keys);
  for (int64_t& l : lens.values()) l = dist(gen);
  return lens;
}

// Number of (query, key) pairs whose key is valid: the work a masking kernel
// cannot skip. Without lens, every pair.
double valid_pairs(const Tensor<int64_t>& lens, bool use_lens, int64_t batch, int64_t num_queries,
                   int64_t num_keys) {
  if (!use_lens) return static_cast<double>(batch * num_queries * num_keys);
  double pairs = 0;
  for (int64_t b = 0; b < batch; ++b) pairs += static_cast<double>(num_queries * lens(b));
  return pairs;
}

void set_rates(benchmark::State& state, double flops_per_iter, double bytes_per_iter) {
  const auto iters = static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(bytes_per_iter * iters));
  state.counters["FLOP/s"] =
      benchmark::Counter(flops_per_iter * iters, benchmark::Counter::kIsRate);
}

// ---- masked softmax ----------------------------------------------------------

// scores: (B, Nq, Nk)   valid_lens: absent or (B)   weights: (B, Nq, Nk)
// range(5) = 1 times the backward instead (weights and d_weights in, d_scores
// out). Bytes as issue 5 counts them: 8 per element forward (X read, W
// written, whatever the lengths), 12 backward (W and dW read, dX written).
// FLOPs: 5 per valid element forward (max, subtract, exp, sum, scale; exp
// counted as one), 4 backward.
template <class Version>
void BM_MaskedSoftmax(benchmark::State& state) {
  const int64_t batch = state.range(0), num_queries = state.range(1), num_keys = state.range(2);
  const bool use_lens = state.range(3) != 0;
  const bool backward = state.range(4) != 0;
  qkv::set_num_threads(static_cast<int>(state.range(5)));
  const Tensor<float> scores = random_normal({batch, num_queries, num_keys}, 1);
  const Tensor<float> d_weights = random_normal({batch, num_queries, num_keys}, 3);
  const Tensor<int64_t> lens = random_lens(batch, num_keys, 2);
  const ValidLens valid_lens = use_lens ? ValidLens(lens) : ValidLens();
  Tensor<float> weights(scores.shape());
  Version::masked_softmax(scores, valid_lens, weights);
  Tensor<float> d_scores(scores.shape());

  for (auto _ : state) {
    if (backward) {
      Version::masked_softmax_backward(weights, d_weights, valid_lens, d_scores);
      benchmark::DoNotOptimize(d_scores.data());
    } else {
      Version::masked_softmax(scores, valid_lens, weights);
      benchmark::DoNotOptimize(weights.data());
    }
    benchmark::ClobberMemory();
  }

  const double valid = valid_pairs(lens, use_lens, batch, num_queries, num_keys);
  const auto elements = static_cast<double>(scores.numel());
  set_rates(state, (backward ? 4.0 : 5.0) * valid,
            (backward ? 3.0 : 2.0) * elements * sizeof(float));
}

const std::vector<std::string> kSoftmaxArgNames = {"B", "Nq", "Nk", "lens", "backward", "threads"};

// One head's attention scores for a batch of 32 sequences of 512 tokens
// (BERT-base's maximum sequence length), and a quarter of that batch. The
// reference is linear in the size too (tens of ms here), so it runs on both.
BENCHMARK_TEMPLATE(BM_MaskedSoftmax, Ref)
    ->ArgNames(kSoftmaxArgNames)
    ->ArgsProduct({{8, 32}, {512}, {512}, {0, 1}, {0, 1}, {1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_MaskedSoftmax, Fast)
    ->ArgNames(kSoftmaxArgNames)
    ->ArgsProduct({{8, 32}, {512}, {512}, {0, 1}, {0, 1}, {1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The ceiling for the memory-bound softmax: this machine's stream copy, a
// 128 MiB buffer copied into another (256 MiB touched), split into one
// contiguous half per thread. Bytes: read once plus written once, as STREAM
// counts copy.
void BM_MaskedSoftmaxStreamCopy(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const int64_t n = int64_t{32} << 20;  // floats
  std::vector<float> src(static_cast<size_t>(n), 1.0f), dst(static_cast<size_t>(n), 0.0f);
  for (auto _ : state) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < threads; ++t) {
      const int64_t begin = n * t / threads, end = n * (t + 1) / threads;
      std::copy(src.data() + begin, src.data() + end, dst.data() + begin);
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 2 * n *
                          static_cast<int64_t>(sizeof(float)));
}
BENCHMARK(BM_MaskedSoftmaxStreamCopy)
    ->ArgNames({"threads"})
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// ---- scaled dot-product attention ---------------------------------------------

// q: (B, Nq, D)   k: (B, Nk, D)   v: (B, Nk, D)   valid_lens: absent or (B)
// out: (B, Nq, D). Nq = Nk = N, Dv = D. range(4) = 1 adds the backward.
// FLOPs over valid (query, key) pairs: 4 D forward (Q Kᵀ and W V), 14 D
// forward + backward (recomputing the weights, dV, dW, dQ, dK: 10 D more).
// Bytes: every input read once and every output written once.
template <class Version>
void BM_Sdpa(benchmark::State& state) {
  const int64_t batch = state.range(0), n = state.range(1), dim = state.range(2);
  const bool use_lens = state.range(3) != 0;
  const bool backward = state.range(4) != 0;
  qkv::set_num_threads(static_cast<int>(state.range(5)));
  const Tensor<float> q = random_normal({batch, n, dim}, 1);
  const Tensor<float> k = random_normal({batch, n, dim}, 2);
  const Tensor<float> v = random_normal({batch, n, dim}, 3);
  const Tensor<float> d_out = random_normal({batch, n, dim}, 4);
  const Tensor<int64_t> lens = random_lens(batch, n, 5);
  const ValidLens valid_lens = use_lens ? ValidLens(lens) : ValidLens();
  qkv::AttentionOptions options;
  options.return_lse = backward;

  for (auto _ : state) {
    qkv::AttentionResult<float> result = Version::sdpa(q, k, v, valid_lens, options);
    benchmark::DoNotOptimize(result.output.data());
    if (backward) {
      qkv::DotProductGrads<float> grads =
          Version::sdpa_backward(q, k, v, valid_lens, options, result.output, result.lse, d_out);
      benchmark::DoNotOptimize(grads.d_queries.data());
      benchmark::DoNotOptimize(grads.d_keys.data());
      benchmark::DoNotOptimize(grads.d_values.data());
    }
    benchmark::ClobberMemory();
  }

  const double pairs = valid_pairs(lens, use_lens, batch, n, n);
  const double tensor = static_cast<double>(batch * n * dim);  // Q, K, V, O, dO, dQ, dK or dV
  const double lse = static_cast<double>(batch * n);
  const double forward_bytes = (4 * tensor + (backward ? lse : 0)) * sizeof(float);
  const double backward_bytes = (8 * tensor + lse) * sizeof(float);
  set_rates(state, (backward ? 14.0 : 4.0) * pairs * static_cast<double>(dim),
            forward_bytes + (backward ? backward_bytes : 0));
}

const std::vector<std::string> kSdpaArgNames = {"B", "N", "D", "lens", "backward", "threads"};

// One head of a 1024-token sequence at GPT-2's head_dim 64, batch 2; the
// reference (and the fast version next to it) at N = 256.
BENCHMARK_TEMPLATE(BM_Sdpa, Ref)
    ->ArgNames(kSdpaArgNames)
    ->ArgsProduct({{2}, {256}, {64}, {0, 1}, {0, 1}, {1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_Sdpa, Fast)
    ->ArgNames(kSdpaArgNames)
    ->ArgsProduct({{2}, {256, 1024}, {64}, {0, 1}, {0, 1}, {1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// ---- additive attention ---------------------------------------------------------

// q: (B, Nq, H)   k: (B, Nk, H)   v: (B, Nk, H)   w_q, w_k: (H, H)   w_v: (1, H)
// out: (B, Nq, H). Nq = Nk = N, and query, key, hidden and value sizes all H.
// range(4) = 1 adds the backward. FLOPs: the projections W_q q and W_k k (2 H²
// per query and per key), then per valid (query, key) pair 4 H for w_vᵀ
// tanh(. + .) (tanh counted as one) and 2 H for the weighted sum of V; the
// backward adds the projections' gradients (8 H² per query and key) and per
// pair 4 H for the recomputed scores, 4 H for dP and dV and 8 H through tanh
// and w_v. Bytes: inputs and parameters read once, output written once (and
// the gradients too with the backward).
template <class Version>
void BM_Additive(benchmark::State& state) {
  const int64_t batch = state.range(0), n = state.range(1), hidden = state.range(2);
  const bool use_lens = state.range(3) != 0;
  const bool backward = state.range(4) != 0;
  qkv::set_num_threads(static_cast<int>(state.range(5)));
  const Tensor<float> q = random_normal({batch, n, hidden}, 1);
  const Tensor<float> k = random_normal({batch, n, hidden}, 2);
  const Tensor<float> v = random_normal({batch, n, hidden}, 3);
  const Tensor<float> d_out = random_normal({batch, n, hidden}, 8);
  // Like torch.nn.Linear's initialisation scale, 1/sqrt(fan_in).
  const float init = 1.0f / std::sqrt(static_cast<float>(hidden));
  const Tensor<float> w_q = random_normal({hidden, hidden}, 4, init);
  const Tensor<float> w_k = random_normal({hidden, hidden}, 5, init);
  const Tensor<float> w_v = random_normal({1, hidden}, 6, init);
  const Tensor<int64_t> lens = random_lens(batch, n, 7);
  const ValidLens valid_lens = use_lens ? ValidLens(lens) : ValidLens();

  for (auto _ : state) {
    qkv::AttentionResult<float> result = Version::additive(q, k, v, w_q, w_k, w_v, valid_lens);
    benchmark::DoNotOptimize(result.output.data());
    if (backward) {
      qkv::AdditiveGrads<float> grads = Version::additive_backward(
          q, k, v, w_q, w_k, w_v, valid_lens, result.output, result.lse, d_out);
      benchmark::DoNotOptimize(grads.d_queries.data());
      benchmark::DoNotOptimize(grads.d_keys.data());
      benchmark::DoNotOptimize(grads.d_w_v.data());
    }
    benchmark::ClobberMemory();
  }

  const auto h = static_cast<double>(hidden);
  const double pairs = valid_pairs(lens, use_lens, batch, n, n);
  const double rows = static_cast<double>(2 * batch * n);  // queries and keys
  const double forward_flops = 2.0 * h * h * rows + 6.0 * h * pairs;
  const double backward_flops = 8.0 * h * h * rows + 16.0 * h * pairs;
  const double tensor = static_cast<double>(batch * n * hidden);
  const double params = 2 * h * h + h;
  const double forward_bytes = (4 * tensor + params) * sizeof(float);
  const double backward_bytes = (6 * tensor + 2 * params) * sizeof(float);
  set_rates(state, forward_flops + (backward ? backward_flops : 0),
            forward_bytes + (backward ? backward_bytes : 0));
}

const std::vector<std::string> kAdditiveArgNames = {"B", "N", "H", "lens", "backward", "threads"};

// Bahdanau-style scoring at realistic sequence lengths: 4 sequences of 256 and
// 512 tokens (issue 5's target shape), query = key = hidden = value size 64;
// the reference (and the fast version next to it) at N = 64.
BENCHMARK_TEMPLATE(BM_Additive, Ref)
    ->ArgNames(kAdditiveArgNames)
    ->ArgsProduct({{4}, {64}, {64}, {0, 1}, {0, 1}, {1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_Additive, Fast)
    ->ArgNames(kAdditiveArgNames)
    ->ArgsProduct({{4}, {64, 256, 512}, {64}, {0, 1}, {0, 1}, {1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
