// DotProductAttention, AdditiveAttention and MultiHeadAttention modules
// (d2l's, with explicit backward) and the SGD step.
#include "qkv/modules.h"

#include <cmath>
#include <string>

#include "core/check.h"
#include "kernels/runtime/blas.h"
#include "kernels/runtime/parallel.h"
#include "kernels/runtime/philox.h"
#include "qkv/linear.h"

namespace qkv {
namespace {

template <class T>
void sgd(TensorView<T> param, ConstView<T> grad, double lr) {
  if (!(param.shape() == grad.shape())) {
    fail("sgd_step",
         "grad has shape " + grad.shape().str() + " but param has shape " + param.shape().str());
  }
  if (!std::isfinite(lr)) fail("sgd_step", "lr = " + std::to_string(lr) + " is not finite");
  const Tensor<T> g = Tensor<T>::copy_of(grad);  // row-major order, whatever grad's strides
  const Shape& s = param.shape();
  int64_t n = 0;
  auto step = [&](T& p) { p -= static_cast<T>(lr) * g.data()[n++]; };
  switch (param.rank()) {
    case 0:
      step(param());
      break;
    case 1:
      for (int64_t a = 0; a < s[0]; ++a) step(param(a));
      break;
    case 2:
      for (int64_t a = 0; a < s[0]; ++a)
        for (int64_t b = 0; b < s[1]; ++b) step(param(a, b));
      break;
    case 3:
      for (int64_t a = 0; a < s[0]; ++a)
        for (int64_t b = 0; b < s[1]; ++b)
          for (int64_t c = 0; c < s[2]; ++c) step(param(a, b, c));
      break;
    default:
      for (int64_t a = 0; a < s[0]; ++a)
        for (int64_t b = 0; b < s[1]; ++b)
          for (int64_t c = 0; c < s[2]; ++c)
            for (int64_t d = 0; d < s[3]; ++d) step(param(a, b, c, d));
  }
}

// Like torch.nn.Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
// from Philox so the values are the same on every platform. `stream` keeps
// the parameters of one module apart.
template <class T>
Tensor<T> linear_init(Shape shape, uint64_t seed, uint32_t stream) {
  Tensor<T> w(shape);
  const int64_t fan_in = shape[shape.rank() - 1];
  const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
  const auto key = kernels::philox_key(seed);
  for (int64_t n = 0; n < w.numel(); ++n) {
    const auto bits =
        kernels::philox4x32({static_cast<uint32_t>(n / 4), stream, 0x11ea5u, 0u}, key);
    const double u = static_cast<double>(bits[n % 4] >> 8) * 0x1p-24;  // [0, 1)
    w.data()[n] = static_cast<T>((2.0 * u - 1.0) * bound);
  }
  return w;
}

// The options of one forward; a fresh dropout mask for each training forward.
AttentionOptions forward_options(double dropout, bool training, uint64_t seed, uint64_t& count) {
  AttentionOptions options;
  options.dropout_p = dropout;
  options.training = training;
  options.seed = seed + count;
  if (training && dropout > 0.0) ++count;
  options.return_weights = true;
  options.return_lse = true;
  return options;
}

// Keeps a forward's inputs and results for the backward; returns the output.
template <class T>
Tensor<T> remember(detail::AttentionCache<T>& cache, ConstView<T> queries, ConstView<T> keys,
                   ConstView<T> values, const ValidLens& valid_lens,
                   const AttentionOptions& options, AttentionResult<T> result) {
  cache = detail::AttentionCache<T>{Tensor<T>::copy_of(queries),
                                    Tensor<T>::copy_of(keys),
                                    Tensor<T>::copy_of(values),
                                    valid_lens.to_tensor(),
                                    options,
                                    result.output,
                                    std::move(result.weights),
                                    std::move(result.lse),
                                    true};
  return std::move(result.output);
}

void check_ready(std::string_view function, bool ready) {
  if (!ready) fail(function, "there is no forward pass to differentiate; call forward first");
}

}  // namespace

void sgd_step(TensorView<float> param, ConstView<float> grad, double lr) { sgd(param, grad, lr); }
void sgd_step(TensorView<double> param, ConstView<double> grad, double lr) { sgd(param, grad, lr); }

template <class T>
DotProductAttention<T>::DotProductAttention(double dropout, uint64_t seed)
    : dropout_(dropout), seed_(seed) {
  detail::check_dropout("DotProductAttention", "dropout", dropout);
}

template <class T>
Tensor<T> DotProductAttention<T>::forward(ConstView<T> queries, ConstView<T> keys,
                                          ConstView<T> values, const ValidLens& valid_lens) {
  const AttentionOptions options = forward_options(dropout_, training_, seed_, forward_count_);
  return remember(cache_, queries, keys, values, valid_lens, options,
                  scaled_dot_product_attention(queries, keys, values, valid_lens, options));
}

template <class T>
DotProductGrads<T> DotProductAttention<T>::backward(ConstView<T> d_output) const {
  check_ready("DotProductAttention::backward", cache_.ready);
  return scaled_dot_product_attention_backward(cache_.queries, cache_.keys, cache_.values,
                                               ValidLens(cache_.valid_lens), cache_.options,
                                               {cache_.output, cache_.lse}, d_output);
}

template <class T>
AdditiveAttention<T>::AdditiveAttention(int64_t key_size, int64_t query_size, int64_t num_hiddens,
                                        double dropout, uint64_t seed)
    : dropout_(dropout), seed_(seed) {
  detail::check_dropout("AdditiveAttention", "dropout", dropout);
  if (key_size < 0 || query_size < 0 || num_hiddens < 0) {
    fail("AdditiveAttention", "sizes must be >= 0; got key_size " + std::to_string(key_size) +
                                  ", query_size " + std::to_string(query_size) + ", num_hiddens " +
                                  std::to_string(num_hiddens));
  }
  w_q_ = linear_init<T>(Shape{num_hiddens, query_size}, seed, 0);
  w_k_ = linear_init<T>(Shape{num_hiddens, key_size}, seed, 1);
  w_v_ = linear_init<T>(Shape{1, num_hiddens}, seed, 2);
  zero_grad();
}

template <class T>
Tensor<T> AdditiveAttention<T>::forward(ConstView<T> queries, ConstView<T> keys,
                                        ConstView<T> values, const ValidLens& valid_lens) {
  const AttentionOptions options = forward_options(dropout_, training_, seed_, forward_count_);
  const AdditiveWeights<T> weights{w_q_, w_k_, w_v_};
  return remember(cache_, queries, keys, values, valid_lens, options,
                  additive_attention(queries, keys, values, weights, valid_lens, options));
}

template <class T>
AdditiveGrads<T> AdditiveAttention<T>::backward(ConstView<T> d_output) {
  check_ready("AdditiveAttention::backward", cache_.ready);
  AdditiveGrads<T> grads = additive_attention_backward(
      cache_.queries, cache_.keys, cache_.values, {w_q_, w_k_, w_v_}, ValidLens(cache_.valid_lens),
      cache_.options, {cache_.output, cache_.lse}, d_output);
  // Accumulate, as PyTorch does, until zero_grad().
  qkv::sgd_step(d_w_q_.view(), grads.d_w_q.view(), -1.0);
  qkv::sgd_step(d_w_k_.view(), grads.d_w_k.view(), -1.0);
  qkv::sgd_step(d_w_v_.view(), grads.d_w_v.view(), -1.0);
  return grads;
}

template <class T>
void AdditiveAttention<T>::zero_grad() {
  d_w_q_ = Tensor<T>(w_q_.shape());
  d_w_k_ = Tensor<T>(w_k_.shape());
  d_w_v_ = Tensor<T>(w_v_.shape());
}

template <class T>
void AdditiveAttention<T>::sgd_step(double lr) {
  qkv::sgd_step(w_q_.view(), d_w_q_.view(), lr);
  qkv::sgd_step(w_k_.view(), d_w_k_.view(), lr);
  qkv::sgd_step(w_v_.view(), d_w_v_.view(), lr);
}

// ---- MultiHeadAttention ------------------------------------------------------------

namespace {

constexpr std::string_view kMha = "MultiHeadAttention";

// (B, N, count * d) features as the (B, count, N, d) view of its heads.
template <class T>
TensorView<T> heads_of(TensorView<T> x, int64_t count) {
  const int64_t n = x.size(1), features = x.size(2), d = count > 0 ? features / count : 0;
  return TensorView<T>(x.data(), Shape{x.size(0), count, n, d},
                       Shape{n * features, d, features, 1});
}

// y (B, N, out) = x (B, N, in) wᵀ + b, w (out, in), b (out) or empty.
template <class T>
Tensor<T> project(const Tensor<T>& x, const Tensor<T>& w, const Tensor<T>& b) {
  return linear(x.view(), w.view(), b.empty() ? ConstView<T>() : b.view());
}

// The backward of project for heads: d_heads (B, count, N, d) contiguous is
// dLoss/dy viewed as heads. d_w (count d, in) += sum_b d_heads[b, h]ᵀ x[b]
// per head h (its d rows); d_b += the sums over (b, n); returns d_x (B, N,
// in) = sum_h d_heads[b, h] w[h's rows]. Head by head on the heads' own
// layout: no transpose of d_heads. Task cuts by shape only (determinism).
template <class T>
Tensor<T> project_backward(const Tensor<T>& x, const Tensor<T>& w, const Tensor<T>& d_heads,
                           Tensor<T>& d_w, Tensor<T>& d_b) {
  const int64_t batch = x.size(0), n = x.size(1), in = x.size(2);
  const int64_t count = d_heads.size(1), d = d_heads.size(3);
  const auto head = [&](int64_t b, int64_t h) { return d_heads.data() + (b * count + h) * n * d; };
  kernels::parallel_for(count, [&](int64_t h) {
    for (int64_t b = 0; b < batch; ++b) {
      kernels::gemm(true, false, d, in, n, T(1), head(b, h), d, x.data() + b * n * in, in, T(1),
                    d_w.data() + h * d * in, in);
      if (d_b.empty()) continue;
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t c = 0; c < d; ++c) d_b.data()[h * d + c] += head(b, h)[i * d + c];
      }
    }
  });
  Tensor<T> d_x(x.shape());
  kernels::parallel_for(batch, [&](int64_t b) {
    for (int64_t h = 0; h < count; ++h) {
      kernels::gemm(false, false, n, in, d, T(1), head(b, h), d, w.data() + h * d * in, in,
                    h == 0 ? T(0) : T(1), d_x.data() + b * n * in, in);
    }
  });
  return d_x;
}

// "MultiHeadAttention::forward: keys has shape [2, 5]; expected (B, Nk, key_size) with key_size 3"
template <class T>
void check_input(std::string_view fn, std::string_view name, ConstView<T> x, std::string_view axes,
                 int64_t size) {
  if (x.rank() != 3 || x.size(2) != size) {
    fail(fn, std::string(name) + " has shape " + x.shape().str() + "; expected " +
                 std::string(axes) + " with the last size " + std::to_string(size));
  }
}

}  // namespace

template <class T>
MultiHeadAttention<T>::MultiHeadAttention(int64_t query_size, int64_t key_size, int64_t value_size,
                                          int64_t num_hiddens, int64_t num_heads, double dropout,
                                          bool bias, int64_t num_kv_heads, uint64_t seed)
    : num_heads_(num_heads),
      num_kv_heads_(num_kv_heads == 0 ? num_heads : num_kv_heads),
      dropout_(dropout),
      seed_(seed) {
  detail::check_dropout(kMha, "dropout", dropout);
  if (query_size < 0 || key_size < 0 || value_size < 0 || num_hiddens < 0) {
    fail(kMha, "sizes must be >= 0; got query_size " + std::to_string(query_size) + ", key_size " +
                   std::to_string(key_size) + ", value_size " + std::to_string(value_size) +
                   ", num_hiddens " + std::to_string(num_hiddens));
  }
  if (num_heads < 1 || num_hiddens % num_heads != 0) {
    fail(kMha, "num_hiddens = " + std::to_string(num_hiddens) +
                   " is not a multiple of num_heads = " + std::to_string(num_heads));
  }
  if (num_kv_heads_ < 1 || num_heads % num_kv_heads_ != 0) {
    fail(kMha, "num_heads = " + std::to_string(num_heads) +
                   " is not a multiple of num_kv_heads = " + std::to_string(num_kv_heads_));
  }
  const int64_t kv_hiddens = num_hiddens / num_heads * num_kv_heads_;
  params_.w_q = linear_init<T>(Shape{num_hiddens, query_size}, seed, 10);
  params_.w_k = linear_init<T>(Shape{kv_hiddens, key_size}, seed, 11);
  params_.w_v = linear_init<T>(Shape{kv_hiddens, value_size}, seed, 12);
  params_.w_o = linear_init<T>(Shape{num_hiddens, num_hiddens}, seed, 13);
  if (bias) {
    // torch.nn.Linear's bias: U(±1/sqrt(in_features)), the weight's bound.
    const auto bias_init = [&](int64_t out, int64_t in, uint32_t stream) {
      Tensor<T> b = linear_init<T>(Shape{out, in}, seed, stream);
      return Tensor<T>::copy_of(ConstView<T>(b.data(), Shape{out}, Shape{in}));
    };
    params_.b_q = bias_init(num_hiddens, query_size, 14);
    params_.b_k = bias_init(kv_hiddens, key_size, 15);
    params_.b_v = bias_init(kv_hiddens, value_size, 16);
    params_.b_o = bias_init(num_hiddens, num_hiddens, 17);
  }
  zero_grad();
}

template <class T>
Tensor<T> MultiHeadAttention<T>::forward(ConstView<T> queries, ConstView<T> keys,
                                         ConstView<T> values, const ValidLens& valid_lens,
                                         Causal causal) {
  constexpr std::string_view fn = "MultiHeadAttention::forward";
  check_input(fn, "queries", queries, "(B, Nq, query_size)", params_.w_q.size(1));
  check_input(fn, "keys", keys, "(B, Nk, key_size)", params_.w_k.size(1));
  check_input(fn, "values", values, "(B, Nk, value_size)", params_.w_v.size(1));
  if (keys.size(0) != queries.size(0) || values.size(0) != queries.size(0) ||
      values.size(1) != keys.size(1)) {
    fail(fn, "queries " + queries.shape().str() + ", keys " + keys.shape().str() + " and values " +
                 values.shape().str() + " must share B, and keys and values Nk");
  }
  AttentionOptions options = forward_options(dropout_, training_, seed_, forward_count_);
  options.causal = causal;
  queries_ = Tensor<T>::copy_of(queries);
  keys_ = Tensor<T>::copy_of(keys);
  values_ = Tensor<T>::copy_of(values);
  q_proj_ = project(queries_, params_.w_q, params_.b_q);
  k_proj_ = project(keys_, params_.w_k, params_.b_k);
  v_proj_ = project(values_, params_.w_v, params_.b_v);
  const int64_t batch = queries.size(0), nq = queries.size(1), nk = keys.size(1);
  joined_ = Tensor<T>(Shape{batch, nq, params_.w_q.size(0)});
  lse_ = Tensor<T>(Shape{batch, num_heads_, nq});
  softmax_stats_ = Tensor<T>(Shape{batch, num_heads_, nq, 2});
  weights_ = keep_weights_ ? Tensor<T>(Shape{batch, num_heads_, nq, nk}) : Tensor<T>();
  AttentionOutputs<T> outputs{heads_of(joined_.view(), num_heads_), std::nullopt, lse_.view(),
                              softmax_stats_.view()};
  if (keep_weights_) outputs.weights = weights_.view();
  ready_ = false;
  scaled_dot_product_attention(
      heads_of(q_proj_.view(), num_heads_), heads_of(k_proj_.view(), num_kv_heads_),
      heads_of(v_proj_.view(), num_kv_heads_), valid_lens, options, outputs);
  valid_lens_ = valid_lens.to_tensor();
  options_ = options;
  ready_ = true;
  return project(joined_, params_.w_o, params_.b_o);
}

template <class T>
MultiHeadGrads<T> MultiHeadAttention<T>::backward(ConstView<T> d_output) {
  constexpr std::string_view fn = "MultiHeadAttention::backward";
  check_ready(fn, ready_);
  detail::check_shape(fn, "d_output", d_output, joined_.shape());
  const Tensor<T> g = Tensor<T>::copy_of(d_output);
  const int64_t rows = joined_.size(0) * joined_.size(1), hid = joined_.size(2);
  // W_o: dW_o += gᵀ joined, db_o += column sums, d_joined = g W_o.
  kernels::parallel_gemm<T>(true, false, hid, hid, rows, T(1), g.data(), hid, joined_.data(), hid,
                            T(1), grads_.w_o.data(), hid);
  if (!grads_.b_o.empty()) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < hid; ++c) grads_.b_o.data()[c] += g.data()[r * hid + c];
    }
  }
  Tensor<T> d_joined(joined_.shape());
  kernels::parallel_gemm<T>(false, false, rows, hid, hid, T(1), g.data(), hid, params_.w_o.data(),
                            hid, T(0), d_joined.data(), hid);
  const DotProductGrads<T> heads = scaled_dot_product_attention_backward(
      heads_of(q_proj_.view(), num_heads_), heads_of(k_proj_.view(), num_kv_heads_),
      heads_of(v_proj_.view(), num_kv_heads_), ValidLens(valid_lens_), options_,
      {heads_of(joined_.view(), num_heads_), lse_, softmax_stats_},
      heads_of(d_joined.view(), num_heads_));
  return {project_backward(queries_, params_.w_q, heads.d_queries, grads_.w_q, grads_.b_q),
          project_backward(keys_, params_.w_k, heads.d_keys, grads_.w_k, grads_.b_k),
          project_backward(values_, params_.w_v, heads.d_values, grads_.w_v, grads_.b_v)};
}

template <class T>
void MultiHeadAttention<T>::zero_grad() {
  for (auto [grad, param] : {std::pair{&grads_.w_q, &params_.w_q},
                             {&grads_.w_k, &params_.w_k},
                             {&grads_.w_v, &params_.w_v},
                             {&grads_.w_o, &params_.w_o},
                             {&grads_.b_q, &params_.b_q},
                             {&grads_.b_k, &params_.b_k},
                             {&grads_.b_v, &params_.b_v},
                             {&grads_.b_o, &params_.b_o}}) {
    *grad = param->empty() ? Tensor<T>() : Tensor<T>(param->shape());
  }
}

template <class T>
void MultiHeadAttention<T>::sgd_step(double lr) {
  for (auto [param, grad] : {std::pair{&params_.w_q, &grads_.w_q},
                             {&params_.w_k, &grads_.w_k},
                             {&params_.w_v, &grads_.w_v},
                             {&params_.w_o, &grads_.w_o},
                             {&params_.b_q, &grads_.b_q},
                             {&params_.b_k, &grads_.b_k},
                             {&params_.b_v, &grads_.b_v},
                             {&params_.b_o, &grads_.b_o}}) {
    if (!param->empty()) qkv::sgd_step(param->view(), grad->view(), lr);
  }
}

template class DotProductAttention<float>;
template class DotProductAttention<double>;
template class AdditiveAttention<float>;
template class AdditiveAttention<double>;
template class MultiHeadAttention<float>;
template class MultiHeadAttention<double>;

}  // namespace qkv
