// The kernels behind the public ops, in two versions with one contract per
// op: ref (plain loops, double accumulation, any strides) and fast (BLAS,
// SIMD, threads; contiguous inputs). Views in, views out: the front ends
// (src/ops, src/attention, src/regression) validate arguments, allocate every
// destination and then call one of them; kernels only assert. The types here are the kernels' own (no
// front-end header: the owning results live in qkv/attention.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <type_traits>

#include "kernels/runtime/workspace.h"
#include "qkv/bfloat16.h"
#include "qkv/tensor.h"
#include "qkv/valid_lens.h"

namespace qkv::kernels {

// The layout the fast SDPA kernel reads and writes in place: a (B, H, N, D)
// view whose rows are contiguous (stride 1 along D) and lie in increasing
// order without overlap (stride along N at least D), any strides along B and
// H (negative too). So a (B, N, H, D) tensor from one fused projection is
// read as (B, H, N, D) with no copy; other layouts are copied once by the
// front end. (N <= 1 or D <= 1: the stride that does not matter is ignored.)
template <class T>
bool rows_in_place(TensorView<T> x) {
  if (x.rank() != 4) return false;
  const bool unit_rows = x.size(3) <= 1 || x.stride(3) == 1;
  const bool ordered = x.size(2) <= 1 || x.stride(2) >= std::max<int64_t>(x.size(3), 1);
  return unit_rows && ordered;
}

// A view as the SDPA kernels take it, (B, H, N, D): a 3-D (B, N, D) view
// gets one head (H = 1); a 4-D view is returned as it is.
template <class T>
TensorView<T> as_heads(TensorView<T> x) {
  if (x.rank() != 3) return x;
  return TensorView<T>(x.data(), Shape{x.size(0), 1, x.size(1), x.size(2)},
                       Shape{x.stride(0), 0, x.stride(1), x.stride(2)});
}

// Everything a forward or backward kernel needs besides the tensors.
struct AttentionConfig {
  ValidLens valid_lens;  // may be absent; a view of the caller's lengths (and the causal cap)
  double scale;                 // dot-product scale (unused by additive)
  double dropout;               // p, already 0 when not training
  uint64_t seed;
  // Query heads per batch element. The kernels number query rows by head
  // bh = b * heads + h: lengths come from valid_lens' batch element b (every
  // head of b shares them), dropout from (seed, bh, i, j), so H heads behave
  // as a batch of B * H with each length repeated H times. 1 for 3-D inputs.
  int64_t heads = 1;
  // Which keys each query may see beyond the lengths (scaled dot-product
  // attention): mask (B, H, Nq, Nk) with zero strides where it broadcasts,
  // key_mask (B, Nk), both nonzero = takes part and null data when absent;
  // a window of keys [i + Nk - Nq - left, i + Nk - Nq + right] (-1:
  // unbounded on that side). The kernels give a masked score -inf.
  ConstView<uint8_t> mask = {};
  ConstView<uint8_t> key_mask = {};
  int64_t window_left = -1, window_right = -1;
  // An additive bias of the scores, (B, H, Nq, Nk) with zero strides where
  // it broadcasts, in the accumulation type: bias_float for float and bf16
  // inputs, bias_double for double (null data when absent). Added before the
  // masks, so a masked key stays -inf whatever its bias.
  ConstView<float> bias_float = {};
  ConstView<double> bias_double = {};
  // Logit capping (Gemma 2, FlashAttention's softcap): the scaled dot product
  // x becomes softcap tanh(x / softcap) before the bias, ALiBi and masks; 0:
  // none. Its derivative, 1 - tanh², scales the score's gradient.
  double softcap = 0.0;
  // ALiBi (FlashAttention's alibi_slopes): slope (B, H) with stride 0 along B
  // for per-head slopes, null data when absent; adds
  // -slope |i + Nk - Nq - j| after the bias (aligned like the window).
  ConstView<double> alibi_slopes = {};
  double alibi_slope(int64_t bh) const { return alibi_slopes(bh / heads, bh % heads); }
  // What ALiBi adds to query i's score of key j (0 without it).
  double alibi_at(int64_t bh, int64_t i, int64_t j, int64_t nq, int64_t nk) const {
    if (alibi_slopes.data() == nullptr) return 0.0;
    return -alibi_slope(bh) * static_cast<double>(std::abs(i + nk - nq - j));
  }
  template <class Acc>
  ConstView<Acc> bias() const {
    if constexpr (std::is_same_v<Acc, float>) {
      return bias_float;
    } else {
      return bias_double;
    }
  }
  bool biased() const { return bias_float.data() != nullptr || bias_double.data() != nullptr; }
  // The bias of query i of head bh at key j, in double (0 without one).
  double bias_at(int64_t bh, int64_t i, int64_t j) const {
    const int64_t b = bh / heads, h = bh % heads;
    if (bias_float.data() != nullptr) return bias_float(b, h, i, j);
    if (bias_double.data() != nullptr) return bias_double(b, h, i, j);
    return 0.0;
  }
  // The valid length of query i of head bh.
  int64_t len(int64_t bh, int64_t i, int64_t nk) const { return valid_lens(bh / heads, i, nk); }
  bool masked() const {
    return mask.data() != nullptr || key_mask.data() != nullptr || window_left >= 0 ||
           window_right >= 0;
  }
  // Whether the scores get anything after scale q.k: softcap, a bias,
  // ALiBi or masks.
  bool adjusts_scores() const {
    return masked() || biased() || softcap > 0.0 || alibi_slopes.data() != nullptr;
  }
  // Keys [lo, hi) of query i that the window leaves (all of [0, nk) without one).
  int64_t window_begin(int64_t i, int64_t nq, int64_t nk) const {
    return window_left < 0 ? 0 : std::max<int64_t>(i + nk - nq - window_left, 0);
  }
  int64_t window_end(int64_t i, int64_t nq, int64_t nk) const {
    return window_right < 0 ? nk : std::clamp<int64_t>(i + nk - nq + window_right + 1, 0, nk);
  }
  // Whether query i of head bh sees key j by mask and key_mask (not the
  // window or the length).
  bool mask_keeps(int64_t bh, int64_t i, int64_t j) const {
    const int64_t b = bh / heads, h = bh % heads;
    return (mask.data() == nullptr || mask(b, h, i, j) != 0) &&
           (key_mask.data() == nullptr || key_mask(b, j) != 0);
  }
};

// Masks of a tile of scores: row r is query query(r) of head head(r), column
// c key j0 + c, r < rows, c < cols. tile_has_keys: whether any (r, c) is
// left by the window and the masks (a tile with none is skipped); it stops
// at the first. mask_tile: sets the masked scores s[r * lds + c] to -inf.
template <class Head, class Query>
bool tile_has_keys(const AttentionConfig& config, int64_t rows, int64_t cols, int64_t j0,
                   int64_t nq, int64_t nk, Head&& head, Query&& query) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = query(r);
    const int64_t lo = std::max<int64_t>(config.window_begin(i, nq, nk), j0);
    const int64_t hi = std::min<int64_t>(config.window_end(i, nq, nk), j0 + cols);
    for (int64_t j = lo; j < hi; ++j) {
      if (config.mask_keeps(head(r), i, j)) return true;
    }
  }
  return false;
}
template <class T, class Head, class Query>
void mask_tile(const AttentionConfig& config, T* s, int64_t lds, int64_t rows, int64_t cols,
               int64_t j0, int64_t nq, int64_t nk, Head&& head, Query&& query) {
  constexpr T kMasked = -std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t bh = head(r), i = query(r);
    const int64_t b = bh / config.heads, h = bh % config.heads;
    T* row = s + r * lds;
    const int64_t lo = std::clamp<int64_t>(config.window_begin(i, nq, nk) - j0, 0, cols);
    const int64_t hi = std::clamp<int64_t>(config.window_end(i, nq, nk) - j0, lo, cols);
    std::fill(row, row + lo, kMasked);
    std::fill(row + hi, row + cols, kMasked);
    // The row's mask bytes (stride 0 where the mask broadcasts over keys):
    // branch-free selects the compiler vectorizes for a contiguous row.
    const auto apply = [&](const uint8_t* bytes, int64_t stride) {
      if (stride == 1) {
        for (int64_t c = lo; c < hi; ++c) row[c] = bytes[c] != 0 ? row[c] : kMasked;
      } else if (bytes[0] == 0 && stride == 0) {
        std::fill(row + lo, row + hi, kMasked);
      } else if (stride != 0) {
        for (int64_t c = lo; c < hi; ++c) row[c] = bytes[c * stride] != 0 ? row[c] : kMasked;
      }
    };
    if (config.mask.data() != nullptr) {
      const ConstView<uint8_t>& m = config.mask;
      apply(m.data() + b * m.stride(0) + h * m.stride(1) + i * m.stride(2) + j0 * m.stride(3),
            m.stride(3));
    }
    if (config.key_mask.data() != nullptr) {
      const ConstView<uint8_t>& km = config.key_mask;
      apply(km.data() + b * km.stride(0) + j0 * km.stride(1), km.stride(1));
    }
  }
}

// Additive attention's parameters, validated: w_v flattened to (H).
template <class T>
struct AdditiveParams {
  ConstView<T> w_q;  // (H, Dq)
  ConstView<T> w_k;  // (H, Dk)
  ConstView<T> w_v;  // (H)
};

// Where a forward writes: output (B, Nq, Dv); weights (B, Nq, Nk) and lse
// (B, Nq) have null data when not wanted. Contiguous. SDPA only: the
// softmax's statistics (B, Nq, 2), each row's pair (m, l) with weights
// exp(score - m) / l as the forward formed them (a row summed exactly, or
// by a kernel that keeps no pair: (lse, 1); no key: (-inf, 0)); wanted only
// with the lse.
template <class T>
struct ForwardViews {
  TensorView<T> output;
  TensorView<T> weights;
  TensorView<T> lse;
  TensorView<T> softmax_stats = {};
};

// What a backward reads back from its forward: output (B, Nq, Dv) and lse
// (B, Nq) (the reference recomputes both and ignores them), and beside them
// the gradient arriving at lse, d_lse (the lse's shape, contiguous; null
// data: 0; SDPA only), and the forward's softmax statistics (ForwardViews;
// contiguous; null data: the weights are recomputed as exp(score - lse)).
template <class T>
struct SavedViews {
  ConstView<T> output;
  ConstView<T> lse;
  ConstView<T> d_lse = {};
  ConstView<T> softmax_stats = {};
};

// Where a backward writes, every element. SDPA: the layouts of its inputs
// (B, H, N, D), rows as sdpa's operands; additive: contiguous 3-D.
template <class T>
struct SdpaGradViews {
  TensorView<T> d_queries;  // (B, H, Nq, D)
  TensorView<T> d_keys;     // (B, Hkv, Nk, D)
  TensorView<T> d_values;   // (B, Hkv, Nk, Dv)
  // The bias gradient, summed over the axes the bias broadcasts along: (B,
  // H, Nq, Nk) with zero strides there, over a contiguous buffer of its own
  // elements (bias_grad_extent of them); null data unless asked for.
  TensorView<T> d_bias = {};
};

// The elements under a d_bias view (SdpaGradViews): 1 + the largest offset
// (axes it broadcasts along have stride 0 and add nothing, even when empty:
// a (Nq, Nk) bias of a batch of none still has its elements).
template <class T>
int64_t bias_grad_extent(TensorView<T> d_bias) {
  int64_t extent = 1;
  for (int a = 0; a < d_bias.rank(); ++a) {
    if (d_bias.stride(a) == 0) continue;
    if (d_bias.size(a) == 0) return 0;
    extent += (d_bias.size(a) - 1) * d_bias.stride(a);
  }
  return extent;
}

template <class T>
struct AdditiveGradViews {
  TensorView<T> d_queries;  // (B, Nq, Dq)
  TensorView<T> d_keys;     // (B, Nk, Dk)
  TensorView<T> d_values;   // (B, Nk, Dv)
  TensorView<T> d_w_q;      // (H, Dq)
  TensorView<T> d_w_k;      // (H, Dk)
  TensorView<T> d_w_v;      // (H)
};

template <class T>
struct BilinearGradViews {
  TensorView<T> d_queries;  // (B, Nq, Dq)
  TensorView<T> d_keys;     // (B, Nk, Dk)
  TensorView<T> d_values;   // (B, Nk, Dv)
  TensorView<T> d_w;        // (Dq, Dk)
};

// Softmax of one row in double: w[j < len] normalised, w[j >= len] = 0.
// Returns the row's log-sum-exp (-inf for an empty or all -inf row, NaN for a
// row with NaN or +inf). The rules of DESIGN.md §3 live here (ref version).
namespace ref {
double softmax_row(const double* x, int64_t len, int64_t n, double* w);
}  // namespace ref

// The ops: ref and fast declare the same templates (instantiated for float
// and double), so a front end switches versions by namespace alone.
//   sdpa:     q (B, H, Nq, D)   k (B, Hkv, Nk, D)   v (B, Hkv, Nk, Dv), H a
//             multiple of Hkv (query head h reads key head h / (H / Hkv));
//             output (B, H, Nq, Dv), weights (B, H, Nq, Nk), lse (B, H, Nq);
//             config.heads = H. Operands and output (fast: and gradients)
//             have rows_in_place layouts; weights and lse are contiguous.
//   additive: q (B, Nq, Dq)  k (B, Nk, Dk)  v (B, Nk, Dv), params
//   masked_softmax: scores, weights, d_weights, d_scores (B, Nq, Nk)
namespace ref {

template <class T>
void masked_softmax(ConstView<T> scores, const ValidLens& valid_lens, TensorView<T> weights);
template <class T>
void masked_softmax_backward(ConstView<T> weights, ConstView<T> d_weights,
                             const ValidLens& valid_lens, TensorView<T> d_scores);
template <class T>
void sdpa(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AttentionConfig& config,
          const ForwardViews<T>& out);
template <class T>
void sdpa_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AttentionConfig& config,
                   const SavedViews<T>& saved, ConstView<T> d_output,
                   const SdpaGradViews<T>& grads);
template <class T>
void additive(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AdditiveParams<T>& params,
              const AttentionConfig& config, const ForwardViews<T>& out);
template <class T>
void additive_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                       const AdditiveParams<T>& params, const AttentionConfig& config,
                       const SavedViews<T>& saved, ConstView<T> d_output,
                       const AdditiveGradViews<T>& grads);
// bilinear: q (B, Nq, Dq)  k (B, Nk, Dk)  v (B, Nk, Dv)  w (Dq, Dk); score q W k.
template <class T>
void bilinear(ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w,
              const AttentionConfig& config, const ForwardViews<T>& out);
template <class T>
void bilinear_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w,
                       const AttentionConfig& config, const SavedViews<T>& saved,
                       ConstView<T> d_output, const BilinearGradViews<T>& grads);
// distance: q (B, Nq, D)  k (B, Nk, D)  v (B, Nk, Dv); score -config.scale/2 |q - k|^2;
// grads 3-D (d_bias not written).
template <class T>
void distance(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AttentionConfig& config,
              const ForwardViews<T>& out);
template <class T>
void distance_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                       const AttentionConfig& config, const SavedViews<T>& saved,
                       ConstView<T> d_output, const SdpaGradViews<T>& grads);

}  // namespace ref

namespace fast {

// Whether the fast version covers a problem; the front end runs ref
// otherwise, so a new variant can land reference-first. Today fast covers
// every problem the front ends pass (any sizes, lengths, dropout, heads):
// the check is the layout contract, rows_in_place for SDPA and contiguous
// for additive attention.
template <class T>
bool supports(ConstView<T> q, ConstView<T> k, ConstView<T> v) {
  return q.is_contiguous() && k.is_contiguous() && v.is_contiguous();
}

// Scratch: one row of exp(x - max) per thread (Workspace, workspace.h).
template <class T>
size_t masked_softmax_workspace_size(int64_t nk, int num_threads);
template <class T>
void masked_softmax(ConstView<T> scores, const ValidLens& valid_lens, TensorView<T> weights,
                    Workspace workspace);
template <class T>
void masked_softmax_backward(ConstView<T> weights, ConstView<T> d_weights,
                             const ValidLens& valid_lens, TensorView<T> d_scores);
// Scratch (Workspace): per thread, a score tile and its rows' running
// softmax state (forward) or the P and dS tiles with one key block's dK and
// dV (backward); per call, bf16 key blocks packed once (forward), D and the
// partial dQs (backward). Heads with D, Dv <= 4 take the small-dimension
// kernel's copies of K and V instead. Each *_workspace_size takes the
// kernel's own arguments and the thread count.
template <class T>
size_t sdpa_workspace_size(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                           const AttentionConfig& config, const ForwardViews<T>& out,
                           int num_threads);
template <class T>
void sdpa(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AttentionConfig& config,
          const ForwardViews<T>& out, Workspace workspace);
template <class T>
size_t sdpa_backward_workspace_size(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                    const AttentionConfig& config, const SavedViews<T>& saved,
                                    ConstView<T> d_output, const SdpaGradViews<T>& grads,
                                    int num_threads);
template <class T>
void sdpa_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AttentionConfig& config,
                   const SavedViews<T>& saved, ConstView<T> d_output, const SdpaGradViews<T>& grads,
                   Workspace workspace);
template <class T>
void additive(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AdditiveParams<T>& params,
              const AttentionConfig& config, const ForwardViews<T>& out, Workspace workspace);
template <class T>
void additive_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                       const AdditiveParams<T>& params, const AttentionConfig& config,
                       const SavedViews<T>& saved, ConstView<T> d_output,
                       const AdditiveGradViews<T>& grads, Workspace workspace);
// Scratch of additive / additive_backward (Workspace, workspace.h), for the
// arguments they will get (out.weights with null data when not wanted): the
// projections W_q q and (W_k k)^T, the backward's partial sums, and one query
// block's or key chunk's scratch per thread.
template <class T>
size_t additive_workspace_size(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                               const AdditiveParams<T>& params, const AttentionConfig& config,
                               const ForwardViews<T>& out, int num_threads);
template <class T>
size_t additive_backward_workspace_size(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                        const AdditiveParams<T>& params,
                                        const AttentionConfig& config, const SavedViews<T>& saved,
                                        ConstView<T> d_output, const AdditiveGradViews<T>& grads,
                                        int num_threads);

// Bilinear and distance attention (shapes as ref's): the fused dot-product
// kernel on q W (bilinear_fast.cc), or on centred operands with a bias per
// key (distance_fast.cc), whose operands live in the workspace ahead of the
// dot-product kernel's scratch. Inputs, weights, lse and gradients
// contiguous; the output contiguous rows.
template <class T>
size_t bilinear_workspace_size(ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w,
                               const AttentionConfig& config, const ForwardViews<T>& out,
                               int num_threads);
template <class T>
void bilinear(ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w,
              const AttentionConfig& config, const ForwardViews<T>& out, Workspace workspace);
template <class T>
size_t bilinear_backward_workspace_size(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                        ConstView<T> w, const AttentionConfig& config,
                                        const SavedViews<T>& saved, ConstView<T> d_output,
                                        const BilinearGradViews<T>& grads, int num_threads);
template <class T>
void bilinear_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w,
                       const AttentionConfig& config, const SavedViews<T>& saved,
                       ConstView<T> d_output, const BilinearGradViews<T>& grads,
                       Workspace workspace);
template <class T>
size_t distance_workspace_size(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                               const AttentionConfig& config, const ForwardViews<T>& out,
                               int num_threads);
template <class T>
void distance(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AttentionConfig& config,
              const ForwardViews<T>& out, Workspace workspace);
template <class T>
size_t distance_backward_workspace_size(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                        const AttentionConfig& config, const SavedViews<T>& saved,
                                        ConstView<T> d_output, const SdpaGradViews<T>& grads,
                                        int num_threads);
template <class T>
void distance_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                       const AttentionConfig& config, const SavedViews<T>& saved,
                       ConstView<T> d_output, const SdpaGradViews<T>& grads, Workspace workspace);

// bf16 queries, keys and values; float results and gradients.
size_t sdpa_workspace_size(ConstView<bfloat16> q, ConstView<bfloat16> k, ConstView<bfloat16> v,
                           const AttentionConfig& config, const ForwardViews<float>& out,
                           int num_threads);
void sdpa(ConstView<bfloat16> q, ConstView<bfloat16> k, ConstView<bfloat16> v,
          const AttentionConfig& config, const ForwardViews<float>& out, Workspace workspace);
size_t sdpa_backward_workspace_size(ConstView<bfloat16> q, ConstView<bfloat16> k,
                                    ConstView<bfloat16> v, const AttentionConfig& config,
                                    const SavedViews<float>& saved, ConstView<float> d_output,
                                    const SdpaGradViews<float>& grads, int num_threads);
void sdpa_backward(ConstView<bfloat16> q, ConstView<bfloat16> k, ConstView<bfloat16> v,
                   const AttentionConfig& config, const SavedViews<float>& saved,
                   ConstView<float> d_output, const SdpaGradViews<float>& grads,
                   Workspace workspace);

// Softmax of one contiguous row of n elements with valid length len, into w
// (may alias x); returns the log-sum-exp as ref::softmax_row does.
float softmax_row(const float* x, int64_t len, int64_t n, float* w);
double softmax_row(const double* x, int64_t len, int64_t n, double* w);

}  // namespace fast

}  // namespace qkv::kernels
