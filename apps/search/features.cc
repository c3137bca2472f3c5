#include "search/features.h"

#include <algorithm>
#include <cmath>
#include <string_view>
#include <utility>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace qkv::search {
namespace {

// Collects one row's features, then merges repeats and weighs them.
class RowBuilder {
 public:
  RowBuilder(const FeatureHashing& hashing, SparseRows& out) : hashing_(hashing), out_(out) {}

  void add(std::string_view kind, std::string_view text) {
    key_.assign(kind);
    key_ += text;
    const uint64_t h = XXH3_64bits_withSeed(key_.data(), key_.size(), hashing_.seed);
    buckets_.push_back(static_cast<int32_t>(h % static_cast<uint64_t>(hashing_.buckets)));
  }
  void add_words(const std::vector<std::string>& ws, bool pairs) {
    for (const std::string& w : ws) add("w:", w);
    if (!pairs) return;
    for (size_t i = 1; i < ws.size(); ++i) add("b:", ws[i - 1] + ' ' + ws[i]);
  }
  void finish() {
    std::sort(buckets_.begin(), buckets_.end());
    const float weight = buckets_.empty() ? 0.0f : 1.0f / std::sqrt(static_cast<float>(buckets_.size()));
    for (size_t i = 0; i < buckets_.size();) {
      size_t j = i;
      while (j < buckets_.size() && buckets_[j] == buckets_[i]) ++j;
      out_.features.push_back(buckets_[i]);
      out_.weights.push_back(weight * static_cast<float>(j - i));
      i = j;
    }
    out_.offsets.push_back(static_cast<int64_t>(out_.features.size()));
    buckets_.clear();
  }

 private:
  const FeatureHashing& hashing_;
  SparseRows& out_;
  std::string key_;
  std::vector<int32_t> buckets_;
};

}  // namespace

SparseRows query_features(const std::vector<std::string>& queries, const FeatureHashing& hashing) {
  SparseRows out;
  RowBuilder row(hashing, out);
  for (const std::string& q : queries) {
    row.add_words(words(q), /*pairs=*/true);
    row.finish();
  }
  return out;
}

SparseRows document_features(const std::vector<Package>& packages, const FeatureHashing& hashing) {
  SparseRows out;
  RowBuilder row(hashing, out);
  for (const Package& p : packages) {
    const DocumentText text = document_text(p);
    row.add_words(words(text.name), /*pairs=*/false);
    row.add_words(words(text.description), hashing.document_pairs);
    row.add_words(words(text.section), /*pairs=*/false);
    row.add_words(words(text.tags), /*pairs=*/false);
    row.add("n:", p.name);
    row.add("s:", p.section);
    for (const std::string& tag : p.tags) row.add("t:", tag);
    row.finish();
  }
  return out;
}

SparseRows transpose(const SparseRows& rows, int64_t columns) {
  SparseRows out;
  out.offsets.assign(static_cast<size_t>(columns + 1), 0);
  for (const int32_t c : rows.features) ++out.offsets[static_cast<size_t>(c) + 1];
  for (int64_t c = 0; c < columns; ++c) out.offsets[c + 1] += out.offsets[c];
  out.features.resize(rows.features.size());
  out.weights.resize(rows.weights.size());
  std::vector<int64_t> next(out.offsets.begin(), out.offsets.end() - 1);
  for (int64_t r = 0; r < rows.rows(); ++r) {  // rows ascending within each column
    for (int64_t e = rows.offsets[r]; e < rows.offsets[r + 1]; ++e) {
      const int64_t at = next[rows.features[e]]++;
      out.features[at] = static_cast<int32_t>(r);
      out.weights[at] = rows.weights[e];
    }
  }
  return out;
}

SparseRows slice(const SparseRows& rows, const std::vector<int64_t>& which) {
  SparseRows out;
  for (const int64_t r : which) {
    out.features.insert(out.features.end(), rows.features.begin() + rows.offsets[r],
                        rows.features.begin() + rows.offsets[r + 1]);
    out.weights.insert(out.weights.end(), rows.weights.begin() + rows.offsets[r],
                       rows.weights.begin() + rows.offsets[r + 1]);
    out.offsets.push_back(static_cast<int64_t>(out.features.size()));
  }
  return out;
}

}  // namespace qkv::search
