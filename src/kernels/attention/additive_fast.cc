// Additive attention, fast version: fused, never forming the (B, Nq, Nk, H)
// features. W_q q and W_k k are projected once (BLAS), the key features stored
// transposed so the SIMD lanes run over keys; scores w_v^T tanh(fq + fk) are
// summed in registers (fast::additive_scores).
// Forward: tasks of kQueryBlock queries; per task its scores against the keys
// any of them may see (keys past the longest valid length are never touched),
// the masked softmax row by row, dropout regenerated from the counter-based
// generator, and one GEMM with the values.
// Backward: tasks of (batch element, key chunk); per query block the scores
// and weights are recomputed from the saved lse and every gradient of the
// tile comes from one tanh per (query, key, h) (fast::additive_grad_tile).
// Each output element is written by exactly one task (partials are summed in
// a fixed order), so results do not depend on the thread count.
// Nothing is allocated: projections, partial sums and each thread's scratch
// are slices of the Workspace sized by additive_workspace_size and
// additive_backward_workspace_size.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/attention/additive_tile.h"
#include "kernels/attention/attention_common.h"
#include "kernels/runtime/blas.h"
#include "kernels/kernels.h"
#include "kernels/runtime/philox.h"
#include "kernels/simd/vecmath.h"
#include "kernels/runtime/workspace.h"

namespace qkv::kernels::fast {
namespace {

// 64 queries x Nk scores per task: 256 KiB at Nk = 1024 in float, inside L2,
// and enough rows for the BLAS to run near its peak rate. The backward's
// query blocks too.
constexpr int64_t kQueryBlock = 64;

// Dropout for one row of weights: w[j] = kept ? w[j] / (1 - p) : 0, j < n;
// keep holds n flags.
template <class T>
void dropout_row(const AttentionConfig& config, int64_t b, int64_t i, T* w, int64_t n,
                 uint8_t* keep) {
  kernels::dropout_row_mask(config.seed, config.dropout, b, i, 0, n, keep);
  const T inv = config.dropout < 1.0 ? static_cast<T>(1.0 / (1.0 - config.dropout)) : T(0);
  for (int64_t j = 0; j < n; ++j) w[j] = keep[j] ? w[j] * inv : T(0);
}

// The forward's second half for one task: scores s (rows x n_eff, leading
// dimension lds; only j < len read) become weights in place, then dropout and
// pooling with the values. scratch holds rows x n_eff (the dropped copy when
// the weights are an output and there is dropout), keep n_eff flags.
template <class T>
void softmax_dropout_pool(T* s, int64_t lds, int64_t rows, int64_t n_eff, int64_t b, int64_t i0,
                          const AttentionConfig& config, int64_t nk, const T* v_b, int64_t dv,
                          T* out, T* lse, bool weights_are_output, T* scratch, uint8_t* keep) {
  for (int64_t r = 0; r < rows; ++r) {
    T* row = s + r * lds;
    const T row_lse = softmax_row(row, config.valid_lens(b, i0 + r, nk), n_eff, row);
    if (lse) lse[r] = row_lse;
    if (weights_are_output) std::fill(row + n_eff, row + nk, T(0));
  }
  const T* pooled = s;
  int64_t ldp = lds;
  if (config.dropout > 0.0) {
    // The returned weights are the ones before dropout, so drop a copy.
    T* p = s;
    if (weights_are_output) {
      p = scratch;
      for (int64_t r = 0; r < rows; ++r) std::copy_n(s + r * lds, n_eff, p + r * n_eff);
      ldp = n_eff;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t len = config.valid_lens(b, i0 + r, nk);
      dropout_row(config, b, i0 + r, p + r * ldp, len, keep);
    }
    pooled = p;
  }
  kernels::gemm(false, false, rows, dv, n_eff, T(1), pooled, ldp, v_b, dv, T(0), out, dv);
}

// One forward task's scratch (a slot of the workspace, so one per running
// thread): scores when the weights are not an output, the dropped copy when
// they are, the dropout flags of a row, the rows' lengths and the score
// tile's own. Sized for the largest task; forward_slot_words counts it.
struct ForwardScratch {
  bool local_scores, dropped_copy, keep;
  int64_t rows, nk, hidden;
};
ForwardScratch forward_scratch(int64_t nq, int64_t nk, int64_t hidden,
                               const AttentionConfig& config, bool return_weights) {
  const bool dropout = config.dropout > 0.0;
  return {!return_weights, dropout && return_weights, dropout, std::min(kQueryBlock, nq), nk, hidden};
}
template <class T>
size_t forward_slot_words(const ForwardScratch& f) {
  return (f.local_scores ? slice_words<T>(f.rows * f.nk) : 0) +
         (f.dropped_copy ? slice_words<T>(f.rows * f.nk) : 0) +
         (f.keep ? slice_words<uint8_t>(f.nk) : 0) + slice_words<int64_t>(f.rows) +
         fast::additive_scores_scratch_words<T>(f.hidden);
}

// Runs the forward over tasks (b, query block), each with the scratch of its
// slot (slot_words doubles from `slots` on); `scores` fills rows x n_eff
// scores for a task, cutting its own scratch from `cursor`:
// scores(b, i0, rows, n_eff, dst, ld, cursor).
template <class T, class ScoreFn>
void forward_tasks(int64_t batch, int64_t nq, int64_t nk, ConstView<T> v,
                   const AttentionConfig& config, TensorView<T> output, TensorView<T> weights,
                   TensorView<T> lse, double* slots, size_t slot_words, int num_slots,
                   ScoreFn&& scores) {
  const int64_t dv = v.size(2);
  const int64_t blocks = ceil_div(nq, kQueryBlock);
  const bool return_weights = weights.data() != nullptr;
  const bool dropout = config.dropout > 0.0;
  parallel_for_slots(batch * blocks, num_slots, [&](int64_t task, int slot) {
    const int64_t b = task / blocks, i0 = (task % blocks) * kQueryBlock;
    const int64_t rows = std::min(kQueryBlock, nq - i0);
    const int64_t n_eff = longest_len(config.valid_lens, b, i0, i0 + rows, nk);
    double* cursor = slots + static_cast<size_t>(slot) * slot_words;
    T* s;
    int64_t lds;
    if (return_weights) {
      s = weights.data() + (b * nq + i0) * nk;
      lds = nk;
    } else {
      s = take_slice<T>(&cursor, rows * n_eff);
      lds = n_eff;
    }
    T* const scratch = dropout && return_weights ? take_slice<T>(&cursor, rows * n_eff) : nullptr;
    uint8_t* const keep = dropout ? take_slice<uint8_t>(&cursor, n_eff) : nullptr;
    scores(b, i0, rows, n_eff, s, lds, cursor);
    softmax_dropout_pool(s, lds, rows, n_eff, b, i0, config, nk, v.data() + b * nk * dv, dv,
                         output.data() + (b * nq + i0) * dv,
                         lse.data() ? lse.data() + b * nq + i0 : nullptr, return_weights, scratch,
                         keep);
  });
}

}  // namespace

namespace {

// f = x W^T for all rows of x: (B*N, dim) x (H, dim)^T -> (B*N, H), every
// element written.
template <class T>
void project(ConstView<T> x, ConstView<T> w, T* f) {
  const int64_t rows = x.size(0) * x.size(1), dim = x.size(2), hidden = w.size(0);
  kernels::parallel_gemm(false, true, rows, hidden, dim, T(1), x.data(), dim, w.data(), dim, T(0),
                         f, hidden);
}

int64_t round_up(int64_t n, int64_t multiple) { return ceil_div(n, multiple) * multiple; }

// Keys per projection task: 256 x H outputs, one BLAS call each.
constexpr int64_t kProjectKeys = 256;

// The key features transposed, fkt(b) = W_k K_b^T: (B, H, ldk), ldk = Nk
// rounded up to kAdditivePad. Keys past every valid length of b are not
// projected (never read); their columns, like the padding, are set to 0 (the
// tiles load whole vectors of them and test them against kExpRange).
template <class T>
void project_keys_transposed(ConstView<T> k, ConstView<T> w_k, const ValidLens& lens, int64_t nq,
                             int64_t ldk, T* fkt) {
  const int64_t batch = k.size(0), nk = k.size(1), dk = k.size(2), hidden = w_k.size(0);
  std::fill_n(fkt, batch * hidden * ldk, T(0));
  const int64_t blocks = ceil_div(nk, kProjectKeys);
  kernels::parallel_for(batch * blocks, [&](int64_t task) {
    const int64_t b = task / blocks, j0 = (task % blocks) * kProjectKeys;
    const int64_t seen = longest_len(lens, b, 0, nq, nk);
    if (j0 >= seen) return;
    kernels::gemm(false, true, hidden, std::min(kProjectKeys, seen - j0), dk, T(1), w_k.data(), dk,
                  k.data() + (b * nk + j0) * dk, dk, T(0), fkt + b * hidden * ldk + j0, ldk);
  });
}

// The backward splits each batch element's visible keys into this many
// chunks, one task each (B * 4 tasks keep 2 threads busy even at B = 1).
// Each task owns its keys' d(fk) and dV outright and writes its own partial
// d(fq) and d(w_v), summed afterwards in chunk order: no two threads write the
// same element, and one tanh per (query, key, h) serves all the gradients.
// The partials cost 4 B Nq H elements.
constexpr int64_t kKeyChunks = 4;

// float's fast path carries the keys' exponentials (additive_tile.h).
template <class T>
constexpr bool kKeyExps = sizeof(T) == 4;

// The whole-problem slices, in the order they are cut: the forward's fq
// (B, Nq, H) and fkt (B, H, ldk), for float the keys' exponentials ekt
// (B, H, ldk) and block_ok (B, ldk / kAdditivePad); the backward adds d(fq)'s
// partials (kKeyChunks, B, Nq, H), d(fk) transposed (B, H, ldk), d(w_v)'s
// partials (B kKeyChunks, H) and d(fq) (B, Nq, H).
template <class T>
size_t projection_words(int64_t batch, int64_t nq, int64_t hidden, int64_t ldk) {
  size_t words = slice_words<T>(batch * nq * hidden) + slice_words<T>(batch * hidden * ldk);
  if constexpr (kKeyExps<T>) {
    words += slice_words<T>(batch * hidden * ldk) +
             slice_words<uint8_t>(batch * ldk / fast::kAdditivePad);
  }
  return words;
}

// Both passes' first step: W_q q (B, Nq, H), (W_k k)^T (B, H, ldk) and, for
// float, the keys' exponentials (fast::additive_key_exps), cut from `cursor`
// in projection_words' order.
template <class T>
struct Projected {
  T* fq;
  T* fkt;
  T* ekt = nullptr;             // float: (B, H, ldk)
  uint8_t* block_ok = nullptr;  // float: (B, ldk / kAdditivePad)
  int64_t nq, hidden, ldk;

  // Batch element b's features from query i0 and key k0 on (k0 a multiple of
  // kAdditivePad), with w_v.
  fast::AdditiveFeatures<T> features(int64_t b, int64_t i0, int64_t k0, const T* wv) const {
    fast::AdditiveFeatures<T> f{
        fq + (b * nq + i0) * hidden, hidden, fkt + b * hidden * ldk + k0, ldk, wv, hidden};
    if constexpr (kKeyExps<T>) {
      f.ekt = ekt + b * hidden * ldk + k0;
      f.block_ok = block_ok + (b * ldk + k0) / fast::kAdditivePad;
    }
    return f;
  }
};

template <class T>
Projected<T> project_all(double** cursor, ConstView<T> q, ConstView<T> k,
                         const AdditiveParams<T>& params, const ValidLens& lens) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), hidden = params.w_q.size(0);
  Projected<T> p;
  p.nq = nq;
  p.hidden = hidden;
  p.ldk = round_up(nk, fast::kAdditivePad);
  p.fq = take_slice<T>(cursor, batch * nq * hidden);
  p.fkt = take_slice<T>(cursor, batch * hidden * p.ldk);
  project(q, params.w_q, p.fq);
  project_keys_transposed(k, params.w_k, lens, nq, p.ldk, p.fkt);
  if constexpr (kKeyExps<T>) {
    p.ekt = take_slice<T>(cursor, batch * hidden * p.ldk);
    p.block_ok = take_slice<uint8_t>(cursor, batch * p.ldk / fast::kAdditivePad);
    kernels::parallel_for(batch, [&](int64_t b) {
      fast::additive_key_exps(p.fkt + b * hidden * p.ldk, hidden, p.ldk, p.ekt + b * hidden * p.ldk,
                              p.block_ok + b * p.ldk / fast::kAdditivePad);
    });
  }
  return p;
}

template <class T>
size_t backward_sums_words(int64_t batch, int64_t nq, int64_t hidden, int64_t ldk) {
  return slice_words<T>(kKeyChunks * batch * nq * hidden) + slice_words<T>(batch * hidden * ldk) +
         slice_words<T>(batch * kKeyChunks * hidden) + slice_words<T>(batch * nq * hidden);
}

// One backward task's scratch, sized for the widest key chunk (ld <= chunk)
// and the largest query block: dLoss/d(dropped weights), the dropped weights,
// the dropout scales, per-row lse, D and valid counts, a row's dropout flags
// and the gradient tile's own.
template <class T>
size_t backward_slot_words(int64_t nq, int64_t nk, int64_t hidden, bool dropout) {
  const int64_t rows = std::min(kQueryBlock, nq);
  const int64_t chunk = round_up(ceil_div(nk, kKeyChunks), fast::kAdditivePad);
  return 2 * slice_words<T>(rows * chunk) + (dropout ? slice_words<T>(rows * chunk) : 0) +
         2 * slice_words<T>(rows) + slice_words<int64_t>(rows) + slice_words<uint8_t>(chunk) +
         fast::additive_grad_tile_scratch_words<T>(hidden);
}

}  // namespace

template <class T>
size_t additive_workspace_size(ConstView<T> q, ConstView<T> k, ConstView<T> /*v*/,
                               const AdditiveParams<T>& params, const AttentionConfig& config,
                               const ForwardViews<T>& out, int num_threads) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), hidden = params.w_q.size(0);
  const ForwardScratch f = forward_scratch(nq, nk, hidden, config, out.weights.data() != nullptr);
  return projection_words<T>(batch, nq, hidden, round_up(nk, fast::kAdditivePad)) +
         forward_slot_words<T>(f) * static_cast<size_t>(std::max(num_threads, 1));
}

template <class T>
size_t additive_backward_workspace_size(ConstView<T> q, ConstView<T> k, ConstView<T> /*v*/,
                                        const AdditiveParams<T>& params,
                                        const AttentionConfig& config,
                                        const SavedViews<T>& /*saved*/, ConstView<T> /*d_output*/,
                                        const AdditiveGradViews<T>& /*grads*/, int num_threads) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), hidden = params.w_q.size(0);
  const int64_t ldk = round_up(nk, fast::kAdditivePad);
  return projection_words<T>(batch, nq, hidden, ldk) +
         backward_sums_words<T>(batch, nq, hidden, ldk) +
         backward_slot_words<T>(nq, nk, hidden, config.dropout > 0.0) *
             static_cast<size_t>(std::max(num_threads, 1));
}

// q: (B, Nq, Dq)   k: (B, Nk, Dk)   v: (B, Nk, Dv)   w_q: (H, Dq)   w_k: (H, Dk)   w_v: (H)
// out.output: (B, Nq, Dv); out.weights (B, Nq, Nk) and out.lse (B, Nq) when given.
template <class T>
void additive(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AdditiveParams<T>& params,
              const AttentionConfig& config, const ForwardViews<T>& out, Workspace workspace) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), hidden = params.w_q.size(0);
  const ValidLens& lens = config.valid_lens;
  // The (B, Nq, Nk, H) features are never formed: W_q q and W_k k once, then
  // each score's tanh-and-reduce happens in registers, keys across the lanes.
  double* cursor = workspace.data;
  const Projected<T> proj = project_all(&cursor, q, k, params, lens);
  const int slots = std::max(workspace.num_threads, 1);
  const size_t slot_words =
      forward_slot_words<T>(forward_scratch(nq, nk, hidden, config, out.weights.data() != nullptr));
  forward_tasks(
      batch, nq, nk, v, config, out.output, out.weights, out.lse, cursor, slot_words, slots,
      [&](int64_t b, int64_t i0, int64_t rows, int64_t, T* s, int64_t lds, double* scratch) {
        int64_t* const row_lens = take_slice<int64_t>(&scratch, rows);
        for (int64_t r = 0; r < rows; ++r) row_lens[r] = lens(b, i0 + r, nk);
        fast::additive_scores(proj.features(b, i0, 0, params.w_v.data()), rows, row_lens, s, lds,
                              scratch);
      });
}

// Gradients of q, k, v, W_q, W_k and w_v (H), every element written.
template <class T>
void additive_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                       const AdditiveParams<T>& params, const AttentionConfig& config,
                       const SavedViews<T>& saved, ConstView<T> d_output,
                       const AdditiveGradViews<T>& grads, Workspace workspace) {
  const ConstView<T> output = saved.output, lse = saved.lse;
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), hidden = params.w_q.size(0);
  const int64_t dq = q.size(2), dk = k.size(2), dv = v.size(2);
  const ValidLens& lens = config.valid_lens;
  double* cursor = workspace.data;
  const Projected<T> proj = project_all(&cursor, q, k, params, lens);
  const int64_t ldk = proj.ldk;
  // Accumulated into (every element, skipped tasks' too, is read afterwards).
  const int64_t fq_size = batch * nq * hidden, dwv_size = batch * kKeyChunks * hidden;
  T* const dfq_parts = take_slice<T>(&cursor, kKeyChunks * fq_size);  // (chunks, B, Nq, H)
  T* const dfkt = take_slice<T>(&cursor, batch * hidden * ldk);       // (B, H, ldk)
  T* const dwv_parts = take_slice<T>(&cursor, dwv_size);              // (B chunks, H)
  T* const dfq = take_slice<T>(&cursor, fq_size);                     // (B, Nq, H)
  std::fill_n(dfq_parts, kKeyChunks * fq_size, T(0));
  std::fill_n(dfkt, batch * hidden * ldk, T(0));
  std::fill_n(dwv_parts, dwv_size, T(0));
  std::fill_n(dfq, fq_size, T(0));
  // Accumulated into below; keys no query sees keep 0.
  std::fill_n(grads.d_values.data(), grads.d_values.numel(), T(0));
  std::fill_n(grads.d_w_k.data(), grads.d_w_k.numel(), T(0));
  std::fill_n(grads.d_w_v.data(), grads.d_w_v.numel(), T(0));
  const T inv_keep = config.dropout < 1.0 ? static_cast<T>(1.0 / (1.0 - config.dropout)) : T(0);

  const bool dropout = config.dropout > 0.0;
  const int slots = std::max(workspace.num_threads, 1);
  const size_t slot_words = backward_slot_words<T>(nq, nk, hidden, dropout);
  double* const slot_base = cursor;
  parallel_for_slots(batch * kKeyChunks, slots, [&](int64_t task, int slot) {
    const int64_t b = task / kKeyChunks, c = task % kKeyChunks;
    const int64_t seen = longest_len(lens, b, 0, nq, nk);
    const int64_t chunk = round_up(ceil_div(seen, kKeyChunks), fast::kAdditivePad);
    const int64_t k0 = c * chunk, k1 = std::min(seen, k0 + chunk);
    if (k0 >= k1) return;
    const int64_t ld = round_up(k1 - k0, fast::kAdditivePad);
    // Per query block: dLoss/d(dropped weights), dropped weights, dropout
    // scales; the slot's own, every element read written first.
    const int64_t max_rows = std::min(kQueryBlock, nq);
    double* scratch = slot_base + static_cast<size_t>(slot) * slot_words;
    T* const dp = take_slice<T>(&scratch, max_rows * ld);
    T* const p = take_slice<T>(&scratch, max_rows * ld);
    T* const drop = dropout ? take_slice<T>(&scratch, max_rows * ld) : nullptr;
    T* const lse_blk = take_slice<T>(&scratch, max_rows);
    T* const d_row = take_slice<T>(&scratch, max_rows);
    int64_t* const n_valid = take_slice<int64_t>(&scratch, max_rows);
    uint8_t* const keep = take_slice<uint8_t>(&scratch, ld);
    const fast::AdditiveFeatures<T> f_b = proj.features(b, 0, k0, params.w_v.data());
    T* d_values_b = grads.d_values.data() + b * nk * dv;
    for (int64_t i0 = 0; i0 < nq; i0 += kQueryBlock) {
      const int64_t rows = std::min(kQueryBlock, nq - i0);
      int64_t cols = 0;
      for (int64_t r = 0; r < rows; ++r) {
        lse_blk[r] = lse(b, i0 + r);
        // An empty row (lse -inf) has no weights and sends back no gradient.
        const bool empty = lse_blk[r] == -std::numeric_limits<T>::infinity();
        n_valid[r] = empty ? 0 : std::clamp<int64_t>(lens(b, i0 + r, nk) - k0, 0, k1 - k0);
        cols = std::max(cols, n_valid[r]);
      }
      if (cols == 0) continue;
      const T* d_out_blk = d_output.data() + (b * nq + i0) * dv;
      kernels::gemm(false, true, rows, cols, dv, T(1), d_out_blk, dv, v.data() + (b * nk + k0) * dv,
                    dv, T(0), dp, ld);
      for (int64_t r = 0; r < rows; ++r) {
        // D_r = sum_j P dP = dO_r . O_r (O already includes the dropout).
        d_row[r] = fast::dot(d_out_blk + r * dv, output.data() + (b * nq + i0 + r) * dv, dv);
        if (drop == nullptr) continue;
        kernels::dropout_row_mask(config.seed, config.dropout, b, i0 + r, k0, n_valid[r], keep);
        T* drop_r = drop + r * ld;
        for (int64_t j = 0; j < n_valid[r]; ++j) drop_r[j] = keep[j] ? inv_keep : T(0);
      }
      fast::AdditiveFeatures<T> f = f_b;
      f.fq += i0 * hidden;
      const fast::AdditiveGradTile<T> tile{rows,
                                           cols,
                                           n_valid,
                                           lse_blk,
                                           d_row,
                                           dp,
                                           drop,
                                           ld,
                                           p,
                                           dfq_parts + ((c * batch + b) * nq + i0) * hidden,
                                           hidden,
                                           dfkt + b * hidden * ldk + k0,
                                           dwv_parts + task * hidden};
      fast::additive_grad_tile(f, tile, scratch);
      // dV += P_dropped^T dO over this block's queries.
      kernels::gemm(true, false, cols, dv, rows, T(1), p, ld, d_out_blk, dv, T(1),
                    d_values_b + k0 * dv, dv);
    }
  });

  // d(fq): the chunks' partial sums, in chunk order.
  kernels::parallel_for(ceil_div(fq_size, int64_t{1} << 14), [&](int64_t blk) {
    const int64_t e0 = blk << 14, e1 = std::min(fq_size, e0 + (int64_t{1} << 14));
    for (int64_t c = 0; c < kKeyChunks; ++c) {
      const T* part = dfq_parts + c * fq_size;
      for (int64_t e = e0; e < e1; ++e) dfq[e] += part[e];
    }
  });

  // Back through the projections: dQ = d(fq) W_q, dW_q = d(fq)^T Q, and the
  // same for K from the transposed d(fk).
  kernels::parallel_gemm(false, false, batch * nq, dq, hidden, T(1), dfq, hidden, params.w_q.data(),
                         dq, T(0), grads.d_queries.data(), dq);
  kernels::parallel_gemm(true, false, hidden, dq, batch * nq, T(1), dfq, hidden, q.data(), dq, T(0),
                         grads.d_w_q.data(), dq);
  const int64_t key_blocks = ceil_div(nk, kernels::kGemmRowBlock);
  kernels::parallel_for(batch * key_blocks, [&](int64_t task) {
    const int64_t b = task / key_blocks, j0 = (task % key_blocks) * kernels::kGemmRowBlock;
    const int64_t rows = std::min(kernels::kGemmRowBlock, nk - j0);
    kernels::gemm(true, false, rows, dk, hidden, T(1), dfkt + b * hidden * ldk + j0, ldk,
                  params.w_k.data(), dk, T(0), grads.d_keys.data() + (b * nk + j0) * dk, dk);
  });
  // dW_k = sum_b d(fk)_b^T K_b over the keys some query of b may see: keys past
  // every valid length are never read, not even to be multiplied by zero.
  kernels::parallel_for(ceil_div(hidden, kernels::kGemmRowBlock), [&](int64_t blk) {
    const int64_t h0 = blk * kernels::kGemmRowBlock;
    const int64_t rows = std::min(kernels::kGemmRowBlock, hidden - h0);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t seen = longest_len(lens, b, 0, nq, nk);
      kernels::gemm(false, false, rows, dk, seen, T(1), dfkt + (b * hidden + h0) * ldk, ldk,
                    k.data() + b * nk * dk, dk, b == 0 ? T(0) : T(1), grads.d_w_k.data() + h0 * dk,
                    dk);
    }
  });
  for (int64_t t = 0; t < batch * kKeyChunks; ++t) {
    for (int64_t h = 0; h < hidden; ++h) grads.d_w_v(h) += dwv_parts[t * hidden + h];
  }
}

#define QKV_INSTANTIATE_ADDITIVE(T)                                                               \
  template size_t additive_workspace_size<T>(ConstView<T>, ConstView<T>, ConstView<T>,            \
                                             const AdditiveParams<T>&, const AttentionConfig&,    \
                                             const ForwardViews<T>&, int);                        \
  template void additive<T>(ConstView<T>, ConstView<T>, ConstView<T>, const AdditiveParams<T>&,   \
                            const AttentionConfig&, const ForwardViews<T>&, Workspace);           \
  template size_t additive_backward_workspace_size<T>(                                            \
      ConstView<T>, ConstView<T>, ConstView<T>, const AdditiveParams<T>&, const AttentionConfig&, \
      const SavedViews<T>&, ConstView<T>, const AdditiveGradViews<T>&, int);                      \
  template void additive_backward<T>(                                                             \
      ConstView<T>, ConstView<T>, ConstView<T>, const AdditiveParams<T>&, const AttentionConfig&, \
      const SavedViews<T>&, ConstView<T>, const AdditiveGradViews<T>&, Workspace);
QKV_INSTANTIATE_ADDITIVE(float)
QKV_INSTANTIATE_ADDITIVE(double)
#undef QKV_INSTANTIATE_ADDITIVE

}  // namespace qkv::kernels::fast
