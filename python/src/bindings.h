// The areas of the qkv._qkv extension module, one file each (module.cc
// lists the calls): every def carries a docstring with Arguments, Returns,
// Raises and an example, and releases the GIL while qkv computes.
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <string_view>

#include "qkv/error.h"
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

// `message` as the Python call `fn` tells it: the C++ function's name `cpp`
// in front becomes fn ("KeyValueStore::open: ..." -> "KeyValueStore.open:
// ..."), and a message from a function further down gets fn in front
// ("KeyValueStore.attend: KeyValueStore::read_chunk: FILE: ...").
std::string as_python_call(const std::string& message, std::string_view fn, std::string_view cpp);

// Runs a library call without the GIL (Ctrl-C stops it); its Error and
// IoError are told as the Python call's (as_python_call).
template <class F>
auto released(std::string_view fn, std::string_view cpp, F&& f) -> decltype(f()) {
  try {
    const ReleasedGil release;
    return f();
  } catch (const Error& e) {
    throw Error(as_python_call(e.what(), fn, cpp));
  } catch (const IoError& e) {
    throw IoError(as_python_call(e.what(), fn, cpp));
  }
}

// A path argument: a str, bytes or os.PathLike (pathlib.Path), as the file
// system spells it; else a TypeError naming fn and name.
std::string path_of(pybind11::handle obj, std::string_view fn, std::string_view name);

void register_runtime(pybind11::module_& m);    // runtime.cc: version, threads, SIMD target, errors
void register_softmax(pybind11::module_& m);    // softmax.cc: masked softmax and its backward
void register_attention(pybind11::module_& m);  // attention.cc: SDPA, additive, backward, bf16
void register_pooling(pybind11::module_& m);    // pooling.cc: pooling with given weights
void register_merge(pybind11::module_& m);  // merge.cc: merging attention over parts of a key set
void register_regression(pybind11::module_& m);  // regression.cc: Nadaraya-Watson
void register_store(pybind11::module_& m);   // store.cc: the on-disk key-value store and its index
void register_search(pybind11::module_& m);  // search.cc: qkv.search (the tokenizer and the sentence encoder)

}  // namespace qkv::python
