// Ranking metrics over held-out queries, each with one right answer (its
// own package): MRR@10 (the mean of 1/rank, 0 past rank 10), recall@1 and
// recall@10 (the share of queries whose package is first, or in the top 10).
#pragma once

#include <cstdint>
#include <vector>

namespace qkv::search {

struct Metrics {
  int64_t queries = 0;
  double mrr_at_10 = 0.0, recall_at_1 = 0.0, recall_at_10 = 0.0;
};

// Adds a query whose answer `target` ranked as `ranked` (best first).
class MetricsSum {
 public:
  void add(const std::vector<int64_t>& ranked, int64_t target);
  Metrics metrics() const;

 private:
  int64_t queries_ = 0, at_1_ = 0, at_10_ = 0;
  double reciprocal_ranks_ = 0.0;
};

}  // namespace qkv::search
