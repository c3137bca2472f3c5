// `qkv lookup`: the key-value database of d2l §11.1 — a table of (key, value)
// records (CSV, or the chapter's six names) queried by exact match, approximate
// match (attention over n-gram similarity) or average pooling; prints the
// weight of every record and the top-k records.
#include "qkv/lookup.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "csv.h"
#include "qkv/error.h"

namespace qkv::cli {
namespace {

struct LookupArgs {
  std::string query, table, mode = "approximate";
  std::optional<double> temperature;
  int top = 3;
  std::vector<std::string> remove;
  bool json = false;
};

// The table from --table (header with columns "key" and "value"; others are
// ignored), or the chapter's names.
std::vector<Record> load_table(const std::string& path) {
  if (path.empty()) return KeyValueDatabase::chapter_records();
  OpenInput file({"--table", path});
  const CsvFile csv = CsvFile::read(file.fd(), path);
  const std::optional<int> key = csv.find("key"), value = csv.find("value");
  if (!key || !value) {
    throw UsageError("--table " + path + ": the header must name the columns key and value");
  }
  std::vector<Record> records;
  for (std::vector<std::string>& row : csv.text({*key, *value})) {
    records.push_back({std::move(row[0]), std::move(row[1])});
  }
  return records;
}

std::string pad(const std::string& text, size_t width) {
  return text + std::string(width > text.size() ? width - text.size() : 0, ' ');
}

void run_lookup(const LookupArgs& args) {
  const LookupMode mode = args.mode == "exact"     ? LookupMode::kExact
                          : args.mode == "average" ? LookupMode::kAverage
                                                   : LookupMode::kApproximate;
  if (args.temperature && mode != LookupMode::kApproximate) {
    throw UsageError("--temperature applies to --mode approximate only");
  }
  const double temperature = args.temperature.value_or(KeyValueDatabase::kDefaultTemperature);
  if (!std::isfinite(temperature) || temperature <= 0) {
    throw UsageError("--temperature must be a finite number > 0, got " + exact_number(temperature));
  }
  if (args.top < 1) throw UsageError("--top-k must be >= 1, got " + std::to_string(args.top));

  std::optional<KeyValueDatabase> db;
  try {
    db.emplace(load_table(args.table));
  } catch (const qkv::Error& e) {
    if (args.table.empty()) throw;
    throw qkv::Error("--table " + args.table + ": " + e.what());
  }
  for (const std::string& key : args.remove) {
    if (!db->remove(key)) throw UsageError("--remove: no record with key \"" + key + "\"");
  }
  const LookupResult result = db->lookup(args.query, mode, temperature);
  if (mode == LookupMode::kExact && !result.match) {
    throw std::runtime_error("no record with key \"" + args.query + "\"");
  }
  const std::vector<Record>& records = db->records();
  const std::vector<size_t> top = top_k(result.weights, args.top);

  if (args.json) {
    std::string json = "{\"query\": " + json_string(args.query) +
                       ", \"mode\": " + json_string(args.mode) + ", \"temperature\": " +
                       (mode == LookupMode::kApproximate ? json_number(temperature) : "null") +
                       ", \"match\": ";
    json += result.match ? "{\"key\": " + json_string(records[*result.match].key) +
                               ", \"value\": " + json_string(records[*result.match].value) + "}"
                         : "null";
    json += ", \"records\": [";
    for (size_t j = 0; j < records.size(); ++j) {
      json += std::string(j == 0 ? "" : ", ") + "{\"key\": " + json_string(records[j].key) +
              ", \"value\": " + json_string(records[j].value) +
              ", \"weight\": " + json_number(result.weights[j]) + "}";
    }
    json += "], \"top\": [";
    for (size_t r = 0; r < top.size(); ++r) {
      const size_t j = top[r];
      json += std::string(r == 0 ? "" : ", ") + "{\"rank\": " + std::to_string(r + 1) +
              ", \"key\": " + json_string(records[j].key) +
              ", \"value\": " + json_string(records[j].value) +
              ", \"weight\": " + json_number(result.weights[j]) + "}";
    }
    std::cout << json << "]}\n";
    return;
  }

  size_t key_width = 3, value_width = 5;
  for (const Record& r : records) {
    key_width = std::max(key_width, r.key.size());
    value_width = std::max(value_width, r.value.size());
  }
  std::cout << "query \"" << args.query << "\", mode " << args.mode;
  if (mode == LookupMode::kApproximate)
    std::cout << ", temperature " << format_number(temperature, "%g");
  std::cout << ", " << records.size() << (records.size() == 1 ? " record" : " records") << '\n';
  if (result.match) {
    std::cout << "match: " << records[*result.match].key << " -> " << records[*result.match].value
              << '\n';
  }
  std::cout << "\nweights\n  " << pad("key", key_width) << "  " << pad("value", value_width)
            << "  weight\n";
  for (size_t j = 0; j < records.size(); ++j) {
    std::cout << "  " << pad(records[j].key, key_width) << "  "
              << pad(records[j].value, value_width) << "  "
              << format_number(result.weights[j], "%.6f") << '\n';
  }
  std::cout << "\ntop " << top.size() << "\n  rank  " << pad("key", key_width) << "  "
            << pad("value", value_width) << "  weight\n";
  for (size_t r = 0; r < top.size(); ++r) {
    const size_t j = top[r];
    std::cout << "  " << pad(std::to_string(r + 1), 4) << "  " << pad(records[j].key, key_width)
              << "  " << pad(records[j].value, value_width) << "  "
              << format_number(result.weights[j], "%.6f") << '\n';
  }
}

}  // namespace

Command add_lookup_command(CLI::App& parent) {
  auto args = std::make_shared<LookupArgs>();
  CLI::App* app = parent.add_subcommand(
      "lookup",
      "Query the key-value database of d2l 11.1 (default: the chapter's six names) by exact "
      "match, approximate match (attention over key similarity) or average pooling");
  app->add_option("--query", args->query, "The query string")->required();
  require_path(app->add_option("--table", args->table,
                               "CSV of records with header columns key and value (default: the "
                               "chapter's six names)"))
      ->type_name("FILE.csv");
  app->add_option("--mode", args->mode, "exact, approximate (default) or average")
      ->check(CLI::IsMember({"exact", "approximate", "average"}))
      ->type_name("MODE");
  require_number(app->add_option("--temperature", args->temperature,
                                 "Softmax temperature of approximate match, > 0 (default 0.1)"))
      ->type_name("T");
  CLI::Option* top_k = require_integer(
      app->add_option("--top-k", args->top, "How many records to rank, K >= 1 (default 3)"));
  top_k->type_name("K")->check(CLI::Range(1, std::numeric_limits<int>::max()));
  require_integer(add_deprecated_option(*app, "lookup", "--top", "--top-k K", top_k, args->top))
      ->type_name("K")
      ->check(CLI::Range(1, std::numeric_limits<int>::max()));
  app->add_option("--remove", args->remove, "Remove the records with these keys first")
      ->type_name("KEY");
  app->add_flag("--json", args->json, "Print the result as JSON");
  return {app, [args] { run_lookup(*args); }};
}

}  // namespace qkv::cli
