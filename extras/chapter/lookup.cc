// The key-value database of d2l §11.1 (qkv/lookup.h): exact lookup through
// one_hot_weights, average pooling as uniform weights 1/n, approximate lookup
// as a softmax over n-gram cosine similarities, twice: ref::approximate, a
// plain loop over every record, and KeyValueDatabase::approximate, through an
// inverted n-gram index, held to the reference bit for bit.
#include "qkv/lookup.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <unordered_map>
#include <vector>

#include "qkv/error.h"
#include "qkv/pooling.h"
#include "qkv/tensor.h"

namespace qkv {
namespace {

// ---- the definition: n-gram counts and their cosine (the reference's) -------

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

// ---- the softmax's normaliser -------------------------------------------------

// A sum of doubles rounded once, to the double nearest the exact sum (ties to
// even), whatever the order of the terms: Shewchuk's non-overlapping partials
// with the final rounding of Python's math.fsum. The reference sums every
// record's exponential in table order, the index the candidates' and then the
// shared exponential of all others times their count; rounded once, the two
// sums of the same numbers are the same double. Exact while no partial
// overflows (here every term is <= 1).
class RoundedSum {
 public:
  void add(double x) {
    size_t kept = 0;
    for (double y : partials_) {
      if (std::fabs(x) < std::fabs(y)) std::swap(x, y);
      const double hi = x + y;
      const double lo = y - (hi - x);  // exact: the error of hi
      if (lo != 0.0) partials_[kept++] = lo;
      x = hi;
    }
    partials_.resize(kept);
    partials_.push_back(x);
  }
  // count * x exactly, as the sum of x * 2^b over the bits b of count (each
  // term exact: a power of two scales without rounding, x <= 1 here).
  void add_times(double x, uint64_t count) {
    for (int b = 0; count != 0; ++b, count >>= 1) {
      if (count & 1) add(std::ldexp(x, b));
    }
  }
  double value() const {
    size_t n = partials_.size();
    if (n == 0) return 0.0;
    double hi = partials_[--n], lo = 0.0;
    // Add the partials from the largest until a sum is inexact.
    while (n > 0) {
      const double x = hi, y = partials_[--n];
      hi = x + y;
      lo = y - (hi - x);
      if (lo != 0.0) break;
    }
    // Round half-even across partials: when the rest of the sum lies on the
    // same side as lo, lo is not exactly half an ulp and hi rounds past it.
    if (n > 0 && ((lo < 0.0 && partials_[n - 1] < 0.0) || (lo > 0.0 && partials_[n - 1] > 0.0))) {
      const double y = lo * 2.0, x = hi + y;
      if (y == x - hi) hi = x;
    }
    return hi;
  }

 private:
  std::vector<double> partials_;  // increasing magnitude, non-overlapping
};

void check_temperature(std::string_view function, double temperature) {
  if (!std::isfinite(temperature) || temperature <= 0) {
    fail(function,
         "temperature is " + std::to_string(temperature) + "; expected a finite number > 0");
  }
}

void check_k(std::string_view function, int k) {
  if (k < 1) fail(function, "k is " + std::to_string(k) + "; expected k >= 1");
}

// Orders records best first: larger weight, then smaller index (table order).
struct Better {
  bool operator()(const Ranked& a, const Ranked& b) const {
    return a.weight > b.weight || (a.weight == b.weight && a.index < b.index);
  }
};

std::vector<double> to_vector(ConstView<float> weights) {
  std::vector<double> out(static_cast<size_t>(weights.numel()));
  for (int64_t j = 0; j < weights.numel(); ++j) out[j] = weights(0, 0, j);
  return out;
}

// ---- the index's n-grams ------------------------------------------------------

// An n-gram as a number: its length in bits 24-25, its bytes below, so a
// bigram and a trigram never share a code and no code is 0.
constexpr uint32_t kBigram = 2u << 24, kTrigram = 3u << 24;

// Calls f(code) for each bigram and trigram of the padded, lower-cased key,
// with repeats: the n-grams of ngrams() above, as codes.
template <class F>
void for_each_ngram(std::string_view key, F&& f) {
  const size_t m = key.size() + 2;  // "^" key "$"
  const auto byte = [&](size_t i) -> uint32_t {
    if (i == 0) return '^';
    if (i == m - 1) return '$';
    const auto c = static_cast<unsigned char>(key[i - 1]);
    return (c >= 'A' && c <= 'Z') ? c - 'A' + 'a' : c;
  };
  uint32_t a = byte(0), b = byte(1);
  f(kBigram | a << 8 | b);
  for (size_t i = 2; i < m; ++i) {
    const uint32_t c = byte(i);
    f(kBigram | b << 8 | c);
    f(kTrigram | a << 16 | b << 8 | c);
    a = b;
    b = c;
  }
}

// n-gram code -> list number: open addressing with linear probing, at most
// half full. 63,666 package names hold ~45,000 distinct n-grams, and 2.6
// million n-grams are looked up to build the index: a probe into 64 K slots
// of 8 bytes (in L2) instead of a node-based map's allocation and pointer
// chase.
class GramTable {
 public:
  static constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

  GramTable() : codes_(size_t{1} << bits_, 0), lists_(size_t{1} << bits_) {}

  size_t size() const { return size_; }

  // The list of `code`, a new one (numbered size() before the call) if it had none.
  uint32_t intern(uint32_t code) {
    size_t s = slot(code);
    for (; codes_[s] != 0; s = (s + 1) & mask()) {
      if (codes_[s] == code) return lists_[s];
    }
    codes_[s] = code;
    lists_[s] = static_cast<uint32_t>(size_++);
    if (2 * size_ > codes_.size()) grow();
    return static_cast<uint32_t>(size_ - 1);
  }

  // The list of `code`, or kNone.
  uint32_t find(uint32_t code) const {
    for (size_t s = slot(code); codes_[s] != 0; s = (s + 1) & mask()) {
      if (codes_[s] == code) return lists_[s];
    }
    return kNone;
  }

 private:
  size_t mask() const { return codes_.size() - 1; }
  size_t slot(uint32_t code) const {
    return static_cast<size_t>((code * 0x9E3779B97F4A7C15ull) >> (64 - bits_));
  }
  void grow() {
    std::vector<uint32_t> codes(codes_.size() * 2, 0), lists(codes_.size() * 2);
    codes.swap(codes_);
    lists.swap(lists_);
    ++bits_;
    for (size_t s = 0; s < codes.size(); ++s) {
      if (codes[s] == 0) continue;
      size_t t = slot(codes[s]);
      while (codes_[t] != 0) t = (t + 1) & mask();
      codes_[t] = codes[s];
      lists_[t] = lists[s];
    }
  }

  int bits_ = 10;
  std::vector<uint32_t> codes_;  // 0: an empty slot
  std::vector<uint32_t> lists_;
  size_t size_ = 0;
};

// One query's similarities as the index finds them: the records sharing an
// n-gram with the query (ascending) and their cosines; every other record's
// is 0.
struct Candidates {
  std::vector<uint32_t> records;
  std::vector<double> cosines;
};

// One query's weights: the candidates', and one weight for all the others.
struct SparseWeights {
  std::vector<uint32_t> records;  // ascending
  std::vector<double> weights;
  double rest = 0;  // the weight of every record not in `records`
};

}  // namespace

// ---- the inverted n-gram index ------------------------------------------------

// For each n-gram (bigram or trigram) that some key holds, its posting list:
// the records holding it, ascending, each with its count. This is the GIN
// index of PostgreSQL's pg_trgm (n-gram -> rows), with the counts that a
// cosine of count vectors needs. Stored as one array of postings cut into
// lists by offsets; ~2.5 postings per key byte.
struct KeyValueDatabase::NgramIndex {
  struct Posting {
    uint32_t record;
    uint32_t count;
  };

  GramTable table;
  std::vector<size_t> offsets;    // list g: postings[offsets[g], offsets[g + 1])
  std::vector<Posting> postings;  // records ascending within a list
  std::vector<double> norms;      // each record's |n-gram count vector|

  // Two passes over the keys' n-grams: count each list's distinct records,
  // then place the postings, counting repeats in place. O(total key length).
  explicit NgramIndex(const std::vector<Record>& records) {
    if (records.size() >= std::numeric_limits<uint32_t>::max()) {
      fail("KeyValueDatabase", "a table of " + std::to_string(records.size()) +
                                   " records; at most 4294967294 are supported");
    }
    const uint32_t n = static_cast<uint32_t>(records.size());
    std::vector<uint32_t> lists;  // each key's n-grams' lists, concatenated
    std::vector<size_t> first(size_t{n} + 1, 0);
    std::vector<uint32_t> seen;  // per list: the last record counted in it, plus 1
    std::vector<size_t> length;  // per list: its distinct records
    for (uint32_t r = 0; r < n; ++r) {
      first[r] = lists.size();
      for_each_ngram(records[r].key, [&](uint32_t code) {
        const uint32_t g = table.intern(code);
        if (g == seen.size()) {
          seen.push_back(0);
          length.push_back(0);
        }
        lists.push_back(g);
        if (seen[g] != r + 1) {
          seen[g] = r + 1;
          ++length[g];
        }
      });
    }
    first[n] = lists.size();
    offsets.assign(length.size() + 1, 0);
    std::partial_sum(length.begin(), length.end(), offsets.begin() + 1);
    postings.resize(offsets.back());
    std::vector<size_t> end(offsets.begin(), offsets.end() - 1);  // each list's next posting
    std::fill(seen.begin(), seen.end(), 0);
    norms.resize(n);
    for (uint32_t r = 0; r < n; ++r) {
      uint64_t squares = 0;  // sum of count^2: (c + 1)^2 - c^2 = 2c + 1 per repeat
      for (size_t i = first[r]; i < first[r + 1]; ++i) {
        const uint32_t g = lists[i];
        if (seen[g] != r + 1) {
          seen[g] = r + 1;
          postings[end[g]++] = {r, 1};
          squares += 1;
        } else {
          uint32_t& count = postings[end[g] - 1].count;
          squares += 2 * uint64_t{count} + 1;
          ++count;
        }
      }
      // An integer below 2^53, so the reference's sum of count^2 in double is
      // this same number, and so is the norm.
      norms[r] = std::sqrt(static_cast<double>(squares));
    }
  }

  // Drops the postings of `record` and renumbers the records after it: one
  // pass over the postings, as erasing from the table moves every record after it.
  void remove(uint32_t record) {
    size_t out = 0, begin = offsets[0];
    for (size_t g = 0; g + 1 < offsets.size(); ++g) {
      const size_t end = offsets[g + 1];
      offsets[g] = out;
      for (size_t i = begin; i < end; ++i) {
        const Posting p = postings[i];
        if (p.record != record) postings[out++] = {p.record - (p.record > record), p.count};
      }
      begin = end;
    }
    offsets.back() = out;
    postings.resize(out);
    norms.erase(norms.begin() + record);
  }

  // The cosine of the query with every record that shares an n-gram with it:
  // the dot products accumulated list by list over the query's n-grams (whole
  // numbers, exact), then one division per candidate as the reference divides.
  Candidates candidates(std::string_view query) const {
    std::vector<uint32_t> codes;
    for_each_ngram(query, [&](uint32_t code) { codes.push_back(code); });
    std::sort(codes.begin(), codes.end());
    const size_t n = norms.size();
    std::vector<uint64_t> dot(n, 0);
    uint64_t squares = 0;
    for (size_t i = 0; i < codes.size();) {
      size_t j = i + 1;
      while (j < codes.size() && codes[j] == codes[i]) ++j;
      const uint64_t count = j - i;
      squares += count * count;
      if (const uint32_t g = table.find(codes[i]); g != GramTable::kNone) {
        for (size_t p = offsets[g]; p < offsets[g + 1]; ++p) {
          dot[postings[p].record] += count * postings[p].count;
        }
      }
      i = j;
    }
    const double query_norm = std::sqrt(static_cast<double>(squares));
    // One pass over a counter per record finds the candidates in table order
    // (at 63,666 records, ~40 us: less than sorting the touched ones).
    Candidates out;
    for (size_t r = 0; r < n; ++r) {
      if (dot[r] == 0) continue;
      out.records.push_back(static_cast<uint32_t>(r));
      out.cosines.push_back(static_cast<double>(dot[r]) / (query_norm * norms[r]));
    }
    return out;
  }
};

namespace {

// softmax(cosine / T) over n records from the candidates' cosines, every
// other record's being 0: the steps of ref::approximate, the n - |C| equal
// terms of its normaliser added as one exact product.
SparseWeights softmax(const Candidates& c, size_t n, double temperature) {
  SparseWeights out;
  out.records = c.records;
  const size_t others = n - c.records.size();
  double largest = others > 0 ? 0.0 : -std::numeric_limits<double>::infinity();
  for (const double s : c.cosines) largest = std::max(largest, s);
  RoundedSum sum;
  out.weights.resize(c.cosines.size());
  for (size_t i = 0; i < c.cosines.size(); ++i) {
    out.weights[i] = std::exp((c.cosines[i] - largest) / temperature);
    sum.add(out.weights[i]);
  }
  const double rest = std::exp((0.0 - largest) / temperature);
  sum.add_times(rest, others);
  const double total = sum.value();
  for (double& w : out.weights) w /= total;
  out.rest = rest / total;
  return out;
}

// The k best of n records by weight (Better's order): the candidates' best k
// by a partial sort, merged with the others, which all weigh `rest` and come
// in table order.
std::vector<Ranked> top_of(const SparseWeights& w, size_t n, int k) {
  std::vector<Ranked> best(w.records.size());
  for (size_t i = 0; i < best.size(); ++i) best[i] = {w.records[i], w.weights[i]};
  const size_t kk = static_cast<size_t>(k);
  const size_t m = std::min(kk, best.size());
  std::partial_sort(best.begin(), best.begin() + static_cast<std::ptrdiff_t>(m), best.end(),
                    Better());
  std::vector<Ranked> out;
  size_t i = 0, next = 0, skip = 0;  // next: the next other record; skip: into w.records
  const auto advance = [&] {         // moves `next` past the candidates
    while (skip < w.records.size() && w.records[skip] == next) ++skip, ++next;
  };
  advance();
  while (out.size() < kk && (i < m || next < n)) {
    const Ranked other{next, w.rest};
    if (i < m && (next >= n || Better()(best[i], other))) {
      out.push_back(best[i++]);
    } else {
      out.push_back(other);
      ++next;
      advance();
    }
  }
  return out;
}

}  // namespace

std::vector<size_t> top_k(const std::vector<double>& weights, int k) {
  check_k("top_k", k);
  std::vector<size_t> order(weights.size());
  std::iota(order.begin(), order.end(), size_t{0});
  const auto m = static_cast<std::ptrdiff_t>(std::min(order.size(), static_cast<size_t>(k)));
  std::partial_sort(order.begin(), order.begin() + m, order.end(), [&](size_t a, size_t b) {
    return Better()({a, weights[a]}, {b, weights[b]});
  });
  order.resize(static_cast<size_t>(m));
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

KeyValueDatabase::KeyValueDatabase() : KeyValueDatabase(chapter_records()) {}

KeyValueDatabase::KeyValueDatabase(std::vector<Record> records) : records_(std::move(records)) {
  std::unordered_map<std::string_view, size_t> first;  // key -> its first record
  first.reserve(records_.size());
  for (size_t i = 0; i < records_.size(); ++i) {
    const auto [it, added] = first.emplace(records_[i].key, i);
    if (!added) {
      fail("KeyValueDatabase", "key \"" + records_[i].key + "\" appears twice (records " +
                                   std::to_string(it->second + 1) + " and " +
                                   std::to_string(i + 1) + "); keys must be distinct");
    }
  }
  index_ = std::make_unique<NgramIndex>(records_);
}

KeyValueDatabase::KeyValueDatabase(const KeyValueDatabase& other)
    : records_(other.records_),
      index_(other.index_ ? std::make_unique<NgramIndex>(*other.index_) : nullptr) {}
KeyValueDatabase::KeyValueDatabase(KeyValueDatabase&& other) noexcept = default;
KeyValueDatabase& KeyValueDatabase::operator=(const KeyValueDatabase& other) {
  if (this != &other) *this = KeyValueDatabase(other);
  return *this;
}
KeyValueDatabase& KeyValueDatabase::operator=(KeyValueDatabase&& other) noexcept = default;
KeyValueDatabase::~KeyValueDatabase() = default;

bool KeyValueDatabase::remove(std::string_view key) {
  const auto it =
      std::find_if(records_.begin(), records_.end(), [&](const Record& r) { return r.key == key; });
  if (it == records_.end()) return false;
  index_->remove(static_cast<uint32_t>(it - records_.begin()));
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
  check_temperature("KeyValueDatabase::approximate", temperature);
  LookupResult result;
  if (records_.empty()) return result;
  const SparseWeights w = softmax(index_->candidates(query), records_.size(), temperature);
  result.weights.assign(records_.size(), w.rest);
  for (size_t i = 0; i < w.records.size(); ++i) result.weights[w.records[i]] = w.weights[i];
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

TopK KeyValueDatabase::top(std::string_view query, LookupMode mode, int k,
                           double temperature) const {
  check_k("KeyValueDatabase::top", k);
  const size_t n = records_.size();
  TopK result;
  switch (mode) {
    case LookupMode::kExact: {
      // One weight 1 (the match, if any), then zeros in table order.
      SparseWeights w;
      for (size_t j = 0; j < n; ++j) {
        if (records_[j].key == query) result.match = j;
      }
      if (result.match) {
        w.records = {static_cast<uint32_t>(*result.match)};
        w.weights = {1.0};
      }
      result.records = top_of(w, n, k);
      return result;
    }
    case LookupMode::kApproximate:
      check_temperature("KeyValueDatabase::approximate", temperature);
      if (n == 0) return result;
      result.records = top_of(softmax(index_->candidates(query), n, temperature), n, k);
      return result;
    case LookupMode::kAverage: {
      SparseWeights w;
      if (n > 0) w.rest = 1.0 / static_cast<double>(n);
      result.records = top_of(w, n, k);
      return result;
    }
  }
  fail("KeyValueDatabase::top", "unknown mode");
}

namespace ref {

// similarity: (Nk) for one query; weights: (Nk), each similarity less the
// largest, then over the temperature: softmax is the same for any shift, and
// shifted the largest score is 0 however small the temperature, so a
// temperature as small as 5e-324 (cos / T = inf, and softmax of inf is NaN)
// gives its limit, the weight shared by the keys of the largest similarity.
LookupResult approximate(const KeyValueDatabase& db, std::string_view query, double temperature) {
  check_temperature("ref::approximate", temperature);
  LookupResult result;
  const std::vector<Record>& records = db.records();
  const size_t n = records.size();
  if (n == 0) return result;
  const Grams q = ngrams(query);
  const double q_norm = norm(q);
  std::vector<double> similarity(n);
  for (size_t j = 0; j < n; ++j) similarity[j] = cosine(q, q_norm, ngrams(records[j].key));
  const double largest = *std::max_element(similarity.begin(), similarity.end());
  result.weights.resize(n);
  RoundedSum sum;
  for (size_t j = 0; j < n; ++j) {
    result.weights[j] = std::exp((similarity[j] - largest) / temperature);
    sum.add(result.weights[j]);
  }
  const double total = sum.value();
  for (double& w : result.weights) w /= total;
  return result;
}

}  // namespace ref

}  // namespace qkv
