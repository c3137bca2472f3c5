// Distance attention, reference version: every score -scale/2 |q_i - k_j|^2
// formed in double from the differences themselves (never from |q|^2 + |k|^2
// - 2 q.k), plain loops, any strides; attend_ref.h does the softmax, dropout,
// pooling and their backward. The fast path (centred dot products with a
// bias per key through the fused kernel: distance_fast.cc) is tested against it.
#include "kernels/attention/attend_ref.h"
#include "kernels/kernels.h"

namespace qkv::kernels::ref {
namespace {

template <class T>
Matrix distance_scores(ConstView<T> q, ConstView<T> k, double scale) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), d = q.size(2);
  Matrix s(batch * nq * nk);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        double norm = 0.0;
        for (int64_t c = 0; c < d; ++c) {
          const double x = static_cast<double>(q(b, i, c)) - static_cast<double>(k(b, j, c));
          norm += x * x;
        }
        s[(b * nq + i) * nk + j] = -0.5 * scale * norm;
      }
    }
  }
  return s;
}

}  // namespace

// q: (B, Nq, D)   k: (B, Nk, D)   v: (B, Nk, Dv)   -> out (B, Nq, Dv), weights, lse
template <class T>
void distance(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AttentionConfig& config,
              const ForwardViews<T>& out) {
  attend(distance_scores(q, k, config.scale), q.size(0), q.size(1), k.size(1), v, config, out);
}

// d score / d q_i = -scale (q_i - k_j) = -d score / d k_j. saved is not read.
template <class T>
void distance_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                       const AttentionConfig& config, const SavedViews<T>&, ConstView<T> d_output,
                       const SdpaGradViews<T>& grads) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), d = q.size(2);
  const Matrix ds = attend_backward(distance_scores(q, k, config.scale), batch, nq, nk, v, config,
                                    d_output, grads.d_values);
  Matrix dq_acc(batch * nq * d, 0.0), dk_acc(batch * nk * d, 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        const double g = ds[(b * nq + i) * nk + j];
        if (g == 0.0) continue;  // e.g. a masked key: never read
        for (int64_t c = 0; c < d; ++c) {
          const double x = -config.scale * g *
                           (static_cast<double>(q(b, i, c)) - static_cast<double>(k(b, j, c)));
          dq_acc[(b * nq + i) * d + c] += x;
          dk_acc[(b * nk + j) * d + c] -= x;
        }
      }
    }
  }
  store(dq_acc, grads.d_queries);
  store(dk_acc, grads.d_keys);
}

template void distance<float>(ConstView<float>, ConstView<float>, ConstView<float>,
                              const AttentionConfig&, const ForwardViews<float>&);
template void distance<double>(ConstView<double>, ConstView<double>, ConstView<double>,
                               const AttentionConfig&, const ForwardViews<double>&);
template void distance_backward<float>(ConstView<float>, ConstView<float>, ConstView<float>,
                                       const AttentionConfig&, const SavedViews<float>&,
                                       ConstView<float>, const SdpaGradViews<float>&);
template void distance_backward<double>(ConstView<double>, ConstView<double>, ConstView<double>,
                                        const AttentionConfig&, const SavedViews<double>&,
                                        ConstView<double>, const SdpaGradViews<double>&);

}  // namespace qkv::kernels::ref
