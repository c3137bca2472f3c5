// Small pieces shared by the fast attention kernels.
#pragma once

#include <algorithm>
#include <cstdint>

#include "qkv/valid_lens.h"

namespace qkv::kernels {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The longest valid length among queries [i0, i1) of batch element b: keys
// at or past it are never read for these queries.
inline int64_t longest_len(const ValidLens& lens, int64_t b, int64_t i0, int64_t i1, int64_t nk) {
  if (!lens.present()) return nk;
  if (!lens.per_query()) return lens(b, 0, nk);
  int64_t longest = 0;
  for (int64_t i = i0; i < i1; ++i) longest = std::max(longest, lens(b, i, nk));
  return longest;
}

}  // namespace qkv::kernels
