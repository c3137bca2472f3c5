// libFuzzer harness for the key-value store's manifest reader
// (KeyValueStore::parse_manifest): any input either parses or throws
// qkv::Error (anything else is a crash), and whatever parses must survive a
// write/parse round trip to the same text.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "qkv/error.h"
#include "qkv/store.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::string written;
  try {
    written = qkv::KeyValueStore::parse_manifest(text, "fuzz.json").manifest_text();
  } catch (const qkv::Error&) {
    return 0;  // bad input, reported as it should be
  }
  const std::string again =
      qkv::KeyValueStore::parse_manifest(written, "round-trip.json").manifest_text();
  if (again != written) std::abort();
  return 0;
}
