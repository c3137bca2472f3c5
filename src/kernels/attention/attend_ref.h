// The half of reference attention every scoring function shares: given the
// scores (B, Nq, Nk) in double, masked softmax, dropout and pooling of the
// values, and its backward. sdpa_ref.cc and additive_ref.cc form the scores;
// a new scoring function's reference does the same and calls these.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/runtime/philox.h"

namespace qkv::kernels::ref {

using Matrix = std::vector<double>;  // row-major, sizes known from context

// Dropout factor of weight (b, i, j): 0 if dropped, 1/(1-p) if kept, 1 without dropout.
inline double dropout_factor(const AttentionConfig& config, int64_t b, int64_t i, int64_t j) {
  if (config.dropout == 0.0) return 1.0;
  return kernels::dropout_kept(config.seed, config.dropout, b, i, j) ? 1.0 / (1.0 - config.dropout)
                                                                     : 0.0;
}

// scores: (B, Nq, Nk)   v: (B, Nk, Dv)   out.output: (B, Nq, Dv)
// out.weights (B, Nq, Nk) and out.lse (B, Nq) written when they have data.
template <class T>
void attend(const Matrix& scores, int64_t batch, int64_t nq, int64_t nk, ConstView<T> v,
            const AttentionConfig& config, const ForwardViews<T>& out) {
  const int64_t dv = v.size(2);
  std::vector<double> w(nk), pooled(dv);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t len = config.len(b, i, nk);
      const double* x = scores.data() + (b * nq + i) * nk;
      const double lse = softmax_row(x, len, nk, w.data());
      if (out.lse.data() != nullptr) out.lse(b, i) = static_cast<T>(lse);
      std::fill(pooled.begin(), pooled.end(), 0.0);
      for (int64_t j = 0; j < nk; ++j) {
        if (out.weights.data() != nullptr) out.weights(b, i, j) = static_cast<T>(w[j]);
        if (j >= len) continue;
        const double wd = w[j] * dropout_factor(config, b, i, j);
        for (int64_t c = 0; c < dv; ++c) pooled[c] += wd * static_cast<double>(v(b, j, c));
      }
      for (int64_t c = 0; c < dv; ++c) out.output(b, i, c) = static_cast<T>(pooled[c]);
    }
  }
}

// Given the scores, the softmax and pooling backward: returns d_scores
// (B, Nq, Nk) and writes d_values (B, Nk, Dv). Recomputes the weights from
// the scores (no trust in a saved lse). d_lse: the gradient arriving at each
// row's lse ((B Nq) of them), or null for none.
template <class T>
Matrix attend_backward(const Matrix& scores, int64_t batch, int64_t nq, int64_t nk, ConstView<T> v,
                       const AttentionConfig& config, ConstView<T> d_output,
                       TensorView<T> d_values, const double* d_lse = nullptr) {
  const int64_t dv = v.size(2);
  Matrix d_scores(batch * nq * nk, 0.0);
  Matrix dv_acc(batch * nk * dv, 0.0);
  std::vector<double> w(nk), dw(nk);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t len = config.len(b, i, nk);
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
      // d lse / d score_j = w_j: before dropout, which the lse does not see.
      if (d_lse != nullptr) dot -= d_lse[b * nq + i];
      for (int64_t j = 0; j < len; ++j) d_scores[(b * nq + i) * nk + j] = w[j] * (dw[j] - dot);
    }
  }
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = 0; j < nk; ++j) {
      for (int64_t c = 0; c < dv; ++c) {
        d_values(b, j, c) = static_cast<T>(dv_acc[(b * nk + j) * dv + c]);
      }
    }
  }
  return d_scores;
}

// dst[...] = m[...] for a (d0, d1, d2) destination of any strides.
template <class T>
void store(const Matrix& m, TensorView<T> dst) {
  const int64_t d0 = dst.size(0), d1 = dst.size(1), d2 = dst.size(2);
  for (int64_t a = 0; a < d0; ++a) {
    for (int64_t r = 0; r < d1; ++r) {
      for (int64_t c = 0; c < d2; ++c) dst(a, r, c) = static_cast<T>(m[(a * d1 + r) * d2 + c]);
    }
  }
}

}  // namespace qkv::kernels::ref
