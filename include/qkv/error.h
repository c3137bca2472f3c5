// qkv::Error, the library's exception for bad arguments and bad input files,
// qkv::IoError for failures of the system underneath (a full disk, a helper
// program that fails), and the helpers that build their messages so that
// every message reads alike:
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

// Thrown when the arguments were fine but the system failed the call: a write
// that runs out of disk space, a file that cannot be renamed into place,
// gnuplot dying while it draws. Retrying elsewhere or later may succeed; the
// qkv command exits with status 1 for it (status 2 for Error).
class IoError : public std::runtime_error {
 public:
  explicit IoError(const std::string& message) : std::runtime_error(message) {}
};

// Throws Error("<function>: <message>").
[[noreturn]] void fail(std::string_view function, std::string_view message);
// Throws IoError("<function>: <message>").
[[noreturn]] void fail_io(std::string_view function, std::string_view message);

}  // namespace qkv
