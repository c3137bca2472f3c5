// Attention scoring functions: scaled dot-product, additive, bilinear and
// distance attention, forward and backward (docs/semantics.md has the full rules).
//   queries: (B, Nq, D)   keys: (B, Nk, D) (additive, bilinear: (B, Nk, Dk))   values: (B, Nk, Dv)
//   valid_lens: absent, (B) or (B, Nq)
//   output: (B, Nq, Dv)   weights: (B, Nq, Nk) if asked for   lse: (B, Nq) if asked for
#pragma once

#include <cstdint>
#include <optional>
#include <variant>

#include "qkv/scoring.h"
#include "qkv/tensor.h"
#include "qkv/valid_lens.h"

namespace qkv {

// Causal masking (AttentionOptions::causal): which keys query i may see.
enum class Causal {
  kNone,
  // j <= i: torch's is_causal (its mask is torch.ones(Nq, Nk).tril()).
  kTopLeft,
  // j <= i + Nk - Nq: the last query sees every key; queries that continue a
  // key cache (Nq new tokens after Nk - Nq cached ones). With Nq > Nk the
  // first Nq - Nk queries see no key.
  kBottomRight,
};

// A float bias of either precision (AttentionOptions::bias): empty, float32
// or float64.
using BiasView = std::variant<std::monostate, ConstView<float>, ConstView<double>>;

struct AttentionOptions {
  // Multiplies the dot products; default 1/sqrt(D). Distance attention: the
  // scale of -|q - k|^2 / 2, > 0, default 1. Additive and bilinear attention
  // reject it.
  std::optional<double> scale;
  // Dropout probability p in [0, 1] on the weights, applied only when training.
  double dropout_p = 0.0;
  bool training = false;
  // Selects the dropout mask (qkv/dropout.h); the backward must get the same seed.
  uint64_t seed = 0;
  // Return the weights (masked softmax, before dropout, as d2l's
  // attention_weights). Off by default: fused kernels need not form them.
  bool return_weights = false;
  // Return lse[b, i] = log sum_{j < L} exp(score[b, i, j]) (-inf when L = 0),
  // needed by the backward and for merging partial results over key sets.
  bool return_lse = false;
  // Scaled dot-product attention, with return_lse: also return the softmax's
  // statistics (B, Nq, 2) ((B, H, Nq, 2) for heads), each row's pair (m, l)
  // with weights exp(score - m) / l as the forward formed them: its largest
  // score and its sum, so lse = m + log l (a row the kernels summed in one
  // exact pass, or with D and Dv <= 4: (lse, 1); no key: (-inf, 0)). Given
  // back to the backward (SavedForward::softmax_stats), it recomputes the
  // forward's very weights instead of exp(score - lse), which carries the
  // lse's rounding into every weight of a row alike: float32 gradients
  // within 2x the error of float32 torch on FlashAttention's test grid,
  // 2.6x without (docs/semantics.md).
  bool return_softmax_stats = false;
  // Causal masking, combined with valid_lens by taking the smaller length:
  // query i's valid length is min(valid_lens, clamp(i + 1 + offset, 0, Nk))
  // with offset 0 (kTopLeft) or Nk - Nq (kBottomRight). Key blocks no query
  // of a block may see are skipped, so causal attention does about half the
  // work. A query left with no key gets a zero output, lse -inf and zero
  // gradients (torch's math path gives NaN there).
  Causal causal = Causal::kNone;
  // Which keys each query may see beyond valid_lens and causal (scaled
  // dot-product attention; everything combines: a key takes part only where
  // every rule lets it). Nonzero = takes part, as torch's boolean attn_mask.
  // mask: broadcast against the scores (B, Nq, Nk), or (B, H, Nq, Nk) for
  // heads: aligned from the right, each axis 1 or the scores' size, e.g.
  // (Nq, Nk), (B, 1, Nq, Nk) or (B, 1, 1, Nk). Read in place, one byte per
  // element; key blocks it leaves no key of are skipped.
  ConstView<uint8_t> mask;
  // key_mask (B, Nk): key j of batch element b takes part (key padding).
  ConstView<uint8_t> key_mask;
  // A sliding window (FlashAttention's window_size, aligned like
  // Causal::kBottomRight): query i sees keys j with
  // i + Nk - Nq - window_left <= j <= i + Nk - Nq + window_right; -1 leaves
  // that side open, so (-1, 0) is bottom-right causal and (256, 0) a causal
  // window of 257 keys. Blocks outside every row's window are skipped.
  int64_t window_left = -1;
  int64_t window_right = -1;
  // An additive bias of the scores (torch's float attn_mask: relative
  // positions, ALiBi): score = scale q.k + bias, broadcast like mask, read in
  // place and added tile by tile. float32 for float32 and bfloat16 inputs,
  // float64 for float64 ones. -inf leaves a key out like a mask; masks win
  // over the bias (a masked key is -inf whatever its bias).
  BiasView bias;
  // The backward also returns d_bias, the gradient of the bias in its own
  // shape (summed over the axes it broadcasts along; exactly 0 where the
  // bias is constant along the keys, which cannot change the weights, unless
  // the backward gets a d_lse: then d_lse, as such a bias shifts the lse).
  bool want_bias_grad = false;
  // Logit capping (Gemma 2; FlashAttention's softcap): the scaled dot
  // product x = scale q.k becomes softcap tanh(x / softcap), before the
  // bias, ALiBi and the masks; finite and >= 0, and 0 (the default) caps
  // nothing. The backward scales each score's gradient by 1 - tanh²(x / softcap).
  double softcap = 0.0;
  // ALiBi (FlashAttention's alibi_slopes): adds -slope |i + Nk - Nq - j| to
  // query i's score of key j (aligned bottom-right, like the window), slope
  // per head: (H) or per batch element and head: (B, H) (H = 1 for 3-D
  // inputs), finite. Formed tile by tile, never as a (B, H, Nq, Nk) bias;
  // no gradient.
  ConstView<double> alibi_slopes;
};

template <class T>
struct AttentionResult {
  Tensor<T> output;   // (B, Nq, Dv)
  Tensor<T> weights;  // (B, Nq, Nk), empty unless return_weights
  Tensor<T> lse;      // (B, Nq), empty unless return_lse
  Tensor<T> softmax_stats;  // (B, Nq, 2), empty unless return_softmax_stats
};

// Caller-provided destinations for the write-into form; each must be
// contiguous and have the documented shape. Absent optionals are not computed.
template <class T>
struct AttentionOutputs {
  TensorView<T> output;
  std::optional<TensorView<T>> weights;
  std::optional<TensorView<T>> lse;
  std::optional<TensorView<T>> softmax_stats = std::nullopt;  // scaled dot-product; needs lse
};

template <class T>
struct DotProductGrads {
  Tensor<T> d_queries;  // (B, Nq, D)
  Tensor<T> d_keys;     // (B, Nk, D)
  Tensor<T> d_values;   // (B, Nk, Dv)
  Tensor<T> d_bias;     // the shape of options.bias; empty unless options.want_bias_grad
};

template <class T>
struct AdditiveGrads {
  Tensor<T> d_queries;  // (B, Nq, Dq)
  Tensor<T> d_keys;     // (B, Nk, Dk)
  Tensor<T> d_values;   // (B, Nk, Dv)
  Tensor<T> d_w_q;      // (H, Dq)
  Tensor<T> d_w_k;      // (H, Dk)
  Tensor<T> d_w_v;      // same shape as the w_v given: (H) or (1, H)
};

template <class T>
struct BilinearGrads {
  Tensor<T> d_queries;  // (B, Nq, Dq)
  Tensor<T> d_keys;     // (B, Nk, Dk)
  Tensor<T> d_values;   // (B, Nk, Dv)
  Tensor<T> d_w;        // (Dq, Dk)
};

// Additive attention's parameters, laid out like nn.Linear weights:
// w_q (H, Dq), w_k (H, Dk), w_v (H) or (1, H).
template <class T>
struct AdditiveWeights {
  ConstView<T> w_q;
  ConstView<T> w_k;
  ConstView<T> w_v;
};

// What a backward reads back from its forward (return_lse set there):
// output (B, Nq, Dv) and lse (B, Nq); for scaled dot-product attention,
// optionally the softmax's statistics (B, Nq, 2) (return_softmax_stats).
template <class T>
struct SavedForward {
  ConstView<T> output;
  ConstView<T> lse;
  ConstView<T> softmax_stats = {};
};

// ---- Scaled dot-product attention: softmax(Q Kᵀ · scale) V ----------------

AttentionResult<float> scaled_dot_product_attention(ConstView<float> queries, ConstView<float> keys,
                                                    ConstView<float> values,
                                                    const ValidLens& valid_lens = {},
                                                    const AttentionOptions& options = {});
AttentionResult<double> scaled_dot_product_attention(ConstView<double> queries,
                                                     ConstView<double> keys,
                                                     ConstView<double> values,
                                                     const ValidLens& valid_lens = {},
                                                     const AttentionOptions& options = {});
// Write-into form; options.return_weights/return_lse are ignored in favour of
// whether outputs.weights/lse are given.
void scaled_dot_product_attention(ConstView<float> queries, ConstView<float> keys,
                                  ConstView<float> values, const ValidLens& valid_lens,
                                  const AttentionOptions& options,
                                  const AttentionOutputs<float>& outputs);
void scaled_dot_product_attention(ConstView<double> queries, ConstView<double> keys,
                                  ConstView<double> values, const ValidLens& valid_lens,
                                  const AttentionOptions& options,
                                  const AttentionOutputs<double>& outputs);

// Gradients given the forward's inputs, options (same seed), its saved output
// and lse, and d_output = dLoss/d(output); optionally d_lse = dLoss/d(lse)
// (B, Nq) (or (B, H, Nq)), for a loss that reads the lse too: cross-entropy
// over the keys, lse - score[target], is attention's lse with d_lse = 1 and
// d_output = 0 (docs/search.md). dLoss/d(score_ij) = P_ij (dP_ij - D_i +
// d_lse_i), so it costs the fused backward nothing.
DotProductGrads<float> scaled_dot_product_attention_backward(
    ConstView<float> queries, ConstView<float> keys, ConstView<float> values,
    const ValidLens& valid_lens, const AttentionOptions& options, const SavedForward<float>& saved,
    ConstView<float> d_output,
    ConstView<float> d_lse = {});
DotProductGrads<double> scaled_dot_product_attention_backward(
    ConstView<double> queries, ConstView<double> keys, ConstView<double> values,
    const ValidLens& valid_lens, const AttentionOptions& options, const SavedForward<double>& saved,
    ConstView<double> d_output,
    ConstView<double> d_lse = {});

// ---- Additive attention: score = w_vᵀ tanh(W_q q + W_k k) ------------------

AttentionResult<float> additive_attention(ConstView<float> queries, ConstView<float> keys,
                                          ConstView<float> values,
                                          const AdditiveWeights<float>& weights,
                                          const ValidLens& valid_lens = {},
                                          const AttentionOptions& options = {});
AttentionResult<double> additive_attention(ConstView<double> queries, ConstView<double> keys,
                                           ConstView<double> values,
                                           const AdditiveWeights<double>& weights,
                                           const ValidLens& valid_lens = {},
                                           const AttentionOptions& options = {});
void additive_attention(ConstView<float> queries, ConstView<float> keys, ConstView<float> values,
                        const AdditiveWeights<float>& weights, const ValidLens& valid_lens,
                        const AttentionOptions& options, const AttentionOutputs<float>& outputs);
void additive_attention(ConstView<double> queries, ConstView<double> keys, ConstView<double> values,
                        const AdditiveWeights<double>& weights, const ValidLens& valid_lens,
                        const AttentionOptions& options, const AttentionOutputs<double>& outputs);

AdditiveGrads<float> additive_attention_backward(
    ConstView<float> queries, ConstView<float> keys, ConstView<float> values,
    const AdditiveWeights<float>& weights, const ValidLens& valid_lens,
    const AttentionOptions& options, const SavedForward<float>& saved, ConstView<float> d_output);
AdditiveGrads<double> additive_attention_backward(
    ConstView<double> queries, ConstView<double> keys, ConstView<double> values,
    const AdditiveWeights<double>& weights, const ValidLens& valid_lens,
    const AttentionOptions& options, const SavedForward<double>& saved, ConstView<double> d_output);

// ---- Bilinear attention: score = qᵀ W k ------------------------------------
// w (Dq, Dk): queries and keys of different sizes through one matrix. Computed
// as scaled dot-product attention (scale 1) of q W (B, Nq, Dk) and the keys:
// one matrix product, then the fused kernel (no (B, Nq, Nk) buffer). Options
// as additive attention: valid_lens, causal, dropout, want_*; no scale, masks
// or bias.

AttentionResult<float> bilinear_attention(ConstView<float> queries, ConstView<float> keys,
                                          ConstView<float> values, ConstView<float> w,
                                          const ValidLens& valid_lens = {},
                                          const AttentionOptions& options = {});
AttentionResult<double> bilinear_attention(ConstView<double> queries, ConstView<double> keys,
                                           ConstView<double> values, ConstView<double> w,
                                           const ValidLens& valid_lens = {},
                                           const AttentionOptions& options = {});
void bilinear_attention(ConstView<float> queries, ConstView<float> keys, ConstView<float> values,
                        ConstView<float> w, const ValidLens& valid_lens,
                        const AttentionOptions& options, const AttentionOutputs<float>& outputs);
void bilinear_attention(ConstView<double> queries, ConstView<double> keys,
                        ConstView<double> values, ConstView<double> w, const ValidLens& valid_lens,
                        const AttentionOptions& options, const AttentionOutputs<double>& outputs);
BilinearGrads<float> bilinear_attention_backward(ConstView<float> queries, ConstView<float> keys,
                                                 ConstView<float> values, ConstView<float> w,
                                                 const ValidLens& valid_lens,
                                                 const AttentionOptions& options,
                                                 const SavedForward<float>& saved,
                                                 ConstView<float> d_output);
BilinearGrads<double> bilinear_attention_backward(
    ConstView<double> queries, ConstView<double> keys, ConstView<double> values,
    ConstView<double> w, const ValidLens& valid_lens, const AttentionOptions& options,
    const SavedForward<double>& saved, ConstView<double> d_output);

// ---- Distance attention: score = -scale/2 |q - k|^2 ---------------------------
// The Gaussian kernel as a scoring function (Nadaraya-Watson with bandwidth
// 1/sqrt(scale)); options.scale > 0, default 1. Computed as scaled
// dot-product attention with a bias per key on queries and keys centred at
// the mean of each batch element's valid keys, so keys far from the origin
// lose no accuracy; lse is the log-sum-exp of the distance scores themselves.
// Options as additive attention (valid_lens, causal, dropout, want_*) plus
// the scale. The gradients come back as DotProductGrads (d_bias empty).

AttentionResult<float> distance_attention(ConstView<float> queries, ConstView<float> keys,
                                          ConstView<float> values,
                                          const ValidLens& valid_lens = {},
                                          const AttentionOptions& options = {});
AttentionResult<double> distance_attention(ConstView<double> queries, ConstView<double> keys,
                                           ConstView<double> values,
                                           const ValidLens& valid_lens = {},
                                           const AttentionOptions& options = {});
void distance_attention(ConstView<float> queries, ConstView<float> keys, ConstView<float> values,
                        const ValidLens& valid_lens, const AttentionOptions& options,
                        const AttentionOutputs<float>& outputs);
void distance_attention(ConstView<double> queries, ConstView<double> keys,
                        ConstView<double> values, const ValidLens& valid_lens,
                        const AttentionOptions& options, const AttentionOutputs<double>& outputs);
DotProductGrads<float> distance_attention_backward(
    ConstView<float> queries, ConstView<float> keys, ConstView<float> values,
    const ValidLens& valid_lens, const AttentionOptions& options, const SavedForward<float>& saved,
    ConstView<float> d_output);
DotProductGrads<double> distance_attention_backward(
    ConstView<double> queries, ConstView<double> keys, ConstView<double> values,
    const ValidLens& valid_lens, const AttentionOptions& options, const SavedForward<double>& saved,
    ConstView<double> d_output);

// Scaled dot-product attention with bfloat16 queries, keys and values
// (qkv/bfloat16.h): products accumulate in float32 and the softmax runs in
// float32, so output, weights, lse and the gradients are float32. The
// backward takes d_output (and d_lse) in float32 and rounds d_output to bf16
// for its products with the values. Same shapes, lengths, options and errors
// as above.
AttentionResult<float> scaled_dot_product_attention(ConstView<bfloat16> queries,
                                                    ConstView<bfloat16> keys,
                                                    ConstView<bfloat16> values,
                                                    const ValidLens& valid_lens = {},
                                                    const AttentionOptions& options = {});
DotProductGrads<float> scaled_dot_product_attention_backward(
    ConstView<bfloat16> queries, ConstView<bfloat16> keys, ConstView<bfloat16> values,
    const ValidLens& valid_lens, const AttentionOptions& options, const SavedForward<float>& saved,
    ConstView<float> d_output, ConstView<float> d_lse = {});

namespace ref {
// Reference versions: plain loops, double accumulation, any strides. They
// always return weights and lse (regardless of want_*), and validate exactly
// like the fast versions.
AttentionResult<float> scaled_dot_product_attention(ConstView<float> queries, ConstView<float> keys,
                                                    ConstView<float> values,
                                                    const ValidLens& valid_lens = {},
                                                    const AttentionOptions& options = {});
AttentionResult<double> scaled_dot_product_attention(ConstView<double> queries,
                                                     ConstView<double> keys,
                                                     ConstView<double> values,
                                                     const ValidLens& valid_lens = {},
                                                     const AttentionOptions& options = {});
DotProductGrads<float> scaled_dot_product_attention_backward(
    ConstView<float> queries, ConstView<float> keys, ConstView<float> values,
    const ValidLens& valid_lens, const AttentionOptions& options, const SavedForward<float>& saved,
    ConstView<float> d_output,
    ConstView<float> d_lse = {});
DotProductGrads<double> scaled_dot_product_attention_backward(
    ConstView<double> queries, ConstView<double> keys, ConstView<double> values,
    const ValidLens& valid_lens, const AttentionOptions& options, const SavedForward<double>& saved,
    ConstView<double> d_output,
    ConstView<double> d_lse = {});
AttentionResult<float> additive_attention(ConstView<float> queries, ConstView<float> keys,
                                          ConstView<float> values,
                                          const AdditiveWeights<float>& weights,
                                          const ValidLens& valid_lens = {},
                                          const AttentionOptions& options = {});
AttentionResult<double> additive_attention(ConstView<double> queries, ConstView<double> keys,
                                           ConstView<double> values,
                                           const AdditiveWeights<double>& weights,
                                           const ValidLens& valid_lens = {},
                                           const AttentionOptions& options = {});
AdditiveGrads<float> additive_attention_backward(
    ConstView<float> queries, ConstView<float> keys, ConstView<float> values,
    const AdditiveWeights<float>& weights, const ValidLens& valid_lens,
    const AttentionOptions& options, const SavedForward<float>& saved, ConstView<float> d_output);
AdditiveGrads<double> additive_attention_backward(
    ConstView<double> queries, ConstView<double> keys, ConstView<double> values,
    const AdditiveWeights<double>& weights, const ValidLens& valid_lens,
    const AttentionOptions& options, const SavedForward<double>& saved, ConstView<double> d_output);
AttentionResult<float> bilinear_attention(ConstView<float> queries, ConstView<float> keys,
                                          ConstView<float> values, ConstView<float> w,
                                          const ValidLens& valid_lens = {},
                                          const AttentionOptions& options = {});
AttentionResult<double> bilinear_attention(ConstView<double> queries, ConstView<double> keys,
                                           ConstView<double> values, ConstView<double> w,
                                           const ValidLens& valid_lens = {},
                                           const AttentionOptions& options = {});
BilinearGrads<float> bilinear_attention_backward(ConstView<float> queries, ConstView<float> keys,
                                                 ConstView<float> values, ConstView<float> w,
                                                 const ValidLens& valid_lens,
                                                 const AttentionOptions& options,
                                                 const SavedForward<float>& saved,
                                                 ConstView<float> d_output);
BilinearGrads<double> bilinear_attention_backward(
    ConstView<double> queries, ConstView<double> keys, ConstView<double> values,
    ConstView<double> w, const ValidLens& valid_lens, const AttentionOptions& options,
    const SavedForward<double>& saved, ConstView<double> d_output);
AttentionResult<float> distance_attention(ConstView<float> queries, ConstView<float> keys,
                                          ConstView<float> values,
                                          const ValidLens& valid_lens = {},
                                          const AttentionOptions& options = {});
AttentionResult<double> distance_attention(ConstView<double> queries, ConstView<double> keys,
                                           ConstView<double> values,
                                           const ValidLens& valid_lens = {},
                                           const AttentionOptions& options = {});
DotProductGrads<float> distance_attention_backward(
    ConstView<float> queries, ConstView<float> keys, ConstView<float> values,
    const ValidLens& valid_lens, const AttentionOptions& options, const SavedForward<float>& saved,
    ConstView<float> d_output);
DotProductGrads<double> distance_attention_backward(
    ConstView<double> queries, ConstView<double> keys, ConstView<double> values,
    const ValidLens& valid_lens, const AttentionOptions& options, const SavedForward<double>& saved,
    ConstView<double> d_output);
}  // namespace ref

}  // namespace qkv
