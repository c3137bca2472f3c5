// Reading the files of a store and of its index: only regular ones, their
// .npy headers checked against what the manifest says. Private to the
// library (store.cc, index.cc, mapped_file.cc).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <string>
#include <string_view>

#include "io/npy_header.h"
#include "qkv/store.h"
#include "qkv/tensor.h"

namespace qkv {

// What a file that is not a regular one is, for messages: "a FIFO", ...
std::string kind_of(mode_t mode);

// Opens `path` for reading if it is a regular file, else Error naming it and
// what it is. O_NONBLOCK, so a FIFO without a writer does not block the
// open itself (for a regular file it changes nothing); a device such as
// /dev/zero is refused before a byte is read.
int open_regular_file(std::string_view function, const std::string& path);

// The whole of a regular file (a manifest) as text; Error naming it if it
// cannot be read or is longer than `max_bytes` ("larger than ...; not
// <what>").
std::string read_text_file(std::string_view function, const std::string& path, size_t max_bytes,
                           std::string_view what);

// The .npy header of a mapped `file` that the manifest says holds `descr`
// `shape`; Error naming the file otherwise, told as `function`'s: "(the
// <what> file is damaged or truncated)", or "(the <what> file was replaced)".
NpyHeader checked_npy_header(std::string_view function, const MappedFile& file,
                             std::string_view descr, const Shape& shape, std::string_view what);

}  // namespace qkv
