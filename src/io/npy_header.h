// The .npy header on its own, for the library's readers that use a mapped
// file's data where it lies (the key-value store's chunks) and its writers
// that stream the data themselves. Private to the library: users read and
// write whole arrays through qkv/npy.h.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "qkv/tensor.h"

namespace qkv {

// The header of a .npy file whose bytes are in memory (a mapped file), for
// readers that use the data where it is (the key-value store's chunks): the
// dtype as NumPy writes it ("<f4", "<f8", "<i4", "<i8", "|u1", "|b1", and
// "<u2", the bits of bfloat16 data, which only this reader takes), the shape
// and where the data starts. The data must be exactly as long as the header
// says. Errors as parse_npy's, from function "parse_npy_header".
struct NpyHeader {
  std::string descr;
  Shape shape;
  size_t data_offset = 0;
  size_t data_bytes = 0;
};
NpyHeader parse_npy_header(const void* bytes, size_t size, const std::string& name);
// The header of a .npy file (version 1.0, or 2.0 if needed) of C-order data of
// dtype `descr` (one of the above but "|b1") and `shape`, padded so the data
// starts at a multiple of 64 bytes, for writers that write the data themselves.
std::string npy_header_bytes(std::string_view descr, const Shape& shape);

}  // namespace qkv
