// `qkv index`: an inverted-file index over a key-value store (qkv/index.h)
// from the command line: build, update, info, verify. Attention through an index is
// `qkv attend --store S --index I` (cli/attend_store.cc).
//   store: keys (N, D), values (N, Dv)   index: the same rows in L lists (k-means)
#include "qkv/index.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "common.h"
#include "progress.h"
#include "qkv/store.h"

namespace qkv::cli {
namespace {

struct IndexArgs {
  std::string store;  // build: the positional STORE; update: --store
  std::string index;  // build: --out; update, info, verify: the positional INDEX
  std::optional<int64_t> lists;
  int iterations = IndexBuildOptions{}.iterations;
  uint64_t seed = IndexBuildOptions{}.seed;
  std::optional<int> threads;
  bool json = false, quiet = false;
};

// --out before any work: a path that exists already (the library would
// refuse it too, after the store was opened), a parent that does not exist,
// or a place inside the store's directory (the index would be a stray
// directory in the store, and a build over a store must not write into it:
// DESIGN.md §9), each named with the option and the path.
void check_index_out(const IndexArgs& args) {
  namespace fs = std::filesystem;
  std::error_code error;
  const fs::file_type type = fs::symlink_status(args.index, error).type();
  // none: it cannot be looked at (a directory without search permission),
  // which the library's own check names.
  if (type != fs::file_type::not_found && type != fs::file_type::none) {
    throw UsageError("--out " + args.index +
                     " already exists; an index is built into a new directory (remove it, or "
                     "give another path)");
  }
  fs::path path(args.index);
  if (!path.has_filename()) path = path.parent_path();  // "INDEX/"
  const fs::path parent = path.parent_path();
  if (!parent.empty() && !fs::is_directory(parent, error)) {
    throw UsageError("--out " + args.index + ": the directory " + parent.string() +
                     " does not exist");
  }
  const fs::path out = fs::weakly_canonical(args.index, error);
  if (error) return;  // the library's checks name what is wrong with it
  const fs::path store = fs::weakly_canonical(args.store, error);
  if (error) return;
  const auto [store_end, out_at] =
      std::mismatch(store.begin(), store.end(), out.begin(), out.end());
  if (store_end == store.end()) {
    throw UsageError("--out " + args.index + " is inside STORE " + args.store +
                     "; the index goes outside the store's directory (no command writes into "
                     "an input store)");
  }
}

// The list sizes and radii of an index, for its summaries.
struct ListStats {
  int64_t smallest = 0, largest = 0, empty = 0;
  double median = 0;
  std::optional<double> least_radius, greatest_radius;  // over the lists with rows
};

ListStats list_stats(const StoreIndex& index) {
  const std::vector<IndexList>& lists = index.lists();
  ListStats stats;
  if (lists.empty()) return stats;
  std::vector<int64_t> rows;
  for (const IndexList& list : lists) {
    rows.push_back(list.rows);
    stats.empty += list.rows == 0;
    if (list.rows == 0) continue;
    stats.least_radius = std::min(stats.least_radius.value_or(list.radius), list.radius);
    stats.greatest_radius = std::max(stats.greatest_radius.value_or(list.radius), list.radius);
  }
  std::sort(rows.begin(), rows.end());
  stats.smallest = rows.front();
  stats.largest = rows.back();
  const size_t n = rows.size();
  stats.median = n % 2 == 1 ? static_cast<double>(rows[n / 2])
                            : (static_cast<double>(rows[n / 2 - 1]) + rows[n / 2]) / 2;
  return stats;
}

std::string optional_json(const std::optional<double>& x) { return x ? json_number(*x) : "null"; }

// `qkv index info`'s summary (and build's, with the seconds it took).
std::string summary(const StoreIndex& index, bool json, std::optional<double> seconds = {}) {
  const ListStats s = list_stats(index);
  const std::string dtype(store_dtype_name(index.dtype()));
  if (json) {
    return "{\"index\": " + json_string(index.dir()) +
           ", \"rows\": " + std::to_string(index.rows()) +
           ", \"key_dim\": " + std::to_string(index.key_dim()) +
           ", \"value_dim\": " + std::to_string(index.value_dim()) + ", \"dtype\": \"" + dtype +
           "\", \"lists\": " + std::to_string(index.lists().size()) +
           ", \"empty_lists\": " + std::to_string(s.empty) +
           ", \"list_rows_min\": " + std::to_string(s.smallest) +
           ", \"list_rows_median\": " + json_number(s.median) +
           ", \"list_rows_max\": " + std::to_string(s.largest) +
           ", \"radius_min\": " + optional_json(s.least_radius) +
           ", \"radius_max\": " + optional_json(s.greatest_radius) +
           (seconds ? ", \"seconds\": " + json_number(*seconds) : "") + "}\n";
  }
  std::string text = index.dir() + ": " + std::to_string(index.rows()) +
                     " rows, keys D = " + std::to_string(index.key_dim()) +
                     ", values Dv = " + std::to_string(index.value_dim()) + ", " + dtype + ", " +
                     std::to_string(index.lists().size()) +
                     (index.lists().size() == 1 ? " list" : " lists");
  if (!index.lists().empty()) {
    text += " of " + std::to_string(s.smallest) + " to " + std::to_string(s.largest) +
            " rows (median " + format_number(s.median, "%g") +
            (s.empty > 0 ? ", " + std::to_string(s.empty) + " empty" : "") + ")";
  }
  if (s.least_radius) {
    text += ", radii " + format_number(*s.least_radius, "%.3g") + " to " +
            format_number(*s.greatest_radius, "%.3g");
  }
  if (seconds) text += ", built in " + format_number(*seconds, "%.2f") + " s";
  return text + "\n";
}

void run_build(const IndexArgs& args) {
  check_index_out(args);
  apply_threads(args.threads);
  // The store's manifest and files' sizes now; the build reads every row.
  const KeyValueStore store = KeyValueStore::open(args.store, StoreCheck::kStructure);
  IndexBuildOptions options;
  if (args.lists) {
    if (*args.lists < 1 || *args.lists > store.rows()) {
      throw UsageError(
          "--lists " + std::to_string(*args.lists) + ": expected 1 <= L <= the store's rows (" +
          std::to_string(store.rows()) + ")" +
          (store.rows() > 0 ? "; without --lists, " +
                                  std::to_string(default_index_lists(store.rows())) + " (4 sqrt(N))"
                            : std::string()));
    }
    options.lists = *args.lists;
  }
  options.iterations = args.iterations;
  options.seed = args.seed;
  Progress progress("qkv index build", args.quiet);
  options.progress = report(progress);
  const auto start = std::chrono::steady_clock::now();
  const StoreIndex index = StoreIndex::build(store, args.index, options);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  progress.finish();
  std::cout << summary(index, args.json, seconds);
}

void run_verify(const IndexArgs& args) {
  const StoreIndex index = StoreIndex::open(args.index, StoreCheck::kStructure);
  Progress progress("qkv index verify", args.quiet);
  index.verify(report(progress));
  progress.finish();
  if (args.json) {
    std::cout << "{\"index\": " << json_string(index.dir())
              << ", \"ok\": true, \"rows\": " << index.rows()
              << ", \"lists\": " << index.lists().size() << "}\n";
  } else {
    std::cout << index.dir() << ": ok, every file matches its checksum (" << index.rows()
              << " rows in " << index.lists().size() << " lists)\n";
  }
}

void run_update(const IndexArgs& args) {
  apply_threads(args.threads);
  const KeyValueStore store = KeyValueStore::open(args.store, StoreCheck::kStructure);
  const int64_t before = StoreIndex::open(args.index, StoreCheck::kStructure).rows();
  Progress progress("qkv index update", args.quiet);
  const auto start = std::chrono::steady_clock::now();
  const StoreIndex index = StoreIndex::update(args.index, store, report(progress));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  progress.finish();
  // Rows added by this update (another process may have updated it meanwhile).
  const int64_t added = std::max<int64_t>(0, index.rows() - before);
  if (args.json) {
    std::string text = summary(index, true);
    text.insert(text.rfind('}'), ", \"added_rows\": " + std::to_string(added) +
                                     ", \"seconds\": " + json_number(seconds));
    std::cout << text;
  } else {
    std::string text = summary(index, false);
    text.insert(text.size() - 1, added == 0 ? std::string("; already current with the store")
                                            : "; " + std::to_string(added) + " rows added in " +
                                                  format_number(seconds, "%.2f") + " s");
    std::cout << text;
  }
}

void add_index_positional(CLI::App* app, IndexArgs& args) {
  require_path(app->add_option("index", args.index, "The index's directory"))
      ->type_name("INDEX")
      ->required();
}

}  // namespace

Command add_index_command(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand(
      "index",
      "An inverted-file index over a key-value store (k-means lists with centroids, radii and "
      "norms) for certified attention through fewer rows: build, update, info, verify");
  app->require_subcommand(1);
  struct Sub {
    CLI::App* app;
    std::shared_ptr<IndexArgs> args;
  };
  const auto sub = [&](const char* name, const char* help) {
    return Sub{app->add_subcommand(name, help), std::make_shared<IndexArgs>()};
  };

  const Sub build = sub("build",
                        "Build an index of a store: cluster a sample of its keys by k-means and "
                        "write its rows again, grouped by list");
  require_path(build.app->add_option("store", build.args->store, "The store to index"))
      ->type_name("STORE")
      ->required();
  require_path(build.app->add_option("--out", build.args->index,
                                     "The new index's directory (must not exist; outside the "
                                     "store)"))
      ->type_name("INDEX")
      ->required();
  require_integer(build.app->add_option("--lists", build.args->lists,
                                        "The number of lists, 1 <= L <= the store's rows "
                                        "(default 4 sqrt(N))"))
      ->type_name("L");
  require_integer(build.app->add_option("--iterations", build.args->iterations,
                                        "k-means rounds on the training sample, 0 <= N <= 1000"))
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000));
  add_seed_option(*build.app, build.args->seed,
                  "Selects the training sample (the same seed, store and options give the same "
                  "index)");
  add_threads_option(*build.app, build.args->threads);
  build.app->add_flag("--json", build.args->json, "Print the summary as JSON");
  build.app->add_flag("--quiet", build.args->quiet, "No progress on stderr");
  set_help_footer(*build.app, {"qkv index build kv --out kv-index --lists 4"},
                  "docs/cli.md#qkv-index");

  const Sub update = sub("update",
                         "Add the rows appended to the store since the index was built to their "
                         "nearest lists (no k-means; the index is written again)");
  add_index_positional(update.app, *update.args);
  require_path(update.app->add_option("--store", update.args->store,
                                      "The store the index was built over, with rows appended "
                                      "since"))
      ->type_name("STORE")
      ->required();
  add_threads_option(*update.app, update.args->threads);
  update.app->add_flag("--json", update.args->json, "Print the summary as JSON");
  update.app->add_flag("--quiet", update.args->quiet, "No progress on stderr");
  set_help_footer(*update.app,
                  {"qkv store append kv --keys keys.npy --values values.npy",
                   "qkv index update kv-index --store kv"},
                  "docs/cli.md#qkv-index");

  const Sub info = sub("info",
                       "Print an index's sizes, its lists' sizes and radii (checks its manifest "
                       "and files' sizes)");
  add_index_positional(info.app, *info.args);
  info.app->add_flag("--json", info.args->json, "Print the summary as JSON");
  set_help_footer(*info.app, {"qkv index info kv-index"}, "docs/cli.md#qkv-index");

  const Sub verify = sub("verify", "Check every file of an index against its checksum");
  add_index_positional(verify.app, *verify.args);
  verify.app->add_flag("--json", verify.args->json, "Print the result as JSON");
  verify.app->add_flag("--quiet", verify.args->quiet, "No progress on stderr");
  set_help_footer(*verify.app, {"qkv index verify kv-index"}, "docs/cli.md#qkv-index");
  set_help_footer(*app,
                  {"qkv index build kv --out kv-index --lists 4",
                   "qkv attend --store kv --index kv-index --queries queries.npy --out out.npy"},
                  "docs/cli.md#qkv-index and docs/scale.md");

  const auto run = [build, update, info, verify] {
    if (build.app->parsed()) {
      run_build(*build.args);
    } else if (update.app->parsed()) {
      run_update(*update.args);
    } else if (info.app->parsed()) {
      std::cout << summary(StoreIndex::open(info.args->index, StoreCheck::kStructure),
                           info.args->json);
    } else {
      run_verify(*verify.args);
    }
  };
  return {app, run};
}

}  // namespace qkv::cli
