// Tests of the key-value database of d2l §11.1 (qkv/lookup.h): exact match,
// approximate match by attention over n-gram similarity (the n-gram index held
// bit for bit to the plain loop, ref::approximate, on random tables), average
// pooling, top-k ranking and argument checks.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "qkv/lookup.h"
#include "qkv/masked_softmax.h"
#include "test_util.h"
#include "tolerances.h"

namespace qkv::test {
namespace {

double sum_of(const std::vector<double>& w) { return std::accumulate(w.begin(), w.end(), 0.0); }

double max_of(const std::vector<double>& w) { return *std::max_element(w.begin(), w.end()); }

std::string hex(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%a", x);
  return buf;
}

// Bitwise equality of two weight vectors; the message names the first record
// that differs.
::testing::AssertionResult same_bits(const std::vector<double>& got,
                                     const std::vector<double>& ref) {
  if (got.size() != ref.size()) {
    return ::testing::AssertionFailure() << "got " << got.size() << " weights, ref " << ref.size();
  }
  for (size_t j = 0; j < got.size(); ++j) {
    if (std::memcmp(&got[j], &ref[j], sizeof(double)) != 0) {
      return ::testing::AssertionFailure()
             << "record " << j << ": got " << hex(got[j]) << ", ref " << hex(ref[j]);
    }
  }
  return ::testing::AssertionSuccess();
}

// The ranking the plain loop gives: top_k over the reference's weights.
std::vector<Ranked> ref_top(const KeyValueDatabase& db, std::string_view query, LookupMode mode,
                            int k, double temperature) {
  const LookupResult r = mode == LookupMode::kApproximate ? ref::approximate(db, query, temperature)
                                                          : db.lookup(query, mode, temperature);
  std::vector<Ranked> out;
  for (const size_t j : top_k(r.weights, k)) out.push_back({j, r.weights[j]});
  return out;
}

::testing::AssertionResult same_top(const std::vector<Ranked>& got,
                                    const std::vector<Ranked>& ref) {
  if (got.size() != ref.size()) {
    return ::testing::AssertionFailure() << "got " << got.size() << " records, ref " << ref.size();
  }
  for (size_t r = 0; r < got.size(); ++r) {
    if (got[r].index != ref[r].index ||
        std::memcmp(&got[r].weight, &ref[r].weight, sizeof(double)) != 0) {
      return ::testing::AssertionFailure()
             << "rank " << r + 1 << ": got record " << got[r].index << " (" << hex(got[r].weight)
             << "), ref record " << ref[r].index << " (" << hex(ref[r].weight) << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

// A random key: 0-10 pieces from a small alphabet, so that keys share many
// n-grams and many keys tie: both cases, '^' and '$' (the padding's bytes),
// a space, multibyte UTF-8 (the n-grams are of bytes) and a byte that is not
// UTF-8.
std::string random_key(Rng& rng) {
  static const std::vector<std::string> kPieces = {
      "a", "b", "c", "A",        "B",        "ab",           "ba",
      "^", "$", " ", "\xc3\xa9", "\xc3\x89", "\xe6\x97\xa5", "\xff"};
  std::string key;
  const int64_t pieces = rng.uniform_int(0, 10);
  for (int64_t i = 0; i < pieces; ++i) {
    key += kPieces[static_cast<size_t>(rng.uniform_int(0, kPieces.size() - 1))];
  }
  return key;
}

std::vector<Record> random_records(Rng& rng, size_t n) {
  std::set<std::string> seen;
  std::vector<Record> records;
  for (size_t tries = 0; records.size() < n && tries < 20 * n; ++tries) {
    std::string key = random_key(rng);
    if (seen.insert(key).second) records.push_back({key, "v" + std::to_string(records.size())});
  }
  return records;
}

// Queries for a table: random keys, one of its keys, the empty query, and
// queries of letters no key holds (no n-gram shared: every weight is 1/n).
std::vector<std::string> random_queries(Rng& rng, const KeyValueDatabase& db) {
  std::vector<std::string> queries = {
      "", "xyz", "Q", random_key(rng), random_key(rng), random_key(rng)};
  if (db.size() > 0) {
    queries.push_back(db.records()[static_cast<size_t>(rng.uniform_int(0, db.size() - 1))].key);
  }
  return queries;
}

// Temperatures from the limit T -> 0 (5e-324: every weight 0 but the
// largest similarity's) to T so large that every weight rounds to 1/n (ties
// everywhere, broken by table order).
const std::vector<double> kTemperatures = {5e-324, 1e-300, 0.01, 0.1, 1.0, 1e3, 1e300};

// The index against the plain loop on one table: weights bit for bit, top k
// with ties, every mode.
void expect_index_matches_loop(const KeyValueDatabase& db, Rng& rng) {
  for (const std::string& query : random_queries(rng, db)) {
    for (const double t : kTemperatures) {
      SCOPED_TRACE("query \"" + query + "\" T=" + hex(t) + " n=" + std::to_string(db.size()));
      const LookupResult ref = ref::approximate(db, query, t);
      const LookupResult got = db.approximate(query, t);
      ASSERT_TRUE(same_bits(got.weights, ref.weights));
      EXPECT_FALSE(got.match.has_value());
      for (const int k : {1, 2, 5, static_cast<int>(db.size()), static_cast<int>(db.size()) + 3}) {
        if (k < 1) continue;
        SCOPED_TRACE("k=" + std::to_string(k));
        const TopK top = db.top(query, LookupMode::kApproximate, k, t);
        ASSERT_TRUE(same_top(top.records, ref_top(db, query, LookupMode::kApproximate, k, t)));
        EXPECT_FALSE(top.match.has_value());
      }
    }
    for (const LookupMode mode : {LookupMode::kExact, LookupMode::kAverage}) {
      for (const int k : {1, 3, static_cast<int>(db.size()) + 1}) {
        SCOPED_TRACE("query \"" + query + "\" mode " + std::to_string(static_cast<int>(mode)) +
                     " k=" + std::to_string(k));
        const TopK top = db.top(query, mode, k);
        ASSERT_TRUE(same_top(top.records, ref_top(db, query, mode, k, 0.1)));
        EXPECT_EQ(top.match, db.lookup(query, mode).match);
      }
    }
  }
}

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

TEST(Lookup, IndexGivesTheLoopsWeightsBitForBit) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (const size_t n : {0u, 1u, 2u, 7u, 40u, 300u, 2000u}) {
    const KeyValueDatabase db(random_records(rng, n));
    expect_index_matches_loop(db, rng);
  }
  expect_index_matches_loop(KeyValueDatabase(), rng);
}

TEST(Lookup, IndexAfterRemovals) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  KeyValueDatabase db(random_records(rng, 200));
  // The first, the last and random records, down to an empty table.
  while (db.size() > 0) {
    const size_t n = db.size();
    const size_t j = n % 3 == 0   ? 0
                     : n % 3 == 1 ? n - 1
                                  : static_cast<size_t>(rng.uniform_int(0, n - 1));
    const std::string key = db.records()[j].key;
    ASSERT_TRUE(db.remove(key));
    ASSERT_EQ(db.size(), n - 1);
    if (db.size() % 17 == 0 || db.size() < 4) {
      SCOPED_TRACE("removed \"" + key + "\", " + std::to_string(db.size()) + " left");
      expect_index_matches_loop(db, rng);
      // The removed key as a query: found approximately, no longer exactly.
      EXPECT_FALSE(db.top(key, LookupMode::kExact, 1).match.has_value());
      ASSERT_TRUE(same_top(db.top(key, LookupMode::kApproximate, 3, 0.1).records,
                           ref_top(db, key, LookupMode::kApproximate, 3, 0.1)));
    }
  }
  EXPECT_TRUE(db.approximate("a").weights.empty());
  EXPECT_TRUE(db.top("a", LookupMode::kApproximate, 3).records.empty());
}

TEST(Lookup, KeysThatRepeatAnNgramManyTimes) {
  // A count per key and n-gram up to thousands ("aa" 2999 times in 3000 a's),
  // and keys made of one n-gram over and over: the norms and dot products
  // of long runs, which the index counts as it appends.
  KeyValueDatabase db({{std::string(3000, 'a'), "1"},
                       {"aa", "2"},
                       {"a", "3"},
                       {std::string(2000, 'b'), "4"},
                       {"banana", "5"},
                       {"ab", "6"}});
  for (int round = 0; round < 2; ++round) {
    for (const std::string& query :
         {std::string("aaa"), std::string(1500, 'a'), std::string("abab"), std::string("bb")}) {
      for (const double t : {0.01, 0.1, 1.0}) {
        SCOPED_TRACE(std::to_string(query.size()) + "-byte query, T=" + std::to_string(t));
        ASSERT_TRUE(
            same_bits(db.approximate(query, t).weights, ref::approximate(db, query, t).weights));
        ASSERT_TRUE(same_top(db.top(query, LookupMode::kApproximate, 4, t).records,
                             ref_top(db, query, LookupMode::kApproximate, 4, t)));
      }
    }
    EXPECT_EQ(
        db.records()[db.top(std::string(2500, 'a'), LookupMode::kApproximate, 1).records[0].index]
            .value,
        "1");
    ASSERT_TRUE(db.remove(round == 0 ? "aa" : "banana"));
  }
}

TEST(Lookup, RepeatedNgramsInSmallTables) {
  // The norms count each key's repeats of an n-gram, which the index tells
  // as it fills the n-gram's list: keys with and without repeats, alone and
  // after others, against the plain loop.
  for (const std::vector<Record>& records :
       {std::vector<Record>{{"ab", "1"}}, std::vector<Record>{{"abab", "1"}},
        std::vector<Record>{{"x", "1"}, {"aaaa", "2"}, {"ab", "3"}},
        std::vector<Record>{{"ba", "1"}, {"abba", "2"}, {"baab", "3"}, {"", "4"}}}) {
    const KeyValueDatabase db(records);
    for (const std::string query : {"ab", "a", "aaa", "abba", "zz"}) {
      SCOPED_TRACE("query \"" + query + "\", " + std::to_string(db.size()) + " records");
      ASSERT_TRUE(
          same_bits(db.approximate(query, 0.1).weights, ref::approximate(db, query, 0.1).weights));
    }
  }
}

TEST(Lookup, CopiesHaveTheirOwnIndex) {
  KeyValueDatabase db;
  KeyValueDatabase copy = db;
  ASSERT_TRUE(copy.remove("Li"));
  EXPECT_EQ(db.records()[db.top("Li", LookupMode::kApproximate, 1).records[0].index].key, "Li");
  EXPECT_EQ(copy.records()[copy.top("Li", LookupMode::kApproximate, 1).records[0].index].key,
            "Lipton");
  copy = db;
  EXPECT_TRUE(same_bits(copy.approximate("Li").weights, db.approximate("Li").weights));
  KeyValueDatabase moved = std::move(copy);
  EXPECT_TRUE(same_bits(moved.approximate("Li").weights, ref::approximate(db, "Li").weights));
}

TEST(Lookup, QueryWithNoSharedNgramGivesUniformWeights) {
  const KeyValueDatabase db;
  // "xq" pads to ^x xq q$ ^xq xq$: no key holds any of them.
  for (const char* query : {"xq", "\xe6\x97\xa5"}) {
    SCOPED_TRACE(query);
    const LookupResult r = db.approximate(query);
    for (const double w : r.weights) EXPECT_EQ(w, 1.0 / 6);
    const TopK top = db.top(query, LookupMode::kApproximate, 4);
    ASSERT_EQ(top.records.size(), 4u);
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(top.records[i], (Ranked{i, 1.0 / 6}));
  }
}

TEST(Lookup, ReferenceIsTheSoftmaxOfTheSimilarities) {
  // The plain loop's weights are masked_softmax's (today's attention) up to
  // its SIMD exp and summation order.
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const KeyValueDatabase db(random_records(rng, 500));
  for (const std::string& query : random_queries(rng, db)) {
    for (const double t : {0.05, 0.1, 1.0}) {
      SCOPED_TRACE("query \"" + query + "\" T=" + std::to_string(t));
      const auto n = static_cast<int64_t>(db.size());
      std::vector<double> s(db.size());
      for (size_t j = 0; j < db.size(); ++j) s[j] = key_similarity(query, db.records()[j].key);
      const double largest = max_of(s);
      Tensor<double> scores(Shape{1, 1, n});
      for (int64_t j = 0; j < n; ++j) scores(0, 0, j) = (s[j] - largest) / t;
      const Tensor<double> w = masked_softmax(scores.view());
      const std::vector<double> ref = ref::approximate(db, query, t).weights;
      const Tensor<double> got(Shape{1, 1, n}, ref);
      EXPECT_TRUE(expect_close(got, w, kSoftmaxDouble, "weights", "b q j"));
    }
  }
}

TEST(Lookup, TopKIsTheStableSortsPrefix) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (const size_t n : {0u, 1u, 5u, 100u, 1000u}) {
    std::vector<double> w(n);
    for (double& x : w) x = static_cast<double>(rng.uniform_int(0, 5)) / 5;  // many ties
    std::vector<size_t> order(n);
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return w[a] > w[b]; });
    for (const int k : {1, 2, 10, static_cast<int>(n) + 1}) {
      const std::vector<size_t> expected(
          order.begin(), order.begin() + std::min<size_t>(n, static_cast<size_t>(k)));
      EXPECT_EQ(top_k(w, k), expected) << "n=" << n << " k=" << k;
    }
  }
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
    expect_error([&] { db.approximate("Li", t); },
                 {"KeyValueDatabase::approximate", "temperature"});
    expect_error([&] { db.top("Li", LookupMode::kApproximate, 3, t); },
                 {"KeyValueDatabase::top", "temperature"});
    expect_error([&] { ref::approximate(db, "Li", t); }, {"ref::approximate", "temperature"});
  }
  expect_error([&] { db.top("Li", LookupMode::kApproximate, 0); },
               {"KeyValueDatabase::top", "k is 0"});
  KeyValueDatabase copy;
  EXPECT_FALSE(copy.remove("Lee"));
  EXPECT_EQ(copy.size(), 6u);
}

TEST(Lookup, EmptyDatabase) {
  const KeyValueDatabase db(std::vector<Record>{});
  EXPECT_TRUE(db.average().weights.empty());
  EXPECT_TRUE(db.approximate("Li").weights.empty());
  EXPECT_FALSE(db.exact("Li").match.has_value());
  for (const LookupMode mode :
       {LookupMode::kExact, LookupMode::kApproximate, LookupMode::kAverage}) {
    const TopK top = db.top("Li", mode, 3);
    EXPECT_TRUE(top.records.empty());
    EXPECT_FALSE(top.match.has_value());
  }
}

}  // namespace
}  // namespace qkv::test
