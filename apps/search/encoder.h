// The learned engine's two encoders: a text's encoding is its hashed
// features' rows of a map (buckets, d), weighted and summed (an embedding
// bag, features.h). One map for queries, one for documents; both trained
// through attention over every document (train.h).
#pragma once

#include <cstdint>

#include "qkv/tensor.h"
#include "search/features.h"

namespace qkv::search {

// out (rows, d) = x (rows, buckets) · map (buckets, d). One task per block of
// rows, each row's sum in feature order: the same bits for any thread count.
void encode(const SparseRows& x, ConstView<float> map, TensorView<float> out);

// d_map (buckets, d) = xᵀ · d_out, given x_by_feature = transpose(x, buckets):
// each map row summed in row order by one task. Rows no text has are 0.
void encode_backward(const SparseRows& x_by_feature, ConstView<float> d_out, TensorView<float> d_map);

// Adam (Kingma and Ba, 2015) over one tensor, in place, with the bias
// correction; elementwise, so thread count does not change the bits.
class Adam {
 public:
  Adam(int64_t size, double learning_rate, double beta1 = 0.9, double beta2 = 0.999,
       double epsilon = 1e-8);
  void step(TensorView<float> params, ConstView<float> grads);

 private:
  Tensor<float> m_, v_;
  double lr_, beta1_, beta2_, epsilon_;
  int64_t t_ = 0;
};

}  // namespace qkv::search
