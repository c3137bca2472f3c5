// merge_attention for NumPy arrays: partial attention results over disjoint
// key sets (outputs and lses) merged into the result over their union.
#include "qkv/merge.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "arrays.h"
#include "bindings.h"

namespace qkv::python {
namespace {

constexpr std::string_view kFn = "merge_attention";

py::handle merged_type;  // qkv.MergedAttention: a namedtuple made at import, held by the module

// The arrays of a list or tuple argument, each named "name[s]".
std::vector<py::array> float_arrays(py::handle seq, std::string_view name) {
  if (!py::isinstance<py::list>(seq) && !py::isinstance<py::tuple>(seq)) {
    throw py::type_error(std::string(kFn) + ": " + std::string(name) + " is a " +
                         std::string(py::str(seq.get_type().attr("__name__"))) +
                         "; expected a list or tuple of arrays");
  }
  std::vector<py::array> arrays;
  size_t s = 0;
  for (py::handle item : seq) {
    arrays.push_back(float_array(item, kFn, std::string(name) + "[" + std::to_string(s++) + "]"));
  }
  return arrays;
}

using Dims = std::vector<py::ssize_t>;

Dims dims_of(const py::array& a) { return Dims(a.shape(), a.shape() + a.ndim()); }

std::string dims_str(const Dims& dims) {
  std::string text = "[";
  for (size_t a = 0; a < dims.size(); ++a) text += (a ? ", " : "") + std::to_string(dims[a]);
  return text + "]";
}

// qkv's views hold at most kMaxRank (4) axes, and the merge is row by row:
// outputs (..., Nq, Dv) of a higher rank (xformers' grouped heads: (B, G,
// H, Nq, Dv)) are merged as (rows, Nq, Dv) and their lses as (rows, Nq), the
// leading axes folded into one (NumPy's reshape: a copy only where the
// strides do not fold). Their shapes are checked first, as given and in the
// library's words (src/ops/merge.cc), since two different shapes may fold
// alike. Returns the outputs' shape to unfold the results to, or nothing
// when every array fits a view as it is.
std::optional<Dims> fold_leading_axes(std::vector<py::array>& outputs,
                                      std::vector<py::array>& lses) {
  const auto high = [](const py::array& a) { return a.ndim() > kMaxRank; };
  if (std::none_of(outputs.begin(), outputs.end(), high) &&
      std::none_of(lses.begin(), lses.end(), high)) {
    return std::nullopt;
  }
  const auto fail = [](const std::string& message) {
    throw Error(std::string(kFn) + ": " + message);
  };
  if (lses.size() != outputs.size()) {  // outputs is not empty: one of them is high
    fail("outputs has " + std::to_string(outputs.size()) + " parts but lses has " +
         std::to_string(lses.size()) + "; expected one lse per output");
  }
  const Dims shape = dims_of(outputs[0]);
  if (shape.size() < 2) {
    fail("outputs[0] has shape " + dims_str(shape) + "; expected rank >= 2 (..., Nq, Dv)");
  }
  const Dims lse_shape(shape.begin(), shape.end() - 1);
  for (size_t s = 0; s < outputs.size(); ++s) {
    const std::string part = "[" + std::to_string(s) + "]";
    if (dims_of(outputs[s]) != shape) {
      fail("outputs" + part + " has shape " + dims_str(dims_of(outputs[s])) +
           " but outputs[0] has shape " + dims_str(shape) + "; every part has one shape");
    }
    if (dims_of(lses[s]) != lse_shape) {
      fail("lses" + part + " has shape " + dims_str(dims_of(lses[s])) + "; expected " +
           dims_str(lse_shape) + " (the outputs' shape " + dims_str(shape) + " without Dv)");
    }
  }
  const py::ssize_t nq = shape[shape.size() - 2], dv = shape.back();
  const py::ssize_t rows =
      std::accumulate(shape.begin(), shape.end() - 2, py::ssize_t{1}, std::multiplies<>());
  for (py::array& a : outputs) a = py::array(a.attr("reshape")(rows, nq, dv));
  for (py::array& a : lses) a = py::array(a.attr("reshape")(rows, nq));
  return shape;
}

py::object merge_attention_py(py::handle outputs_obj, py::handle lses_obj) {
  std::vector<py::array> outputs = float_arrays(outputs_obj, "outputs");
  std::vector<py::array> lses = float_arrays(lses_obj, "lses");
  const Dtype dtype = outputs.empty() ? Dtype::kFloat32 : dtype_of(outputs[0]);
  for (size_t s = 0; s < outputs.size(); ++s) {
    check_same_dtype(outputs[s], dtype, kFn, "outputs[" + std::to_string(s) + "]", "outputs[0]");
  }
  for (size_t s = 0; s < lses.size(); ++s) {
    check_same_dtype(lses[s], dtype, kFn, "lses[" + std::to_string(s) + "]", "outputs[0]");
  }
  const std::optional<Dims> unfolded = fold_leading_axes(outputs, lses);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    std::vector<ConstView<T>> output_views, lse_views;
    for (py::array& a : outputs) output_views.push_back(view_of<T>(a));
    for (py::array& a : lses) lse_views.push_back(view_of<T>(a));
    MergedAttention<T> merged;
    {
      const ReleasedGil release;
      merged = merge_attention(output_views, lse_views);
    }
    py::array output = to_numpy(std::move(merged.output)), lse = to_numpy(std::move(merged.lse));
    if (unfolded) {  // views of the new arrays: no copy
      const Dims& shape = *unfolded;
      output = py::array(output.attr("reshape")(py::tuple(py::cast(shape))));
      lse =
          py::array(lse.attr("reshape")(py::tuple(py::cast(Dims(shape.begin(), shape.end() - 1)))));
    }
    return merged_type(output, lse);
  };
  return dtype == Dtype::kFloat32 ? run(float{}) : run(double{});
}

}  // namespace

void register_merge(py::module_& m) {
  m.attr("MergedAttention") =
      py::module_::import("collections")
          .attr("namedtuple")("MergedAttention", py::make_tuple("output", "lse"));
  m.attr("MergedAttention").attr("__module__") = "qkv";
  merged_type = m.attr("MergedAttention");

  m.def("merge_attention", &merge_attention_py, py::arg("outputs"), py::arg("lses"),
        R"(Merges attention computed over disjoint parts of a key set into attention over all of it.

Per row, parts s in the order given: lse = log sum_s exp(lse_s) and
output = sum_s exp(lse_s - lse) output_s, summed in double with the largest
lse_s taken out first. A part with lse -inf (no keys) has weight 0 and is not
read; a row whose parts are all -inf gets lse -inf and output 0; a NaN or
+inf lse makes the row NaN. The backward of a split key set is each part's
backward given the merged output and lse (docs/semantics.md).

Arguments:
    outputs: list or tuple of arrays (..., Nq, Dv), one shape of any rank
        >= 2 (leading axes past qkv's four are folded into one: the merge
        is row by row), e.g. the outputs of scaled_dot_product_attention
        over each part of the keys.
    lses: their log-sum-exps (..., Nq) (return_lse=True), one per output.
        float32 or float64, one dtype for all.

Returns:
    MergedAttention(output, lse): new arrays of the inputs' shapes and dtype.

Raises:
    TypeError: outputs or lses not a list or tuple, dtypes that are not
        float32/float64, or two different ones.
    qkv.Error (a ValueError): no parts, different counts or shapes.

>>> rng = np.random.default_rng(0)
>>> queries, keys, values = rng.normal(size=(2, 4)), rng.normal(size=(10, 4)), rng.normal(size=(10, 3))
>>> o1, l1 = qkv.scaled_dot_product_attention(queries, keys[:6], values[:6], return_lse=True)
>>> o2, l2 = qkv.scaled_dot_product_attention(queries, keys[6:], values[6:], return_lse=True)
>>> merged = qkv.merge_attention([o1, o2], [l1, l2])
>>> whole, lse = qkv.scaled_dot_product_attention(queries, keys, values, return_lse=True)
>>> bool(np.allclose(merged.output, whole) and np.allclose(merged.lse, lse))
True
)");
}

}  // namespace qkv::python
