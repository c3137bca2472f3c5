// Dropout: the public per-element decision and the in-place application.
#include "qkv/dropout.h"

#include <cmath>
#include <string>
#include <vector>

#include "core/check.h"
#include "kernels/runtime/philox.h"
#include "qkv/error.h"

namespace qkv {
namespace {

template <class T>
void apply_dropout_impl(TensorView<T> weights, uint64_t seed, double p) {
  detail::check_dropout("apply_dropout", "p", p);
  if (weights.rank() != 3) {
    fail("apply_dropout",
         "weights has shape " + weights.shape().str() + "; expected rank 3 (B, Nq, Nk)");
  }
  const int64_t nk = weights.size(2);
  const T scale = p < 1.0 ? static_cast<T>(1.0 / (1.0 - p)) : T(0);
  std::vector<uint8_t> keep(static_cast<size_t>(nk));
  for (int64_t b = 0; b < weights.size(0); ++b) {
    for (int64_t i = 0; i < weights.size(1); ++i) {
      kernels::dropout_row_mask(seed, p, b, i, 0, nk, keep.data());
      for (int64_t j = 0; j < nk; ++j) {
        weights(b, i, j) = keep[j] ? weights(b, i, j) * scale : T(0);
      }
    }
  }
}

}  // namespace

bool dropout_keep(uint64_t seed, double p, int64_t b, int64_t i, int64_t j) {
  detail::check_dropout("dropout_keep", "p", p);
  return kernels::dropout_kept(seed, p, b, i, j);
}

void apply_dropout(TensorView<float> weights, uint64_t seed, double p) {
  apply_dropout_impl(weights, seed, p);
}
void apply_dropout(TensorView<double> weights, uint64_t seed, double p) {
  apply_dropout_impl(weights, seed, p);
}

}  // namespace qkv
