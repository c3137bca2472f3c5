// A search index's metadata files, read strictly (index.h has the layout):
// manifest.json, every number it is read for checked and the whole manifest
// covered by its own checksum, and packages.json. Apart from index.cc so the
// fuzzer (fuzz/index_fuzz.cc) compiles the readers alone.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace qkv::search {

inline constexpr const char* kIndexFormat = "qkv search index";
inline constexpr int kIndexVersion = 2;
// The hybrid's fusions (index.cc's Fusion), as the manifest names them.
inline constexpr const char* kFusionNames[] = {"linear", "normalized", "ranks"};
// The sentence encoder's files, as an index holds them under model/.
inline constexpr const char* kModelFiles[] = {"config.json", "1_Pooling/config.json",
                                              "sentence_bert_config.json", "vocab.txt",
                                              "model.safetensors"};
// The files the manifest keeps checksums of (the store keeps its own):
// packages.json, query_head.npy, bm25.sqlite and model/ each of kModelFiles.
std::vector<std::string> index_checked_files();
// Bounds of the manifest's numbers: far past what training gives (score
// scale 20, hybrid weights up to 50, 384 dimensions), short of what
// overflows a score.
inline constexpr double kMaxScoreScale = 1e6, kMaxHybridWeight = 1e6;
inline constexpr int64_t kMaxDim = 1 << 16;

// What open() uses of the manifest.
struct IndexManifest {
  int64_t dim = 0;                    // the encoder's hidden size, in [1, kMaxDim]
  double score_scale = 1.0;           // in (0, kMaxScoreScale]
  int hybrid_fusion = 0;              // an index into kFusionNames
  double hybrid_weight = 1.0;         // in [0, kMaxHybridWeight]
  std::vector<std::string> sections;  // at least one, none empty
  std::map<std::string, std::string>
      files;  // each of index_checked_files(): its XXH3-64, 16 hex digits
};

// The manifest's text: `manifest` (an object without "xxh3") with one more
// member, last, "xxh3": the XXH3-64 of manifest.dump() (no indent, as
// nlohmann writes it), which a reader forms again from what it parsed, so
// any change of content is found and a change of layout is not.
std::string index_manifest_text(const nlohmann::ordered_json& manifest);

// Parses and checks manifest.json's text (`name` is its path, for messages);
// Error "SearchIndex::open: NAME: ..." naming the member and its value.
IndexManifest parse_index_manifest(std::string_view text, const std::string& name);

struct IndexedPackage {
  std::string name, short_description, section;
  bool held_out = false;
};

// Parses packages.json: an array of objects with a string "name",
// "short_description" and "section" and a boolean "held_out"; Error naming
// `name` and the element.
std::vector<IndexedPackage> parse_packages(std::string_view text, const std::string& name);

}  // namespace qkv::search
