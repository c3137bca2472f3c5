// Dropout on attention weights. The keep/drop decision for element (b, i, j)
// is a pure function of (seed, b, i, j) — Philox4x32-10 keyed by the seed with
// the counter (j / 4, i, b, 0) — so it is the same for any blocking or thread
// count, and a backward pass regenerates it instead of storing a mask.
#pragma once

#include <cstdint>

#include "qkv/tensor.h"

namespace qkv {

// True if weight (b, i, j) survives dropout with drop probability p in [0, 1].
bool dropout_keep(uint64_t seed, double p, int64_t b, int64_t i, int64_t j);

// Applies dropout in place to weights of shape (B, Nq, Nk): dropped elements
// become 0, kept ones are scaled by 1/(1 - p). p = 1 zeroes everything.
// Throws Error unless weights has rank 3 and 0 <= p <= 1.
void apply_dropout(TensorView<float> weights, uint64_t seed, double p);
void apply_dropout(TensorView<double> weights, uint64_t seed, double p);

}  // namespace qkv
