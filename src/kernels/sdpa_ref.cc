// Scaled dot-product attention, reference version: every score, weight and
// gradient formed explicitly in double with plain loops, any strides. Slow
// and obviously right; the fast kernel (sdpa_fast.cc) is tested against it.
#include "kernels/attend_ref.h"
#include "kernels/kernels.h"

namespace qkv::kernels::ref {
namespace {

template <class T>
Matrix dot_product_scores(ConstView<T> q, ConstView<T> k, double scale) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), d = q.size(2);
  Matrix scores(batch * nq * nk);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        double s = 0.0;
        for (int64_t c = 0; c < d; ++c) s += static_cast<double>(q(b, i, c)) * k(b, j, c);
        scores[(b * nq + i) * nk + j] = s * scale;
      }
    }
  }
  return scores;
}

}  // namespace

// q: (B, Nq, D)   k: (B, Nk, D)   v: (B, Nk, Dv)  ->  out (B, Nq, Dv), weights, lse
template <class T>
void sdpa(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AttentionConfig& config,
          const ForwardViews<T>& out) {
  attend(dot_product_scores(q, k, config.scale), q.size(0), q.size(1), k.size(1), v, config, out);
}

// Gradients dQ (B, Nq, D), dK (B, Nk, D), dV (B, Nk, Dv); saved is not read.
template <class T>
void sdpa_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AttentionConfig& config,
                   const SavedViews<T>&, ConstView<T> d_output, const SdpaGradViews<T>& grads) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), d = q.size(2);
  const Matrix ds = attend_backward(dot_product_scores(q, k, config.scale), batch, nq, nk, v,
                                    config, d_output, grads.d_values);
  Matrix dq(batch * nq * d, 0.0), dk(batch * nk * d, 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        const double g = ds[(b * nq + i) * nk + j] * config.scale;
        if (g == 0.0) continue;
        for (int64_t c = 0; c < d; ++c) {
          dq[(b * nq + i) * d + c] += g * static_cast<double>(k(b, j, c));
          dk[(b * nk + j) * d + c] += g * static_cast<double>(q(b, i, c));
        }
      }
    }
  }
  store(dq, grads.d_queries);
  store(dk, grads.d_keys);
}

template void sdpa<float>(ConstView<float>, ConstView<float>, ConstView<float>,
                          const AttentionConfig&, const ForwardViews<float>&);
template void sdpa<double>(ConstView<double>, ConstView<double>, ConstView<double>,
                           const AttentionConfig&, const ForwardViews<double>&);
template void sdpa_backward<float>(ConstView<float>, ConstView<float>, ConstView<float>,
                                   const AttentionConfig&, const SavedViews<float>&,
                                   ConstView<float>, const SdpaGradViews<float>&);
template void sdpa_backward<double>(ConstView<double>, ConstView<double>, ConstView<double>,
                                    const AttentionConfig&, const SavedViews<double>&,
                                    ConstView<double>, const SdpaGradViews<double>&);

}  // namespace qkv::kernels::ref
