// Scaled dot-product and additive attention, reference version: every score,
// weight and gradient formed explicitly in double with plain loops, any
// strides. Slow and obviously right; the fast kernels are tested against it.
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/kernels.h"
#include "qkv/dropout.h"

namespace qkv::kernels::ref {
namespace {

using Matrix = std::vector<double>;  // row-major, sizes known from context

// Dropout factor of weight (b, i, j): 0 if dropped, 1/(1-p) if kept, 1 without dropout.
double dropout_factor(const AttentionConfig& config, int64_t b, int64_t i, int64_t j) {
  if (config.dropout == 0.0) return 1.0;
  return dropout_keep(config.seed, config.dropout, b, i, j) ? 1.0 / (1.0 - config.dropout) : 0.0;
}

// Given scores (B, Nq, Nk) in double, the rest of the forward: masked softmax,
// dropout, pooling of the values.
template <class T>
AttentionResult<T> attend(const Matrix& scores, int64_t batch, int64_t nq, int64_t nk,
                          ConstView<T> v, const AttentionConfig& config) {
  const int64_t dv = v.size(2);
  AttentionResult<T> result{Tensor<T>(Shape{batch, nq, dv}), Tensor<T>(Shape{batch, nq, nk}),
                            Tensor<T>(Shape{batch, nq})};
  std::vector<double> w(nk), out(dv);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t len = (*config.valid_lens)(b, i, nk);
      const double* x = scores.data() + (b * nq + i) * nk;
      result.lse(b, i) = static_cast<T>(softmax_row(x, len, nk, w.data()));
      std::fill(out.begin(), out.end(), 0.0);
      for (int64_t j = 0; j < nk; ++j) {
        result.weights(b, i, j) = static_cast<T>(w[j]);
        if (j >= len) continue;
        const double wd = w[j] * dropout_factor(config, b, i, j);
        for (int64_t c = 0; c < dv; ++c) out[c] += wd * static_cast<double>(v(b, j, c));
      }
      for (int64_t c = 0; c < dv; ++c) result.output(b, i, c) = static_cast<T>(out[c]);
    }
  }
  return result;
}

// Given scores, the softmax and pooling backward: d_scores (B, Nq, Nk) and dV.
// Recomputes the weights from the scores (no trust in a saved lse).
template <class T>
Matrix attend_backward(const Matrix& scores, int64_t batch, int64_t nq, int64_t nk, ConstView<T> v,
                       const AttentionConfig& config, ConstView<T> d_output, Tensor<T>& d_values) {
  const int64_t dv = v.size(2);
  Matrix d_scores(batch * nq * nk, 0.0);
  Matrix dv_acc(batch * nk * dv, 0.0);
  std::vector<double> w(nk), dw(nk);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t len = (*config.valid_lens)(b, i, nk);
      softmax_row(scores.data() + (b * nq + i) * nk, len, nk, w.data());
      double dot = 0.0;
      for (int64_t j = 0; j < len; ++j) {
        const double factor = dropout_factor(config, b, i, j);
        double g = 0.0;  // dLoss / d(weight after dropout)
        for (int64_t c = 0; c < dv; ++c) {
          g += static_cast<double>(d_output(b, i, c)) * static_cast<double>(v(b, j, c));
          dv_acc[(b * nk + j) * dv + c] += w[j] * factor * static_cast<double>(d_output(b, i, c));
        }
        dw[j] = g * factor;
        dot += w[j] * dw[j];
      }
      for (int64_t j = 0; j < len; ++j) d_scores[(b * nq + i) * nk + j] = w[j] * (dw[j] - dot);
    }
  }
  d_values = Tensor<T>(Shape{batch, nk, dv});
  for (int64_t n = 0; n < d_values.numel(); ++n) d_values.data()[n] = static_cast<T>(dv_acc[n]);
  return d_scores;
}

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

struct AdditiveFeatures {
  Matrix fq, fk, scores;  // (B, Nq, H), (B, Nk, H), (B, Nq, Nk)
};

template <class T>
AdditiveFeatures additive_features(ConstView<T> q, ConstView<T> k, const AdditiveParams<T>& p) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), hidden = p.w_q.size(0);
  AdditiveFeatures f{project(q, p.w_q), project(k, p.w_k), Matrix(batch * nq * nk)};
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

template <class T>
Tensor<T> to_tensor(const Matrix& m, Shape shape) {
  Tensor<T> t(shape);
  for (int64_t n = 0; n < t.numel(); ++n) t.data()[n] = static_cast<T>(m[n]);
  return t;
}

}  // namespace

// q: (B, Nq, D)   k: (B, Nk, D)   v: (B, Nk, Dv)  ->  out (B, Nq, Dv), weights, lse
template <class T>
AttentionResult<T> dot_product_attention(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                         const AttentionConfig& config) {
  return attend(dot_product_scores(q, k, config.scale), q.size(0), q.size(1), k.size(1), v, config);
}

template <class T>
DotProductGrads<T> dot_product_attention_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                                  const AttentionConfig& config,
                                                  ConstView<T> d_output) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), d = q.size(2);
  DotProductGrads<T> grads;
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
  grads.d_queries = to_tensor<T>(dq, Shape{batch, nq, d});
  grads.d_keys = to_tensor<T>(dk, Shape{batch, nk, d});
  return grads;
}

template <class T>
AttentionResult<T> additive_attention(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                      const AdditiveParams<T>& params,
                                      const AttentionConfig& config) {
  return attend(additive_features(q, k, params).scores, q.size(0), q.size(1), k.size(1), v, config);
}

template <class T>
AdditiveGrads<T> additive_attention_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                             const AdditiveParams<T>& params,
                                             const AttentionConfig& config, ConstView<T> d_output) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1);
  const int64_t dq_dim = q.size(2), dk_dim = k.size(2), hidden = params.w_q.size(0);
  const AdditiveFeatures f = additive_features(q, k, params);
  AdditiveGrads<T> grads;
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
  auto back_project = [&](const Matrix& df, ConstView<T> x, ConstView<T> w, int64_t n, int64_t dim,
                          Tensor<T>& dx, Tensor<T>& dw) {
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
    dx = to_tensor<T>(dx_acc, Shape{batch, n, dim});
    dw = to_tensor<T>(dw_acc, Shape{hidden, dim});
  };
  back_project(dfq, q, params.w_q, nq, dq_dim, grads.d_queries, grads.d_w_q);
  back_project(dfk, k, params.w_k, nk, dk_dim, grads.d_keys, grads.d_w_k);
  grads.d_w_v = to_tensor<T>(dwv, Shape{hidden});
  return grads;
}

#define QKV_INSTANTIATE(T)                                                                         \
  template AttentionResult<T> dot_product_attention<T>(ConstView<T>, ConstView<T>, ConstView<T>,   \
                                                       const AttentionConfig&);                    \
  template DotProductGrads<T> dot_product_attention_backward<T>(                                   \
      ConstView<T>, ConstView<T>, ConstView<T>, const AttentionConfig&, ConstView<T>);             \
  template AttentionResult<T> additive_attention<T>(                                               \
      ConstView<T>, ConstView<T>, ConstView<T>, const AdditiveParams<T>&, const AttentionConfig&); \
  template AdditiveGrads<T> additive_attention_backward<T>(ConstView<T>, ConstView<T>,             \
                                                           ConstView<T>, const AdditiveParams<T>&, \
                                                           const AttentionConfig&, ConstView<T>);
QKV_INSTANTIATE(float)
QKV_INSTANTIATE(double)
#undef QKV_INSTANTIATE

}  // namespace qkv::kernels::ref
