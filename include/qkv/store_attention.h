// Attention over a key-value store (qkv/store.h, or any chunk source,
// qkv/chunk_source.h) too large to hold in memory: the fused kernel runs
// over the source's chunks one after another (each read, the next one's
// read started ahead of it), and the chunks' partial results are merged by
// their log-sum-exps in chunk order (qkv/merge.h), so the result is
// attention over every row at once, to float rounding. Memory: the queries,
// output and lse, one chunk's partial output, and with top_k each thread's
// top_k candidates: independent of the store's size.
//   queries: (Nq, D)   store: keys (N, D), values (N, Dv)   valid_rows: absent, one, or (Nq)
//   output: (Nq, Dv)   lse: (Nq)   top_ids, top_weights: (Nq, top_k)
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "qkv/attention.h"
#include "qkv/chunk_source.h"
#include "qkv/scoring.h"
#include "qkv/tensor.h"
#include "qkv/valid_lens.h"

namespace qkv {

struct StoreAttentionOptions {
  // How a query scores a row: a scoring function that works over a store
  // (qkv/scoring.h, over_store): Scoring::kDotProduct, scale q . k, or
  // Scoring::kDistance, -scale/2 |q - k|^2 (Nadaraya-Watson's Gaussian
  // kernel of bandwidth h = 1/sqrt(scale) as attention, d2l 11.2), computed
  // by distance_attention on each chunk (keys centred at the chunk's mean,
  // so keys far from the origin lose no accuracy; a bf16 chunk widened to
  // float while it is attended); forward only.
  Scoring scoring = Scoring::kDotProduct;
  // By the scoring function's rule: dot, any finite number, default
  // 1/sqrt(D); distance, a finite number > 0, default 1.
  std::optional<double> scale;
  // Also return each query's top_k rows by weight: their row ids in the store
  // and their weights (over the whole store), by weight, largest first (ties:
  // the smaller row id first). A query with fewer than top_k valid rows gets
  // id -1 and weight 0 in the places left over. 0 <= top_k <= the store's rows.
  // The rows are chosen by a pass over each chunk's scores split over the
  // threads by rows as well as by queries, so a single query uses every
  // thread.
  int64_t top_k = 0;
  // Called after each chunk with the bytes of keys and values done and in all.
  StoreProgress progress;
};

struct StoreAttentionResult {
  Tensor<float> output;       // (Nq, Dv)
  Tensor<float> lse;          // (Nq): log sum_j exp(score(q, k_j)) over the valid rows
  Tensor<int64_t> top_ids;    // (Nq, top_k), empty unless top_k > 0
  Tensor<float> top_weights;  // (Nq, top_k), empty unless top_k > 0
};

// softmax(scores) V over the store's rows, scores scale Q Kᵀ (or distance
// scores, options.scoring). valid_rows, as the valid
// lengths of a batch of one (ValidLens::for_batch_of_one): absent (every row),
// one count (a scalar or (1)) or one per query ((Nq) or (1, Nq)): query i sees
// rows [0, valid_rows[i]) only, and chunks no query sees are not read. A
// query with no row gets output 0 and lse -inf. A bfloat16 store takes the
// queries rounded to bfloat16 (products in float32, results in float32).
// Throws Error for bad shapes or options before reading any chunk, and for a
// chunk file that no longer matches the manifest when it is mapped.
StoreAttentionResult attend(ConstView<float> queries, const ChunkSource& store,
                            const ValidLens& valid_rows = {},
                            const StoreAttentionOptions& options = {});

// The same over the rows of several stores, in the order given (shards on
// one machine): row ids count through the stores in order; each store's
// result is merged by merge_parts. Every store has the same D and Dv.
StoreAttentionResult attend(ConstView<float> queries, const std::vector<const ChunkSource*>& stores,
                            const ValidLens& valid_rows = {},
                            const StoreAttentionOptions& options = {});

// Attention over a key set from attend()'s results over its consecutive
// parts, in order (shards, or MPI ranks: qkv::mpi merges its ranks' parts
// with it): part p holds part_rows[p] rows, and its top row ids count from
// the first of them. Outputs and lses merge by merge_attention, in double;
// the top rows by weight over the whole key set, exp(lse_p + log w - lse),
// top_k of them (each part's result must hold at least min(top_k, its rows)
// top rows per query). The same parts give the same bits.
StoreAttentionResult merge_parts(const std::vector<StoreAttentionResult>& parts,
                                 const std::vector<int64_t>& part_rows, int64_t top_k);

struct StoreAttentionGrads {
  Tensor<float> d_queries;  // (Nq, D)
  Tensor<float> d_keys;     // (N, D): the store's rows, 0 where no query sees a row
  Tensor<float> d_values;   // (N, Dv)
};

// The gradients of attend() given its output and lse (saved) and d_output
// (Nq, Dv) = dLoss/d(output): chunk by chunk, each chunk's backward handed
// the output and lse over every row (docs/semantics.md, "Merging attention
// over parts of a key set"), dQ's shares summed in chunk order. Same
// queries, store, valid_rows and scale as the forward (top_k is ignored).
// Memory: dK and dV hold a row per store row.
StoreAttentionGrads attend_backward(ConstView<float> queries, const ChunkSource& store,
                                    const ValidLens& valid_rows,
                                    const StoreAttentionOptions& options,
                                    const SavedForward<float>& saved, ConstView<float> d_output);

}  // namespace qkv
