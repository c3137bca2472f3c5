// Attention pooling with given weights and its special cases (average
// pooling, one-hot lookup), for NumPy arrays. 2-D arguments are a batch of
// one, as everywhere in the bindings.
#include "qkv/pooling.h"

#include "arrays.h"
#include "bindings.h"

namespace qkv::python {
namespace {

template <class T>
py::array unbatched(Tensor<T>&& t, bool batch_of_one) {
  const Shape shape = without_batch_axis(t.shape(), batch_of_one);
  return to_numpy(std::move(t), shape);
}

py::array attention_pooling_py(py::handle weights_obj, py::handle values_obj) {
  constexpr std::string_view kFn = "attention_pooling";
  py::array w = float_array(weights_obj, kFn, "weights");
  py::array v = float_array(values_obj, kFn, "values");
  check_rank_2_or_3(w, kFn, "weights", "(B, Nq, Nk)", "(Nq, Nk)");
  check_same_rank({{"weights", &w}, {"values", &v}}, kFn);
  check_same_dtype(v, dtype_of(w), kFn, "values", "weights");
  const bool one = w.ndim() == 2;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const ConstView<T> wv = with_batch_axis(view_of<T>(w), one, 2),
                       vv = with_batch_axis(view_of<T>(v), one, 2);
    Tensor<T> out;
    {
      const ReleasedGil release;
      out = attention_pooling(wv, vv);
    }
    return unbatched(std::move(out), one);
  };
  return dtype_of(w) == Dtype::kFloat32 ? run(float{}) : run(double{});
}

py::array average_pooling_py(py::handle values_obj, int64_t num_queries, py::handle lens_obj) {
  constexpr std::string_view kFn = "average_pooling";
  py::array v = float_array(values_obj, kFn, "values");
  check_rank_2_or_3(v, kFn, "values", "(B, Nk, Dv)", "(Nk, Dv)");
  const bool one = v.ndim() == 2;
  py::object storage;
  ValidLens lens = valid_lens_of(lens_obj, kFn, storage);
  if (one)
    lens = lens.for_batch_of_one(kFn, "valid_lens", "weights", Shape{num_queries, v.shape(0)});
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const ConstView<T> values = with_batch_axis(view_of<T>(v), one, 2);
    Tensor<T> out;
    {
      const ReleasedGil release;
      out = average_pooling(values, num_queries, lens);
    }
    return unbatched(std::move(out), one);
  };
  return dtype_of(v) == Dtype::kFloat32 ? run(float{}) : run(double{});
}

py::array one_hot_lookup_py(py::handle index_obj, py::handle values_obj) {
  constexpr std::string_view kFn = "one_hot_lookup";
  py::array index = int_array(index_obj, kFn, "index", false);
  py::array v = float_array(values_obj, kFn, "values");
  check_rank_2_or_3(v, kFn, "values", "(B, Nk, Dv)", "(Nk, Dv)");
  const bool one = v.ndim() == 2;
  const ConstView<int64_t> iv = with_batch_axis(view_of<int64_t>(index), one, 1);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const ConstView<T> values = with_batch_axis(view_of<T>(v), one, 2);
    Tensor<T> out;
    {
      const ReleasedGil release;
      out = one_hot_lookup(iv, values);
    }
    return unbatched(std::move(out), one);
  };
  return dtype_of(v) == Dtype::kFloat32 ? run(float{}) : run(double{});
}

py::array one_hot_weights_py(py::handle index_obj, int64_t num_keys) {
  constexpr std::string_view kFn = "one_hot_weights";
  py::array index = int_array(index_obj, kFn, "index", false);
  const bool one = index.ndim() == 1;
  const ConstView<int64_t> iv = with_batch_axis(view_of<int64_t>(index), one, 1);
  return unbatched(one_hot_weights(iv, num_keys), one);
}

py::array uniform_weights_py(int64_t batch, int64_t num_queries, int64_t num_keys,
                             py::handle lens_obj) {
  py::object storage;
  const ValidLens lens = valid_lens_of(lens_obj, "uniform_weights", storage);
  return to_numpy(uniform_weights(batch, num_queries, num_keys, lens));
}

}  // namespace

void register_pooling(py::module_& m) {
  m.def("attention_pooling", &attention_pooling_py, py::arg("weights"), py::arg("values"),
        R"(Attention pooling with given weights: output[b, i] = sum_j weights[b, i, j] values[b, j].

Any weights, convex or not (d2l 11.1's Attention(q, D) = sum_i alpha(q, k_i) v_i).

Arguments:
    weights: (B, Nq, Nk); values: (B, Nk, Dv); or both 2-D (a batch of one).
        float32 or float64, one dtype.

Returns:
    output (B, Nq, Dv) (2-D: (Nq, Dv)), a new array of the inputs' dtype.

Raises:
    TypeError: dtypes that are not float32/float64, or two different ones.
    qkv.Error (a ValueError): shapes that do not fit.

>>> qkv.attention_pooling(np.array([[0.5, 0.5]]), np.array([[1.0], [3.0]]))
array([[2.]])
)");
  m.def("average_pooling", &average_pooling_py, py::arg("values"), py::arg("num_queries"),
        py::arg("valid_lens") = py::none(),
        R"(Average pooling: every query gets the mean of the first L values (uniform weights 1/L).

Arguments:
    values: (B, Nk, Dv) or (Nk, Dv) (a batch of one), float32 or float64.
    num_queries: Nq, how many queries get the mean.
    valid_lens: None, (B) or (B, Nq) (2-D values: a scalar, (1), (Nq) or
        (1, Nq)); a row with L = 0 gets zeros.

Returns:
    (B, Nq, Dv) (2-D: (Nq, Dv)), the values' dtype.

Raises:
    TypeError, qkv.Error (a ValueError): bad dtypes, shapes or lengths.

>>> qkv.average_pooling(np.array([[1.0], [3.0], [8.0]]), 2, [[2, 3]])
array([[2.],
       [4.]])
)");
  m.def("one_hot_lookup", &one_hot_lookup_py, py::arg("index"), py::arg("values"),
        R"(Exact database lookup: output[b, i] = values[b, index[b, i]] (one-hot weights).

Arguments:
    index: (B, Nq) integers in [0, Nk); with 2-D values, (Nq) (a batch of one).
    values: (B, Nk, Dv) or (Nk, Dv), float32 or float64.

Returns:
    (B, Nq, Dv) (2-D values: (Nq, Dv)), the values' dtype.

Raises:
    TypeError: index not integers, values not float32/float64.
    qkv.Error (a ValueError): an index outside [0, Nk), or shapes that do not fit.

>>> qkv.one_hot_lookup([1, 0], np.array([[10.0], [20.0]]))
array([[20.],
       [10.]])
)");
  m.def("one_hot_weights", &one_hot_weights_py, py::arg("index"), py::arg("num_keys"),
        R"(One-hot weights: 1 at key index[b, i], 0 elsewhere (float32).

Arguments:
    index: (B, Nq) integers in [0, num_keys), or (Nq) for a batch of one.
    num_keys: Nk.

Returns:
    (B, Nq, Nk) float32 (1-D index: (Nq, Nk)).

Raises:
    qkv.Error (a ValueError): an index outside [0, num_keys).

>>> qkv.one_hot_weights([2], 3)
array([[0., 0., 1.]], dtype=float32)
)");
  m.def("uniform_weights", &uniform_weights_py, py::arg("batch"), py::arg("num_queries"),
        py::arg("num_keys"), py::arg("valid_lens") = py::none(),
        R"(Uniform weights 1/L over the first L keys of each row (float32).

Arguments:
    batch, num_queries, num_keys: B, Nq, Nk (each >= 0).
    valid_lens: None (L = Nk), (B) or (B, Nq); a row with L = 0 is zeros.

Returns:
    (B, Nq, Nk) float32.

Raises:
    qkv.Error (a ValueError): negative sizes, lengths of the wrong shape or
        outside [0, Nk].

>>> qkv.uniform_weights(1, 1, 4, [2])
array([[[0.5, 0.5, 0. , 0. ]]], dtype=float32)
)");
}

}  // namespace qkv::python
