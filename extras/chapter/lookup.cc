// The key-value database of d2l §11.1 (qkv/lookup.h): exact lookup through
// one_hot_weights, average pooling as uniform weights 1/n, approximate lookup
// as a softmax over n-gram cosine similarities, twice: ref::approximate, a
// plain loop over every record, and KeyValueDatabase::approximate, through an
// inverted n-gram index, held to the reference bit for bit.
#include "qkv/lookup.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <string>
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

// Calls on_code(code) for each bigram and trigram of the padded, lower-cased
// key, with repeats (the n-grams of ngrams() above): 2 * key.size() + 1 of
// them. A callback rather than a vector of codes, so the index's passes
// take each code as it is made (the database of the package names built in
// 21.4 ms, not 22.6).
template <class OnCode>
void for_each_ngram(std::string_view key, OnCode on_code) {
  const size_t m = key.size() + 2;  // "^" key "$"
  const auto lower = [](char ch) -> uint32_t {
    const auto c = static_cast<unsigned char>(ch);
    return (c >= 'A' && c <= 'Z') ? c - 'A' + 'a' : c;
  };
  uint32_t a = '^', b = m == 2 ? '$' : lower(key[0]);  // the padded key's first two bytes
  on_code(kBigram | a << 8 | b);
  for (size_t i = 2; i < m; ++i) {
    const uint32_t c = i + 1 == m ? '$' : lower(key[i - 1]);
    on_code(kBigram | b << 8 | c);
    on_code(kTrigram | a << 16 | b << 8 | c);
    a = b;
    b = c;
  }
}

// n-gram code -> list number. Bigrams by a direct table of all 65,536;
// trigrams by open addressing with linear probing, at most half full. The
// 63,697 names of Debian's packages hold 2.2 million n-grams (1,495 distinct
// bigrams, 20,399 trigrams): a probe into 64 K slots of 8 bytes, in L2, costs
// a few ns, where a node-based map's allocations and pointer chases cost more
// than the rest of the index's build.
class GramTable {
 public:
  static constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

  GramTable() : bigrams_(size_t{1} << 16, kNone), slots_(size_t{1} << bits_) {}

  size_t size() const { return size_; }

  // The list of `code`, a new one (numbered size() before the call) if it had none.
  uint32_t intern(uint32_t code) {
    if (code < kTrigram) {
      uint32_t& list = bigrams_[code & 0xFFFF];
      if (list == kNone) list = static_cast<uint32_t>(size_++);
      return list;
    }
    size_t s = slot(code);
    for (; slots_[s].code != 0; s = (s + 1) & mask()) {
      if (slots_[s].code == code) return slots_[s].list;
    }
    slots_[s] = {code, static_cast<uint32_t>(size_++)};
    if (2 * ++trigrams_ > slots_.size()) grow();
    return static_cast<uint32_t>(size_ - 1);
  }

  // The list of `code`, or kNone.
  uint32_t find(uint32_t code) const {
    if (code < kTrigram) return bigrams_[code & 0xFFFF];
    for (size_t s = slot(code); slots_[s].code != 0; s = (s + 1) & mask()) {
      if (slots_[s].code == code) return slots_[s].list;
    }
    return kNone;
  }

 private:
  struct Slot {
    uint32_t code = 0;  // 0: empty
    uint32_t list = 0;
  };

  size_t mask() const { return slots_.size() - 1; }
  size_t slot(uint32_t code) const {
    return static_cast<size_t>((code * 0x9E3779B97F4A7C15ull) >> (64 - bits_));
  }
  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    ++bits_;
    for (const Slot& x : old) {
      if (x.code == 0) continue;
      size_t t = slot(x.code);
      while (slots_[t].code != 0) t = (t + 1) & mask();
      slots_[t] = x;
    }
  }

  std::vector<uint32_t> bigrams_;  // by the two bytes
  int bits_ = 12;
  std::vector<Slot> slots_;  // trigrams
  size_t size_ = 0, trigrams_ = 0;
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
// the records holding it, ascending, a record as many times as its key holds
// the n-gram (the counts that a cosine of count vectors needs; a repeat
// within a key is rare: 2% of the n-grams of Debian's package names). This
// is the GIN index of PostgreSQL's pg_trgm (n-gram -> rows); 4 bytes per
// n-gram of the keys. The lists lie end to end in one array (compressed
// sparse rows), sized by a counting pass and then filled: the 63,697 package
// names' 2.2 million postings in one allocation, not 21,894 growing vectors.
struct KeyValueDatabase::NgramIndex {
  GramTable table;
  std::vector<size_t> starts;      // list g is postings[starts[g], starts[g + 1])
  std::vector<uint32_t> postings;  // the lists, by the table's list numbers
  std::vector<double> norms;       // each record's |n-gram count vector|

  // Two passes over the keys' n-grams, record by record: the first numbers
  // the n-grams (the table's lists) and counts each list's length, the
  // second appends each record to its n-grams' lists and finds the norms.
  // O(total key length). The second pass makes the n-grams again rather
  // than keeping the first's list numbers: a 9 MB array for the package
  // names, whose page faults and traffic cost more than making them twice
  // (the database of the package names built in 22.6 ms, not 24.0). The
  // repeats that the norms need are told in the second pass, by each list's
  // cursor: telling them in the first, by counters beside the lengths, made
  // it 3.4 ms slower and the whole build 0.7 ms slower.
  explicit NgramIndex(const std::vector<Record>& records) {
    if (records.size() >= std::numeric_limits<uint32_t>::max()) {
      fail("KeyValueDatabase", "a table of " + std::to_string(records.size()) +
                                   " records; at most 4294967294 are supported");
    }
    const uint32_t n = static_cast<uint32_t>(records.size());
    std::vector<size_t> length;  // by list
    for (uint32_t r = 0; r < n; ++r) {
      for_each_ngram(records[r].key, [&](uint32_t code) {
        const uint32_t g = table.intern(code);
        if (g == length.size()) length.push_back(0);
        ++length[g];
      });
    }
    // Each list's start; then, per list, where its next record goes, its
    // last record plus 1 and how many times that record holds its n-gram.
    // Records come in ascending order, so each list comes out ascending.
    starts.resize(length.size() + 1);
    for (size_t g = 0; g < length.size(); ++g) starts[g + 1] = starts[g] + length[g];
    struct Cursor {
      size_t at;
      uint32_t last = 0, times = 0;
    };
    std::vector<Cursor> next(length.size());
    for (size_t g = 0; g < length.size(); ++g) next[g].at = starts[g];
    postings.resize(starts.back());
    norms.resize(n);
    for (uint32_t r = 0; r < n; ++r) {
      uint64_t squares = 0;  // sum of count^2: the c-th occurrence adds c^2 - (c-1)^2 = 2c - 1
      for_each_ngram(records[r].key, [&](uint32_t code) {
        Cursor& c = next[table.find(code)];
        c.times = c.last == r + 1 ? c.times + 1 : 1;
        c.last = r + 1;
        squares += 2 * uint64_t{c.times} - 1;
        postings[c.at++] = r;
      });
      // An integer below 2^53, so the reference's sum of count^2 in double is
      // this same number, and so is the norm.
      norms[r] = std::sqrt(static_cast<double>(squares));
    }
  }

  // Drops `record` from the lists and renumbers the records after it: one
  // pass over the lists, as erasing from the table moves every record after it.
  void remove(uint32_t record) {
    size_t out = 0, begin = 0;
    for (size_t g = 0; g + 1 < starts.size(); ++g) {
      const size_t end = starts[g + 1];
      starts[g] = out;
      for (size_t p = begin; p < end; ++p) {
        const uint32_t r = postings[p];
        if (r != record) postings[out++] = r - (r > record);
      }
      begin = end;
    }
    starts.back() = out;
    postings.resize(out);
    norms.erase(norms.begin() + record);
  }

  // The cosine of the query with every record that shares an n-gram with it:
  // the dot products accumulated list by list over the query's n-grams (whole
  // numbers, exact), then one division per candidate as the reference divides.
  Candidates candidates(std::string_view query) const {
    std::vector<uint32_t> codes;
    codes.reserve(2 * query.size() + 1);
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
        for (size_t p = starts[g]; p < starts[g + 1]; ++p) dot[postings[p]] += count;
      }
      i = j;
    }
    const double query_norm = std::sqrt(static_cast<double>(squares));
    // One pass over a counter per record finds the candidates in table order
    // (0.5 MB at 63,697 records: less than sorting the records touched).
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
  // Keys by hash, open addressing at most half full: a node-based map spent
  // 12 ms on the allocations of 63,697 nodes.
  const size_t slots = std::bit_ceil(2 * records_.size() + 1);
  std::vector<size_t> first(slots, 0);  // record + 1, 0 for an empty slot
  for (size_t i = 0; i < records_.size(); ++i) {
    const std::string& key = records_[i].key;
    size_t s = std::hash<std::string_view>()(key) & (slots - 1);
    for (; first[s] != 0; s = (s + 1) & (slots - 1)) {
      if (records_[first[s] - 1].key == key) {
        fail("KeyValueDatabase", "key \"" + key + "\" appears twice (records " +
                                     std::to_string(first[s]) + " and " + std::to_string(i + 1) +
                                     "); keys must be distinct");
      }
    }
    first[s] = i + 1;
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
      check_temperature("KeyValueDatabase::top", temperature);
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
