// Bilinear attention's front end (qkv/attention.h): the pipeline
// (attention/pipeline.h), then kernels/attention/bilinear_fast.cc or the
// reference (bilinear_ref.cc).
#include "attention/pipeline.h"

namespace qkv {
namespace detail {
namespace {

constexpr std::string_view kBilinear = "bilinear_attention";
constexpr std::string_view kBilinearBackward = "bilinear_attention_backward";

// w (Dq, Dk).
template <class T>
void check_bilinear_w(std::string_view fn, const Dims& dims, ConstView<T> w) {
  detail::check_rank(fn, "w", w, 2, "(Dq, Dk)");
  if (w.size(0) != dims.dq || w.size(1) != dims.dk) {
    fail(fn, "w has shape " + w.shape().str() + " but queries has Dq = " + std::to_string(dims.dq) +
                 " and keys has Dk = " + std::to_string(dims.dk) + "; expected " +
                 Shape{dims.dq, dims.dk}.str());
  }
}

template <class T>
AttentionResult<T> bilinear_forward(Version version, ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                    ConstView<T> w, const ValidLens& valid_lens,
                                    const AttentionOptions& options,
                                    const AttentionOutputs<T>* given = nullptr) {
  const Dims dims = check_inputs(kBilinear, rules_of(Scoring::kBilinear), q, k, v, valid_lens);
  check_bilinear_w(kBilinear, dims, w);
  const kernels::AttentionConfig config =
      attention_config<T>(kBilinear, rules_of(Scoring::kBilinear), dims, valid_lens, options);
  AttentionResult<T> result;
  const kernels::ForwardViews<T> out =
      destinations(kBilinear, version, dims, options, given, result);
  if (version == Version::kRef) {
    kernels::ref::bilinear(q, k, v, w, config, out);
    return result;
  }
  const detail::Contiguous<T> qc(q), kc(k), vc(v), wc(w);
  with_workspace(
      pair_flops(qc.view(), kc.view(), 2.0 * static_cast<double>(dims.dk + dims.dv)),
      [&](int threads) {
        return kernels::fast::bilinear_workspace_size(qc.view(), kc.view(), vc.view(), wc.view(),
                                                      config, out, threads);
      },
      [&](kernels::Workspace ws) {
        kernels::fast::bilinear(qc.view(), kc.view(), vc.view(), wc.view(), config, out, ws);
      });
  return result;
}

template <class T>
BilinearGrads<T> bilinear_backward(Version version, ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                   ConstView<T> w, const ValidLens& valid_lens,
                                   const AttentionOptions& options, const SavedForward<T>& saved,
                                   ConstView<T> d_output) {
  const Dims dims =
      check_inputs(kBilinearBackward, rules_of(Scoring::kBilinear), q, k, v, valid_lens);
  check_bilinear_w(kBilinearBackward, dims, w);
  const kernels::AttentionConfig config = attention_config<T>(
      kBilinearBackward, rules_of(Scoring::kBilinear), dims, valid_lens, options);
  check_saved(kBilinearBackward, dims, saved, d_output);
  BilinearGrads<T> grads{Tensor<T>(q.shape()), Tensor<T>(k.shape()), Tensor<T>(v.shape()),
                         Tensor<T>(w.shape())};
  const kernels::BilinearGradViews<T> out{grads.d_queries.view(), grads.d_keys.view(),
                                          grads.d_values.view(), grads.d_w.view()};
  if (version == Version::kRef) {
    kernels::ref::bilinear_backward(q, k, v, w, config, {saved.output, saved.lse}, d_output, out);
    return grads;
  }
  const detail::Contiguous<T> qc(q), kc(k), vc(v), wc(w), oc(saved.output), lc(saved.lse),
      gc(d_output);
  const kernels::SavedViews<T> fast_saved{oc.view(), lc.view()};
  with_workspace(
      pair_flops(qc.view(), kc.view(), 5.0 * static_cast<double>(dims.dk + dims.dv)),
      [&](int threads) {
        return kernels::fast::bilinear_backward_workspace_size(qc.view(), kc.view(), vc.view(),
                                                               wc.view(), config, fast_saved,
                                                               gc.view(), out, threads);
      },
      [&](kernels::Workspace ws) {
        kernels::fast::bilinear_backward(qc.view(), kc.view(), vc.view(), wc.view(), config,
                                         fast_saved, gc.view(), out, ws);
      });
  return grads;
}

}  // namespace
}  // namespace detail

// ---- the public overloads: each picks a version and an element type ----------

using detail::bilinear_backward;
using detail::bilinear_forward;
using detail::Version;

AttentionResult<float> bilinear_attention(ConstView<float> q, ConstView<float> k,
                                          ConstView<float> v, ConstView<float> w,
                                          const ValidLens& lens, const AttentionOptions& options) {
  return bilinear_forward(Version::kFast, q, k, v, w, lens, options);
}
AttentionResult<double> bilinear_attention(ConstView<double> q, ConstView<double> k,
                                           ConstView<double> v, ConstView<double> w,
                                           const ValidLens& lens, const AttentionOptions& options) {
  return bilinear_forward(Version::kFast, q, k, v, w, lens, options);
}
void bilinear_attention(ConstView<float> q, ConstView<float> k, ConstView<float> v,
                        ConstView<float> w, const ValidLens& lens, const AttentionOptions& options,
                        const AttentionOutputs<float>& outputs) {
  bilinear_forward(Version::kFast, q, k, v, w, lens, options, &outputs);
}
void bilinear_attention(ConstView<double> q, ConstView<double> k, ConstView<double> v,
                        ConstView<double> w, const ValidLens& lens, const AttentionOptions& options,
                        const AttentionOutputs<double>& outputs) {
  bilinear_forward(Version::kFast, q, k, v, w, lens, options, &outputs);
}
BilinearGrads<float> bilinear_attention_backward(ConstView<float> q, ConstView<float> k,
                                                 ConstView<float> v, ConstView<float> w,
                                                 const ValidLens& lens,
                                                 const AttentionOptions& options,
                                                 const SavedForward<float>& saved,
                                                 ConstView<float> d_output) {
  return bilinear_backward(Version::kFast, q, k, v, w, lens, options, saved, d_output);
}
BilinearGrads<double> bilinear_attention_backward(ConstView<double> q, ConstView<double> k,
                                                  ConstView<double> v, ConstView<double> w,
                                                  const ValidLens& lens,
                                                  const AttentionOptions& options,
                                                  const SavedForward<double>& saved,
                                                  ConstView<double> d_output) {
  return bilinear_backward(Version::kFast, q, k, v, w, lens, options, saved, d_output);
}

namespace ref {

AttentionResult<float> bilinear_attention(ConstView<float> q, ConstView<float> k,
                                          ConstView<float> v, ConstView<float> w,
                                          const ValidLens& lens, const AttentionOptions& options) {
  return bilinear_forward(Version::kRef, q, k, v, w, lens, options);
}
AttentionResult<double> bilinear_attention(ConstView<double> q, ConstView<double> k,
                                           ConstView<double> v, ConstView<double> w,
                                           const ValidLens& lens, const AttentionOptions& options) {
  return bilinear_forward(Version::kRef, q, k, v, w, lens, options);
}
BilinearGrads<float> bilinear_attention_backward(ConstView<float> q, ConstView<float> k,
                                                 ConstView<float> v, ConstView<float> w,
                                                 const ValidLens& lens,
                                                 const AttentionOptions& options,
                                                 const SavedForward<float>& saved,
                                                 ConstView<float> d_output) {
  return bilinear_backward(Version::kRef, q, k, v, w, lens, options, saved, d_output);
}
BilinearGrads<double> bilinear_attention_backward(ConstView<double> q, ConstView<double> k,
                                                  ConstView<double> v, ConstView<double> w,
                                                  const ValidLens& lens,
                                                  const AttentionOptions& options,
                                                  const SavedForward<double>& saved,
                                                  ConstView<double> d_output) {
  return bilinear_backward(Version::kRef, q, k, v, w, lens, options, saved, d_output);
}

}  // namespace ref
}  // namespace qkv
