// Scaled dot-product, additive, bilinear and distance attention, forward and
// backward, for NumPy arrays (float32, float64), and the bf16 entry points qkv.torch uses
// for torch.bfloat16 tensors. Inputs are views over the caller's arrays;
// forward results are new arrays qkv writes into; gradients are the
// library's tensors handed to NumPy without a copy.
#include "qkv/attention.h"

#include <pybind11/stl.h>

#include <cmath>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "arrays.h"
#include "bindings.h"
#include "qkv/error.h"
#include "qkv/scoring.h"

namespace qkv::python {
namespace {

constexpr std::string_view kSdpa = "scaled_dot_product_attention";
constexpr std::string_view kSdpaBackward = "scaled_dot_product_attention_backward";
constexpr std::string_view kAdditive = "additive_attention";
constexpr std::string_view kAdditiveBackward = "additive_attention_backward";
constexpr std::string_view kBilinear = "bilinear_attention";
constexpr std::string_view kBilinearBackward = "bilinear_attention_backward";
constexpr std::string_view kDistance = "distance_attention";
constexpr std::string_view kDistanceBackward = "distance_attention_backward";

// The gradient tuples (namedtuples made at import, attributes of the module).
py::handle sdpa_grads_type, sdpa_bias_grads_type, additive_grads_type, bilinear_grads_type;

// causal: None, "top-left" (torch's is_causal) or "bottom-right". Taken as
// any object and checked here: True, torch's spelling, got pybind11's
// "incompatible function arguments" and the whole signature.
Causal causal_of(std::string_view fn, py::handle causal) {
  if (causal.is_none()) return Causal::kNone;
  if (!py::isinstance<py::str>(causal)) {
    throw py::type_error(std::string(fn) + ": causal is " + std::string(py::repr(causal)) +
                         "; expected None, 'top-left' (torch's is_causal=True: the mask's "
                         "corner at the first query and key) or 'bottom-right' (at the last)");
  }
  const std::string name = causal.cast<std::string>();
  if (name == "top-left") return Causal::kTopLeft;
  if (name == "bottom-right") return Causal::kBottomRight;
  throw Error(std::string(fn) + ": causal = '" + name +
              "' is not one of None, 'top-left', 'bottom-right'");
}

// dropout_p, or `dropout`, its old name, for one release: a DeprecationWarning
// names the function; giving both is a TypeError.
double dropout_of(std::string_view fn, std::optional<double> dropout_p, py::handle dropout_old) {
  if (dropout_old.is_none()) return dropout_p.value_or(0.0);
  if (dropout_p) {
    throw py::type_error(std::string(fn) +
                         "() got dropout_p and dropout, its old name; give "
                         "dropout_p only");
  }
  const std::string warning = std::string(fn) +
                              ": dropout= is deprecated and goes in the next release; use "
                              "dropout_p=";
  if (PyErr_WarnEx(PyExc_DeprecationWarning, warning.c_str(), 1) != 0) {
    throw py::error_already_set();
  }
  return py::cast<double>(dropout_old);
}

enum class Pass { kForward, kBackward };

// The dropout seed of a call. seed=None: a forward draws a fresh one from
// NumPy's global generator (np.random.seed(...) repeats a run), so two calls
// drop different weights (with the old default, 0, every call dropped the
// same ones); a backward replays its forward's mask, so with dropout it
// needs the forward's seed, given.
uint64_t dropout_seed(py::handle seed, double dropout, std::string_view fn, Pass pass) {
  if (!seed.is_none()) return seed_of(seed, fn);
  // No dropout, or a p the library refuses with its own message.
  if (!(dropout > 0.0 && dropout <= 1.0)) return 0;
  if (pass == Pass::kBackward) {
    throw Error(std::string(fn) +
                ": dropout_p = " + py::str(py::float_(dropout)).cast<std::string>() +
                " needs seed=, the forward's: the backward replays the forward's dropout mask "
                "from it (a forward given no seed draws a fresh one and does not return it)");
  }
  return py::module_::import("numpy.random")
      .attr("randint")(0, py::int_(1ULL << 62))
      .cast<uint64_t>();
}

AttentionOptions options_of(std::optional<double> scale, double dropout, py::handle seed,
                            std::string_view fn, Pass pass, Causal causal = Causal::kNone) {
  AttentionOptions options;
  options.causal = causal;
  options.scale = scale;
  options.dropout_p = dropout;
  // The functional form has no training mode: dropout applies when p > 0,
  // as in torch.nn.functional.
  options.training = dropout > 0.0;
  options.seed = dropout_seed(seed, dropout, fn, pass);
  return options;
}

// The masks of a call (scaled dot-product attention): mask and key_mask as
// bool or one-byte integer arrays read in place (nonzero = takes part; a
// 1-D key_mask with 2-D inputs is the batch of one's), window (left, right).
// `storage` keeps the arrays alive for the call.
struct MaskArrays {
  py::object mask, key_mask, bias, alibi_slopes;
};

ConstView<uint8_t> byte_mask(py::handle obj, std::string_view fn, std::string_view name,
                             py::object& storage) {
  py::array array = py::module_::import("numpy").attr("asarray")(obj);
  const py::dtype dt = array.dtype();
  if (!((dt.kind() == 'b' || dt.kind() == 'u' || dt.kind() == 'i') && dt.itemsize() == 1)) {
    throw py::type_error(std::string(fn) + ": " + std::string(name) + " has dtype " +
                         py::cast<std::string>(dt.attr("__str__")()) +
                         "; expected bool (or uint8/int8: nonzero = takes part)");
  }
  if (array.ndim() < 1 || array.ndim() > 4) {
    throw Error(std::string(fn) + ": " + std::string(name) + " has " +
                std::to_string(array.ndim()) + " axes; expected 1 to 4");
  }
  storage = array;
  Shape shape, strides;
  for (py::ssize_t a = 0; a < array.ndim(); ++a) {
    shape.push_back(array.shape(a));
    strides.push_back(array.strides(a));  // bytes: one per element
  }
  return ConstView<uint8_t>(static_cast<const uint8_t*>(array.data()), shape, strides);
}

// bias: a float array of the type the kernels compute in (float32 for
// float32 and bf16 inputs, float64 for float64), read in place.
void set_bias(std::string_view fn, py::handle bias, Dtype compute, AttentionOptions& options,
              MaskArrays& storage) {
  if (bias.is_none()) return;
  py::array array = float_array(bias, fn, "bias");
  check_same_dtype(
      array, compute, fn, "bias",
      compute == Dtype::kFloat32 ? "the inputs (float32 for bf16 inputs)" : "the inputs");
  storage.bias = array;
  if (compute == Dtype::kFloat32) {
    options.bias = view_of<float>(array);
  } else {
    options.bias = view_of<double>(array);
  }
}

// softcap: a real number, finite and >= 0 (checked here, to name it as the
// caller spelled it); alibi_slopes: None or a float array, (H) or (B, H),
// read as float64 (its shape and values checked by the library).
void set_softcap_alibi(std::string_view fn, py::handle softcap, py::handle alibi_slopes,
                       AttentionOptions& options, MaskArrays& storage) {
  const bool real = (PyFloat_Check(softcap.ptr()) || PyLong_Check(softcap.ptr()) ||
                     PyObject_HasAttrString(softcap.ptr(), "__float__")) &&
                    !PyBool_Check(softcap.ptr());
  if (!real) {
    throw py::type_error(std::string(fn) + ": softcap is " + std::string(py::repr(softcap)) +
                         "; expected a number (0: no capping)");
  }
  const py::object as_float = py::reinterpret_steal<py::object>(PyNumber_Float(softcap.ptr()));
  if (!as_float) throw py::error_already_set();
  const double cap = PyFloat_AsDouble(as_float.ptr());
  if (!(std::isfinite(cap) && cap >= 0.0)) {
    throw Error(std::string(fn) + ": softcap = " + std::string(py::repr(softcap)) +
                "; expected a finite number >= 0 (0: no capping)");
  }
  options.softcap = cap;
  if (alibi_slopes.is_none()) return;
  py::array array = float_array(alibi_slopes, fn, "alibi_slopes");
  py::array slopes = py::module_::import("numpy").attr("asarray")(array, "float64");
  options.alibi_slopes = view_of<double>(slopes);
  storage.alibi_slopes = slopes;  // after view_of, which may replace it by a copy
}

void set_masks(std::string_view fn, py::handle mask, py::handle key_mask, py::handle window,
               bool batch_of_one, AttentionOptions& options, MaskArrays& storage) {
  if (!mask.is_none()) options.mask = byte_mask(mask, fn, "mask", storage.mask);
  if (!key_mask.is_none()) {
    ConstView<uint8_t> keys = byte_mask(key_mask, fn, "key_mask", storage.key_mask);
    options.key_mask = with_batch_axis(keys, batch_of_one, 1);
  }
  if (!window.is_none()) {
    // Checked here: pybind11's cast of a bad one says only "Unable to cast
    // Python instance to C++ type".
    const auto is_int = [](py::handle x) {
      return PyIndex_Check(x.ptr()) && !PyBool_Check(x.ptr());
    };
    const bool pair = (py::isinstance<py::tuple>(window) || py::isinstance<py::list>(window)) &&
                      py::len(window) == 2 && is_int(window[py::int_(0)]) &&
                      is_int(window[py::int_(1)]);
    if (!pair) {
      throw py::type_error(std::string(fn) + ": window is " + std::string(py::repr(window)) +
                           "; expected (left, right), two integers (-1: no limit on that side)");
    }
    options.window_left = py::cast<int64_t>(window[py::int_(0)]);
    options.window_right = py::cast<int64_t>(window[py::int_(1)]);
  }
}

// The queries, keys and values of a call, as float arrays of one dtype and
// one rank (3, or 2 for a batch of one).
struct Tensors {
  std::vector<py::array> arrays;
  std::vector<std::string> names;  // each array's argument name, for messages
  Dtype dtype;
  bool batch_of_one;
};

// The shapes the messages give come from the scoring function's row of the
// table (qkv/scoring.h): keys of their own size, and heads where it takes them.
Tensors float_arrays(std::string_view fn, Scoring scoring,
                     const std::vector<std::pair<const char*, py::handle>>& args, int num_inputs) {
  const ScoringRules& rules = rules_of(scoring);
  const bool own = rules.keys_own_dim;
  Tensors t;
  for (const auto& [name, obj] : args) {
    t.arrays.push_back(float_array(obj, fn, name));
    t.names.emplace_back(name);
  }
  t.dtype = dtype_of(t.arrays[0]);
  for (size_t i = 1; i < args.size(); ++i) {
    check_same_dtype(t.arrays[i], t.dtype, fn, args[i].first, args[0].first);
  }
  check_rank_2_or_3(t.arrays[0], fn, args[0].first, own ? "(B, Nq, Dq)" : "(B, Nq, D)",
                    own ? "(Nq, Dq)" : "(Nq, D)", rules.heads ? "(B, H, Nq, D)" : "");
  std::vector<std::pair<std::string_view, const py::array*>> inputs;
  for (int i = 0; i < num_inputs; ++i) inputs.emplace_back(args[i].first, &t.arrays[i]);
  check_same_rank(inputs, fn, rules.heads ? "all 2-D, all 3-D or all 4-D" : "all 2-D or all 3-D");
  t.batch_of_one = t.arrays[0].ndim() == 2;
  return t;
}

ValidLens lens_of(py::handle obj, std::string_view fn, bool batch_of_one, const Shape& q_shape,
                  py::object& storage) {
  const ValidLens lens = valid_lens_of(obj, fn, storage);
  return batch_of_one ? lens.for_batch_of_one(fn, "valid_lens", "queries", q_shape) : lens;
}

py::object forward_result(py::object output, std::optional<py::object> weights,
                          std::optional<py::object> lse,
                          std::optional<py::object> softmax_stats = std::nullopt) {
  if (!weights && !lse) return output;
  py::list parts;
  parts.append(output);
  if (weights) parts.append(*weights);
  if (lse) parts.append(*lse);
  if (softmax_stats) parts.append(*softmax_stats);
  return py::tuple(parts);
}

// ---- forward (float, double): into new arrays -----------------------------

// attend(q, k, v, lens, outputs) runs the scoring function.
template <class T, class Attend>
py::object forward(std::string_view fn, Tensors& t, Attend&& attend, py::handle lens_obj,
                   bool return_weights, bool return_lse, py::handle out = py::none(),
                   bool return_softmax_stats = false) {
  const bool one = t.batch_of_one;
  const ConstView<T> q = with_batch_axis(view_of<T>(t.arrays[0]), one, 2);
  const ConstView<T> k = with_batch_axis(view_of<T>(t.arrays[1]), one, 2);
  const ConstView<T> v = with_batch_axis(view_of<T>(t.arrays[2]), one, 2);
  py::object lens_storage;
  const ValidLens lens = lens_of(lens_obj, fn, one, shape_of(t.arrays[0]), lens_storage);
  // (B, Nq, ·) results, or (B, H, Nq, ·) for heads (B, H, Nq, D).
  const int n = q.rank() - 2;  // the N axis
  Shape lead;
  for (int a = 0; a < n; ++a) lead.push_back(q.size(a));
  const auto with_lead = [&](std::initializer_list<int64_t> rest) {
    Shape shape = lead;
    for (const int64_t e : rest) shape.push_back(e);
    return without_batch_axis(shape, one);
  };
  const int64_t nq = q.size(n), nk = k.size(n), dv = v.size(n + 1);
  py::object output;
  TensorView<T> output_view;
  if (out.is_none()) {
    auto [array, view] = new_array<T>(with_lead({nq, dv}));
    output = array;
    output_view = view;
  } else {  // the caller's array (its shape and layout checked by the library)
    py::array array = out_array(out, fn, "out", dtype_of(t.arrays[0]));
    // The kernels read the inputs while they write out: an out that shares
    // memory with one (out=q) gave an output 0.73 off, silently.
    for (size_t i = 0; i < t.arrays.size(); ++i) {
      if (may_share_memory(array, t.arrays[i])) {
        throw Error(std::string(fn) + ": out shares memory with " + t.names[i] +
                    ", which is read while out is written; pass a separate array (or no out)");
      }
    }
    output_view = mutable_view_of<T>(array);
    output = array;
  }
  AttentionOutputs<T> outputs{with_batch_axis(output_view, one, 2), std::nullopt, std::nullopt,
                              std::nullopt};
  std::optional<py::object> weights, lse, softmax_stats;
  if (return_weights) {
    auto [array, view] = new_array<T>(with_lead({nq, nk}));
    weights = array;
    outputs.weights = with_batch_axis(view, one, 2);
  }
  if (return_lse) {
    auto [array, view] = new_array<T>(with_lead({nq}));
    lse = array;
    outputs.lse = with_batch_axis(view, one, 1);
  }
  if (return_softmax_stats) {  // checked by the library: only with the lse
    auto [array, view] = new_array<T>(with_lead({nq, 2}));
    softmax_stats = array;
    outputs.softmax_stats = with_batch_axis(view, one, 2);
  }
  // The caller's out as it was, put back if Ctrl-C stops the call: a
  // stopped call leaves no partial output (a copy of the output, small
  // next to the attention that fills it).
  std::optional<py::object> out_before;
  if (!out.is_none()) out_before = output.attr("copy")();
  try {
    const ReleasedGil release;
    attend(q, k, v, lens, outputs);
  } catch (const Interrupted&) {
    if (out_before) {
      // The KeyboardInterrupt waits while the copy back runs Python.
      py::error_scope pending;
      py::module_::import("numpy").attr("copyto")(output, *out_before);
    }
    throw;
  }
  return forward_result(output, weights, lse, softmax_stats);
}

// The statistics come with the lse, as the user spelled the two flags (the
// library, given write-into outputs, would name those).
void check_softmax_stats_with_lse(std::string_view fn, bool return_softmax_stats, bool return_lse) {
  if (return_softmax_stats && !return_lse) {
    throw Error(std::string(fn) +
                ": return_softmax_stats=True needs return_lse=True; the statistics come with "
                "the lse (the backward reads both)");
  }
}

py::object sdpa_py(py::handle q, py::handle k, py::handle v, py::handle valid_lens,
                   std::optional<double> scale, std::optional<double> dropout_p, py::handle seed,
                   bool return_weights, bool return_lse, py::handle causal, py::handle out,
                   py::handle mask, py::handle key_mask, py::handle window, py::handle bias,
                   py::handle softcap, py::handle alibi_slopes, bool return_softmax_stats,
                   py::handle dropout_old) {
  check_softmax_stats_with_lse(kSdpa, return_softmax_stats, return_lse);
  Tensors t =
      float_arrays(kSdpa, Scoring::kDotProduct, {{"queries", q}, {"keys", k}, {"values", v}}, 3);
  AttentionOptions options = options_of(scale, dropout_of(kSdpa, dropout_p, dropout_old), seed,
                                        kSdpa, Pass::kForward, causal_of(kSdpa, causal));
  MaskArrays masks;
  set_masks(kSdpa, mask, key_mask, window, t.batch_of_one, options, masks);
  set_bias(kSdpa, bias, t.dtype, options, masks);
  set_softcap_alibi(kSdpa, softcap, alibi_slopes, options, masks);
  const auto attend = [&](auto q, auto k, auto v, const ValidLens& lens, const auto& outputs) {
    scaled_dot_product_attention(q, k, v, lens, options, outputs);
  };
  if (t.dtype == Dtype::kFloat32) {
    return forward<float>(kSdpa, t, attend, valid_lens, return_weights, return_lse, out,
                          return_softmax_stats);
  }
  return forward<double>(kSdpa, t, attend, valid_lens, return_weights, return_lse, out,
                         return_softmax_stats);
}

template <class T>
AdditiveWeights<T> additive_weights(Tensors& t) {
  return {view_of<T>(t.arrays[3]), view_of<T>(t.arrays[4]), view_of<T>(t.arrays[5])};
}

py::object additive_py(py::handle q, py::handle k, py::handle v, py::handle w_q, py::handle w_k,
                       py::handle w_v, py::handle valid_lens, std::optional<double> dropout_p,
                       py::handle seed, bool return_weights, bool return_lse, py::handle causal,
                       py::handle dropout_old) {
  Tensors t = float_arrays(
      kAdditive, Scoring::kAdditive,
      {{"queries", q}, {"keys", k}, {"values", v}, {"W_q", w_q}, {"W_k", w_k}, {"w_v", w_v}}, 3);
  const AttentionOptions options =
      options_of(std::nullopt, dropout_of(kAdditive, dropout_p, dropout_old), seed, kAdditive,
                 Pass::kForward, causal_of(kAdditive, causal));
  // The parameters' views made here, with the GIL (view_of may copy).
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    const AdditiveWeights<T> w = additive_weights<T>(t);
    const auto attend = [&](auto q, auto k, auto v, const ValidLens& lens, const auto& outputs) {
      additive_attention(q, k, v, w, lens, options, outputs);
    };
    return forward<T>(kAdditive, t, attend, valid_lens, return_weights, return_lse);
  };
  return t.dtype == Dtype::kFloat32 ? run(0.0f) : run(0.0);
}

// ---- backward (float, double) ---------------------------------------------

// The saved forward and d_output of a backward call: arrays 3, 4, 5 of `t`
// for SDPA (after queries, keys, values), 6, 7, 8 for additive.
template <class T>
struct Saved {
  SavedForward<T> saved;
  ConstView<T> d_output;
};

template <class T>
Saved<T> saved_of(Tensors& t, size_t first) {
  const bool one = t.batch_of_one;
  return {{with_batch_axis(view_of<T>(t.arrays[first]), one, 2),
           with_batch_axis(view_of<T>(t.arrays[first + 1]), one, 1)},
          with_batch_axis(view_of<T>(t.arrays[first + 2]), one, 2)};
}

// An optional array of a backward, None or of the compute dtype (`name`'s
// dtype is compared with the lse's), as a view with the batch axis of a
// batch of one put back (`axes`: the axes after it); `storage` keeps it
// alive. d_lse, the gradient at the forward's lse, takes the lse's shape
// (axes 1); softmax_stats, the forward's (return_softmax_stats), (..., 2).
template <class T>
ConstView<T> optional_saved_of(py::handle obj, std::string_view fn, const char* name, Dtype dtype,
                               bool batch_of_one, int axes, py::object& storage) {
  if (obj.is_none()) return {};
  py::array array = float_array(obj, fn, name);
  check_same_dtype(array, dtype, fn, name, "lse");
  const ConstView<T> view = view_of<T>(array);
  storage = array;  // after view_of, which may replace it by a copy
  return with_batch_axis(view, batch_of_one, axes);
}

template <class T>
py::object sdpa_backward(Tensors& t, py::handle lens_obj, const AttentionOptions& options,
                         py::handle d_lse_obj, py::handle softmax_stats_obj) {
  const bool one = t.batch_of_one;
  const ConstView<T> q = with_batch_axis(view_of<T>(t.arrays[0]), one, 2);
  const ConstView<T> k = with_batch_axis(view_of<T>(t.arrays[1]), one, 2);
  const ConstView<T> v = with_batch_axis(view_of<T>(t.arrays[2]), one, 2);
  Saved<T> s = saved_of<T>(t, 3);
  py::object lens_storage;
  const ValidLens lens = lens_of(lens_obj, kSdpaBackward, one, shape_of(t.arrays[0]), lens_storage);
  py::object d_lse_storage, stats_storage;
  const ConstView<T> d_lse =
      optional_saved_of<T>(d_lse_obj, kSdpaBackward, "d_lse", t.dtype, one, 1, d_lse_storage);
  s.saved.softmax_stats = optional_saved_of<T>(softmax_stats_obj, kSdpaBackward, "softmax_stats",
                                               t.dtype, one, 2, stats_storage);
  DotProductGrads<T> g;
  {
    const ReleasedGil release;
    g = scaled_dot_product_attention_backward(q, k, v, lens, options, s.saved, s.d_output, d_lse);
  }
  py::object dq = to_numpy(std::move(g.d_queries), without_batch_axis(q.shape(), one));
  py::object dk = to_numpy(std::move(g.d_keys), without_batch_axis(k.shape(), one));
  py::object dv = to_numpy(std::move(g.d_values), without_batch_axis(v.shape(), one));
  if (options.want_bias_grad) {
    return sdpa_bias_grads_type(dq, dk, dv, to_numpy(std::move(g.d_bias)));
  }
  return sdpa_grads_type(dq, dk, dv);
}

py::object sdpa_backward_py(py::handle q, py::handle k, py::handle v, py::handle output,
                            py::handle lse, py::handle d_output, py::handle valid_lens,
                            std::optional<double> scale, std::optional<double> dropout_p,
                            py::handle seed, py::handle causal, py::handle mask,
                            py::handle key_mask, py::handle window, py::handle bias, bool bias_grad,
                            py::handle softcap, py::handle alibi_slopes, py::handle d_lse,
                            py::handle softmax_stats, py::handle dropout_old) {
  Tensors t = float_arrays(kSdpaBackward, Scoring::kDotProduct,
                           {{"queries", q},
                            {"keys", k},
                            {"values", v},
                            {"output", output},
                            {"lse", lse},
                            {"d_output", d_output}},
                           3);
  AttentionOptions options =
      options_of(scale, dropout_of(kSdpaBackward, dropout_p, dropout_old), seed, kSdpaBackward,
                 Pass::kBackward, causal_of(kSdpaBackward, causal));
  MaskArrays masks;
  set_masks(kSdpaBackward, mask, key_mask, window, t.batch_of_one, options, masks);
  set_bias(kSdpaBackward, bias, t.dtype, options, masks);
  set_softcap_alibi(kSdpaBackward, softcap, alibi_slopes, options, masks);
  options.want_bias_grad = !bias.is_none() && bias_grad;
  return t.dtype == Dtype::kFloat32
             ? sdpa_backward<float>(t, valid_lens, options, d_lse, softmax_stats)
             : sdpa_backward<double>(t, valid_lens, options, d_lse, softmax_stats);
}

template <class T>
py::object additive_backward(Tensors& t, py::handle lens_obj, const AttentionOptions& options) {
  const bool one = t.batch_of_one;
  const ConstView<T> q = with_batch_axis(view_of<T>(t.arrays[0]), one, 2);
  const ConstView<T> k = with_batch_axis(view_of<T>(t.arrays[1]), one, 2);
  const ConstView<T> v = with_batch_axis(view_of<T>(t.arrays[2]), one, 2);
  const AdditiveWeights<T> w = additive_weights<T>(t);
  const Saved<T> s = saved_of<T>(t, 6);
  py::object lens_storage;
  const ValidLens lens =
      lens_of(lens_obj, kAdditiveBackward, one, shape_of(t.arrays[0]), lens_storage);
  AdditiveGrads<T> g;
  {
    const ReleasedGil release;
    g = additive_attention_backward(q, k, v, w, lens, options, s.saved, s.d_output);
  }
  return additive_grads_type(to_numpy(std::move(g.d_queries), without_batch_axis(q.shape(), one)),
                             to_numpy(std::move(g.d_keys), without_batch_axis(k.shape(), one)),
                             to_numpy(std::move(g.d_values), without_batch_axis(v.shape(), one)),
                             to_numpy(std::move(g.d_w_q)), to_numpy(std::move(g.d_w_k)),
                             to_numpy(std::move(g.d_w_v)));
}

py::object additive_backward_py(py::handle q, py::handle k, py::handle v, py::handle w_q,
                                py::handle w_k, py::handle w_v, py::handle output, py::handle lse,
                                py::handle d_output, py::handle valid_lens,
                                std::optional<double> dropout_p, py::handle seed, py::handle causal,
                                py::handle dropout_old) {
  Tensors t = float_arrays(kAdditiveBackward, Scoring::kAdditive,
                           {{"queries", q},
                            {"keys", k},
                            {"values", v},
                            {"W_q", w_q},
                            {"W_k", w_k},
                            {"w_v", w_v},
                            {"output", output},
                            {"lse", lse},
                            {"d_output", d_output}},
                           3);
  const AttentionOptions options =
      options_of(std::nullopt, dropout_of(kAdditiveBackward, dropout_p, dropout_old), seed,
                 kAdditiveBackward, Pass::kBackward, causal_of(kAdditiveBackward, causal));
  return t.dtype == Dtype::kFloat32 ? additive_backward<float>(t, valid_lens, options)
                                    : additive_backward<double>(t, valid_lens, options);
}

// ---- bilinear and distance ----------------------------------------------------

// Bilinear attention: W (Dq, Dk) is array 3 (not batched with the inputs).
py::object bilinear_py(py::handle q, py::handle k, py::handle v, py::handle w,
                       py::handle valid_lens, std::optional<double> dropout_p, py::handle seed,
                       bool return_weights, bool return_lse, py::handle causal,
                       py::handle dropout_old) {
  Tensors t = float_arrays(kBilinear, Scoring::kBilinear,
                           {{"queries", q}, {"keys", k}, {"values", v}, {"W", w}}, 3);
  const AttentionOptions options =
      options_of(std::nullopt, dropout_of(kBilinear, dropout_p, dropout_old), seed, kBilinear,
                 Pass::kForward, causal_of(kBilinear, causal));
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    const ConstView<T> w = view_of<T>(t.arrays[3]);  // with the GIL (view_of may copy)
    const auto attend = [&](auto q, auto k, auto v, const ValidLens& lens, const auto& outputs) {
      bilinear_attention(q, k, v, w, lens, options, outputs);
    };
    return forward<T>(kBilinear, t, attend, valid_lens, return_weights, return_lse);
  };
  return t.dtype == Dtype::kFloat32 ? run(0.0f) : run(0.0);
}

py::object distance_py(py::handle q, py::handle k, py::handle v, py::handle valid_lens,
                       std::optional<double> scale, std::optional<double> dropout_p,
                       py::handle seed, bool return_weights, bool return_lse, py::handle causal,
                       py::handle dropout_old) {
  Tensors t =
      float_arrays(kDistance, Scoring::kDistance, {{"queries", q}, {"keys", k}, {"values", v}}, 3);
  const AttentionOptions options =
      options_of(scale, dropout_of(kDistance, dropout_p, dropout_old), seed, kDistance,
                 Pass::kForward, causal_of(kDistance, causal));
  const auto attend = [&](auto q, auto k, auto v, const ValidLens& lens, const auto& outputs) {
    distance_attention(q, k, v, lens, options, outputs);
  };
  if (t.dtype == Dtype::kFloat32) {
    return forward<float>(kDistance, t, attend, valid_lens, return_weights, return_lse);
  }
  return forward<double>(kDistance, t, attend, valid_lens, return_weights, return_lse);
}

// The inputs of a backward (arrays 0-2 of `t`), batched, and their lengths.
template <class T>
struct BackwardInputs {
  ConstView<T> q, k, v;
  py::object lens_storage;  // before lens, which it keeps alive
  ValidLens lens;
  BackwardInputs(std::string_view fn, Tensors& t, py::handle lens_obj)
      : q(with_batch_axis(view_of<T>(t.arrays[0]), t.batch_of_one, 2)),
        k(with_batch_axis(view_of<T>(t.arrays[1]), t.batch_of_one, 2)),
        v(with_batch_axis(view_of<T>(t.arrays[2]), t.batch_of_one, 2)),
        lens(lens_of(lens_obj, fn, t.batch_of_one, shape_of(t.arrays[0]), lens_storage)) {}
};

template <class T>
py::object bilinear_backward(Tensors& t, py::handle lens_obj, const AttentionOptions& options) {
  const bool one = t.batch_of_one;
  const BackwardInputs<T> in(kBilinearBackward, t, lens_obj);
  const ConstView<T> w = view_of<T>(t.arrays[3]);
  const Saved<T> s = saved_of<T>(t, 4);
  BilinearGrads<T> g;
  {
    const ReleasedGil release;
    g = bilinear_attention_backward(in.q, in.k, in.v, w, in.lens, options, s.saved, s.d_output);
  }
  return bilinear_grads_type(
      to_numpy(std::move(g.d_queries), without_batch_axis(in.q.shape(), one)),
      to_numpy(std::move(g.d_keys), without_batch_axis(in.k.shape(), one)),
      to_numpy(std::move(g.d_values), without_batch_axis(in.v.shape(), one)),
      to_numpy(std::move(g.d_w)));
}

py::object bilinear_backward_py(py::handle q, py::handle k, py::handle v, py::handle w,
                                py::handle output, py::handle lse, py::handle d_output,
                                py::handle valid_lens, std::optional<double> dropout_p,
                                py::handle seed, py::handle causal, py::handle dropout_old) {
  Tensors t = float_arrays(kBilinearBackward, Scoring::kBilinear,
                           {{"queries", q},
                            {"keys", k},
                            {"values", v},
                            {"W", w},
                            {"output", output},
                            {"lse", lse},
                            {"d_output", d_output}},
                           3);
  const AttentionOptions options =
      options_of(std::nullopt, dropout_of(kBilinearBackward, dropout_p, dropout_old), seed,
                 kBilinearBackward, Pass::kBackward, causal_of(kBilinearBackward, causal));
  return t.dtype == Dtype::kFloat32 ? bilinear_backward<float>(t, valid_lens, options)
                                    : bilinear_backward<double>(t, valid_lens, options);
}

template <class T>
py::object distance_backward(Tensors& t, py::handle lens_obj, const AttentionOptions& options) {
  const bool one = t.batch_of_one;
  const BackwardInputs<T> in(kDistanceBackward, t, lens_obj);
  const Saved<T> s = saved_of<T>(t, 3);
  DotProductGrads<T> g;
  {
    const ReleasedGil release;
    g = distance_attention_backward(in.q, in.k, in.v, in.lens, options, s.saved, s.d_output);
  }
  return sdpa_grads_type(to_numpy(std::move(g.d_queries), without_batch_axis(in.q.shape(), one)),
                         to_numpy(std::move(g.d_keys), without_batch_axis(in.k.shape(), one)),
                         to_numpy(std::move(g.d_values), without_batch_axis(in.v.shape(), one)));
}

py::object distance_backward_py(py::handle q, py::handle k, py::handle v, py::handle output,
                                py::handle lse, py::handle d_output, py::handle valid_lens,
                                std::optional<double> scale, std::optional<double> dropout_p,
                                py::handle seed, py::handle causal, py::handle dropout_old) {
  Tensors t = float_arrays(kDistanceBackward, Scoring::kDistance,
                           {{"queries", q},
                            {"keys", k},
                            {"values", v},
                            {"output", output},
                            {"lse", lse},
                            {"d_output", d_output}},
                           3);
  const AttentionOptions options =
      options_of(scale, dropout_of(kDistanceBackward, dropout_p, dropout_old), seed,
                 kDistanceBackward, Pass::kBackward, causal_of(kDistanceBackward, causal));
  return t.dtype == Dtype::kFloat32 ? distance_backward<float>(t, valid_lens, options)
                                    : distance_backward<double>(t, valid_lens, options);
}

// ---- bf16 (qkv.torch's torch.bfloat16): bits in, float32 out ---------------

// bf16 inputs of one rank, 3 or 2 (a batch of one), viewed with the batch
// axis; and the lengths for them.
struct Bf16Inputs {
  ConstView<bfloat16> q, k, v;
  bool batch_of_one;
  ValidLens lens;
  py::object lens_storage;
};

Bf16Inputs bf16_inputs(std::string_view fn, py::handle q_obj, py::handle k_obj, py::handle v_obj,
                       py::handle lens_obj) {
  Bf16Inputs in;
  const ConstView<bfloat16> q = bf16_view_of(q_obj, fn, "queries");
  const ConstView<bfloat16> k = bf16_view_of(k_obj, fn, "keys");
  const ConstView<bfloat16> v = bf16_view_of(v_obj, fn, "values");
  in.batch_of_one = q.rank() == 2 && k.rank() == 2 && v.rank() == 2;
  in.q = with_batch_axis(q, in.batch_of_one, 2);
  in.k = with_batch_axis(k, in.batch_of_one, 2);
  in.v = with_batch_axis(v, in.batch_of_one, 2);
  in.lens = lens_of(lens_obj, fn, in.batch_of_one, q.shape(), in.lens_storage);
  return in;
}

py::tuple sdpa_bf16_py(py::handle q, py::handle k, py::handle v, py::handle valid_lens,
                       std::optional<double> scale, double dropout, py::handle seed,
                       bool return_weights, bool return_lse, py::handle causal, py::handle mask,
                       py::handle key_mask, py::handle window, py::handle bias, py::handle softcap,
                       py::handle alibi_slopes, bool return_softmax_stats) {
  check_softmax_stats_with_lse(kSdpa, return_softmax_stats, return_lse);
  const Bf16Inputs in = bf16_inputs(kSdpa, q, k, v, valid_lens);
  AttentionOptions options =
      options_of(scale, dropout, seed, kSdpa, Pass::kForward, causal_of(kSdpa, causal));
  MaskArrays masks;
  set_masks(kSdpa, mask, key_mask, window, in.batch_of_one, options, masks);
  set_bias(kSdpa, bias, Dtype::kFloat32, options, masks);
  set_softcap_alibi(kSdpa, softcap, alibi_slopes, options, masks);
  options.return_weights = return_weights;
  options.return_lse = return_lse;
  options.return_softmax_stats = return_softmax_stats;
  AttentionResult<float> r;
  {
    const ReleasedGil release;
    r = scaled_dot_product_attention(in.q, in.k, in.v, in.lens, options);
  }
  const bool one = in.batch_of_one;
  auto result = [&](Tensor<float>& t) -> py::object {
    const Shape shape = t.shape();
    return to_numpy(std::move(t), without_batch_axis(shape, one));
  };
  return py::make_tuple(result(r.output), return_weights ? result(r.weights) : py::none(),
                        return_lse ? result(r.lse) : py::none(),
                        return_softmax_stats ? result(r.softmax_stats) : py::none());
}

py::tuple sdpa_bf16_backward_py(py::handle q, py::handle k, py::handle v, py::handle output,
                                py::handle lse, py::handle d_output, py::handle valid_lens,
                                std::optional<double> scale, double dropout, py::handle seed,
                                py::handle causal, py::handle mask, py::handle key_mask,
                                py::handle window, py::handle bias, bool bias_grad,
                                py::handle softcap, py::handle alibi_slopes, py::handle d_lse_obj,
                                py::handle softmax_stats_obj) {
  const Bf16Inputs in = bf16_inputs(kSdpaBackward, q, k, v, valid_lens);
  std::vector<py::array> saved;
  for (const auto& [name, obj] : std::vector<std::pair<const char*, py::handle>>{
           {"output", output}, {"lse", lse}, {"d_output", d_output}}) {
    saved.push_back(float_array(obj, kSdpaBackward, name));
    check_same_dtype(saved.back(), Dtype::kFloat32, kSdpaBackward, name, "the bf16 path");
  }
  const bool one = in.batch_of_one;
  AttentionOptions options = options_of(scale, dropout, seed, kSdpaBackward, Pass::kBackward,
                                        causal_of(kSdpaBackward, causal));
  MaskArrays masks;
  set_masks(kSdpaBackward, mask, key_mask, window, one, options, masks);
  set_bias(kSdpaBackward, bias, Dtype::kFloat32, options, masks);
  set_softcap_alibi(kSdpaBackward, softcap, alibi_slopes, options, masks);
  options.want_bias_grad = !bias.is_none() && bias_grad;
  py::object stats_storage;
  const SavedForward<float> s{
      with_batch_axis(view_of<float>(saved[0]), one, 2),
      with_batch_axis(view_of<float>(saved[1]), one, 1),
      optional_saved_of<float>(softmax_stats_obj, kSdpaBackward, "softmax_stats", Dtype::kFloat32,
                               one, 2, stats_storage)};
  const ConstView<float> g = with_batch_axis(view_of<float>(saved[2]), one, 2);
  py::object d_lse_storage;
  const ConstView<float> d_lse = optional_saved_of<float>(d_lse_obj, kSdpaBackward, "d_lse",
                                                          Dtype::kFloat32, one, 1, d_lse_storage);
  DotProductGrads<float> grads;
  {
    const ReleasedGil release;
    grads = scaled_dot_product_attention_backward(in.q, in.k, in.v, in.lens, options, s, g, d_lse);
  }
  return py::make_tuple(
      to_numpy(std::move(grads.d_queries), without_batch_axis(in.q.shape(), one)),
      to_numpy(std::move(grads.d_keys), without_batch_axis(in.k.shape(), one)),
      to_numpy(std::move(grads.d_values), without_batch_axis(in.v.shape(), one)),
      options.want_bias_grad ? py::object(to_numpy(std::move(grads.d_bias))) : py::none());
}

}  // namespace

void register_attention(py::module_& m) {
  const py::object namedtuple = py::module_::import("collections").attr("namedtuple");
  m.attr("ScaledDotProductAttentionGrads") = namedtuple(
      "ScaledDotProductAttentionGrads", py::make_tuple("d_queries", "d_keys", "d_values"));
  // What the backward returns when it also gives the bias's gradient.
  m.attr("ScaledDotProductAttentionBiasGrads") =
      namedtuple("ScaledDotProductAttentionBiasGrads",
                 py::make_tuple("d_queries", "d_keys", "d_values", "d_bias"));
  m.attr("ScaledDotProductAttentionBiasGrads").attr("__module__") = "qkv";
  m.attr("AdditiveAttentionGrads") =
      namedtuple("AdditiveAttentionGrads",
                 py::make_tuple("d_queries", "d_keys", "d_values", "d_W_q", "d_W_k", "d_w_v"));
  m.attr("ScaledDotProductAttentionGrads").attr("__module__") = "qkv";
  m.attr("AdditiveAttentionGrads").attr("__module__") = "qkv";
  // Borrowed from the module, which lives as long as the interpreter.
  sdpa_grads_type = m.attr("ScaledDotProductAttentionGrads");
  sdpa_bias_grads_type = m.attr("ScaledDotProductAttentionBiasGrads");
  additive_grads_type = m.attr("AdditiveAttentionGrads");
  m.attr("BilinearAttentionGrads") = namedtuple(
      "BilinearAttentionGrads", py::make_tuple("d_queries", "d_keys", "d_values", "d_W"));
  m.attr("BilinearAttentionGrads").attr("__module__") = "qkv";
  bilinear_grads_type = m.attr("BilinearAttentionGrads");

  m.def("scaled_dot_product_attention", &sdpa_py, py::arg("queries"), py::arg("keys"),
        py::arg("values"), py::arg("valid_lens") = py::none(), py::kw_only(),
        py::arg("scale") = py::none(), py::arg("dropout_p") = py::none(),
        py::arg("seed") = py::none(), py::arg("return_weights") = false,
        py::arg("return_lse") = false, py::arg("causal") = py::none(), py::arg("out") = py::none(),
        py::arg("mask") = py::none(), py::arg("key_mask") = py::none(),
        py::arg("window") = py::none(), py::arg("bias") = py::none(), py::arg("softcap") = 0.0,
        py::arg("alibi_slopes") = py::none(), py::arg("return_softmax_stats") = false,
        py::arg("dropout") = py::none(),
        R"(Scaled dot-product attention: softmax(Q K^T * scale + bias) V, masked and fused.

No (B, Nq, Nk) score matrix is formed unless the weights are asked for.
Masked keys are never read; a query with valid length 0 gets a zero output.

Arguments:
    queries: (B, Nq, D), keys: (B, Nk, D), values: (B, Nk, Dv); or all three
        2-D, (Nq, D), (Nk, D), (Nk, Dv), a batch of one; or heads, all
        three 4-D: (B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, Dv) with H a
        multiple of Hkv (grouped-query attention: query head h reads key
        head h // (H // Hkv)). float32 or float64 (one dtype for all), any
        strides; read in place, never copied by the binding (the library
        copies only arrays whose rows are not contiguous in the last axis,
        so a (B, N, H, D) array transposed to (B, H, N, D) is read as is).
    valid_lens: None, (B) or (B, Nq) integers, shared by the heads (2-D
        inputs: a scalar, (1), (Nq) or (1, Nq)); keys j >= the length get
        weight 0.
    scale: multiplies Q K^T; default 1/sqrt(D).
    dropout_p: probability p in [0, 1] of dropping each weight (kept weights
        are scaled by 1/(1-p)); applied whenever p > 0. (dropout=, its old
        name, still works for one release with a DeprecationWarning.)
    seed: selects the dropout mask, a pure function of (seed, b, i, j)
        (heads: of (seed, b * H + h, i, j)): the backward given the same
        seed replays it. None (the default): a fresh seed per call from
        NumPy's global generator (np.random.seed repeats a run), so two
        calls drop different weights; the backward needs it given.
    return_weights: also return the weights (B, Nq, Nk), before dropout
        (heads: (B, H, Nq, Nk)).
    return_lse: also return lse (B, Nq) (heads: (B, H, Nq)), the
        log-sum-exp of each query's valid scaled scores (-inf for length
        0); the backward needs it.
    causal: None, 'top-left' (query i sees keys j <= i, torch's is_causal)
        or 'bottom-right' (j <= i + Nk - Nq: queries that continue a key
        cache); combined with valid_lens by taking the smaller length. Key
        blocks no query may see are skipped.
    mask: None, or a bool array (uint8/int8: nonzero) saying which keys each
        query sees (True = takes part, torch's boolean attn_mask), broadcast
        against the scores (B, Nq, Nk) (heads: (B, H, Nq, Nk)) from the
        right: (Nq, Nk), (B, 1, Nq, Nk), (1, H, 1, Nk), ... Read in place.
    key_mask: None, or (B, Nk) bools: key j of batch element b takes part
        (key padding; 2-D inputs: (Nk)).
    window: None, or (left, right): query i sees keys j with
        i + Nk - Nq - left <= j <= i + Nk - Nq + right (FlashAttention's
        window_size; -1 leaves a side open). Everything combines: a key
        takes part where valid_lens, causal, mask, key_mask and window all
        let it; a query left with none gets 0 (lse -inf, zero gradients).
    bias: None, or a float array added to the scaled scores (torch's float
        attn_mask: ALiBi, relative positions), broadcast like mask, of the
        inputs' dtype; read in place. -inf leaves a key out; masks win over
        the bias.
    softcap: logit capping (Gemma 2, FlashAttention's softcap): each scaled
        score x becomes softcap * tanh(x / softcap), before bias, ALiBi and
        the masks; a finite number >= 0, 0 (the default) caps nothing.
    alibi_slopes: None, or float slopes (H) (one per head; 3-D inputs
        have H = 1) or (B, H): ALiBi, adding -slope * |i + Nk - Nq - j| to
        query i's score of key j (aligned bottom-right, like window), formed
        tile by tile, never as a (B, H, Nq, Nk) array (FlashAttention's
        alibi_slopes). No gradient.
    return_softmax_stats: with return_lse, also return the softmax's
        statistics (B, Nq, 2) (heads: (B, H, Nq, 2)), each row's pair
        (m, l), weights = exp(score - m) / l as the forward formed them
        (lse = m + log l). Given to the backward (softmax_stats=), it
        recomputes these very weights instead of exp(score - lse), which
        carries the lse's rounding into a whole row: float32 gradients
        within 2x float32 torch's error on FlashAttention's tests.
    out: None, or an array to write the output into and return, of the
        output's shape and the inputs' dtype; any strides whose rows (the
        last axis) are contiguous and do not overlap: e.g. heads written as
        (B, Nq, H, Dv) memory viewed as (B, H, Nq, Dv), which a following
        projection reads without a transpose. On an error it is left as it
        was.

Returns:
    output (B, Nq, Dv) (heads: (B, H, Nq, Dv)), or the tuple
    (output[, weights][, lse][, softmax_stats]) when a return_ flag is set; arrays of the
    inputs' dtype (2-D inputs: no batch axis).

Raises:
    TypeError: an input that is not float32/float64, mixed dtypes,
        valid_lens that are not integers, a softcap that is not a number.
    qkv.Error (a ValueError): shapes that do not fit, a length outside
        [0, Nk], dropout_p outside [0, 1], a scale that is not finite, a
        softcap that is negative or not finite, alibi_slopes not finite.

>>> import numpy as np, qkv
>>> q = np.ones((2, 1, 2), np.float32); k = np.ones((2, 10, 2), np.float32)
>>> v = np.tile(np.arange(40, dtype=np.float32).reshape(1, 10, 4), (2, 1, 1))
>>> qkv.scaled_dot_product_attention(q, k, v, [2, 6])
array([[[ 2.,  3.,  4.,  5.]],
<BLANKLINE>
       [[10., 11., 12., 13.]]], dtype=float32)
)");

  m.def("scaled_dot_product_attention_backward", &sdpa_backward_py, py::arg("queries"),
        py::arg("keys"), py::arg("values"), py::arg("output"), py::arg("lse"), py::arg("d_output"),
        py::arg("valid_lens") = py::none(), py::kw_only(), py::arg("scale") = py::none(),
        py::arg("dropout_p") = py::none(), py::arg("seed") = py::none(),
        py::arg("causal") = py::none(), py::arg("mask") = py::none(),
        py::arg("key_mask") = py::none(), py::arg("window") = py::none(),
        py::arg("bias") = py::none(), py::arg("bias_grad") = true, py::arg("softcap") = 0.0,
        py::arg("alibi_slopes") = py::none(), py::arg("d_lse") = py::none(),
        py::arg("softmax_stats") = py::none(), py::arg("dropout") = py::none(),
        R"(Gradients of scaled_dot_product_attention with respect to its inputs (and its bias).

Fused as the forward: no (B, Nq, Nk) buffer; dropout's mask is regenerated
from the seed, not stored.

Arguments:
    queries, keys, values, valid_lens, scale, dropout_p, seed, causal, mask,
        key_mask, window, bias, softcap, alibi_slopes: exactly as the
        forward got them.
    bias_grad: with a bias, also return d_bias (False skips it).
    output, lse: the forward's output and lse (return_lse=True).
    d_output: the gradient of the loss with respect to output.
    d_lse: None, or the gradient of the loss with respect to lse (lse's
        shape and dtype), for a loss that reads the lse too (a
        cross-entropy over the keys): d lse / d score = the weight, so each
        score's gradient gains weight * d_lse.
    softmax_stats: None, or the forward's (return_softmax_stats=True):
        the weights are then recomputed as the forward formed them, not
        from the lse (float32: more exact gradients, at no extra cost).

Returns:
    qkv.ScaledDotProductAttentionGrads(d_queries, d_keys, d_values), a
    named tuple of new arrays shaped like the inputs (heads: d_keys and
    d_values summed over the query heads that share each key head); with a
    bias (and bias_grad), qkv.ScaledDotProductAttentionBiasGrads(d_queries,
    d_keys, d_values, d_bias): d_bias has the bias's shape, summed over the
    axes it broadcasts along (exactly 0 where it is constant along the keys,
    which cannot change the weights).

Raises:
    TypeError, qkv.Error (a ValueError): as the forward; also output, lse
        or d_output of the wrong shape.

>>> out, lse = qkv.scaled_dot_product_attention(q, k, v, [2, 6], return_lse=True)
>>> g = qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, np.ones_like(out), [2, 6])
>>> g.d_values[0, :3, 0].round(6)
array([0.5, 0.5, 0. ], dtype=float32)
)");

  m.def("additive_attention", &additive_py, py::arg("queries"), py::arg("keys"), py::arg("values"),
        py::arg("W_q"), py::arg("W_k"), py::arg("w_v"), py::arg("valid_lens") = py::none(),
        py::kw_only(), py::arg("dropout_p") = py::none(), py::arg("seed") = py::none(),
        py::arg("return_weights") = false, py::arg("return_lse") = false,
        py::arg("causal") = py::none(), py::arg("dropout") = py::none(),
        R"(Additive attention: score(q, k) = w_v^T tanh(W_q q + W_k k), masked softmax, times V.

Fused: the (B, Nq, Nk, H) features are never formed. Parameters are laid out
like torch.nn.Linear weights (no biases), as in d2l's AdditiveAttention.

Arguments:
    queries: (B, Nq, Dq), keys: (B, Nk, Dk), values: (B, Nk, Dv); or all
        three 2-D (a batch of one). float32 or float64, any strides.
    W_q: (H, Dq), W_k: (H, Dk), w_v: (H) or (1, H); the inputs' dtype.
    valid_lens, dropout_p, seed, return_weights, return_lse, causal: as in
        scaled_dot_product_attention (causal: None, "top-left" or
        "bottom-right", combined with valid_lens).

Returns:
    output (B, Nq, Dv), or (output[, weights][, lse]) when a return_ flag is set.

Raises:
    TypeError: as scaled_dot_product_attention.
    qkv.Error (a ValueError): shapes that do not fit (the message names
        them), a length outside [0, Nk], dropout_p outside [0, 1], a causal
        other than "top-left" or "bottom-right".

>>> rng = np.random.default_rng(0)
>>> q = rng.normal(size=(2, 1, 20)); k = np.ones((2, 10, 2)); v = np.ones((2, 10, 4))
>>> W_q, W_k, w_v = rng.normal(size=(8, 20)), rng.normal(size=(8, 2)), rng.normal(size=(1, 8))
>>> qkv.additive_attention(q, k, v, W_q, W_k, w_v, [2, 6]).shape
(2, 1, 4)
)");

  m.def("additive_attention_backward", &additive_backward_py, py::arg("queries"), py::arg("keys"),
        py::arg("values"), py::arg("W_q"), py::arg("W_k"), py::arg("w_v"), py::arg("output"),
        py::arg("lse"), py::arg("d_output"), py::arg("valid_lens") = py::none(), py::kw_only(),
        py::arg("dropout_p") = py::none(), py::arg("seed") = py::none(),
        py::arg("causal") = py::none(), py::arg("dropout") = py::none(),
        R"(Gradients of additive_attention with respect to its inputs and parameters.

Arguments:
    queries, keys, values, W_q, W_k, w_v, valid_lens, dropout_p, seed, causal:
        as the forward got them.
    output, lse: the forward's output and lse (return_lse=True).
    d_output: the gradient of the loss with respect to output.

Returns:
    qkv.AdditiveAttentionGrads(d_queries, d_keys, d_values, d_W_q, d_W_k,
    d_w_v), new arrays shaped like what they differentiate (d_w_v like w_v).

Raises:
    TypeError, qkv.Error (a ValueError): as the forward.

>>> out, lse = qkv.additive_attention(q, k, v, W_q, W_k, w_v, [2, 6], return_lse=True)
>>> g = qkv.additive_attention_backward(q, k, v, W_q, W_k, w_v, out, lse, np.ones_like(out), [2, 6])
>>> g.d_w_v.shape
(1, 8)
)");

  m.def("bilinear_attention", &bilinear_py, py::arg("queries"), py::arg("keys"), py::arg("values"),
        py::arg("W"), py::arg("valid_lens") = py::none(), py::kw_only(),
        py::arg("dropout_p") = py::none(), py::arg("seed") = py::none(),
        py::arg("return_weights") = false, py::arg("return_lse") = false,
        py::arg("causal") = py::none(), py::arg("dropout") = py::none(),
        R"(Bilinear attention: score(q, k) = q^T W k, masked softmax, times V.

Queries and keys of different sizes through one matrix. Computed as q W
(one matrix product) through the fused dot-product kernel with scale 1: no
(B, Nq, Nk) scores unless the weights are asked for.

Arguments:
    queries: (B, Nq, Dq), keys: (B, Nk, Dk), values: (B, Nk, Dv); or all
        three 2-D (a batch of one). float32 or float64, any strides.
    W: (Dq, Dk), the inputs' dtype.
    valid_lens, dropout_p, seed, return_weights, return_lse, causal: as in
        scaled_dot_product_attention.

Returns:
    output (B, Nq, Dv), or (output[, weights][, lse]) when a return_ flag is set.

Raises:
    TypeError: as scaled_dot_product_attention.
    qkv.Error (a ValueError): shapes that do not fit (W must be (Dq, Dk); the
        message names them), a length outside [0, Nk], dropout_p outside [0, 1].

>>> # q (2, 1, 20), k (2, 10, 2), v (2, 10, 4) as in additive_attention
>>> W = np.random.default_rng(1).normal(size=(20, 2))
>>> qkv.bilinear_attention(q, k, v, W, [2, 6]).shape
(2, 1, 4)
)");

  m.def("bilinear_attention_backward", &bilinear_backward_py, py::arg("queries"), py::arg("keys"),
        py::arg("values"), py::arg("W"), py::arg("output"), py::arg("lse"), py::arg("d_output"),
        py::arg("valid_lens") = py::none(), py::kw_only(), py::arg("dropout_p") = py::none(),
        py::arg("seed") = py::none(), py::arg("causal") = py::none(),
        py::arg("dropout") = py::none(),
        R"(Gradients of bilinear_attention with respect to its inputs and W.

The fused dot-product backward on q W, then dQ = d(qW) W^T and
dW = sum_b Q_b^T d(qW)_b.

Arguments:
    queries, keys, values, W, valid_lens, dropout_p, seed, causal: as the
        forward got them.
    output, lse: the forward's output and lse (return_lse=True).
    d_output: the gradient of the loss with respect to output.

Returns:
    qkv.BilinearAttentionGrads(d_queries, d_keys, d_values, d_W), new arrays
    shaped like what they differentiate.

Raises:
    TypeError, qkv.Error (a ValueError): as the forward.

>>> out, lse = qkv.bilinear_attention(q, k, v, W, [2, 6], return_lse=True)
>>> g = qkv.bilinear_attention_backward(q, k, v, W, out, lse, np.ones_like(out), [2, 6])
>>> g.d_W.shape
(20, 2)
)");

  m.def("distance_attention", &distance_py, py::arg("queries"), py::arg("keys"), py::arg("values"),
        py::arg("valid_lens") = py::none(), py::kw_only(), py::arg("scale") = py::none(),
        py::arg("dropout_p") = py::none(), py::arg("seed") = py::none(),
        py::arg("return_weights") = false, py::arg("return_lse") = false,
        py::arg("causal") = py::none(), py::arg("dropout") = py::none(),
        R"(Distance attention: score(q, k) = -scale/2 |q - k|^2, masked softmax, times V.

The Gaussian kernel as a scoring function (Nadaraya-Watson with bandwidth
1/sqrt(scale)). Computed by the fused dot-product kernel with a bias per key
on queries and keys centred at each batch element's mean valid key, so keys
far from the origin lose no accuracy; lse is that of the distance scores.

Arguments:
    queries: (B, Nq, D), keys: (B, Nk, D), values: (B, Nk, Dv); or all
        three 2-D (a batch of one). float32 or float64, any strides.
    scale: > 0; None means 1.
    valid_lens, dropout_p, seed, return_weights, return_lse, causal: as in
        scaled_dot_product_attention.

Returns:
    output (B, Nq, Dv), or (output[, weights][, lse]) when a return_ flag is set.

Raises:
    TypeError: as scaled_dot_product_attention.
    qkv.Error (a ValueError): shapes that do not fit (the message names
        them), a length outside [0, Nk], dropout_p outside [0, 1], scale <= 0.

>>> xq = np.array([[0.0], [2.0]]); xk = np.array([[0.0], [1.0], [3.0]]); xv = np.eye(3)
>>> qkv.distance_attention(xq, xk, xv, scale=100.0).round(3)
array([[1. , 0. , 0. ],
       [0. , 0.5, 0.5]])
)");

  m.def("distance_attention_backward", &distance_backward_py, py::arg("queries"), py::arg("keys"),
        py::arg("values"), py::arg("output"), py::arg("lse"), py::arg("d_output"),
        py::arg("valid_lens") = py::none(), py::kw_only(), py::arg("scale") = py::none(),
        py::arg("dropout_p") = py::none(), py::arg("seed") = py::none(),
        py::arg("causal") = py::none(), py::arg("dropout") = py::none(),
        R"(Gradients of distance_attention with respect to its inputs.

Arguments:
    queries, keys, values, valid_lens, scale, dropout_p, seed, causal: as the
        forward got them.
    output, lse: the forward's output and lse (return_lse=True).
    d_output: the gradient of the loss with respect to output.

Returns:
    qkv.ScaledDotProductAttentionGrads(d_queries, d_keys, d_values), new
    arrays shaped like what they differentiate.

Raises:
    TypeError, qkv.Error (a ValueError): as the forward.

>>> out, lse = qkv.distance_attention(xq, xk, xv, scale=100.0, return_lse=True)
>>> g = qkv.distance_attention_backward(xq, xk, xv, out, lse, np.ones_like(out), scale=100.0)
>>> g.d_keys.shape
(3, 1)
)");

  // qkv.torch's path for torch.bfloat16: the tensors' bits as int16 arrays
  // (3-D, or 2-D for a batch of one); float32 results.
  m.def("_scaled_dot_product_attention_bf16", &sdpa_bf16_py, py::arg("queries"), py::arg("keys"),
        py::arg("values"), py::arg("valid_lens"), py::arg("scale"), py::arg("dropout_p"),
        py::arg("seed"), py::arg("return_weights"), py::arg("return_lse"), py::arg("causal"),
        py::arg("mask"), py::arg("key_mask"), py::arg("window"), py::arg("bias") = py::none(),
        py::arg("softcap") = 0.0, py::arg("alibi_slopes") = py::none(),
        py::arg("return_softmax_stats") = false,
        "bf16 scaled dot-product attention for qkv.torch: int16 bits in, float32 "
        "(output, weights or None, lse or None, softmax_stats or None) out.");
  m.def("_scaled_dot_product_attention_bf16_backward", &sdpa_bf16_backward_py, py::arg("queries"),
        py::arg("keys"), py::arg("values"), py::arg("output"), py::arg("lse"), py::arg("d_output"),
        py::arg("valid_lens"), py::arg("scale"), py::arg("dropout_p"), py::arg("seed"),
        py::arg("causal"), py::arg("mask"), py::arg("key_mask"), py::arg("window"),
        py::arg("bias") = py::none(), py::arg("bias_grad") = true, py::arg("softcap") = 0.0,
        py::arg("alibi_slopes") = py::none(), py::arg("d_lse") = py::none(),
        py::arg("softmax_stats") = py::none(),
        "The backward of _scaled_dot_product_attention_bf16: float32 (d_queries, d_keys, "
        "d_values, d_bias or None).");
}

}  // namespace qkv::python
