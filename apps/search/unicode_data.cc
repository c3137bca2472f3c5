// The generated per-code-point tables (unicode_data.inc) and their lookup:
// a binary search in the ranges and one in the mappings (about 500 and
// 3,000 rows), for non-ASCII characters only (wordpiece.cc keeps a table
// of the 128 ASCII ones).
#include "search/unicode_data.h"

#include <algorithm>
#include <iterator>

namespace qkv::search::unicode {
namespace {

#include "search/unicode_data.inc"

}  // namespace

CharInfo char_info(char32_t cp) {
  CharInfo info;
  const auto range = std::upper_bound(std::begin(kRanges), std::end(kRanges), cp,
                                      [](char32_t c, const CharRange& r) { return c < r.first; });
  if (range != std::begin(kRanges) && cp <= std::prev(range)->last) {
    info.kind = std::prev(range)->kind;
    info.combining_class = std::prev(range)->combining_class;
  }
  if (info.kind == CharKind::kWord || info.kind == CharKind::kPunctuation ||
      info.kind == CharKind::kChinese) {
    const auto m =
        std::lower_bound(std::begin(kMappings), std::end(kMappings), cp,
                         [](const CharMapping& m, char32_t c) { return m.code_point < c; });
    if (m != std::end(kMappings) && m->code_point == cp) {
      info.mapped = true;
      info.text = std::string_view(kMappingText + m->offset, m->length);
    }
  }
  return info;
}

}  // namespace qkv::search::unicode
