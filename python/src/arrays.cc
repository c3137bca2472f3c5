// NumPy conversions for the bindings (arrays.h).
#include "arrays.h"

#include <Python.h>

#include <limits>
#include <string>

#include "qkv/error.h"

namespace qkv::python {
namespace {

std::string prefix(std::string_view fn, std::string_view name) {
  return std::string(fn) + ": " + std::string(name);
}

// np.asarray(obj), or a TypeError naming the argument.
py::array as_array(py::handle obj, std::string_view fn, std::string_view name,
                   std::string_view expected) {
  py::array array = py::array::ensure(obj);
  if (!array) {
    throw py::type_error(prefix(fn, name) + " is a " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))) +
                         " that NumPy cannot turn into an array; expected " +
                         std::string(expected));
  }
  return array;
}

bool native_order(const py::dtype& dt) {
  const char order = dt.byteorder();
  return order == '=' || order == '|' || (order == '<') == (PY_BIG_ENDIAN == 0);
}

std::string dtype_str(const py::dtype& dt) { return py::cast<std::string>(dt.attr("__str__")()); }

}  // namespace

py::array float_array(py::handle obj, std::string_view fn, std::string_view name) {
  py::array array = as_array(obj, fn, name, "a float32 or float64 array");
  const py::dtype dt = array.dtype();
  if (dt.kind() == 'f' && (dt.itemsize() == 4 || dt.itemsize() == 8)) {
    if (!native_order(dt)) array = array.attr("astype")(dt.attr("newbyteorder")("="));
    return array;
  }
  throw py::type_error(prefix(fn, name) + " has dtype " + dtype_str(dt) +
                       "; expected float32 or float64");
}

py::array out_array(py::handle obj, std::string_view fn, std::string_view name, Dtype dtype) {
  if (!py::isinstance<py::array>(obj)) {
    throw py::type_error(prefix(fn, name) + " is a " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))) +
                         "; expected a NumPy array to write into");
  }
  py::array array = py::reinterpret_borrow<py::array>(obj);
  const py::dtype dt = array.dtype();
  const bool right_type =
      dt.kind() == 'f' && native_order(dt) && dt.itemsize() == (dtype == Dtype::kFloat32 ? 4 : 8);
  if (!right_type) {
    throw py::type_error(prefix(fn, name) + " has dtype " + dtype_str(dt) + "; expected " +
                         (dtype == Dtype::kFloat32 ? "float32" : "float64") +
                         ", the inputs' dtype");
  }
  if (!array.writeable()) throw Error(prefix(fn, name) + " is read-only");
  bool placed = reinterpret_cast<uintptr_t>(array.data()) % dt.itemsize() == 0;
  for (py::ssize_t a = 0; a < array.ndim(); ++a)
    placed = placed && array.strides(a) % dt.itemsize() == 0;
  if (!placed) {
    throw Error(prefix(fn, name) +
                " is not aligned to its elements; pass an array qkv can "
                "write in place");
  }
  return array;
}

namespace {
// [lowest, highest) byte an array's elements span; empty for no elements.
std::pair<uintptr_t, uintptr_t> byte_span(const py::array& a) {
  auto low = reinterpret_cast<uintptr_t>(a.data());
  uintptr_t high = low;
  for (py::ssize_t axis = 0; axis < a.ndim(); ++axis) {
    if (a.shape(axis) == 0) return {0, 0};
    const py::ssize_t step = a.strides(axis) * (a.shape(axis) - 1);
    if (step < 0)
      low -= static_cast<uintptr_t>(-step);
    else
      high += static_cast<uintptr_t>(step);
  }
  return {low, high + static_cast<uintptr_t>(a.itemsize())};
}
}  // namespace

bool may_share_memory(const py::array& a, const py::array& b) {
  const auto [a_low, a_high] = byte_span(a);
  const auto [b_low, b_high] = byte_span(b);
  return a_low < a_high && b_low < b_high && a_low < b_high && b_low < a_high;
}

Dtype dtype_of(const py::array& array) {
  return array.dtype().itemsize() == 4 ? Dtype::kFloat32 : Dtype::kFloat64;
}

void check_same_dtype(const py::array& array, Dtype expected, std::string_view fn,
                      std::string_view name, std::string_view first_name) {
  if (dtype_of(array) == expected) return;
  const char* want = expected == Dtype::kFloat32 ? "float32" : "float64";
  throw py::type_error(prefix(fn, name) + " has dtype " + dtype_str(array.dtype()) + " but " +
                       std::string(first_name) + " has " + want +
                       "; pass all of them in one dtype");
}

ConstView<bfloat16> bf16_view_of(py::handle obj, std::string_view fn, std::string_view name) {
  py::array array = as_array(obj, fn, name, "the int16 bits of bfloat16 values");
  const py::dtype dt = array.dtype();
  if (!((dt.kind() == 'i' || dt.kind() == 'u') && dt.itemsize() == 2 && native_order(dt))) {
    throw py::type_error(prefix(fn, name) + " has dtype " + dtype_str(dt) +
                         "; expected the int16 bits of bfloat16 values");
  }
  // bfloat16 is one uint16_t: the same layout, viewed as such.
  const ConstView<uint16_t> bits = view_of<uint16_t>(array);
  return ConstView<bfloat16>(reinterpret_cast<const bfloat16*>(bits.data()), bits.shape(),
                             bits.strides());
}

py::array int_array(py::handle obj, std::string_view fn, std::string_view name,
                    bool int32_in_place) {
  py::array array = as_array(obj, fn, name, "integers (int32 or int64)");
  const py::dtype dt = array.dtype();
  if (dt.kind() != 'i' && dt.kind() != 'u') {
    throw py::type_error(prefix(fn, name) + " has dtype " + dtype_str(dt) +
                         "; expected integers (int32 or int64)");
  }
  const bool in_place = dt.kind() == 'i' && native_order(dt) &&
                        (dt.itemsize() == 8 || (int32_in_place && dt.itemsize() == 4));
  if (dt.kind() == 'u' && dt.itemsize() == 8 && array.size() > 0) {
    // astype("int64") would wrap 2^64 - 1 to -1, and the message name -1.
    const auto largest = py::cast<unsigned long long>(array.attr("max")());
    if (largest > static_cast<unsigned long long>(std::numeric_limits<int64_t>::max())) {
      throw Error(prefix(fn, name) + " holds " + std::to_string(largest) + " (" + dtype_str(dt) +
                  "), beyond any length (int64)");
    }
  }
  return in_place ? array : py::array(array.attr("astype")("int64"));
}

ValidLens valid_lens_of(py::handle obj, std::string_view fn, py::object& storage) {
  if (obj.is_none()) return {};
  py::array array = int_array(obj, fn, "valid_lens", true);
  storage = array;
  if (array.dtype().itemsize() == 4) return ValidLens(view_of<int32_t>(array));
  return ValidLens(view_of<int64_t>(array));
}

std::string shape_str(const py::array& array) {
  std::string text = "[";
  for (py::ssize_t a = 0; a < array.ndim(); ++a) {
    if (a > 0) text.append(", ");
    text.append(std::to_string(array.shape(a)));
  }
  return text.append("]");
}

void check_rank_2_or_3(const py::array& array, std::string_view fn, std::string_view name,
                       std::string_view axes3, std::string_view axes2, std::string_view axes4) {
  if (array.ndim() == 2 || array.ndim() == 3 || (!axes4.empty() && array.ndim() == 4)) return;
  const std::string heads = axes4.empty() ? "" : "rank 4 " + std::string(axes4) + ", ";
  throw Error(prefix(fn, name) + " has shape " + shape_str(array) + "; expected " + heads +
              "rank 3 " + std::string(axes3) + " or rank 2 " + std::string(axes2) +
              ", a batch of one");
}

void check_same_rank(const std::vector<std::pair<std::string_view, const py::array*>>& arrays,
                     std::string_view fn, std::string_view allowed) {
  bool same = true;
  for (const auto& [name, array] : arrays) same = same && array->ndim() == arrays[0].second->ndim();
  if (same) return;
  std::string names, ranks;
  for (size_t i = 0; i < arrays.size(); ++i) {
    if (i > 0) {
      names.append(i + 1 == arrays.size() ? " and " : ", ");
      ranks.append(", ");
    }
    names.append(arrays[i].first);
    ranks.append(std::to_string(arrays[i].second->ndim()));
  }
  throw Error(std::string(fn) + ": " + names + " must be " + std::string(allowed) + "; got ranks " +
              ranks);
}

uint64_t seed_of(py::handle obj, std::string_view fn) {
  if (PyBool_Check(obj.ptr()) || !PyIndex_Check(obj.ptr())) {
    throw py::type_error(prefix(fn, "seed") + " is a " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))) +
                         "; expected a whole number in [0, 2**64)");
  }
  PyObject* index = PyNumber_Index(obj.ptr());
  if (index == nullptr) throw py::error_already_set();
  const py::int_ value = py::reinterpret_steal<py::int_>(index);
  const unsigned long long seed = PyLong_AsUnsignedLongLong(value.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    throw py::value_error(prefix(fn, "seed") + " = " +
                          py::cast<std::string>(value.attr("__str__")()) +
                          " is outside [0, 2**64)");
  }
  return seed;
}

Shape shape_of(const py::array& array) {
  Shape shape;
  for (py::ssize_t a = 0; a < array.ndim(); ++a) shape.push_back(array.shape(a));
  return shape;
}

}  // namespace qkv::python
