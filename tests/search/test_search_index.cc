// qkv search's learned engine: hashed features, the encoders (held to dense
// float64 loops), the training loss (held to a float64 softmax over every
// document, its gradients to finite differences), training's determinism
// for a seed at any thread count, the metrics, and the index on the fixture
// lists (build, open, query, eval, a corrupt file).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "qkv/error.h"
#include "qkv/threads.h"
#include "search/corpus.h"
#include "search_testing.h"
#include "search/encoder.h"
#include "search/features.h"
#include "search/index.h"
#include "search/metrics.h"
#include "search/train.h"

namespace qkv::search {
namespace {

namespace fs = std::filesystem;
using testing::kFixture;

using testing::TempDir;

uint64_t test_seed() {
  const char* s = std::getenv("QKV_TEST_SEED");
  return s ? std::strtoull(s, nullptr, 10) : std::random_device{}();
}

// Dense (rows, buckets) in double of sparse rows.
std::vector<double> dense(const SparseRows& x, int64_t buckets) {
  std::vector<double> out(static_cast<size_t>(x.rows() * buckets), 0.0);
  for (int64_t r = 0; r < x.rows(); ++r) {
    for (int64_t e = x.offsets[r]; e < x.offsets[r + 1]; ++e) {
      out[r * buckets + x.features[e]] += x.weights[e];
    }
  }
  return out;
}

Tensor<float> random_map(std::mt19937_64& rng, int64_t buckets, int64_t d, float sd) {
  std::normal_distribution<float> normal(0.0f, sd);
  Tensor<float> m(Shape{buckets, d});
  for (float& x : m.values()) x = normal(rng);
  return m;
}

TEST(SearchFeatures, HashedWordsAndPairs) {
  const FeatureHashing h{1 << 20, 7};
  const SparseRows a = query_features({"plotting tool", "tool plotting", "", "plot plot plot"}, h);
  ASSERT_EQ(a.rows(), 4);
  // Two words and one pair each; the same words in another order share the
  // words' buckets but not the pair's.
  EXPECT_EQ(a.offsets[1] - a.offsets[0], 3);
  EXPECT_EQ(a.offsets[2] - a.offsets[1], 3);
  int shared = 0;
  for (int64_t e = 0; e < 3; ++e) {
    for (int64_t f = 3; f < 6; ++f) shared += a.features[e] == a.features[f];
  }
  EXPECT_EQ(shared, 2);
  for (int64_t e = 0; e < 6; ++e) EXPECT_FLOAT_EQ(a.weights[e], 1.0f / std::sqrt(3.0f));
  EXPECT_EQ(a.offsets[3] - a.offsets[2], 0);  // no words, no features
  // "plot plot plot": word x3 and pair x2 merge into two entries weighing
  // 3/sqrt(5) and 2/sqrt(5).
  ASSERT_EQ(a.offsets[4] - a.offsets[3], 2);
  std::vector<float> w(a.weights.begin() + a.offsets[3], a.weights.end());
  std::sort(w.begin(), w.end());
  EXPECT_FLOAT_EQ(w[0], 2.0f / std::sqrt(5.0f));
  EXPECT_FLOAT_EQ(w[1], 3.0f / std::sqrt(5.0f));
  // Another hashing seed moves the buckets.
  const SparseRows b = query_features({"plotting tool"}, FeatureHashing{1 << 20, 8});
  EXPECT_NE(std::vector<int32_t>(b.features.begin(), b.features.end()),
            std::vector<int32_t>(a.features.begin(), a.features.begin() + 3));
}

TEST(SearchFeatures, TransposeAndSlice) {
  const std::vector<Package> packages = read_apt_lists(kFixture);
  const int64_t buckets = 97;
  const SparseRows x = document_features(packages, FeatureHashing{buckets, 1});
  EXPECT_EQ(x.rows(), static_cast<int64_t>(packages.size()));
  const SparseRows t = transpose(x, buckets);
  const std::vector<double> dx = dense(x, buckets), dt = dense(t, x.rows());
  for (int64_t r = 0; r < x.rows(); ++r) {
    for (int64_t c = 0; c < buckets; ++c) ASSERT_EQ(dx[r * buckets + c], dt[c * x.rows() + r]);
  }
  const SparseRows s = slice(x, {5, 0, 5});
  const std::vector<double> ds = dense(s, buckets);
  for (int64_t c = 0; c < buckets; ++c) {
    EXPECT_EQ(ds[c], dx[5 * buckets + c]);
    EXPECT_EQ(ds[buckets + c], dx[c]);
    EXPECT_EQ(ds[2 * buckets + c], dx[5 * buckets + c]);
  }
}

// encode and encode_backward against dense float64 products.
TEST(SearchEncoder, MatchesDenseProducts) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("QKV_TEST_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<Package> packages = read_apt_lists(kFixture);
  const int64_t buckets = 211, d = 9;
  const SparseRows x = document_features(packages, FeatureHashing{buckets, seed});
  const Tensor<float> map = random_map(rng, buckets, d, 1.0f);
  const Tensor<float> enc = encodings(x, map);
  const std::vector<double> dx = dense(x, buckets);
  double worst = 0.0;
  for (int64_t r = 0; r < x.rows(); ++r) {
    for (int64_t c = 0; c < d; ++c) {
      double want = 0.0;
      for (int64_t f = 0; f < buckets; ++f) want += dx[r * buckets + f] * map(f, c);
      worst = std::max(worst, std::abs(enc(r, c) - want));
    }
  }
  EXPECT_LT(worst, 1e-5);
  const Tensor<float> g = random_map(rng, x.rows(), d, 1.0f);
  Tensor<float> d_map(Shape{buckets, d});
  encode_backward(transpose(x, buckets), g.view(), d_map.view());
  worst = 0.0;
  for (int64_t f = 0; f < buckets; ++f) {
    for (int64_t c = 0; c < d; ++c) {
      double want = 0.0;
      for (int64_t r = 0; r < x.rows(); ++r) want += dx[r * buckets + f] * g(r, c);
      worst = std::max(worst, std::abs(d_map(f, c) - want));
    }
  }
  EXPECT_LT(worst, 1e-4);
}

struct LossCase {
  std::vector<Package> packages;
  SparseRows documents, documents_by_feature, queries;
  std::vector<int64_t> targets;
  Encoders enc;
};

LossCase loss_case(uint64_t seed, int64_t buckets, int64_t d) {
  std::mt19937_64 rng(seed);
  LossCase c;
  c.packages = read_apt_lists(kFixture);
  const FeatureHashing h{buckets, seed};
  c.documents = document_features(c.packages, h);
  c.documents_by_feature = transpose(c.documents, buckets);
  std::vector<std::string> texts;
  for (int64_t i = 3; i < static_cast<int64_t>(c.packages.size()); i += 37) {
    texts.push_back(c.packages[i].short_description);
    c.targets.push_back(i);
  }
  c.queries = query_features(texts, h);
  c.enc = Encoders{h, 3.0, random_map(rng, buckets, d, 0.5f), random_map(rng, buckets, d, 0.5f), {}, 0};
  return c;
}

// The loss against a float64 softmax over every document, from the same encodings.
TEST(SearchTraining, LossIsCrossEntropyOverEveryDocument) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("QKV_TEST_SEED=" + std::to_string(seed));
  const LossCase c = loss_case(seed, 64, 6);
  const Tensor<float> q = encodings(c.queries, c.enc.query_map);
  const Tensor<float> docs = encodings(c.documents, c.enc.doc_map);
  double want = 0.0;
  for (int64_t i = 0; i < q.size(0); ++i) {
    std::vector<double> s(static_cast<size_t>(docs.size(0)));
    double m = -INFINITY;
    for (int64_t j = 0; j < docs.size(0); ++j) {
      double dot = 0.0;
      for (int64_t k = 0; k < q.size(1); ++k) dot += double{q(i, k)} * double{docs(j, k)};
      s[j] = c.enc.score_scale * dot;
      m = std::max(m, s[j]);
    }
    double z = 0.0;
    for (const double x : s) z += std::exp(x - m);
    want += m + std::log(z) - s[c.targets[i]];
  }
  want /= static_cast<double>(q.size(0));
  const double got = training_loss(c.enc, c.documents, c.documents_by_feature, c.queries,
                                   c.targets, nullptr, nullptr);
  EXPECT_NEAR(got, want, 1e-4 * std::abs(want));
}

// The maps' gradients against central differences of the loss (float32:
// steps of 1e-2 on entries of size 0.5, checked on the entries the loss
// depends on most).
TEST(SearchTraining, GradientsMatchFiniteDifferences) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("QKV_TEST_SEED=" + std::to_string(seed));
  LossCase c = loss_case(seed, 32, 4);
  Tensor<float> dq, dd;
  training_loss(c.enc, c.documents, c.documents_by_feature, c.queries, c.targets, &dq, &dd);
  for (const bool query_side : {true, false}) {
    Tensor<float>& map = query_side ? c.enc.query_map : c.enc.doc_map;
    const Tensor<float>& grad = query_side ? dq : dd;
    // The 12 largest gradient entries.
    std::vector<int64_t> order(static_cast<size_t>(grad.numel()));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + 12, order.end(), [&](int64_t a, int64_t b) {
      return std::abs(grad.data()[a]) > std::abs(grad.data()[b]);
    });
    for (int n = 0; n < 12; ++n) {
      const int64_t e = order[n];
      const float saved = map.data()[e];
      const float h = 1e-2f;
      map.data()[e] = saved + h;
      const double up = training_loss(c.enc, c.documents, c.documents_by_feature, c.queries,
                                      c.targets, nullptr, nullptr);
      map.data()[e] = saved - h;
      const double down = training_loss(c.enc, c.documents, c.documents_by_feature, c.queries,
                                        c.targets, nullptr, nullptr);
      map.data()[e] = saved;
      const double fd = (up - down) / (2.0 * h);
      EXPECT_NEAR(grad.data()[e], fd, 2e-3 + 2e-2 * std::abs(fd))
          << (query_side ? "query" : "document") << " map entry " << e;
    }
  }
}

// The same seed gives the same maps, bit for bit, with 1 or 2 threads; another
// seed other maps.
TEST(SearchTraining, DeterministicForASeedAtAnyThreadCount) {
  const std::vector<Package> packages = read_apt_lists(kFixture);
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < static_cast<int64_t>(packages.size()); ++i) {
    if (split_of(packages[i].name) == Split::kTrain) ids.push_back(i);
  }
  TrainOptions o;
  o.dim = 16;
  o.hashing.buckets = 1024;
  o.batch = 64;
  o.epochs = 2;
  o.seed = 11;
  auto run = [&](int threads, uint64_t seed) {
    set_num_threads(threads);
    TrainOptions oo = o;
    oo.seed = seed;
    Encoders e = train(packages, ids, oo);
    set_num_threads(0);
    return e;
  };
  const Encoders a = run(1, 11), b = run(2, 11), c = run(2, 12);
  EXPECT_EQ(a.query_map.values(), b.query_map.values());
  EXPECT_EQ(a.doc_map.values(), b.doc_map.values());
  EXPECT_NE(a.doc_map.values(), c.doc_map.values());
}

// Training lowers the loss on the training queries.
TEST(SearchTraining, LowersTheLoss) {
  const std::vector<Package> packages = read_apt_lists(kFixture);
  std::vector<int64_t> ids;
  std::vector<std::string> texts;
  for (int64_t i = 0; i < static_cast<int64_t>(packages.size()); ++i) {
    if (split_of(packages[i].name) != Split::kTrain) continue;
    ids.push_back(i);
    texts.push_back(packages[i].short_description);
  }
  TrainOptions o;
  o.dim = 16;
  o.hashing.buckets = 4096;
  o.batch = 64;
  const SparseRows docs = document_features(packages, o.hashing);
  const SparseRows by_feature = transpose(docs, o.hashing.buckets);
  const SparseRows queries = query_features(texts, o.hashing);
  o.epochs = 1;
  const double before = training_loss(train(packages, ids, TrainOptions{o.dim, 0, o.batch, o.learning_rate, o.score_scale, o.tied, 0, o.hashing, {}}),
                                      docs, by_feature, queries, ids, nullptr, nullptr);
  o.epochs = 10;
  const double after =
      training_loss(train(packages, ids, o), docs, by_feature, queries, ids, nullptr, nullptr);
  EXPECT_LT(after, 0.5 * before);
}

TEST(SearchMetrics, RanksCount) {
  MetricsSum m;
  m.add({7, 3, 9}, 7);                            // rank 1
  m.add({1, 2, 3, 4}, 4);                         // rank 4
  m.add({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, 11);  // past 10
  m.add({}, 3);                                   // not found
  const Metrics r = m.metrics();
  EXPECT_EQ(r.queries, 4);
  EXPECT_DOUBLE_EQ(r.mrr_at_10, (1.0 + 0.25) / 4);
  EXPECT_DOUBLE_EQ(r.recall_at_1, 0.25);
  EXPECT_DOUBLE_EQ(r.recall_at_10, 0.5);
}

// An index of the fixture: built, opened, queried by the three engines,
// evaluated; a changed byte in any file, and a missing directory, are Errors.
TEST(SearchIndex, BuildQueryEvaluate) {
  TempDir tmp;
  const std::vector<Package> packages = read_apt_lists(kFixture);
  TrainOptions o;
  o.dim = 32;
  o.hashing.buckets = 1 << 12;
  o.batch = 64;
  o.epochs = 8;
  SearchIndex::build(tmp.file("index"), packages, o);
  EXPECT_THROW(SearchIndex::build(tmp.file("index"), packages, o), Error);
  const SearchIndex index = SearchIndex::open(tmp.file("index"));
  ASSERT_EQ(index.packages().size(), packages.size());
  const Ranking learned = index.learned("command-line driven interactive plotting program", 5);
  ASSERT_EQ(learned.hits.size(), 5u);
  double total = 0.0;
  for (const auto& [section, weight] : learned.sections) total += weight;
  EXPECT_NEAR(total, 1.0, 1e-5);  // the pooled one-hots: a distribution over sections
  for (size_t i = 1; i < learned.hits.size(); ++i) {
    EXPECT_GE(learned.hits[i - 1].score, learned.hits[i].score);
  }
  const Ranking bm25 = index.bm25("gnuplot", 3);
  ASSERT_FALSE(bm25.hits.empty());
  EXPECT_EQ(index.packages()[bm25.hits[0].doc].name.rfind("gnuplot", 0), 0u);
  const Ranking hybrid = index.hybrid("gnuplot", 3);
  EXPECT_EQ(hybrid.hits.size(), 3u);
  const Evaluation e = index.evaluate();
  EXPECT_GT(e.bm25.queries, 10);
  EXPECT_EQ(e.learned.queries, e.bm25.queries);
  EXPECT_GT(e.learned.recall_at_10, 0.0);

  for (const char* name : {"query_map.npy", "packages.json", "bm25.sqlite", "documents/manifest.json"}) {
    SCOPED_TRACE(name);
    const std::string copy = tmp.file("copy");
    fs::remove_all(copy);
    fs::copy(tmp.file("index"), copy, fs::copy_options::recursive);
    const std::string file = (fs::path(copy) / name).string();
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(fs::file_size(file) / 2));
    const char old = static_cast<char>(f.get());
    f.seekp(static_cast<std::streamoff>(fs::file_size(file) / 2));
    f.put(static_cast<char>(old ^ 0x20));
    f.close();
    EXPECT_THROW(SearchIndex::open(copy), Error);
  }
  try {
    SearchIndex::open(tmp.file("missing"));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no such index"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace qkv::search
