// qkv::Error, the one exception type of the library, and the helpers that
// build its messages so that every message reads alike:
//   "<function>: <argument> has shape [..] but <other> has shape [..]; expected .."
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace qkv {

// Thrown for bad arguments and bad input files. Derived from
// std::invalid_argument so callers that only know the standard library can
// still catch it; Python bindings turn it into ValueError.
class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& message) : std::invalid_argument(message) {}
};

// Throws Error("<function>: <message>").
[[noreturn]] void fail(std::string_view function, std::string_view message);

}  // namespace qkv
