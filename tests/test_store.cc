// Tests of attention over the on-disk key-value store (qkv/store_attention.h)
// and over any chunk source: against a float64 plain loop over all rows,
// with every valid-rows form, top-k against sorting, chunks no query sees
// left unread, 1, 2 and 3 threads bitwise, merge_parts; every error. The
// kernels underneath run once per SIMD target. The store's files (round
// trips, appends, damage, the manifest) are test_store_files.cc's.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "attention_testing.h"
#include "qkv/store.h"
#include "qkv/store_attention.h"
#include "qkv/threads.h"
#include "store_testing.h"
#include "test_util.h"
#include "tolerances.h"

namespace qkv::test {
namespace {

namespace fs = std::filesystem;
constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- attention over a store -----------------------------------------------------

TEST_F(StoreTest, AttentionEqualsAttentionOverEveryRow) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  int made = 0;
  for (StoreDtype dtype : {StoreDtype::kFloat32, StoreDtype::kBFloat16}) {
    for (int round = 0; round < 6; ++round) {
      const int64_t n = rng.uniform_int(1, 700), d = rng.uniform_int(1, 40);
      const int64_t dv = rng.uniform_int(1, 24), nq = rng.uniform_int(1, 20);
      const int64_t chunk_rows = rng.uniform_int(1, 300);
      const Tensor<float> keys = random_tensor<float>(rng, Shape{n, d}, -2, 2);
      const Tensor<float> values = random_tensor<float>(rng, Shape{n, dv});
      const Tensor<float> queries = random_tensor<float>(rng, Shape{nq, d}, -2, 2);
      const KeyValueStore store = KeyValueStore::create(path("s" + std::to_string(made++)), keys,
                                                        values, dtype, chunk_rows);
      const bool bf16 = dtype == StoreDtype::kBFloat16;
      const Tensor<float> ref_q = bf16 ? rounded_to_bf16(queries) : queries;
      const Tensor<float> ref_k = bf16 ? rounded_to_bf16(keys) : keys;
      const Tensor<float> ref_v = bf16 ? rounded_to_bf16(values) : values;
      // Every valid-rows form: none, one count, one per query (0, chunk
      // edges, everything among them).
      Tensor<int64_t> one(Shape{}, rng.uniform_int(0, n));
      Tensor<int64_t> per_query(Shape{nq});
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t edge = std::min(n, chunk_rows * rng.uniform_int(0, n / chunk_rows + 1));
        const int64_t choices[] = {0, n, rng.uniform_int(0, n), edge, std::min(n, edge + 1)};
        per_query(i) = choices[rng.uniform_int(0, 4)];
      }
      const Tensor<int32_t> per_query32 = cast<int32_t>(per_query);
      const double scale = rng.bernoulli(0.5) ? 1.0 / std::sqrt(double(d)) : rng.uniform(0.1, 2);
      const int64_t top_k = rng.uniform_int(0, std::min<int64_t>(n, 12));
      for (int form = 0; form < 4; ++form) {
        SCOPED_TRACE("n=" + std::to_string(n) + " d=" + std::to_string(d) +
                     " dv=" + std::to_string(dv) + " nq=" + std::to_string(nq) +
                     " chunk_rows=" + std::to_string(chunk_rows) + " form=" + std::to_string(form) +
                     (bf16 ? " bf16" : " f32"));
        std::vector<int64_t> lens(static_cast<size_t>(nq), n);
        ValidLens valid;
        if (form == 1) {
          valid = ValidLens(one);
          std::fill(lens.begin(), lens.end(), one());
        } else if (form >= 2) {
          valid = form == 2 ? ValidLens(per_query) : ValidLens(per_query32);
          for (int64_t i = 0; i < nq; ++i) lens[static_cast<size_t>(i)] = per_query(i);
        }
        StoreAttentionOptions options;
        if (scale != 1.0 / std::sqrt(double(d))) options.scale = scale;
        options.top_k = top_k;
        const StoreAttentionResult got = attend(queries, store, valid, options);
        const PlainAttention ref = plain_attention(ref_q, ref_k, ref_v, lens, scale);
        // bf16: the reference takes the inputs as stored; the kernel rounds P
        // to bf16 for P V where the CPU has AVX-512 BF16 (2^-8 relative, so
        // 2^-8 max|v| on a convex combination; test_sdpa_flash's bound).
        const Tol output_tol = bf16 ? Tol{.atol = (0x1p-8 + 1e-5) * 1.0, .rtol = 0} : kSdpa;
        const double weight_rtol = bf16 ? 0x1p-7 : 1e-4;
        expect_close(got.output, ref.output, output_tol, "output", "(i, c)");
        expect_close(got.lse, ref.lse, kSdpaLse, "lse", "(i)");
        if (top_k == 0) {
          EXPECT_TRUE(got.top_ids.empty());
          continue;
        }
        ASSERT_EQ(got.top_ids.shape(), Shape({nq, top_k}));
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t len = lens[static_cast<size_t>(i)];
          for (int64_t r = 0; r < top_k; ++r) {
            const int64_t id = got.top_ids(i, r);
            if (r >= len) {
              EXPECT_EQ(id, -1) << "i=" << i << " r=" << r;
              EXPECT_EQ(got.top_weights(i, r), 0.0f);
              continue;
            }
            ASSERT_GE(id, 0);
            ASSERT_LT(id, len);
            // Its weight is the reference's for that row, and no row left
            // out weighs clearly more than the last row taken.
            EXPECT_NEAR(got.top_weights(i, r), ref.weights(i, id),
                        1e-6 + weight_rtol * ref.weights(i, id))
                << "i=" << i << " r=" << r << " id=" << id;
          }
          std::vector<double> sorted(ref.weights.data() + i * n, ref.weights.data() + i * n + len);
          std::sort(sorted.rbegin(), sorted.rend());
          for (int64_t r = 0; r < std::min(top_k, len); ++r) {
            EXPECT_NEAR(got.top_weights(i, r), sorted[static_cast<size_t>(r)],
                        1e-6 + weight_rtol * sorted[static_cast<size_t>(r)])
                << "i=" << i << " rank " << r;
          }
          for (int64_t r = 1; r < std::min(top_k, len); ++r) {
            EXPECT_GE(got.top_weights(i, r - 1), got.top_weights(i, r));
          }
        }
      }
    }
  }
}

// One query over chunks of one row asks for (1, 1, 1) weights per chunk: the
// same element count as the empty tensor's (rank 0, numel 1), which the
// weights buffer once mistook for an allocated one (an Error in MPI's test).
TEST_F(StoreTest, TopKOfOneQueryOverOneRowChunks) {
  const Tensor<float> keys(Shape{3, 2}, {0.5f, -1.0f, 2.0f, 0.25f, -0.75f, 1.5f});
  const Tensor<float> values(Shape{3, 1}, {1.0f, 2.0f, 3.0f});
  const Tensor<float> queries(Shape{1, 2}, {1.0f, 0.5f});
  const KeyValueStore store =
      KeyValueStore::create(path("one-row-chunks"), keys, values, StoreDtype::kFloat32, 1);
  ASSERT_EQ(store.chunks().size(), 3u);
  for (Scoring scoring : {Scoring::kDotProduct, Scoring::kDistance}) {
    SCOPED_TRACE(rules_of(scoring).name);
    StoreAttentionOptions options;
    options.scoring = scoring;
    options.top_k = 2;
    const StoreAttentionResult got = attend(queries, store, {}, options);
    // A float64 loop: scores, softmax, the two heaviest rows.
    std::vector<double> score(3);
    for (int64_t j = 0; j < 3; ++j) {
      double dot = 0, dist = 0;
      for (int64_t c = 0; c < 2; ++c) {
        dot += double(queries(0, c)) * keys(j, c);
        dist += (double(queries(0, c)) - keys(j, c)) * (double(queries(0, c)) - keys(j, c));
      }
      score[j] = scoring == Scoring::kDotProduct ? dot / std::sqrt(2.0) : -dist / 2;
    }
    const double max = *std::max_element(score.begin(), score.end());
    double sum = 0, out = 0;
    for (int64_t j = 0; j < 3; ++j) sum += std::exp(score[j] - max);
    std::vector<double> weight(3);
    for (int64_t j = 0; j < 3; ++j) {
      weight[j] = std::exp(score[j] - max) / sum;
      out += weight[j] * values(j, 0);
    }
    EXPECT_NEAR(got.output(0, 0), out, 1e-6);
    EXPECT_NEAR(got.lse(0), max + std::log(sum), 1e-6);
    std::vector<int64_t> order{0, 1, 2};
    // Ties (rows 0 and 2 score 0 by dot product) go to the smaller row id.
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return weight[a] > weight[b]; });
    ASSERT_EQ(got.top_ids.shape(), Shape({1, 2}));
    for (int64_t r = 0; r < 2; ++r) {
      EXPECT_EQ(got.top_ids(0, r), order[r]) << "rank " << r;
      EXPECT_NEAR(got.top_weights(0, r), weight[order[r]], 1e-6) << "rank " << r;
    }
  }
}

TEST_F(StoreTest, BackwardEqualsTheBackwardOverEveryRow) {
  // Each chunk's backward handed the output and lse over all rows: dQ, and dK
  // and dV of every row, against the float64 reference backward over the
  // store's rows at once (one batch element, per-query lengths).
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  int made = 0;
  for (StoreDtype dtype : {StoreDtype::kFloat32, StoreDtype::kBFloat16}) {
    for (int round = 0; round < 4; ++round) {
      const int64_t n = rng.uniform_int(1, 500), d = rng.uniform_int(1, 24);
      const int64_t dv = rng.uniform_int(1, 16), nq = rng.uniform_int(1, 12);
      const int64_t chunk_rows = rng.uniform_int(1, 200);
      const Tensor<float> keys = random_tensor<float>(rng, Shape{n, d});
      const Tensor<float> values = random_tensor<float>(rng, Shape{n, dv});
      const Tensor<float> queries = random_tensor<float>(rng, Shape{nq, d});
      const Tensor<float> d_output = random_tensor<float>(rng, Shape{nq, dv});
      const KeyValueStore store = KeyValueStore::create(path("b" + std::to_string(made++)), keys,
                                                        values, dtype, chunk_rows);
      Tensor<int64_t> lens(Shape{nq});
      for (int64_t i = 0; i < nq; ++i) {
        lens(i) = rng.bernoulli(0.3) ? n : rng.uniform_int(0, n);
      }
      SCOPED_TRACE("n=" + std::to_string(n) + " chunk_rows=" + std::to_string(chunk_rows) +
                   (dtype == StoreDtype::kBFloat16 ? " bf16" : " f32"));
      const StoreAttentionResult forward = attend(queries, store, ValidLens(lens));
      const StoreAttentionGrads got =
          attend_backward(queries, store, ValidLens(lens), {},
                          {forward.output.view(), forward.lse.view()}, d_output);
      // The reference: float64, over the rows as stored (bf16 rounded), the
      // queries rounded as the store rounds them.
      const bool bf16 = dtype == StoreDtype::kBFloat16;
      const ReadBack back = read_back(store);
      const Tensor<double> q =
          cast<double>(bf16 ? rounded_to_bf16(queries) : queries).reshaped(Shape{1, nq, d});
      const Tensor<double> k = cast<double>(back.keys).reshaped(Shape{1, n, d});
      const Tensor<double> v = cast<double>(back.values).reshaped(Shape{1, n, dv});
      const Tensor<int64_t> lens2 = Tensor<int64_t>::copy_of(lens.view()).reshaped(Shape{1, nq});
      AttentionOptions with_lse;
      with_lse.return_lse = true;
      const AttentionResult<double> ref =
          ref::scaled_dot_product_attention(q, k, v, ValidLens(lens2), with_lse);
      const DotProductGrads<double> want = ref::scaled_dot_product_attention_backward(
          q, k, v, ValidLens(lens2), with_lse, {ref.output.view(), ref.lse.view()},
          cast<double>(d_output).reshaped(Shape{1, nq, dv}));
      // bf16: the kernels round dO, P and dS to bf16 for their products (2^-8
      // each), so a gradient errs by a fraction of the terms it sums, which
      // here (inputs in [-1, 1], D <= 24, Dv <= 16, Nq <= 12) are at most
      // about 1: test_sdpa_flash's 2e-2 of the larger of that and the gradient.
      const auto tol = [&](const Tensor<double>& grad) {
        double most = 1.0;
        for (double x : grad.values()) most = std::max(most, std::abs(x));
        return bf16 ? Tol{.atol = 2e-2 * most, .rtol = 0} : kSdpaBackward;
      };
      expect_close(got.d_queries, want.d_queries.reshaped(Shape{nq, d}), tol(want.d_queries),
                   "d_queries");
      expect_close(got.d_keys, want.d_keys.reshaped(Shape{n, d}), tol(want.d_keys), "d_keys");
      expect_close(got.d_values, want.d_values.reshaped(Shape{n, dv}), tol(want.d_values),
                   "d_values");
    }
  }
  const KeyValueStore store = KeyValueStore::create(path("e"), Tensor<float>(Shape{3, 2}, 1.0f),
                                                    Tensor<float>(Shape{3, 2}, 1.0f));
  const Tensor<float> q(Shape{2, 2}), o(Shape{2, 2}), lse(Shape{2});
  expect_error(
      [&] {
        attend_backward(q, store, {}, {}, {o.view(), Tensor<float>(Shape{3}).view()}, o);
      },
      {"attend_backward", "saved.lse", "[3]", "[2]"});
  expect_error(
      [&] {
        attend_backward(q, store, {}, {}, {o.view(), lse.view()}, Tensor<float>(Shape{2, 3}));
      },
      {"attend_backward", "d_output", "[2, 3]"});
}

TEST_F(StoreTest, DistanceScoringIsNadarayaWatsonOverEveryRow) {
  // -|q - k|^2 / (2 h^2), distance scoring at scale 1/h^2, against a float64 loop, with keys near
  // the origin and 1000 away from it (centred per chunk, so no accuracy is lost there; the
  // uncentred float form would err by ~1e-7 |k|^2 / h^2 ~ 0.4 per score).
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  int made = 0;
  for (StoreDtype dtype : {StoreDtype::kFloat32, StoreDtype::kBFloat16}) {
    for (double offset : {0.0, 1000.0}) {
      const int64_t n = rng.uniform_int(1, 600), d = rng.uniform_int(1, 16);
      const int64_t dv = rng.uniform_int(1, 8), nq = rng.uniform_int(1, 10);
      const double h = rng.uniform(0.3, 2.0);
      const Tensor<float> keys = random_tensor<float>(rng, Shape{n, d}, offset - 1, offset + 1);
      const Tensor<float> values = random_tensor<float>(rng, Shape{n, dv});
      const Tensor<float> queries =
          random_tensor<float>(rng, Shape{nq, d}, offset - 1.2, offset + 1.2);
      const KeyValueStore store = KeyValueStore::create(path("g" + std::to_string(made++)), keys,
                                                        values, dtype, rng.uniform_int(1, 250));
      SCOPED_TRACE("n=" + std::to_string(n) + " d=" + std::to_string(d) +
                   " h=" + std::to_string(h) + " offset=" + std::to_string(offset) +
                   (dtype == StoreDtype::kBFloat16 ? " bf16" : ""));
      Tensor<int64_t> lens(Shape{nq});
      for (int64_t i = 0; i < nq; ++i) lens(i) = rng.bernoulli(0.5) ? n : rng.uniform_int(0, n);
      StoreAttentionOptions options;
      options.scoring = Scoring::kDistance;
      options.scale = 1 / (h * h);
      options.top_k = std::min<int64_t>(n, 3);
      const StoreAttentionResult got = attend(queries, store, ValidLens(lens), options);
      // The reference on the rows as stored (bf16 rounded), queries as given.
      const ReadBack back = read_back(store);
      Tensor<double> out(Shape{nq, dv}), lse(Shape{nq});
      double largest_score = 0;
      for (int64_t i = 0; i < nq; ++i) {
        std::vector<double> score(static_cast<size_t>(lens(i)));
        double max = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < lens(i); ++j) {
          double dist = 0;
          for (int64_t c = 0; c < d; ++c) {
            const double x = double(queries(i, c)) - double(back.keys(j, c));
            dist += x * x;
          }
          score[static_cast<size_t>(j)] = -dist / (2 * h * h);
          max = std::max(max, score[static_cast<size_t>(j)]);
          largest_score = std::max(largest_score, std::abs(score[static_cast<size_t>(j)]));
        }
        double sum = 0;
        for (double x : score) sum += std::exp(x - max);
        lse(i) = lens(i) == 0 ? -std::numeric_limits<double>::infinity() : max + std::log(sum);
        for (int64_t j = 0; j < lens(i); ++j) {
          const double w = std::exp(score[static_cast<size_t>(j)] - max) / sum;
          for (int64_t c = 0; c < dv; ++c) out(i, c) += w * double(back.values(j, c));
        }
        // The top row is the nearest key (or one as near).
        if (lens(i) > 0) {
          const int64_t best = got.top_ids(i, 0);
          ASSERT_GE(best, 0);
          EXPECT_NEAR(score[static_cast<size_t>(best)], max, 1e-5 * (1 + std::abs(max)));
        }
      }
      // Scores are differences of float-rounded centred coordinates: their
      // error grows with their size (up to ~d (2.2)^2 / (2 h^2)).
      expect_close(got.output, out, Tol{.atol = 1e-5 * (1 + largest_score), .rtol = 1e-4},
                   "output");
      expect_close(got.lse, lse, Tol{.atol = 2e-6 * (1 + largest_score), .rtol = 2e-6}, "lse");
    }
  }
  const KeyValueStore store = KeyValueStore::create(path("ge"), Tensor<float>(Shape{3, 2}, 1.0f),
                                                    Tensor<float>(Shape{3, 2}, 1.0f));
  const Tensor<float> q(Shape{2, 2});
  StoreAttentionOptions options;
  options.scoring = Scoring::kDistance;
  for (const double scale : {0.0, -1.0, std::numeric_limits<double>::infinity()}) {
    options.scale = scale;
    expect_error([&] { attend(q, store, {}, options); },
                 {"attend", "scale = ", "expected a finite number > 0 for distance scoring"});
  }
  options.scale.reset();
  for (const Scoring scoring : {Scoring::kAdditive, Scoring::kBilinear}) {
    StoreAttentionOptions other;
    other.scoring = scoring;
    expect_error([&] { attend(q, store, {}, other); },
                 {"attend", "options.scoring is " + std::string(rules_of(scoring).name),
                  "attention over a store scores by dot or distance"});
  }
  const StoreAttentionResult forward = attend(q, store, {}, options);
  expect_error(
      [&] {
        attend_backward(q, store, {}, options, {forward.output.view(), forward.lse.view()},
                        Tensor<float>(Shape{2, 2}));
      },
      {"attend_backward", "distance scoring has none"});
}

TEST_F(StoreTest, AttentionIsTheSameBitsForAnyThreadCount) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tensor<float> keys = random_tensor<float>(rng, Shape{3000, 32});
  const Tensor<float> values = random_tensor<float>(rng, Shape{3000, 16});
  const KeyValueStore store =
      KeyValueStore::create(path("s"), keys, values, StoreDtype::kFloat32, 700);
  for (int64_t nq : {1, 5, 300}) {
    const Tensor<float> queries = random_tensor<float>(rng, Shape{nq, 32}, -3, 3);
    StoreAttentionOptions options;
    options.top_k = 7;
    set_num_threads(1);
    const StoreAttentionResult one = attend(queries, store, {}, options);
    set_num_threads(2);
    const StoreAttentionResult two = attend(queries, store, {}, options);
    set_num_threads(0);
    expect_bitwise_equal(one.output, two.output, "output");
    expect_bitwise_equal(one.lse, two.lse, "lse");
    expect_bitwise_equal(one.top_ids, two.top_ids, "top_ids");
    expect_bitwise_equal(one.top_weights, two.top_weights, "top_weights");
  }
}

TEST_F(StoreTest, ChunksNoQuerySeesAreNotRead) {
  const Tensor<float> keys(Shape{30, 4}, 0.5f), values(Shape{30, 2}, 1.0f);
  const KeyValueStore store =
      KeyValueStore::create(path("s"), keys, values, StoreDtype::kFloat32, 10);
  fs::resize_file(path("s/") + store.chunks()[2].keys_file, 100);  // damaged after open
  const Tensor<float> queries(Shape{3, 4}, 1.0f);
  const Tensor<int64_t> within({3}, {0, 20, 13});
  const StoreAttentionResult got = attend(queries, store, ValidLens(within));
  EXPECT_EQ(got.lse(0), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(got.output(0, 0), 0.0f);
  EXPECT_NEAR(got.lse(1), std::log(20.0) + 1.0, 1e-5);  // 20 equal scores of 4 * 0.5 / 2
  EXPECT_NEAR(got.output(2, 1), 1.0f, 1e-6);
  expect_error([&] { attend(queries, store); },
               {"read_chunk", store.chunks()[2].keys_file, "truncated"});
}

TEST_F(StoreTest, AttentionOverAnEmptyStore) {
  const KeyValueStore store =
      KeyValueStore::create(path("s"), Tensor<float>(Shape{0, 3}), Tensor<float>(Shape{0, 2}));
  const StoreAttentionResult got = attend(Tensor<float>(Shape{2, 3}, 1.0f), store);
  expect_bitwise_equal(got.output, Tensor<float>(Shape{2, 2}), "output");
  EXPECT_EQ(got.lse(1), -std::numeric_limits<float>::infinity());
}

TEST_F(StoreTest, AttentionErrors) {
  const KeyValueStore store = KeyValueStore::create(path("s"), Tensor<float>(Shape{5, 3}, 1.0f),
                                                    Tensor<float>(Shape{5, 2}, 1.0f));
  const Tensor<float> queries(Shape{2, 3}, 1.0f);
  expect_error(
      [&] {
        attend(Tensor<float>(Shape{2, 4}), store);
      },
      {"attend", "queries has shape [2, 4]", "D = 3"});
  expect_error([&] { attend(Tensor<float>(Shape{1, 2, 3}), store); }, {"attend", "(Nq, D)"});
  StoreAttentionOptions options;
  options.top_k = 6;
  expect_error([&] { attend(queries, store, {}, options); }, {"top_k = 6", "5 rows"});
  options.top_k = -1;
  expect_error([&] { attend(queries, store, {}, options); }, {"top_k = -1"});
  options = {};
  options.scale = std::numeric_limits<double>::infinity();
  expect_error([&] { attend(queries, store, {}, options); }, {"scale"});
  const Tensor<int64_t> too_many({2}, {1, 6});
  expect_error([&] { attend(queries, store, ValidLens(too_many)); }, {"attend", "6"});
  const Tensor<int64_t> wrong_shape({3}, {1, 2, 3});
  expect_error([&] { attend(queries, store, ValidLens(wrong_shape)); }, {"valid_rows", "[3]"});
}

// A storage backend in one class: rows held in memory, in chunks of the
// sizes given, float32 or bfloat16 (the rows rounded as a store would).
class MemorySource final : public ChunkSource {
 public:
  MemorySource(const Tensor<float>& keys, const Tensor<float>& values, StoreDtype dtype,
               std::vector<int64_t> chunk_rows)
      : keys_(keys), values_(values), dtype_(dtype), chunk_rows_(std::move(chunk_rows)) {
    if (dtype == StoreDtype::kBFloat16) {
      keys16_ = cast<bfloat16>(keys);
      values16_ = cast<bfloat16>(values);
    }
    int64_t row = 0;
    for (int64_t rows : chunk_rows_) {
      first_rows_.push_back(row);
      row += rows;
    }
  }
  std::string name() const override { return "memory"; }
  StoreDtype dtype() const override { return dtype_; }
  int64_t rows() const override { return keys_.size(0); }
  int64_t key_dim() const override { return keys_.size(1); }
  int64_t value_dim() const override { return values_.size(1); }
  size_t num_chunks() const override { return chunk_rows_.size(); }
  ChunkRange chunk_range(size_t c) const override { return {first_rows_.at(c), chunk_rows_.at(c)}; }
  SourceChunk read_chunk(size_t c) const override {
    ++reads;
    const ChunkRange r = chunk_range(c);
    const int64_t d = key_dim(), dv = value_dim();
    if (dtype_ == StoreDtype::kFloat32) {
      return SourceChunk(r, ConstView<float>(keys_.data() + r.first_row * d, Shape{r.rows, d}),
                         ConstView<float>(values_.data() + r.first_row * dv, Shape{r.rows, dv}),
                         nullptr);
    }
    return SourceChunk(r, ConstView<bfloat16>(keys16_.data() + r.first_row * d, Shape{r.rows, d}),
                       ConstView<bfloat16>(values16_.data() + r.first_row * dv, Shape{r.rows, dv}),
                       nullptr);
  }
  mutable int reads = 0;

 private:
  Tensor<float> keys_, values_;
  Tensor<bfloat16> keys16_, values16_;
  StoreDtype dtype_;
  std::vector<int64_t> chunk_rows_, first_rows_;
};

TEST_F(StoreTest, AnyChunkSourceIsAttendedAsAStoreIs) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  int made = 0;
  for (StoreDtype dtype : {StoreDtype::kFloat32, StoreDtype::kBFloat16}) {
    const bool bf16 = dtype == StoreDtype::kBFloat16;
    const int64_t chunk_rows = rng.uniform_int(5, 60), chunks = rng.uniform_int(1, 6);
    const int64_t n = chunk_rows * chunks, d = rng.uniform_int(1, 24), dv = rng.uniform_int(1, 9);
    const int64_t nq = rng.uniform_int(1, 7);
    const Tensor<float> keys = random_tensor<float>(rng, Shape{n, d}, -2, 2);
    const Tensor<float> values = random_tensor<float>(rng, Shape{n, dv});
    const Tensor<float> queries = random_tensor<float>(rng, Shape{nq, d}, -2, 2);
    const KeyValueStore store =
        KeyValueStore::create(path("s" + std::to_string(made++)), keys, values, dtype, chunk_rows);
    StoreAttentionOptions options;
    options.top_k = std::min<int64_t>(n, 4);
    // The same chunks in memory: the same bits as the store.
    const MemorySource same(keys, values, dtype, std::vector<int64_t>(chunks, chunk_rows));
    const StoreAttentionResult want = attend(queries, store, {}, options);
    const StoreAttentionResult got = attend(queries, same, {}, options);
    expect_bitwise_equal(got.output, want.output, "output");
    expect_bitwise_equal(got.lse, want.lse, "lse");
    expect_bitwise_equal(got.top_ids, want.top_ids, "top_ids");
    expect_bitwise_equal(got.top_weights, want.top_weights, "top_weights");
    const ReadBack back = read_back(same);
    expect_bitwise_equal(back.keys, bf16 ? rounded_to_bf16(keys) : keys, "keys read back");
    // Chunks of uneven sizes, one of a single row: attention over every row.
    std::vector<int64_t> uneven = {1};
    for (int64_t left = n - 1; left > 0;) {
      uneven.push_back(std::min(left, rng.uniform_int(1, 2 * chunk_rows)));
      left -= uneven.back();
    }
    const MemorySource source(keys, values, dtype, uneven);
    const StoreAttentionResult other = attend(queries, source, {}, options);
    const Tensor<float> ref_q = bf16 ? rounded_to_bf16(queries) : queries;
    const PlainAttention ref = plain_attention(
        ref_q, bf16 ? rounded_to_bf16(keys) : keys, bf16 ? rounded_to_bf16(values) : values,
        std::vector<int64_t>(nq, n), 1.0 / std::sqrt(double(d)));
    expect_close(other.output, ref.output, bf16 ? Tol{.atol = 0x1p-8 + 1e-5, .rtol = 0} : kSdpa,
                 "output of uneven chunks");
    expect_close(other.lse, ref.lse, kSdpaLse, "lse of uneven chunks");
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t r = 0; r < options.top_k; ++r) {
        EXPECT_NEAR(other.top_weights(i, r), ref.weights(i, other.top_ids(i, r)), 1e-6)
            << "i=" << i << " r=" << r;
      }
    }
    // Its backward too.
    const Tensor<float> d_out = random_tensor<float>(rng, Shape{nq, dv});
    const SavedForward<float> saved{want.output.view(), want.lse.view()};
    const StoreAttentionGrads g_store = attend_backward(queries, store, {}, {}, saved, d_out);
    const StoreAttentionGrads g_same = attend_backward(queries, same, {}, {}, saved, d_out);
    expect_bitwise_equal(g_same.d_queries, g_store.d_queries, "d_queries");
    expect_bitwise_equal(g_same.d_keys, g_store.d_keys, "d_keys");
    expect_bitwise_equal(g_same.d_values, g_store.d_values, "d_values");
  }
}

TEST_F(StoreTest, ChunksNoQuerySeesAreNotReadFromAnySource) {
  const Tensor<float> keys(Shape{30, 4}, 0.5f), values(Shape{30, 2}, 1.0f);
  const MemorySource source(keys, values, StoreDtype::kFloat32, {10, 10, 10});
  const Tensor<int64_t> within({2}, {0, 13});
  attend(Tensor<float>(Shape{2, 4}, 1.0f), source, ValidLens(within));
  EXPECT_EQ(source.reads, 2);
}

// One query's top rows come from a pass split over the threads by rows
// (4096 rows a piece at least): the same rows and bits for any thread count,
// and the rows of largest weight by a float64 loop.
TEST_F(StoreTest, TopKOfFewQueriesSplitsOverRows) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t n = 20000, d = 16, dv = 3, k = 9;
  const Tensor<float> keys = random_tensor<float>(rng, Shape{n, d}, -2, 2);
  const Tensor<float> values = random_tensor<float>(rng, Shape{n, dv});
  for (StoreDtype dtype : {StoreDtype::kFloat32, StoreDtype::kBFloat16}) {
    const bool bf16 = dtype == StoreDtype::kBFloat16;
    const MemorySource source(keys, values, dtype, {n});
    for (int64_t nq : {1, 2}) {
      for (Scoring scoring : {Scoring::kDotProduct, Scoring::kDistance}) {
        SCOPED_TRACE("nq=" + std::to_string(nq) + (bf16 ? " bf16 " : " f32 ") +
                     std::string(rules_of(scoring).name));
        const Tensor<float> queries = random_tensor<float>(rng, Shape{nq, d}, -2, 2);
        StoreAttentionOptions options;
        options.top_k = k;
        options.scoring = scoring;
        std::vector<StoreAttentionResult> by_threads;
        for (int threads : {1, 2, 3}) {
          set_num_threads(threads);
          by_threads.push_back(attend(queries, source, {}, options));
        }
        set_num_threads(0);
        for (size_t t = 1; t < by_threads.size(); ++t) {
          expect_bitwise_equal(by_threads[t].top_ids, by_threads[0].top_ids, "top_ids");
          expect_bitwise_equal(by_threads[t].top_weights, by_threads[0].top_weights, "top_weights");
        }
        // The float64 scores of the rows as the store holds them (queries
        // rounded to bf16 for dot scoring over a bf16 source).
        const Tensor<float> q =
            bf16 && scoring == Scoring::kDotProduct ? rounded_to_bf16(queries) : queries;
        const Tensor<float> kk = bf16 ? rounded_to_bf16(keys) : keys;
        const StoreAttentionResult& got = by_threads[0];
        for (int64_t i = 0; i < nq; ++i) {
          std::vector<std::pair<double, int64_t>> scores;
          double top = -INFINITY;
          for (int64_t j = 0; j < n; ++j) {
            double s = 0;
            for (int64_t c = 0; c < d; ++c) {
              const double a = q(i, c), b = kk(j, c);
              s += scoring == Scoring::kDotProduct ? a * b : -0.5 * (a - b) * (a - b);
            }
            scores.push_back({scoring == Scoring::kDotProduct ? s / std::sqrt(double(d)) : s, j});
            top = std::max(top, scores.back().first);
          }
          double sum = 0;
          for (const auto& [s, j] : scores) sum += std::exp(s - top);
          const double lse = top + std::log(sum);
          std::sort(scores.begin(), scores.end(), [](const auto& a, const auto& b) {
            return a.first > b.first || (a.first == b.first && a.second < b.second);
          });
          EXPECT_NEAR(got.lse(i), lse, 1e-4 * std::max(1.0, std::abs(lse)));
          for (int64_t r = 0; r < k; ++r) {
            const double want = std::exp(scores[static_cast<size_t>(r)].first - lse);
            EXPECT_NEAR(got.top_weights(i, r), want, 1e-6 + 1e-4 * want) << "i=" << i << " r=" << r;
            if (got.top_ids(i, r) != scores[static_cast<size_t>(r)].second) {  // only a near tie
              EXPECT_NEAR(got.top_weights(i, r), want, 1e-7) << "i=" << i << " r=" << r;
            }
          }
        }
      }
    }
  }
}

TEST_F(StoreTest, MergePartsIsAttentionOverTheUnion) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t d = 6, dv = 4, nq = 5, k = 6;
  const int64_t sizes[] = {rng.uniform_int(1, 40), rng.uniform_int(0, 3), rng.uniform_int(1, 40)};
  const int64_t n = sizes[0] + sizes[1] + sizes[2];
  const Tensor<float> keys = random_tensor<float>(rng, Shape{n, d}, -2, 2);
  const Tensor<float> values = random_tensor<float>(rng, Shape{n, dv});
  const Tensor<float> queries = random_tensor<float>(rng, Shape{nq, d}, -2, 2);
  std::vector<StoreAttentionResult> parts;
  int64_t first = 0;
  for (const int64_t rows : sizes) {
    Tensor<float> part_keys(Shape{rows, d}), part_values(Shape{rows, dv});
    std::copy_n(keys.data() + first * d, rows * d, part_keys.data());
    std::copy_n(values.data() + first * dv, rows * dv, part_values.data());
    StoreAttentionOptions options;
    options.top_k = std::min(k, rows);
    parts.push_back(
        attend(queries,
               MemorySource(part_keys, part_values, StoreDtype::kFloat32,
                            rows > 0 ? std::vector<int64_t>{rows} : std::vector<int64_t>{}),
               {}, options));
    first += rows;
  }
  const std::vector<int64_t> part_rows(std::begin(sizes), std::end(sizes));
  const int64_t top_k = std::min(k, n);
  const StoreAttentionResult merged = merge_parts(parts, part_rows, top_k);
  const PlainAttention ref = plain_attention(queries, keys, values, std::vector<int64_t>(nq, n),
                                             1.0 / std::sqrt(double(d)));
  expect_close(merged.output, ref.output, kSdpa, "output");
  expect_close(merged.lse, ref.lse, kSdpaLse, "lse");
  for (int64_t i = 0; i < nq; ++i) {
    std::vector<double> sorted(ref.weights.data() + i * n, ref.weights.data() + (i + 1) * n);
    std::sort(sorted.rbegin(), sorted.rend());
    for (int64_t r = 0; r < top_k; ++r) {
      EXPECT_NEAR(merged.top_weights(i, r), ref.weights(i, merged.top_ids(i, r)), 1e-6);
      EXPECT_NEAR(merged.top_weights(i, r), sorted[static_cast<size_t>(r)], 1e-6);
    }
  }
  // The same parts, the same bits.
  expect_bitwise_equal(merge_parts(parts, part_rows, top_k).top_weights, merged.top_weights,
                       "again");
  // (The parts' type named: {} alone also fits merge_parts of index results.)
  expect_error([&] { merge_parts(std::vector<StoreAttentionResult>{}, {}, 0); },
               {"merge_parts", "parts is empty"});
  expect_error(
      [&] {
        merge_parts(parts, {1, 2}, 0);
      },
      {"merge_parts", "part_rows has 2 entries but parts has 3"});
  std::vector<StoreAttentionResult> bad = parts;
  bad[0].top_ids = Tensor<int64_t>();  // a part asked for no top rows
  expect_error([&] { merge_parts(bad, part_rows, top_k); },
               {"merge_parts", "parts[0]", "top_k = " + std::to_string(top_k)});
  bad = parts;
  bad[2].lse = Tensor<float>(Shape{nq + 1});
  expect_error([&] { merge_parts(bad, part_rows, 0); }, {"merge_parts", "parts[2].lse"});
}

// Ties go to the smaller row id however the rows are chunked: the top rows
// are ranked by their scores, which do not depend on the chunking (they
// were ranked by weights rounded through each chunk's lse, and ten equal
// keys gave ids 7 8 9 in chunks of 7 and 3, 0 1 2 in chunks of 10).
TEST_F(StoreTest, TopKTiesDoNotDependOnChunking) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tensor<float> keys(Shape{10, 4}, 0.5f);
  const Tensor<float> values = random_tensor<float>(rng, Shape{10, 2});
  Tensor<float> queries = random_tensor<float>(rng, Shape{2, 4}, -2, 2);
  for (int64_t c = 0; c < 4; ++c) queries(1, c) = 0.0f;  // a zero query: every score 0
  StoreAttentionOptions options;
  options.top_k = 3;
  int made = 0;
  for (StoreDtype dtype : {StoreDtype::kFloat32, StoreDtype::kBFloat16}) {
    for (int64_t chunk_rows : {10, 7, 3, 4, 1}) {
      SCOPED_TRACE("chunk_rows=" + std::to_string(chunk_rows));
      const KeyValueStore store = KeyValueStore::create(path("s" + std::to_string(made++)), keys,
                                                        values, dtype, chunk_rows);
      const StoreAttentionResult got = attend(queries, store, {}, options);
      for (int64_t i = 0; i < 2; ++i) {
        for (int64_t r = 0; r < 3; ++r) {
          EXPECT_EQ(got.top_ids(i, r), r) << "i=" << i;
          EXPECT_NEAR(got.top_weights(i, r), 0.1f, 1e-6) << "i=" << i << " r=" << r;
        }
      }
    }
  }
}

TEST_F(StoreTest, ChunkIndicesOutOfRangeAreNamed) {
  const KeyValueStore store =
      KeyValueStore::create(path("s"), Tensor<float>(Shape{5, 3}, 1.0f),
                            Tensor<float>(Shape{5, 2}, 1.0f), StoreDtype::kFloat32, 2);
  ASSERT_EQ(store.num_chunks(), 3u);
  EXPECT_EQ(store.chunk_range(2).first_row, 4);
  EXPECT_EQ(store.chunk_range(2).rows, 1);
  EXPECT_EQ(store.name(), "store " + path("s"));
  expect_error([&] { store.chunk_range(3); },
               {"KeyValueStore::chunk_range", "index = 3", "3 chunks"});
  expect_error([&] { store.read_chunk(7); },
               {"KeyValueStore::read_chunk", "index = 7", "3 chunks"});
  store.read_ahead(3);  // a hint past the end reads nothing and is no error
}

}  // namespace
}  // namespace qkv::test