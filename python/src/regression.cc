// Nadaraya-Watson kernel regression (attention pooling by similarity) for
// NumPy arrays: qkv.nadaraya_watson, qkv.KernelRegression (fit / predict,
// scikit-learn style, over the C++ class), the bandwidth rules and the
// chapter's parametric model. Everything is float64, as in the C++ API:
// float32 arrays are converted (a copy, like the C++ class's own).
#include <pybind11/stl.h>

#include <cmath>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <variant>
#include <vector>

#include "arrays.h"
#include "bindings.h"
#include "qkv/error.h"
#include "qkv/kernel_regression.h"

namespace qkv::python {
namespace {

// A float array as float64 (converted from float32: a copy).
py::array float64_array(py::handle obj, std::string_view fn, std::string_view name) {
  py::array array = float_array(obj, fn, name);
  if (dtype_of(array) == Dtype::kFloat32) array = array.attr("astype")("float64");
  return array;
}

// A float64 array of data: finite everywhere. The library checks that too,
// but names its own arguments; this names the Python call's:
// "nadaraya_watson: x_train[5] is nan (x_train has shape [20]); ...".
py::array data_array(py::handle obj, std::string_view fn, std::string_view name) {
  py::array array = float64_array(obj, fn, name);
  const ConstView<double> v = view_of<double>(array);
  const int rank = v.rank();
  std::vector<int64_t> at(static_cast<size_t>(rank), 0);
  for (int64_t n = 0; n < v.numel(); ++n) {
    int64_t offset = 0;
    for (int a = 0; a < rank; ++a) offset += at[static_cast<size_t>(a)] * v.stride(a);
    const double x = v.data()[offset];
    if (!std::isfinite(x)) {
      std::string index;
      for (int a = 0; a < rank; ++a) {
        if (a > 0) index.append(", ");
        index.append(std::to_string(at[static_cast<size_t>(a)]));
      }
      throw Error(std::string(fn) + ": " + std::string(name) + "[" + index + "] is " +
                  (std::isnan(x) ? "nan"
                   : x > 0       ? "inf"
                                 : "-inf") +
                  " (" + std::string(name) + " has shape " + v.shape().str() +
                  "); every element must be finite");
    }
    for (int a = rank - 1; a >= 0 && ++at[static_cast<size_t>(a)] == v.size(a); --a) {
      at[static_cast<size_t>(a)] = 0;
    }
  }
  return array;
}

// The kernel named `name`, or an Error naming the Python call.
Kernel kernel_of(const std::string& name, std::string_view fn) {
  try {
    return kernel_from_name(name);
  } catch (const Error&) {
    throw Error(std::string(fn) + ": kernel = '" + name +
                "' is not a kernel; expected 'gaussian', 'boxcar' (or 'uniform'), "
                "'epanechnikov' or 'triangular'");
  }
}

// Runs a library call; its Error gets the Python call's name in front
// ("KernelRegression.fit: silverman_bandwidth: feature 0 is constant ...").
template <class F>
auto calling(std::string_view fn, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    throw Error(std::string(fn) + ": " + e.what());
  }
}

// A bandwidth as Python gives it: a number (every feature), one per feature,
// or the name of a rule applied to the training data at fit.
enum class Rule { kSilverman, kScott, kCv, kCvFast };
using Bandwidth = std::variant<double, std::vector<double>, Rule>;

Bandwidth bandwidth_of(py::handle obj, std::string_view fn) {
  if (py::isinstance<py::str>(obj)) {
    const std::string name = py::str(obj);
    if (name == "silverman") return Rule::kSilverman;
    if (name == "scott") return Rule::kScott;
    if (name == "cv") return Rule::kCv;
    if (name == "cv-fast") return Rule::kCvFast;
    throw Error(std::string(fn) + ": bandwidth = '" + name +
                "' is not a rule; expected a number, one number per feature, 'silverman', "
                "'scott', 'cv' or 'cv-fast'");
  }
  // A number (Python's or NumPy's), or numbers: np.asarray says which.
  std::optional<py::array> values;
  if (!PyBool_Check(obj.ptr())) {
    py::array array = py::array::ensure(obj);
    if (array && (array.dtype().kind() == 'f' || array.dtype().kind() == 'i' ||
                  array.dtype().kind() == 'u')) {
      values = py::array(array.attr("astype")("float64"));
    }
  }
  auto checked = [&](double h) {
    if (!(std::isfinite(h) && h >= std::numeric_limits<double>::min())) {
      std::ostringstream os;
      os << fn << ": bandwidth = " << h
         << " is not a bandwidth; expected a finite value >= " << std::numeric_limits<double>::min()
         << " (the smallest normal double)";
      throw Error(os.str());
    }
    return h;
  };
  if (values && values->ndim() == 0) return checked(*static_cast<const double*>(values->data()));
  if (values && values->ndim() == 1) {
    const ConstView<double> view = view_of<double>(*values);
    std::vector<double> h(static_cast<size_t>(view.size(0)));
    for (size_t c = 0; c < h.size(); ++c) h[c] = checked(view(static_cast<int64_t>(c)));
    return h;
  }
  throw py::type_error(std::string(fn) + ": bandwidth is a " +
                       std::string(py::str(py::type::handle_of(obj).attr("__name__"))) +
                       "; expected a number, one number per feature, 'silverman', 'scott', "
                       "'cv' or 'cv-fast'");
}

struct Fitted {
  KernelRegression model;
  std::optional<CvResult> cv;
};

// The model of x and y with the bandwidth resolved (rules applied to x; cv
// to x and y). Runs without the GIL.
Fitted fit_model(ConstView<double> x, ConstView<double> y, Kernel kernel,
                 const Bandwidth& bandwidth) {
  Fitted f{KernelRegression(x, y, kernel), std::nullopt};
  if (const auto* h = std::get_if<double>(&bandwidth)) {
    f.model.set_bandwidth(*h);
  } else if (const auto* hs = std::get_if<std::vector<double>>(&bandwidth)) {
    f.model.set_bandwidth(*hs);
  } else {
    switch (std::get<Rule>(bandwidth)) {
      case Rule::kSilverman:
        f.model.set_bandwidth(silverman_bandwidth(x));
        break;
      case Rule::kScott:
        f.model.set_bandwidth(scott_bandwidth(x));
        break;
      case Rule::kCv:
        f.cv = cv_bandwidth(f.model);
        f.model.set_bandwidth(f.cv->bandwidth);
        break;
      case Rule::kCvFast: {
        // Checked here so the message names the Python argument, not the C++
        // function cv_bandwidth_fast_1d.
        const int64_t p = x.rank() == 1 ? 1 : x.size(1);
        if (kernel != Kernel::kGaussian || p != 1) {
          throw Error("bandwidth = 'cv-fast' is cv through the fast 1-D Gaussian path; x has " +
                      std::to_string(p) + " feature" + (p == 1 ? "" : "s") + " and the kernel is '" +
                      std::string(kernel_name(kernel)) + "' (use bandwidth='cv')");
        }
        f.cv = cv_bandwidth_fast_1d(f.model);
        f.model.set_bandwidth(f.cv->bandwidth);
        break;
      }
    }
  }
  return f;
}

py::array predictions(const KernelRegression& model, py::handle queries_obj, bool exact,
                      std::string_view fn) {
  py::array queries = data_array(queries_obj, fn, "x_query");
  const ConstView<double> q = view_of<double>(queries);
  KernelPrediction p;
  {
    const ReleasedGil release;
    p = calling(fn, [&] { return model.predict(q, exact); });
  }
  return to_numpy(std::move(p.values));
}

py::array nadaraya_watson_py(py::handle x_obj, py::handle y_obj, py::handle queries_obj,
                             const std::string& kernel, py::handle bandwidth_obj, bool exact) {
  constexpr std::string_view kFn = "nadaraya_watson";
  py::array x = data_array(x_obj, kFn, "x_train");
  py::array y = data_array(y_obj, kFn, "y_train");
  const Kernel k = kernel_of(kernel, kFn);
  const Bandwidth bandwidth = bandwidth_of(bandwidth_obj, kFn);
  const ConstView<double> xv = view_of<double>(x), yv = view_of<double>(y);
  std::optional<Fitted> fitted;
  {
    const ReleasedGil release;
    fitted.emplace(calling(kFn, [&] { return fit_model(xv, yv, k, bandwidth); }));
  }
  return predictions(fitted->model, queries_obj, exact, kFn);
}

py::array vector_array(const std::vector<double>& values) {
  py::array_t<double> array(static_cast<py::ssize_t>(values.size()));
  std::copy(values.begin(), values.end(), array.mutable_data());
  return array;
}

// qkv.KernelRegression: the estimator as scikit-learn users expect it.
class PyKernelRegression {
 public:
  PyKernelRegression(const std::string& kernel, py::handle bandwidth)
      : kernel_(kernel_of(kernel, "KernelRegression")),
        bandwidth_spec_(bandwidth_of(bandwidth, "KernelRegression")) {}

  void fit(py::handle x_obj, py::handle y_obj) {
    constexpr std::string_view kFn = "KernelRegression.fit";
    py::array x = data_array(x_obj, kFn, "x");
    py::array y = data_array(y_obj, kFn, "y");
    const ConstView<double> xv = view_of<double>(x), yv = view_of<double>(y);
    std::optional<Fitted> fitted;
    {
      const ReleasedGil release;
      fitted.emplace(calling(kFn, [&] { return fit_model(xv, yv, kernel_, bandwidth_spec_); }));
    }
    fitted_ = std::move(fitted);
    // Copies (data_array may return the caller's own array), for pickling.
    x_ = py::array(x.attr("copy")());
    y_ = py::array(y.attr("copy")());
  }

  // pickle: (kernel, bandwidth as given, and if fitted: x, y, the fitted
  // bandwidth, the cv search's (loo_error, iterations) or None). Unpickled,
  // the model is fitted again at the fitted bandwidth (numbers: no search),
  // so it predicts the same bits.
  py::tuple state() const {
    if (!fitted_) return py::make_tuple(kernel(), bandwidth());
    const auto& cv = fitted_->cv;
    return py::make_tuple(
        kernel(), bandwidth(), x_, y_, vector_array(fitted_->model.bandwidth()),
        cv ? py::object(py::make_tuple(cv->loo_error, cv->iterations)) : py::object(py::none()));
  }
  static PyKernelRegression from_state(const py::tuple& t) {
    if (t.size() != 2 && t.size() != 6) {
      throw Error("KernelRegression.__setstate__: a state of " + std::to_string(t.size()) +
                  " items; expected 2 or 6 (as pickled by this qkv)");
    }
    PyKernelRegression r(t[0].cast<std::string>(), t[1]);
    if (t.size() == 6) {
      const PyKernelRegression at_fitted(t[0].cast<std::string>(), t[4]);
      r.x_ = data_array(t[2], "KernelRegression.__setstate__", "x");
      r.y_ = data_array(t[3], "KernelRegression.__setstate__", "y");
      r.fitted_ = calling("KernelRegression.__setstate__", [&] {
        return fit_model(view_of<double>(r.x_), view_of<double>(r.y_), r.kernel_,
                         at_fitted.bandwidth_spec_);
      });
      if (!t[5].is_none()) {
        const auto cv = t[5].cast<std::pair<double, int>>();
        r.fitted_->cv = CvResult{r.fitted_->model.bandwidth(), cv.first, cv.second};
      }
    }
    return r;
  }

  const Fitted& fitted(std::string_view method) const {
    if (!fitted_) {
      throw py::value_error("KernelRegression." + std::string(method) +
                            ": the model is not fitted; call fit(x, y) first");
    }
    return *fitted_;
  }

  py::array predict(py::handle queries, bool exact) const {
    return predictions(fitted("predict").model, queries, exact, "KernelRegression.predict");
  }

  py::array weights(py::handle queries_obj) const {
    const KernelRegression& model = fitted("weights").model;
    constexpr std::string_view kFn = "KernelRegression.weights";
    py::array queries = data_array(queries_obj, kFn, "x_query");
    const ConstView<double> q = view_of<double>(queries);
    Tensor<double> w;
    {
      const ReleasedGil release;
      w = calling(kFn, [&] { return model.weights(q); });
    }
    return to_numpy(std::move(w));
  }

  double loo_error(py::handle bandwidth_obj) const {
    const KernelRegression& model = fitted("loo_error").model;
    if (bandwidth_obj.is_none()) {
      const ReleasedGil release;
      return model.loo_error();
    }
    const Bandwidth h = bandwidth_of(bandwidth_obj, "KernelRegression.loo_error");
    if (std::holds_alternative<Rule>(h)) {
      throw Error("KernelRegression.loo_error: bandwidth must be numbers, not a rule");
    }
    const std::vector<double> hs =
        std::holds_alternative<double>(h)
            ? std::vector<double>(model.bandwidth().size(), std::get<double>(h))
            : std::get<std::vector<double>>(h);
    const ReleasedGil release;
    return calling("KernelRegression.loo_error", [&] { return model.loo_error(hs); });
  }

  std::string kernel() const { return std::string(kernel_name(kernel_)); }
  py::object bandwidth() const {
    if (const auto* h = std::get_if<double>(&bandwidth_spec_)) return py::float_(*h);
    if (const auto* hs = std::get_if<std::vector<double>>(&bandwidth_spec_)) {
      return vector_array(*hs);
    }
    static const char* const kNames[] = {"silverman", "scott", "cv", "cv-fast"};
    return py::str(kNames[static_cast<int>(std::get<Rule>(bandwidth_spec_))]);
  }

 private:
  Kernel kernel_;
  Bandwidth bandwidth_spec_;
  std::optional<Fitted> fitted_;
  py::array x_, y_;  // what fit() got, as float64 copies
};

}  // namespace

void register_regression(py::module_& m) {
  m.def("nadaraya_watson", &nadaraya_watson_py, py::arg("x_train"), py::arg("y_train"),
        py::arg("x_query"), py::kw_only(), py::arg("kernel") = "gaussian",
        py::arg("bandwidth") = 1.0, py::arg("exact") = false,
        R"(Nadaraya-Watson kernel regression: predictions at x_query from (x_train, y_train).

f(q) = sum_i K((q - x_i) / h) y_i / sum_j K((q - x_j) / h): attention pooling
with the kernel as similarity. The Gaussian is evaluated as a softmax, so a
query far from every key gets its nearest keys' values, never 0/0. For 1-D x
with the Gaussian kernel and n * t > 1e6, an O((n + t) log n) algorithm
within 1e-7 (relative) of exact evaluation serves the call unless exact=True.

Arguments:
    x_train: (n) or (n, p); y_train: (n) or (n, m); x_query: (t) or (t, p).
        float64 (float32 is converted).
    kernel: 'gaussian', 'boxcar' (or 'uniform'), 'epanechnikov', 'triangular'.
    bandwidth: h, one number for every feature or one per feature, or a rule
        fitted to the training data: 'silverman', 'scott', 'cv'
        (leave-one-out cross-validation) or 'cv-fast' (the same error
        minimised through the fast 1-D path: one feature and the Gaussian
        kernel only; seconds where 'cv' takes hours at n = 200,000, the
        error at its bandwidth within 1e-7 of 'cv''s).
    exact: evaluate every kernel term even where the fast 1-D path would serve.

Returns:
    predictions (t) when y_train is 1-D, else (t, m), float64. Compact
    kernels give NaN for a query with no training point in reach.

Raises:
    TypeError: inputs that are not float arrays.
    qkv.Error (a ValueError): shapes that do not fit, NaN or inf in the
        data, an unknown kernel or rule, a bandwidth that is not a normal
        positive number.

>>> x = np.linspace(0, 5, 50); y = 2 * np.sin(x) + x ** 0.8
>>> qkv.nadaraya_watson(x, y, np.array([2.5]), bandwidth=0.3).round(3)
array([3.223])
)");

  py::class_<PyKernelRegression>(
      m, "KernelRegression",
      R"(Nadaraya-Watson kernel regression as an estimator: fit, then predict.

Mirrors the C++ qkv::KernelRegression; see nadaraya_watson for the formula,
the kernels and the bandwidth rules.

Arguments:
    kernel: 'gaussian', 'boxcar' (or 'uniform'), 'epanechnikov', 'triangular'.
    bandwidth: a number, one number per feature, 'silverman', 'scott', 'cv'
        or 'cv-fast' (one feature, Gaussian kernel).

Attributes (after fit):
    bandwidth_: the bandwidth per feature, an array (p,).
    cv_loo_error_, cv_iterations_: the leave-one-out error at the chosen
        bandwidth and the search's iterations (bandwidth='cv' or 'cv-fast',
        whose error is the fast path's, within about 1e-9 max|y| of the
        exact one; else None).
    n_features_in_: p.

>>> model = qkv.KernelRegression(bandwidth='cv').fit(x, y)
>>> model.bandwidth_.shape
(1,)
>>> model.predict(np.array([2.5])).shape
(1,)
)")
      .def(py::init<const std::string&, py::handle>(), py::arg("kernel") = "gaussian",
           py::arg("bandwidth") = 1.0)
      .def(
          "fit",
          [](py::object self, py::handle x, py::handle y) {
            self.cast<PyKernelRegression&>().fit(x, y);
            return self;
          },
          py::arg("x"), py::arg("y"),
          R"(Fits the model to training points x (n) or (n, p) and values y (n) or (n, m);
resolves a bandwidth rule. Returns the model itself.

Raises:
    qkv.Error (a ValueError): mismatched n, n = 0, NaN or inf in x or y, a
        rule that cannot be applied (a constant feature, n < 2).
)")
      .def("predict", &PyKernelRegression::predict, py::arg("x_query"), py::arg("exact") = false,
           R"(Predictions at the queries (t) or (t, p): (t) for 1-D y, else (t, m).

exact=True evaluates every kernel term even where the fast 1-D Gaussian
path would serve. Raises ValueError before fit.
)")
      .def("weights", &PyKernelRegression::weights, py::arg("x_query"),
           R"(The attention weights (t, n) of the queries over the training points,
in the order fit got them; rows sum to 1 (NaN rows for compact-kernel
queries with no point in reach).
)")
      .def("loo_error", &PyKernelRegression::loo_error, py::arg("bandwidth") = py::none(),
           R"(The leave-one-out squared error, mean over i of ||f_{-i}(x_i) - y_i||^2,
at the fitted bandwidth or the one given (numbers, not a rule).
)")
      .def(py::pickle([](const PyKernelRegression& r) { return r.state(); },
                      [](const py::tuple& t) { return PyKernelRegression::from_state(t); }))
      .def_property_readonly("kernel", &PyKernelRegression::kernel, "The kernel's name.")
      .def_property_readonly("bandwidth", &PyKernelRegression::bandwidth,
                             "The bandwidth as given: a number, numbers, or a rule's name.")
      .def_property_readonly(
          "bandwidth_",
          [](const PyKernelRegression& r) {
            return vector_array(r.fitted("bandwidth_").model.bandwidth());
          },
          "The fitted bandwidth per feature (p,).")
      .def_property_readonly(
          "cv_loo_error_",
          [](const PyKernelRegression& r) -> py::object {
            const Fitted& f = r.fitted("cv_loo_error_");
            return f.cv ? py::object(py::float_(f.cv->loo_error)) : py::none();
          },
          "The leave-one-out error at the cross-validated bandwidth (bandwidth='cv' or 'cv-fast'), "
          "else None.")
      .def_property_readonly(
          "cv_iterations_",
          [](const PyKernelRegression& r) -> py::object {
            const Fitted& f = r.fitted("cv_iterations_");
            return f.cv ? py::object(py::int_(f.cv->iterations)) : py::none();
          },
          "The cross-validation search's iterations (bandwidth='cv' or 'cv-fast'), else None.")
      .def_property_readonly(
          "n_features_in_",
          [](const PyKernelRegression& r) {
            return r.fitted("n_features_in_").model.num_features();
          },
          "The number of features p of the training points.");

  m.def(
      "silverman_bandwidth",
      [](py::handle x_obj) {
        py::array x = data_array(x_obj, "silverman_bandwidth", "x");
        return vector_array(silverman_bandwidth(view_of<double>(x)));
      },
      py::arg("x"),
      R"(Silverman's rule, 0.9 min(s, IQR / 1.349) n^(-1/5), per feature of x (n) or (n, p).

>>> qkv.silverman_bandwidth(np.arange(10.0)).round(4)
array([1.7193])
)");
  m.def(
      "scott_bandwidth",
      [](py::handle x_obj) {
        py::array x = data_array(x_obj, "scott_bandwidth", "x");
        return vector_array(scott_bandwidth(view_of<double>(x)));
      },
      py::arg("x"),
      R"(Scott's rule, 1.059 s n^(-1/(p + 4)), per feature of x (n) or (n, p).

>>> qkv.scott_bandwidth(np.arange(10.0)).round(4)
array([2.023])
)");

  m.def(
      "train_parametric",
      [](py::handle x_obj, py::handle y_obj, int epochs, double lr, std::optional<double> initial_w,
         py::handle seed) {
        constexpr std::string_view kFn = "train_parametric";
        py::array x = data_array(x_obj, kFn, "x");
        py::array y = data_array(y_obj, kFn, "y");
        ParametricOptions options;
        options.epochs = epochs;
        options.lr = lr;
        options.initial_w = initial_w;
        options.seed = seed_of(seed, kFn);
        const ConstView<double> xv = view_of<double>(x), yv = view_of<double>(y);
        ParametricResult r;
        {
          const ReleasedGil release;
          r = train_parametric(xv, yv, options);
        }
        return py::make_tuple(r.w, vector_array(r.losses), vector_array(r.ws));
      },
      py::arg("x"), py::arg("y"), py::kw_only(), py::arg("epochs") = 5, py::arg("lr") = 0.5,
      py::arg("initial_w") = py::none(), py::arg("seed") = 0,
      R"(The chapter's parametric model: Gaussian scores -((q - x_i) w)^2 / 2 with w
learned by full-batch SGD on the leave-one-out loss sum_i (f_{-i}(x_i) - y_i)^2.

Arguments:
    x: (n) or (n, p); y: (n) or (n, m); float64 (float32 is converted).
    epochs, lr: SGD's epochs and learning rate (the book's 5 and 0.5).
    initial_w: the starting w; default drawn from U(0, 1) by seed, as the
        book's torch.rand(1).

Returns:
    (w, losses, ws): the learned w (bandwidth 1/|w|), and the loss and w at
    the start of each epoch.

>>> w, losses, ws = qkv.train_parametric(x, y, initial_w=0.5)
>>> bool(losses[-1] < losses[0])
True
)");
}

}  // namespace qkv::python
