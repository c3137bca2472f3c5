// qkv::fail: the one place error messages get their "<function>: " prefix.
#include "qkv/error.h"

namespace qkv {

void fail(std::string_view function, std::string_view message) {
  std::string text;
  text.reserve(function.size() + 2 + message.size());
  text.append(function).append(": ").append(message);
  throw Error(text);
}

}  // namespace qkv
