// Tests of qkv's threading contract (qkv/threads.h, DESIGN.md "Determinism"):
// the same inputs and seed give bitwise-identical results with 1 or N threads,
// on shapes large enough to be split into many blocks; the thread count
// itself; and the dropout mask of the attention forwards being dropout_keep's.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "test_util.h"

namespace qkv::test {
namespace {

// B=3, Nq=300, Nk=517 (odd, not a multiple of any SIMD width or block size),
// D=64 (a common head_dim), Dv=48: hundreds of row and key blocks.
constexpr int64_t kBatch = 3, kQueries = 300, kKeys = 517, kHeadDim = 64, kValueDim = 48;

template <class T>
using Named = std::vector<std::pair<std::string, Tensor<T>>>;

// Runs `run` (returning named tensors) with 1 thread, then with 2 and 3, and
// expects every tensor to be bitwise identical to the 1-thread one.
template <class T, class F>
void expect_thread_independent(F&& run) {
  Named<T> base;
  {
    ThreadCount one(1);
    ASSERT_EQ(num_threads(), 1);
    base = run();
  }
  for (int n : {2, 3}) {
    ThreadCount count(n);
    ASSERT_EQ(num_threads(), n);
    const Named<T> other = run();
    ASSERT_EQ(other.size(), base.size());
    for (size_t k = 0; k < base.size(); ++k) {
      ASSERT_FALSE(base[k].second.empty()) << base[k].first << " was not computed";
      expect_bitwise_equal(other[k].second, base[k].second,
                           base[k].first + ": " + std::to_string(n) + " threads vs 1");
    }
  }
}

// Valid lengths of each form, owned here; `view` is what the ops take.
struct Lens {
  LensForm form;
  Tensor<int32_t> int32;
  Tensor<int64_t> int64;
  ValidLens view() const {
    if (!int32.empty()) return ValidLens(int32);
    if (!int64.empty()) return ValidLens(int64);
    return ValidLens{};
  }
};

// No lengths, int32 (B) and int64 (B, Nq), each with some zeros and at
// least one full row (so that there is something to compare).
std::vector<Lens> all_lens(Rng& rng, int64_t batch, int64_t num_queries, int64_t num_keys) {
  std::vector<Lens> out;
  out.push_back({LensForm::kNone, {}, {}});
  out.push_back({LensForm::kPerBatch,
                 random_lens<int32_t>(rng, LensForm::kPerBatch, batch, num_queries, num_keys),
                 {}});
  out.push_back({LensForm::kPerQuery,
                 {},
                 random_lens<int64_t>(rng, LensForm::kPerQuery, batch, num_queries, num_keys)});
  out[1].int32.values().back() = static_cast<int32_t>(num_keys);
  out[2].int64.values().back() = num_keys;
  return out;
}

// ---- the thread count ----------------------------------------------------------

TEST(Threads, SetAndQuery) {
  {
    ThreadCount count(1);
    EXPECT_EQ(num_threads(), 1);
    set_num_threads(7);
    EXPECT_EQ(num_threads(), 7);
  }
  EXPECT_GE(num_threads(), 1);
}

// ---- stopping a call (InterruptPoll) ---------------------------------------------

std::atomic<int> polls{0};
std::atomic<int> stop_after{0};
bool stop_when_told() { return ++polls > stop_after; }

// An InterruptPoll that says stop makes a long call throw Interrupted
// between its tasks, at 1 and 2 threads; one that never says stop changes
// no bit; a short call never asks (the first poll waits kInterruptPollMs).
TEST(Threads, AnInterruptPollStopsALongCallAndChangesNothingElse) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t n = kSanitized ? 800 : 2000;
  const Tensor<double> q = random_tensor<double>(rng, Shape{1, n, 64});
  const Tensor<double> k = random_tensor<double>(rng, Shape{1, n, 64});
  const Tensor<double> v = random_tensor<double>(rng, Shape{1, n, 64});
  const AttentionResult<double> want = scaled_dot_product_attention(q, k, v);
  for (const int threads : {1, 2}) {
    ThreadCount count(threads);
    {
      polls = 0;
      stop_after = 1 << 30;
      const InterruptPoll poll(stop_when_told);
      // Long enough to poll: 10 calls of about 10 ms (Release), a poll every 20 ms.
      for (int i = 0; i < 10; ++i) {
        expect_bitwise_equal(scaled_dot_product_attention(q, k, v).output, want.output, "output");
      }
      EXPECT_GT(polls.load(), 0);
    }
    {
      polls = 0;
      stop_after = 0;
      const InterruptPoll poll(stop_when_told);
      const auto call = [&] {
        for (int i = 0; i < 200; ++i) scaled_dot_product_attention(q, k, v);
      };
      EXPECT_THROW(call(), Interrupted);
      EXPECT_EQ(polls.load(), 1);
    }
    // Without a poll nothing asks.
    polls = 0;
    scaled_dot_product_attention(q, k, v);
    EXPECT_EQ(polls.load(), 0);
  }
}

TEST(Threads, NegativeCountIsAnError) {
  set_num_threads(2);
  expect_error([] { set_num_threads(-1); }, {"set_num_threads", "-1"});
  EXPECT_EQ(num_threads(), 2) << "a rejected call changed the thread count";
  set_num_threads(0);
}

TEST(Threads, CountsAboveTheLimitAreAnError) {
  set_num_threads(2);
  expect_error([] { set_num_threads(kMaxThreads + 1); },
               {"set_num_threads", std::to_string(kMaxThreads + 1), std::to_string(kMaxThreads)});
  expect_error([] { set_num_threads(100000); }, {"set_num_threads", "100000"});
  EXPECT_EQ(num_threads(), 2) << "a rejected call changed the thread count";
  set_num_threads(0);
}

TEST(Threads, EnvironmentAboveTheLimitIsIgnored) {
  const char* old = std::getenv("QKV_NUM_THREADS");
  const std::optional<std::string> saved = old ? std::optional<std::string>(old) : std::nullopt;
  ASSERT_EQ(unsetenv("QKV_NUM_THREADS"), 0);
  set_num_threads(0);
  const int default_count = num_threads();
  EXPECT_LE(default_count, kMaxThreads);
  for (const char* value : {"1025", "100000", "0", "-3", "2x"}) {
    ASSERT_EQ(setenv("QKV_NUM_THREADS", value, 1), 0);
    EXPECT_EQ(num_threads(), default_count) << "QKV_NUM_THREADS=" << value;
  }
  ASSERT_EQ(setenv("QKV_NUM_THREADS", std::to_string(kMaxThreads).c_str(), 1), 0);
  EXPECT_EQ(num_threads(), kMaxThreads);
  if (saved) {
    setenv("QKV_NUM_THREADS", saved->c_str(), 1);
  } else {
    unsetenv("QKV_NUM_THREADS");
  }
}

TEST(Threads, TheLimitItselfRunsAndGivesTheSameBits) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  // Enough rows that all 1024 threads take part.
  const Tensor<float> x = random_tensor<float>(rng, Shape{4, 2048, 37}, -8.0, 8.0);
  Tensor<float> one, many;
  {
    ThreadCount count(1);
    one = masked_softmax(x, ValidLens{});
  }
  {
    ThreadCount count(kMaxThreads);
    ASSERT_EQ(num_threads(), kMaxThreads);
    many = masked_softmax(x, ValidLens{});
  }
  expect_bitwise_equal(many, one, "masked_softmax: 1024 threads vs 1");
}

TEST(Threads, DefaultComesFromTheEnvironment) {
  const char* old = std::getenv("QKV_NUM_THREADS");
  const std::optional<std::string> saved = old ? std::optional<std::string>(old) : std::nullopt;
  ASSERT_EQ(setenv("QKV_NUM_THREADS", "3", 1), 0);
  set_num_threads(0);
  EXPECT_EQ(num_threads(), 3);
  set_num_threads(5);  // an explicit count wins over the environment
  EXPECT_EQ(num_threads(), 5);
  set_num_threads(0);
  EXPECT_EQ(num_threads(), 3);
  if (saved) {
    setenv("QKV_NUM_THREADS", saved->c_str(), 1);
  } else {
    unsetenv("QKV_NUM_THREADS");
  }
  set_num_threads(0);
  EXPECT_GE(num_threads(), 1);
}

// ---- bitwise identical with 1, 2 and 3 threads ---------------------------------

template <class T>
class Determinism : public ::testing::Test {};
using FloatTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Determinism, FloatTypes);

TYPED_TEST(Determinism, MaskedSoftmaxAndBackward) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Shape shape{kBatch, kQueries, kKeys};
  const Tensor<T> x = random_tensor<T>(rng, shape, -8.0, 8.0);
  const Tensor<T> g = random_tensor<T>(rng, shape);
  for (const Lens& lens : all_lens(rng, kBatch, kQueries, kKeys)) {
    SCOPED_TRACE(to_string(lens.form));
    expect_thread_independent<T>([&] {
      Named<T> out;
      Tensor<T> w = masked_softmax(x, lens.view());
      out.emplace_back("masked_softmax_backward", masked_softmax_backward(w, g, lens.view()));
      Tensor<T> in_place = x;
      masked_softmax(in_place.view(), lens.view(), in_place.view());
      out.emplace_back("masked_softmax in place", std::move(in_place));
      out.emplace_back("masked_softmax", std::move(w));
      return out;
    });
  }
}

TEST(Determinism, PoolingFloat) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tensor<float> w = random_tensor<float>(rng, Shape{kBatch, kQueries, kKeys});
  const Tensor<float> v = random_tensor<float>(rng, Shape{kBatch, kKeys, kValueDim});
  const Tensor<int64_t> lens = random_lens(rng, LensForm::kPerQuery, kBatch, kQueries, kKeys);
  expect_thread_independent<float>([&] {
    Named<float> out;
    out.emplace_back("attention_pooling", attention_pooling(w, v));
    out.emplace_back("average_pooling", average_pooling(v, kQueries, lens));
    return out;
  });
}

TYPED_TEST(Determinism, ScaledDotProductAttention) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tensor<T> q = random_tensor<T>(rng, Shape{kBatch, kQueries, kHeadDim});
  const Tensor<T> k = random_tensor<T>(rng, Shape{kBatch, kKeys, kHeadDim});
  const Tensor<T> v = random_tensor<T>(rng, Shape{kBatch, kKeys, kValueDim});
  const Tensor<T> d_out = random_tensor<T>(rng, Shape{kBatch, kQueries, kValueDim});
  for (const Lens& lens : all_lens(rng, kBatch, kQueries, kKeys)) {
    for (bool training : {false, true}) {
      AttentionOptions options;
      options.training = training;
      options.dropout_p = training ? 0.2 : 0.0;
      options.seed = rng.next();
      options.return_weights = true;
      options.return_lse = true;
      SCOPED_TRACE(std::string(to_string(lens.form)) + (training ? ", dropout 0.2" : ", eval"));
      expect_thread_independent<T>([&] {
        Named<T> out;
        AttentionResult<T> r = scaled_dot_product_attention(q, k, v, lens.view(), options);
        DotProductGrads<T> grads = scaled_dot_product_attention_backward(
            q, k, v, lens.view(), options, {r.output, r.lse}, d_out);
        // The fused path that forms no weights.
        AttentionOptions fused = options;
        fused.return_weights = false;
        fused.return_lse = false;
        out.emplace_back("output (fused)",
                         scaled_dot_product_attention(q, k, v, lens.view(), fused).output);
        out.emplace_back("output", std::move(r.output));
        out.emplace_back("weights", std::move(r.weights));
        out.emplace_back("lse", std::move(r.lse));
        out.emplace_back("d_queries", std::move(grads.d_queries));
        out.emplace_back("d_keys", std::move(grads.d_keys));
        out.emplace_back("d_values", std::move(grads.d_values));
        return out;
      });
    }
  }
}

TEST(Determinism, AdditiveAttention) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t query_size = 24, key_size = 40, hiddens = 16;
  const Tensor<float> q = random_tensor<float>(rng, Shape{kBatch, kQueries, query_size});
  const Tensor<float> k = random_tensor<float>(rng, Shape{kBatch, kKeys, key_size});
  const Tensor<float> v = random_tensor<float>(rng, Shape{kBatch, kKeys, kValueDim});
  const Tensor<float> w_q = random_tensor<float>(rng, Shape{hiddens, query_size}, -0.3, 0.3);
  const Tensor<float> w_k = random_tensor<float>(rng, Shape{hiddens, key_size}, -0.3, 0.3);
  const Tensor<float> w_v = random_tensor<float>(rng, Shape{1, hiddens}, -0.5, 0.5);
  const Tensor<float> d_out = random_tensor<float>(rng, Shape{kBatch, kQueries, kValueDim});
  for (const Lens& lens : all_lens(rng, kBatch, kQueries, kKeys)) {
    AttentionOptions options;
    options.training = true;
    options.dropout_p = 0.1;
    options.seed = rng.next();
    options.return_weights = true;
    options.return_lse = true;
    SCOPED_TRACE(to_string(lens.form));
    expect_thread_independent<float>([&] {
      Named<float> out;
      AttentionResult<float> r = additive_attention(q, k, v, {w_q, w_k, w_v}, lens.view(), options);
      AdditiveGrads<float> grads = additive_attention_backward(
          q, k, v, {w_q, w_k, w_v}, lens.view(), options, {r.output, r.lse}, d_out);
      out.emplace_back("output", std::move(r.output));
      out.emplace_back("weights", std::move(r.weights));
      out.emplace_back("lse", std::move(r.lse));
      out.emplace_back("d_queries", std::move(grads.d_queries));
      out.emplace_back("d_keys", std::move(grads.d_keys));
      out.emplace_back("d_values", std::move(grads.d_values));
      out.emplace_back("d_w_q", std::move(grads.d_w_q));
      out.emplace_back("d_w_k", std::move(grads.d_w_k));
      out.emplace_back("d_w_v", std::move(grads.d_w_v));
      return out;
    });
  }
}

// ---- the attention forwards use dropout_keep's mask ---------------------------

template <class T>
Tensor<T> dropped_pooling(Tensor<T> weights, const Tensor<T>& values, uint64_t seed, double p) {
  apply_dropout(weights.view(), seed, p);
  return attention_pooling(weights, values);
}

// With training dropout p, output == attention_pooling(apply_dropout(weights)),
// the weights being the reference's (masked softmax, before dropout).
TYPED_TEST(Determinism, DotProductDropoutMaskIsDropoutKeep) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t batch = 2, num_queries = 37, num_keys = 71, head_dim = 16, value_dim = 8;
  const Tensor<T> q = random_tensor<T>(rng, Shape{batch, num_queries, head_dim});
  const Tensor<T> k = random_tensor<T>(rng, Shape{batch, num_keys, head_dim});
  const Tensor<T> v = random_tensor<T>(rng, Shape{batch, num_keys, value_dim});
  for (const Lens& lens : all_lens(rng, batch, num_queries, num_keys)) {
    for (double p : {0.1, 0.5}) {
      AttentionOptions options;
      options.training = true;
      options.dropout_p = p;
      options.seed = rng.next();
      options.return_weights = true;
      SCOPED_TRACE(std::string(to_string(lens.form)) + ", p = " + std::to_string(p) +
                   ", dropout seed " + std::to_string(options.seed));
      const AttentionResult<T> ref_r =
          ref::scaled_dot_product_attention(q, k, v, lens.view(), options);
      const Tensor<T> expected = dropped_pooling(ref_r.weights, v, options.seed, p);
      const AttentionResult<T> fast_r = scaled_dot_product_attention(q, k, v, lens.view(), options);
      const Tol tol = tol_for<T>(kSdpa, kSdpaDouble);
      expect_close(ref_r.output, expected, tol, "ref output vs pooling of dropped ref weights",
                   "b q d");
      expect_close(fast_r.output, expected, tol, "fast output vs pooling of dropped ref weights",
                   "b q d");
      expect_close(fast_r.weights, ref_r.weights, tol, "fast weights (before dropout) vs ref");
      // Dropout really happened: the eval output differs.
      AttentionOptions eval = options;
      eval.training = false;
      const Tensor<T> eval_out = scaled_dot_product_attention(q, k, v, lens.view(), eval).output;
      EXPECT_FALSE(all_close(eval_out, expected, tol, "eval vs training (must differ)"))
          << "training output equals the eval output: no dropout was applied";
    }
  }
}

TEST(Determinism, AdditiveDropoutMaskIsDropoutKeep) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t batch = 2, num_queries = 13, num_keys = 29, query_size = 6, key_size = 5,
                hiddens = 7, value_dim = 4;
  const Tensor<double> q = random_tensor<double>(rng, Shape{batch, num_queries, query_size});
  const Tensor<double> k = random_tensor<double>(rng, Shape{batch, num_keys, key_size});
  const Tensor<double> v = random_tensor<double>(rng, Shape{batch, num_keys, value_dim});
  const Tensor<double> w_q = random_tensor<double>(rng, Shape{hiddens, query_size});
  const Tensor<double> w_k = random_tensor<double>(rng, Shape{hiddens, key_size});
  const Tensor<double> w_v = random_tensor<double>(rng, Shape{hiddens});
  for (const Lens& lens : all_lens(rng, batch, num_queries, num_keys)) {
    AttentionOptions options;
    options.training = true;
    options.dropout_p = 0.4;
    options.seed = rng.next();
    options.return_weights = true;
    SCOPED_TRACE(std::string(to_string(lens.form)) + ", dropout seed " +
                 std::to_string(options.seed));
    const AttentionResult<double> ref_r =
        ref::additive_attention(q, k, v, {w_q, w_k, w_v}, lens.view(), options);
    const Tensor<double> expected = dropped_pooling(ref_r.weights, v, options.seed, 0.4);
    const AttentionResult<double> fast_r =
        additive_attention(q, k, v, {w_q, w_k, w_v}, lens.view(), options);
    expect_close(ref_r.output, expected, kAdditiveDouble, "ref output", "b q d");
    expect_close(fast_r.output, expected, kAdditiveDouble, "fast output", "b q d");
  }
}

}  // namespace
}  // namespace qkv::test
