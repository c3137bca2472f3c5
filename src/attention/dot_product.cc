// Scaled dot-product attention's front end (qkv/attention.h): the pipeline
// (attention/pipeline.h), then the fused kernels (kernels/attention/sdpa_fast.cc)
// or the reference (sdpa_ref.cc); float, double and bfloat16 inputs.
#include "attention/pipeline.h"
#include "kernels/simd/gemm_bf16.h"
#include "kernels/simd/vecmath.h"

namespace qkv {
namespace detail {
namespace {

constexpr std::string_view kSdpa = "scaled_dot_product_attention";
constexpr std::string_view kSdpaBackward = "scaled_dot_product_attention_backward";

// The fast SDPA kernels with their scratch; In is float, double or bfloat16
// (then Acc is float).
template <class In, class Acc>
void fast_sdpa(ConstView<In> q, ConstView<In> k, ConstView<In> v,
               const kernels::AttentionConfig& config, const kernels::ForwardViews<Acc>& out) {
  with_workspace(
      pair_flops(q, k, 2.0 * static_cast<double>(q.size(3) + v.size(3))),
      [&](int threads) {
        return kernels::fast::sdpa_workspace_size(q, k, v, config, out, threads);
      },
      [&](kernels::Workspace ws) { kernels::fast::sdpa(q, k, v, config, out, ws); });
}

template <class In, class Acc>
void fast_sdpa_backward(ConstView<In> q, ConstView<In> k, ConstView<In> v,
                        const kernels::AttentionConfig& config,
                        const kernels::SavedViews<Acc>& saved, ConstView<Acc> d_output,
                        const kernels::SdpaGradViews<Acc>& grads) {
  with_workspace(
      pair_flops(q, k, 5.0 * static_cast<double>(q.size(3) + v.size(3))),
      [&](int threads) {
        return kernels::fast::sdpa_backward_workspace_size(q, k, v, config, saved, d_output, grads,
                                                           threads);
      },
      [&](kernels::Workspace ws) {
        kernels::fast::sdpa_backward(q, k, v, config, saved, d_output, grads, ws);
      });
}

// A contiguous copy's view of an optional argument: null data when not given.
template <class T>
ConstView<T> optional_view(const detail::Contiguous<T>& copy, ConstView<T> given) {
  return given.data() != nullptr ? copy.view() : ConstView<T>();
}

// The gradients of a backward, allocated in the inputs' shapes (and the
// bias's when asked for), and the views the kernels write them through.
template <class In, class Acc>
kernels::SdpaGradViews<Acc> gradient_views(ConstView<In> q, ConstView<In> k, ConstView<In> v,
                                           const Dims& dims, const AttentionOptions& options,
                                           DotProductGrads<Acc>& grads) {
  grads.d_queries = Tensor<Acc>(q.shape());
  grads.d_keys = Tensor<Acc>(k.shape());
  grads.d_values = Tensor<Acc>(v.shape());
  kernels::SdpaGradViews<Acc> out{kernels::as_heads(grads.d_queries.view()),
                                  kernels::as_heads(grads.d_keys.view()),
                                  kernels::as_heads(grads.d_values.view())};
  if (options.want_bias_grad) {
    grads.d_bias = Tensor<Acc>(std::get<ConstView<Acc>>(options.bias).shape());
    out.d_bias = broadcast_to_scores(kSdpaBackward, "options.bias", grads.d_bias.view(), dims);
  }
  return out;
}

// The forward into the caller's outputs (given) or into a new result.
template <class T>
AttentionResult<T> sdpa_forward(Version version, ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                const ValidLens& valid_lens, const AttentionOptions& options,
                                const AttentionOutputs<T>* given = nullptr) {
  const Dims dims = check_inputs(kSdpa, rules_of(Scoring::kDotProduct), q, k, v, valid_lens);
  const kernels::AttentionConfig config =
      attention_config<T>(kSdpa, rules_of(Scoring::kDotProduct), dims, valid_lens, options);
  AttentionResult<T> result;
  kernels::ForwardViews<T> out = destinations(kSdpa, version, dims, options, given, result,
                                              /*strided_output=*/true, /*stats=*/true);
  out.output = kernels::as_heads(out.output);
  if (version == Version::kFast) {
    const KernelOperand<T> qk(q), kk(k), vk(v);
    fast_sdpa(qk.view(), kk.view(), vk.view(), config, out);
    return result;
  }
  kernels::ref::sdpa(kernels::as_heads(q), kernels::as_heads(k), kernels::as_heads(v), config, out);
  return result;
}

template <class T>
DotProductGrads<T> sdpa_backward(Version version, ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                 const ValidLens& valid_lens, const AttentionOptions& options,
                                 const SavedForward<T>& saved, ConstView<T> d_output,
                                 ConstView<T> d_lse = {}) {
  const Dims dims =
      check_inputs(kSdpaBackward, rules_of(Scoring::kDotProduct), q, k, v, valid_lens);
  const kernels::AttentionConfig config =
      attention_config<T>(kSdpaBackward, rules_of(Scoring::kDotProduct), dims, valid_lens, options);
  check_saved(kSdpaBackward, dims, saved, d_output);
  if (d_lse.data() != nullptr) detail::check_shape(kSdpaBackward, "d_lse", d_lse, lse_shape(dims));
  DotProductGrads<T> grads;
  const kernels::SdpaGradViews<T> out = gradient_views(q, k, v, dims, options, grads);
  if (version == Version::kFast) {
    const KernelOperand<T> qk(q), kk(k), vk(v), ok(saved.output), gk(d_output);
    const detail::Contiguous<T> lc(saved.lse), dlc(d_lse), sc(saved.softmax_stats);
    fast_sdpa_backward(
        qk.view(), kk.view(), vk.view(), config,
        {ok.view(), lc.view(), optional_view(dlc, d_lse), optional_view(sc, saved.softmax_stats)},
        gk.view(), out);
    return grads;
  }
  kernels::ref::sdpa_backward(kernels::as_heads(q), kernels::as_heads(k), kernels::as_heads(v),
                              config, {kernels::as_heads(saved.output), saved.lse, d_lse},
                              kernels::as_heads(d_output), out);
  return grads;
}

// bf16 inputs: the same checks, float results. The forward reads bf16 in
// every case: with the BF16 instructions in their products, without them
// widened in registers (few queries) or tile by tile (kernels/attention/sdpa_fast.cc).
// The backward without the BF16 instructions (or at a SIMD cap below
// avx512) runs the float kernel on float copies of the inputs (widening is
// exact: results within the bf16 path's bounds, docs/semantics.md): its
// packed bf16 products would widen every block for every product.
bool bf16_backward_through_float() { return !kernels::fast::bf16_native(); }

Tensor<float> widened(ConstView<bfloat16> x) {
  const detail::Contiguous<bfloat16> xc(x);
  Tensor<float> out(x.shape());
  kernels::fast::to_float(xc.data(), out.data(), out.numel());
  return out;
}

AttentionResult<float> sdpa_forward_bf16(ConstView<bfloat16> q, ConstView<bfloat16> k,
                                         ConstView<bfloat16> v, const ValidLens& valid_lens,
                                         const AttentionOptions& options) {
  const Dims dims = check_inputs(kSdpa, rules_of(Scoring::kDotProduct), q, k, v, valid_lens);
  const kernels::AttentionConfig config =
      attention_config<float>(kSdpa, rules_of(Scoring::kDotProduct), dims, valid_lens, options);
  AttentionResult<float> result;
  kernels::ForwardViews<float> out =
      destinations<float>(kSdpa, Version::kFast, dims, options, nullptr, result,
                          /*strided_output=*/false, /*stats=*/true);
  out.output = kernels::as_heads(out.output);
  const KernelOperand<bfloat16> qk(q), kk(k), vk(v);
  fast_sdpa(qk.view(), kk.view(), vk.view(), config, out);
  return result;
}

DotProductGrads<float> sdpa_backward_bf16(ConstView<bfloat16> q, ConstView<bfloat16> k,
                                          ConstView<bfloat16> v, const ValidLens& valid_lens,
                                          const AttentionOptions& options,
                                          const SavedForward<float>& saved,
                                          ConstView<float> d_output, ConstView<float> d_lse) {
  const Dims dims =
      check_inputs(kSdpaBackward, rules_of(Scoring::kDotProduct), q, k, v, valid_lens);
  const kernels::AttentionConfig config = attention_config<float>(
      kSdpaBackward, rules_of(Scoring::kDotProduct), dims, valid_lens, options);
  check_saved(kSdpaBackward, dims, saved, d_output);
  if (bf16_backward_through_float()) {
    const Tensor<float> qf = widened(q), kf = widened(k), vf = widened(v);
    return sdpa_backward<float>(Version::kFast, qf, kf, vf, valid_lens, options, saved, d_output,
                                d_lse);
  }
  if (d_lse.data() != nullptr) detail::check_shape(kSdpaBackward, "d_lse", d_lse, lse_shape(dims));
  DotProductGrads<float> grads;
  const kernels::SdpaGradViews<float> out = gradient_views(q, k, v, dims, options, grads);
  const KernelOperand<bfloat16> qk(q), kk(k), vk(v);
  const KernelOperand<float> ok(saved.output), gk(d_output);
  const detail::Contiguous<float> lc(saved.lse), dlc(d_lse), sc(saved.softmax_stats);
  fast_sdpa_backward<bfloat16, float>(
      qk.view(), kk.view(), vk.view(), config,
      {ok.view(), lc.view(), optional_view(dlc, d_lse), optional_view(sc, saved.softmax_stats)},
      gk.view(), out);
  return grads;
}

}  // namespace
}  // namespace detail

// ---- the public overloads: each picks a version and an element type ----------

using detail::sdpa_backward;
using detail::sdpa_backward_bf16;
using detail::sdpa_forward;
using detail::sdpa_forward_bf16;
using detail::Version;

AttentionResult<float> scaled_dot_product_attention(ConstView<float> q, ConstView<float> k,
                                                    ConstView<float> v, const ValidLens& lens,
                                                    const AttentionOptions& options) {
  return sdpa_forward(Version::kFast, q, k, v, lens, options);
}
AttentionResult<double> scaled_dot_product_attention(ConstView<double> q, ConstView<double> k,
                                                     ConstView<double> v, const ValidLens& lens,
                                                     const AttentionOptions& options) {
  return sdpa_forward(Version::kFast, q, k, v, lens, options);
}
AttentionResult<float> scaled_dot_product_attention(ConstView<bfloat16> q, ConstView<bfloat16> k,
                                                    ConstView<bfloat16> v, const ValidLens& lens,
                                                    const AttentionOptions& options) {
  return sdpa_forward_bf16(q, k, v, lens, options);
}
void scaled_dot_product_attention(ConstView<float> q, ConstView<float> k, ConstView<float> v,
                                  const ValidLens& lens, const AttentionOptions& options,
                                  const AttentionOutputs<float>& outputs) {
  sdpa_forward(Version::kFast, q, k, v, lens, options, &outputs);
}
void scaled_dot_product_attention(ConstView<double> q, ConstView<double> k, ConstView<double> v,
                                  const ValidLens& lens, const AttentionOptions& options,
                                  const AttentionOutputs<double>& outputs) {
  sdpa_forward(Version::kFast, q, k, v, lens, options, &outputs);
}

DotProductGrads<float> scaled_dot_product_attention_backward(
    ConstView<float> q, ConstView<float> k, ConstView<float> v, const ValidLens& lens,
    const AttentionOptions& options, const SavedForward<float>& saved, ConstView<float> d_output,
    ConstView<float> d_lse) {
  return sdpa_backward(Version::kFast, q, k, v, lens, options, saved, d_output, d_lse);
}
DotProductGrads<double> scaled_dot_product_attention_backward(
    ConstView<double> q, ConstView<double> k, ConstView<double> v, const ValidLens& lens,
    const AttentionOptions& options, const SavedForward<double>& saved, ConstView<double> d_output,
    ConstView<double> d_lse) {
  return sdpa_backward(Version::kFast, q, k, v, lens, options, saved, d_output, d_lse);
}
DotProductGrads<float> scaled_dot_product_attention_backward(
    ConstView<bfloat16> q, ConstView<bfloat16> k, ConstView<bfloat16> v, const ValidLens& lens,
    const AttentionOptions& options, const SavedForward<float>& saved, ConstView<float> d_output,
    ConstView<float> d_lse) {
  return sdpa_backward_bf16(q, k, v, lens, options, saved, d_output, d_lse);
}

namespace ref {

AttentionResult<float> scaled_dot_product_attention(ConstView<float> q, ConstView<float> k,
                                                    ConstView<float> v, const ValidLens& lens,
                                                    const AttentionOptions& options) {
  return sdpa_forward(Version::kRef, q, k, v, lens, options);
}
AttentionResult<double> scaled_dot_product_attention(ConstView<double> q, ConstView<double> k,
                                                     ConstView<double> v, const ValidLens& lens,
                                                     const AttentionOptions& options) {
  return sdpa_forward(Version::kRef, q, k, v, lens, options);
}
DotProductGrads<float> scaled_dot_product_attention_backward(
    ConstView<float> q, ConstView<float> k, ConstView<float> v, const ValidLens& lens,
    const AttentionOptions& options, const SavedForward<float>& saved, ConstView<float> d_output,
    ConstView<float> d_lse) {
  return sdpa_backward(Version::kRef, q, k, v, lens, options, saved, d_output, d_lse);
}
DotProductGrads<double> scaled_dot_product_attention_backward(
    ConstView<double> q, ConstView<double> k, ConstView<double> v, const ValidLens& lens,
    const AttentionOptions& options, const SavedForward<double>& saved, ConstView<double> d_output,
    ConstView<double> d_lse) {
  return sdpa_backward(Version::kRef, q, k, v, lens, options, saved, d_output, d_lse);
}

}  // namespace ref
}  // namespace qkv
