// Attention over a range of a store's chunks, before it is finished into
// float results: what attend() runs over every chunk and qkv::mpi::attend
// runs over each rank's share, then merges across the ranks. Front-end
// helpers (qkv::detail), shared by src/store/store_attention.cc and src/store/mpi.cc.
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "qkv/attention.h"
#include "qkv/store.h"
#include "qkv/store_attention.h"
#include "qkv/tensor.h"
#include "qkv/valid_lens.h"

namespace qkv::detail {

// A row offered for a query's top k: (log-weight up to the final lse, store
// row id). Its weight over all rows is exp(log_weight - lse).
using ScoredRow = std::pair<double, int64_t>;
// Larger log-weight first; ties: the smaller row id first.
inline bool better_row(const ScoredRow& a, const ScoredRow& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}
// Puts `row` into `best` (sorted by better_row) if it beats the k-th.
void keep_best(std::vector<ScoredRow>& best, const ScoredRow& row, int64_t k);

// Attention over some rows of a store, kept in double for merging.
struct StorePartial {
  Tensor<double> output;                    // (Nq, Dv)
  Tensor<double> lse;                       // (Nq), -inf for a query with no row here
  std::vector<std::vector<ScoredRow>> top;  // per query, at most top_k, best first
};

// The last row each query sees, in the store's row ids, from valid_rows as
// attend() takes it (checked there against `num_rows`).
std::vector<int64_t> rows_seen(std::string_view function, ConstView<float> queries,
                               const ValidLens& valid_rows, int64_t num_rows);

// Checks queries (Nq, D) against the store and options.top_k against
// `max_top_k` rows; Error naming `function` otherwise.
void check_store_attention(std::string_view function, ConstView<float> queries,
                           const KeyValueStore& store, const StoreAttentionOptions& options,
                           int64_t max_top_k);

// Attention of `queries` (Nq, D) over the rows of chunks [first, last):
// query i sees the rows below query_rows[i] (store row ids). Chunks no
// query sees are not read.
StorePartial attend_chunks(ConstView<float> queries, const KeyValueStore& store, size_t first,
                           size_t last, const std::vector<int64_t>& query_rows,
                           const StoreAttentionOptions& options);

// Merges partials over consecutive parts of a key set, in order: outputs
// and lses by merge_attention, top rows by keep_best (their row ids must be
// the whole key set's already).
StorePartial merge_partials(const std::vector<StorePartial>& parts, int64_t top_k);

// Moves a partial's top row ids from the store's row ids of chunks starting
// at `store_first_row` to the key set's, where those rows start at `offset`.
void shift_row_ids(StorePartial& partial, int64_t store_first_row, int64_t offset);

// The float results of a (merged) partial.
StoreAttentionResult finish(const StorePartial& partial, int64_t top_k);

// The gradients of attention over chunks [first, last) given the output and
// lse over every row (docs/semantics.md: each part's backward with the merged
// O and lse): this part's share of dQ, in double, and dK, dV of its rows.
struct StorePartialGrads {
  Tensor<double> d_queries;       // (Nq, D)
  Tensor<float> d_keys, d_values;  // (rows of the chunks, D), (rows, Dv)
};
StorePartialGrads backward_chunks(ConstView<float> queries, const KeyValueStore& store,
                                  size_t first, size_t last,
                                  const std::vector<int64_t>& query_rows,
                                  const StoreAttentionOptions& options,
                                  const SavedForward<float>& saved, ConstView<float> d_output);

// Checks the backward's saved output (Nq, Dv), lse (Nq) and d_output (Nq, Dv).
void check_store_backward(std::string_view function, ConstView<float> queries,
                          const KeyValueStore& store, const StoreAttentionOptions& options,
                          const SavedForward<float>& saved, ConstView<float> d_output);

}  // namespace qkv::detail
