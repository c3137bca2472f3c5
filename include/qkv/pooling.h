// Attention pooling with given weights, Attention(q, D) = sum_i alpha(q, k_i) v_i,
// and its named special cases: one-hot weights (an exact database lookup) and
// uniform weights (average pooling).
//   weights: (B, Nq, Nk)   values: (B, Nk, Dv)   output: (B, Nq, Dv)
#pragma once

#include <cstdint>

#include "qkv/tensor.h"
#include "qkv/valid_lens.h"

namespace qkv {

// output[b, i] = sum_j weights[b, i, j] * values[b, j], for any weights
// (convex or not).
Tensor<float> attention_pooling(ConstView<float> weights, ConstView<float> values);
Tensor<double> attention_pooling(ConstView<double> weights, ConstView<double> values);

// Uniform weights 1/L over the first L keys of each row (L from valid_lens,
// Nk when absent; L = 0 gives a row of zeros): shape (B, num_queries, num_keys).
Tensor<float> uniform_weights(int64_t batch, int64_t num_queries, int64_t num_keys,
                              const ValidLens& valid_lens = {});
// Average pooling: every query gets the mean of the first L values.
Tensor<float> average_pooling(ConstView<float> values, int64_t num_queries,
                              const ValidLens& valid_lens = {});
Tensor<double> average_pooling(ConstView<double> values, int64_t num_queries,
                               const ValidLens& valid_lens = {});

// One-hot weights: weight 1 at key index[b, i], 0 elsewhere; shape
// (B, Nq, num_keys). Throws Error if an index is outside [0, num_keys).
Tensor<float> one_hot_weights(ConstView<int64_t> index, int64_t num_keys);
// Exact lookup: output[b, i] = values[b, index[b, i]] (index: (B, Nq)).
Tensor<float> one_hot_lookup(ConstView<int64_t> index, ConstView<float> values);
Tensor<double> one_hot_lookup(ConstView<int64_t> index, ConstView<double> values);

}  // namespace qkv
