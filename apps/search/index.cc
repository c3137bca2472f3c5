#include "search/index.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <unordered_map>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "qkv/error.h"
#include "qkv/npy.h"
#include "qkv/staged_file.h"
#include "qkv/store_attention.h"
#include "search/encoder.h"

namespace qkv::search {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

// Errors of build and open, and of their file helpers; the command adds
// its own prefix ("qkv search: error: ").
constexpr std::string_view kBuild = "SearchIndex::build", kFn = "SearchIndex::open";
// Held-out queries on which evaluate() holds Bm25::search to FTS5's own
// query (which takes 100-150 ms each on the full corpus).
constexpr size_t kFts5Checks = 200;
// The hybrid's candidates: each engine's top 100.
constexpr int64_t kCandidates = 100;

std::string read_file(const std::string& path) {
  // Checked before it is opened: a FIFO would block the open, and a device
  // such as /dev/zero would be read until memory runs out.
  std::error_code error;
  const fs::file_status status = fs::status(path, error);
  if (fs::exists(status) && !fs::is_regular_file(status)) {
    fail(kFn, path + ": not a regular file (" +
                  (fs::is_directory(status) ? "a directory"
                   : fs::is_fifo(status)    ? "a FIFO"
                                            : "a special file") +
                  "); an index's files are regular files (build the index again)");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(kFn, path + ": missing or unreadable (the index is incomplete; build it again)");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string hex64(uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

uint64_t file_xxh3(const std::string& path) {
  const std::string bytes = read_file(path);
  return XXH3_64bits(bytes.data(), bytes.size());
}

void write_text(const std::string& path, const std::string& text) {
  StagedFile out(kBuild, "", path);
  out.write(text);
  out.commit();
}

double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double median(std::vector<double> x) {
  if (x.empty()) return 0.0;
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

// The hybrid's candidates: BM25's top 100 and the learned top 100, each
// with its BM25 score (0 where BM25 did not return it), its learned logit,
// and its rank in each list (0: not in it).
struct Candidates {
  std::vector<int64_t> docs;
  std::vector<double> bm25, logits;
  std::vector<int64_t> bm25_rank, learned_rank;
};

// How the hybrid mixes the two engines' evidence about a candidate; the
// validation queries choose one and its weight w.
enum class Fusion {
  kLinear,      // w bm25 + logit
  kNormalized,  // w bm25 / (the query's best bm25) + (logit - the query's best logit)
  kRanks,       // reciprocal rank fusion: w / (60 + BM25's rank) + 1 / (60 + the learned rank)
};

struct Hybrid {
  Fusion fusion = Fusion::kLinear;
  double weight = 1.0;
};

std::vector<Hit> mix(const Candidates& c, const Hybrid& h, int64_t k) {
  double best_bm25 = 0.0, best_logit = -INFINITY;
  for (size_t i = 0; i < c.docs.size(); ++i) {
    best_bm25 = std::max(best_bm25, c.bm25[i]);
    best_logit = std::max(best_logit, c.logits[i]);
  }
  const auto reciprocal = [](int64_t rank) { return rank > 0 ? 1.0 / (60.0 + double(rank)) : 0.0; };
  std::vector<Hit> hits;
  for (size_t i = 0; i < c.docs.size(); ++i) {
    double score = 0.0;
    switch (h.fusion) {
      case Fusion::kLinear:
        score = h.weight * c.bm25[i] + c.logits[i];
        break;
      case Fusion::kNormalized:
        score =
            h.weight * (best_bm25 > 0 ? c.bm25[i] / best_bm25 : 0.0) + (c.logits[i] - best_logit);
        break;
      case Fusion::kRanks:
        score = h.weight * reciprocal(c.bm25_rank[i]) + reciprocal(c.learned_rank[i]);
        break;
    }
    hits.push_back({c.docs[i], score});
  }
  std::sort(hits.begin(), hits.end(), [](const Hit& a, const Hit& b) {
    return a.score > b.score || (a.score == b.score && a.doc < b.doc);
  });
  if (static_cast<int64_t>(hits.size()) > k) hits.resize(static_cast<size_t>(k));
  return hits;
}

std::vector<int64_t> docs_of(const std::vector<Hit>& hits) {
  std::vector<int64_t> d;
  for (const Hit& h : hits) d.push_back(h.doc);
  return d;
}

// The learned engine's pieces shared by build (fitting the hybrid) and the index.
// The documents' encodings are kept in bfloat16 (the store's dtype): a query
// reads 63,666 x 128 x 2 bytes = 16 MB of keys instead of 32 MB, which is
// what a query's time is (the scores are products in float32 of the query
// rounded to bfloat16, as the store's attention takes it, so the weights
// exp(logit - lse) sum to 1).
struct LearnedScorer {
  const FeatureHashing* hashing;
  const Tensor<float>* query_map;
  const ChunkSource* documents;  // keys (N, d) bfloat16, values the sections (N, S)
  double scale;

  // The query's encoding, rounded to bfloat16.
  std::vector<float> encode(std::string_view query) const {
    const SparseRows rows = query_features({std::string(query)}, *hashing);
    Tensor<float> q(Shape{1, documents->key_dim()});
    search::encode(rows, query_map->view(), q.view());
    std::vector<float> out = q.values();
    for (float& x : out) x = static_cast<float>(bfloat16(x));
    return out;
  }
  // Attention of the query over every document: the pooled sections, the
  // lse and, with k > 0, the k documents of largest weight (the store's
  // top-k, split over the threads by rows).
  StoreAttentionResult attend(const std::vector<float>& q, int64_t k) const {
    StoreAttentionOptions options;
    options.scale = scale;
    options.top_k = std::min(k, documents->rows());
    return qkv::attend(ConstView<float>(q.data(), Shape{1, static_cast<int64_t>(q.size())}),
                       *documents, {}, options);
  }
  // The k documents of largest weight, best first (ties: smaller doc),
  // their scores the weights.
  std::vector<Hit> top(const std::vector<float>& q, int64_t k) const {
    const StoreAttentionResult r = attend(q, k);
    return hits_of(r);
  }
  static std::vector<Hit> hits_of(const StoreAttentionResult& r) {
    std::vector<Hit> hits;
    for (int64_t j = 0; j < r.top_ids.numel(); ++j) {
      if (r.top_ids(0, j) >= 0) hits.push_back({r.top_ids(0, j), double{r.top_weights(0, j)}});
    }
    return hits;
  }
  // The chunk of the documents' store that holds `doc` (chunks are in row order).
  size_t chunk_of(int64_t doc) const {
    size_t low = 0, high = documents->num_chunks();
    while (high - low > 1) {
      const size_t mid = low + (high - low) / 2;
      (documents->chunk_range(mid).first_row <= doc ? low : high) = mid;
    }
    return low;
  }
  // scale q . k of each document, read through the store's chunks that hold
  // them: each chunk read once per run of documents it holds (the index's
  // store is one chunk), and checked intact after its rows were used.
  std::vector<double> logits(const std::vector<float>& q, const std::vector<int64_t>& docs) const {
    std::vector<double> out;
    std::optional<SourceChunk> chunk;
    size_t read = 0;
    for (const int64_t doc : docs) {
      const size_t c = chunk_of(doc);
      if (!chunk || c != read) {
        if (chunk) chunk->check_intact();
        chunk = documents->read_chunk(c);
        read = c;
      }
      const ConstView<bfloat16> keys = chunk->keys<bfloat16>();
      const int64_t row = doc - chunk->range().first_row;
      float s = 0.0f;
      for (int64_t j = 0; j < keys.size(1); ++j)
        s += q[static_cast<size_t>(j)] * static_cast<float>(keys(row, j));
      out.push_back(scale * double{s});
    }
    if (chunk) chunk->check_intact();
    return out;
  }
  Candidates candidates(const std::vector<float>& q, const std::vector<Hit>& learned_hits,
                        const std::vector<Hit>& bm25_hits) const {
    Candidates c;
    std::unordered_map<int64_t, std::pair<double, int64_t>> bm25;  // score, rank
    std::unordered_map<int64_t, int64_t> learned;                  // rank
    for (size_t r = 0; r < bm25_hits.size(); ++r) {
      bm25[bm25_hits[r].doc] = {bm25_hits[r].score, static_cast<int64_t>(r) + 1};
      c.docs.push_back(bm25_hits[r].doc);
    }
    for (size_t r = 0; r < learned_hits.size(); ++r) {
      learned[learned_hits[r].doc] = static_cast<int64_t>(r) + 1;
      if (!bm25.count(learned_hits[r].doc)) c.docs.push_back(learned_hits[r].doc);
    }
    for (const int64_t doc : c.docs) {
      const auto b = bm25.find(doc);
      const auto l = learned.find(doc);
      c.bm25.push_back(b == bm25.end() ? 0.0 : b->second.first);
      c.bm25_rank.push_back(b == bm25.end() ? 0 : b->second.second);
      c.learned_rank.push_back(l == learned.end() ? 0 : l->second);
    }
    c.logits = logits(q, c.docs);
    return c;
  }
};

// The fusion and weight of the hybrid that give the best MRR@10 on
// `queries` (the validation split: neither trained on nor the test queries).
Hybrid fit_hybrid(const LearnedScorer& scorer, const Bm25& bm25,
                  const std::vector<std::pair<std::string, int64_t>>& queries) {
  std::vector<std::pair<Candidates, int64_t>> cases;
  for (const auto& [text, target] : queries) {
    const std::vector<float> q = scorer.encode(text);
    cases.push_back(
        {scorer.candidates(q, scorer.top(q, kCandidates), bm25.search(text, kCandidates)), target});
  }
  Hybrid best_hybrid;
  double best = -1.0;
  for (const Fusion fusion : {Fusion::kLinear, Fusion::kNormalized, Fusion::kRanks}) {
    for (const double w :
         {0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0}) {
      MetricsSum sum;
      for (const auto& [c, target] : cases) sum.add(docs_of(mix(c, {fusion, w}, 10)), target);
      if (sum.metrics().mrr_at_10 > best) {
        best = sum.metrics().mrr_at_10;
        best_hybrid = {fusion, w};
      }
    }
  }
  return best_hybrid;
}

}  // namespace

void SearchIndex::build(const std::string& dir, const std::vector<Package>& packages,
                        const TrainOptions& options, const BuildProgress& progress) {
  if (packages.empty()) fail(kBuild, "no packages to index");
  StagedDirectory staged(kBuild, dir);
  const std::string temp = staged.temp();
  auto path = [&](const char* name) { return (fs::path(temp) / name).string(); };

  std::vector<int64_t> train_ids, validation_ids;
  for (int64_t i = 0; i < static_cast<int64_t>(packages.size()); ++i) {
    if (words(packages[i].short_description).empty()) continue;
    const Split split = split_of(packages[i].name);
    if (split == Split::kTrain) train_ids.push_back(i);
    if (split == Split::kValidation) validation_ids.push_back(i);
  }
  TrainOptions train_options = options;
  if (progress) {
    train_options.progress = [&](int64_t done, int64_t total, double) {
      progress("training", done, total);
    };
  }
  // Early stopping on the validation queries' MRR@10.
  std::vector<std::string> validation_texts;
  for (const int64_t id : validation_ids)
    validation_texts.push_back(packages[id].short_description);
  const SparseRows validation_queries = query_features(validation_texts, options.hashing);
  const SparseRows document_rows = document_features(packages, options.hashing);
  if (!validation_ids.empty()) {
    train_options.validation_score = [&](const Encoders& e) {
      const std::vector<std::vector<int64_t>> ranked =
          rank_by_attention(encodings(validation_queries, e.query_map),
                            encodings(document_rows, e.doc_map), e.score_scale, 10);
      MetricsSum sum;
      for (size_t i = 0; i < ranked.size(); ++i) sum.add(ranked[i], validation_ids[i]);
      return sum.metrics().mrr_at_10;
    };
  }
  const double start = now_ms();
  const Encoders enc = train(packages, train_ids, train_options);
  const double training_seconds = (now_ms() - start) / 1000.0;

  // The documents' store: encodings and section one-hots.
  const int64_t n = static_cast<int64_t>(packages.size()), d = options.dim;
  const Tensor<float> documents = encodings(document_rows, enc.doc_map);
  std::vector<std::string> sections;
  for (const Package& p : packages) sections.push_back(p.section);
  std::sort(sections.begin(), sections.end());
  sections.erase(std::unique(sections.begin(), sections.end()), sections.end());
  Tensor<float> one_hot(Shape{n, static_cast<int64_t>(sections.size())}, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const auto at = std::lower_bound(sections.begin(), sections.end(), packages[i].section);
    one_hot(i, at - sections.begin()) = 1.0f;
  }
  if (progress) progress("writing", 0, 1);
  const KeyValueStore store =
      KeyValueStore::create(path("documents"), documents, one_hot, StoreDtype::kBFloat16, n);
  write_npy(path("query_map.npy"), enc.query_map.view());
  write_npy(path("doc_map.npy"), enc.doc_map.view());
  Json list = Json::array();
  for (const Package& p : packages) {
    list.push_back({{"name", p.name},
                    {"short_description", p.short_description},
                    {"section", p.section},
                    {"held_out", split_of(p.name) == Split::kTest}});
  }
  write_text(path("packages.json"), list.dump() + "\n");
  Bm25::build(path("bm25.sqlite"), packages);

  // The hybrid's weight, on training queries.
  const Bm25 bm25(path("bm25.sqlite"));
  const LearnedScorer scorer{&enc.hashing, &enc.query_map, &store, enc.score_scale};
  std::vector<std::pair<std::string, int64_t>> fit;
  for (const int64_t id : validation_ids) fit.push_back({packages[id].short_description, id});
  if (progress) progress("fitting the hybrid", 0, 1);
  const Hybrid hybrid = fit_hybrid(scorer, bm25, fit);

  Json manifest = {{"format", kIndexFormat},
                   {"version", kIndexVersion},
                   {"packages", n},
                   {"training_queries", static_cast<int64_t>(train_ids.size())},
                   {"validation_queries", static_cast<int64_t>(validation_ids.size())},
                   {"dim", d},
                   {"buckets", enc.hashing.buckets},
                   {"hash_seed", enc.hashing.seed},
                   {"score_scale", enc.score_scale},
                   {"tied", options.tied},
                   {"epochs", options.epochs},
                   {"batch", options.batch},
                   {"learning_rate", options.learning_rate},
                   {"seed", options.seed},
                   {"training_seconds", training_seconds},
                   {"validation_mrr_at_10", enc.validation_scores},
                   {"best_epoch", enc.best_epoch},
                   {"hybrid_fusion", kFusionNames[static_cast<int>(hybrid.fusion)]},
                   {"hybrid_weight", hybrid.weight},
                   {"sections", sections}};
  Json files = Json::object();
  for (const char* name : kIndexChecked) files[name] = hex64(file_xxh3(path(name)));
  manifest["files"] = files;
  write_text(path("manifest.json"), index_manifest_text(manifest));
  staged.commit();
}

SearchIndex SearchIndex::open(const std::string& dir) {
  SearchIndex index;
  index.dir_ = dir;
  auto path = [&](const std::string& name) { return (fs::path(dir) / name).string(); };
  std::error_code error;
  const fs::file_status status = fs::status(dir, error);
  if (!fs::exists(status)) {
    fail(kFn, dir + ": no such index directory (make one with qkv search index --out " + dir + ")");
  }
  if (!fs::is_directory(status)) {
    fail(kFn, dir + ": not an index (an index is a directory, made by qkv search index --out)");
  }
  index.manifest_text_ = read_file(path("manifest.json"));
  const IndexManifest m = parse_index_manifest(index.manifest_text_, path("manifest.json"));
  index.hashing_ = m.hashing;
  index.score_scale_ = m.score_scale;
  index.hybrid_fusion_ = m.hybrid_fusion;
  index.hybrid_weight_ = m.hybrid_weight;
  index.sections_ = m.sections;
  for (const auto& [name, want] : m.files) {
    const std::string got = hex64(file_xxh3(path(name)));
    if (got != want) {
      fail(kFn, path(name) + ": checksum " + got + " does not match the manifest's " + want +
                    " (the file was altered; build the index again)");
    }
  }
  index.packages_ = parse_packages(read_file(path("packages.json")), path("packages.json"));
  NpyArray q = read_npy(path("query_map.npy"));
  Tensor<float>* map = std::get_if<Tensor<float>>(&q);
  if (map == nullptr || map->rank() != 2 || map->size(0) != index.hashing_.buckets) {
    fail(kFn, path("query_map.npy") + ": not the (buckets, d) float32 map the manifest describes");
  }
  index.query_map_ = std::move(*map);
  index.documents_ = std::make_shared<const KeyValueStore>(KeyValueStore::open(path("documents")));
  if (index.documents_->rows() != static_cast<int64_t>(index.packages_.size()) ||
      index.documents_->key_dim() != index.query_map_.size(1) ||
      index.documents_->value_dim() != static_cast<int64_t>(index.sections_.size()) ||
      index.documents_->dtype() != StoreDtype::kBFloat16) {
    fail(kFn, path("documents") + ": does not match the index's manifest");
  }
  index.bm25_ = std::make_shared<const Bm25>(path("bm25.sqlite"));
  if (index.bm25_->size() != static_cast<int64_t>(index.packages_.size())) {
    fail(kFn, path("bm25.sqlite") + ": does not match the index's manifest");
  }
  return index;
}

Tensor<float> SearchIndex::encode_queries(const std::vector<std::string>& queries) const {
  return encodings(query_features(queries, hashing_), query_map_);
}

Ranking SearchIndex::learned(std::string_view query, int64_t k) const {
  const LearnedScorer scorer{&hashing_, &query_map_, documents_.get(), score_scale_};
  // The attention over every document gives the pooled sections and the
  // top k by weight.
  const StoreAttentionResult r = scorer.attend(scorer.encode(query), k);
  Ranking out;
  out.hits = LearnedScorer::hits_of(r);
  for (size_t s = 0; s < sections_.size(); ++s) {
    out.sections.push_back({sections_[s], double{r.output(0, static_cast<int64_t>(s))}});
  }
  std::stable_sort(out.sections.begin(), out.sections.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  return out;
}

Ranking SearchIndex::bm25(std::string_view query, int64_t k) const {
  return {bm25_->search(query, k), {}};
}

Ranking SearchIndex::hybrid(std::string_view query, int64_t k) const {
  const LearnedScorer scorer{&hashing_, &query_map_, documents_.get(), score_scale_};
  const std::vector<float> q = scorer.encode(query);
  const Candidates c =
      scorer.candidates(q, scorer.top(q, kCandidates), bm25_->search(query, kCandidates));
  return {mix(c, {static_cast<Fusion>(hybrid_fusion_), hybrid_weight_}, k), {}};
}

Evaluation SearchIndex::evaluate(const BuildProgress& progress) const {
  std::vector<int64_t> held;
  for (int64_t i = 0; i < static_cast<int64_t>(packages_.size()); ++i) {
    if (packages_[i].held_out && !words(packages_[i].short_description).empty()) held.push_back(i);
  }
  MetricsSum bm25_sum, learned_sum, hybrid_sum;
  std::vector<double> bm25_ms, learned_ms, hybrid_ms;
  const LearnedScorer scorer{&hashing_, &query_map_, documents_.get(), score_scale_};
  for (size_t n = 0; n < held.size(); ++n) {
    const std::string& text = packages_[held[n]].short_description;
    double t0 = now_ms();
    const std::vector<Hit> b = bm25_->search(text, kCandidates);
    const double t1 = now_ms();
    const std::vector<float> q = scorer.encode(text);
    const std::vector<Hit> l = learned(text, kCandidates).hits;
    const double t2 = now_ms();
    const std::vector<Hit> h =
        mix(scorer.candidates(q, l, b), {static_cast<Fusion>(hybrid_fusion_), hybrid_weight_}, 10);
    const double t3 = now_ms();
    bm25_ms.push_back(t1 - t0);
    learned_ms.push_back(t2 - t1);
    hybrid_ms.push_back(t3 - t0);
    bm25_sum.add(docs_of(b), held[n]);
    learned_sum.add(docs_of(l), held[n]);
    hybrid_sum.add(docs_of(h), held[n]);
    if (progress)
      progress("evaluating", static_cast<int64_t>(n + 1), static_cast<int64_t>(held.size()));
  }
  Evaluation e{bm25_sum.metrics(), learned_sum.metrics(), hybrid_sum.metrics(),
               median(bm25_ms),    median(learned_ms),    median(hybrid_ms)};
  std::vector<double> fts5_ms;
  for (size_t n = 0; n < held.size() && n < kFts5Checks; ++n) {
    const std::string& text = packages_[held[n]].short_description;
    const double t0 = now_ms();
    const std::vector<Hit> want = bm25_->search_fts5(text, 10);
    fts5_ms.push_back(now_ms() - t0);
    ++e.fts5_compared;
    e.fts5_same += docs_of(want) == docs_of(bm25_->search(text, 10));
  }
  e.fts5_ms = median(fts5_ms);
  return e;
}

}  // namespace qkv::search
