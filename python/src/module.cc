// qkv._qkv: the compiled half of the Python package (python/qkv/__init__.py
// re-exports it as `qkv`). Only the list of areas lives here.
#include <pybind11/pybind11.h>

#include "bindings.h"

PYBIND11_MODULE(_qkv, m) {
  m.doc() = "qkv's compiled kernels and ops; use them through the `qkv` package.";
  qkv::python::register_runtime(m);
  qkv::python::register_softmax(m);
  qkv::python::register_attention(m);
  qkv::python::register_pooling(m);
  qkv::python::register_merge(m);
  qkv::python::register_regression(m);
  qkv::python::register_store(m);
  qkv::python::register_search(m);
}
