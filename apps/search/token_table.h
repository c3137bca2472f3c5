// The WordPiece vocabulary's lookup (wordpiece.cc defines it): byte strings
// to ids in one open-addressing table (XXH3, linear probing, at most half
// full), its keys in one buffer. Lookups are half the tokenizer's time on
// package descriptions (1.6 a wordpiece, many for strings that are not
// there), most of it cache misses: slots of 8 bytes with the keys of up to
// 16 bytes compared in place, or a bit filter in front for the misses, were
// each within 5 % of this.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace qkv::search {

class TokenTable {
 public:
  // Keys must be distinct.
  void build(const std::vector<std::pair<std::string_view, int32_t>>& entries);
  // The id of `key`, or -1.
  int32_t find(std::string_view key) const;
  // The longest key's length in bytes: no longer string is found.
  size_t max_length() const { return max_length_; }

 private:
  struct Slot {
    uint32_t offset = 0, length = 0;  // the key: keys_[offset, offset + length)
    int32_t id = -1;                  // -1: empty
  };
  std::vector<Slot> slots_{Slot{}};  // one empty slot until build
  std::string keys_;
  size_t mask_ = 0, max_length_ = 0;
};

}  // namespace qkv::search
