// `qkv lookup`: the key-value database of d2l §11.1 — a table of (key, value)
// records (CSV, or the chapter's six names) queried by exact match, approximate
// match (attention over n-gram similarity, through the n-gram index) or
// average pooling; prints the top-k records, and with --all every record's
// weight.
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
  bool json = false, all = false;
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
  // Room for every row at once: growing by doubling moved the records 16
  // times and touched twice their 4 MB (63,697 rows: a run took 980 more
  // page faults, about 1 ms).
  records.reserve(csv.max_rows());
  csv.for_each_text({*key, *value}, [&](const std::vector<std::string_view>& row) {
    records.push_back({std::string(row[0]), std::string(row[1])});
  });
  return records;
}

std::string pad(const std::string& text, size_t width) {
  return text + std::string(width > text.size() ? width - text.size() : 0, ' ');
}

std::string json_record(const Record& r, double weight) {
  return "\"key\": " + json_string(r.key) + ", \"value\": " + json_string(r.value) +
         ", \"weight\": " + json_number(weight);
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
  // The top K through the index (no weight per record); with --all, every
  // record's weight too. Both are the same numbers, bit for bit.
  const TopK top = db->top(args.query, mode, args.top, temperature);
  if (mode == LookupMode::kExact && !top.match) {
    throw std::runtime_error("no record with key \"" + args.query + "\"");
  }
  std::vector<double> all;
  if (args.all) all = db->lookup(args.query, mode, temperature).weights;
  const std::vector<Record>& records = db->records();
  if (args.json) {
    std::string json = "{\"query\": " + json_string(args.query) +
                       ", \"mode\": " + json_string(args.mode) + ", \"temperature\": " +
                       (mode == LookupMode::kApproximate ? json_number(temperature) : "null") +
                       ", \"num_records\": " + std::to_string(records.size()) + ", \"match\": ";
    json += top.match ? "{\"key\": " + json_string(records[*top.match].key) +
                            ", \"value\": " + json_string(records[*top.match].value) + "}"
                      : "null";
    if (args.all) {
      json += ", \"records\": [";
      for (size_t j = 0; j < records.size(); ++j) {
        json += std::string(j == 0 ? "{" : ", {") + json_record(records[j], all[j]) + "}";
      }
      json += "]";
    }
    json += ", \"top\": [";
    for (size_t r = 0; r < top.records.size(); ++r) {
      const Ranked& t = top.records[r];
      json += std::string(r == 0 ? "" : ", ") + "{\"rank\": " + std::to_string(r + 1) + ", " +
              json_record(records[t.index], t.weight) + "}";
    }
    std::cout << json << "]}\n";
    return;
  }

  // Columns as wide as the longest key and value printed.
  size_t key_width = 3, value_width = 5;
  const auto widen = [&](const Record& r) {
    key_width = std::max(key_width, r.key.size());
    value_width = std::max(value_width, r.value.size());
  };
  if (args.all) {
    for (const Record& r : records) widen(r);
  }
  for (const Ranked& t : top.records) widen(records[t.index]);
  std::string out = "query \"" + args.query + "\", mode " + args.mode;
  if (mode == LookupMode::kApproximate) out += ", temperature " + format_number(temperature, "%g");
  out +=
      ", " + std::to_string(records.size()) + (records.size() == 1 ? " record" : " records") + '\n';
  if (top.match) {
    out += "match: " + records[*top.match].key + " -> " + records[*top.match].value + '\n';
  }
  const auto line = [&](const std::string& rank, const Record& r, const std::string& weight) {
    out += "  " + rank + pad(r.key, key_width) + "  " + pad(r.value, value_width) + "  " + weight +
           '\n';
  };
  if (args.all) {
    out += "\nweights\n";
    line("", {"key", "value"}, "weight");
    for (size_t j = 0; j < records.size(); ++j) {
      line("", records[j], format_number(all[j], "%.6f"));
      if (out.size() >= (size_t{1} << 16)) {  // written as it goes: 63,697 lines are 10-28 MB
        std::cout << out;
        out.clear();
      }
    }
  }
  out += "\ntop " + std::to_string(top.records.size()) + '\n';
  line("rank  ", {"key", "value"}, "weight");
  for (size_t r = 0; r < top.records.size(); ++r) {
    const Ranked& t = top.records[r];
    line(pad(std::to_string(r + 1), 4) + "  ", records[t.index], format_number(t.weight, "%.6f"));
  }
  std::cout << out;
}

}  // namespace

Command add_lookup_command(CLI::App& parent) {
  auto args = std::make_shared<LookupArgs>();
  CLI::App* app = parent.add_subcommand(
      "lookup",
      "Query the key-value database of d2l 11.1 (default: the chapter's six names) by exact "
      "match, approximate match (attention over key similarity, through an n-gram index) or "
      "average pooling; prints the K records of largest weight");
  app->add_option("--query", args->query, "The query string")->type_name("QUERY")->required();
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
  CLI::Option* top_k = require_integer(app->add_option(
      "--top-k", args->top, "How many records to print, best first, K >= 1 (default 3)"));
  top_k->type_name("K")->check(CLI::Range(1, std::numeric_limits<int>::max()));
  require_integer(add_deprecated_option(*app, "lookup", "--top", "--top-k K", top_k, args->top))
      ->type_name("K")
      ->check(CLI::Range(1, std::numeric_limits<int>::max()));
  app->add_option("--remove", args->remove, "Remove the records with these keys first")
      ->type_name("KEY");
  app->add_flag("--all", args->all,
                "Also print every record's weight, in table order (default: the top K only)");
  app->add_flag("--json", args->json, "Print the result as JSON");
  set_help_footer(*app,
                  {"qkv lookup --query Alise", "qkv lookup --query Lipton --mode exact --json"},
                  "docs/cli.md#qkv-lookup");
  return {app, [args] { run_lookup(*args); }};
}

}  // namespace qkv::cli
