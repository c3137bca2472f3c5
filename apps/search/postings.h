// A term's postings as bm25.sqlite keeps them (bm25.h): for each document
// holding the term, in increasing order, the gap from the previous
// document's rowid (the first from rowid 0; rowids are positions + 1) and
// the term's occurrences in it, each a varint (7 bits a byte, low bits
// first, the high bit set on every byte but the last). Header-only, so the
// fuzzer (fuzz/index_fuzz.cc) reads blobs as Bm25::search does.
#pragma once

#include <cstdint>
#include <string>

namespace qkv::search {

inline void put_varint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out += static_cast<char>((value & 0x7F) | 0x80);
    value >>= 7;
  }
  out += static_cast<char>(value);
}

// Reads a varint at `p`, advancing it; false if it runs past `end` or over
// 35 bits (a rowid or a count of this format fits in 32).
inline bool get_varint(const unsigned char*& p, const unsigned char* end, uint64_t& value) {
  value = 0;
  for (int shift = 0; shift < 35 && p < end; shift += 7) {
    const unsigned char byte = *p++;
    value |= static_cast<uint64_t>(byte & 0x7F) << shift;
    if ((byte & 0x80) == 0) return true;
  }
  return false;
}

// Calls each(doc, count) for each posting of the blob [p, end), which should
// hold `hits` postings of documents [0, documents): doc the document's
// position (< documents), count >= 1. False if the blob is damaged (a varint
// past its end or over 35 bits, a zero gap or count, a document past the
// last, another number of postings than `hits`); `each` may have been
// called for the postings before the damage was found.
template <class Each>
bool for_each_posting(const unsigned char* p, const unsigned char* end, int64_t hits,
                      int64_t documents, Each&& each) {
  if (hits < 1 || hits > documents) return false;
  uint64_t rowid = 0;
  int64_t seen = 0;
  while (p < end) {
    uint64_t gap, count;
    if (!get_varint(p, end, gap) || !get_varint(p, end, count) || gap == 0 || count == 0 ||
        (rowid += gap) > static_cast<uint64_t>(documents) || ++seen > hits)
      return false;
    each(static_cast<size_t>(rowid - 1), count);
  }
  return seen == hits;
}

}  // namespace qkv::search
