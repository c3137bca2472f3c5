#include "search/index.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <sstream>
#include <unordered_map>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "qkv/error.h"
#include "qkv/lookup.h"
#include "qkv/npy.h"
#include "qkv/staged_file.h"
#include "qkv/store_attention.h"

namespace qkv::search {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

// Errors of build, open and verify, and of their file helpers; the command
// adds its own prefix ("qkv search: error: ").
constexpr std::string_view kBuild = "SearchIndex::build", kFn = "SearchIndex::open",
                           kVerify = "SearchIndex::verify";
// Held-out queries on which evaluate() holds Bm25::search to FTS5's own
// query (which takes 100-150 ms each on the full corpus).
constexpr size_t kFts5Checks = 200;
// The hybrid's candidates: each engine's top 100.
constexpr int64_t kCandidates = 100;

// A regular file's status, or Error: a FIFO would block the open, and a
// device such as /dev/zero would be read until memory runs out.
void check_regular(std::string_view function, const std::string& path) {
  std::error_code error;
  const fs::file_status status = fs::status(path, error);
  if (fs::exists(status) && !fs::is_regular_file(status)) {
    fail(function, path + ": not a regular file (" +
                       (fs::is_directory(status) ? "a directory"
                        : fs::is_fifo(status)    ? "a FIFO"
                                                 : "a special file") +
                       "); an index's files are regular files (build the index again)");
  }
}

std::string read_file(std::string_view function, const std::string& path) {
  check_regular(function, path);
  std::ifstream in(path, std::ios::binary);
  if (!in)
    fail(function, path + ": missing or unreadable (the index is incomplete; build it again)");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string hex64(uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

// A file's XXH3-64, read in 1 MiB pieces (the model is 90 MB).
uint64_t file_xxh3(std::string_view function, const std::string& path) {
  check_regular(function, path);
  std::ifstream in(path, std::ios::binary);
  if (!in)
    fail(function, path + ": missing or unreadable (the index is incomplete; build it again)");
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  std::vector<char> buf(size_t{1} << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    XXH3_64bits_update(state, buf.data(), static_cast<size_t>(in.gcount()));
  }
  const uint64_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return h;
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

// What the sentence encoder reads of a package: its name spelled out
// ("gnuplot-nox gnuplot nox") and its long description, which the short
// description (the query) is never part of.
std::string document_for_encoder(const Package& p) {
  const DocumentText t = document_text(p);
  return t.description.empty() ? t.name : t.name + ": " + t.description;
}

// `rows` of x (n, d), in that order.
Tensor<float> rows_of(const Tensor<float>& x, const std::vector<int64_t>& rows) {
  const int64_t d = x.size(1);
  Tensor<float> out(Shape{static_cast<int64_t>(rows.size()), d});
  for (size_t r = 0; r < rows.size(); ++r) {
    std::copy(x.data() + rows[r] * d, x.data() + (rows[r] + 1) * d,
              out.data() + static_cast<int64_t>(r) * d);
  }
  return out;
}

std::string lower_trimmed(std::string_view text) {
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos) return "";
  const size_t last = text.find_last_not_of(" \t\r\n");
  std::string out(text.substr(first, last - first + 1));
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
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

// The learned engine's pieces shared by build (fitting the hybrid) and the
// index. The documents' encodings are kept in bfloat16 (the store's dtype):
// a query reads 63,681 x 384 x 2 bytes = 49 MB of keys instead of 98 MB,
// which is most of a query's time after its encoding (the scores are
// products in float32 of the query rounded to bfloat16, as the store's
// attention takes it, so the weights exp(logit - lse) sum to 1).
struct LearnedScorer {
  const SentenceEncoder* encoder;
  const Tensor<float>* query_weight;
  const ChunkSource* documents;  // keys (N, d) bfloat16, values the sections (N, S)
  double scale;

  // The queries' encodings W_q e(query) (n, d), rounded to bfloat16.
  Tensor<float> encode(const std::vector<std::string>& queries) const {
    Tensor<float> q = apply_map(encoder->encode_texts(queries, kQueryTokens), *query_weight);
    for (float& x : q.values()) x = static_cast<float>(bfloat16(x));
    return q;
  }
  // Attention of the queries (n, d) over every document: the pooled
  // sections, the lse and, with k > 0, the k documents of largest weight
  // (the store's top-k, split over the threads by rows).
  StoreAttentionResult attend(const Tensor<float>& q, int64_t k) const {
    StoreAttentionOptions options;
    options.scale = scale;
    options.top_k = std::min(k, documents->rows());
    return qkv::attend(q.view(), *documents, {}, options);
  }
  // The k documents of largest weight, best first (ties: smaller doc),
  // their scores the weights.
  std::vector<Hit> top(const std::vector<float>& q, int64_t k) const {
    return hits_of(attend(Tensor<float>(Shape{1, static_cast<int64_t>(q.size())}, q), k), 0);
  }
  // Query `row`'s top documents.
  static std::vector<Hit> hits_of(const StoreAttentionResult& r, int64_t row) {
    std::vector<Hit> hits;
    for (int64_t j = 0; j < r.top_ids.size(1); ++j) {
      if (r.top_ids(row, j) >= 0)
        hits.push_back({r.top_ids(row, j), double{r.top_weights(row, j)}});
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

// The fusion and weight of the hybrid that give the best MRR@10 on the
// validation queries (neither trained on nor the test queries): their
// texts for BM25, their encodings (n, d) W_q e for the learned engine, and
// their packages.
Hybrid fit_hybrid(const LearnedScorer& scorer, const Bm25& bm25,
                  const std::vector<std::string>& texts, const Tensor<float>& encoded,
                  const std::vector<int64_t>& targets) {
  std::vector<std::pair<Candidates, int64_t>> cases;
  for (size_t i = 0; i < texts.size(); ++i) {
    const int64_t d = encoded.size(1);
    std::vector<float> q(encoded.data() + static_cast<int64_t>(i) * d,
                         encoded.data() + (static_cast<int64_t>(i) + 1) * d);
    for (float& x : q) x = static_cast<float>(bfloat16(x));
    cases.push_back(
        {scorer.candidates(q, scorer.top(q, kCandidates), bm25.search(texts[i], kCandidates)),
         targets[i]});
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

// `hits` with `doc` first (its score `score` if it was not among them), at
// most k.
std::vector<Hit> named_first(std::vector<Hit> hits, int64_t doc, double score, int64_t k) {
  if (doc < 0) return hits;
  const auto at =
      std::find_if(hits.begin(), hits.end(), [&](const Hit& h) { return h.doc == doc; });
  if (at != hits.end()) {
    score = at->score;
    hits.erase(at);
  }
  hits.insert(hits.begin(), Hit{doc, score});
  if (static_cast<int64_t>(hits.size()) > k) hits.resize(static_cast<size_t>(k));
  return hits;
}

}  // namespace

void SearchIndex::build(const std::string& dir, const std::vector<Package>& packages,
                        const IndexOptions& options, const BuildProgress& progress) {
  if (packages.empty()) fail(kBuild, "no packages to index");
  // The model is read first: a wrong --model is named before anything is written.
  const SentenceEncoder encoder = SentenceEncoder::load(options.model);
  const int64_t max_tokens = encoder.config().max_positions;
  if (options.document_tokens < 3 || options.document_tokens > max_tokens) {
    fail(kBuild, "document_tokens is " + std::to_string(options.document_tokens) +
                     "; expected [3, " + std::to_string(max_tokens) +
                     "] (the model's max_position_embeddings)");
  }
  StagedDirectory staged(kBuild, dir);
  const std::string temp = staged.temp();
  auto path = [&](const std::string& name) { return (fs::path(temp) / name).string(); };
  const auto stage = [&](const char* what, int64_t done, int64_t total) {
    if (progress) progress(what, done, total);
  };

  // The queries: short descriptions with words, by split.
  std::vector<int64_t> train_ids, validation_ids;
  for (int64_t i = 0; i < static_cast<int64_t>(packages.size()); ++i) {
    if (words(packages[i].short_description).empty()) continue;
    const Split split = split_of(packages[i].name);
    if (split == Split::kTrain) train_ids.push_back(i);
    if (split == Split::kValidation) validation_ids.push_back(i);
  }
  const int64_t n = static_cast<int64_t>(packages.size());
  const double build_start = now_ms();
  double start = build_start;
  std::vector<std::string> texts;
  for (const Package& p : packages) texts.push_back(document_for_encoder(p));
  stage("encoding documents", 0, n);
  const Tensor<float> documents = encoder.encode_texts(
      texts, options.document_tokens, [&](int64_t done) { stage("encoding documents", done, n); });
  texts.clear();
  for (const int64_t id : train_ids) texts.push_back(packages[id].short_description);
  for (const int64_t id : validation_ids) texts.push_back(packages[id].short_description);
  const int64_t nq = static_cast<int64_t>(texts.size());
  stage("encoding queries", 0, nq);
  const Tensor<float> queries = encoder.encode_texts(
      texts, kQueryTokens, [&](int64_t done) { stage("encoding queries", done, nq); });
  const double encoding_seconds = (now_ms() - start) / 1000.0;
  std::vector<int64_t> train_rows(train_ids.size()), validation_rows(validation_ids.size());
  std::iota(train_rows.begin(), train_rows.end(), int64_t{0});
  std::iota(validation_rows.begin(), validation_rows.end(), static_cast<int64_t>(train_ids.size()));
  const Tensor<float> train_queries = rows_of(queries, train_rows);
  const Tensor<float> validation_queries = rows_of(queries, validation_rows);

  // The head, stopped early on the validation queries' MRR@10.
  HeadOptions head_options = options.head;
  head_options.progress = [&](int64_t done, int64_t total, double) {
    stage("training", done, total);
  };
  if (!validation_ids.empty()) {
    head_options.validation_score = [&](const Head& h) {
      const std::vector<std::vector<int64_t>> ranked =
          rank_by_attention(apply_map(validation_queries, h.query_weight),
                            apply_map(documents, h.doc_weight), h.score_scale, 10);
      MetricsSum sum;
      for (size_t i = 0; i < ranked.size(); ++i) sum.add(ranked[i], validation_ids[i]);
      return sum.metrics().mrr_at_10;
    };
  }
  start = now_ms();
  const Head head = train_head(documents, train_queries, train_ids, head_options);
  const double training_seconds = (now_ms() - start) / 1000.0;

  // The documents' store: encodings and section one-hots.
  stage("writing", 0, 0);
  const Tensor<float> keys = apply_map(documents, head.doc_weight);
  std::vector<std::string> sections;
  for (const Package& p : packages) sections.push_back(p.section);
  std::sort(sections.begin(), sections.end());
  sections.erase(std::unique(sections.begin(), sections.end()), sections.end());
  Tensor<float> one_hot(Shape{n, static_cast<int64_t>(sections.size())}, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const auto at = std::lower_bound(sections.begin(), sections.end(), packages[i].section);
    one_hot(i, at - sections.begin()) = 1.0f;
  }
  const KeyValueStore store =
      KeyValueStore::create(path("documents"), keys, one_hot, StoreDtype::kBFloat16, n);
  write_npy(path("query_head.npy"), head.query_weight.view());
  for (const char* file : kModelFiles) {
    const fs::path to = fs::path(path("model")) / file;
    fs::create_directories(to.parent_path());
    std::error_code error;
    if (!fs::copy_file(fs::path(options.model) / file, to, error)) {
      fail(kBuild, (fs::path(options.model) / file).string() +
                       ": cannot be copied into the index (" + error.message() + ")");
    }
  }
  Json list = Json::array();
  for (const Package& p : packages) {
    list.push_back({{"name", p.name},
                    {"short_description", p.short_description},
                    {"section", p.section},
                    {"held_out", split_of(p.name) == Split::kTest}});
  }
  write_text(path("packages.json"), list.dump() + "\n");
  Bm25::build(path("bm25.sqlite"), packages);

  // The hybrid's mix, on the validation queries.
  stage("fitting the hybrid", 0, 0);
  const Bm25 bm25(path("bm25.sqlite"));
  const LearnedScorer scorer{&encoder, &head.query_weight, &store, head.score_scale};
  std::vector<std::string> validation_texts;
  for (const int64_t id : validation_ids)
    validation_texts.push_back(packages[id].short_description);
  const Hybrid hybrid =
      fit_hybrid(scorer, bm25, validation_texts, apply_map(validation_queries, head.query_weight),
                 validation_ids);

  Json manifest = {{"format", kIndexFormat},
                   {"version", kIndexVersion},
                   {"packages", n},
                   {"training_queries", static_cast<int64_t>(train_ids.size())},
                   {"validation_queries", static_cast<int64_t>(validation_ids.size())},
                   {"model", fs::absolute(options.model).lexically_normal().string()},
                   {"dim", encoder.config().hidden_size},
                   {"document_tokens", options.document_tokens},
                   {"query_tokens", kQueryTokens},
                   {"score_scale", head.score_scale},
                   {"epochs", options.head.epochs},
                   {"batch", options.head.batch},
                   {"learning_rate", options.head.learning_rate},
                   {"seed", options.head.seed},
                   {"encoding_seconds", encoding_seconds},
                   {"training_seconds", training_seconds},
                   {"validation_mrr_at_10", head.validation_scores},
                   {"best_epoch", head.best_epoch},
                   {"build_seconds", (now_ms() - build_start) / 1000.0},
                   {"hybrid_fusion", kFusionNames[static_cast<int>(hybrid.fusion)]},
                   {"hybrid_weight", hybrid.weight},
                   {"sections", sections}};
  Json files = Json::object();
  for (const std::string& name : index_checked_files())
    files[name] = hex64(file_xxh3(kBuild, path(name)));
  manifest["files"] = files;
  write_text(path("manifest.json"), index_manifest_text(manifest));
  staged.commit();
}

struct SearchIndex::Names {
  std::once_flag made;
  std::unique_ptr<KeyValueDatabase> table;  // key: a package's name
};

std::string SearchIndex::corrected(const std::string& query) const {
  // The query's words as BM25 reads them, each looked up among the
  // documents' terms.
  std::vector<std::pair<std::string, std::string>> replace;
  for (const std::string& word : words(query)) {
    if (word.size() < 4 || bm25_->has_word(word)) continue;
    std::call_once(names_->made, [&] {
      std::vector<Record> records;
      for (const IndexedPackage& p : packages_) records.push_back({p.name, ""});
      names_->table = std::make_unique<KeyValueDatabase>(std::move(records));
    });
    const TopK top = names_->table->top(word, LookupMode::kApproximate, 1);
    if (top.records.empty()) continue;
    const std::string& name = names_->table->records()[top.records[0].index].key;
    if (key_similarity(word, name) >= kCorrectionSimilarity) replace.push_back({word, name});
  }
  if (replace.empty()) return "";
  // Each word replaced where it stands, matched as words() reads it
  // (case-insensitively, between characters that are not letters or digits).
  std::string out = query;
  for (const auto& [word, name] : replace) {
    const std::string lower = lower_trimmed(out);
    size_t at = 0;
    while ((at = lower.find(word, at)) != std::string::npos) {
      const bool starts = at == 0 || !std::isalnum(static_cast<unsigned char>(lower[at - 1]));
      const size_t end = at + word.size();
      const bool ends =
          end == lower.size() || !std::isalnum(static_cast<unsigned char>(lower[end]));
      if (starts && ends) break;
      ++at;
    }
    if (at == std::string::npos) continue;
    const size_t lead = out.find_first_not_of(" \t\r\n");
    out.replace(lead + at, word.size(), name);
  }
  return out;
}

std::string SearchIndex::path(const std::string& name) const {
  return (fs::path(dir_) / name).string();
}

SearchIndex SearchIndex::open(const std::string& dir) {
  SearchIndex index;
  index.dir_ = dir;
  std::error_code error;
  const fs::file_status status = fs::status(dir, error);
  if (!fs::exists(status)) {
    fail(kFn, dir + ": no such index directory (make one with qkv search index --out " + dir + ")");
  }
  if (!fs::is_directory(status)) {
    fail(kFn, dir + ": not an index (an index is a directory, made by qkv search index --out)");
  }
  index.manifest_text_ = read_file(kFn, index.path("manifest.json"));
  index.manifest_ = parse_index_manifest(index.manifest_text_, index.path("manifest.json"));
  const IndexManifest& m = index.manifest_;
  index.packages_ =
      parse_packages(read_file(kFn, index.path("packages.json")), index.path("packages.json"));
  const auto mismatch = [&](const std::string& name, const std::string& what) {
    fail(kFn, index.path(name) + ": " + what +
                  ", which does not match the index's manifest (build the index again)");
  };
  index.encoder_ =
      std::make_shared<const SentenceEncoder>(SentenceEncoder::load(index.path("model")));
  if (index.encoder_->config().hidden_size != m.dim) {
    mismatch("model",
             "an encoder of hidden size " + std::to_string(index.encoder_->config().hidden_size));
  }
  check_regular(kFn, index.path("query_head.npy"));
  NpyArray q = read_npy(index.path("query_head.npy"));
  Tensor<float>* head = std::get_if<Tensor<float>>(&q);
  if (head == nullptr || head->rank() != 2 || head->size(0) != m.dim || head->size(1) != m.dim)
    mismatch("query_head.npy",
             "not a (" + std::to_string(m.dim) + ", " + std::to_string(m.dim) + ") float32 map");
  index.query_weight_ = std::move(*head);
  index.documents_ = std::make_shared<const KeyValueStore>(
      KeyValueStore::open(index.path("documents"), StoreCheck::kStructure));
  const KeyValueStore& docs = *index.documents_;
  if (docs.rows() != static_cast<int64_t>(index.packages_.size()) || docs.key_dim() != m.dim ||
      docs.value_dim() != static_cast<int64_t>(m.sections.size()) ||
      docs.dtype() != StoreDtype::kBFloat16) {
    mismatch("documents", "a store of " + std::to_string(docs.rows()) + " rows, keys of " +
                              std::to_string(docs.key_dim()) + " and values of " +
                              std::to_string(docs.value_dim()));
  }
  index.names_ = std::make_shared<Names>();
  check_regular(kFn, index.path("bm25.sqlite"));
  index.bm25_ = std::make_shared<const Bm25>(index.path("bm25.sqlite"));
  if (index.bm25_->size() != static_cast<int64_t>(index.packages_.size())) {
    mismatch("bm25.sqlite", std::to_string(index.bm25_->size()) + " documents");
  }
  return index;
}

void SearchIndex::verify() const {
  for (const auto& [name, want] : manifest_.files) {
    const std::string got = hex64(file_xxh3(kVerify, path(name)));
    if (got != want) {
      fail(kVerify, path(name) + ": checksum " + got + " does not match the manifest's " + want +
                        " (the file was altered; build the index again)");
    }
  }
  documents_->verify();
}

int64_t SearchIndex::named(std::string_view query) const {
  const std::string name = lower_trimmed(query);
  if (name.empty()) return -1;
  for (size_t i = 0; i < packages_.size(); ++i) {
    if (packages_[i].name == name) return static_cast<int64_t>(i);
  }
  return -1;
}

Tensor<float> SearchIndex::encode_queries(const std::vector<std::string>& queries) const {
  return apply_map(encoder_->encode_texts(queries, kQueryTokens), query_weight_);
}

const char* engine_name(Engine engine) {
  switch (engine) {
    case Engine::kHybrid:
      return "hybrid";
    case Engine::kLearned:
      return "learned";
    case Engine::kBm25:
      return "bm25";
  }
  return "";
}

Engine parse_engine(std::string_view text, std::string_view function) {
  for (const Engine e : {Engine::kHybrid, Engine::kLearned, Engine::kBm25}) {
    if (text == engine_name(e)) return e;
  }
  fail(function,
       "engine is \"" + std::string(text) + "\"; expected \"hybrid\", \"learned\" or \"bm25\"");
}

std::vector<Ranking> SearchIndex::search(const std::vector<std::string>& queries, Engine engine,
                                         int64_t k) const {
  std::vector<Ranking> out(queries.size());
  std::vector<size_t> asked;                     // the queries with words
  std::vector<std::string> run(queries.size());  // each as the engines run it
  if (engine == Engine::kBm25) {                 // FTS5's ranking, the baseline, as it is
    for (size_t i = 0; i < queries.size(); ++i) out[i].hits = bm25_->search(queries[i], k);
    return out;
  }
  for (size_t i = 0; i < queries.size(); ++i) {
    if (words(queries[i]).empty()) continue;
    asked.push_back(i);
    out[i].corrected = corrected(queries[i]);
    run[i] = out[i].corrected.empty() ? queries[i] : out[i].corrected;
  }
  const LearnedScorer scorer{encoder_.get(), &query_weight_, documents_.get(),
                             manifest_.score_scale};
  const Hybrid mixing{static_cast<Fusion>(manifest_.hybrid_fusion), manifest_.hybrid_weight};
  // 256 queries at a time: their encodings and one pass over the documents.
  constexpr size_t kBlock = 256;
  for (size_t first = 0; first < asked.size(); first += kBlock) {
    const size_t count = std::min(kBlock, asked.size() - first);
    std::vector<std::string> texts;
    for (size_t j = 0; j < count; ++j) texts.push_back(run[asked[first + j]]);
    const Tensor<float> q = scorer.encode(texts);
    const int64_t d = q.size(1);
    const StoreAttentionResult r = scorer.attend(q, engine == Engine::kLearned ? k : kCandidates);
    for (size_t j = 0; j < count; ++j) {
      const std::string& text = texts[j];
      Ranking& ranking = out[asked[first + j]];
      const auto row = static_cast<int64_t>(j);
      const std::vector<float> qj(q.data() + row * d, q.data() + (row + 1) * d);
      const int64_t doc = named(text);
      if (engine == Engine::kLearned) {
        ranking.hits = LearnedScorer::hits_of(r, row);
        if (doc >= 0) {
          const double weight = std::exp(scorer.logits(qj, {doc})[0] - double{r.lse(row)});
          ranking.hits = named_first(std::move(ranking.hits), doc, weight, k);
        }
        for (size_t s = 0; s < manifest_.sections.size(); ++s) {
          ranking.sections.push_back(
              {manifest_.sections[s], double{r.output(row, static_cast<int64_t>(s))}});
        }
        std::stable_sort(ranking.sections.begin(), ranking.sections.end(),
                         [](const auto& a, const auto& b) { return a.second > b.second; });
      } else {
        const Candidates c =
            scorer.candidates(qj, LearnedScorer::hits_of(r, row), bm25_->search(text, kCandidates));
        std::vector<Hit> hits = mix(c, mixing, k);
        const double best = hits.empty() ? 0.0 : hits[0].score;
        ranking.hits = named_first(std::move(hits), doc, best, k);
      }
    }
  }
  return out;
}

Ranking SearchIndex::learned(std::string_view query, int64_t k) const {
  return std::move(search({std::string(query)}, Engine::kLearned, k)[0]);
}

Ranking SearchIndex::bm25(std::string_view query, int64_t k) const {
  return std::move(search({std::string(query)}, Engine::kBm25, k)[0]);
}

Ranking SearchIndex::hybrid(std::string_view query, int64_t k) const {
  return std::move(search({std::string(query)}, Engine::kHybrid, k)[0]);
}

Evaluation SearchIndex::evaluate(const BuildProgress& progress) const {
  std::vector<int64_t> held;
  for (int64_t i = 0; i < static_cast<int64_t>(packages_.size()); ++i) {
    if (packages_[i].held_out && !words(packages_[i].short_description).empty()) held.push_back(i);
  }
  MetricsSum bm25_sum, learned_sum, hybrid_sum;
  std::vector<double> bm25_ms, learned_ms, hybrid_ms;
  for (size_t n = 0; n < held.size(); ++n) {
    const std::string& text = packages_[held[n]].short_description;
    const double t0 = now_ms();
    const std::vector<Hit> b = bm25(text, kCandidates).hits;
    const double t1 = now_ms();
    const std::vector<Hit> l = learned(text, kCandidates).hits;
    const double t2 = now_ms();
    const std::vector<Hit> h = hybrid(text, 10).hits;
    const double t3 = now_ms();
    bm25_ms.push_back(t1 - t0);
    learned_ms.push_back(t2 - t1);
    hybrid_ms.push_back(t3 - t2);
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
