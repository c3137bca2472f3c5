// The key-value database of d2l §11.1: (key, value) string records queried by
// exact match (one-hot weights), approximate match (softmax attention over a
// character n-gram similarity of the keys) or average pooling (uniform weights).
// Values are strings, so "attention pooling" of the values is the records
// ranked by their weights: top_k() gives that ranking, weights the numbers.
// Approximate match goes through an inverted n-gram index (pg_trgm's way) and
// gives the weights of ref::approximate, the plain loop over every record, bit
// for bit.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace qkv {

struct Record {
  std::string key;
  std::string value;
  bool operator==(const Record&) const = default;
};

enum class LookupMode { kExact, kApproximate, kAverage };

// The outcome of one query: a weight per record (table order, n of them) and,
// for exact match, the record whose key equals the query.
struct LookupResult {
  std::vector<double> weights;
  // Exact mode: the index of the matching record, or nullopt ("no match":
  // then every weight is 0). Always nullopt in the other modes.
  std::optional<size_t> match;
};

// One of a query's best records: its index in records() and its weight.
struct Ranked {
  size_t index;
  double weight;
  bool operator==(const Ranked&) const = default;
};

// The k best records of one query, best first, without a weight per record.
struct TopK {
  std::vector<Ranked> records;
  // As LookupResult::match.
  std::optional<size_t> match;
};

// Indices of the k largest weights, largest first; equal weights keep table
// order; k larger than the number of weights gives them all. k < 1 is an Error.
// A partial sort: O(n log k).
std::vector<size_t> top_k(const std::vector<double>& weights, int k);

// The similarity of two keys: the cosine of their character n-gram count
// vectors (bigrams and trigrams of the ASCII-lower-cased key padded with '^'
// in front and '$' behind: "Li" -> ^l li i$ ^li li$). In [0, 1]; 1 for keys
// equal up to case.
double key_similarity(std::string_view a, std::string_view b);

class KeyValueDatabase {
 public:
  // The chapter's six names: (Zhang, Aston), (Lipton, Zachary), (Li, Mu),
  // (Smola, Alex), (Hu, Rachel), (Werness, Brent), in that order.
  static constexpr double kDefaultTemperature = 0.1;
  static std::vector<Record> chapter_records();

  KeyValueDatabase();
  // Keys must be distinct (an Error names the repeated key); the database may
  // be empty. Builds the n-gram index: O(total key length).
  explicit KeyValueDatabase(std::vector<Record> records);
  KeyValueDatabase(const KeyValueDatabase& other);
  KeyValueDatabase(KeyValueDatabase&& other) noexcept;
  KeyValueDatabase& operator=(const KeyValueDatabase& other);
  KeyValueDatabase& operator=(KeyValueDatabase&& other) noexcept;
  ~KeyValueDatabase();

  const std::vector<Record>& records() const { return records_; }
  size_t size() const { return records_.size(); }
  // Removes the record with this key, from the table and the index; false if
  // there is none. O(n + size of the index).
  bool remove(std::string_view key);

  // Weight 1 on the record whose key equals `query` (case-sensitive), 0
  // elsewhere; all zeros and no match if no key equals it.
  LookupResult exact(std::string_view query) const;
  // weights = softmax(key_similarity(query, key_i) / temperature): positive,
  // summing to 1; a lower temperature sharpens them. temperature must be
  // finite and > 0 (else Error). Through the n-gram index: similarities are
  // computed only for the records sharing an n-gram with the query; every
  // other record has similarity 0 and so one known weight. The same bits as
  // ref::approximate.
  LookupResult approximate(std::string_view query, double temperature = kDefaultTemperature) const;
  // Uniform weights 1/n: every record counts the same, whatever the query.
  LookupResult average() const;
  // One of the three by mode (temperature is used by kApproximate only).
  LookupResult lookup(std::string_view query, LookupMode mode,
                      double temperature = kDefaultTemperature) const;
  // The k records of largest weight, best first, equal weights in table order:
  // the records and weights of top_k(lookup(query, mode, temperature).weights, k),
  // bit for bit, without a weight vector over the table (approximate mode
  // reads only the index entries of the query's n-grams). k < 1 is an Error.
  TopK top(std::string_view query, LookupMode mode, int k,
           double temperature = kDefaultTemperature) const;

 private:
  struct NgramIndex;  // lookup.cc
  std::vector<Record> records_;
  std::unique_ptr<NgramIndex> index_;
};

namespace ref {

// Approximate match by a plain loop: the similarity of the query to every key
// in turn, then a softmax in double whose normaliser is the correctly rounded
// sum of the exponentials (so it does not depend on their order). The
// reference that KeyValueDatabase::approximate is held to.
LookupResult approximate(const KeyValueDatabase& db, std::string_view query,
                         double temperature = KeyValueDatabase::kDefaultTemperature);

}  // namespace ref

}  // namespace qkv
