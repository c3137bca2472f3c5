// Contiguous copies for the front ends: the fast kernels take unit-stride
// views, and the front end (which owns all allocation) makes them.
#pragma once

#include "qkv/tensor.h"

namespace qkv::detail {

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
