// Bilinear attention, fast version: the scores q W k are the dot products of
// q W (B, Nq, Dk) with the keys, so one matrix product and then the fused
// dot-product kernel at scale 1 (no (B, Nq, Nk) buffer). The backward runs
// the dot-product backward on q W, then dQ = d(q W) Wᵀ and
// dW = sum_b Q_bᵀ d(q W)_b, each one product. q W and d(q W) live in the
// workspace ahead of the dot-product kernel's own scratch. Tested against
// bilinear_ref.cc (tests/test_bilinear.cc).
#include "kernels/kernels.h"
#include "kernels/runtime/blas.h"

namespace qkv::kernels::fast {
namespace {

// A (B, N, D) view of `data` as the SDPA kernels take it, (B, 1, N, D).
template <class T>
ConstView<T> heads_of(const T* data, int64_t batch, int64_t n, int64_t d) {
  return as_heads(ConstView<T>(data, Shape{batch, n, d}));
}

// The workspace's layout: q W (and d(q W) for the backward) first, then the
// dot-product kernel's scratch.
template <class T>
struct Layout {
  T* qw = nullptr;
  T* d_qw = nullptr;
  Layout(Slicer& slicer, int64_t rows, int64_t dk, bool backward) {
    qw = slicer.take<T>(rows * dk);
    if (backward) d_qw = slicer.take<T>(rows * dk);
  }
};

template <class T>
size_t layout_words(int64_t rows, int64_t dk, bool backward) {
  return counted_words([&](Slicer& s) { Layout<T>(s, rows, dk, backward); });
}

// q W into qw: one product over all B * Nq rows in fixed row blocks (bits
// independent of the thread count).
template <class T>
void queries_times_w(ConstView<T> q, ConstView<T> w, T* qw) {
  const int64_t dq = w.size(0), dk = w.size(1);
  parallel_gemm(false, false, q.size(0) * q.size(1), dk, dq, T(1), q.data(), dq, w.data(), dk, T(0),
                qw, dk);
}

template <class T>
ForwardViews<T> forward_heads(const ForwardViews<T>& out) {
  return {as_heads(out.output), out.weights, out.lse};
}

}  // namespace

template <class T>
size_t bilinear_workspace_size(ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w,
                               const AttentionConfig& config, const ForwardViews<T>& out,
                               int num_threads) {
  const int64_t batch = q.size(0), nq = q.size(1), dk = w.size(1);
  return layout_words<T>(batch * nq, dk, false) +
         sdpa_workspace_size(heads_of<T>(nullptr, batch, nq, dk), as_heads(k), as_heads(v), config,
                             forward_heads(out), num_threads);
}

template <class T>
void bilinear(ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w,
              const AttentionConfig& config, const ForwardViews<T>& out, Workspace workspace) {
  const int64_t batch = q.size(0), nq = q.size(1), dk = w.size(1);
  Slicer slicer(workspace.data);
  const Layout<T> layout(slicer, batch * nq, dk, false);
  queries_times_w(q, w, layout.qw);
  sdpa(heads_of<T>(layout.qw, batch, nq, dk), as_heads(k), as_heads(v), config, forward_heads(out),
       Workspace{workspace.data + slicer.words(), workspace.num_threads});
}

template <class T>
size_t bilinear_backward_workspace_size(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                        ConstView<T> w, const AttentionConfig& config,
                                        const SavedViews<T>& saved, ConstView<T> d_output,
                                        const BilinearGradViews<T>& grads, int num_threads) {
  const int64_t batch = q.size(0), nq = q.size(1), dk = w.size(1);
  const ConstView<T> qw = heads_of<T>(nullptr, batch, nq, dk);
  const SdpaGradViews<T> sdpa_grads{as_heads(TensorView<T>(nullptr, qw.shape())),
                                    as_heads(grads.d_keys), as_heads(grads.d_values)};
  return layout_words<T>(batch * nq, dk, true) +
         sdpa_backward_workspace_size(qw, as_heads(k), as_heads(v), config,
                                      {as_heads(saved.output), saved.lse}, as_heads(d_output),
                                      sdpa_grads, num_threads);
}

template <class T>
void bilinear_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w,
                       const AttentionConfig& config, const SavedViews<T>& saved,
                       ConstView<T> d_output, const BilinearGradViews<T>& grads,
                       Workspace workspace) {
  const int64_t batch = q.size(0), nq = q.size(1), dq = w.size(0), dk = w.size(1);
  const int64_t rows = batch * nq;
  Slicer slicer(workspace.data);
  const Layout<T> layout(slicer, rows, dk, true);
  queries_times_w(q, w, layout.qw);
  const SdpaGradViews<T> sdpa_grads{as_heads(TensorView<T>(layout.d_qw, Shape{batch, nq, dk})),
                                    as_heads(grads.d_keys), as_heads(grads.d_values)};
  sdpa_backward(heads_of<T>(layout.qw, batch, nq, dk), as_heads(k), as_heads(v), config,
                {as_heads(saved.output), saved.lse}, as_heads(d_output), sdpa_grads,
                Workspace{workspace.data + slicer.words(), workspace.num_threads});
  parallel_gemm(false, true, rows, dq, dk, T(1), layout.d_qw, dk, w.data(), dk, T(0),
                grads.d_queries.data(), dq);
  gemm(true, false, dq, dk, rows, T(1), q.data(), dq, layout.d_qw, dk, T(0), grads.d_w.data(), dk);
}

#define QKV_INSTANTIATE_BILINEAR(T)                                                               \
  template size_t bilinear_workspace_size(ConstView<T>, ConstView<T>, ConstView<T>, ConstView<T>, \
                                          const AttentionConfig&, const ForwardViews<T>&, int);   \
  template void bilinear(ConstView<T>, ConstView<T>, ConstView<T>, ConstView<T>,                  \
                         const AttentionConfig&, const ForwardViews<T>&, Workspace);              \
  template size_t bilinear_backward_workspace_size(                                               \
      ConstView<T>, ConstView<T>, ConstView<T>, ConstView<T>, const AttentionConfig&,             \
      const SavedViews<T>&, ConstView<T>, const BilinearGradViews<T>&, int);                      \
  template void bilinear_backward(ConstView<T>, ConstView<T>, ConstView<T>, ConstView<T>,         \
                                  const AttentionConfig&, const SavedViews<T>&, ConstView<T>,     \
                                  const BilinearGradViews<T>&, Workspace);
QKV_INSTANTIATE_BILINEAR(float)
QKV_INSTANTIATE_BILINEAR(double)
#undef QKV_INSTANTIATE_BILINEAR

}  // namespace qkv::kernels::fast
