// NumPy arrays in and out of qkv for the bindings: caller arrays become
// views over their memory (no copy), results are NumPy arrays that qkv
// writes into or whose memory a qkv Tensor owns. Every check names the
// Python function and argument, as the library's own messages do.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qkv/bfloat16.h"
#include "qkv/tensor.h"
#include "qkv/valid_lens.h"

namespace qkv::python {

namespace py = pybind11;

enum class Dtype { kFloat32, kFloat64 };

// np.asarray(obj) as a float32 or float64 array, without a copy when obj
// already is one in native byte order. A float array in the other byte
// order is converted (a copy); integers, bools, complex, float16 and
// objects are a TypeError: "fn: name has dtype int64; expected float32 or
// float64". So is a NumPy array's dtype that qkv does not compute in.
py::array float_array(py::handle obj, std::string_view fn, std::string_view name);

// A caller's array to write a result into (NumPy's `out=`): an ndarray of
// `dtype` in native byte order, writeable, aligned to its elements (else a
// TypeError or qkv::Error naming fn and name); its shape and layout are the
// library's to check. mutable_view_of gives the view qkv writes.
py::array out_array(py::handle obj, std::string_view fn, std::string_view name, Dtype dtype);
// Whether the bytes a and b span (from their lowest to their highest
// element, whatever the strides) overlap: NumPy's may_share_memory.
bool may_share_memory(const py::array& a, const py::array& b);
template <class T>
TensorView<T> mutable_view_of(py::array& array) {
  Shape shape, strides;
  for (py::ssize_t a = 0; a < array.ndim(); ++a) {
    shape.push_back(array.shape(a));
    strides.push_back(array.strides(a) / static_cast<py::ssize_t>(sizeof(T)));
  }
  return TensorView<T>(static_cast<T*>(array.mutable_data()), shape, strides);
}

// The dtype of a float_array result.
Dtype dtype_of(const py::array& array);

// Throws TypeError unless `array` has dtype `expected` ("fn: keys has dtype
// float64 but queries has float32; pass all of them in one dtype").
void check_same_dtype(const py::array& array, Dtype expected, std::string_view fn,
                      std::string_view name, std::string_view first_name);

// A view over the array's memory with its strides (negative and zero
// strides too). The array must outlive the view. An array whose memory is
// not aligned to its element size, or whose strides are not whole elements
// (views into bytes or records), is first copied (the only copy a binding
// makes of a caller's float array), so `array` may be replaced.
template <class T>
ConstView<T> view_of(py::array& array) {
  auto misplaced = [&] {
    if (reinterpret_cast<uintptr_t>(array.data()) % alignof(T) != 0) return true;
    for (py::ssize_t a = 0; a < array.ndim(); ++a) {
      if (array.strides(a) % static_cast<py::ssize_t>(sizeof(T)) != 0) return true;
    }
    return false;
  };
  if (misplaced()) array = py::array_t<T, py::array::c_style | py::array::forcecast>(array);
  Shape shape, strides;
  for (py::ssize_t a = 0; a < array.ndim(); ++a) {
    shape.push_back(array.shape(a));
    strides.push_back(array.strides(a) / static_cast<py::ssize_t>(sizeof(T)));
  }
  return ConstView<T>(static_cast<const T*>(array.data()), shape, strides);
}

// torch.bfloat16 tensors reach the bindings as int16 or uint16 arrays of
// their bits (tensor.view(torch.int16).numpy()); this views them as bf16.
ConstView<bfloat16> bf16_view_of(py::handle obj, std::string_view fn, std::string_view name);

// A new C-order array of `shape` and the view qkv writes into.
template <class T>
std::pair<py::array_t<T>, TensorView<T>> new_array(const Shape& shape) {
  std::vector<py::ssize_t> dims(shape.begin(), shape.end());
  py::array_t<T> array(dims);
  return {array, TensorView<T>(array.mutable_data(), shape)};
}

// A Tensor's memory handed to NumPy without a copy: the array owns the
// Tensor and frees it with the array. `shape` must have its element count.
template <class T>
py::array_t<T> to_numpy(Tensor<T>&& tensor, const Shape& shape) {
  auto* owned = new Tensor<T>(std::move(tensor));
  py::capsule owner(owned, [](void* p) { delete static_cast<Tensor<T>*>(p); });
  std::vector<py::ssize_t> dims(shape.begin(), shape.end());
  return py::array_t<T>(dims, owned->data(), owner);
}
template <class T>
py::array_t<T> to_numpy(Tensor<T>&& tensor) {
  const Shape shape = tensor.shape();
  return to_numpy(std::move(tensor), shape);
}

// An integer array (np.asarray(obj)): int64 in place, int32 in place when
// `int32_in_place`, other integer types converted to int64; anything else
// is a TypeError naming fn and name.
py::array int_array(py::handle obj, std::string_view fn, std::string_view name,
                    bool int32_in_place);

// Valid lengths from None, an integer array, list, tuple or scalar. int32
// and int64 arrays are viewed in place; other integer types are converted
// to int64; anything else is a TypeError. `storage` keeps the array alive.
ValidLens valid_lens_of(py::handle obj, std::string_view fn, py::object& storage);

// The rank of a tensor argument that takes 3 axes or 2 (a batch of one), or
// also 4 (heads) when axes4 is given: qkv::Error (qkv.Error, a ValueError)
// "fn: name has shape [..]; expected rank 3 (axes3) or rank 2 (axes2), a
// batch of one" otherwise.
void check_rank_2_or_3(const py::array& array, std::string_view fn, std::string_view name,
                       std::string_view axes3, std::string_view axes2, std::string_view axes4 = {});

// Throws qkv::Error unless all the arrays have one rank, naming them:
// "fn: queries, keys and values must be all 2-D or all 3-D; got ranks 2, 3, 3".
void check_same_rank(const std::vector<std::pair<std::string_view, const py::array*>>& arrays,
                     std::string_view fn, std::string_view allowed = "all 2-D or all 3-D");

// A dropout probability or seed from Python, checked: a seed is a whole
// number in [0, 2^64) (TypeError for a non-integer, ValueError outside).
uint64_t seed_of(py::handle obj, std::string_view fn);

// An array's shape as a qkv Shape (ValueError beyond qkv's 4 axes).
Shape shape_of(const py::array& array);
// An array's shape for messages, "[2, 3, 4]", for any rank.
std::string shape_str(const py::array& array);

}  // namespace qkv::python
