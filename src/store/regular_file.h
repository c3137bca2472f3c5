// Reading a store's files: only regular ones. Private to the library
// (store.cc, mapped_file.cc).
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>

namespace qkv {

// What a file that is not a regular one is, for messages: "a FIFO", ...
std::string kind_of(mode_t mode);

// Opens `path` for reading if it is a regular file, else Error naming it and
// what it is. O_NONBLOCK, so a FIFO without a writer does not block the
// open itself (for a regular file it changes nothing); a device such as
// /dev/zero is refused before a byte is read.
int open_regular_file(std::string_view function, const std::string& path);

}  // namespace qkv
