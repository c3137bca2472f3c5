// Attention front ends: validate shapes and options once, then run the fast
// kernels (public API) or the reference kernels (qkv::ref).
#include "qkv/attention.h"

#include <cmath>
#include <string>

#include "check.h"
#include "kernels/gemm_bf16.h"
#include "kernels/kernels.h"

namespace qkv {
namespace {

constexpr std::string_view kDot = "scaled_dot_product_attention";
constexpr std::string_view kDotBackward = "scaled_dot_product_attention_backward";
constexpr std::string_view kAdditive = "additive_attention";
constexpr std::string_view kAdditiveBackward = "additive_attention_backward";

struct Dims {
  int64_t batch, nq, nk, dq, dk, dv;
};

std::string shapes_of(std::string_view a, const Shape& sa, std::string_view b, const Shape& sb) {
  return " (" + std::string(a) + " " + sa.str() + ", " + std::string(b) + " " + sb.str() + ")";
}

// queries (B, Nq, Dq), keys (B, Nk, Dk), values (B, Nk, Dv); Dq == Dk for dot products.
template <class T>
Dims check_inputs(std::string_view fn, ConstView<T> q, ConstView<T> k, ConstView<T> v,
                  bool same_feature_size, const ValidLens& valid_lens) {
  detail::check_rank(fn, "queries", q, 3, "(batch, num_queries, head_dim)");
  detail::check_rank(fn, "keys", k, 3, "(batch, num_keys, head_dim)");
  detail::check_rank(fn, "values", v, 3, "(batch, num_keys, value_dim)");
  if (k.size(0) != q.size(0)) {
    fail(fn, "keys has batch size " + std::to_string(k.size(0)) + " but queries has " +
                 std::to_string(q.size(0)) + shapes_of("keys", k.shape(), "queries", q.shape()));
  }
  if (v.size(0) != k.size(0)) {
    fail(fn, "values has batch size " + std::to_string(v.size(0)) + " but keys has " +
                 std::to_string(k.size(0)) + shapes_of("values", v.shape(), "keys", k.shape()));
  }
  if (same_feature_size && k.size(2) != q.size(2)) {
    fail(fn, "keys has feature size " + std::to_string(k.size(2)) + " but queries has " +
                 std::to_string(q.size(2)) + shapes_of("keys", k.shape(), "queries", q.shape()));
  }
  if (v.size(1) != k.size(1)) {
    fail(fn, "values has " + std::to_string(v.size(1)) + " keys but keys has " +
                 std::to_string(k.size(1)) + shapes_of("values", v.shape(), "keys", k.shape()));
  }
  const Dims dims{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), v.size(2)};
  valid_lens.check(fn, "scores", Shape{dims.batch, dims.nq, dims.nk}, dims.batch, dims.nq, dims.nk);
  return dims;
}

void check_dropout(std::string_view fn, const AttentionOptions& options) {
  if (!(options.dropout >= 0.0 && options.dropout <= 1.0)) {
    fail(fn, "options.dropout = " + std::to_string(options.dropout) + " is outside [0, 1]");
  }
}

kernels::AttentionConfig dot_config(std::string_view fn, const Dims& dims,
                                    const ValidLens& valid_lens, const AttentionOptions& options) {
  check_dropout(fn, options);
  if (options.scale && !std::isfinite(*options.scale)) {
    fail(fn, "options.scale = " + std::to_string(*options.scale) + " is not finite");
  }
  if (!options.scale && dims.dq == 0) {
    fail(fn,
         "queries has head_dim 0, so the default scale 1/sqrt(head_dim) is undefined; "
         "set options.scale");
  }
  const double scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(dims.dq)));
  return {&valid_lens, scale, options.training ? options.dropout : 0.0, options.seed};
}

template <class T>
kernels::AdditiveParams<T> check_params(std::string_view fn, const Dims& dims, ConstView<T> w_q,
                                        ConstView<T> w_k, ConstView<T> w_v) {
  detail::check_rank(fn, "w_q", w_q, 2, "(num_hiddens, query_size)");
  detail::check_rank(fn, "w_k", w_k, 2, "(num_hiddens, key_size)");
  const int64_t hidden = w_q.size(0);
  if (w_q.size(1) != dims.dq) {
    fail(fn, "w_q has shape " + w_q.shape().str() + " but queries has feature size " +
                 std::to_string(dims.dq) + "; expected " + Shape{hidden, dims.dq}.str());
  }
  if (w_k.size(0) != hidden || w_k.size(1) != dims.dk) {
    fail(fn, "w_k has shape " + w_k.shape().str() + " but w_q has shape " + w_q.shape().str() +
                 " and keys has feature size " + std::to_string(dims.dk) + "; expected " +
                 Shape{hidden, dims.dk}.str());
  }
  const bool flat = w_v.shape() == Shape{hidden};
  const bool row = w_v.shape() == Shape{1, hidden};
  if (!flat && !row) {
    fail(fn, "w_v has shape " + w_v.shape().str() + " but w_q has shape " + w_q.shape().str() +
                 "; expected " + Shape{hidden}.str() + " or " + Shape{1, hidden}.str());
  }
  const ConstView<T> w_v_flat =
      flat ? w_v : ConstView<T>(w_v.data(), Shape{hidden}, Shape{w_v.stride(1)});
  return {w_q, w_k, w_v_flat};
}

kernels::AttentionConfig additive_config(std::string_view fn, const ValidLens& valid_lens,
                                         const AttentionOptions& options) {
  check_dropout(fn, options);
  if (options.scale) {
    fail(fn, "options.scale is set, but additive attention has no scale; leave it unset");
  }
  return {&valid_lens, 1.0, options.training ? options.dropout : 0.0, options.seed};
}

template <class T>
void check_outputs(std::string_view fn, const Dims& dims, const AttentionOutputs<T>& outputs) {
  detail::check_destination(fn, "outputs.output", outputs.output,
                            Shape{dims.batch, dims.nq, dims.dv});
  if (outputs.weights) {
    detail::check_destination(fn, "outputs.weights", *outputs.weights,
                              Shape{dims.batch, dims.nq, dims.nk});
  }
  if (outputs.lse) {
    detail::check_destination(fn, "outputs.lse", *outputs.lse, Shape{dims.batch, dims.nq});
  }
}

template <class T>
AttentionOutputs<T> allocate(const Dims& dims, const AttentionOptions& options,
                             AttentionResult<T>& result) {
  result.output = Tensor<T>(Shape{dims.batch, dims.nq, dims.dv});
  AttentionOutputs<T> outputs{result.output.view(), std::nullopt, std::nullopt};
  if (options.want_weights) {
    result.weights = Tensor<T>(Shape{dims.batch, dims.nq, dims.nk});
    outputs.weights = result.weights.view();
  }
  if (options.want_lse) {
    result.lse = Tensor<T>(Shape{dims.batch, dims.nq});
    outputs.lse = result.lse.view();
  }
  return outputs;
}

template <class T>
void check_saved(std::string_view fn, const Dims& dims, ConstView<T> output, ConstView<T> lse,
                 ConstView<T> d_output) {
  detail::check_shape(fn, "output", output, Shape{dims.batch, dims.nq, dims.dv});
  detail::check_shape(fn, "lse", lse, Shape{dims.batch, dims.nq});
  detail::check_shape(fn, "d_output", d_output, Shape{dims.batch, dims.nq, dims.dv});
}

// ---- scaled dot-product ------------------------------------------------------

// The forward once the inputs are known to be consistent (dims from check_inputs).
template <class T>
void run_dot(ConstView<T> q, ConstView<T> k, ConstView<T> v, const ValidLens& valid_lens,
             const AttentionOptions& options, const Dims& dims,
             const AttentionOutputs<T>& outputs) {
  const kernels::AttentionConfig config = dot_config(kDot, dims, valid_lens, options);
  check_outputs(kDot, dims, outputs);
  const detail::Contiguous<T> qc(q), kc(k), vc(v);
  kernels::fast::dot_product_attention(qc.view(), kc.view(), vc.view(), config, outputs.output,
                                       outputs.weights.value_or(TensorView<T>()),
                                       outputs.lse.value_or(TensorView<T>()));
}

template <class T>
void dot_into(ConstView<T> q, ConstView<T> k, ConstView<T> v, const ValidLens& valid_lens,
              const AttentionOptions& options, const AttentionOutputs<T>& outputs) {
  run_dot(q, k, v, valid_lens, options, check_inputs(kDot, q, k, v, true, valid_lens), outputs);
}

template <class T>
AttentionResult<T> dot(ConstView<T> q, ConstView<T> k, ConstView<T> v, const ValidLens& valid_lens,
                       const AttentionOptions& options) {
  const Dims dims = check_inputs(kDot, q, k, v, true, valid_lens);
  AttentionResult<T> result;
  run_dot(q, k, v, valid_lens, options, dims, allocate(dims, options, result));
  return result;
}

template <class T>
DotProductGrads<T> dot_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                const ValidLens& valid_lens, const AttentionOptions& options,
                                ConstView<T> output, ConstView<T> lse, ConstView<T> d_output) {
  const Dims dims = check_inputs(kDotBackward, q, k, v, true, valid_lens);
  const kernels::AttentionConfig config = dot_config(kDotBackward, dims, valid_lens, options);
  check_saved(kDotBackward, dims, output, lse, d_output);
  const detail::Contiguous<T> qc(q), kc(k), vc(v), oc(output), lc(lse), gc(d_output);
  DotProductGrads<T> grads;
  kernels::fast::dot_product_attention_backward(qc.view(), kc.view(), vc.view(), config, oc.view(),
                                                lc.view(), gc.view(), grads);
  return grads;
}

template <class T>
AttentionResult<T> ref_dot(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                           const ValidLens& valid_lens, const AttentionOptions& options) {
  const Dims dims = check_inputs(kDot, q, k, v, true, valid_lens);
  return kernels::ref::dot_product_attention(q, k, v, dot_config(kDot, dims, valid_lens, options));
}

template <class T>
DotProductGrads<T> ref_dot_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                    const ValidLens& valid_lens, const AttentionOptions& options,
                                    ConstView<T> output, ConstView<T> lse, ConstView<T> d_output) {
  const Dims dims = check_inputs(kDotBackward, q, k, v, true, valid_lens);
  const kernels::AttentionConfig config = dot_config(kDotBackward, dims, valid_lens, options);
  check_saved(kDotBackward, dims, output, lse, d_output);
  return kernels::ref::dot_product_attention_backward(q, k, v, config, d_output);
}

// bf16 inputs: the same checks, float results. Without the BF16 instructions
// (or at a SIMD cap below avx512) the float kernel runs on float copies of
// the inputs (widening is exact): multiplying bf16 blocks there means
// widening them block by block for every product, slower than float32 inputs
// (issue 11). Widened, bf16 takes 1.09x float32's time on an AVX2 machine
// (93.2 vs 85.2 ms, B = 2, Nq = Nk = 4096, D = 64; docs/performance-avx2.md),
// where AVX-512 BF16 makes it 1.7x faster than float32. The copies cost 2 bytes per input
// element; the results are float32 attention's on the widened inputs, within
// the bf16 path's bounds (docs/semantics.md).
bool bf16_through_float() { return !kernels::bf16::native(); }

Tensor<float> widened(ConstView<bfloat16> x) {
  const detail::Contiguous<bfloat16> xc(x);
  Tensor<float> out(x.shape());
  kernels::bf16::to_float(xc.data(), out.data(), out.numel());
  return out;
}

AttentionResult<float> dot_bf16(ConstView<bfloat16> q, ConstView<bfloat16> k,
                                ConstView<bfloat16> v, const ValidLens& valid_lens,
                                const AttentionOptions& options) {
  const Dims dims = check_inputs(kDot, q, k, v, true, valid_lens);
  AttentionResult<float> result;
  const AttentionOutputs<float> outputs = allocate(dims, options, result);
  if (bf16_through_float()) {
    const Tensor<float> qf = widened(q), kf = widened(k), vf = widened(v);
    run_dot<float>(qf, kf, vf, valid_lens, options, dims, outputs);
    return result;
  }
  const kernels::AttentionConfig config = dot_config(kDot, dims, valid_lens, options);
  const detail::Contiguous<bfloat16> qc(q), kc(k), vc(v);
  kernels::fast::dot_product_attention(qc.view(), kc.view(), vc.view(), config, outputs.output,
                                       outputs.weights.value_or(TensorView<float>()),
                                       outputs.lse.value_or(TensorView<float>()));
  return result;
}

DotProductGrads<float> dot_backward_bf16(ConstView<bfloat16> q, ConstView<bfloat16> k,
                                         ConstView<bfloat16> v, const ValidLens& valid_lens,
                                         const AttentionOptions& options, ConstView<float> output,
                                         ConstView<float> lse, ConstView<float> d_output) {
  const Dims dims = check_inputs(kDotBackward, q, k, v, true, valid_lens);
  const kernels::AttentionConfig config = dot_config(kDotBackward, dims, valid_lens, options);
  check_saved(kDotBackward, dims, output, lse, d_output);
  if (bf16_through_float()) {
    const Tensor<float> qf = widened(q), kf = widened(k), vf = widened(v);
    return dot_backward<float>(qf, kf, vf, valid_lens, options, output, lse, d_output);
  }
  const detail::Contiguous<bfloat16> qc(q), kc(k), vc(v);
  const detail::Contiguous<float> oc(output), lc(lse), gc(d_output);
  DotProductGrads<float> grads;
  kernels::fast::dot_product_attention_backward(qc.view(), kc.view(), vc.view(), config, oc.view(),
                                                lc.view(), gc.view(), grads);
  return grads;
}

// ---- additive ---------------------------------------------------------------

template <class T>
void run_additive(ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w_q,
                  ConstView<T> w_k, ConstView<T> w_v, const ValidLens& valid_lens,
                  const AttentionOptions& options, const Dims& dims,
                  const AttentionOutputs<T>& outputs) {
  const kernels::AdditiveParams<T> params = check_params(kAdditive, dims, w_q, w_k, w_v);
  const kernels::AttentionConfig config = additive_config(kAdditive, valid_lens, options);
  check_outputs(kAdditive, dims, outputs);
  const detail::Contiguous<T> qc(q), kc(k), vc(v), wqc(params.w_q), wkc(params.w_k),
      wvc(params.w_v);
  kernels::fast::additive_attention(
      qc.view(), kc.view(), vc.view(),
      kernels::AdditiveParams<T>{wqc.view(), wkc.view(), wvc.view()}, config, outputs.output,
      outputs.weights.value_or(TensorView<T>()), outputs.lse.value_or(TensorView<T>()));
}

template <class T>
void additive_into(ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w_q,
                   ConstView<T> w_k, ConstView<T> w_v, const ValidLens& valid_lens,
                   const AttentionOptions& options, const AttentionOutputs<T>& outputs) {
  run_additive(q, k, v, w_q, w_k, w_v, valid_lens, options,
               check_inputs(kAdditive, q, k, v, false, valid_lens), outputs);
}

template <class T>
AttentionResult<T> additive(ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w_q,
                            ConstView<T> w_k, ConstView<T> w_v, const ValidLens& valid_lens,
                            const AttentionOptions& options) {
  const Dims dims = check_inputs(kAdditive, q, k, v, false, valid_lens);
  AttentionResult<T> result;
  run_additive(q, k, v, w_q, w_k, w_v, valid_lens, options, dims, allocate(dims, options, result));
  return result;
}

template <class T>
AdditiveGrads<T> additive_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w_q,
                                   ConstView<T> w_k, ConstView<T> w_v, const ValidLens& valid_lens,
                                   const AttentionOptions& options, ConstView<T> output,
                                   ConstView<T> lse, ConstView<T> d_output) {
  const Dims dims = check_inputs(kAdditiveBackward, q, k, v, false, valid_lens);
  const kernels::AdditiveParams<T> params = check_params(kAdditiveBackward, dims, w_q, w_k, w_v);
  const kernels::AttentionConfig config = additive_config(kAdditiveBackward, valid_lens, options);
  check_saved(kAdditiveBackward, dims, output, lse, d_output);
  const detail::Contiguous<T> qc(q), kc(k), vc(v), wqc(params.w_q), wkc(params.w_k),
      wvc(params.w_v), oc(output), lc(lse), gc(d_output);
  AdditiveGrads<T> grads;
  kernels::fast::additive_attention_backward(
      qc.view(), kc.view(), vc.view(),
      kernels::AdditiveParams<T>{wqc.view(), wkc.view(), wvc.view()}, config, oc.view(), lc.view(),
      gc.view(), grads);
  grads.d_w_v = std::move(grads.d_w_v).reshaped(w_v.shape());
  return grads;
}

template <class T>
AttentionResult<T> ref_additive(ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w_q,
                                ConstView<T> w_k, ConstView<T> w_v, const ValidLens& valid_lens,
                                const AttentionOptions& options) {
  const Dims dims = check_inputs(kAdditive, q, k, v, false, valid_lens);
  const kernels::AdditiveParams<T> params = check_params(kAdditive, dims, w_q, w_k, w_v);
  return kernels::ref::additive_attention(q, k, v, params,
                                          additive_config(kAdditive, valid_lens, options));
}

template <class T>
AdditiveGrads<T> ref_additive_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                       ConstView<T> w_q, ConstView<T> w_k, ConstView<T> w_v,
                                       const ValidLens& valid_lens, const AttentionOptions& options,
                                       ConstView<T> output, ConstView<T> lse,
                                       ConstView<T> d_output) {
  const Dims dims = check_inputs(kAdditiveBackward, q, k, v, false, valid_lens);
  const kernels::AdditiveParams<T> params = check_params(kAdditiveBackward, dims, w_q, w_k, w_v);
  const kernels::AttentionConfig config = additive_config(kAdditiveBackward, valid_lens, options);
  check_saved(kAdditiveBackward, dims, output, lse, d_output);
  AdditiveGrads<T> grads =
      kernels::ref::additive_attention_backward(q, k, v, params, config, d_output);
  grads.d_w_v = std::move(grads.d_w_v).reshaped(w_v.shape());
  return grads;
}

}  // namespace

// ---- the public overloads, one per element type -------------------------------

AttentionResult<float> scaled_dot_product_attention(ConstView<bfloat16> q, ConstView<bfloat16> k,
                                                    ConstView<bfloat16> v, const ValidLens& lens,
                                                    const AttentionOptions& options) {
  return dot_bf16(q, k, v, lens, options);
}

DotProductGrads<float> scaled_dot_product_attention_backward(
    ConstView<bfloat16> q, ConstView<bfloat16> k, ConstView<bfloat16> v, const ValidLens& lens,
    const AttentionOptions& options, ConstView<float> output, ConstView<float> lse,
    ConstView<float> d_output) {
  return dot_backward_bf16(q, k, v, lens, options, output, lse, d_output);
}


#define QKV_DEFINE(T)                                                                             \
  AttentionResult<T> scaled_dot_product_attention(ConstView<T> q, ConstView<T> k, ConstView<T> v, \
                                                  const ValidLens& lens,                          \
                                                  const AttentionOptions& options) {              \
    return dot(q, k, v, lens, options);                                                           \
  }                                                                                               \
  void scaled_dot_product_attention(ConstView<T> q, ConstView<T> k, ConstView<T> v,               \
                                    const ValidLens& lens, const AttentionOptions& options,       \
                                    const AttentionOutputs<T>& outputs) {                         \
    dot_into(q, k, v, lens, options, outputs);                                                    \
  }                                                                                               \
  DotProductGrads<T> scaled_dot_product_attention_backward(                                       \
      ConstView<T> q, ConstView<T> k, ConstView<T> v, const ValidLens& lens,                      \
      const AttentionOptions& options, ConstView<T> output, ConstView<T> lse,                     \
      ConstView<T> d_output) {                                                                    \
    return dot_backward(q, k, v, lens, options, output, lse, d_output);                           \
  }                                                                                               \
  AttentionResult<T> additive_attention(ConstView<T> q, ConstView<T> k, ConstView<T> v,           \
                                        ConstView<T> w_q, ConstView<T> w_k, ConstView<T> w_v,     \
                                        const ValidLens& lens, const AttentionOptions& options) { \
    return additive(q, k, v, w_q, w_k, w_v, lens, options);                                       \
  }                                                                                               \
  void additive_attention(ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w_q,       \
                          ConstView<T> w_k, ConstView<T> w_v, const ValidLens& lens,              \
                          const AttentionOptions& options, const AttentionOutputs<T>& outputs) {  \
    additive_into(q, k, v, w_q, w_k, w_v, lens, options, outputs);                                \
  }                                                                                               \
  AdditiveGrads<T> additive_attention_backward(                                                   \
      ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w_q, ConstView<T> w_k,         \
      ConstView<T> w_v, const ValidLens& lens, const AttentionOptions& options,                   \
      ConstView<T> output, ConstView<T> lse, ConstView<T> d_output) {                             \
    return additive_backward(q, k, v, w_q, w_k, w_v, lens, options, output, lse, d_output);       \
  }                                                                                               \
  namespace ref {                                                                                 \
  AttentionResult<T> scaled_dot_product_attention(ConstView<T> q, ConstView<T> k, ConstView<T> v, \
                                                  const ValidLens& lens,                          \
                                                  const AttentionOptions& options) {              \
    return ref_dot(q, k, v, lens, options);                                                       \
  }                                                                                               \
  DotProductGrads<T> scaled_dot_product_attention_backward(ConstView<T> q, ConstView<T> k,        \
                                                           ConstView<T> v, const ValidLens& lens, \
                                                           const AttentionOptions& options,       \
                                                           ConstView<T> output, ConstView<T> lse, \
                                                           ConstView<T> d_output) {               \
    return ref_dot_backward(q, k, v, lens, options, output, lse, d_output);                       \
  }                                                                                               \
  AttentionResult<T> additive_attention(ConstView<T> q, ConstView<T> k, ConstView<T> v,           \
                                        ConstView<T> w_q, ConstView<T> w_k, ConstView<T> w_v,     \
                                        const ValidLens& lens, const AttentionOptions& options) { \
    return ref_additive(q, k, v, w_q, w_k, w_v, lens, options);                                   \
  }                                                                                               \
  AdditiveGrads<T> additive_attention_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,    \
                                               ConstView<T> w_q, ConstView<T> w_k,                \
                                               ConstView<T> w_v, const ValidLens& lens,           \
                                               const AttentionOptions& options,                   \
                                               ConstView<T> output, ConstView<T> lse,             \
                                               ConstView<T> d_output) {                           \
    return ref_additive_backward(q, k, v, w_q, w_k, w_v, lens, options, output, lse, d_output);   \
  }                                                                                               \
  }  // namespace ref
QKV_DEFINE(float)
QKV_DEFINE(double)
#undef QKV_DEFINE

}  // namespace qkv
