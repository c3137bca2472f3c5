// attend(queries, source) and its backward: the fused attention kernel over
// each chunk of a chunk source (a key-value store, qkv/chunk_source.h),
// merged in chunk order by log-sum-exp (qkv/merge.h) into a running result
// kept in double; each query's top-k rows by score, from a pass over the
// chunk's rows split over the threads. A front end: it checks once, then
// calls the public attention and merge functions chunk by chunk.
// merge_parts merges the float results over consecutive parts of a key
// set: attention over a list of sources, and qkv::mpi's ranks.
#include "qkv/store_attention.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/check.h"
#include "kernels/runtime/parallel.h"
#include "kernels/simd/vecmath.h"
#include "qkv/attention.h"
#include "qkv/bfloat16.h"
#include "qkv/error.h"
#include "qkv/merge.h"
#include "qkv/scoring.h"
#include "qkv/threads.h"
#include "store/scored_rows.h"

namespace qkv {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Attention over some rows, kept in double for merging.
struct Partial {
  Tensor<double> output;                    // (Nq, Dv)
  Tensor<double> lse;                       // (Nq), -inf for a query with no row here
  std::vector<std::vector<ScoredRow>> top;  // per query, at most top_k, best first
};

Partial empty_partial(int64_t nq, int64_t dv, int64_t k) {
  return Partial{Tensor<double>(Shape{nq, dv}), Tensor<double>(Shape{nq}, -kInf),
                 std::vector<std::vector<ScoredRow>>(static_cast<size_t>(k > 0 ? nq : 0))};
}

// The float results of a partial: top weights exp(score - lse), at most 1
// (a row's score and the lse are computed apart, and a row that holds all
// the weight can round to just above it).
StoreAttentionResult finish(const Partial& partial, int64_t top_k) {
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
        result.top_ids(i, static_cast<int64_t>(r)) = rows[r].second;
        result.top_weights(i, static_cast<int64_t>(r)) =
            static_cast<float>(std::min(1.0, std::exp(rows[r].first - partial.lse(i))));
      }
    }
  }
  return result;
}

// The queries as the kernels take them: contiguous (1, Nq, D), and rounded
// to bf16 for a bf16 source (`rounded`, widened back, is what its scores
// multiply).
struct KernelQueries {
  Tensor<float> f32;
  Tensor<bfloat16> bf16;
  Tensor<float> rounded;

  KernelQueries(ConstView<float> queries, StoreDtype dtype)
      : f32(Tensor<float>::copy_of(queries).reshaped(Shape{1, queries.size(0), queries.size(1)})),
        rounded(f32) {
    if (dtype == StoreDtype::kBFloat16) {
      bf16 = Tensor<bfloat16>(f32.shape());
      for (int64_t i = 0; i < f32.numel(); ++i) {
        bf16.data()[i] = bfloat16(f32.data()[i]);
        rounded.data()[i] = static_cast<float>(bf16.data()[i]);
      }
    }
  }
};

// The last row each query sees, from valid_rows as attend() takes it
// (checked against `num_rows`).
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

// Checks queries (Nq, D) against the source and the options, top_k against
// `max_top_k` rows; Error naming `function` otherwise.
void check_store_attention(std::string_view function, ConstView<float> queries,
                           const ChunkSource& source, const StoreAttentionOptions& options,
                           int64_t max_top_k) {
  detail::check_rank(function, "queries", queries, 2, "(Nq, D)");
  if (queries.size(1) != source.key_dim()) {
    fail(function, "queries has shape " + queries.shape().str() + " but " + source.name() +
                       " has keys of D = " + std::to_string(source.key_dim()));
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

// The scale the kernels use, by the scoring function's rule.
double scale_of(const StoreAttentionOptions& options, int64_t d) {
  if (options.scale) return *options.scale;
  return rules_of(options.scoring).scale == ScaleRule::kInverseSqrtDim
             ? 1.0 / std::sqrt(static_cast<double>(d))
             : 1.0;
}

// The chunks some query sees, in order.
std::vector<size_t> chunks_seen(const ChunkSource& source, const std::vector<int64_t>& query_rows) {
  std::vector<size_t> seen;
  for (size_t c = 0; c < source.num_chunks(); ++c) {
    const int64_t first_row = source.chunk_range(c).first_row;
    if (std::any_of(query_rows.begin(), query_rows.end(),
                    [&](int64_t r) { return r > first_row; })) {
      seen.push_back(c);
    }
  }
  return seen;
}

// The bytes of one row of keys and values, for progress reports.
int64_t row_bytes(const ChunkSource& source) {
  return (source.key_dim() + source.value_dim()) * (source.dtype() == StoreDtype::kFloat32 ? 4 : 2);
}

// Calls work(chunk, valid) for each chunk some query sees, in order, the
// next one's read started (read_ahead) before the current one is computed,
// with `lens` (1, Nq) the chunk's rows each query sees (viewed by `valid`);
// reports progress over every chunk (those no query sees count as done).
template <class F>
void for_each_chunk(const ChunkSource& source, const std::vector<int64_t>& query_rows,
                    const StoreProgress& progress, Tensor<int64_t>& lens, F&& work) {
  const std::vector<size_t> seen = chunks_seen(source, query_rows);
  const int64_t total = source.rows() * row_bytes(source);
  int64_t done = 0;
  for (size_t s = 0; s < seen.size(); ++s) {
    const SourceChunk chunk = source.read_chunk(seen[s]);
    if (s + 1 < seen.size()) source.read_ahead(seen[s + 1]);
    const ChunkRange range = chunk.range();
    for (size_t i = 0; i < query_rows.size(); ++i) {
      lens(0, static_cast<int64_t>(i)) =
          std::clamp<int64_t>(query_rows[i] - range.first_row, 0, range.rows);
    }
    work(chunk, ValidLens(lens.view()));
    chunk.check_intact();
    done += range.rows * row_bytes(source);
    if (progress) progress(done, total);
  }
  if (progress && total > done) progress(total, total);
}

// A view (rows, dim) as the kernels take it: (1, rows, dim).
template <class T>
ConstView<T> batch_of_one(ConstView<T> x) {
  return ConstView<T>(x.data(), Shape{1, x.size(0), x.size(1)});
}

// A bf16 chunk's rows widened to float (1, rows, dim), for distance scoring.
Tensor<float> widened(ConstView<bfloat16> x) {
  Tensor<float> out(Shape{1, x.size(0), x.size(1)});
  kernels::fast::to_float(x.data(), out.data(), x.numel());
  return out;
}

// Rows a piece of the top-k pass scores at least: below this, a thread's
// start-up outweighs its share (4096 rows of D = 64 are 1 MiB of float keys).
constexpr int64_t kMinRowsPerPiece = 4096;

// Each query's best k rows of `keys` (a chunk's, the first at `first_row`)
// by score, offered to `top`: the rows are cut into pieces, (query, rows)
// pairs split over the threads, so that one query still uses every thread
// (the kernel's weights would be formed on one thread per query).
template <bool kDistance, class T>
void offer_top_rows(const Tensor<float>& queries, ConstView<T> keys, int64_t first_row,
                    const Tensor<int64_t>& lens, double scale, int64_t k,
                    std::vector<std::vector<ScoredRow>>& top) {
  const int64_t nq = queries.size(1), d = queries.size(2), rows = keys.size(0);
  const int64_t threads = kernels::current_num_threads();
  const int64_t splits = std::clamp<int64_t>((threads + nq - 1) / nq, 1,
                                             std::max<int64_t>(1, rows / kMinRowsPerPiece));
  std::vector<std::vector<ScoredRow>> pieces(static_cast<size_t>(nq * splits));
  kernels::parallel_for(nq * splits, [&](int64_t t) {
    const int64_t i = t / splits, s = t % splits;
    const int64_t last = std::min(lens(0, i), rows * (s + 1) / splits);
    const float* q = &queries(0, i, 0);
    std::vector<ScoredRow>& best = pieces[static_cast<size_t>(t)];  // a heap, the worst on top
    for (int64_t j = rows * s / splits; j < last; ++j) {
      const ScoredRow row{scale * double{raw_score<kDistance>(q, &keys(j, 0), d)}, first_row + j};
      if (std::isnan(row.first)) continue;
      if (static_cast<int64_t>(best.size()) < k) {
        best.push_back(row);
        std::push_heap(best.begin(), best.end(), better_row);
      } else if (better_row(row, best.front())) {
        std::pop_heap(best.begin(), best.end(), better_row);
        best.back() = row;
        std::push_heap(best.begin(), best.end(), better_row);
      }
    }
  });
  for (int64_t t = 0; t < nq * splits; ++t) {
    for (const ScoredRow& row : pieces[static_cast<size_t>(t)]) {
      keep_best(top[static_cast<size_t>(t / splits)], row, k);
    }
  }
}

// Attention of `queries` (Nq, D) over the source's rows: query i sees the
// rows below query_rows[i]. Chunks no query sees are not read.
Partial attend_chunks(ConstView<float> queries, const ChunkSource& source,
                      const std::vector<int64_t>& query_rows,
                      const StoreAttentionOptions& options) {
  const int64_t nq = queries.size(0), dv = source.value_dim(), k = options.top_k;
  const bool distance = options.scoring == Scoring::kDistance;
  const bool bf16 = source.dtype() == StoreDtype::kBFloat16;
  const KernelQueries q(queries, distance ? StoreDtype::kFloat32 : source.dtype());
  const double scale = scale_of(options, source.key_dim());
  AttentionOptions attention;
  attention.scale = options.scale;
  attention.return_lse = true;

  Partial part = empty_partial(nq, dv, k);
  // Each chunk's result in double, merged into `part` in place.
  Tensor<double> out_chunk(Shape{nq, dv}), lse_chunk(Shape{nq});
  Tensor<int64_t> lens(Shape{1, nq});
  AttentionResult<float> result;
  result.output = Tensor<float>(Shape{1, nq, dv});
  result.lse = Tensor<float>(Shape{1, nq});

  for_each_chunk(
      source, query_rows, options.progress, lens,
      [&](const SourceChunk& chunk, const ValidLens& valid) {
        const AttentionOutputs<float> outputs{result.output.view(), std::nullopt, result.lse.view(),
                                              std::nullopt};
        if (distance) {
          const Tensor<float> keys = bf16 ? widened(chunk.keys<bfloat16>()) : Tensor<float>();
          const Tensor<float> values = bf16 ? widened(chunk.values<bfloat16>()) : Tensor<float>();
          distance_attention(q.f32.view(), bf16 ? keys.view() : batch_of_one(chunk.keys<float>()),
                             bf16 ? values.view() : batch_of_one(chunk.values<float>()), valid,
                             attention, outputs);
        } else if (!bf16) {
          scaled_dot_product_attention(q.f32.view(), batch_of_one(chunk.keys<float>()),
                                       batch_of_one(chunk.values<float>()), valid, attention,
                                       outputs);
        } else {
          result = scaled_dot_product_attention(q.bf16.view(), batch_of_one(chunk.keys<bfloat16>()),
                                                batch_of_one(chunk.values<bfloat16>()), valid,
                                                attention);
        }
        for (int64_t i = 0; i < nq; ++i) {
          lse_chunk(i) = result.lse(0, i);
          for (int64_t j = 0; j < dv; ++j) out_chunk(i, j) = result.output(0, i, j);
        }
        merge_attention(std::vector<ConstView<double>>{part.output.view(), out_chunk.view()},
                        std::vector<ConstView<double>>{part.lse.view(), lse_chunk.view()},
                        part.output.view(), part.lse.view());
        if (k == 0) return;
        const int64_t first_row = chunk.range().first_row;
        if (distance && bf16) {
          offer_top_rows<true>(q.rounded, chunk.keys<bfloat16>(), first_row, lens, scale, k,
                               part.top);
        } else if (distance) {
          offer_top_rows<true>(q.rounded, chunk.keys<float>(), first_row, lens, scale, k, part.top);
        } else if (bf16) {
          offer_top_rows<false>(q.rounded, chunk.keys<bfloat16>(), first_row, lens, scale, k,
                                part.top);
        } else {
          offer_top_rows<false>(q.rounded, chunk.keys<float>(), first_row, lens, scale, k,
                                part.top);
        }
      });
  return part;
}

// Checks the backward's scoring, saved output (Nq, Dv), lse (Nq) and d_output (Nq, Dv).
void check_store_backward(std::string_view function, ConstView<float> queries,
                          const ChunkSource& source, const StoreAttentionOptions& options,
                          const SavedForward<float>& saved, ConstView<float> d_output) {
  if (options.scoring != Scoring::kDotProduct) {
    fail(function, "the backward over a store is for dot scoring; " +
                       std::string(rules_of(options.scoring).name) + " scoring has none");
  }
  const Shape out_shape{queries.size(0), source.value_dim()};
  detail::check_shape(function, "saved.output", saved.output, out_shape);
  detail::check_shape(function, "saved.lse", saved.lse, Shape{queries.size(0)});
  detail::check_shape(function, "d_output", d_output, out_shape);
}

constexpr std::string_view kFn = "attend";
constexpr std::string_view kBackwardFn = "attend_backward";
constexpr std::string_view kMergeFn = "merge_parts";

}  // namespace

StoreAttentionResult attend(ConstView<float> queries, const ChunkSource& source,
                            const ValidLens& valid_rows, const StoreAttentionOptions& options) {
  check_store_attention(kFn, queries, source, options, source.rows());
  const std::vector<int64_t> rows = rows_seen(kFn, queries, valid_rows, source.rows());
  return finish(attend_chunks(queries, source, rows, options), options.top_k);
}

StoreAttentionResult merge_parts(const std::vector<StoreAttentionResult>& parts,
                                 const std::vector<int64_t>& part_rows, int64_t top_k) {
  if (parts.empty()) fail(kMergeFn, "parts is empty; expected at least one part");
  if (part_rows.size() != parts.size()) {
    fail(kMergeFn, "part_rows has " + std::to_string(part_rows.size()) + " entries but parts has " +
                       std::to_string(parts.size()));
  }
  const int64_t nq = parts[0].lse.numel();
  const int64_t dv = parts[0].output.rank() == 2 ? parts[0].output.size(1) : 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    const std::string at = "parts[" + std::to_string(p) + "]";
    detail::check_shape(kMergeFn, at + ".output", parts[p].output.view(), Shape{nq, dv});
    detail::check_shape(kMergeFn, at + ".lse", parts[p].lse.view(), Shape{nq});
    const int64_t k = parts[p].top_ids.rank() == 2 ? parts[p].top_ids.size(1) : 0;
    if (part_rows[p] < 0 || (top_k > 0 && k < std::min(top_k, part_rows[p]))) {
      fail(kMergeFn, at + " has top_ids of shape " + parts[p].top_ids.shape().str() + " and " +
                         "part_rows[" + std::to_string(p) + "] = " + std::to_string(part_rows[p]) +
                         "; expected at least min(top_k = " + std::to_string(top_k) +
                         ", its rows) top rows per query");
    }
    if (k > 0)
      detail::check_shape(kMergeFn, at + ".top_weights", parts[p].top_weights.view(), Shape{nq, k});
  }
  Partial merged = empty_partial(nq, dv, top_k);
  std::vector<Tensor<double>> outputs, lses;
  std::vector<ConstView<double>> output_views, lse_views;
  for (const StoreAttentionResult& part : parts) {
    outputs.push_back(Tensor<double>(part.output.shape()));
    lses.push_back(Tensor<double>(part.lse.shape()));
    std::copy_n(part.output.data(), part.output.numel(), outputs.back().data());
    std::copy_n(part.lse.data(), part.lse.numel(), lses.back().data());
    output_views.push_back(outputs.back().view());
    lse_views.push_back(lses.back().view());
  }
  merge_attention(output_views, lse_views, merged.output.view(), merged.lse.view());
  int64_t offset = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    const StoreAttentionResult& part = parts[p];
    const int64_t k = top_k > 0 && part.top_ids.rank() == 2 ? part.top_ids.size(1) : 0;
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t r = 0; r < k; ++r) {
        const float w = part.top_weights(i, r);
        if (part.top_ids(i, r) < 0 || !(w > 0.0f)) continue;  // none, or below float's range
        keep_best(merged.top[static_cast<size_t>(i)],
                  {double{part.lse(i)} + std::log(double{w}), offset + part.top_ids(i, r)}, top_k);
      }
    }
    offset += part_rows[p];
  }
  return finish(merged, top_k);
}

StoreAttentionResult attend(ConstView<float> queries,
                            const std::vector<const ChunkSource*>& sources,
                            const ValidLens& valid_rows, const StoreAttentionOptions& options) {
  if (sources.empty()) fail(kFn, "stores is empty; expected at least one store");
  int64_t rows = 0;
  for (size_t s = 0; s < sources.size(); ++s) {
    if (sources[s] == nullptr) fail(kFn, "stores[" + std::to_string(s) + "] is null");
    if (sources[s]->key_dim() != sources[0]->key_dim() ||
        sources[s]->value_dim() != sources[0]->value_dim()) {
      fail(kFn, sources[s]->name() + " has D = " + std::to_string(sources[s]->key_dim()) +
                    ", Dv = " + std::to_string(sources[s]->value_dim()) + " but " +
                    sources[0]->name() + " has D = " + std::to_string(sources[0]->key_dim()) +
                    ", Dv = " + std::to_string(sources[0]->value_dim()));
    }
    rows += sources[s]->rows();
  }
  check_store_attention(kFn, queries, *sources[0], options, rows);
  const std::vector<int64_t> global = rows_seen(kFn, queries, valid_rows, rows);
  std::vector<StoreAttentionResult> parts;
  std::vector<int64_t> part_rows;
  int64_t offset = 0;
  for (const ChunkSource* source : sources) {
    std::vector<int64_t> local(global.size());
    for (size_t i = 0; i < global.size(); ++i) {
      local[i] = std::clamp<int64_t>(global[i] - offset, 0, source->rows());
    }
    StoreAttentionOptions part_options = options;
    part_options.top_k = std::min(options.top_k, source->rows());
    parts.push_back(
        finish(attend_chunks(queries, *source, local, part_options), part_options.top_k));
    part_rows.push_back(source->rows());
    offset += source->rows();
  }
  return merge_parts(parts, part_rows, options.top_k);
}

StoreAttentionGrads attend_backward(ConstView<float> queries, const ChunkSource& source,
                                    const ValidLens& valid_rows,
                                    const StoreAttentionOptions& options,
                                    const SavedForward<float>& saved, ConstView<float> d_output) {
  check_store_attention(kBackwardFn, queries, source, options, source.rows());
  check_store_backward(kBackwardFn, queries, source, options, saved, d_output);
  const std::vector<int64_t> query_rows =
      rows_seen(kBackwardFn, queries, valid_rows, source.rows());
  const int64_t nq = queries.size(0), d = source.key_dim(), dv = source.value_dim();
  const bool bf16 = source.dtype() == StoreDtype::kBFloat16;
  Tensor<double> d_queries(Shape{nq, d});
  StoreAttentionGrads grads{Tensor<float>(Shape{nq, d}), Tensor<float>(Shape{source.rows(), d}),
                            Tensor<float>(Shape{source.rows(), dv})};
  const KernelQueries q(queries, source.dtype());
  const Tensor<float> out = Tensor<float>::copy_of(saved.output).reshaped(Shape{1, nq, dv});
  const Tensor<float> lse = Tensor<float>::copy_of(saved.lse).reshaped(Shape{1, nq});
  const Tensor<float> d_out = Tensor<float>::copy_of(d_output).reshaped(Shape{1, nq, dv});
  AttentionOptions attention;
  attention.scale = options.scale;
  Tensor<int64_t> lens(Shape{1, nq});
  const SavedForward<float> global{out.view(), lse.view()};

  for_each_chunk(
      source, query_rows, options.progress, lens,
      [&](const SourceChunk& chunk, const ValidLens& valid) {
        const DotProductGrads<float> g =
            bf16 ? scaled_dot_product_attention_backward(q.bf16.view(),
                                                         batch_of_one(chunk.keys<bfloat16>()),
                                                         batch_of_one(chunk.values<bfloat16>()),
                                                         valid, attention, global, d_out.view())
                 : scaled_dot_product_attention_backward(
                       q.f32.view(), batch_of_one(chunk.keys<float>()),
                       batch_of_one(chunk.values<float>()), valid, attention, global, d_out.view());
        // dQ's shares summed in chunk order, in double; dK and dV are this chunk's rows.
        for (int64_t i = 0; i < nq * d; ++i) d_queries.data()[i] += g.d_queries.data()[i];
        const ChunkRange range = chunk.range();
        std::copy_n(g.d_keys.data(), range.rows * d, grads.d_keys.data() + range.first_row * d);
        std::copy_n(g.d_values.data(), range.rows * dv,
                    grads.d_values.data() + range.first_row * dv);
      });
  for (int64_t i = 0; i < nq * d; ++i)
    grads.d_queries.data()[i] = static_cast<float>(d_queries.data()[i]);
  return grads;
}

}  // namespace qkv
