// A safetensors file, Hugging Face's format for model weights, read
// strictly: 8 bytes of little-endian header length N, N bytes of JSON
// ({"name": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]},
// ..., optionally "__metadata__": {string: string}}), then the data, each
// tensor's bytes at [begin, end) of it, little-endian. The file is mapped
// (qkv::MappedFile), not copied: a tensor is a view of the mapping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "qkv/store.h"
#include "qkv/tensor.h"

namespace qkv::search {

struct SafeTensorEntry {
  std::string dtype;           // as the header says: "F32", "BF16", "I64", ...
  std::vector<int64_t> shape;  // each size >= 0
  size_t begin = 0, end = 0;   // bytes of the data, after the header
};

// The header of a safetensors file of `size` bytes (`path` names it in
// messages): Error "safetensors: PATH: ..." naming what is wrong unless the
// header length fits the file and 100 MB, the JSON is an object of entries
// with a known dtype, a shape of at most kMaxRank sizes >= 0 whose element count times the
// dtype's size is end - begin, and offsets inside the data that no two
// tensors share. Parses from memory, so the fuzzer reaches it alone.
std::map<std::string, SafeTensorEntry> parse_safetensors_header(const unsigned char* data,
                                                                size_t size,
                                                                const std::string& path);

class SafeTensors {
 public:
  // Maps `path` and parses its header; Error naming the path if it is
  // missing, not a regular file, or malformed (parse_safetensors_header).
  static SafeTensors open(const std::string& path);

  // The float32 tensor `name`, which must have `shape`: a view of the
  // mapping, valid while this object (or a copy) lives. Error naming the
  // file, the tensor and what differs (absent, another dtype or shape, not
  // 4-byte aligned).
  ConstView<float> floats(const std::string& name, const Shape& shape) const;
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  const std::map<std::string, SafeTensorEntry>& entries() const { return entries_; }
  const std::string& path() const { return file_->path(); }

 private:
  std::shared_ptr<const MappedFile> file_;
  size_t data_offset_ = 0;  // 8 + the header length
  std::map<std::string, SafeTensorEntry> entries_;
};

}  // namespace qkv::search
