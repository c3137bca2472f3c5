// libFuzzer harness for the .npy reader: any input either parses or throws
// qkv::Error (anything else is a crash), and whatever parses must survive a
// write/parse round trip bit for bit.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <variant>

#include "qkv/error.h"
#include "qkv/npy.h"

namespace {

// Same dtype, same shape, same bytes (bytes, so NaN payloads count too).
bool same(const qkv::NpyArray& a, const qkv::NpyArray& b) {
  if (a.index() != b.index()) return false;
  return std::visit(
      [&](const auto& x) {
        const auto& y = std::get<std::decay_t<decltype(x)>>(b);
        if (!(x.shape() == y.shape()) || x.values().size() != y.values().size()) return false;
        // memcmp must not see the null data() of an empty vector.
        return x.values().empty() || std::memcmp(x.values().data(), y.values().data(),
                                                 x.values().size() * sizeof(x.values()[0])) == 0;
      },
      a);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  qkv::NpyArray array;
  try {
    array = qkv::parse_npy(data, size, "fuzz.npy");
  } catch (const qkv::Error&) {
    return 0;  // bad input, reported as it should be
  }
  std::string bytes = std::visit([](const auto& t) { return qkv::npy_bytes(t.view()); }, array);
  qkv::NpyArray again = qkv::parse_npy(bytes.data(), bytes.size(), "round-trip.npy");
  if (!same(array, again)) std::abort();
  return 0;
}
