// Masked softmax, reference version: plain loops in double over any strides.
// This is the executable form of DESIGN.md §3; the fast version is held to it.
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/kernels.h"

namespace qkv::kernels::ref {

double softmax_row(const double* x, int64_t len, int64_t n, double* w) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  for (int64_t j = len; j < n; ++j) w[j] = 0.0;
  if (len == 0) return -kInf;
  double max = -kInf;
  for (int64_t j = 0; j < len; ++j) {
    if (std::isnan(x[j]) || x[j] == kInf) {
      for (int64_t jj = 0; jj < len; ++jj) w[jj] = std::numeric_limits<double>::quiet_NaN();
      return std::numeric_limits<double>::quiet_NaN();
    }
    max = std::max(max, x[j]);
  }
  if (max == -kInf) {  // every valid score is -inf: an empty sum
    for (int64_t j = 0; j < len; ++j) w[j] = 0.0;
    return -kInf;
  }
  double sum = 0.0;
  for (int64_t j = 0; j < len; ++j) sum += w[j] = std::exp(x[j] - max);
  for (int64_t j = 0; j < len; ++j) w[j] /= sum;
  return max + std::log(sum);
}

// scores: (B, Nq, Nk)   valid_lens: absent, (B) or (B, Nq)   weights: (B, Nq, Nk)
template <class T>
void masked_softmax(ConstView<T> scores, const ValidLens& valid_lens, TensorView<T> weights) {
  const int64_t batch = scores.size(0), nq = scores.size(1), nk = scores.size(2);
  std::vector<double> x(nk), w(nk);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t len = valid_lens(b, i, nk);
      // Masked positions are never read: they might hold anything.
      for (int64_t j = 0; j < len; ++j) x[j] = scores(b, i, j);
      softmax_row(x.data(), len, nk, w.data());
      for (int64_t j = 0; j < nk; ++j) weights(b, i, j) = static_cast<T>(w[j]);
    }
  }
}

// d_scores[j] = w[j] * (d_weights[j] - sum_k w[k] d_weights[k]) for j < L, 0 beyond.
template <class T>
void masked_softmax_backward(ConstView<T> weights, ConstView<T> d_weights,
                             const ValidLens& valid_lens, TensorView<T> d_scores) {
  const int64_t batch = weights.size(0), nq = weights.size(1), nk = weights.size(2);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t len = valid_lens(b, i, nk);
      double dot = 0.0;
      for (int64_t j = 0; j < len; ++j) {
        dot += static_cast<double>(weights(b, i, j)) * static_cast<double>(d_weights(b, i, j));
      }
      for (int64_t j = 0; j < nk; ++j) {
        d_scores(b, i, j) = j < len
                                ? static_cast<T>(static_cast<double>(weights(b, i, j)) *
                                                 (static_cast<double>(d_weights(b, i, j)) - dot))
                                : T(0);
      }
    }
  }
}

template void masked_softmax<float>(ConstView<float>, const ValidLens&, TensorView<float>);
template void masked_softmax<double>(ConstView<double>, const ValidLens&, TensorView<double>);
template void masked_softmax_backward<float>(ConstView<float>, ConstView<float>, const ValidLens&,
                                             TensorView<float>);
template void masked_softmax_backward<double>(ConstView<double>, ConstView<double>,
                                              const ValidLens&, TensorView<double>);

}  // namespace qkv::kernels::ref
