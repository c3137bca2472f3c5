// qkv::fail and qkv::fail_io: the one place error messages get their
// "<function>: " prefix.
#include "qkv/error.h"

namespace qkv {
namespace {

// An empty `function` (a caller such as the qkv command that names the
// output by its option instead) gives the message alone.
std::string prefixed(std::string_view function, std::string_view message) {
  if (function.empty()) return std::string(message);
  std::string text;
  text.reserve(function.size() + 2 + message.size());
  text.append(function).append(": ").append(message);
  return text;
}

}  // namespace

void fail(std::string_view function, std::string_view message) {
  throw Error(prefixed(function, message));
}

void fail_io(std::string_view function, std::string_view message) {
  throw IoError(prefixed(function, message));
}

}  // namespace qkv
