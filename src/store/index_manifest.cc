// The index's manifest (store/index_manifest.h), through nlohmann-json and
// the store's ManifestReader.
#include "store/index_manifest.h"

#include <algorithm>
#include <iterator>
#include <limits>

#include "store/manifest_json.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace qkv {
namespace {

constexpr const char* kFormat = "qkv store index";
// Version 2 added each list's bounding box (box_low.npy, box_high.npy),
// version 3 each block's (block_low.npy, block_high.npy).
constexpr int kVersion = 3;

// The manifest as JSON without its checksum: what the checksum is of.
Json manifest_body(const IndexManifest& m) {
  Json files = Json::object();
  for (size_t f = 0; f < kIndexFileCount; ++f) files[kIndexFiles[f]] = hex64(m.file_xxh3[f]);
  Json json;
  json["format"] = kFormat;
  json["version"] = kVersion;
  json["dtype"] = std::string(store_dtype_name(m.dtype));
  json["key_dim"] = m.key_dim;
  json["value_dim"] = m.value_dim;
  json["rows"] = m.rows;
  json["lists"] = m.lists;
  json["store"] = Json{{"chunks", m.store_chunks}, {"fingerprint", hex64(m.store_fingerprint)}};
  json["build"] = Json{{"iterations", m.iterations},
                       {"sample_per_list", m.sample_per_list},
                       {"seed", hex64(m.seed)}};
  json["files"] = files;
  return json;
}

}  // namespace

std::string index_manifest_text(const IndexManifest& manifest) {
  Json json = manifest_body(manifest);
  const std::string body = json.dump(1);
  json["xxh3"] = hex64(XXH3_64bits(body.data(), body.size()));
  return json.dump(1) + "\n";
}

IndexManifest parse_index_manifest(std::string_view function, std::string_view text,
                                   const std::string& name) {
  const ManifestReader in{function, name};
  Json json = in.parse(text,
                       {"format", "version", "dtype", "key_dim", "value_dim", "rows", "lists",
                        "store", "build", "files", "xxh3"},
                       kFormat, kVersion);
  // The checksum first: every number after it is what build() wrote.
  const uint64_t want = in.checksum(json, "xxh3", "");
  json.erase("xxh3");
  const std::string body = json.dump(1);
  const uint64_t got = XXH3_64bits(body.data(), body.size());
  if (got != want) {
    in.fail("its checksum \"xxh3\" " + hex64(want) + " does not match its contents' " + hex64(got) +
            " (the manifest was edited or damaged)");
  }
  IndexManifest m;
  m.dtype = in.dtype(json);
  // Sizes far past any machine, small enough that rows x dim x 4 fits in 64 bits.
  constexpr int64_t kMaxDim = int64_t{1} << 20, kMaxRows = int64_t{1} << 40;
  m.key_dim = in.integer(json, "key_dim", "", 1, kMaxDim);
  m.value_dim = in.integer(json, "value_dim", "", 1, kMaxDim);
  m.rows = in.integer(json, "rows", "", 0, kMaxRows);
  m.lists = in.integer(json, "lists", "", 0, m.rows);
  if ((m.lists == 0) != (m.rows == 0)) {
    in.fail("\"lists\" is " + std::to_string(m.lists) + " and \"rows\" " + std::to_string(m.rows) +
            "; expected both 0 or both at least 1");
  }
  const Json& store = in.member(json, "store", "");
  if (!store.is_object()) in.fail("\"store\" is a JSON " + std::string(store.type_name()));
  in.only(store, {"chunks", "fingerprint"}, "\"store\" ");
  m.store_chunks = in.integer(store, "chunks", "\"store\": ", 0, kMaxRows);
  m.store_fingerprint = in.checksum(store, "fingerprint", "\"store\": ");
  const Json& build = in.member(json, "build", "");
  if (!build.is_object()) in.fail("\"build\" is a JSON " + std::string(build.type_name()));
  in.only(build, {"iterations", "sample_per_list", "seed"}, "\"build\" ");
  m.iterations = in.integer(build, "iterations", "\"build\": ", 0, 1000);
  m.sample_per_list = in.integer(build, "sample_per_list", "\"build\": ", 1, int64_t{1} << 20);
  m.seed = in.checksum(build, "seed", "\"build\": ");
  const Json& files = in.member(json, "files", "");
  if (!files.is_object()) in.fail("\"files\" is a JSON " + std::string(files.type_name()));
  for (const auto& item : files.items()) {
    if (std::find(std::begin(kIndexFiles), std::end(kIndexFiles), item.key()) ==
        std::end(kIndexFiles)) {
      in.fail("\"files\" has an unknown member \"" + item.key() + "\"");
    }
  }
  for (size_t f = 0; f < kIndexFileCount; ++f) {
    m.file_xxh3[f] = in.checksum(files, kIndexFiles[f], "\"files\": ");
  }
  return m;
}

}  // namespace qkv
