// The kernels behind the public ops, in two versions with the same contract:
// ref (plain loops, double accumulation, any strides) and fast (BLAS, SIMD,
// threads; contiguous inputs). Front ends in src/*.cc validate arguments and
// then call one of them; kernels only assert.
#pragma once

#include <cstdint>

#include "qkv/attention.h"
#include "qkv/tensor.h"
#include "qkv/valid_lens.h"

namespace qkv::kernels {

// Everything a forward or backward kernel needs besides the tensors.
struct AttentionConfig {
  const ValidLens* valid_lens;  // never null; may be absent
  double scale;                 // dot-product scale (unused by additive)
  double dropout;               // p, already 0 when not training
  uint64_t seed;
};

// Additive attention's parameters, validated: w_v flattened to (H).
template <class T>
struct AdditiveParams {
  ConstView<T> w_q;  // (H, Dq)
  ConstView<T> w_k;  // (H, Dk)
  ConstView<T> w_v;  // (H)
};

namespace ref {

// Softmax of one row in double: w[j < len] normalised, w[j >= len] = 0.
// Returns the row's log-sum-exp (-inf for an empty or all -inf row, NaN for a
// row with NaN or +inf). The rules of DESIGN.md §3 live here.
double softmax_row(const double* x, int64_t len, int64_t n, double* w);

template <class T>
void masked_softmax(ConstView<T> scores, const ValidLens& valid_lens, TensorView<T> weights);
template <class T>
void masked_softmax_backward(ConstView<T> weights, ConstView<T> d_weights,
                             const ValidLens& valid_lens, TensorView<T> d_scores);

template <class T>
AttentionResult<T> dot_product_attention(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                         const AttentionConfig& config);
template <class T>
DotProductGrads<T> dot_product_attention_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                                  const AttentionConfig& config,
                                                  ConstView<T> d_output);
template <class T>
AttentionResult<T> additive_attention(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                      const AdditiveParams<T>& params,
                                      const AttentionConfig& config);
// d_w_v of the result has shape (H).
template <class T>
AdditiveGrads<T> additive_attention_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                             const AdditiveParams<T>& params,
                                             const AttentionConfig& config, ConstView<T> d_output);
}  // namespace ref

namespace fast {

// Softmax of one contiguous row of n elements with valid length len, into w
// (may alias x); returns the log-sum-exp as ref::softmax_row does.
float softmax_row(const float* x, int64_t len, int64_t n, float* w);
double softmax_row(const double* x, int64_t len, int64_t n, double* w);

template <class T>
void masked_softmax(ConstView<T> scores, const ValidLens& valid_lens, TensorView<T> weights);
template <class T>
void masked_softmax_backward(ConstView<T> weights, ConstView<T> d_weights,
                             const ValidLens& valid_lens, TensorView<T> d_scores);

// Destinations are contiguous; weights and lse may have null data (not wanted).
template <class T>
void dot_product_attention(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                           const AttentionConfig& config, TensorView<T> output,
                           TensorView<T> weights, TensorView<T> lse);
template <class T>
void dot_product_attention_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                    const AttentionConfig& config, ConstView<T> output,
                                    ConstView<T> lse, ConstView<T> d_output,
                                    DotProductGrads<T>& grads);
// bf16 queries, keys and values; float results (qkv/attention.h).
void dot_product_attention(ConstView<bfloat16> q, ConstView<bfloat16> k, ConstView<bfloat16> v,
                           const AttentionConfig& config, TensorView<float> output,
                           TensorView<float> weights, TensorView<float> lse);
void dot_product_attention_backward(ConstView<bfloat16> q, ConstView<bfloat16> k,
                                    ConstView<bfloat16> v, const AttentionConfig& config,
                                    ConstView<float> output, ConstView<float> lse,
                                    ConstView<float> d_output, DotProductGrads<float>& grads);
template <class T>
void additive_attention(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                        const AdditiveParams<T>& params, const AttentionConfig& config,
                        TensorView<T> output, TensorView<T> weights, TensorView<T> lse);
template <class T>
void additive_attention_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                 const AdditiveParams<T>& params, const AttentionConfig& config,
                                 ConstView<T> output, ConstView<T> lse, ConstView<T> d_output,
                                 AdditiveGrads<T>& grads);
}  // namespace fast

}  // namespace qkv::kernels
