// `qkv store`: the on-disk key-value store (qkv/store.h) from the command
// line: create, append, info, verify.
//   keys: (N, D)   values: (N, Dv), float32 or float64 .npy (stored as float32 or bfloat16)
#include "qkv/store.h"

#include <CLI/CLI.hpp>
#include <charconv>
#include <cmath>
#include <iostream>
#include <memory>
#include <optional>
#include <string>

#include "common.h"
#include "progress.h"

namespace qkv::cli {
namespace {

struct StoreArgs {
  std::string store;  // the positional STORE (create: also the deprecated --out)
  std::string keys, values;
  std::string dtype = "float32";
  int64_t chunk_rows = kDefaultChunkRows;
  bool json = false, quiet = false;
};

// Keys (N, D) and values (N, Dv) from .npy files as float32; float64 is
// rounded (the store holds float32 or bfloat16), and a float64 value beyond
// float32's range is a usage error, not an inf in the store.
struct Rows {
  Tensor<float> keys, values;
};

Tensor<float> as_float32(FloatTensor tensor, const Input& input) {
  if (auto* f = std::get_if<Tensor<float>>(&tensor)) return std::move(*f);
  const Tensor<double>& d = std::get<Tensor<double>>(tensor);
  Tensor<float> f(d.shape());
  for (int64_t i = 0; i < d.numel(); ++i) {
    f.data()[i] = static_cast<float>(d.data()[i]);
    if (std::isfinite(d.data()[i]) && !std::isfinite(f.data()[i])) {
      char value[32];  // the shortest text that reads back as the same double
      const auto written = std::to_chars(value, value + sizeof value, d.data()[i]);
      const std::string at = d.rank() == 2 ? "[" + std::to_string(i / d.size(1)) + ", " +
                                                 std::to_string(i % d.size(1)) + "]"
                                           : std::to_string(i) + " (flat index)";
      throw UsageError(input.describe() + ": element " + at + " is " +
                       std::string(value, written.ptr) +
                       ", beyond float32's range (about ±3.4e38); the store holds float32");
    }
  }
  return f;
}

Rows read_rows(const StoreArgs& args) {
  const Input keys{"--keys", args.keys}, values{"--values", args.values};
  Rows rows{as_float32(load_float(keys), keys), as_float32(load_float(values), values)};
  if (rows.keys.rank() != 2 || rows.values.rank() != 2 ||
      rows.keys.size(0) != rows.values.size(0)) {
    throw UsageError(keys.describe() + " has shape " + rows.keys.shape().str() + " and " +
                     values.describe() + " has shape " + rows.values.shape().str() +
                     "; expected keys (N, D) and values (N, Dv) with the same N");
  }
  return rows;
}

std::string summary(const KeyValueStore& store, bool json) {
  if (json) {
    return "{\"store\": " + json_string(store.dir()) +
           ", \"rows\": " + std::to_string(store.rows()) +
           ", \"key_dim\": " + std::to_string(store.key_dim()) +
           ", \"value_dim\": " + std::to_string(store.value_dim()) + ", \"dtype\": \"" +
           std::string(store_dtype_name(store.dtype())) +
           "\", \"chunk_rows\": " + std::to_string(store.chunk_rows()) +
           ", \"chunks\": " + std::to_string(store.chunks().size()) +
           ", \"bytes\": " + std::to_string(store.file_bytes()) + "}\n";
  }
  return store.dir() + ": " + std::to_string(store.rows()) +
         " rows, keys D = " + std::to_string(store.key_dim()) +
         ", values Dv = " + std::to_string(store.value_dim()) + ", " +
         std::string(store_dtype_name(store.dtype())) + ", " +
         std::to_string(store.chunks().size()) + " chunks of at most " +
         std::to_string(store.chunk_rows()) + " rows, " + std::to_string(store.file_bytes()) +
         " bytes\n";
}

void add_rows_options(CLI::App* app, StoreArgs& args) {
  require_path(app->add_option("--keys", args.keys, "Keys K.npy: (N, D), float32 or float64"))
      ->type_name("K.npy")
      ->required();
  require_path(
      app->add_option("--values", args.values, "Values V.npy: (N, Dv), float32 or float64"))
      ->type_name("V.npy")
      ->required();
}

void add_common_options(CLI::App* app, StoreArgs& args, bool progress) {
  app->add_flag("--json", args.json, "Print the summary as JSON");
  if (progress) app->add_flag("--quiet", args.quiet, "No progress on stderr");
}

void add_store_positional(CLI::App* app, StoreArgs& args) {
  require_path(app->add_option("store", args.store, "The store's directory"))
      ->type_name("STORE")
      ->required();
}

}  // namespace

Command add_store_command(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand(
      "store",
      "An on-disk key-value store for attention (a directory of .npy chunks and a manifest with "
      "their checksums): create, append, info, verify");
  app->require_subcommand(1);
  struct Sub {
    CLI::App* app;
    std::shared_ptr<StoreArgs> args;
  };
  const auto sub = [&](const char* name, const char* help) {
    return Sub{app->add_subcommand(name, help), std::make_shared<StoreArgs>()};
  };

  const Sub create = sub("create", "Create a new store from keys and values");
  CLI::Option* store = require_path(create.app->add_option(
      "store", create.args->store, "The new store's directory (must not exist)"));
  store->type_name("STORE");
  require_path(add_deprecated_option(*create.app, "store create", "--out", "STORE (positional)",
                                     store, create.args->store))
      ->type_name("STORE");
  add_rows_options(create.app, *create.args);
  create.app
      ->add_option("--dtype", create.args->dtype, "How the rows are stored: float32 or bfloat16")
      ->type_name("DTYPE")
      ->capture_default_str()
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  require_integer(create.app->add_option("--chunk-rows", create.args->chunk_rows,
                                         "Rows per chunk file, >= 1 (the last may hold fewer)"))
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 36));
  add_common_options(create.app, *create.args, true);
  set_help_footer(*create.app, {"qkv store create kv --keys keys.npy --values values.npy"},
                  "docs/cli.md#qkv-store");

  const Sub append = sub("append", "Append rows to a store, atomically");
  add_store_positional(append.app, *append.args);
  add_rows_options(append.app, *append.args);
  add_common_options(append.app, *append.args, true);
  set_help_footer(*append.app, {"qkv store append kv --keys keys.npy --values values.npy"},
                  "docs/cli.md#qkv-store");

  const Sub info = sub("info", "Print a store's sizes (checks its manifest and files' sizes)");
  add_store_positional(info.app, *info.args);
  add_common_options(info.app, *info.args, false);
  set_help_footer(*info.app, {"qkv store info kv", "qkv store info kv --json"},
                  "docs/cli.md#qkv-store");

  const Sub verify = sub("verify", "Check every chunk file against its checksum");
  add_store_positional(verify.app, *verify.args);
  add_common_options(verify.app, *verify.args, true);
  set_help_footer(*verify.app, {"qkv store verify kv"}, "docs/cli.md#qkv-store");
  set_help_footer(*app,
                  {"qkv store create kv --keys keys.npy --values values.npy",
                   "qkv attend --store kv --queries queries.npy --top-k 3 --top-ids ids.npy "
                   "--out out.npy"},
                  "docs/cli.md#qkv-store and docs/scale.md");

  const auto run = [create, append, info, verify] {
    if (create.app->parsed()) {
      const StoreArgs& args = *create.args;
      // STORE or the deprecated --out, one of them (CLI11 refuses both).
      if (args.store.empty()) throw UsageError("STORE is required: the new store's directory");
      const Rows rows = read_rows(args);
      Progress progress("qkv store create", args.quiet);
      const KeyValueStore store = KeyValueStore::create(
          args.store, rows.keys.view(), rows.values.view(),
          args.dtype == "bfloat16" ? StoreDtype::kBFloat16 : StoreDtype::kFloat32, args.chunk_rows,
          report(progress));
      progress.finish();
      std::cout << summary(store, args.json);
    } else if (append.app->parsed()) {
      const StoreArgs& args = *append.args;
      KeyValueStore store = KeyValueStore::open(args.store, StoreCheck::kStructure);
      const Rows rows = read_rows(args);
      Progress progress("qkv store append", args.quiet);
      store.append(rows.keys.view(), rows.values.view(), report(progress));
      progress.finish();
      std::cout << summary(store, args.json);
    } else if (info.app->parsed()) {
      std::cout << summary(KeyValueStore::open(info.args->store, StoreCheck::kStructure),
                           info.args->json);
    } else {
      const StoreArgs& args = *verify.args;
      Progress progress("qkv store verify", args.quiet);
      const KeyValueStore store =
          KeyValueStore::open(args.store, StoreCheck::kChecksums, report(progress));
      progress.finish();
      if (args.json) {
        std::cout << "{\"store\": " << json_string(store.dir())
                  << ", \"ok\": true, \"chunks\": " << store.chunks().size()
                  << ", \"bytes\": " << store.file_bytes() << "}\n";
      } else {
        std::cout << store.dir() << ": ok, " << store.chunks().size()
                  << " chunks match their checksums (" << store.file_bytes() << " bytes)\n";
      }
    }
  };
  return {app, run};
}

}  // namespace qkv::cli
