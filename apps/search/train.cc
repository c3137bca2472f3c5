#include "search/train.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "qkv/attention.h"
#include "search/encoder.h"

namespace qkv::search {
namespace {

// A fixed seed for the split, apart from the training seed.
constexpr uint64_t kSplitSeed = 0x5ea2c4;

}  // namespace

Split split_of(const std::string& name) {
  const uint64_t h = XXH3_64bits_withSeed(name.data(), name.size(), kSplitSeed) % 20;
  return h < 2 ? Split::kTest : h == 2 ? Split::kValidation : Split::kTrain;
}

Tensor<float> encodings(const SparseRows& rows, const Tensor<float>& map) {
  Tensor<float> out(Shape{rows.rows(), map.size(1)});
  encode(rows, map.view(), out.view());
  return out;
}

double training_loss(const Encoders& encoders, const SparseRows& documents,
                     const SparseRows& documents_by_feature, const SparseRows& queries,
                     const std::vector<int64_t>& targets, Tensor<float>* d_query_map,
                     Tensor<float>* d_doc_map) {
  const int64_t nq = queries.rows(), n = documents.rows(), d = encoders.query_map.size(1);
  Tensor<float> q = encodings(queries, encoders.query_map);
  Tensor<float> docs = encodings(documents, encoders.doc_map);
  // Attention of the batch over every document: a batch of one, scores q · d
  // (scale 1: the encodings learn their own scale). The values are not
  // needed for the loss (d_output = 0): one zero column.
  const ConstView<float> q3(q.data(), Shape{1, nq, d}), k3(docs.data(), Shape{1, n, d});
  const Tensor<float> values(Shape{1, n, 1}, 0.0f);
  AttentionOptions options;
  options.scale = encoders.score_scale;
  options.return_lse = true;
  const AttentionResult<float> fwd = scaled_dot_product_attention(q3, k3, values, {}, options);

  double loss = 0.0;
  std::vector<double> target_scores(static_cast<size_t>(nq));
  for (int64_t i = 0; i < nq; ++i) {
    double s = 0.0;
    for (int64_t c = 0; c < d; ++c) s += double{q(i, c)} * double{docs(targets[i], c)};
    loss += double{fwd.lse(0, i)} - encoders.score_scale * s;
  }
  loss /= static_cast<double>(nq);
  if (d_query_map == nullptr && d_doc_map == nullptr) return loss;

  // dL/dS = (P - Y) / nq: the lse's part through the fused backward, the
  // target's by hand.
  const Tensor<float> d_output(Shape{1, nq, 1}, 0.0f);
  const Tensor<float> d_lse(Shape{1, nq}, static_cast<float>(1.0 / static_cast<double>(nq)));
  DotProductGrads<float> g = scaled_dot_product_attention_backward(
      q3, k3, values, {}, options, {fwd.output, fwd.lse}, d_output, d_lse);
  const float inv = static_cast<float>(encoders.score_scale / static_cast<double>(nq));
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t c = 0; c < d; ++c) {
      g.d_queries(0, i, c) -= inv * docs(targets[i], c);
      g.d_keys(0, targets[i], c) -= inv * q(i, c);
    }
  }
  if (d_query_map != nullptr) {
    *d_query_map = Tensor<float>(encoders.query_map.shape());
    encode_backward(transpose(queries, encoders.hashing.buckets),
                    ConstView<float>(g.d_queries.data(), Shape{nq, d}), d_query_map->view());
  }
  if (d_doc_map != nullptr) {
    *d_doc_map = Tensor<float>(encoders.doc_map.shape());
    encode_backward(documents_by_feature, ConstView<float>(g.d_keys.data(), Shape{n, d}),
                    d_doc_map->view());
  }
  return loss;
}

std::vector<std::vector<int64_t>> rank_by_attention(const Tensor<float>& queries,
                                                    const Tensor<float>& documents, double scale,
                                                    int64_t k) {
  const int64_t nq = queries.size(0), n = documents.size(0), d = queries.size(1);
  std::vector<std::vector<int64_t>> ranked(static_cast<size_t>(nq));
  // 256 queries at a time: their weights over every document, 256 N floats.
  constexpr int64_t kBlock = 256;
  const Tensor<float> values(Shape{1, n, 1}, 0.0f);
  AttentionOptions options;
  options.scale = scale;
  options.return_weights = true;
  const ConstView<float> k3(documents.data(), Shape{1, n, d});
  for (int64_t first = 0; first < nq; first += kBlock) {
    const int64_t rows = std::min(kBlock, nq - first);
    const AttentionResult<float> r = scaled_dot_product_attention(
        ConstView<float>(queries.data() + first * d, Shape{1, rows, d}), k3, values, {}, options);
    for (int64_t i = 0; i < rows; ++i) {
      const float* w = r.weights.data() + i * n;
      std::vector<int64_t> ids(static_cast<size_t>(n));
      std::iota(ids.begin(), ids.end(), int64_t{0});
      const int64_t top = std::min(k, n);
      std::partial_sort(ids.begin(), ids.begin() + top, ids.end(), [&](int64_t a, int64_t b) {
        return w[a] > w[b] || (w[a] == w[b] && a < b);
      });
      ids.resize(static_cast<size_t>(top));
      ranked[first + i] = std::move(ids);
    }
  }
  return ranked;
}

Encoders train(const std::vector<Package>& packages, const std::vector<int64_t>& train_ids,
               const TrainOptions& options) {
  const int64_t buckets = options.hashing.buckets, d = options.dim;
  Encoders enc{options.hashing, options.score_scale, Tensor<float>(Shape{buckets, d}),
               Tensor<float>(Shape{buckets, d}), {}, 0};
  // Both maps start equal, N(0, 1/d): a query's and a document's shared
  // features then add about their weights' product to the score.
  std::mt19937_64 rng(options.seed);
  std::normal_distribution<float> normal(0.0f, static_cast<float>(1.0 / std::sqrt(double(d))));
  for (float& x : enc.query_map.values()) x = normal(rng);
  enc.doc_map.values() = enc.query_map.values();

  const SparseRows documents = document_features(packages, options.hashing);
  const SparseRows documents_by_feature = transpose(documents, buckets);
  std::vector<std::string> texts;
  texts.reserve(train_ids.size());
  for (const int64_t id : train_ids) texts.push_back(packages[id].short_description);
  const SparseRows all_queries = query_features(texts, options.hashing);

  Adam adam_q(enc.query_map.numel(), options.learning_rate);
  Adam adam_d(enc.doc_map.numel(), options.learning_rate);
  std::vector<int64_t> order(train_ids.size());
  const int64_t steps_per_epoch =
      (static_cast<int64_t>(order.size()) + options.batch - 1) / options.batch;
  const int64_t steps = steps_per_epoch * options.epochs;
  int64_t step = 0;
  int best_epoch = 0;
  std::vector<float> best_query_map, best_doc_map;
  for (int epoch = 0; epoch < options.epochs; ++epoch) {
    std::iota(order.begin(), order.end(), int64_t{0});
    std::shuffle(order.begin(), order.end(), rng);
    for (int64_t s = 0; s < steps_per_epoch; ++s) {
      const auto first = order.begin() + s * options.batch;
      const auto last = order.begin() + std::min<int64_t>(static_cast<int64_t>(order.size()),
                                                          (s + 1) * options.batch);
      const std::vector<int64_t> batch(first, last);
      std::vector<int64_t> targets;
      for (const int64_t b : batch) targets.push_back(train_ids[b]);
      Tensor<float> d_query_map, d_doc_map;
      const double loss = training_loss(enc, documents, documents_by_feature,
                                        slice(all_queries, batch), targets, &d_query_map,
                                        &d_doc_map);
      if (options.tied) {
        for (size_t e = 0; e < d_doc_map.values().size(); ++e) d_doc_map.values()[e] += d_query_map.values()[e];
        adam_d.step(enc.doc_map.view(), d_doc_map.view());
        enc.query_map.values() = enc.doc_map.values();
      } else {
        adam_q.step(enc.query_map.view(), d_query_map.view());
        adam_d.step(enc.doc_map.view(), d_doc_map.view());
      }
      if (options.progress) options.progress(++step, steps, loss);
    }
    if (options.validation_score) {
      const double score = options.validation_score(enc);
      enc.validation_scores.push_back(score);
      if (best_epoch == 0 || score > enc.validation_scores[best_epoch - 1]) {
        best_epoch = epoch + 1;
        best_query_map = enc.query_map.values();
        best_doc_map = enc.doc_map.values();
      }
    }
  }
  if (best_epoch > 0) {
    enc.query_map.values() = std::move(best_query_map);
    enc.doc_map.values() = std::move(best_doc_map);
    enc.best_epoch = best_epoch;
  } else {
    enc.best_epoch = options.epochs;
  }
  return enc;
}

}  // namespace qkv::search
