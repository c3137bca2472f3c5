// attend(queries, store): the fused scaled dot-product kernel over each chunk
// of a key-value store, merged in chunk order by log-sum-exp (qkv/merge.h)
// into a running result kept in double; top-k rows from each chunk's
// weights. A front end: it checks once, then calls the public attention and
// merge functions chunk by chunk.
#include "qkv/store_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "check.h"
#include "kernels/parallel.h"
#include "qkv/attention.h"
#include "qkv/bfloat16.h"
#include "qkv/error.h"
#include "qkv/merge.h"

namespace qkv {
namespace {

constexpr std::string_view kFn = "attend";
constexpr double kInf = std::numeric_limits<double>::infinity();

// A query's best rows so far: (log-weight up to the final lse, row id),
// best first; log-weights are lse_chunk + log(chunk weight).
struct TopRows {
  std::vector<std::pair<double, int64_t>> rows;  // sorted: larger first, then smaller id

  static bool better(const std::pair<double, int64_t>& a, const std::pair<double, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  }
  // Offers one chunk's weights w[0..n) of rows first_row + j, whose chunk
  // log-sum-exp is lse: a row enters if it beats the k-th best.
  void offer(const float* w, int64_t n, int64_t first_row, double lse, int64_t k) {
    for (int64_t j = 0; j < n; ++j) {
      if (w[j] <= 0.0f) continue;  // masked, or below float's range: weight 0
      const std::pair<double, int64_t> row{lse + std::log(static_cast<double>(w[j])), first_row + j};
      if (static_cast<int64_t>(rows.size()) == k && !better(row, rows.back())) continue;
      rows.insert(std::upper_bound(rows.begin(), rows.end(), row, better), row);
      if (static_cast<int64_t>(rows.size()) > k) rows.pop_back();
    }
  }
};

// One chunk's partial attention: output (1, Nq, Dv) and lse (1, Nq), and
// the weights (1, Nq, rows) when `weights` is given.
void attend_chunk(const KeyValueStore& store, const MappedChunk& chunk, int64_t rows,
                  ConstView<float> queries, const Tensor<bfloat16>& queries_bf16,
                  ConstView<int64_t> lens, const AttentionOptions& options, Tensor<float>& output,
                  Tensor<float>& lse, Tensor<float>* weights) {
  const int64_t d = store.key_dim(), dv = store.value_dim();
  if (store.dtype() == StoreDtype::kFloat32) {
    const ConstView<float> keys(static_cast<const float*>(chunk.keys), Shape{1, rows, d});
    const ConstView<float> values(static_cast<const float*>(chunk.values), Shape{1, rows, dv});
    AttentionOutputs<float> outputs{output.view(), std::nullopt, lse.view()};
    if (weights) outputs.weights = weights->view();
    scaled_dot_product_attention(queries, keys, values, ValidLens(lens), options, outputs);
    return;
  }
  const ConstView<bfloat16> keys(static_cast<const bfloat16*>(chunk.keys), Shape{1, rows, d});
  const ConstView<bfloat16> values(static_cast<const bfloat16*>(chunk.values), Shape{1, rows, dv});
  AttentionOptions with = options;
  with.want_lse = true;
  with.want_weights = weights != nullptr;
  AttentionResult<float> result =
      scaled_dot_product_attention(queries_bf16.view(), keys, values, ValidLens(lens), with);
  output = std::move(result.output);
  lse = std::move(result.lse);
  if (weights) *weights = std::move(result.weights);
}

}  // namespace

StoreAttentionResult attend(ConstView<float> queries, const KeyValueStore& store,
                            const ValidLens& valid_rows, const StoreAttentionOptions& options) {
  detail::check_rank(kFn, "queries", queries, 2, "(Nq, D)");
  const int64_t nq = queries.size(0), d = store.key_dim(), dv = store.value_dim();
  const int64_t n = store.rows();
  if (queries.size(1) != d) {
    fail(kFn, "queries has shape " + queries.shape().str() + " but store " + store.dir() +
                  " has keys of D = " + std::to_string(d));
  }
  const ValidLens lens = valid_rows.for_batch_of_one(kFn, "valid_rows", "queries", queries.shape());
  lens.check(kFn, "the store's rows", Shape{nq, n}, 1, nq, n);
  if (options.top_k < 0 || options.top_k > n) {
    fail(kFn, "top_k = " + std::to_string(options.top_k) + "; expected 0 to the store's " +
                  std::to_string(n) + " rows");
  }
  if (options.scale && !std::isfinite(*options.scale)) {
    fail(kFn, "scale = " + std::to_string(*options.scale) + "; expected a finite number");
  }
  const int64_t k = options.top_k;

  // The queries as the kernels take them: contiguous (1, Nq, D), bf16 for a
  // bf16 store.
  const Tensor<float> q = Tensor<float>::copy_of(queries);
  const ConstView<float> q3 = q.view().unsqueeze0();
  Tensor<bfloat16> q_bf16;
  if (store.dtype() == StoreDtype::kBFloat16) {
    q_bf16 = Tensor<bfloat16>(Shape{1, nq, d});
    for (int64_t i = 0; i < nq * d; ++i) q_bf16.data()[i] = bfloat16(q.data()[i]);
  }
  std::vector<int64_t> query_rows(static_cast<size_t>(nq));
  for (int64_t i = 0; i < nq; ++i) query_rows[static_cast<size_t>(i)] = lens(0, i, n);

  AttentionOptions attention;
  attention.scale = options.scale;
  attention.want_lse = true;

  // The running result in double, merged with each chunk's in place.
  Tensor<double> out_run(Shape{nq, dv}), lse_run(Shape{nq}, -kInf);
  Tensor<double> out_part(Shape{nq, dv}), lse_part(Shape{nq});
  Tensor<float> out_chunk(Shape{1, nq, dv}), lse_chunk(Shape{1, nq}), weights;
  Tensor<int64_t> chunk_lens(Shape{1, nq});
  std::vector<TopRows> top(static_cast<size_t>(k > 0 ? nq : 0));

  // Chunks some query sees, in order; the next one is mapped and its read
  // started while the current one is computed.
  std::vector<size_t> needed;
  for (size_t c = 0; c < store.chunks().size(); ++c) {
    const int64_t first = store.chunks()[c].first_row;
    if (std::any_of(query_rows.begin(), query_rows.end(), [&](int64_t r) { return r > first; })) {
      needed.push_back(c);
    }
  }
  const int64_t total = store.file_bytes();
  int64_t done = 0;
  MappedChunk next;
  if (!needed.empty()) {
    next = store.map_chunk(needed[0]);
    next.keys_file.prefetch();
    next.values_file.prefetch();
  }
  for (size_t s = 0; s < needed.size(); ++s) {
    const MappedChunk chunk = std::move(next);
    if (s + 1 < needed.size()) {
      next = store.map_chunk(needed[s + 1]);
      next.keys_file.prefetch();
      next.values_file.prefetch();
    }
    const StoreChunk& info = store.chunks()[needed[s]];
    for (int64_t i = 0; i < nq; ++i) {
      chunk_lens(0, i) = std::clamp<int64_t>(query_rows[static_cast<size_t>(i)] - info.first_row, 0,
                                             info.rows);
    }
    if (k > 0 && store.dtype() == StoreDtype::kFloat32 && weights.numel() != nq * info.rows) {
      weights = Tensor<float>(Shape{1, nq, info.rows});  // once, unless the chunks' sizes differ
    }
    attend_chunk(store, chunk, info.rows, q3, q_bf16, chunk_lens.view(), attention, out_chunk,
                 lse_chunk, k > 0 ? &weights : nullptr);
    for (int64_t i = 0; i < nq; ++i) {
      lse_part(i) = lse_chunk(0, i);
      for (int64_t j = 0; j < dv; ++j) out_part(i, j) = out_chunk(0, i, j);
    }
    merge_attention(std::vector<ConstView<double>>{out_run.view(), out_part.view()},
                    std::vector<ConstView<double>>{lse_run.view(), lse_part.view()}, out_run.view(),
                    lse_run.view());
    if (k > 0) {
      kernels::parallel_for(nq, [&](int64_t i) {
        const int64_t len = chunk_lens(0, i);
        if (len > 0) {
          top[static_cast<size_t>(i)].offer(&weights(0, i, 0), len, info.first_row,
                                            lse_chunk(0, i), k);
        }
      });
    }
    done += static_cast<int64_t>(chunk.keys_file.size() + chunk.values_file.size());
    if (options.progress) options.progress(done, total);
  }

  StoreAttentionResult result;
  result.output = Tensor<float>(Shape{nq, dv});
  result.lse = Tensor<float>(Shape{nq});
  for (int64_t i = 0; i < nq; ++i) {
    result.lse(i) = static_cast<float>(lse_run(i));
    for (int64_t j = 0; j < dv; ++j) result.output(i, j) = static_cast<float>(out_run(i, j));
  }
  if (k > 0) {
    result.top_ids = Tensor<int64_t>(Shape{nq, k}, -1);
    result.top_weights = Tensor<float>(Shape{nq, k});
    for (int64_t i = 0; i < nq; ++i) {
      const auto& rows = top[static_cast<size_t>(i)].rows;
      for (size_t r = 0; r < rows.size(); ++r) {
        result.top_ids(i, r) = rows[r].second;
        result.top_weights(i, r) = static_cast<float>(std::exp(rows[r].first - lse_run(i)));
      }
    }
  }
  return result;
}

}  // namespace qkv
