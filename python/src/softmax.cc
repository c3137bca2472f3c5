// Masked softmax and its backward for NumPy arrays.
#include "arrays.h"
#include "bindings.h"
#include "qkv/masked_softmax.h"

namespace qkv::python {
namespace {

constexpr std::string_view kSoftmax = "masked_softmax";
constexpr std::string_view kSoftmaxBackward = "masked_softmax_backward";

// The lengths as the library takes them: 2-D scores (named `scores_name`)
// are a batch of one.
ValidLens lens_for(const ValidLens& lens, const Shape& scores_shape, std::string_view fn,
                   std::string_view scores_name) {
  return scores_shape.rank() == 3
             ? lens
             : lens.for_batch_of_one(fn, "valid_lens", scores_name, scores_shape);
}

// Scores (Nq, Nk) are a batch of one.
template <class V>
V batched(const V& view) {
  return with_batch_axis(view, true, 2);
}

template <class T>
py::array forward(py::array& x, py::handle lens_obj) {
  const ConstView<T> scores = view_of<T>(x);
  py::object lens_storage;
  const ValidLens lens =
      lens_for(valid_lens_of(lens_obj, kSoftmax, lens_storage), scores.shape(), kSoftmax, "X");
  auto [weights, out] = new_array<T>(scores.shape());
  {
    const ReleasedGil release;
    masked_softmax(batched(scores), lens, batched(out));
  }
  return weights;
}

template <class T>
py::array backward(py::array& w, py::array& g, py::handle lens_obj) {
  const ConstView<T> weights = view_of<T>(w), d_weights = view_of<T>(g);
  py::object lens_storage;
  const ValidLens lens = lens_for(valid_lens_of(lens_obj, kSoftmaxBackward, lens_storage),
                                  weights.shape(), kSoftmaxBackward, "weights");
  auto [d_scores, out] = new_array<T>(weights.shape());
  {
    const ReleasedGil release;
    masked_softmax_backward(batched(weights), batched(d_weights), lens, batched(out));
  }
  return d_scores;
}

py::array masked_softmax_py(py::handle x_obj, py::handle lens_obj) {
  py::array x = float_array(x_obj, kSoftmax, "X");
  check_rank_2_or_3(x, kSoftmax, "X", "(B, Nq, Nk)", "(Nq, Nk)");
  return dtype_of(x) == Dtype::kFloat32 ? forward<float>(x, lens_obj)
                                        : forward<double>(x, lens_obj);
}

py::array masked_softmax_backward_py(py::handle w_obj, py::handle g_obj, py::handle lens_obj) {
  py::array w = float_array(w_obj, kSoftmaxBackward, "weights");
  py::array g = float_array(g_obj, kSoftmaxBackward, "d_weights");
  check_rank_2_or_3(w, kSoftmaxBackward, "weights", "(B, Nq, Nk)", "(Nq, Nk)");
  check_same_dtype(g, dtype_of(w), kSoftmaxBackward, "d_weights", "weights");
  if (g.ndim() != w.ndim()) check_same_rank({{"weights", &w}, {"d_weights", &g}}, kSoftmaxBackward);
  return dtype_of(w) == Dtype::kFloat32 ? backward<float>(w, g, lens_obj)
                                        : backward<double>(w, g, lens_obj);
}

}  // namespace

void register_softmax(py::module_& m) {
  m.def("masked_softmax", &masked_softmax_py, py::arg("X"), py::arg("valid_lens") = py::none(),
        R"(Softmax over the last axis with the keys past each row's valid length masked.

For row (b, i) with valid length L, weights[b, i, j] = exp(X[b, i, j] - m) /
sum_{j' < L} exp(X[b, i, j'] - m) for j < L and 0 for j >= L. Masking is
exact: masked scores are never read (d2l's -1e6 sentinel is not used), so
L = 0 gives a row of zeros, not d2l's uniform row. -inf is a legal score;
NaN or +inf among a row's valid scores makes that row NaN.

Arguments:
    X: the scores, float32 or float64, (B, Nq, Nk) or (Nq, Nk) (a batch of
        one); any strides. Read in place, never copied.
    valid_lens: None (every key valid), (B) one length per batch element or
        (B, Nq) one per query; for 2-D X a scalar or (1) or (Nq) or (1, Nq).
        Integers (int32 and int64 arrays are read in place); each in [0, Nk].

Returns:
    The weights, a new array of X's dtype and shape.

Raises:
    TypeError: X is not float32/float64, or valid_lens is not integers.
    qkv.Error (a ValueError): shapes that do not fit, or a length outside
        [0, Nk]; the message names the arguments and their shapes.

>>> import numpy as np, qkv
>>> qkv.masked_softmax(np.zeros((1, 2, 4), np.float32), [3]).round(3)
array([[[0.333, 0.333, 0.333, 0.   ],
        [0.333, 0.333, 0.333, 0.   ]]], dtype=float32)
)");
  m.def("masked_softmax_backward", &masked_softmax_backward_py, py::arg("weights"),
        py::arg("d_weights"), py::arg("valid_lens") = py::none(),
        R"(Gradient of a loss with respect to masked_softmax's scores.

d_scores[j] = w[j] * (d_weights[j] - sum_k w[k] d_weights[k]) for j < L, and
0 for the masked j >= L (no gradient flows into valid_lens).

Arguments:
    weights: masked_softmax's result, float32 or float64, (B, Nq, Nk) or
        (Nq, Nk).
    d_weights: the gradient of the loss with respect to the weights, same
        shape and dtype.
    valid_lens: the lengths the forward got (see masked_softmax).

Returns:
    d_scores, a new array of weights' shape and dtype.

Raises:
    TypeError: a dtype that is not float32/float64, or two different ones.
    qkv.Error (a ValueError): shapes that do not fit.

>>> w = qkv.masked_softmax(np.zeros((1, 1, 2)))
>>> qkv.masked_softmax_backward(w, np.array([[[1.0, 0.0]]]))
array([[[ 0.25, -0.25]]])
)");
}

}  // namespace qkv::python
