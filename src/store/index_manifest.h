// The manifest of a store's index (qkv/index.h): what it holds, read and
// checked (its own checksum first, then every member) and written. Private
// to the library (index.cc); the fuzzer reads it too (fuzz/manifest_fuzz.cc).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/chunk_source.h"

namespace qkv {

// The index's files besides the manifest, in the manifest's order.
inline constexpr const char* kIndexFiles[] = {
    "centroids.npy", "list_rows.npy", "radii.npy",    "norms.npy",     "ids.npy",       "keys.npy",
    "values.npy",    "box_low.npy",   "box_high.npy", "block_low.npy", "block_high.npy"};
inline constexpr size_t kIndexFileCount = sizeof kIndexFiles / sizeof kIndexFiles[0];

struct IndexManifest {
  StoreDtype dtype = StoreDtype::kFloat32;
  int64_t key_dim = 0, value_dim = 0, rows = 0, lists = 0;
  // The store it was built over: its chunks then, and a fingerprint of them.
  int64_t store_chunks = 0;
  uint64_t store_fingerprint = 0;
  // The build's options.
  int64_t iterations = 0, sample_per_list = 0;
  uint64_t seed = 0;
  // Each file's XXH3-64, in kIndexFiles' order.
  std::vector<uint64_t> file_xxh3 = std::vector<uint64_t>(kIndexFileCount);
};

// Parses and checks a manifest's text; Error "<function>: <name>: ..." naming
// what is wrong (an edit is found by the checksum before any number is read).
IndexManifest parse_index_manifest(std::string_view function, std::string_view text,
                                   const std::string& name);
// The manifest's text: its members, then "xxh3", the XXH3-64 of the text
// without it.
std::string index_manifest_text(const IndexManifest& manifest);

}  // namespace qkv
