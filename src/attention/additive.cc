// Additive attention's front end (qkv/attention.h): the pipeline
// (attention/pipeline.h), then kernels/attention/additive_fast.cc or the
// reference (additive_ref.cc).
#include "attention/pipeline.h"

namespace qkv {
namespace detail {
namespace {

constexpr std::string_view kAdditive = "additive_attention";
constexpr std::string_view kAdditiveBackward = "additive_attention_backward";

// w_q (H, Dq), w_k (H, Dk), w_v (H) or (1, H); the kernels get w_v as (H).
template <class T>
kernels::AdditiveParams<T> check_weights(std::string_view fn, const Dims& dims,
                                         const AdditiveWeights<T>& weights) {
  const ConstView<T>& w_q = weights.w_q;
  const ConstView<T>& w_k = weights.w_k;
  const ConstView<T>& w_v = weights.w_v;
  detail::check_rank(fn, "w_q", w_q, 2, "(H, Dq)");
  detail::check_rank(fn, "w_k", w_k, 2, "(H, Dk)");
  const int64_t hidden = w_q.size(0);
  if (w_q.size(1) != dims.dq) {
    fail(fn, "w_q has shape " + w_q.shape().str() + " but queries has Dq = " +
                 std::to_string(dims.dq) + "; expected " + Shape{hidden, dims.dq}.str());
  }
  if (w_k.size(0) != hidden || w_k.size(1) != dims.dk) {
    fail(fn, "w_k has shape " + w_k.shape().str() + " but w_q has shape " + w_q.shape().str() +
                 " and keys has Dk = " + std::to_string(dims.dk) + "; expected " +
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

template <class T>
AttentionResult<T> additive_forward(Version version, ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                    const AdditiveWeights<T>& weights, const ValidLens& valid_lens,
                                    const AttentionOptions& options,
                                    const AttentionOutputs<T>* given = nullptr) {
  const Dims dims = check_inputs(kAdditive, rules_of(Scoring::kAdditive), q, k, v, valid_lens);
  const kernels::AdditiveParams<T> params = check_weights(kAdditive, dims, weights);
  const kernels::AttentionConfig config =
      attention_config<T>(kAdditive, rules_of(Scoring::kAdditive), dims, valid_lens, options);
  AttentionResult<T> result;
  const kernels::ForwardViews<T> out =
      destinations(kAdditive, version, dims, options, given, result);
  if (version == Version::kFast) {
    const detail::Contiguous<T> qc(q), kc(k), vc(v);
    if (kernels::fast::supports(qc.view(), kc.view(), vc.view())) {
      const detail::Contiguous<T> wqc(params.w_q), wkc(params.w_k), wvc(params.w_v);
      const kernels::AdditiveParams<T> fast_params{wqc.view(), wkc.view(), wvc.view()};
      with_workspace(
          pair_flops(qc.view(), kc.view(), 4.0 * static_cast<double>(params.w_q.size(0) + dims.dv)),
          [&](int threads) {
            return kernels::fast::additive_workspace_size(qc.view(), kc.view(), vc.view(),
                                                          fast_params, config, out, threads);
          },
          [&](kernels::Workspace ws) {
            kernels::fast::additive(qc.view(), kc.view(), vc.view(), fast_params, config, out, ws);
          });
      return result;
    }
  }
  kernels::ref::additive(q, k, v, params, config, out);
  return result;
}

template <class T>
AdditiveGrads<T> additive_backward(Version version, ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                   const AdditiveWeights<T>& weights, const ValidLens& valid_lens,
                                   const AttentionOptions& options, const SavedForward<T>& saved,
                                   ConstView<T> d_output) {
  const Dims dims =
      check_inputs(kAdditiveBackward, rules_of(Scoring::kAdditive), q, k, v, valid_lens);
  const kernels::AdditiveParams<T> params = check_weights(kAdditiveBackward, dims, weights);
  const kernels::AttentionConfig config = attention_config<T>(
      kAdditiveBackward, rules_of(Scoring::kAdditive), dims, valid_lens, options);
  check_saved(kAdditiveBackward, dims, saved, d_output);
  const int64_t hidden = params.w_q.size(0);
  AdditiveGrads<T> grads{Tensor<T>(q.shape()),           Tensor<T>(k.shape()),
                         Tensor<T>(v.shape()),           Tensor<T>(weights.w_q.shape()),
                         Tensor<T>(weights.w_k.shape()), Tensor<T>(Shape{hidden})};
  const kernels::AdditiveGradViews<T> out{grads.d_queries.view(), grads.d_keys.view(),
                                          grads.d_values.view(),  grads.d_w_q.view(),
                                          grads.d_w_k.view(),     grads.d_w_v.view()};
  bool done = false;
  if (version == Version::kFast) {
    const detail::Contiguous<T> qc(q), kc(k), vc(v);
    if (kernels::fast::supports(qc.view(), kc.view(), vc.view())) {
      const detail::Contiguous<T> wqc(params.w_q), wkc(params.w_k), wvc(params.w_v);
      const detail::Contiguous<T> oc(saved.output), lc(saved.lse), gc(d_output);
      const kernels::AdditiveParams<T> fast_params{wqc.view(), wkc.view(), wvc.view()};
      const kernels::SavedViews<T> fast_saved{oc.view(), lc.view()};
      with_workspace(
          pair_flops(qc.view(), kc.view(), 8.0 * static_cast<double>(hidden + dims.dv)),
          [&](int threads) {
            return kernels::fast::additive_backward_workspace_size(qc.view(), kc.view(), vc.view(),
                                                                   fast_params, config, fast_saved,
                                                                   gc.view(), out, threads);
          },
          [&](kernels::Workspace ws) {
            kernels::fast::additive_backward(qc.view(), kc.view(), vc.view(), fast_params, config,
                                             fast_saved, gc.view(), out, ws);
          });
      done = true;
    }
  }
  if (!done) {
    kernels::ref::additive_backward(q, k, v, params, config, {saved.output, saved.lse}, d_output,
                                    out);
  }
  grads.d_w_v = std::move(grads.d_w_v).reshaped(weights.w_v.shape());
  return grads;
}

}  // namespace
}  // namespace detail

// ---- the public overloads: each picks a version and an element type ----------

using detail::additive_backward;
using detail::additive_forward;
using detail::Version;

AttentionResult<float> additive_attention(ConstView<float> q, ConstView<float> k,
                                          ConstView<float> v, const AdditiveWeights<float>& w,
                                          const ValidLens& lens, const AttentionOptions& options) {
  return additive_forward(Version::kFast, q, k, v, w, lens, options);
}
AttentionResult<double> additive_attention(ConstView<double> q, ConstView<double> k,
                                           ConstView<double> v, const AdditiveWeights<double>& w,
                                           const ValidLens& lens, const AttentionOptions& options) {
  return additive_forward(Version::kFast, q, k, v, w, lens, options);
}
void additive_attention(ConstView<float> q, ConstView<float> k, ConstView<float> v,
                        const AdditiveWeights<float>& w, const ValidLens& lens,
                        const AttentionOptions& options, const AttentionOutputs<float>& outputs) {
  additive_forward(Version::kFast, q, k, v, w, lens, options, &outputs);
}
void additive_attention(ConstView<double> q, ConstView<double> k, ConstView<double> v,
                        const AdditiveWeights<double>& w, const ValidLens& lens,
                        const AttentionOptions& options, const AttentionOutputs<double>& outputs) {
  additive_forward(Version::kFast, q, k, v, w, lens, options, &outputs);
}

AdditiveGrads<float> additive_attention_backward(
    ConstView<float> q, ConstView<float> k, ConstView<float> v, const AdditiveWeights<float>& w,
    const ValidLens& lens, const AttentionOptions& options, const SavedForward<float>& saved,
    ConstView<float> d_output) {
  return additive_backward(Version::kFast, q, k, v, w, lens, options, saved, d_output);
}
AdditiveGrads<double> additive_attention_backward(
    ConstView<double> q, ConstView<double> k, ConstView<double> v, const AdditiveWeights<double>& w,
    const ValidLens& lens, const AttentionOptions& options, const SavedForward<double>& saved,
    ConstView<double> d_output) {
  return additive_backward(Version::kFast, q, k, v, w, lens, options, saved, d_output);
}

namespace ref {

AttentionResult<float> additive_attention(ConstView<float> q, ConstView<float> k,
                                          ConstView<float> v, const AdditiveWeights<float>& w,
                                          const ValidLens& lens, const AttentionOptions& options) {
  return additive_forward(Version::kRef, q, k, v, w, lens, options);
}
AttentionResult<double> additive_attention(ConstView<double> q, ConstView<double> k,
                                           ConstView<double> v, const AdditiveWeights<double>& w,
                                           const ValidLens& lens, const AttentionOptions& options) {
  return additive_forward(Version::kRef, q, k, v, w, lens, options);
}
AdditiveGrads<float> additive_attention_backward(
    ConstView<float> q, ConstView<float> k, ConstView<float> v, const AdditiveWeights<float>& w,
    const ValidLens& lens, const AttentionOptions& options, const SavedForward<float>& saved,
    ConstView<float> d_output) {
  return additive_backward(Version::kRef, q, k, v, w, lens, options, saved, d_output);
}
AdditiveGrads<double> additive_attention_backward(
    ConstView<double> q, ConstView<double> k, ConstView<double> v, const AdditiveWeights<double>& w,
    const ValidLens& lens, const AttentionOptions& options, const SavedForward<double>& saved,
    ConstView<double> d_output) {
  return additive_backward(Version::kRef, q, k, v, w, lens, options, saved, d_output);
}

}  // namespace ref
}  // namespace qkv
