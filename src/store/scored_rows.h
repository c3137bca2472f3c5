// Scoring one row at a time and keeping each query's best rows: shared by
// attention over a store (store_attention.cc) and through its index
// (index_attention.cc). Private to the library.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <utility>
#include <vector>

#include "qkv/bfloat16.h"

namespace qkv {

// A row offered for a query's top k: (score, row id), the score being the
// logarithm of the row's weight up to the lse over every row: its weight is
// exp(score - lse).
using ScoredRow = std::pair<double, int64_t>;
// Larger score first; ties: the smaller row id first.
inline bool better_row(const ScoredRow& a, const ScoredRow& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}
// Puts `row` into `best` (sorted by better_row) if it beats the k-th.
inline void keep_best(std::vector<ScoredRow>& best, const ScoredRow& row, int64_t k) {
  if (static_cast<int64_t>(best.size()) == k && (k == 0 || !better_row(row, best.back()))) return;
  best.insert(std::upper_bound(best.begin(), best.end(), row, better_row), row);
  if (static_cast<int64_t>(best.size()) > k) best.pop_back();
}

inline float widen(float x) { return x; }
inline float widen(bfloat16 x) { return std::bit_cast<float>(uint32_t{x.bits} << 16); }

// A query's score of one row in float: q . k (dot), or -|q - k|^2 / 2
// (distance), before the scale. Products of float32 (a bf16 row widened
// by a shift, which vectorizes).
template <bool kDistance, class T>
float raw_score(const float* q, const T* k, int64_t d) {
  float s = 0.0f;
  if constexpr (kDistance) {
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < d; ++c) {
      const float diff = q[c] - widen(k[c]);
      s += diff * diff;
    }
    return -0.5f * s;
  } else {
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < d; ++c) s += q[c] * widen(k[c]);
    return s;
  }
}

}  // namespace qkv
