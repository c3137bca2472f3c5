// Bilinear attention, reference version: every score q_i W k_j formed in
// double with plain loops (no q W shortcut), any strides; attend_ref.h does
// the softmax, dropout, pooling and their backward. The fast path (q W, then
// the fused dot-product kernel: bilinear_fast.cc) is tested against it.
#include "kernels/attention/attend_ref.h"
#include "kernels/kernels.h"

namespace qkv::kernels::ref {
namespace {

// scores[b, i, j] = sum_{c, e} q[b, i, c] w[c, e] k[b, j, e]
template <class T>
Matrix bilinear_scores(ConstView<T> q, ConstView<T> k, ConstView<T> w) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), dq = q.size(2), dk = k.size(2);
  Matrix s(batch * nq * nk);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        double acc = 0.0;
        for (int64_t c = 0; c < dq; ++c) {
          for (int64_t e = 0; e < dk; ++e) {
            acc += static_cast<double>(q(b, i, c)) * static_cast<double>(w(c, e)) *
                   static_cast<double>(k(b, j, e));
          }
        }
        s[(b * nq + i) * nk + j] = acc;
      }
    }
  }
  return s;
}

}  // namespace

// q: (B, Nq, Dq)   k: (B, Nk, Dk)   v: (B, Nk, Dv)   w: (Dq, Dk)
// -> out (B, Nq, Dv), weights, lse
template <class T>
void bilinear(ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w,
              const AttentionConfig& config, const ForwardViews<T>& out) {
  attend(bilinear_scores(q, k, w), q.size(0), q.size(1), k.size(1), v, config, out);
}

// d score / d q[b,i,c] = sum_e w[c,e] k[b,j,e]; / d k[b,j,e] = sum_c q[b,i,c] w[c,e];
// / d w[c,e] = q[b,i,c] k[b,j,e]. saved is not read.
template <class T>
void bilinear_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w,
                       const AttentionConfig& config, const SavedViews<T>&, ConstView<T> d_output,
                       const BilinearGradViews<T>& grads) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), dq = q.size(2), dk = k.size(2);
  const Matrix ds =
      attend_backward(bilinear_scores(q, k, w), batch, nq, nk, v, config, d_output, grads.d_values);
  Matrix dq_acc(batch * nq * dq, 0.0), dk_acc(batch * nk * dk, 0.0), dw_acc(dq * dk, 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        const double g = ds[(b * nq + i) * nk + j];
        if (g == 0.0) continue;  // e.g. a masked key: never read
        for (int64_t c = 0; c < dq; ++c) {
          for (int64_t e = 0; e < dk; ++e) {
            const double qc = static_cast<double>(q(b, i, c)), wce = static_cast<double>(w(c, e)),
                         ke = static_cast<double>(k(b, j, e));
            dq_acc[(b * nq + i) * dq + c] += g * wce * ke;
            dk_acc[(b * nk + j) * dk + e] += g * qc * wce;
            dw_acc[c * dk + e] += g * qc * ke;
          }
        }
      }
    }
  }
  store(dq_acc, grads.d_queries);
  store(dk_acc, grads.d_keys);
  for (int64_t c = 0; c < dq; ++c) {
    for (int64_t e = 0; e < dk; ++e) grads.d_w(c, e) = static_cast<T>(dw_acc[c * dk + e]);
  }
}

template void bilinear<float>(ConstView<float>, ConstView<float>, ConstView<float>,
                              ConstView<float>, const AttentionConfig&, const ForwardViews<float>&);
template void bilinear<double>(ConstView<double>, ConstView<double>, ConstView<double>,
                               ConstView<double>, const AttentionConfig&,
                               const ForwardViews<double>&);
template void bilinear_backward<float>(ConstView<float>, ConstView<float>, ConstView<float>,
                                       ConstView<float>, const AttentionConfig&,
                                       const SavedViews<float>&, ConstView<float>,
                                       const BilinearGradViews<float>&);
template void bilinear_backward<double>(ConstView<double>, ConstView<double>, ConstView<double>,
                                        ConstView<double>, const AttentionConfig&,
                                        const SavedViews<double>&, ConstView<double>,
                                        const BilinearGradViews<double>&);

}  // namespace qkv::kernels::ref
