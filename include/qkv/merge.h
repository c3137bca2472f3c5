// Merging attention computed over disjoint parts of a key set: partial
// outputs and log-sum-exps (options.return_lse) → the result over the union,
// exactly (DESIGN.md §3 and §9). What attention over a store's chunks, or
// over MPI ranks each holding a shard, is built on.
//   outputs[s]: (..., Nq, Dv)   lses[s]: (..., Nq)   → output (..., Nq, Dv), lse (..., Nq)
#pragma once

#include <vector>

#include "qkv/tensor.h"

namespace qkv {

template <class T>
struct MergedAttention {
  Tensor<T> output;  // the outputs' shape
  Tensor<T> lse;     // the lses' shape
};

// For each row (every index but the last axis of the outputs), with parts
// s = 0, 1, ... in the order given:
//   lse    = log sum_s exp(lse_s)
//   output = sum_s exp(lse_s - lse) output_s
// formed with the largest lse_s subtracted first and summed in double, so it
// neither overflows nor depends on how the keys were split beyond rounding.
// A part with lse_s = -inf (no keys, or all masked) has weight 0 and its
// output is not read; a row whose parts are all -inf gets lse -inf and an
// output of 0, like attention over no keys. A NaN or +inf lse_s (a part
// whose valid scores held NaN or +inf) makes that row's lse and output NaN.
// Every output has one shape with rank >= 2, every lse that shape without its
// last axis; any strides. At least one part. Throws Error otherwise. A view
// holds at most kMaxRank (4) axes: fold further leading axes into one, e.g.
// (B, G, H, Nq, Dv) (xformers' grouped heads) as (B·G·H, Nq, Dv) with lses
// (B·G·H, Nq); the merge is row by row, so the folded rows merge alike (the
// Python binding folds arrays of any rank so).
MergedAttention<float> merge_attention(const std::vector<ConstView<float>>& outputs,
                                       const std::vector<ConstView<float>>& lses);
MergedAttention<double> merge_attention(const std::vector<ConstView<double>>& outputs,
                                        const std::vector<ConstView<double>>& lses);

// The same into caller-provided, contiguous output and lse of the shapes
// above. They may be one of the parts' own output and lse (a running merge,
// in place); any other overlap with the inputs is not allowed.
void merge_attention(const std::vector<ConstView<float>>& outputs,
                     const std::vector<ConstView<float>>& lses, TensorView<float> output,
                     TensorView<float> lse);
void merge_attention(const std::vector<ConstView<double>>& outputs,
                     const std::vector<ConstView<double>>& lses, TensorView<double> output,
                     TensorView<double> lse);

}  // namespace qkv
