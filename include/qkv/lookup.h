// The key-value database of d2l §11.1: (key, value) string records queried by
// exact match (one-hot weights), approximate match (softmax attention over a
// character n-gram similarity of the keys) or average pooling (uniform weights).
// Values are strings, so "attention pooling" of the values is the records
// ranked by their weights: top_k() gives that ranking, weights the numbers.
#pragma once

#include <cstddef>
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

// Indices of the k largest weights, largest first; equal weights keep table
// order; k larger than the number of weights gives them all. k < 1 is an Error.
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
  // be empty.
  explicit KeyValueDatabase(std::vector<Record> records);

  const std::vector<Record>& records() const { return records_; }
  size_t size() const { return records_.size(); }
  // Removes the record with this key; false if there is none.
  bool remove(std::string_view key);

  // Weight 1 on the record whose key equals `query` (case-sensitive), 0
  // elsewhere; all zeros and no match if no key equals it.
  LookupResult exact(std::string_view query) const;
  // weights = masked_softmax(key_similarity(query, key_i) / temperature):
  // positive, summing to 1; a lower temperature sharpens them. temperature
  // must be finite and > 0 (else Error).
  LookupResult approximate(std::string_view query, double temperature = kDefaultTemperature) const;
  // Uniform weights 1/n: every record counts the same, whatever the query.
  LookupResult average() const;
  // One of the three by mode (temperature is used by kApproximate only).
  LookupResult lookup(std::string_view query, LookupMode mode,
                      double temperature = kDefaultTemperature) const;

 private:
  std::vector<Record> records_;
};

}  // namespace qkv
