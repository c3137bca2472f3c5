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

}  // namespace qkv
