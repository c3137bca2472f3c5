// Argument checks shared by the public entry points. Kernels assume they
// passed and only assert.
#pragma once

#include <string>
#include <string_view>

#include "qkv/error.h"
#include "qkv/tensor.h"

namespace qkv::detail {

// "queries has shape [2, 3]; expected rank 3 (batch, num_queries, head_dim)"
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

// A contiguous version of a view: the view itself when it already is,
// otherwise a copy owned by this object. The fast kernels need unit strides
// for the BLAS and SIMD loops; copying odd layouts once is cheaper than
// strided inner loops.
template <class T>
class Contiguous {
 public:
  explicit Contiguous(ConstView<T> view) {
    if (view.is_contiguous()) {
      view_ = ConstView<T>(view.data(), view.shape());
    } else {
      copy_ = Tensor<T>::copy_of(view);
      view_ = copy_.view();
    }
  }
  Contiguous(const Contiguous&) = delete;
  Contiguous& operator=(const Contiguous&) = delete;
  const T* data() const { return view_.data(); }
  const ConstView<T>& view() const { return view_; }

 private:
  Tensor<T> copy_;
  ConstView<T> view_;
};

}  // namespace qkv::detail
