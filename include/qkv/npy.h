// Reading and writing NumPy .npy files (format versions 1.0, 2.0 and 3.0;
// little-endian <f4, <f8, <i4, <i8, and the one-byte bool |b1 and uint8 |u1
// (both read as uint8_t, written as |u1); C order). Anything else — Fortran order,
// big-endian, other dtypes, truncated data, a header that disagrees with the
// file size — is a qkv::Error saying what and at which byte offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <variant>

#include "qkv/tensor.h"

namespace qkv {

// An array read from a .npy file, in the type the file holds.
using NpyArray = std::variant<Tensor<float>, Tensor<double>, Tensor<int32_t>, Tensor<int64_t>,
                              Tensor<uint8_t>>;

// Parses a whole .npy file held in memory. `name` goes into error messages.
NpyArray parse_npy(const void* bytes, size_t size, const std::string& name = "<memory>");

// Reads a .npy file: a regular file, or a pipe or device, whose preamble and
// header are checked as they arrive (so /dev/zero fails after 6 bytes, and
// no more than the header's data and one byte past it are ever read).
NpyArray read_npy(const std::string& path);
// The same from a file descriptor open for reading (not closed here); `name`
// goes into error messages. `consumed` holds the bytes the caller already read
// from its start (e.g. to tell .npy from CSV by the magic string): for a pipe
// they are taken as the file's first bytes; a regular file is read by offset
// from its start anyway.
NpyArray read_npy(int fd, const std::string& name, std::string_view consumed = {});

// The bytes of a .npy file (version 1.0, or 2.0 if the header needs it).
std::string npy_bytes(ConstView<float> array);
std::string npy_bytes(ConstView<double> array);
std::string npy_bytes(ConstView<int32_t> array);
std::string npy_bytes(ConstView<int64_t> array);
std::string npy_bytes(ConstView<uint8_t> array);

// Writes a .npy file atomically, as a StagedFile (qkv/staged_file.h): to a
// temporary file beside `path`, renamed over it only once complete and on
// disk, so a failure never leaves a partial file; a symlink's target is
// replaced, a device or FIFO written through. A bad path is an Error, a
// failing disk an IoError.
void write_npy(const std::string& path, ConstView<float> array);
void write_npy(const std::string& path, ConstView<double> array);
void write_npy(const std::string& path, ConstView<int32_t> array);
void write_npy(const std::string& path, ConstView<int64_t> array);
void write_npy(const std::string& path, ConstView<uint8_t> array);

}  // namespace qkv
