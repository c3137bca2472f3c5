// Tests of the key-value database of d2l §11.1 (qkv/lookup.h): exact match,
// approximate match by attention over n-gram similarity, average pooling,
// top-k ranking and argument checks.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "qkv/lookup.h"
#include "test_util.h"

namespace qkv::test {
namespace {

double sum_of(const std::vector<double>& w) { return std::accumulate(w.begin(), w.end(), 0.0); }

double max_of(const std::vector<double>& w) { return *std::max_element(w.begin(), w.end()); }

TEST(Lookup, DefaultIsTheChaptersSixNamesInOrder) {
  const KeyValueDatabase db;
  const std::vector<Record> expected = {{"Zhang", "Aston"}, {"Lipton", "Zachary"},
                                        {"Li", "Mu"},       {"Smola", "Alex"},
                                        {"Hu", "Rachel"},   {"Werness", "Brent"}};
  EXPECT_EQ(db.records(), expected);
}

TEST(Lookup, ExactLiIsMuWithOneHotWeights) {
  const KeyValueDatabase db;
  const LookupResult r = db.exact("Li");
  ASSERT_TRUE(r.match.has_value());
  EXPECT_EQ(db.records()[*r.match].value, "Mu");
  EXPECT_EQ(r.weights, (std::vector<double>{0, 0, 1, 0, 0, 0}));
  EXPECT_EQ(top_k(r.weights, 1), std::vector<size_t>{2});
}

TEST(Lookup, ExactIsCaseSensitiveAndMissingKeyIsNoMatch) {
  const KeyValueDatabase db;
  for (const char* query : {"Lee", "li", "", "Lipto"}) {
    SCOPED_TRACE(query);
    const LookupResult r = db.exact(query);
    EXPECT_FALSE(r.match.has_value());
    EXPECT_EQ(r.weights, std::vector<double>(6, 0.0));
  }
}

TEST(Lookup, ApproximateLiWithoutMuRetrievesLipton) {
  KeyValueDatabase db;
  ASSERT_TRUE(db.remove("Li"));
  EXPECT_EQ(db.size(), 5u);
  EXPECT_FALSE(db.exact("Li").match.has_value());
  const LookupResult r = db.approximate("Li");
  ASSERT_EQ(r.weights.size(), 5u);
  const size_t best = top_k(r.weights, 1)[0];
  EXPECT_EQ(db.records()[best], (Record{"Lipton", "Zachary"}));
  EXPECT_GT(r.weights[best], 0.5);
  EXPECT_FALSE(r.match.has_value());
}

TEST(Lookup, ApproximateWithLiPresentPrefersTheExactKey) {
  const KeyValueDatabase db;
  const LookupResult r = db.approximate("Li");
  EXPECT_EQ(db.records()[top_k(r.weights, 1)[0]].value, "Mu");
  // Lipton shares "^l", "li", "^li" with "Li": second.
  EXPECT_EQ(db.records()[top_k(r.weights, 2)[1]].key, "Lipton");
}

TEST(Lookup, ApproximateWeightsArePositiveAndSumToOne) {
  const KeyValueDatabase db;
  for (const double t : {0.05, 0.1, 1.0, 10.0}) {
    for (const char* query : {"Li", "smola", "xyz", ""}) {
      SCOPED_TRACE(std::string(query) + " T=" + std::to_string(t));
      const LookupResult r = db.approximate(query, t);
      ASSERT_EQ(r.weights.size(), 6u);
      for (const double w : r.weights) EXPECT_GT(w, 0.0);
      EXPECT_NEAR(sum_of(r.weights), 1.0, 1e-12);
    }
  }
}

TEST(Lookup, LowerTemperatureSharpensTheWeights) {
  KeyValueDatabase db;
  db.remove("Li");
  double previous = 0;
  for (const double t : {10.0, 1.0, 0.3, 0.1, 0.03}) {
    SCOPED_TRACE("T=" + std::to_string(t));
    const double m = max_of(db.approximate("Li", t).weights);
    EXPECT_GT(m, previous);
    previous = m;
  }
  EXPECT_GT(previous, 0.99);
}

TEST(Lookup, ApproximateMatchesASoftmaxOfSimilarities) {
  const KeyValueDatabase db;
  const double t = 0.25;
  const LookupResult r = db.approximate("Lip", t);
  std::vector<double> e;
  for (const Record& rec : db.records()) e.push_back(std::exp(key_similarity("Lip", rec.key) / t));
  const double s = sum_of(e);
  for (size_t j = 0; j < e.size(); ++j) EXPECT_NEAR(r.weights[j], e[j] / s, 1e-12) << "j=" << j;
}

TEST(Lookup, KeySimilarity) {
  EXPECT_NEAR(key_similarity("Li", "li"), 1.0, 1e-15);
  EXPECT_NEAR(key_similarity("Li", "Lipton"), 3.0 / std::sqrt(5.0 * 13.0), 1e-15);
  EXPECT_EQ(key_similarity("Li", "Hu"), 0.0);
  EXPECT_NEAR(key_similarity("Smola", "Lipton"), key_similarity("Lipton", "Smola"), 1e-15);
}

TEST(Lookup, AverageWeightsAreOneOverN) {
  KeyValueDatabase db;
  for (const size_t n : {6u, 5u}) {
    const LookupResult r = db.average();
    ASSERT_EQ(r.weights.size(), n);
    for (const double w : r.weights) EXPECT_EQ(w, 1.0 / static_cast<double>(n));
    EXPECT_EQ(db.lookup("anything", LookupMode::kAverage).weights, r.weights);
    db.remove("Hu");
  }
}

TEST(Lookup, TopKOrdersByWeightThenTableOrder) {
  const std::vector<double> w = {0.1, 0.4, 0.1, 0.3, 0.1};
  EXPECT_EQ(top_k(w, 1), std::vector<size_t>{1});
  EXPECT_EQ(top_k(w, 3), (std::vector<size_t>{1, 3, 0}));
  EXPECT_EQ(top_k(w, 10), (std::vector<size_t>{1, 3, 0, 2, 4}));
  EXPECT_TRUE(top_k({}, 3).empty());
  expect_error([&] { top_k(w, 0); }, {"top_k", "k is 0"});
}

TEST(Lookup, CustomRecordsAndModeDispatch) {
  const KeyValueDatabase db({{"apple", "red"}, {"banana", "yellow"}, {"grape", "purple"}});
  EXPECT_EQ(db.lookup("banana", LookupMode::kExact).match, std::optional<size_t>(1));
  const LookupResult r = db.lookup("appel", LookupMode::kApproximate, 0.1);
  EXPECT_EQ(db.records()[top_k(r.weights, 1)[0]].value, "red");
}

TEST(Lookup, BadArguments) {
  expect_error(
      [] {
        KeyValueDatabase({{"a", "1"}, {"b", "2"}, {"a", "3"}});
      },
      {"KeyValueDatabase", "\"a\"", "records 1 and 3"});
  const KeyValueDatabase db;
  for (const double t : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    expect_error([&] { db.approximate("Li", t); }, {"temperature"});
  }
  KeyValueDatabase copy;
  EXPECT_FALSE(copy.remove("Lee"));
  EXPECT_EQ(copy.size(), 6u);
}

TEST(Lookup, EmptyDatabase) {
  const KeyValueDatabase db(std::vector<Record>{});
  EXPECT_TRUE(db.average().weights.empty());
  EXPECT_TRUE(db.approximate("Li").weights.empty());
  EXPECT_FALSE(db.exact("Li").match.has_value());
}

}  // namespace
}  // namespace qkv::test
