// An affine map on the last axis, torch.nn.functional.linear's:
//   x (..., in)   weight (out, in)   bias (out) or empty   ->   (..., out)
//   y = x weightᵀ + bias
// The matrix products of the modules (qkv/modules.h) and of the search
// engine's transformer encoder go through it: the BLAS, single-threaded,
// on blocks of 64 rows split over qkv's threads (the cut depends on the
// shapes alone, so the bits do not depend on the thread count).
#pragma once

#include "qkv/tensor.h"

namespace qkv {

// Error "linear: ..." naming the argument and its shape when x has rank 0,
// weight is not (out, in) with in = x's last size, or bias is neither empty
// nor (out). Any strides (an odd layout is copied once).
Tensor<float> linear(ConstView<float> x, ConstView<float> weight, ConstView<float> bias = {});
Tensor<double> linear(ConstView<double> x, ConstView<double> weight, ConstView<double> bias = {});

// The same into `out` (..., out), contiguous; Error naming out's shape if it is not x's with the
// last size out, or if it is not contiguous.
void linear(ConstView<float> x, ConstView<float> weight, ConstView<float> bias,
            TensorView<float> out);
void linear(ConstView<double> x, ConstView<double> weight, ConstView<double> bias,
            TensorView<double> out);

}  // namespace qkv
