// attend(queries, store) and its backward: the fused scaled dot-product
// kernel over each chunk of a key-value store, merged in chunk order by
// log-sum-exp (qkv/merge.h) into a running result kept in double; top-k rows
// from each chunk's weights. A front end: it checks once, then calls the
// public attention and merge functions chunk by chunk. The chunk-range
// pieces (src/store/store_parts.h) also serve qkv::mpi.
#include "qkv/store_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/check.h"
#include "kernels/runtime/parallel.h"
#include "qkv/attention.h"
#include "qkv/bfloat16.h"
#include "qkv/error.h"
#include "qkv/merge.h"
#include "qkv/scoring.h"
#include "store/store_parts.h"

namespace qkv {
namespace detail {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The queries as the kernels take them: contiguous (1, Nq, D), and rounded
// to bf16 for a bf16 store.
struct KernelQueries {
  Tensor<float> f32;
  Tensor<bfloat16> bf16;

  KernelQueries(ConstView<float> queries, StoreDtype dtype)
      : f32(Tensor<float>::copy_of(queries).reshaped(Shape{1, queries.size(0), queries.size(1)})) {
    if (dtype == StoreDtype::kBFloat16) {
      bf16 = Tensor<bfloat16>(f32.shape());
      for (int64_t i = 0; i < f32.numel(); ++i) bf16.data()[i] = bfloat16(f32.data()[i]);
    }
  }
};

// The chunks of [first, last) that some query sees, in order.
std::vector<size_t> chunks_seen(const KeyValueStore& store, size_t first, size_t last,
                                const std::vector<int64_t>& query_rows) {
  std::vector<size_t> seen;
  for (size_t c = first; c < last; ++c) {
    const int64_t first_row = store.chunks()[c].first_row;
    if (std::any_of(query_rows.begin(), query_rows.end(),
                    [&](int64_t r) { return r > first_row; })) {
      seen.push_back(c);
    }
  }
  return seen;
}

// (1, Nq) lengths of chunk `info`'s rows each query sees.
void chunk_lens(const StoreChunk& info, const std::vector<int64_t>& query_rows,
                Tensor<int64_t>& lens) {
  for (size_t i = 0; i < query_rows.size(); ++i) {
    lens(0, static_cast<int64_t>(i)) =
        std::clamp<int64_t>(query_rows[i] - info.first_row, 0, info.rows);
  }
}

// Maps chunks in order, the next one mapped and its read started (madvise
// WILLNEED) while the current one is computed.
class ChunkReader {
 public:
  ChunkReader(const KeyValueStore& store, const std::vector<size_t>& order)
      : store_(store), order_(order) {
    if (!order_.empty()) next_ = map(order_[0]);
  }
  // The chunk at position s of the order (s = 0, 1, ... in turn).
  std::shared_ptr<const MappedChunk> take(size_t s) {
    std::shared_ptr<const MappedChunk> chunk = std::move(next_);
    if (s + 1 < order_.size()) next_ = map(order_[s + 1]);
    return chunk;
  }

 private:
  std::shared_ptr<const MappedChunk> map(size_t index) const {
    std::shared_ptr<const MappedChunk> chunk = store_.map_chunk(index);
    chunk->keys_file.prefetch();
    chunk->values_file.prefetch();
    return chunk;
  }
  const KeyValueStore& store_;
  const std::vector<size_t>& order_;
  std::shared_ptr<const MappedChunk> next_;
};

// The bytes of one row of keys and values, for progress reports.
int64_t chunk_row_bytes(const KeyValueStore& store) {
  return (store.key_dim() + store.value_dim()) * (store.dtype() == StoreDtype::kFloat32 ? 4 : 2);
}

template <class T>
ConstView<T> chunk_view(const void* data, int64_t rows, int64_t dim) {
  return ConstView<T>(static_cast<const T*>(data), Shape{1, rows, dim});
}

// Calls work(chunk, info, valid) for each chunk of [first, last) some query
// sees, in order, mapped through a ChunkReader, with `lens` (1, Nq) the
// chunk's rows each query sees (viewed by `valid`); reports progress over
// every chunk of the range (those no query sees count as done).
template <class F>
void for_each_chunk(const KeyValueStore& store, size_t first, size_t last,
                    const std::vector<int64_t>& query_rows, const StoreProgress& progress,
                    Tensor<int64_t>& lens, F&& work) {
  const std::vector<size_t> seen = chunks_seen(store, first, last, query_rows);
  const int64_t row_bytes = chunk_row_bytes(store);
  int64_t total = 0, done = 0;
  for (size_t c = first; c < last; ++c) total += store.chunks()[c].rows * row_bytes;
  ChunkReader reader(store, seen);
  for (size_t s = 0; s < seen.size(); ++s) {
    const std::shared_ptr<const MappedChunk> chunk = reader.take(s);
    const StoreChunk& info = store.chunks()[seen[s]];
    chunk_lens(info, query_rows, lens);
    work(*chunk, info, ValidLens(lens.view()));
    done += info.rows * row_bytes;
    if (progress) progress(done, total);
  }
  if (progress && total > done) progress(total, total);
}

// A bf16 chunk's rows widened to float (1, rows, dim), for distance scoring.
Tensor<float> widened_chunk(const void* data, int64_t rows, int64_t dim) {
  Tensor<float> out(Shape{1, rows, dim});
  const auto* x = static_cast<const bfloat16*>(data);
  for (int64_t i = 0; i < rows * dim; ++i) out.data()[i] = static_cast<float>(x[i]);
  return out;
}

}  // namespace

void keep_best(std::vector<ScoredRow>& best, const ScoredRow& row, int64_t k) {
  if (static_cast<int64_t>(best.size()) == k && (k == 0 || !better_row(row, best.back()))) return;
  best.insert(std::upper_bound(best.begin(), best.end(), row, better_row), row);
  if (static_cast<int64_t>(best.size()) > k) best.pop_back();
}

std::vector<int64_t> rows_seen(std::string_view function, ConstView<float> queries,
                               const ValidLens& valid_rows, int64_t num_rows) {
  const int64_t nq = queries.size(0);
  const ValidLens lens =
      valid_rows.for_batch_of_one(function, "valid_rows", "queries", queries.shape());
  lens.check(function, "the store's rows", Shape{nq, num_rows}, 1, nq, num_rows);
  std::vector<int64_t> rows(static_cast<size_t>(nq));
  for (int64_t i = 0; i < nq; ++i) rows[static_cast<size_t>(i)] = lens(0, i, num_rows);
  return rows;
}

void check_store_attention(std::string_view function, ConstView<float> queries,
                           const KeyValueStore& store, const StoreAttentionOptions& options,
                           int64_t max_top_k) {
  check_rank(function, "queries", queries, 2, "(Nq, D)");
  if (queries.size(1) != store.key_dim()) {
    fail(function, "queries has shape " + queries.shape().str() + " but store " + store.dir() +
                       " has keys of D = " + std::to_string(store.key_dim()));
  }
  if (options.top_k < 0 || options.top_k > max_top_k) {
    fail(function, "top_k = " + std::to_string(options.top_k) + "; expected 0 to the store's " +
                       std::to_string(max_top_k) + " rows");
  }
  const ScoringRules& rules = rules_of(options.scoring);
  if (!rules.over_store) {
    fail(function, "options.scoring is " + std::string(rules.name) +
                       "; attention over a store scores by " + scoring_names(true));
  }
  const bool positive = rules.scale == ScaleRule::kPositiveOne;
  if (options.scale && !(std::isfinite(*options.scale) && (!positive || *options.scale > 0))) {
    fail(function, "scale = " + std::to_string(*options.scale) + "; expected a finite number" +
                       (positive ? " > 0 for distance scoring" : ""));
  }
}

StorePartial attend_chunks(ConstView<float> queries, const KeyValueStore& store, size_t first,
                           size_t last, const std::vector<int64_t>& query_rows,
                           const StoreAttentionOptions& options) {
  const int64_t nq = queries.size(0), dv = store.value_dim(), k = options.top_k;
  const bool distance = options.scoring == Scoring::kDistance;
  const KernelQueries q(queries, distance ? StoreDtype::kFloat32 : store.dtype());
  AttentionOptions attention;
  attention.scale = options.scale;
  attention.return_lse = true;
  attention.return_weights = k > 0;

  StorePartial part{Tensor<double>(Shape{nq, dv}), Tensor<double>(Shape{nq}, -kInf),
                    std::vector<std::vector<ScoredRow>>(static_cast<size_t>(k > 0 ? nq : 0))};
  // Each chunk's result in double, merged into `part` in place.
  Tensor<double> out_chunk(Shape{nq, dv}), lse_chunk(Shape{nq});
  Tensor<int64_t> lens(Shape{1, nq});
  AttentionResult<float> result;
  result.output = Tensor<float>(Shape{1, nq, dv});
  result.lse = Tensor<float>(Shape{1, nq});

  for_each_chunk(
      store, first, last, query_rows, options.progress, lens,
      [&](const MappedChunk& chunk, const StoreChunk& info, const ValidLens& valid) {
        const int64_t d = store.key_dim();
        if (distance || store.dtype() == StoreDtype::kFloat32) {
          // Once, unless chunk sizes differ. By shape, not numel: the empty
          // tensor is rank 0 and so has numel 1, as (1, 1, 1) weights do.
          if (k > 0 && result.weights.shape() != Shape{1, nq, info.rows}) {
            result.weights = Tensor<float>(Shape{1, nq, info.rows});
          }
          AttentionOutputs<float> outputs{result.output.view(), std::nullopt, result.lse.view()};
          if (k > 0) outputs.weights = result.weights.view();
          if (distance) {
            const bool bf16 = store.dtype() == StoreDtype::kBFloat16;
            const Tensor<float> keys =
                bf16 ? widened_chunk(chunk.keys, info.rows, d) : Tensor<float>();
            const Tensor<float> values =
                bf16 ? widened_chunk(chunk.values, info.rows, dv) : Tensor<float>();
            distance_attention(
                q.f32.view(), bf16 ? keys.view() : chunk_view<float>(chunk.keys, info.rows, d),
                bf16 ? values.view() : chunk_view<float>(chunk.values, info.rows, dv), valid,
                attention, outputs);
          } else {
            scaled_dot_product_attention(q.f32.view(), chunk_view<float>(chunk.keys, info.rows, d),
                                         chunk_view<float>(chunk.values, info.rows, dv), valid,
                                         attention, outputs);
          }
        } else {
          result = scaled_dot_product_attention(
              q.bf16.view(), chunk_view<bfloat16>(chunk.keys, info.rows, d),
              chunk_view<bfloat16>(chunk.values, info.rows, dv), valid, attention);
        }
        for (int64_t i = 0; i < nq; ++i) {
          lse_chunk(i) = result.lse(0, i);
          for (int64_t j = 0; j < dv; ++j) out_chunk(i, j) = result.output(0, i, j);
        }
        merge_attention(std::vector<ConstView<double>>{part.output.view(), out_chunk.view()},
                        std::vector<ConstView<double>>{part.lse.view(), lse_chunk.view()},
                        part.output.view(), part.lse.view());
        if (k > 0) {
          kernels::parallel_for(nq, [&](int64_t i) {
            const float* w = &result.weights(0, i, 0);
            const double lse = lse_chunk(i);
            for (int64_t j = 0; j < lens(0, i); ++j) {
              if (w[j] <= 0.0f) continue;  // masked, or below float's range: weight 0
              keep_best(part.top[static_cast<size_t>(i)],
                        {lse + std::log(static_cast<double>(w[j])), info.first_row + j}, k);
            }
          });
        }
      });
  return part;
}

StorePartial merge_partials(const std::vector<StorePartial>& parts, int64_t top_k) {
  const int64_t nq = parts.at(0).lse.numel(), dv = parts[0].output.size(1);
  StorePartial merged{Tensor<double>(Shape{nq, dv}), Tensor<double>(Shape{nq}),
                      std::vector<std::vector<ScoredRow>>(static_cast<size_t>(top_k > 0 ? nq : 0))};
  std::vector<ConstView<double>> outputs, lses;
  for (const StorePartial& part : parts) {
    outputs.push_back(part.output.view());
    lses.push_back(part.lse.view());
  }
  merge_attention(outputs, lses, merged.output.view(), merged.lse.view());
  for (size_t i = 0; i < merged.top.size(); ++i) {
    for (const StorePartial& part : parts) {
      for (const ScoredRow& row : part.top[i]) keep_best(merged.top[i], row, top_k);
    }
  }
  return merged;
}

void shift_row_ids(StorePartial& partial, int64_t store_first_row, int64_t offset) {
  for (std::vector<ScoredRow>& rows : partial.top) {
    for (ScoredRow& row : rows) row.second += offset - store_first_row;
  }
}

StoreAttentionResult finish(const StorePartial& partial, int64_t top_k) {
  const int64_t nq = partial.lse.numel(), dv = partial.output.size(1);
  StoreAttentionResult result;
  result.output = Tensor<float>(Shape{nq, dv});
  result.lse = Tensor<float>(Shape{nq});
  for (int64_t i = 0; i < nq; ++i) {
    result.lse(i) = static_cast<float>(partial.lse(i));
    for (int64_t j = 0; j < dv; ++j) result.output(i, j) = static_cast<float>(partial.output(i, j));
  }
  if (top_k > 0) {
    result.top_ids = Tensor<int64_t>(Shape{nq, top_k}, -1);
    result.top_weights = Tensor<float>(Shape{nq, top_k});
    for (int64_t i = 0; i < nq; ++i) {
      const std::vector<ScoredRow>& rows = partial.top[static_cast<size_t>(i)];
      for (size_t r = 0; r < rows.size(); ++r) {
        result.top_ids(i, r) = rows[r].second;
        result.top_weights(i, r) = static_cast<float>(std::exp(rows[r].first - partial.lse(i)));
      }
    }
  }
  return result;
}

void check_store_backward(std::string_view function, ConstView<float> queries,
                          const KeyValueStore& store, const StoreAttentionOptions& options,
                          const SavedForward<float>& saved, ConstView<float> d_output) {
  if (options.scoring != Scoring::kDotProduct) {
    fail(function, "the backward over a store is for dot scoring; " +
                       std::string(rules_of(options.scoring).name) + " scoring has none");
  }
  const Shape out_shape{queries.size(0), store.value_dim()};
  check_shape(function, "saved.output", saved.output, out_shape);
  check_shape(function, "saved.lse", saved.lse, Shape{queries.size(0)});
  check_shape(function, "d_output", d_output, out_shape);
}

StorePartialGrads backward_chunks(ConstView<float> queries, const KeyValueStore& store,
                                  size_t first, size_t last, const std::vector<int64_t>& query_rows,
                                  const StoreAttentionOptions& options,
                                  const SavedForward<float>& saved, ConstView<float> d_output) {
  const int64_t nq = queries.size(0), d = store.key_dim(), dv = store.value_dim();
  const int64_t first_row = first < last ? store.chunks()[first].first_row : 0;
  const int64_t rows =
      first < last ? store.chunks()[last - 1].first_row + store.chunks()[last - 1].rows - first_row
                   : 0;
  StorePartialGrads grads{Tensor<double>(Shape{nq, d}), Tensor<float>(Shape{rows, d}),
                          Tensor<float>(Shape{rows, dv})};
  const KernelQueries q(queries, store.dtype());
  const Tensor<float> out = Tensor<float>::copy_of(saved.output).reshaped(Shape{1, nq, dv});
  const Tensor<float> lse = Tensor<float>::copy_of(saved.lse).reshaped(Shape{1, nq});
  const Tensor<float> d_out = Tensor<float>::copy_of(d_output).reshaped(Shape{1, nq, dv});
  AttentionOptions attention;
  attention.scale = options.scale;
  Tensor<int64_t> lens(Shape{1, nq});

  for_each_chunk(store, first, last, query_rows, options.progress, lens,
                 [&](const MappedChunk& chunk, const StoreChunk& info, const ValidLens& valid) {
                   const SavedForward<float> global{out.view(), lse.view()};
                   const DotProductGrads<float> g =
                       store.dtype() == StoreDtype::kFloat32
                           ? scaled_dot_product_attention_backward(
                                 q.f32.view(), chunk_view<float>(chunk.keys, info.rows, d),
                                 chunk_view<float>(chunk.values, info.rows, dv), valid, attention,
                                 global, d_out.view())
                           : scaled_dot_product_attention_backward(
                                 q.bf16.view(), chunk_view<bfloat16>(chunk.keys, info.rows, d),
                                 chunk_view<bfloat16>(chunk.values, info.rows, dv), valid,
                                 attention, global, d_out.view());
                   // dQ's shares summed in chunk order; dK and dV are this chunk's rows.
                   for (int64_t i = 0; i < nq * d; ++i)
                     grads.d_queries.data()[i] += g.d_queries.data()[i];
                   const int64_t at = info.first_row - first_row;
                   std::copy_n(g.d_keys.data(), info.rows * d, grads.d_keys.data() + at * d);
                   std::copy_n(g.d_values.data(), info.rows * dv, grads.d_values.data() + at * dv);
                 });
  return grads;
}

}  // namespace detail

namespace {
constexpr std::string_view kFn = "attend";
constexpr std::string_view kBackwardFn = "attend_backward";
}  // namespace

StoreAttentionResult attend(ConstView<float> queries, const KeyValueStore& store,
                            const ValidLens& valid_rows, const StoreAttentionOptions& options) {
  detail::check_store_attention(kFn, queries, store, options, store.rows());
  const std::vector<int64_t> rows = detail::rows_seen(kFn, queries, valid_rows, store.rows());
  return detail::finish(
      detail::attend_chunks(queries, store, 0, store.chunks().size(), rows, options),
      options.top_k);
}

StoreAttentionResult attend(ConstView<float> queries,
                            const std::vector<const KeyValueStore*>& stores,
                            const ValidLens& valid_rows, const StoreAttentionOptions& options) {
  if (stores.empty()) fail(kFn, "stores is empty; expected at least one store");
  int64_t rows = 0;
  for (size_t s = 0; s < stores.size(); ++s) {
    if (stores[s] == nullptr) fail(kFn, "stores[" + std::to_string(s) + "] is null");
    if (stores[s]->key_dim() != stores[0]->key_dim() ||
        stores[s]->value_dim() != stores[0]->value_dim()) {
      fail(kFn, "store " + stores[s]->dir() + " has D = " + std::to_string(stores[s]->key_dim()) +
                    ", Dv = " + std::to_string(stores[s]->value_dim()) + " but store " +
                    stores[0]->dir() + " has D = " + std::to_string(stores[0]->key_dim()) +
                    ", Dv = " + std::to_string(stores[0]->value_dim()));
    }
    rows += stores[s]->rows();
  }
  detail::check_store_attention(kFn, queries, *stores[0], options, rows);
  const std::vector<int64_t> global = detail::rows_seen(kFn, queries, valid_rows, rows);
  std::vector<detail::StorePartial> parts;
  int64_t offset = 0;
  for (const KeyValueStore* store : stores) {
    std::vector<int64_t> local(global.size());
    for (size_t i = 0; i < global.size(); ++i) {
      local[i] = std::clamp<int64_t>(global[i] - offset, 0, store->rows());
    }
    parts.push_back(
        detail::attend_chunks(queries, *store, 0, store->chunks().size(), local, options));
    detail::shift_row_ids(parts.back(), 0, offset);
    offset += store->rows();
  }
  return detail::finish(detail::merge_partials(parts, options.top_k), options.top_k);
}

StoreAttentionGrads attend_backward(ConstView<float> queries, const KeyValueStore& store,
                                    const ValidLens& valid_rows,
                                    const StoreAttentionOptions& options,
                                    const SavedForward<float>& saved, ConstView<float> d_output) {
  detail::check_store_attention(kBackwardFn, queries, store, options, store.rows());
  detail::check_store_backward(kBackwardFn, queries, store, options, saved, d_output);
  const std::vector<int64_t> rows =
      detail::rows_seen(kBackwardFn, queries, valid_rows, store.rows());
  detail::StorePartialGrads part = detail::backward_chunks(queries, store, 0, store.chunks().size(),
                                                           rows, options, saved, d_output);
  StoreAttentionGrads grads{Tensor<float>(part.d_queries.shape()), std::move(part.d_keys),
                            std::move(part.d_values)};
  for (int64_t i = 0; i < grads.d_queries.numel(); ++i) {
    grads.d_queries.data()[i] = static_cast<float>(part.d_queries.data()[i]);
  }
  return grads;
}

}  // namespace qkv
