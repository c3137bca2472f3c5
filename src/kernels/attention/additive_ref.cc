// Additive attention, reference version: the projections, every score's
// tanh, weight and gradient formed explicitly in double with plain loops,
// any strides. Slow and obviously right; the fast kernel (additive_fast.cc)
// is tested against it.
#include <cmath>

#include "kernels/attention/attend_ref.h"
#include "kernels/kernels.h"

namespace qkv::kernels::ref {
namespace {

// features[b, n, h] = sum_c w[h, c] x[b, n, c]
template <class T>
Matrix project(ConstView<T> x, ConstView<T> w) {
  const int64_t batch = x.size(0), n = x.size(1), dim = x.size(2), hidden = w.size(0);
  Matrix f(batch * n * hidden);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t h = 0; h < hidden; ++h) {
        double s = 0.0;
        for (int64_t c = 0; c < dim; ++c) s += static_cast<double>(w(h, c)) * x(b, r, c);
        f[(b * n + r) * hidden + h] = s;
      }
    }
  }
  return f;
}

struct Features {
  Matrix fq, fk, scores;  // (B, Nq, H), (B, Nk, H), (B, Nq, Nk)
};

template <class T>
Features additive_features(ConstView<T> q, ConstView<T> k, const AdditiveParams<T>& p) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), hidden = p.w_q.size(0);
  Features f{project(q, p.w_q), project(k, p.w_k), Matrix(batch * nq * nk)};
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        double s = 0.0;
        for (int64_t h = 0; h < hidden; ++h) {
          s += static_cast<double>(p.w_v(h)) *
               std::tanh(f.fq[(b * nq + i) * hidden + h] + f.fk[(b * nk + j) * hidden + h]);
        }
        f.scores[(b * nq + i) * nk + j] = s;
      }
    }
  }
  return f;
}

// Back through a projection f = W x: dx (B, n, dim) and dW (H, dim).
template <class T>
void back_project(const Matrix& df, ConstView<T> x, ConstView<T> w, TensorView<T> dx,
                  TensorView<T> dw) {
  const int64_t batch = x.size(0), n = x.size(1), dim = x.size(2), hidden = w.size(0);
  Matrix dx_acc(batch * n * dim, 0.0), dw_acc(hidden * dim, 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t h = 0; h < hidden; ++h) {
        const double g = df[(b * n + r) * hidden + h];
        if (g == 0.0) continue;  // e.g. a masked key: never read
        for (int64_t c = 0; c < dim; ++c) {
          dx_acc[(b * n + r) * dim + c] += g * static_cast<double>(w(h, c));
          dw_acc[h * dim + c] += g * static_cast<double>(x(b, r, c));
        }
      }
    }
  }
  store(dx_acc, dx);
  for (int64_t h = 0; h < hidden; ++h) {
    for (int64_t c = 0; c < dim; ++c) dw(h, c) = static_cast<T>(dw_acc[h * dim + c]);
  }
}

}  // namespace

// q: (B, Nq, Dq)   k: (B, Nk, Dk)   v: (B, Nk, Dv)   w_q: (H, Dq)   w_k: (H, Dk)   w_v: (H)
// -> out (B, Nq, Dv), weights, lse
template <class T>
void additive(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AdditiveParams<T>& params,
              const AttentionConfig& config, const ForwardViews<T>& out) {
  attend(additive_features(q, k, params).scores, q.size(0), q.size(1), k.size(1), v, config, out);
}

// Gradients of q, k, v, W_q, W_k and w_v (H); saved is not read.
template <class T>
void additive_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                       const AdditiveParams<T>& params, const AttentionConfig& config,
                       const SavedViews<T>&, ConstView<T> d_output,
                       const AdditiveGradViews<T>& grads) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), hidden = params.w_q.size(0);
  const Features f = additive_features(q, k, params);
  const Matrix ds = attend_backward(f.scores, batch, nq, nk, v, config, d_output, grads.d_values);
  // Back through score = w_v . tanh(fq + fk): d(fq), d(fk), d(w_v).
  Matrix dfq(batch * nq * hidden, 0.0), dfk(batch * nk * hidden, 0.0), dwv(hidden, 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        const double g = ds[(b * nq + i) * nk + j];
        if (g == 0.0) continue;
        for (int64_t h = 0; h < hidden; ++h) {
          const double t =
              std::tanh(f.fq[(b * nq + i) * hidden + h] + f.fk[(b * nk + j) * hidden + h]);
          const double dpre = g * static_cast<double>(params.w_v(h)) * (1.0 - t * t);
          dfq[(b * nq + i) * hidden + h] += dpre;
          dfk[(b * nk + j) * hidden + h] += dpre;
          dwv[h] += g * t;
        }
      }
    }
  }
  // Back through the projections fq = W_q q and fk = W_k k.
  back_project(dfq, q, params.w_q, grads.d_queries, grads.d_w_q);
  back_project(dfk, k, params.w_k, grads.d_keys, grads.d_w_k);
  for (int64_t h = 0; h < hidden; ++h) grads.d_w_v(h) = static_cast<T>(dwv[h]);
}

template void additive<float>(ConstView<float>, ConstView<float>, ConstView<float>,
                              const AdditiveParams<float>&, const AttentionConfig&,
                              const ForwardViews<float>&);
template void additive<double>(ConstView<double>, ConstView<double>, ConstView<double>,
                               const AdditiveParams<double>&, const AttentionConfig&,
                               const ForwardViews<double>&);
template void additive_backward<float>(ConstView<float>, ConstView<float>, ConstView<float>,
                                       const AdditiveParams<float>&, const AttentionConfig&,
                                       const SavedViews<float>&, ConstView<float>,
                                       const AdditiveGradViews<float>&);
template void additive_backward<double>(ConstView<double>, ConstView<double>, ConstView<double>,
                                        const AdditiveParams<double>&, const AttentionConfig&,
                                        const SavedViews<double>&, ConstView<double>,
                                        const AdditiveGradViews<double>&);

}  // namespace qkv::kernels::ref
