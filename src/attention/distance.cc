// Distance attention's front end (qkv/attention.h): the pipeline
// (attention/pipeline.h), then kernels/attention/distance_fast.cc or the
// reference (distance_ref.cc).
#include "attention/pipeline.h"

namespace qkv {
namespace detail {
namespace {

constexpr std::string_view kDistance = "distance_attention";
constexpr std::string_view kDistanceBackward = "distance_attention_backward";

template <class T>
AttentionResult<T> distance_forward(Version version, ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                    const ValidLens& valid_lens, const AttentionOptions& options,
                                    const AttentionOutputs<T>* given = nullptr) {
  const Dims dims = check_inputs(kDistance, rules_of(Scoring::kDistance), q, k, v, valid_lens);
  const kernels::AttentionConfig config =
      attention_config<T>(kDistance, rules_of(Scoring::kDistance), dims, valid_lens, options);
  AttentionResult<T> result;
  const kernels::ForwardViews<T> out =
      destinations(kDistance, version, dims, options, given, result);
  if (version == Version::kRef) {
    kernels::ref::distance(q, k, v, config, out);
    return result;
  }
  const detail::Contiguous<T> qc(q), kc(k), vc(v);
  with_workspace(
      pair_flops(qc.view(), kc.view(), 2.0 * static_cast<double>(dims.dq + dims.dv)),
      [&](int threads) {
        return kernels::fast::distance_workspace_size(qc.view(), kc.view(), vc.view(), config, out,
                                                      threads);
      },
      [&](kernels::Workspace ws) {
        kernels::fast::distance(qc.view(), kc.view(), vc.view(), config, out, ws);
      });
  return result;
}

template <class T>
DotProductGrads<T> distance_backward(Version version, ConstView<T> q, ConstView<T> k,
                                     ConstView<T> v, const ValidLens& valid_lens,
                                     const AttentionOptions& options, const SavedForward<T>& saved,
                                     ConstView<T> d_output) {
  const Dims dims =
      check_inputs(kDistanceBackward, rules_of(Scoring::kDistance), q, k, v, valid_lens);
  const kernels::AttentionConfig config = attention_config<T>(
      kDistanceBackward, rules_of(Scoring::kDistance), dims, valid_lens, options);
  check_saved(kDistanceBackward, dims, saved, d_output);
  DotProductGrads<T> grads{Tensor<T>(q.shape()), Tensor<T>(k.shape()), Tensor<T>(v.shape()), {}};
  const kernels::SdpaGradViews<T> out{grads.d_queries.view(), grads.d_keys.view(),
                                      grads.d_values.view()};
  if (version == Version::kRef) {
    kernels::ref::distance_backward(q, k, v, config, {saved.output, saved.lse}, d_output, out);
    return grads;
  }
  const detail::Contiguous<T> qc(q), kc(k), vc(v), oc(saved.output), lc(saved.lse), gc(d_output);
  const kernels::SavedViews<T> fast_saved{oc.view(), lc.view()};
  with_workspace(
      pair_flops(qc.view(), kc.view(), 5.0 * static_cast<double>(dims.dq + dims.dv)),
      [&](int threads) {
        return kernels::fast::distance_backward_workspace_size(
            qc.view(), kc.view(), vc.view(), config, fast_saved, gc.view(), out, threads);
      },
      [&](kernels::Workspace ws) {
        kernels::fast::distance_backward(qc.view(), kc.view(), vc.view(), config, fast_saved,
                                         gc.view(), out, ws);
      });
  return grads;
}

}  // namespace
}  // namespace detail

// ---- the public overloads: each picks a version and an element type ----------

using detail::distance_backward;
using detail::distance_forward;
using detail::Version;

AttentionResult<float> distance_attention(ConstView<float> q, ConstView<float> k,
                                          ConstView<float> v, const ValidLens& lens,
                                          const AttentionOptions& options) {
  return distance_forward(Version::kFast, q, k, v, lens, options);
}
AttentionResult<double> distance_attention(ConstView<double> q, ConstView<double> k,
                                           ConstView<double> v, const ValidLens& lens,
                                           const AttentionOptions& options) {
  return distance_forward(Version::kFast, q, k, v, lens, options);
}
void distance_attention(ConstView<float> q, ConstView<float> k, ConstView<float> v,
                        const ValidLens& lens, const AttentionOptions& options,
                        const AttentionOutputs<float>& outputs) {
  distance_forward(Version::kFast, q, k, v, lens, options, &outputs);
}
void distance_attention(ConstView<double> q, ConstView<double> k, ConstView<double> v,
                        const ValidLens& lens, const AttentionOptions& options,
                        const AttentionOutputs<double>& outputs) {
  distance_forward(Version::kFast, q, k, v, lens, options, &outputs);
}
DotProductGrads<float> distance_attention_backward(ConstView<float> q, ConstView<float> k,
                                                   ConstView<float> v, const ValidLens& lens,
                                                   const AttentionOptions& options,
                                                   const SavedForward<float>& saved,
                                                   ConstView<float> d_output) {
  return distance_backward(Version::kFast, q, k, v, lens, options, saved, d_output);
}
DotProductGrads<double> distance_attention_backward(ConstView<double> q, ConstView<double> k,
                                                    ConstView<double> v, const ValidLens& lens,
                                                    const AttentionOptions& options,
                                                    const SavedForward<double>& saved,
                                                    ConstView<double> d_output) {
  return distance_backward(Version::kFast, q, k, v, lens, options, saved, d_output);
}

namespace ref {

AttentionResult<float> distance_attention(ConstView<float> q, ConstView<float> k,
                                          ConstView<float> v, const ValidLens& lens,
                                          const AttentionOptions& options) {
  return distance_forward(Version::kRef, q, k, v, lens, options);
}
AttentionResult<double> distance_attention(ConstView<double> q, ConstView<double> k,
                                           ConstView<double> v, const ValidLens& lens,
                                           const AttentionOptions& options) {
  return distance_forward(Version::kRef, q, k, v, lens, options);
}
DotProductGrads<float> distance_attention_backward(ConstView<float> q, ConstView<float> k,
                                                   ConstView<float> v, const ValidLens& lens,
                                                   const AttentionOptions& options,
                                                   const SavedForward<float>& saved,
                                                   ConstView<float> d_output) {
  return distance_backward(Version::kRef, q, k, v, lens, options, saved, d_output);
}
DotProductGrads<double> distance_attention_backward(ConstView<double> q, ConstView<double> k,
                                                    ConstView<double> v, const ValidLens& lens,
                                                    const AttentionOptions& options,
                                                    const SavedForward<double>& saved,
                                                    ConstView<double> d_output) {
  return distance_backward(Version::kRef, q, k, v, lens, options, saved, d_output);
}

}  // namespace ref
}  // namespace qkv
