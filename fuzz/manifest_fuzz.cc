// libFuzzer harness for the manifest readers of the key-value store
// (KeyValueStore::parse_manifest) and of its index (parse_index_manifest):
// any input either parses or throws qkv::Error (anything else is a crash),
// and whatever parses must survive a write/parse round trip to the same
// text. The index's manifest carries its own checksum, which random bytes
// almost never match; so each input also goes to it as the manifest's body,
// given the checksum of the body as the index writes it, which lets the
// fuzzer reach every check after the checksum's.
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "qkv/error.h"
#include "qkv/store.h"
#include "store/index_manifest.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace {

void store_manifest(std::string_view text) {
  std::string written;
  try {
    written = qkv::KeyValueStore::parse_manifest(text, "fuzz.json").manifest_text();
  } catch (const qkv::Error&) {
    return;  // bad input, reported as it should be
  }
  const std::string again =
      qkv::KeyValueStore::parse_manifest(written, "round-trip.json").manifest_text();
  if (again != written) std::abort();
}

void index_manifest(std::string_view text) {
  std::string written;
  try {
    written = qkv::index_manifest_text(qkv::parse_index_manifest("fuzz", text, "fuzz.json"));
  } catch (const qkv::Error&) {
    return;
  }
  const std::string again =
      qkv::index_manifest_text(qkv::parse_index_manifest("fuzz", written, "round-trip.json"));
  if (again != written) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  store_manifest(text);
  index_manifest(text);
  // The input as the body of an index's manifest, with the checksum it needs.
  using Json = nlohmann::ordered_json;
  const Json body = Json::parse(text.begin(), text.end(), nullptr, false);
  if (body.is_object() && !body.contains("xxh3")) {
    Json json = body;
    const std::string dumped = body.dump(1, ' ', false, Json::error_handler_t::replace);
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx",
                  static_cast<unsigned long long>(XXH3_64bits(dumped.data(), dumped.size())));
    json["xxh3"] = hex;
    index_manifest(json.dump(1, ' ', false, Json::error_handler_t::replace));
  }
  return 0;
}
