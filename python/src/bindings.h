// The areas of the qkv._qkv extension module, one file each (module.cc
// lists the calls): every def carries a docstring with Arguments, Returns,
// Raises and an example, and releases the GIL while qkv computes.
#pragma once

#include <pybind11/pybind11.h>

#include "qkv/threads.h"

namespace qkv::python {

// Whether Python has a signal pending whose handler raised (Ctrl-C's
// KeyboardInterrupt): takes the GIL for the moment and runs the handlers
// (PyErr_CheckSignals), which only the main thread does; the exception
// stays set for the call to raise.
bool python_signal_raised();

// The GIL released while qkv computes, and Ctrl-C able to stop it: the
// calling thread asks python_signal_raised between the call's tasks (every
// 20 ms at most: qkv::InterruptPoll), and a KeyboardInterrupt stops the call
// (qkv::Interrupted, which runtime.cc turns back into that KeyboardInterrupt)
// instead of arriving when it ends (22 s later in the test that found it).
class ReleasedGil {
 public:
  ReleasedGil() = default;

 private:
  pybind11::gil_scoped_release release_;
  InterruptPoll poll_{&python_signal_raised};
};

void register_runtime(pybind11::module_& m);    // runtime.cc: version, threads, SIMD target, errors
void register_softmax(pybind11::module_& m);    // softmax.cc: masked softmax and its backward
void register_attention(pybind11::module_& m);  // attention.cc: SDPA, additive, backward, bf16
void register_pooling(pybind11::module_& m);    // pooling.cc: pooling with given weights
void register_merge(pybind11::module_& m);  // merge.cc: merging attention over parts of a key set
void register_regression(pybind11::module_& m);  // regression.cc: Nadaraya-Watson
void register_store(pybind11::module_& m);  // store.cc: the on-disk key-value store and its index
void register_search(pybind11::module_& m);  // search.cc: the search engine's sentence encoder

}  // namespace qkv::python
