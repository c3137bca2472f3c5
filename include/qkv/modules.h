// Modules mirroring d2l's DotProductAttention and AdditiveAttention: they
// hold their parameters and gradients, remember what the backward needs, and
// take an SGD step. Forward caches copies of its inputs, so callers may free
// theirs before calling backward.
#pragma once

#include <cstdint>

#include "qkv/attention.h"
#include "qkv/tensor.h"
#include "qkv/valid_lens.h"

namespace qkv {

// param -= lr * grad, elementwise; shapes must match (throws Error otherwise).
namespace detail {
// What a module's forward keeps for its backward (both modules alike). The
// inputs and lengths are the module's own copies: the caller's views need
// not outlive the forward.
template <class T>
struct AttentionCache {
  Tensor<T> queries, keys, values;
  Tensor<int64_t> valid_lens;
  AttentionOptions options;
  Tensor<T> output, weights, lse;
  bool ready = false;
};
}  // namespace detail

void sgd_step(TensorView<float> param, ConstView<float> grad, double lr);
void sgd_step(TensorView<double> param, ConstView<double> grad, double lr);

// Scaled dot-product attention with dropout on the weights. A module starts in
// training mode, like torch.nn.Module; each training forward draws a fresh
// dropout mask (seed + number of training forwards so far).
template <class T = float>
class DotProductAttention {
 public:
  explicit DotProductAttention(double dropout = 0.0, uint64_t seed = 0);

  void train(bool on = true) { training_ = on; }
  void eval() { training_ = false; }
  bool training() const { return training_; }

  // queries (B, Nq, D), keys (B, Nk, D), values (B, Nk, Dv) -> (B, Nq, Dv).
  Tensor<T> forward(ConstView<T> queries, ConstView<T> keys, ConstView<T> values,
                    const ValidLens& valid_lens = {});
  // The last forward's weights (masked softmax, before dropout), (B, Nq, Nk).
  const Tensor<T>& attention_weights() const { return cache_.weights; }
  // Gradients of the last forward, given dLoss/d(output). Throws Error if
  // there was no forward or d_output's shape differs from the output's.
  DotProductGrads<T> backward(ConstView<T> d_output) const;

 private:
  double dropout_;
  uint64_t seed_;
  uint64_t forward_count_ = 0;
  bool training_ = true;
  detail::AttentionCache<T> cache_;
};

// Additive attention with learnable W_q (H, query_size), W_k (H, key_size),
// w_v (1, H), initialised like torch.nn.Linear (uniform in ±1/sqrt(fan_in))
// from `seed`. Gradients accumulate across backward calls until zero_grad().
template <class T = float>
class AdditiveAttention {
 public:
  AdditiveAttention(int64_t key_size, int64_t query_size, int64_t num_hiddens, double dropout = 0.0,
                    uint64_t seed = 0);

  void train(bool on = true) { training_ = on; }
  void eval() { training_ = false; }
  bool training() const { return training_; }

  Tensor<T>& w_q() { return w_q_; }
  Tensor<T>& w_k() { return w_k_; }
  Tensor<T>& w_v() { return w_v_; }
  const Tensor<T>& w_q() const { return w_q_; }
  const Tensor<T>& w_k() const { return w_k_; }
  const Tensor<T>& w_v() const { return w_v_; }
  const Tensor<T>& d_w_q() const { return d_w_q_; }
  const Tensor<T>& d_w_k() const { return d_w_k_; }
  const Tensor<T>& d_w_v() const { return d_w_v_; }

  // queries (B, Nq, query_size), keys (B, Nk, key_size), values (B, Nk, Dv).
  Tensor<T> forward(ConstView<T> queries, ConstView<T> keys, ConstView<T> values,
                    const ValidLens& valid_lens = {});
  const Tensor<T>& attention_weights() const { return cache_.weights; }
  // Returns dQ, dK, dV (d_w_* of the result hold this call's parameter
  // gradients) and adds the parameter gradients into d_w_q/d_w_k/d_w_v.
  AdditiveGrads<T> backward(ConstView<T> d_output);
  void zero_grad();
  // Every parameter -= lr * its gradient.
  void sgd_step(double lr);

 private:
  double dropout_;
  uint64_t seed_;
  uint64_t forward_count_ = 0;
  bool training_ = true;
  Tensor<T> w_q_, w_k_, w_v_;
  Tensor<T> d_w_q_, d_w_k_, d_w_v_;
  detail::AttentionCache<T> cache_;
};

// The parameters of a MultiHeadAttention (as torch.nn.Linear's: weights
// (out_features, in_features), biases (out_features), empty without bias),
// and the same shapes for their gradients.
template <class T>
struct MultiHeadParams {
  Tensor<T> w_q, w_k, w_v, w_o;  // (hid, query_size), (kv_hid, key_size), (kv_hid, value_size), (hid, hid)
  Tensor<T> b_q, b_k, b_v, b_o;  // (hid), (kv_hid), (kv_hid), (hid)
};

// What MultiHeadAttention::backward returns: the gradients of its inputs.
template <class T>
struct MultiHeadGrads {
  Tensor<T> d_queries;  // (B, Nq, query_size)
  Tensor<T> d_keys;     // (B, Nk, key_size)
  Tensor<T> d_values;   // (B, Nk, value_size)
};

// d2l's MultiHeadAttention (section 11.5): W_q, W_k, W_v project the queries,
// keys and values to num_hiddens features, split into num_heads heads of
// d = num_hiddens / num_heads; scaled dot-product attention per head; W_o
// mixes the joined heads. With num_kv_heads < num_heads (0: num_heads) keys
// and values have num_kv_heads heads of d (W_k, W_v give num_kv_heads d
// features) shared by num_heads / num_kv_heads query heads: grouped-query
// attention. The heads are strided (B, H, N, d) views of the projections and
// each head's output is written straight into its d columns of the joined
// (B, Nq, num_hiddens) tensor: no head transposes, forward or backward.
// Parameters initialised as torch.nn.Linear's default from `seed`; dropout on
// the weights in training mode (a fresh mask per training forward, as
// DotProductAttention); valid_lens (B) or (B, Nq) shared by the heads.
// Gradients accumulate across backward calls until zero_grad().
template <class T = float>
class MultiHeadAttention {
 public:
  MultiHeadAttention(int64_t query_size, int64_t key_size, int64_t value_size,
                     int64_t num_hiddens, int64_t num_heads, double dropout = 0.0,
                     bool bias = false, int64_t num_kv_heads = 0, uint64_t seed = 0);

  void train(bool on = true) { training_ = on; }
  void eval() { training_ = false; }
  bool training() const { return training_; }
  int64_t num_heads() const { return num_heads_; }
  int64_t num_kv_heads() const { return num_kv_heads_; }
  // Whether forward keeps the weights (B, num_heads, Nq, Nk) (default true,
  // as d2l; off saves that buffer).
  void keep_attention_weights(bool on) { keep_weights_ = on; }

  MultiHeadParams<T>& params() { return params_; }
  const MultiHeadParams<T>& params() const { return params_; }
  const MultiHeadParams<T>& grads() const { return grads_; }

  // queries (B, Nq, query_size), keys (B, Nk, key_size), values (B, Nk,
  // value_size) -> (B, Nq, num_hiddens).
  Tensor<T> forward(ConstView<T> queries, ConstView<T> keys, ConstView<T> values,
                    const ValidLens& valid_lens = {}, Causal causal = Causal::kNone);
  // The last forward's weights (before dropout), (B, num_heads, Nq, Nk);
  // empty when not kept.
  const Tensor<T>& attention_weights() const { return weights_; }
  // Gradients of the last forward's inputs given dLoss/d(output) (B, Nq,
  // num_hiddens); adds the parameters' gradients into grads().
  MultiHeadGrads<T> backward(ConstView<T> d_output);
  void zero_grad();
  // Every parameter -= lr * its gradient.
  void sgd_step(double lr);

 private:
  int64_t num_heads_, num_kv_heads_;
  double dropout_;
  uint64_t seed_;
  uint64_t forward_count_ = 0;
  bool training_ = true;
  bool keep_weights_ = true;
  MultiHeadParams<T> params_, grads_;
  // The last forward: its inputs (copies), lengths, options, the projections
  // (B, N, features), the joined heads' output (B, Nq, num_hiddens) and lse.
  Tensor<T> queries_, keys_, values_, q_proj_, k_proj_, v_proj_, joined_, lse_, weights_;
  Tensor<T> softmax_stats_;  // the forward's (m, l) per row, for the backward's weights
  Tensor<int64_t> valid_lens_;
  AttentionOptions options_;
  bool ready_ = false;
};

}  // namespace qkv
