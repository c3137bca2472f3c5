#include "search/encoder.h"

#include <cassert>
#include <cmath>

#include "qkv/threads.h"

namespace qkv::search {
namespace {

// out_row = sum over the row's entries of weight * table row.
void weighted_row_sum(const SparseRows& x, int64_t r, const float* table, int64_t d, float* out) {
  for (int64_t c = 0; c < d; ++c) out[c] = 0.0f;
  for (int64_t e = x.offsets[r]; e < x.offsets[r + 1]; ++e) {
    const float w = x.weights[e];
    const float* row = table + static_cast<int64_t>(x.features[e]) * d;
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) out[c] += w * row[c];
  }
}

}  // namespace

void encode(const SparseRows& x, ConstView<float> map, TensorView<float> out) {
  const int64_t rows = x.rows(), d = map.size(1);
  assert(map.is_contiguous() && out.is_contiguous() && out.size(0) == rows && out.size(1) == d);
  const float* table = map.data();
  float* dst = out.data();
#pragma omp parallel for schedule(static, 64) num_threads(num_threads())
  for (int64_t r = 0; r < rows; ++r) weighted_row_sum(x, r, table, d, dst + r * d);
}

void encode_backward(const SparseRows& x_by_feature, ConstView<float> d_out,
                     TensorView<float> d_map) {
  const int64_t buckets = x_by_feature.rows(), d = d_out.size(1);
  assert(d_out.is_contiguous() && d_map.is_contiguous() && d_map.size(0) == buckets);
  const float* src = d_out.data();
  float* dst = d_map.data();
#pragma omp parallel for schedule(static, 256) num_threads(num_threads())
  for (int64_t f = 0; f < buckets; ++f) weighted_row_sum(x_by_feature, f, src, d, dst + f * d);
}

Adam::Adam(int64_t size, double learning_rate, double beta1, double beta2, double epsilon)
    : m_(Shape{size}, 0.0f), v_(Shape{size}, 0.0f), lr_(learning_rate), beta1_(beta1),
      beta2_(beta2), epsilon_(epsilon) {}

void Adam::step(TensorView<float> params, ConstView<float> grads) {
  const int64_t n = m_.numel();
  assert(params.numel() == n && grads.numel() == n);
  ++t_;
  const float b1 = static_cast<float>(beta1_), b2 = static_cast<float>(beta2_);
  const float step = static_cast<float>(lr_ / (1.0 - std::pow(beta1_, static_cast<double>(t_))));
  const float correct2 = static_cast<float>(1.0 / (1.0 - std::pow(beta2_, static_cast<double>(t_))));
  const float eps = static_cast<float>(epsilon_);
  float* p = params.data();
  const float* g = grads.data();
  float* m = m_.data();
  float* v = v_.data();
#pragma omp parallel for simd schedule(static) num_threads(num_threads())
  for (int64_t i = 0; i < n; ++i) {
    m[i] = b1 * m[i] + (1.0f - b1) * g[i];
    v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
    p[i] -= step * m[i] / (std::sqrt(v[i] * correct2) + eps);
  }
}

}  // namespace qkv::search
