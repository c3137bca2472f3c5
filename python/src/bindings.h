// The areas of the qkv._qkv extension module, one file each (module.cc
// lists the calls): every def carries a docstring with Arguments, Returns,
// Raises and an example, and releases the GIL while qkv computes.
#pragma once

#include <pybind11/pybind11.h>

namespace qkv::python {

void register_runtime(pybind11::module_& m);     // runtime.cc: version, threads, SIMD target, errors
void register_softmax(pybind11::module_& m);     // softmax.cc: masked softmax and its backward
void register_attention(pybind11::module_& m);   // attention.cc: SDPA, additive, backward, bf16
void register_pooling(pybind11::module_& m);     // pooling.cc: pooling with given weights
void register_merge(pybind11::module_& m);       // merge.cc: merging attention over parts of a key set
void register_regression(pybind11::module_& m);  // regression.cc: Nadaraya-Watson

}  // namespace qkv::python
