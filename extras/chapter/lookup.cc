// The key-value database of d2l §11.1 (qkv/lookup.h): exact lookup through
// one_hot_weights, approximate lookup through masked_softmax over n-gram
// cosine similarities, average pooling as uniform weights 1/n.
#include "qkv/lookup.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "qkv/error.h"
#include "qkv/masked_softmax.h"
#include "qkv/pooling.h"
#include "qkv/tensor.h"

namespace qkv {
namespace {

using Grams = std::map<std::string, int>;

// Counts of the padded bigrams and trigrams of the lower-cased key.
Grams ngrams(std::string_view key) {
  std::string padded = "^";
  for (const char c : key) {
    padded += (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
  }
  padded += '$';
  Grams grams;
  for (size_t n = 2; n <= 3; ++n) {
    for (size_t i = 0; i + n <= padded.size(); ++i) ++grams[padded.substr(i, n)];
  }
  return grams;
}

double norm(const Grams& grams) {
  double sum = 0;
  for (const auto& [gram, count] : grams) sum += static_cast<double>(count) * count;
  return std::sqrt(sum);
}

double cosine(const Grams& a, double norm_a, const Grams& b) {
  double dot = 0;
  for (const auto& [gram, count] : a) {
    const auto it = b.find(gram);
    if (it != b.end()) dot += static_cast<double>(count) * it->second;
  }
  // Padding gives every key at least one bigram, so neither norm is 0.
  return dot / (norm_a * norm(b));
}

std::vector<double> to_vector(ConstView<float> weights) {
  std::vector<double> out(static_cast<size_t>(weights.numel()));
  for (int64_t j = 0; j < weights.numel(); ++j) out[j] = weights(0, 0, j);
  return out;
}

}  // namespace

std::vector<size_t> top_k(const std::vector<double>& weights, int k) {
  if (k < 1) fail("top_k", "k is " + std::to_string(k) + "; expected k >= 1");
  std::vector<size_t> order(weights.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return weights[a] > weights[b]; });
  order.resize(std::min(order.size(), static_cast<size_t>(k)));
  return order;
}

double key_similarity(std::string_view a, std::string_view b) {
  const Grams ga = ngrams(a);
  return cosine(ga, norm(ga), ngrams(b));
}

std::vector<Record> KeyValueDatabase::chapter_records() {
  return {{"Zhang", "Aston"}, {"Lipton", "Zachary"}, {"Li", "Mu"},
          {"Smola", "Alex"},  {"Hu", "Rachel"},      {"Werness", "Brent"}};
}

KeyValueDatabase::KeyValueDatabase() : records_(chapter_records()) {}

KeyValueDatabase::KeyValueDatabase(std::vector<Record> records) : records_(std::move(records)) {
  for (size_t i = 0; i < records_.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (records_[i].key == records_[j].key) {
        fail("KeyValueDatabase", "key \"" + records_[i].key + "\" appears twice (records " +
                                     std::to_string(j + 1) + " and " + std::to_string(i + 1) +
                                     "); keys must be distinct");
      }
    }
  }
}

bool KeyValueDatabase::remove(std::string_view key) {
  const auto it =
      std::find_if(records_.begin(), records_.end(), [&](const Record& r) { return r.key == key; });
  if (it == records_.end()) return false;
  records_.erase(it);
  return true;
}

LookupResult KeyValueDatabase::exact(std::string_view query) const {
  LookupResult result;
  const int64_t n = static_cast<int64_t>(records_.size());
  for (int64_t j = 0; j < n; ++j) {
    if (records_[j].key == query) result.match = static_cast<size_t>(j);
  }
  if (!result.match) {
    result.weights.assign(records_.size(), 0.0);
    return result;
  }
  const Tensor<int64_t> index(Shape{1, 1},
                              std::vector<int64_t>{static_cast<int64_t>(*result.match)});
  result.weights = to_vector(one_hot_weights(index, n));
  return result;
}

LookupResult KeyValueDatabase::approximate(std::string_view query, double temperature) const {
  if (!std::isfinite(temperature) || temperature <= 0) {
    fail("KeyValueDatabase::approximate",
         "temperature is " + std::to_string(temperature) + "; expected a finite number > 0");
  }
  LookupResult result;
  const int64_t n = static_cast<int64_t>(records_.size());
  if (n == 0) return result;
  const Grams q = ngrams(query);
  const double q_norm = norm(q);
  // scores: (B=1, Nq=1, Nk=n), each similarity less the largest, then over
  // the temperature: softmax is the same for any shift, and shifted the
  // largest score is 0 however small the temperature, so a temperature as
  // small as 5e-324 (cos / T = inf, and softmax of inf is NaN) gives its
  // limit, the weight shared by the keys of the largest similarity.
  std::vector<double> similarity(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    similarity[static_cast<size_t>(j)] = cosine(q, q_norm, ngrams(records_[j].key));
  }
  const double largest = *std::max_element(similarity.begin(), similarity.end());
  Tensor<double> scores(Shape{1, 1, n});
  for (int64_t j = 0; j < n; ++j) {
    scores(0, 0, j) = (similarity[static_cast<size_t>(j)] - largest) / temperature;
  }
  const Tensor<double> weights = masked_softmax(scores.view());
  result.weights.assign(weights.data(), weights.data() + n);
  return result;
}

LookupResult KeyValueDatabase::average() const {
  LookupResult result;
  const int64_t n = static_cast<int64_t>(records_.size());
  if (n == 0) return result;
  // pooling.h's uniform_weights in double: 1/n for every record.
  result.weights.assign(records_.size(), 1.0 / static_cast<double>(n));
  return result;
}

LookupResult KeyValueDatabase::lookup(std::string_view query, LookupMode mode,
                                      double temperature) const {
  switch (mode) {
    case LookupMode::kExact:
      return exact(query);
    case LookupMode::kApproximate:
      return approximate(query, temperature);
    case LookupMode::kAverage:
      return average();
  }
  fail("KeyValueDatabase::lookup", "unknown mode");
}

}  // namespace qkv
