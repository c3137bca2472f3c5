"""The docstrings are the API's documentation: each public callable has one with
an example, and every example runs and prints what it shows.

- Every public function and class of qkv (qkv.__all__) and qkv.torch
  (qkv.torch.__all__) has a docstring with a `>>>` example, and so has every
  method of the store and the index (KeyValueStore.create, Index.attend,
  ...); the exception classes and the result and gradient named tuples
  (types, not operations) have a docstring; the estimator's methods and
  properties, and the store's and the index's properties, each have one.
- The examples run with doctest (NORMALIZE_WHITESPACE) in the order they
  appear in the sources, since later examples use names (q, k, v, x, y,
  store, index) defined by earlier ones: python/src/softmax.cc, attention.cc,
  pooling.cc, merge.cc, regression.cc, runtime.cc, store.cc (the order of
  their m.def / py::class_ registrations, a class's methods after it) and
  python/qkv/_heatmaps.py, then python/qkv/torch.py and python/qkv/_mha.py, all in one globals dict holding np, torch and qkv
  (with qkv.torch imported). Each docstring is one test.
- The submodules' bindings (python/src/search.cc: qkv.search) the same way,
  every method of their classes included, after the rest.
"""

import doctest
import os
import re

import numpy as np
import pytest
import torch

import qkv
import qkv.search
import qkv.torch

SOURCE = os.environ.get("QKV_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BINDING_FILES = ["softmax.cc", "attention.cc", "pooling.cc", "merge.cc", "regression.cc",
                 "runtime.cc", "store.cc"]
# Classes whose methods each carry an example, run after the class's own.
CLASSES_WITH_METHOD_EXAMPLES = {"KeyValueStore", "Index"}
# Submodules, one binding file each: file -> module; each method of their
# classes carries an example.
SUBMODULE_FILES = {"search.cc": "qkv.search"}
REGISTRATION = re.compile(r'(?P<function>\bm\.def\(\s*"(?P<f>\w+)")'
                          r'|(?P<cls>py::class_<[^>]*>\(\s*m\s*,\s*"(?P<c>\w+)")'
                          r'|(?P<method>\.def(?:_static)?\(\s*"(?P<m>\w+)")')
SUBMODULE_REGISTRATION = re.compile(r'(?P<cls>py::class_<[^>]*>\(\s*\w+\s*,\s*"(?P<c>\w+)")'
                                    r'|(?P<method>\.def(?:_static)?\(\s*"(?P<m>\w+)")')


def binding_order():
    """Public names registered by python/src's files, in the order of the sources:
    functions, classes, and "Class.method" for CLASSES_WITH_METHOD_EXAMPLES."""
    names = []
    for name in BINDING_FILES:
        with open(os.path.join(SOURCE, "python", "src", name)) as f:
            text = f.read()
        cls = None
        for m in REGISTRATION.finditer(text):
            if m.group("function"):
                cls, found = None, m.group("f")
            elif m.group("cls"):
                cls = found = m.group("c")
            elif cls in CLASSES_WITH_METHOD_EXAMPLES:
                found = f"{cls}.{m.group('m')}"
            else:
                continue
            if not found.split(".")[-1].startswith("_"):
                names.append(found)
    return names


def submodule_order():
    """(module, "Class" or "Class.method") of the submodules' binding files, in source order."""
    names = []
    for name, module in SUBMODULE_FILES.items():
        with open(os.path.join(SOURCE, "python", "src", name)) as f:
            text = f.read()
        cls = None
        for m in SUBMODULE_REGISTRATION.finditer(text):
            if m.group("cls"):
                cls = m.group("c")
                names.append((module, cls))
            elif cls and not m.group("m").startswith("_"):
                names.append((module, f"{cls}.{m.group('m')}"))
    return names


def python_order(*files):
    """The public functions and classes of python/qkv/<files>, in their order."""
    names = []
    for name in files:
        with open(os.path.join(SOURCE, "python", "qkv", name)) as f:
            text = f.read()
        names += [n for n in re.findall(r"^(?:def|class) (\w+)", text, re.M)
                  if not n.startswith("_")]
    return names


# qkv's: the bindings, then show_heatmaps (python/qkv/_heatmaps.py); qkv.torch's:
# python/qkv/torch.py, then MultiheadAttention (python/qkv/_mha.py, re-exported).
ORDER = [("qkv", n) for n in binding_order() + python_order("_heatmaps.py")] + \
    [("qkv.torch", n) for n in python_order("torch.py", "_mha.py")] + submodule_order()
IDS = [f"{module}.{name}" for module, name in ORDER]
TYPES = {"Error", "IoError", "ScaledDotProductAttentionGrads", "ScaledDotProductAttentionBiasGrads",
         "AdditiveAttentionGrads", "BilinearAttentionGrads", "MergedAttention",
         "StoreAttentionResult", "IndexAttentionResult"}


def resolve(module, name):
    obj = {"qkv": qkv, "qkv.torch": qkv.torch, "qkv.search": qkv.search}[module]
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_order_covers_the_public_api():
    scanned = {name for module, name in ORDER if module == "qkv" and "." not in name}
    callables = {n for n in qkv.__all__ if n not in TYPES and n != "__version__"}
    assert scanned == callables, (scanned ^ callables)
    assert [n for m, n in ORDER if m == "qkv.torch"] and \
        {n for m, n in ORDER if m == "qkv.torch"} == set(qkv.torch.__all__)
    for module in SUBMODULE_FILES.values():
        assert {n for m, n in ORDER if m == module and "." not in n} == \
            set(resolve(module, "__all__")), module
    assert len(ORDER) == len(set(ORDER))


@pytest.mark.parametrize("module,name", ORDER, ids=IDS)
def test_public_callable_has_a_docstring_with_an_example(module, name):
    obj = resolve(module, name)
    assert callable(obj)
    doc = obj.__doc__ or ""
    examples = doctest.DocTestParser().get_examples(doc)
    assert examples, f"{module}.{name} has no >>> example in its docstring"
    # More than a signature: a sentence saying what it does.
    assert len(doc.split(">>>")[0].strip()) > 40, f"{module}.{name}: {doc[:200]!r}"


@pytest.mark.parametrize("name", sorted(TYPES))
def test_types_have_docstrings(name):
    assert getattr(qkv, name).__doc__, name


@pytest.mark.parametrize("member", ["fit", "predict", "weights", "loo_error", "kernel",
                                    "bandwidth", "bandwidth_", "cv_loo_error_", "cv_iterations_",
                                    "n_features_in_"])
def test_estimator_members_have_docstrings(member):
    doc = getattr(qkv.KernelRegression, member).__doc__
    assert doc and len(doc.strip()) > 10, member


STORE_PROPERTIES = [("KeyValueStore", p) for p in ("dir", "rows", "key_dim", "value_dim", "dtype",
                                                    "chunk_rows", "num_chunks")] + \
    [("Index", p) for p in ("dir", "rows", "key_dim", "value_dim", "dtype", "num_lists",
                            "list_rows", "radii", "max_norms", "centroids",
                            "box_low", "box_high", "block_low", "block_high")]


@pytest.mark.parametrize("cls,member", STORE_PROPERTIES,
                         ids=[f"{c}.{m}" for c, m in STORE_PROPERTIES])
def test_store_and_index_properties_have_docstrings(cls, member):
    doc = getattr(qkv, cls).__dict__[member].__doc__
    assert doc and len(doc.strip()) > 10, f"{cls}.{member}"


def test_every_store_and_index_method_is_in_the_order():
    """A method added to the classes without an example would not be run."""
    for cls in CLASSES_WITH_METHOD_EXAMPLES:
        methods = {n for n, v in vars(getattr(qkv, cls)).items()
                   if not n.startswith("_") and not isinstance(v, property)}
        assert methods == {n.split(".")[1] for m, n in ORDER if n.startswith(cls + ".")}, cls
    for module, cls in [(m, n) for m, n in ORDER if m in SUBMODULE_FILES.values() and "." not in n]:
        methods = {n for n, v in vars(resolve(module, cls)).items()
                   if not n.startswith("_") and not isinstance(v, property)}
        assert methods == {n.split(".")[1] for m, n in ORDER
                           if m == module and n.startswith(cls + ".")}, cls


class Recorder(doctest.DocTestRunner):
    """Keeps each failing example: its source, what the docstring shows and what it printed."""

    def __init__(self):
        super().__init__(optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
        self.recorded = []

    def report_failure(self, out, test, example, got):
        self.recorded.append((test.name, example.source.strip(), example.want.rstrip(),
                              got.rstrip()))

    def report_unexpected_exception(self, out, test, example, exc_info):
        error = "".join(doctest.traceback.format_exception_only(*exc_info[:2])).strip()
        self.recorded.append((test.name, example.source.strip(), example.want.rstrip(),
                              f"raised {error}"))


@pytest.fixture(scope="module")
def doctest_runs():
    """Runs every docstring's examples in source order in one globals dict; returns
    {id: (examples run, failures)}."""
    threads, target = qkv.get_num_threads(), qkv.simd_target()
    shared = {"np": np, "torch": torch, "qkv": qkv}
    parser = doctest.DocTestParser()
    runs = {}
    torch_state = torch.random.get_rng_state()
    try:
        for (module, name), test_id in zip(ORDER, IDS):
            obj = resolve(module, name)
            test = parser.get_doctest(obj.__doc__ or "", shared, test_id, None, 0)
            test.globs = shared  # share names with the examples that follow
            runner = Recorder()
            runner.run(test, out=lambda text: None, clear_globs=False)
            runs[test_id] = (len(test.examples), runner.recorded)
    finally:
        torch.random.set_rng_state(torch_state)
        qkv.set_num_threads(threads)
        qkv.set_simd_target(os.environ.get("QKV_SIMD_TARGET", ""))
        if qkv.simd_target() != target:
            qkv.set_simd_target(target)
    return runs


@pytest.mark.parametrize("test_id", IDS)
def test_docstring_examples_print_what_they_show(doctest_runs, test_id):
    count, failures = doctest_runs[test_id]
    assert count > 0
    assert not failures, "\n\n".join(
        f"{name}:\n>>> {source}\nthe docstring shows:\n{want}\nit printed:\n{got}"
        for name, source, want, got in failures)
