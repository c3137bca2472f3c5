// The runtime: version, errors, thread count and SIMD target.
#include <pybind11/stl.h>

#include "bindings.h"
#include "qkv/error.h"
#include "qkv/simd.h"
#include "qkv/threads.h"
#include "qkv/version.h"

namespace qkv::python {

namespace py = pybind11;

bool python_signal_raised() {
  const py::gil_scoped_acquire gil;
  return PyErr_CheckSignals() != 0;
}

std::string as_python_call(const std::string& message, std::string_view fn, std::string_view cpp) {
  const std::string prefix = std::string(cpp) + ": ";
  if (message.rfind(prefix, 0) == 0) return std::string(fn) + ": " + message.substr(prefix.size());
  return std::string(fn) + ": " + message;
}

std::string path_of(py::handle obj, std::string_view fn, std::string_view name) {
  if (!py::isinstance<py::str>(obj) && !py::isinstance<py::bytes>(obj) &&
      !py::hasattr(obj, "__fspath__")) {
    throw py::type_error(std::string(fn) + ": " + std::string(name) + " is a " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))) +
                         "; expected a path (a str or an os.PathLike such as pathlib.Path)");
  }
  return py::cast<std::string>(py::module_::import("os").attr("fsdecode")(obj));
}

void register_runtime(py::module_& m) {
  m.attr("__version__") = kVersion;

  // qkv::Error (bad arguments or input) is a ValueError, qkv::IoError (the
  // system failed the call) an OSError; both keep the library's message.
  py::register_exception<Error>(m, "Error", PyExc_ValueError).doc() =
      "Bad arguments or input: qkv::Error, a ValueError. The message names the function, the "
      "argument and the shapes, e.g. 'scaled_dot_product_attention: keys has D = 3 but queries "
      "has D = 2 (keys [2, 5, 3], queries [2, 4, 2])'.";
  py::register_exception<IoError>(m, "IoError", PyExc_OSError).doc() =
      "The system failed a call whose arguments were fine (qkv::IoError, an OSError).";
  m.attr("Error").attr("__module__") = "qkv";
  m.attr("IoError").attr("__module__") = "qkv";
  // A call stopped by Ctrl-C (ReleasedGil): the KeyboardInterrupt the signal
  // handler raised, still set; or one made here if a handler left none.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Interrupted&) {
      if (!PyErr_Occurred()) PyErr_SetNone(PyExc_KeyboardInterrupt);
    }
  });

  m.def("set_num_threads", &set_num_threads, py::arg("n"),
        R"(Sets the number of threads qkv's ops use from now on.

Results are bitwise the same for any thread count: work is split into blocks
fixed by the shapes alone.

Arguments:
    n: 1 to 1024 threads, or 0 for the default (the QKV_NUM_THREADS
        environment variable if it holds such a number, else every core).

Raises:
    qkv.Error (a ValueError): n < 0 or n > 1024.

>>> qkv.set_num_threads(1)
>>> qkv.get_num_threads()
1
>>> qkv.set_num_threads(0)  # back to the default
)");
  m.def("get_num_threads", &num_threads,
        R"(The number of threads qkv's ops use (see set_num_threads).

>>> qkv.get_num_threads() >= 1
True
)");

  m.def("simd_targets", &simd_targets,
        R"(The SIMD targets this build has and this CPU supports, best first.

Returns:
    A list such as ['avx512', 'avx2', 'sse4', 'scalar'].

>>> 'scalar' in qkv.simd_targets()
True
)");
  m.def("simd_target", &simd_target,
        R"(The SIMD target qkv's kernels run on now: the best of simd_targets(), or
the cap set by set_simd_target or the QKV_SIMD_TARGET environment variable.

>>> qkv.simd_target() in qkv.simd_targets()
True
)");
  m.def("set_simd_target", &set_simd_target, py::arg("name"),
        R"(Caps the kernels at one SIMD target (and those below it), e.g. to see on
an AVX-512 machine what an AVX2-only machine computes; "" lifts the cap.
Call it while no qkv op runs on another thread.

Arguments:
    name: one of simd_targets(), or "".

Raises:
    qkv.Error (a ValueError): a name not in simd_targets(); the message lists them.

>>> qkv.set_simd_target('scalar'); qkv.simd_target()
'scalar'
>>> qkv.set_simd_target('')
)");
  m.def(
      "simd_info",
      [] {
        const SimdInfo info = simd_info();
        py::dict d;
        d["simd_targets_compiled"] = info.compiled;
        d["simd_targets_supported"] = info.supported;
        d["simd_target"] = info.chosen;
        d["simd_cap"] = info.cap.empty() ? py::object(py::none()) : py::str(info.cap);
        py::dict features;
        for (const auto& [name, present] : info.cpu_features) features[py::str(name)] = present;
        d["cpu_features"] = features;
        d["bf16_products"] = info.bf16_products;
        d["bf16_products_why"] = info.bf16_products_why;
        d["blas"] = info.blas;
        d["blas_core"] = info.blas_core;
        d["blas_core_found"] = info.blas_core_found;
        d["blas_core_from"] = info.blas_core_from;
        d["blas_core_action"] = info.blas_core_action;
        return d;
      },
      R"(What this build and this CPU offer, and what the kernels run on (as `qkv info`).

Returns:
    A dict: simd_targets_compiled and simd_targets_supported (best first),
    simd_target (the one in use), simd_cap (None without a cap),
    cpu_features ({name: bool} for the features the kernels look for, e.g.
    'avx2', 'avx512f', 'avx512bf16'), bf16_products ('amx', 'avx512_bf16' or
    'widen') and bf16_products_why (the reason, in words), blas (OpenBLAS's configuration), and OpenBLAS's kernels:
    blas_core (the core type running), blas_core_found and blas_core_from
    (what OpenBLAS chose as it loaded, and from what) and blas_core_action
    (what qkv did: it switches OpenBLAS to the best core type this CPU runs
    when OpenBLAS's is older; QKV_BLAS_CORE=keep keeps it).

>>> info = qkv.simd_info()
>>> info['simd_target'] == qkv.simd_target()
True
)");

  // The qkv command, the tests and benchmarks honour QKV_SIMD_TARGET at
  // start-up; so does the module, when it is imported.
  set_simd_target_from_env();
}

}  // namespace qkv::python
