#include "search/safetensors.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string_view>
#include <utility>

#include "qkv/error.h"

namespace qkv::search {
namespace {

constexpr std::string_view kFn = "safetensors";
// The format's own limit on the header (safetensors' MAX_HEADER_SIZE).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Bytes per element of each dtype the format defines.
size_t dtype_size(const std::string& dtype) {
  static const std::map<std::string, size_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"I64", 8}, {"U64", 8},     {"F64", 8}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

}  // namespace

std::map<std::string, SafeTensorEntry> parse_safetensors_header(const unsigned char* data,
                                                                size_t size,
                                                                const std::string& path) {
  const auto bad = [&](const std::string& what) { fail(kFn, path + ": " + what); };
  if (size < 8) bad("is " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = header << 8 | data[i];
  if (header > kMaxHeaderBytes || header > size - 8) {
    bad("the header length is " + std::to_string(header) + " bytes, past " +
        (header > kMaxHeaderBytes ? "the format's limit of 100 MB"
                                  : "the file's " + std::to_string(size - 8) + " after it"));
  }
  const size_t data_size = size - 8 - header;
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(data + 8, data + 8 + header);
  } catch (const nlohmann::json::exception& e) {
    bad(std::string("the header is not JSON (") + e.what() + ")");
  }
  if (!json.is_object()) bad("the header is not a JSON object");
  std::map<std::string, SafeTensorEntry> entries;
  std::vector<std::pair<size_t, size_t>> spans;
  for (const auto& [name, value] : json.items()) {
    const std::string where = "tensor \"" + name + "\"";
    if (name == "__metadata__") {
      if (!value.is_object()) bad("\"__metadata__\" is not an object");
      for (const auto& [key, text] : value.items()) {
        if (!text.is_string()) bad("\"__metadata__\" member \"" + key + "\" is not a string");
      }
      continue;
    }
    if (!value.is_object() || !value.contains("dtype") || !value["dtype"].is_string() ||
        !value.contains("shape") || !value["shape"].is_array() || !value.contains("data_offsets") ||
        !value["data_offsets"].is_array()) {
      bad(where +
          " is not an object with a string \"dtype\" and arrays \"shape\" and "
          "\"data_offsets\"");
    }
    SafeTensorEntry entry;
    entry.dtype = value["dtype"].get<std::string>();
    const size_t element = dtype_size(entry.dtype);
    if (element == 0) bad(where + " has the unknown dtype \"" + entry.dtype + "\"");
    if (value["shape"].size() > static_cast<size_t>(kMaxRank)) {
      bad(where + " has rank " + std::to_string(value["shape"].size()) + "; qkv reads rank " +
          std::to_string(kMaxRank) + " at most");
    }
    // The element count, checked against the data's size as it grows, so it cannot overflow.
    uint64_t count = 1;
    for (const auto& s : value["shape"]) {
      if (!s.is_number_unsigned())
        bad(where + "'s shape " + value["shape"].dump() + " is not sizes >= 0");
      const uint64_t n = s.get<uint64_t>();
      entry.shape.push_back(static_cast<int64_t>(std::min<uint64_t>(n, uint64_t{1} << 62)));
      if (n != 0 && count > data_size / n)
        count = data_size + 1;  // too large either way
      else
        count *= n;
    }
    const auto& offsets = value["data_offsets"];
    if (offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned()) {
      bad(where + "'s data_offsets " + offsets.dump() + " are not two byte offsets");
    }
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    if (begin > end || end > data_size) {
      bad(where + "'s data_offsets " + offsets.dump() + " are not inside the " +
          std::to_string(data_size) + " bytes of data");
    }
    if (count > data_size || count * element != end - begin) {
      bad(where + " of shape " + value["shape"].dump() + " and dtype " + entry.dtype + " has " +
          std::to_string(end - begin) + " bytes of data (data_offsets " + offsets.dump() + ")");
    }
    entry.begin = begin;
    entry.end = end;
    spans.emplace_back(begin, end);
    entries.emplace(name, std::move(entry));
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) {
      bad("two tensors share the data bytes from " + std::to_string(spans[i].first));
    }
  }
  return entries;
}

SafeTensors SafeTensors::open(const std::string& path) {
  SafeTensors t;
  auto file = std::make_shared<MappedFile>(kFn, path);
  t.entries_ = parse_safetensors_header(file->data(), file->size(), path);
  uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = header << 8 | file->data()[i];
  t.data_offset_ = 8 + header;
  t.file_ = std::move(file);
  return t;
}

ConstView<float> SafeTensors::floats(const std::string& name, const Shape& shape) const {
  const auto it = entries_.find(name);
  if (it == entries_.end()) fail(kFn, path() + ": has no tensor \"" + name + "\"");
  const SafeTensorEntry& e = it->second;
  const Shape found(e.shape.begin(), e.shape.end());
  if (e.dtype != "F32" || !(found == shape)) {
    fail(kFn, path() + ": tensor \"" + name + "\" is " + e.dtype + " " + found.str() +
                  "; expected F32 " + shape.str());
  }
  const unsigned char* bytes = file_->data() + data_offset_ + e.begin;
  if (reinterpret_cast<uintptr_t>(bytes) % alignof(float) != 0) {
    fail(kFn, path() + ": tensor \"" + name + "\" starts at byte " +
                  std::to_string(data_offset_ + e.begin) + ", not a multiple of 4");
  }
  return ConstView<float>(reinterpret_cast<const float*>(bytes), shape);
}

}  // namespace qkv::search
