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

// The reference: plain loops, double accumulation, single-threaded. It only
// has the allocating form, so its softmax timing includes the allocation.
struct Ref {
  static void masked_softmax(ConstView<float> scores, const ValidLens& lens, Tensor<float>& out) {
    out = qkv::ref::masked_softmax(scores, lens);
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
    return qkv::ref::scaled_dot_product_attention_backward(q, k, v, lens, options, out, lse, d_out);
  }
  static qkv::AttentionResult<float> additive(ConstView<float> q, ConstView<float> k,
                                              ConstView<float> v, ConstView<float> w_q,
                                              ConstView<float> w_k, ConstView<float> w_v,
                                              const ValidLens& lens) {
    return qkv::ref::additive_attention(q, k, v, w_q, w_k, w_v, lens);
  }
};

// The fast version, as the public API serves it. Masked softmax writes into a
// buffer allocated once: the op is memory-bound, and a fresh zero-filled
// 32 MiB result per call would add a write pass and page faults to the timing.
struct Fast {
  static void masked_softmax(ConstView<float> scores, const ValidLens& lens, Tensor<float>& out) {
    qkv::masked_softmax(scores, lens, out.view());
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
    return qkv::scaled_dot_product_attention_backward(q, k, v, lens, options, out, lse, d_out);
  }
  static qkv::AttentionResult<float> additive(ConstView<float> q, ConstView<float> k,
                                              ConstView<float> v, ConstView<float> w_q,
                                              ConstView<float> w_k, ConstView<float> w_v,
                                              const ValidLens& lens) {
    return qkv::additive_attention(q, k, v, w_q, w_k, w_v, lens);
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
// Bytes: the valid scores read once and every weight written once. FLOPs: 5
// per valid element (max, subtract, exp, sum, scale; exp counted as one).
template <class Version>
void BM_MaskedSoftmax(benchmark::State& state) {
  const int64_t batch = state.range(0), num_queries = state.range(1), num_keys = state.range(2);
  const bool use_lens = state.range(3) != 0;
  qkv::set_num_threads(static_cast<int>(state.range(4)));
  const Tensor<float> scores = random_normal({batch, num_queries, num_keys}, 1);
  const Tensor<int64_t> lens = random_lens(batch, num_keys, 2);
  const ValidLens valid_lens = use_lens ? ValidLens(lens) : ValidLens();
  Tensor<float> weights(scores.shape());

  for (auto _ : state) {
    Version::masked_softmax(scores, valid_lens, weights);
    benchmark::DoNotOptimize(weights.data());
    benchmark::ClobberMemory();
  }

  const double valid = valid_pairs(lens, use_lens, batch, num_queries, num_keys);
  set_rates(state, 5.0 * valid, (valid + static_cast<double>(scores.numel())) * sizeof(float));
}

const std::vector<std::string> kSoftmaxArgNames = {"B", "Nq", "Nk", "lens", "threads"};

// One head's attention scores for a batch of 32 sequences of 512 tokens
// (BERT-base's maximum sequence length), and a quarter of that batch. The
// reference is linear in the size too (tens of ms here), so it runs on both.
BENCHMARK_TEMPLATE(BM_MaskedSoftmax, Ref)
    ->ArgNames(kSoftmaxArgNames)
    ->ArgsProduct({{8, 32}, {512}, {512}, {0, 1}, {1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_MaskedSoftmax, Fast)
    ->ArgNames(kSoftmaxArgNames)
    ->ArgsProduct({{8, 32}, {512}, {512}, {0, 1}, {1, 2}})
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
  options.want_lse = backward;

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
// FLOPs: the projections W_q q and W_k k (2 H² per query and per key), then per
// valid (query, key) pair 4 H for w_vᵀ tanh(. + .) (tanh counted as one) and
// 2 H for the weighted sum of V. Bytes: inputs and parameters read once, output
// written once.
template <class Version>
void BM_Additive(benchmark::State& state) {
  const int64_t batch = state.range(0), n = state.range(1), hidden = state.range(2);
  const bool use_lens = state.range(3) != 0;
  qkv::set_num_threads(static_cast<int>(state.range(4)));
  const Tensor<float> q = random_normal({batch, n, hidden}, 1);
  const Tensor<float> k = random_normal({batch, n, hidden}, 2);
  const Tensor<float> v = random_normal({batch, n, hidden}, 3);
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
    benchmark::ClobberMemory();
  }

  const auto h = static_cast<double>(hidden);
  const double pairs = valid_pairs(lens, use_lens, batch, n, n);
  const double projections = 2.0 * h * h * static_cast<double>(2 * batch * n);
  const double tensor = static_cast<double>(batch * n * hidden);
  set_rates(state, projections + 6.0 * h * pairs, (4 * tensor + 2 * h * h + h) * sizeof(float));
}

const std::vector<std::string> kAdditiveArgNames = {"B", "N", "H", "lens", "threads"};

// Bahdanau-style scoring at a realistic sequence length: 4 sequences of 256
// tokens, query = key = hidden = value size 64; the reference (and the fast
// version next to it) at N = 64.
BENCHMARK_TEMPLATE(BM_Additive, Ref)
    ->ArgNames(kAdditiveArgNames)
    ->ArgsProduct({{4}, {64}, {64}, {0, 1}, {1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_Additive, Fast)
    ->ArgNames(kAdditiveArgNames)
    ->ArgsProduct({{4}, {64, 256}, {64}, {0, 1}, {1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
