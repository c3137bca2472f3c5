// DotProductAttention and AdditiveAttention modules (d2l's, with explicit
// backward) and the SGD step.
#include "qkv/modules.h"

#include <cmath>
#include <string>

#include "check.h"
#include "kernels/philox.h"

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
  options.dropout = dropout;
  options.training = training;
  options.seed = seed + count;
  if (training && dropout > 0.0) ++count;
  options.want_weights = true;
  options.want_lse = true;
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

template class DotProductAttention<float>;
template class DotProductAttention<double>;
template class AdditiveAttention<float>;
template class AdditiveAttention<double>;

}  // namespace qkv
