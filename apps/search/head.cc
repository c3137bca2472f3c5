#include "search/head.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <numeric>
#include <random>

#include "qkv/attention.h"
#include "qkv/linear.h"
#include "qkv/threads.h"

namespace qkv::search {
namespace {

Tensor<float> transposed(const Tensor<float>& x) {
  const int64_t rows = x.size(0), cols = x.size(1);
  Tensor<float> t(Shape{cols, rows});
#pragma omp parallel for schedule(static) num_threads(num_threads())
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = 0; r < rows; ++r) t.data()[c * rows + r] = x.data()[r * cols + c];
  }
  return t;
}

}  // namespace

Tensor<float> apply_map(const Tensor<float>& x, const Tensor<float>& weight) {
  return linear(x.view(), weight.view());
}

Head identity_head(int64_t dim, double score_scale) {
  Head head{Tensor<float>(Shape{dim, dim}, 0.0f),
            Tensor<float>(Shape{dim, dim}, 0.0f),
            score_scale,
            {},
            0};
  for (int64_t i = 0; i < dim; ++i) {
    head.query_weight.data()[i * dim + i] = 1.0f;
    head.doc_weight.data()[i * dim + i] = 1.0f;
  }
  return head;
}

double head_loss(const Head& head, const Tensor<float>& documents, const Tensor<float>& queries,
                 const std::vector<int64_t>& targets, Head* grads) {
  const int64_t nq = queries.size(0), n = documents.size(0), d = head.query_weight.size(0);
  const Tensor<float> q = apply_map(queries, head.query_weight);
  const Tensor<float> docs = apply_map(documents, head.doc_weight);
  // A batch of one: the queries attend over every document; the values are
  // not needed for the loss (d_output = 0), one zero column.
  const ConstView<float> q3(q.data(), Shape{1, nq, d}), k3(docs.data(), Shape{1, n, d});
  const Tensor<float> values(Shape{1, n, 1}, 0.0f);
  AttentionOptions options;
  options.scale = head.score_scale;
  options.return_lse = true;
  const AttentionResult<float> fwd = scaled_dot_product_attention(q3, k3, values, {}, options);
  double loss = 0.0;
  for (int64_t i = 0; i < nq; ++i) {
    double s = 0.0;
    for (int64_t c = 0; c < d; ++c) s += double{q(i, c)} * double{docs(targets[i], c)};
    loss += double{fwd.lse(0, i)} - head.score_scale * s;
  }
  loss /= static_cast<double>(nq);
  if (grads == nullptr) return loss;
  // dL/dS = (P - Y) / nq: the lse's part through the fused backward, the
  // target's by hand.
  const Tensor<float> d_output(Shape{1, nq, 1}, 0.0f);
  const Tensor<float> d_lse(Shape{1, nq}, static_cast<float>(1.0 / static_cast<double>(nq)));
  DotProductGrads<float> g = scaled_dot_product_attention_backward(
      q3, k3, values, {}, options, {fwd.output, fwd.lse}, d_output, d_lse);
  const float inv = static_cast<float>(head.score_scale / static_cast<double>(nq));
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t c = 0; c < d; ++c) {
      g.d_queries(0, i, c) -= inv * docs(targets[i], c);
      g.d_keys(0, targets[i], c) -= inv * q(i, c);
    }
  }
  // dW = d_outᵀ x: (d, rows) (rows, d), as linear(d_outᵀ, xᵀ).
  const Tensor<float> dq(Shape{nq, d},
                         std::vector<float>(g.d_queries.data(), g.d_queries.data() + nq * d));
  const Tensor<float> dk(Shape{n, d}, std::vector<float>(g.d_keys.data(), g.d_keys.data() + n * d));
  grads->query_weight = linear(transposed(dq).view(), transposed(queries).view());
  grads->doc_weight = linear(transposed(dk).view(), transposed(documents).view());
  return loss;
}

Head train_head(const Tensor<float>& documents, const Tensor<float>& queries,
                const std::vector<int64_t>& targets, const HeadOptions& options) {
  const int64_t d = documents.size(1), m = queries.size(0);
  Head head = identity_head(d, options.score_scale);
  Adam adam_q(head.query_weight.numel(), options.learning_rate);
  Adam adam_d(head.doc_weight.numel(), options.learning_rate);
  Head best = head;
  if (options.validation_score) best.validation_scores.push_back(options.validation_score(head));
  double best_score = best.validation_scores.empty() ? 0.0 : best.validation_scores[0];
  std::mt19937_64 rng(options.seed);
  std::vector<int64_t> order(static_cast<size_t>(m));
  const int64_t steps_per_epoch = (m + options.batch - 1) / options.batch;
  const int64_t steps = steps_per_epoch * options.epochs;
  int64_t step = 0;
  std::vector<double> scores = best.validation_scores;
  for (int epoch = 1; epoch <= options.epochs; ++epoch) {
    std::iota(order.begin(), order.end(), int64_t{0});
    std::shuffle(order.begin(), order.end(), rng);
    for (int64_t s = 0; s < steps_per_epoch; ++s) {
      const int64_t first = s * options.batch, rows = std::min(options.batch, m - first);
      Tensor<float> batch(Shape{rows, d});
      std::vector<int64_t> batch_targets;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = order[static_cast<size_t>(first + r)];
        std::copy(queries.data() + i * d, queries.data() + (i + 1) * d, batch.data() + r * d);
        batch_targets.push_back(targets[static_cast<size_t>(i)]);
      }
      Head grads;
      const double loss = head_loss(head, documents, batch, batch_targets, &grads);
      adam_q.step(head.query_weight.view(), grads.query_weight.view());
      adam_d.step(head.doc_weight.view(), grads.doc_weight.view());
      if (options.progress) options.progress(++step, steps, loss);
    }
    if (options.validation_score) {
      const double score = options.validation_score(head);
      scores.push_back(score);
      if (score > best_score) {
        best_score = score;
        best = head;
        best.best_epoch = epoch;
      }
    } else {
      best = head;
      best.best_epoch = epoch;
    }
  }
  best.validation_scores = scores;
  return best;
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

Adam::Adam(int64_t size, double learning_rate, double beta1, double beta2, double epsilon)
    : m_(Shape{size}, 0.0f),
      v_(Shape{size}, 0.0f),
      lr_(learning_rate),
      beta1_(beta1),
      beta2_(beta2),
      epsilon_(epsilon) {}

void Adam::step(TensorView<float> params, ConstView<float> grads) {
  const int64_t n = m_.numel();
  assert(params.numel() == n && grads.numel() == n);
  ++t_;
  const float b1 = static_cast<float>(beta1_), b2 = static_cast<float>(beta2_);
  const float step = static_cast<float>(lr_ / (1.0 - std::pow(beta1_, static_cast<double>(t_))));
  const float correct2 =
      static_cast<float>(1.0 / (1.0 - std::pow(beta2_, static_cast<double>(t_))));
  const float eps = static_cast<float>(epsilon_);
  float* p = params.data();
  const float* g = grads.data();
  float* m = m_.data();
  float* v = v_.data();
#pragma omp parallel for simd schedule(static) num_threads(num_threads())
  for (int64_t i = 0; i < n; ++i) {
    m[i] = b1 * m[i] + (1.0f - b1) * g[i];
    v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
    p[i] -= step * m[i] / (std::sqrt(v[i] * correct2) + eps);
  }
}

}  // namespace qkv::search
