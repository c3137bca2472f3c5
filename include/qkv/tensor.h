// Row-major tensors: Tensor<T> owns its elements, TensorView<T> borrows
// someone else's (strided, no copy). Every op of the library takes views, so
// callers pass their own memory; Tensor<T> converts to a view implicitly.
#pragma once

#include <algorithm>
#include <array>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

#include "qkv/bfloat16.h"

namespace qkv {

inline constexpr int kMaxRank = 4;

// The sizes of a tensor's axes (rank 0 to kMaxRank). Also used for strides.
class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> sizes);
  // Builds a shape from any range of sizes (e.g. a std::vector<int64_t>).
  template <class It>
  Shape(It first, It last) {
    for (; first != last; ++first) push_back(static_cast<int64_t>(*first));
  }

  int rank() const { return rank_; }
  int64_t operator[](int axis) const { return sizes_[axis]; }
  int64_t& operator[](int axis) { return sizes_[axis]; }
  const int64_t* begin() const { return sizes_.data(); }
  const int64_t* end() const { return sizes_.data() + rank_; }
  // Product of the sizes (1 for rank 0).
  int64_t numel() const;
  // Appends an axis; throws Error past kMaxRank.
  void push_back(int64_t size);
  // "[2, 4, 5]"
  std::string str() const;

  friend bool operator==(const Shape& a, const Shape& b) {
    return a.rank_ == b.rank_ && std::equal(a.begin(), a.end(), b.begin());
  }

 private:
  std::array<int64_t, kMaxRank> sizes_{};
  int rank_ = 0;
};

// Strides (in elements) of a contiguous row-major tensor of this shape.
Shape row_major_strides(const Shape& shape);

namespace detail {
// The element count of a tensor of this shape; throws Error for a negative
// size or a count that overflows.
size_t checked_numel(const Shape& shape);
}  // namespace detail

// A non-owning, strided view of elements of type T (const T for read-only).
// A default-constructed view has rank 0 and no data.
template <class T>
class TensorView {
 public:
  using value_type = std::remove_const_t<T>;

  TensorView() = default;
  // Contiguous row-major view of `shape` starting at `data`.
  TensorView(T* data, Shape shape)
      : data_(data), shape_(shape), strides_(row_major_strides(shape)) {}
  // Arbitrary strides, in elements (may be 0 for broadcast reads).
  TensorView(T* data, Shape shape, Shape strides) : data_(data), shape_(shape), strides_(strides) {
    assert(shape.rank() == strides.rank());
  }
  // A mutable view converts to a read-only one.
  template <class U, class = std::enable_if_t<std::is_same_v<const U, T> && !std::is_same_v<U, T>>>
  TensorView(const TensorView<U>& other)
      : data_(other.data()), shape_(other.shape()), strides_(other.strides()) {}

  T* data() const { return data_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int rank() const { return shape_.rank(); }
  int64_t size(int axis) const { return shape_[axis]; }
  int64_t stride(int axis) const { return strides_[axis]; }
  int64_t numel() const { return shape_.numel(); }
  // True if the elements are laid out contiguously in row-major order.
  bool is_contiguous() const {
    int64_t expected = 1;
    for (int a = rank() - 1; a >= 0; --a) {
      if (shape_[a] != 1 && strides_[a] != expected) return false;
      expected *= shape_[a];
    }
    return true;
  }

  T& operator()() const { return *data_; }
  T& operator()(int64_t i0) const { return data_[i0 * strides_[0]]; }
  T& operator()(int64_t i0, int64_t i1) const { return data_[i0 * strides_[0] + i1 * strides_[1]]; }
  T& operator()(int64_t i0, int64_t i1, int64_t i2) const {
    return data_[i0 * strides_[0] + i1 * strides_[1] + i2 * strides_[2]];
  }
  T& operator()(int64_t i0, int64_t i1, int64_t i2, int64_t i3) const {
    return data_[i0 * strides_[0] + i1 * strides_[1] + i2 * strides_[2] + i3 * strides_[3]];
  }

  // The sub-view at index i of the first axis (rank drops by one).
  TensorView slice(int64_t i) const {
    Shape shape, strides;
    for (int a = 1; a < rank(); ++a) {
      shape.push_back(shape_[a]);
      strides.push_back(strides_[a]);
    }
    return TensorView(data_ + i * strides_[0], shape, strides);
  }

  // The same elements seen with a leading axis of size 1 (a batch of one).
  TensorView unsqueeze0() const {
    Shape shape{1}, strides{numel()};
    for (int a = 0; a < rank(); ++a) {
      shape.push_back(shape_[a]);
      strides.push_back(strides_[a]);
    }
    return TensorView(data_, shape, strides);
  }

 private:
  T* data_ = nullptr;
  Shape shape_;
  Shape strides_;
};

template <class T>
using ConstView = TensorView<const T>;

// An owning, contiguous, row-major tensor. Elements are value-initialised
// (zero) unless a fill value is given.
template <class T>
class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(Shape shape) : shape_(shape), data_(detail::checked_numel(shape)) {}
  Tensor(Shape shape, T fill) : shape_(shape), data_(detail::checked_numel(shape), fill) {}
  // Takes `values` (row-major, exactly shape.numel() of them; throws Error otherwise).
  Tensor(Shape shape, std::vector<T> values);
  // A contiguous copy of any view.
  static Tensor copy_of(ConstView<T> view);

  T* data() { return data_.data(); }
  const T* data() const { return data_.data(); }
  const Shape& shape() const { return shape_; }
  int rank() const { return shape_.rank(); }
  int64_t size(int axis) const { return shape_[axis]; }
  int64_t numel() const { return shape_.numel(); }
  // True for a default-constructed tensor (e.g. weights that were not asked for).
  bool empty() const { return shape_.rank() == 0 && data_.empty(); }
  std::vector<T>& values() { return data_; }
  const std::vector<T>& values() const { return data_; }

  TensorView<T> view() { return TensorView<T>(data_.data(), shape_); }
  ConstView<T> view() const { return ConstView<T>(data_.data(), shape_); }
  operator TensorView<T>() { return view(); }
  operator ConstView<T>() const { return view(); }

  template <class... I>
  T& operator()(I... i) {
    return view()(static_cast<int64_t>(i)...);
  }
  template <class... I>
  const T& operator()(I... i) const {
    return view()(static_cast<int64_t>(i)...);
  }

  // Same elements, new shape with the same number of elements (throws Error otherwise).
  Tensor reshaped(Shape shape) const&;
  Tensor reshaped(Shape shape) &&;

 private:
  Shape shape_;
  std::vector<T> data_;
};

// The batch-of-one rule of the qkv command and the Python bindings (the
// valid lengths' half is ValidLens::for_batch_of_one): an input without its
// batch axis stands for a batch of one, and its outputs are handed back
// without that axis.
// with_batch_axis: when batch_of_one and `view` has `unbatched_rank` axes,
// the same elements with a leading axis of 1; otherwise `view` itself (an
// input of another rank is left for the op's shape check to name).
template <class T>
TensorView<T> with_batch_axis(const TensorView<T>& view, bool batch_of_one, int unbatched_rank) {
  return batch_of_one && view.rank() == unbatched_rank ? view.unsqueeze0() : view;
}
// An output's shape as handed back: without its leading axis of 1 when
// batch_of_one, as it is otherwise.
inline Shape without_batch_axis(const Shape& shape, bool batch_of_one) {
  return batch_of_one ? Shape(shape.begin() + 1, shape.end()) : shape;
}

}  // namespace qkv
