// A search index on disk (`qkv search index`): a directory made whole or not
// at all (StagedDirectory), holding
//   manifest.json    format, the build's parameters and figures, the
//                    sections, the hybrid's fusion and weight, each file's
//                    XXH3-64 (checked by verify(), not by open())
//   packages.json    per document: name, short description, section, held out
//   model/           the sentence encoder (transformer.h), copied from the
//                    model directory the index was built with: config.json,
//                    1_Pooling/config.json, sentence_bert_config.json,
//                    vocab.txt, model.safetensors
//   query_head.npy   the head's query map W_q (d, d), float32 (head.h)
//   documents/       a key-value store (qkv/store.h), bfloat16: keys the
//                    documents' encodings W_d e(document) (N, d), values each
//                    document's section one-hot (N, S), so a query's
//                    attention-pooled value is how its weight spreads over
//                    the sections
//   bm25.sqlite      the BM25 baseline (bm25.h)
// Opening reads the manifest (its own checksum checked), packages.json and
// the store's manifest, and maps the model; the rest is read as queries
// need it, so a query from a fresh process does not read 150 MB first.
// verify() checks every file's checksum and the store's chunks.
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
#include "search/head.h"
#include "search/index_files.h"
#include "search/metrics.h"
#include "search/transformer.h"

namespace qkv::search {

// Progress of index building: what is being done ("encoding documents"),
// done, total (0: a stage without a count).
using BuildProgress = std::function<void(std::string_view, int64_t, int64_t)>;

struct IndexOptions {
  std::string model;  // the sentence encoder's directory (scripts/model-dir.sh)
  // Where a document's text is cut, in tokens. With the head's 2 epochs,
  // 64 gave held-out MRR@10 0.733 (hybrid) and 0.659 (learned) in a build
  // of 13.5 minutes on 2 cores; 128 with 4 epochs 0.741 and 0.684 in about
  // 21 (docs/search.md), past the 15 a build may take.
  int64_t document_tokens = 64;
  HeadOptions head;
};

// The least similarity (qkv/lookup.h's key_similarity, the cosine of
// character bigram and trigram counts) of an unknown word to the name that
// replaces it: one typo in a name of 6 or more letters scores 0.67 to 0.86
// ("gnuplt" and gnuplot 0.72), an unrelated name 0.4 or less.
inline constexpr double kCorrectionSimilarity = 0.6;

// Where a query's text is cut: the short descriptions the head is trained
// on have at most 40 tokens but for a few dozen of 63,681.
inline constexpr int64_t kQueryTokens = 64;

enum class Engine { kHybrid, kLearned, kBm25 };
// "hybrid", "learned", "bm25"; parse_engine: Error naming `function` and the text otherwise.
const char* engine_name(Engine engine);
Engine parse_engine(std::string_view text, std::string_view function);

struct Ranking {
  // The query as the engines ran it, if a word of it was corrected (below);
  // empty otherwise.
  std::string corrected;
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
  // Encodes every package's document and the training and validation
  // queries with the sentence encoder at options.model, trains the head on
  // the training split's queries (held_out() false), stopping early on the
  // validation split's, and writes the index at `dir`, which must not exist.
  static void build(const std::string& dir, const std::vector<Package>& packages,
                    const IndexOptions& options, const BuildProgress& progress = {});
  static SearchIndex open(const std::string& dir);

  // Every file against the manifest's checksum and the documents' store
  // (KeyValueStore::verify); Error naming the first file that differs.
  void verify() const;

  // The top `k` documents for free text `query`: by attention over every
  // document (learned), by BM25, or by the hybrid (BM25's top 100 and the
  // learned top 100, their scores or ranks mixed as the validation queries
  // chose: index.cc's Fusion). BM25 is FTS5's ranking as it is (the
  // baseline); in the other two a package whose name is the whole query
  // (ignoring case and the spaces around it) comes first, and a word
  // of 4 or more letters that no document has ("gnuplt") is first replaced
  // by the package name nearest to it by character n-grams (qkv lookup's
  // approximate key matching, qkv/lookup.h), if their similarity is at
  // least kCorrectionSimilarity; Ranking::corrected then says so.
  Ranking learned(std::string_view query, int64_t k) const;
  Ranking bm25(std::string_view query, int64_t k) const;
  Ranking hybrid(std::string_view query, int64_t k) const;

  // The same for many queries: rankings[i] is queries[i]'s (no hits for a
  // query without words, sections only from the learned engine). The
  // queries are encoded in batches and attend over the documents together,
  // so the documents are read once per 256 queries, not once per query.
  std::vector<Ranking> search(const std::vector<std::string>& queries, Engine engine,
                              int64_t k) const;

  // The three engines on the held-out queries (`progress`: queries done).
  Evaluation evaluate(const BuildProgress& progress = {}) const;

  // The head's encodings of `queries` (Nq, d), W_q e(query): what the
  // learned engine attends with (before its score scale).
  Tensor<float> encode_queries(const std::vector<std::string>& queries) const;

  const std::vector<IndexedPackage>& packages() const { return packages_; }
  const std::string& manifest_text() const { return manifest_text_; }

 private:
  SearchIndex() = default;
  std::string path(const std::string& name) const;
  // The package named by the whole of `query`, or -1.
  int64_t named(std::string_view query) const;
  // `query` with each unknown word replaced by the nearest name (above), or
  // "" if none was.
  std::string corrected(const std::string& query) const;
  // The package names as a lookup table, made when a query first needs it.
  struct Names;

  std::string dir_, manifest_text_;
  IndexManifest manifest_;
  std::vector<IndexedPackage> packages_;
  std::shared_ptr<const SentenceEncoder> encoder_;
  Tensor<float> query_weight_;
  std::shared_ptr<const KeyValueStore> documents_;
  std::shared_ptr<const Bm25> bm25_;
  std::shared_ptr<Names> names_;
};

}  // namespace qkv::search
