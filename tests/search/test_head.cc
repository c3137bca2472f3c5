// GoogleTest suite of the learned engine's head (search/head.h): the loss
// against a float64 loop, its gradients against finite differences, the
// same bits for a seed at 1 and 2 threads, and early stopping on the
// validation score. On random embeddings, fresh each run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "qkv/threads.h"
#include "search/head.h"
#include "test_util.h"

namespace qkv::search {
namespace {

struct HeadCase {
  Tensor<float> documents, queries;
  std::vector<int64_t> targets;
  Head head;
};

// n documents and m queries of dimension d: unit rows; each query its
// target plus noise; a head near the identity.
HeadCase head_case(uint64_t seed, int64_t n, int64_t m, int64_t d) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto unit_rows = [&](int64_t rows) {
    Tensor<float> x(Shape{rows, d});
    for (int64_t r = 0; r < rows; ++r) {
      double len = 0;
      for (int64_t c = 0; c < d; ++c) len += std::pow(x(r, c) = normal(rng), 2);
      for (int64_t c = 0; c < d; ++c) x(r, c) /= static_cast<float>(std::sqrt(len));
    }
    return x;
  };
  HeadCase c{unit_rows(n), unit_rows(m), {}, identity_head(d, 5.0)};
  for (int64_t i = 0; i < m; ++i) {
    c.targets.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(n)));
    for (int64_t k = 0; k < d; ++k) c.queries(i, k) += c.documents(c.targets.back(), k);
  }
  for (float& w : c.head.query_weight.values()) w += 0.1f * normal(rng);
  for (float& w : c.head.doc_weight.values()) w += 0.1f * normal(rng);
  return c;
}

// The loss in double: mean over queries of lse(s q·D) - s q·d_target.
double loss_loop(const HeadCase& c) {
  const int64_t n = c.documents.size(0), m = c.queries.size(0), d = c.documents.size(1);
  const auto mapped = [&](const Tensor<float>& x, const Tensor<float>& w, int64_t r) {
    std::vector<double> y(static_cast<size_t>(d), 0.0);
    for (int64_t o = 0; o < d; ++o) {
      for (int64_t k = 0; k < d; ++k) y[o] += double{w(o, k)} * x(r, k);
    }
    return y;
  };
  std::vector<std::vector<double>> docs;
  for (int64_t j = 0; j < n; ++j) docs.push_back(mapped(c.documents, c.head.doc_weight, j));
  double total = 0;
  for (int64_t i = 0; i < m; ++i) {
    const std::vector<double> q = mapped(c.queries, c.head.query_weight, i);
    std::vector<double> s(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) {
      s[j] = c.head.score_scale * std::inner_product(q.begin(), q.end(), docs[j].begin(), 0.0);
    }
    const double top = *std::max_element(s.begin(), s.end());
    double z = 0;
    for (double x : s) z += std::exp(x - top);
    total += top + std::log(z) - s[c.targets[i]];
  }
  return total / static_cast<double>(m);
}

TEST(SearchHead, LossMatchesAFloat64Loop) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_note(seed));
  const HeadCase c = head_case(seed, 300, 40, 12);
  EXPECT_NEAR(head_loss(c.head, c.documents, c.queries, c.targets, nullptr), loss_loop(c), 2e-5);
}

TEST(SearchHead, GradientsMatchFiniteDifferences) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_note(seed));
  HeadCase c = head_case(seed, 200, 24, 8);
  Head grads;
  head_loss(c.head, c.documents, c.queries, c.targets, &grads);
  for (const bool query_side : {true, false}) {
    SCOPED_TRACE(query_side ? "query_weight" : "doc_weight");
    Tensor<float>& w = query_side ? c.head.query_weight : c.head.doc_weight;
    const Tensor<float>& g = query_side ? grads.query_weight : grads.doc_weight;
    ASSERT_EQ(g.shape(), w.shape());
    for (int64_t e = 0; e < w.numel(); e += 5) {
      const float saved = w.data()[e];
      const double h = 1e-3;
      w.data()[e] = static_cast<float>(saved + h);
      const double up = loss_loop(c);
      w.data()[e] = static_cast<float>(saved - h);
      const double down = loss_loop(c);
      w.data()[e] = saved;
      const double fd = (up - down) / (2 * h);
      EXPECT_NEAR(g.data()[e], fd, 2e-5 + 1e-3 * std::abs(fd)) << "entry " << e;
    }
  }
}

TEST(SearchHead, TrainingLowersTheLossAndIsDeterministic) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_note(seed));
  const HeadCase c = head_case(seed, 500, 300, 16);
  HeadOptions options;
  options.epochs = 3;
  options.batch = 64;
  options.learning_rate = 1e-2;
  options.score_scale = 5.0;
  options.seed = seed;
  int64_t last_step = 0, total_steps = 0;
  options.progress = [&](int64_t step, int64_t steps, double) {
    last_step = step;
    total_steps = steps;
  };
  set_num_threads(1);
  const Head one = train_head(c.documents, c.queries, c.targets, options);
  set_num_threads(2);
  const Head two = train_head(c.documents, c.queries, c.targets, options);
  set_num_threads(0);
  EXPECT_EQ(last_step, 15);
  EXPECT_EQ(total_steps, 15);
  EXPECT_EQ(one.best_epoch, 3);
  test::expect_bitwise_equal(one.query_weight, two.query_weight, "query_weight at 1 and 2 threads");
  test::expect_bitwise_equal(one.doc_weight, two.doc_weight, "doc_weight at 1 and 2 threads");
  const Head start = identity_head(16, 5.0);
  EXPECT_LT(head_loss(one, c.documents, c.queries, c.targets, nullptr),
            head_loss(start, c.documents, c.queries, c.targets, nullptr) - 0.1);
  // Early stopping: a validation score that peaks at epoch 1 keeps epoch 1's
  // head; one that never beats the untrained head keeps the identity.
  std::vector<double> scores = {0.5, 0.9, 0.7, 0.6};
  size_t call = 0;
  options.validation_score = [&](const Head&) { return scores[call++]; };
  const Head early = train_head(c.documents, c.queries, c.targets, options);
  EXPECT_EQ(early.best_epoch, 1);
  EXPECT_EQ(early.validation_scores, scores);
  scores = {0.9, 0.5, 0.6, 0.7};
  call = 0;
  const Head none = train_head(c.documents, c.queries, c.targets, options);
  EXPECT_EQ(none.best_epoch, 0);
  test::expect_bitwise_equal(none.query_weight, start.query_weight, "the untrained head");
}

}  // namespace
}  // namespace qkv::search
