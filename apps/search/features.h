// The learned engine's inputs: hashed word and word-bigram features of a
// text, as sparse rows (docs/search.md). A feature is a string ("w:gnuplot",
// "b:plotting program", "n:gnuplot-nox", "s:math", "t:role::program")
// hashed by XXH3-64 with a seed into one of `buckets` rows of the encoders'
// maps; a row's weights are 1/sqrt(its feature count), so every text's
// encoding has about the same scale whatever its length.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "search/corpus.h"

namespace qkv::search {

struct FeatureHashing {
  int64_t buckets = int64_t{1} << 17;
  uint64_t seed = 0;
  // Word pairs of documents' descriptions as features too (queries always
  // have them).
  bool document_pairs = true;
};

// Sparse rows in compressed-row form: row r's features are
// features[offsets[r] .. offsets[r + 1]), each bucket at most once per row
// (repeats add their weights), ascending.
struct SparseRows {
  std::vector<int64_t> offsets{0};
  std::vector<int32_t> features;
  std::vector<float> weights;
  int64_t rows() const { return static_cast<int64_t>(offsets.size()) - 1; }
  int64_t nonzeros() const { return offsets.back(); }
};

// A query's features: its words and adjacent word pairs.
SparseRows query_features(const std::vector<std::string>& queries, const FeatureHashing& hashing);

// A document's: the words and word pairs of its description, the words of
// its name, section and tags (document_text), and the whole name, section
// and each tag as one feature each.
SparseRows document_features(const std::vector<Package>& packages, const FeatureHashing& hashing);

// The same rows by column: row c of the result lists the rows of `rows` that
// have feature c, with their weights (for the backward, X^T dY, one output
// row per task: no two tasks add to the same row).
SparseRows transpose(const SparseRows& rows, int64_t columns);

// The rows `which` of `rows`, in that order (a batch of queries).
SparseRows slice(const SparseRows& rows, const std::vector<int64_t>& which);

}  // namespace qkv::search
