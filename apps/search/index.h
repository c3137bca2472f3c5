// A search index on disk (`qkv search index`): a directory made whole or not
// at all (StagedDirectory), holding
//   manifest.json    format, the training's parameters and figures, the
//                    sections, the hybrid's fusion and weight, each file's XXH3-64
//   packages.json    per document: name, short description, section, held out
//   query_map.npy    the query encoder's map (buckets, d), float32
//   doc_map.npy      the document encoder's map (buckets, d), float32
//   documents/       a key-value store (qkv/store.h), bfloat16: keys the document
//                    encodings (N, d), values each document's section one-hot
//                    (N, S), so a query's attention-pooled value is how its
//                    weight spreads over the sections
//   bm25.sqlite      the BM25 baseline (bm25.h)
// Opening checks the manifest, every checksum and the store; a missing or
// altered file is an Error naming it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/store.h"
#include "qkv/tensor.h"
#include "search/bm25.h"
#include "search/corpus.h"
#include "search/index_files.h"
#include "search/metrics.h"
#include "search/train.h"

namespace qkv::search {

// Progress of index building: what is being done ("training"), done, total.
using BuildProgress = std::function<void(std::string_view, int64_t, int64_t)>;

struct Ranking {
  std::vector<Hit> hits;  // best first; score: the learned engine's softmax weight over every
                          // document, BM25's score, or the hybrid's mixed score
  std::vector<std::pair<std::string, double>> sections;  // learned: the pooled value, largest first
};

struct Evaluation {
  Metrics bm25, learned, hybrid;
  // Milliseconds per query, the median over the held-out queries, one query at a time.
  double bm25_ms = 0.0, learned_ms = 0.0, hybrid_ms = 0.0;
  // Bm25::search (FTS5's formula over FTS5's own postings) against FTS5's
  // own query (Bm25::search_fts5) on the first held-out queries: how many
  // were compared, how many gave the same top 10, and FTS5's median time.
  int64_t fts5_compared = 0, fts5_same = 0;
  double fts5_ms = 0.0;
};

class SearchIndex {
 public:
  // Trains the encoders on the training split's queries (held_out() false)
  // and writes the index at `dir`, which must not exist.
  static void build(const std::string& dir, const std::vector<Package>& packages,
                    const TrainOptions& options, const BuildProgress& progress = {});
  static SearchIndex open(const std::string& dir);

  // The top `k` documents for free text `query`: by attention over every
  // document (learned), by BM25, or by the hybrid (BM25's top 100 and the
  // learned top 100, their scores or ranks mixed as the validation queries
  // chose: index.cc's Fusion).
  Ranking learned(std::string_view query, int64_t k) const;
  Ranking bm25(std::string_view query, int64_t k) const;
  Ranking hybrid(std::string_view query, int64_t k) const;

  // The three engines on the held-out queries (`progress`: queries done).
  Evaluation evaluate(const BuildProgress& progress = {}) const;

  // The query encoder's encodings of `queries` (Nq, d): what the learned
  // engine attends with (before its score scale).
  Tensor<float> encode_queries(const std::vector<std::string>& queries) const;

  const std::vector<IndexedPackage>& packages() const { return packages_; }
  const std::string& manifest_text() const { return manifest_text_; }

 private:
  SearchIndex() = default;

  std::string dir_, manifest_text_;
  std::vector<IndexedPackage> packages_;
  std::vector<std::string> sections_;
  FeatureHashing hashing_;
  double score_scale_ = 1.0, hybrid_weight_ = 1.0;
  int hybrid_fusion_ = 0;  // index.cc's Fusion
  Tensor<float> query_map_;
  std::shared_ptr<const KeyValueStore> documents_;
  std::shared_ptr<const Bm25> bm25_;
};

}  // namespace qkv::search
