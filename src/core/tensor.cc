// Shape and Tensor members that are not inline, instantiated for the element
// types the library uses.
#include "qkv/tensor.h"

#include <limits>

#include "qkv/error.h"

namespace qkv {

Shape::Shape(std::initializer_list<int64_t> sizes) {
  for (int64_t size : sizes) push_back(size);
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int a = 0; a < rank_; ++a) n *= sizes_[a];
  return n;
}

void Shape::push_back(int64_t size) {
  if (rank_ == kMaxRank) {
    fail("Shape", "rank above " + std::to_string(kMaxRank) + " is not supported");
  }
  sizes_[rank_++] = size;
}

std::string Shape::str() const {
  std::string s = "[";
  for (int a = 0; a < rank_; ++a) {
    if (a) s += ", ";
    s += std::to_string(sizes_[a]);
  }
  return s + "]";
}

Shape row_major_strides(const Shape& shape) {
  Shape strides = shape;
  int64_t stride = 1;
  for (int a = shape.rank() - 1; a >= 0; --a) {
    strides[a] = stride;
    stride *= shape[a];
  }
  return strides;
}

namespace detail {
size_t checked_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t size : shape) {
    if (size < 0) fail("Tensor", "shape " + shape.str() + " has a negative size");
    if (size != 0 && n > std::numeric_limits<int64_t>::max() / size) {
      fail("Tensor", "shape " + shape.str() + " has too many elements");
    }
    n *= size;
  }
  return static_cast<size_t>(n);
}
}  // namespace detail

template <class T>
Tensor<T>::Tensor(Shape shape, std::vector<T> values) : shape_(shape), data_(std::move(values)) {
  if (static_cast<int64_t>(data_.size()) != shape.numel()) {
    fail("Tensor", "got " + std::to_string(data_.size()) + " values for shape " + shape.str() +
                       " (" + std::to_string(shape.numel()) + " elements)");
  }
}

template <class T>
Tensor<T> Tensor<T>::copy_of(ConstView<T> view) {
  Tensor<T> out(view.shape());
  if (view.is_contiguous()) {
    std::copy(view.data(), view.data() + view.numel(), out.data());
    return out;
  }
  // Walk the view in row-major order with an odometer over its indices.
  const Shape& shape = view.shape();
  std::array<int64_t, kMaxRank> index{};
  for (int64_t n = 0; n < out.numel(); ++n) {
    int64_t offset = 0;
    for (int a = 0; a < shape.rank(); ++a) offset += index[a] * view.stride(a);
    out.data()[n] = view.data()[offset];
    for (int a = shape.rank() - 1; a >= 0; --a) {
      if (++index[a] < shape[a]) break;
      index[a] = 0;
    }
  }
  return out;
}

template <class T>
Tensor<T> Tensor<T>::reshaped(Shape shape) const& {
  return Tensor(*this).reshaped(shape);
}

template <class T>
Tensor<T> Tensor<T>::reshaped(Shape shape) && {
  if (shape.numel() != numel()) {
    fail("Tensor::reshaped", "cannot reshape " + shape_.str() + " to " + shape.str());
  }
  Tensor<T> out;
  out.shape_ = shape;
  out.data_ = std::move(data_);
  return out;
}

template class Tensor<float>;
template class Tensor<double>;
template class Tensor<int32_t>;
template class Tensor<int64_t>;
template class Tensor<uint8_t>;
template class Tensor<bfloat16>;

}  // namespace qkv
