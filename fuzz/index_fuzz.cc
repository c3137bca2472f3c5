// libFuzzer harness for the search index's readers: the first byte picks
// one, the rest is its input.
//   0  parse_index_manifest (manifest.json): parses or throws qkv::Error,
//      and what parses is in range (the fuzzer reaches the range checks
//      because the checksum is checked last)
//   1  parse_packages (packages.json): parses or throws qkv::Error
//   2  for_each_posting (a BM25 postings blob): two bytes of the document
//      count and two of the postings count said, then the blob; every
//      posting it hands out is a document in range with a count >= 1
//   3  parse_safetensors_header (the sentence encoder's model.safetensors):
//      parses or throws qkv::Error, and every tensor it accepts lies inside
//      the data with its element count's bytes
// Anything else (a crash, an exception of another type) is a failure.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "qkv/error.h"
#include "search/index_files.h"
#include "search/postings.h"
#include "search/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t reader = data[0] % 4;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  try {
    if (reader == 0) {
      const qkv::search::IndexManifest m =
          qkv::search::parse_index_manifest(text, "fuzz/manifest.json");
      if (!(m.score_scale > 0 && m.score_scale <= qkv::search::kMaxScoreScale) ||
          !(m.hybrid_weight >= 0 && m.hybrid_weight <= qkv::search::kMaxHybridWeight) ||
          m.dim < 1 || m.dim > qkv::search::kMaxDim || m.hybrid_fusion < 0 || m.hybrid_fusion > 2 ||
          m.sections.empty())
        std::abort();
    } else if (reader == 1) {
      qkv::search::parse_packages(text, "fuzz/packages.json");
    } else if (reader == 3) {
      const size_t bytes = size - 1;
      const auto entries =
          qkv::search::parse_safetensors_header(data + 1, bytes, "fuzz.safetensors");
      for (const auto& [name, e] : entries) {
        if (e.begin > e.end || e.end > bytes) std::abort();
      }
    } else {
      if (size < 5) return 0;
      const int64_t documents = data[1] | (data[2] << 8), hits = data[3] | (data[4] << 8);
      int64_t seen = 0;
      qkv::search::for_each_posting(
          data + 5, data + size, hits, documents, [&](size_t doc, uint64_t count) {
            if (static_cast<int64_t>(doc) >= documents || count < 1 || ++seen > hits) std::abort();
          });
    }
  } catch (const qkv::Error&) {
    return 0;  // bad input, reported as it should be
  }
  return 0;
}
