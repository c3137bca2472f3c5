#include "search/metrics.h"

#include <algorithm>
#include <cstddef>

namespace qkv::search {

void MetricsSum::add(const std::vector<int64_t>& ranked, int64_t target) {
  ++queries_;
  const size_t shown = std::min<size_t>(ranked.size(), 10);
  const auto it = std::find(ranked.begin(), ranked.begin() + static_cast<ptrdiff_t>(shown), target);
  if (it == ranked.begin() + static_cast<ptrdiff_t>(shown)) return;
  const int64_t rank = (it - ranked.begin()) + 1;
  reciprocal_ranks_ += 1.0 / static_cast<double>(rank);
  at_1_ += rank == 1;
  ++at_10_;
}

Metrics MetricsSum::metrics() const {
  Metrics m;
  m.queries = queries_;
  if (queries_ == 0) return m;
  const double n = static_cast<double>(queries_);
  m.mrr_at_10 = reciprocal_ranks_ / n;
  m.recall_at_1 = static_cast<double>(at_1_) / n;
  m.recall_at_10 = static_cast<double>(at_10_) / n;
  return m;
}

}  // namespace qkv::search
