// Argument checks shared by the public entry points. Kernels assume they
// passed and only assert.
#pragma once

#include <string>
#include <string_view>

#include "qkv/error.h"
#include "qkv/tensor.h"

namespace qkv::detail {

// "queries has shape [2, 3]; expected rank 3 (B, Nq, D)"
template <class T>
void check_rank(std::string_view function, std::string_view name, const TensorView<T>& view,
                int rank, std::string_view axes) {
  if (view.rank() != rank) {
    fail(function, std::string(name) + " has shape " + view.shape().str() + "; expected rank " +
                       std::to_string(rank) + " " + std::string(axes));
  }
}

// "weights has shape [2, 4, 4]; expected [2, 4, 5]"
template <class T>
void check_shape(std::string_view function, std::string_view name, const TensorView<T>& view,
                 const Shape& expected) {
  if (!(view.shape() == expected)) {
    fail(function,
         std::string(name) + " has shape " + view.shape().str() + "; expected " + expected.str());
  }
}

// For caller-provided destinations: the right shape and contiguous.
template <class T>
void check_destination(std::string_view function, std::string_view name, const TensorView<T>& view,
                       const Shape& expected) {
  check_shape(function, name, view, expected);
  if (!view.is_contiguous()) {
    fail(function,
         std::string(name) + " of shape " + view.shape().str() + " must be contiguous (row-major)");
  }
}

// The one check of a dropout probability, for every entry point that takes
// one: "options.dropout_p = 1.500000 is outside [0, 1]".
inline void check_dropout(std::string_view function, std::string_view name, double p) {
  if (!(p >= 0.0 && p <= 1.0)) {
    fail(function, std::string(name) + " = " + std::to_string(p) + " is outside [0, 1]");
  }
}

}  // namespace qkv::detail
