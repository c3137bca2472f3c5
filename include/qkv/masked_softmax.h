// Masked softmax over the last axis (docs/semantics.md has the full rules).
//   scores: (B, Nq, Nk)   valid_lens: absent, (B) or (B, Nq)   weights: (B, Nq, Nk)
// For row (b, i) with valid length L, positions j >= L get weight 0 and are
// never read; L = 0 gives a row of zeros; -inf is a legal score (weight 0);
// NaN or +inf among the valid scores makes that row's valid weights NaN.
#pragma once

#include "qkv/tensor.h"
#include "qkv/valid_lens.h"

namespace qkv {

// The fast version (SIMD, threaded).
Tensor<float> masked_softmax(ConstView<float> scores, const ValidLens& valid_lens = {});
Tensor<double> masked_softmax(ConstView<double> scores, const ValidLens& valid_lens = {});
// Writes into a caller-provided buffer of the scores' shape, any strides (it
// may be the scores themselves: in place).
void masked_softmax(ConstView<float> scores, const ValidLens& valid_lens,
                    TensorView<float> weights);
void masked_softmax(ConstView<double> scores, const ValidLens& valid_lens,
                    TensorView<double> weights);

// Gradient with respect to the scores, given the forward's weights and the
// gradient d_weights of the loss with respect to them:
//   d_scores[j] = w[j] * (d_weights[j] - sum_k w[k] d_weights[k]) for j < L, 0 for j >= L.
Tensor<float> masked_softmax_backward(ConstView<float> weights, ConstView<float> d_weights,
                                      const ValidLens& valid_lens = {});
Tensor<double> masked_softmax_backward(ConstView<double> weights, ConstView<double> d_weights,
                                       const ValidLens& valid_lens = {});
// Writes into a caller-provided buffer of the weights' shape, any strides (it
// may be weights or d_weights themselves: in place). For large shapes this is
// the memory-speed form: a fresh result means fresh pages to fault in.
void masked_softmax_backward(ConstView<float> weights, ConstView<float> d_weights,
                             const ValidLens& valid_lens, TensorView<float> d_scores);
void masked_softmax_backward(ConstView<double> weights, ConstView<double> d_weights,
                             const ValidLens& valid_lens, TensorView<double> d_scores);

namespace ref {
// The reference versions: plain loops, double accumulation, any strides.
// Same contract and same validation as the fast versions.
Tensor<float> masked_softmax(ConstView<float> scores, const ValidLens& valid_lens = {});
Tensor<double> masked_softmax(ConstView<double> scores, const ValidLens& valid_lens = {});
Tensor<float> masked_softmax_backward(ConstView<float> weights, ConstView<float> d_weights,
                                      const ValidLens& valid_lens = {});
Tensor<double> masked_softmax_backward(ConstView<double> weights, ConstView<double> d_weights,
                                       const ValidLens& valid_lens = {});
}  // namespace ref

}  // namespace qkv
