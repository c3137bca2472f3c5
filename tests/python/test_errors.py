"""Every error path of the NumPy API: the exception's type and its message.

- TypeError for what is not the right kind of thing: int, bool, complex,
  object, string and float16 arrays where floats are expected, mixed
  float32/float64, valid lengths or indices that are not integers (floats,
  bools), a seed that is not a whole number; the message names the function
  and the argument. So do arguments that do not fit a signature (an unknown
  keyword, with the nearest known one; a missing argument; one positional
  argument too many; a value of the wrong kind), not pybind11's listing.
- qkv.Error (a ValueError, the C++ library's qkv::Error) for values and shapes
  the library refuses, with its message: the function, the argument and the
  shapes (e.g. 'scaled_dot_product_attention: keys has D = 3 but queries has
  D = 2 (keys [..], queries [..])'); a ValueError for the binding's own checks
  (ranks, seeds out of range, an estimator used before fit). A separate test
  holds the binding's shape errors to the documented type, qkv.Error.
- Runtime settings: set_num_threads(-1), (2000), set_simd_target('nope');
  a refused setting leaves the old one in place.
- Never a crash: garbage (None, strings, bytes, dicts, ragged lists, sets,
  objects, functions) in every argument of every function, in a child
  process, gives a TypeError or ValueError; so does every op on empty
  tensors (each of B, Nq, Nk, D, Dv zero), unless it returns results of the
  right shapes.
"""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

import qkv

F4, F8 = np.float32, np.float64


class Arrays:
    """Valid inputs of every op, float32, drawn from rng:
    queries (2, 3, 4), keys (2, 5, 4), values (2, 5, 6), additive W_q (7, 4),
    W_k (7, 4), w_v (7), scores X (2, 3, 5), and the forward's output and lse."""

    def __init__(self, rng):
        n = lambda *s: rng.standard_normal(s).astype(F4)  # noqa: E731
        self.q, self.k, self.v = n(2, 3, 4), n(2, 5, 4), n(2, 5, 6)
        self.Wq, self.Wk, self.wv = n(7, 4), n(7, 4), n(7)
        self.X = n(2, 3, 5)
        self.out, self.lse = qkv.scaled_dot_product_attention(self.q, self.k, self.v,
                                                              return_lse=True)
        self.aout, self.alse = qkv.additive_attention(self.q, self.k, self.v, self.Wq, self.Wk,
                                                      self.wv, return_lse=True)
        self.x = np.sort(rng.uniform(0, 5, 20))
        self.y = np.sin(self.x) + rng.normal(0, 0.1, 20)


@pytest.fixture
def a(rng):
    return Arrays(rng)


def check_raises(call, kind, fn, parts):
    """call() raises `kind` ('TypeError', 'ValueError' or 'qkv.Error') whose message
    starts with 'fn: ' (unless fn is None) and holds every string of `parts`."""
    with pytest.raises(Exception) as info:
        call()
    e = info.value
    if kind == "TypeError":
        assert isinstance(e, TypeError) and not isinstance(e, ValueError), repr(e)
    elif kind == "qkv.Error":
        assert type(e) is qkv.Error, f"{type(e).__module__}.{type(e).__name__}: {e}"
        assert isinstance(e, ValueError)
    else:
        assert isinstance(e, ValueError), repr(e)
    message = str(e)
    if fn is not None:
        assert message.startswith(f"{fn}: "), f"message does not name {fn}: {message}"
    for part in parts:
        assert part in message, f"{part!r} not in the message: {message}"
    assert "\n" not in message, f"a one-line message, got: {message}"


# ---- dtypes: TypeError --------------------------------------------------------------

BAD_DTYPES = [np.int64, np.int32, np.uint8, np.bool_, np.complex64, np.complex128, np.float16,
              object, "U3"]


def bad(array, dtype):
    return array.astype(dtype)


SDPA_ARGS = ["queries", "keys", "values"]
ADDITIVE_ARGS = ["queries", "keys", "values", "W_q", "W_k", "w_v"]


def sdpa_kwargs(a):
    return {"queries": a.q, "keys": a.k, "values": a.v}


def additive_kwargs(a):
    return {"queries": a.q, "keys": a.k, "values": a.v, "W_q": a.Wq, "W_k": a.Wk, "w_v": a.wv}


def sdpa_backward_kwargs(a):
    return {**sdpa_kwargs(a), "output": a.out, "lse": a.lse, "d_output": a.out}


def additive_backward_kwargs(a):
    return {**additive_kwargs(a), "output": a.aout, "lse": a.alse, "d_output": a.aout}


FLOAT_ARGUMENTS = [  # (function, kwargs maker, float arguments)
    ("scaled_dot_product_attention", sdpa_kwargs, SDPA_ARGS),
    ("scaled_dot_product_attention_backward", sdpa_backward_kwargs,
     SDPA_ARGS + ["output", "lse", "d_output"]),
    ("additive_attention", additive_kwargs, ADDITIVE_ARGS),
    ("additive_attention_backward", additive_backward_kwargs,
     ADDITIVE_ARGS + ["output", "lse", "d_output"]),
    ("masked_softmax", lambda a: {"X": a.X}, ["X"]),
    ("masked_softmax_backward", lambda a: {"weights": a.X, "d_weights": a.X},
     ["weights", "d_weights"]),
    ("attention_pooling", lambda a: {"weights": a.X, "values": a.v}, ["weights", "values"]),
    ("average_pooling", lambda a: {"values": a.v, "num_queries": 3}, ["values"]),
    ("one_hot_lookup", lambda a: {"index": [[0, 1, 2]] * 2, "values": a.v}, ["values"]),
]
FLOAT_CASES = [(fn, make, name) for fn, make, names in FLOAT_ARGUMENTS for name in names]


def dtype_id(dtype):
    return np.dtype(dtype).name if dtype != "U3" else "str"


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("fn,make,name", FLOAT_CASES, ids=[f"{c[0]}-{c[2]}" for c in FLOAT_CASES])
def test_non_float_dtypes_are_type_errors(a, fn, make, name, dtype):
    kwargs = make(a)
    kwargs[name] = bad(kwargs[name], dtype)
    check_raises(lambda: getattr(qkv, fn)(**kwargs), "TypeError", fn,
                 [f"{name} has dtype {np.dtype(dtype)}", "expected float32 or float64"])


MIXED_CASES = [(fn, make, name) for fn, make, names in FLOAT_ARGUMENTS for name in names[1:]
               if fn not in ("average_pooling", "one_hot_lookup")]


@pytest.mark.parametrize("first", [F4, F8], ids=["float32-first", "float64-first"])
@pytest.mark.parametrize("fn,make,name", MIXED_CASES, ids=[f"{c[0]}-{c[2]}" for c in MIXED_CASES])
def test_mixed_float_dtypes_are_type_errors(a, fn, make, name, first):
    kwargs = {n: (x.astype(first) if isinstance(x, np.ndarray) else x)
              for n, x in make(a).items()}
    other = F8 if first is F4 else F4
    kwargs[name] = kwargs[name].astype(other)
    first_name = next(iter(kwargs))
    check_raises(lambda: getattr(qkv, fn)(**kwargs), "TypeError", fn,
                 [f"{name} has dtype {np.dtype(other)} but {first_name} has {np.dtype(first)}",
                  "one dtype"])


LENS_FUNCTIONS = {
    "masked_softmax": lambda a, L: qkv.masked_softmax(a.X, L),
    "masked_softmax_backward": lambda a, L: qkv.masked_softmax_backward(a.X, a.X, L),
    "scaled_dot_product_attention": lambda a, L: qkv.scaled_dot_product_attention(
        a.q, a.k, a.v, L),
    "scaled_dot_product_attention_backward": lambda a, L: (
        qkv.scaled_dot_product_attention_backward(a.q, a.k, a.v, a.out, a.lse, a.out, L)),
    "additive_attention": lambda a, L: qkv.additive_attention(a.q, a.k, a.v, a.Wq, a.Wk, a.wv,
                                                              L),
    "additive_attention_backward": lambda a, L: qkv.additive_attention_backward(
        a.q, a.k, a.v, a.Wq, a.Wk, a.wv, a.aout, a.alse, a.aout, L),
    "average_pooling": lambda a, L: qkv.average_pooling(a.v, 3, L),
    "uniform_weights": lambda a, L: qkv.uniform_weights(2, 3, 5, L),
}
NON_INTEGER_LENS = [
    ("floats", [1.0, 2.0], "float64"), ("float array", np.array([1, 2], F4), "float32"),
    ("whole floats", np.array([[1.0, 2, 3], [4, 5, 5]]), "float64"),
    ("bools", [True, False], "bool"), ("bool array", np.ones((2, 3), bool), "bool"),
    ("complex", np.array([1, 2], complex), "complex128"), ("strings", ["1", "2"], "<U1"),
    ("objects", np.array([1, 2], object), "object"), ("a float", 2.0, "float64"),
    ("a bool", True, "bool"),
]


@pytest.mark.parametrize("lens", NON_INTEGER_LENS, ids=[c[0] for c in NON_INTEGER_LENS])
@pytest.mark.parametrize("fn", list(LENS_FUNCTIONS))
def test_non_integer_valid_lens_are_type_errors(a, fn, lens):
    _, value, dtype = lens
    check_raises(lambda: LENS_FUNCTIONS[fn](a, value), "TypeError", fn,
                 [f"valid_lens has dtype {dtype}", "expected integers"])


@pytest.mark.parametrize("fn", list(LENS_FUNCTIONS))
def test_uint64_valid_lens_past_int64_are_named_as_given(a, fn):
    """2^64 - 1 as uint64 was converted to int64 and named as -1."""
    lens = np.array([2, 2**64 - 1], np.uint64)
    check_raises(lambda: LENS_FUNCTIONS[fn](a, lens), "qkv.Error", fn,
                 ["valid_lens holds 18446744073709551615 (uint64)", "beyond any length"])


@pytest.mark.parametrize("fn", ["scaled_dot_product_attention", "additive_attention",
                                "bilinear_attention", "distance_attention"])
@pytest.mark.parametrize("causal", [True, 1, b"top-left"], ids=["True", "one", "bytes"])
def test_causal_that_is_not_a_name_is_a_type_error_naming_it(a, fn, causal):
    """causal=True (torch's is_causal spelling) got pybind11's "incompatible
    function arguments" and the whole signature."""
    call = {
        "scaled_dot_product_attention": lambda: qkv.scaled_dot_product_attention(
            a.q, a.k, a.v, causal=causal),
        "additive_attention": lambda: qkv.additive_attention(a.q, a.k, a.v, a.Wq, a.Wk, a.wv,
                                                             causal=causal),
        "bilinear_attention": lambda: qkv.bilinear_attention(
            a.q, a.k, a.v, np.ones((a.q.shape[-1], a.k.shape[-1]), a.q.dtype), causal=causal),
        "distance_attention": lambda: qkv.distance_attention(a.q, a.k, a.v, causal=causal),
    }[fn]
    check_raises(call, "TypeError", fn,
                 [f"causal is {causal!r}", "expected None, 'top-left'", "'bottom-right'"])


@pytest.mark.parametrize("window", [(1,), (1, 2, 3), "ab", (1.5, 2), (True, 1), 3, [None, 1]],
                         ids=["one", "three", "string", "float", "bool", "int", "none"])
def test_a_window_that_is_not_two_integers_is_a_type_error(a, window):
    """window=(1,) gave pybind11's "Unable to cast Python instance to C++ type"."""
    check_raises(lambda: qkv.scaled_dot_product_attention(a.q, a.k, a.v, window=window),
                 "TypeError", "scaled_dot_product_attention",
                 [f"window is {window!r}", "expected (left, right), two integers"])


# ---- arguments that do not fit a signature: named, not pybind11's listing ----------------

PUBLIC_FUNCTIONS = [n for n in qkv.__all__
                    if callable(getattr(qkv, n)) and not isinstance(getattr(qkv, n), type)]
# The compiled ones: pybind11 answered a bad keyword with its wall (Python's
# own functions, such as show_heatmaps, name the keyword themselves).
COMPILED_FUNCTIONS = [n for n in PUBLIC_FUNCTIONS if getattr(qkv, n).__module__ == "qkv._qkv"]


@pytest.mark.parametrize("name", COMPILED_FUNCTIONS)
def test_an_unknown_keyword_is_named_by_every_function(name):
    """qkv.masked_softmax(x, dropout_p=0.1) got pybind11's "incompatible
    function arguments" wall: the signature and every array printed."""
    check_raises(lambda: getattr(qkv, name)(no_such_argument=[1, 2]), "TypeError", f"qkv.{name}",
                 ["unknown argument no_such_argument=[1, 2]", "(it takes "])


def test_arguments_that_do_not_fit_are_named_with_the_nearest_keyword(a):
    x, kr = a.q, qkv.KernelRegression
    cases = [
        (lambda: qkv.masked_softmax(x, dropout_p=0.1), "qkv.masked_softmax",
         ["unknown argument dropout_p=0.1", "(it takes X, valid_lens)"]),
        (lambda: qkv.scaled_dot_product_attention(x, x, x, scael=2.0),
         "qkv.scaled_dot_product_attention", ["unknown argument scael=2.0; did you mean scale?"]),
        (lambda: kr(bandwith=1), "qkv.KernelRegression",
         ["unknown argument bandwith=1; did you mean bandwidth? (it takes kernel, bandwidth)"]),
        (lambda: kr(bandwidth=1.0).fit(x[0, :, 0], x[0, :, 1]).predict(x[0, :, 0], exakt=True),
         "qkv.KernelRegression.predict", ["unknown argument exakt=True; did you mean exact?"]),
        (lambda: qkv.scaled_dot_product_attention(x, x), "qkv.scaled_dot_product_attention",
         ["missing argument values (required: queries, keys, values)"]),
        (lambda: kr().fit(x), "qkv.KernelRegression.fit", ["missing argument y (required: x, y)"]),
        (lambda: qkv.masked_softmax(x, None, 3), "qkv.masked_softmax",
         ["takes 2 positional arguments (X, valid_lens) but was given 3"]),
        (lambda: qkv.scaled_dot_product_attention(x, x, x, None, 0.5),
         "qkv.scaled_dot_product_attention",
         ["takes 4 positional arguments (queries, keys, values, valid_lens) but was given 5; "
          "scale, dropout_p, ", " are keyword-only (name=value)"]),
        (lambda: kr("gaussian", 1.0, 3), "qkv.KernelRegression",
         ["takes 2 positional arguments (kernel, bandwidth) but was given 3"]),
        (lambda: qkv.masked_softmax(x, X=x), "qkv.masked_softmax",
         [f"X given twice, by position and as X=an array of shape {x.shape} and dtype {x.dtype}"]),
        (lambda: qkv.scaled_dot_product_attention(x, x, x, scale="a"),
         "qkv.scaled_dot_product_attention", ["scale takes a number or None, not a str: scale='a'"]),
        (lambda: qkv.scaled_dot_product_attention(x, x, x, return_weights="yes"),
         "qkv.scaled_dot_product_attention",
         ["return_weights takes True or False, not a str: return_weights='yes'"]),
        (lambda: qkv.nadaraya_watson(x[0, :, 0], x[0, :, 1], x[0, :, 0], kernel=3),
         "qkv.nadaraya_watson", ["kernel takes a string, not an int: kernel=3"]),
        (lambda: qkv.set_num_threads(2.5), "qkv.set_num_threads",
         ["n takes an integer, not a float: n=2.5"]),
    ]
    for call, fn, parts in cases:
        check_raises(call, "TypeError", fn, parts)


@pytest.mark.parametrize("index", [[[0.0, 1.0, 2.0]] * 2, np.ones((2, 3), bool), [["a"] * 3] * 2],
                         ids=["floats", "bools", "strings"])
def test_non_integer_indices_are_type_errors(a, index):
    dtype = str(np.asarray(index).dtype)
    check_raises(lambda: qkv.one_hot_lookup(index, a.v), "TypeError", "one_hot_lookup",
                 [f"index has dtype {dtype}", "expected integers"])
    check_raises(lambda: qkv.one_hot_weights(index, 5), "TypeError", "one_hot_weights",
                 [f"index has dtype {dtype}", "expected integers"])


SEED_FUNCTIONS = {
    "scaled_dot_product_attention": lambda a, s: qkv.scaled_dot_product_attention(
        a.q, a.k, a.v, dropout_p=0.5, seed=s),
    "scaled_dot_product_attention_backward": lambda a, s: (
        qkv.scaled_dot_product_attention_backward(a.q, a.k, a.v, a.out, a.lse, a.out, seed=s)),
    "additive_attention": lambda a, s: qkv.additive_attention(a.q, a.k, a.v, a.Wq, a.Wk, a.wv,
                                                              seed=s),
    "additive_attention_backward": lambda a, s: qkv.additive_attention_backward(
        a.q, a.k, a.v, a.Wq, a.Wk, a.wv, a.aout, a.alse, a.aout, seed=s),
    "train_parametric": lambda a, s: qkv.train_parametric(a.x, a.y, seed=s),
}


@pytest.mark.parametrize("value,typename", [(1.0, "float"), (2.5, "float"),
                                            (np.float64(3), "float64"), (True, "bool"),
                                            ("7", "str"), (None, "NoneType"), ([1], "list")],
                         ids=repr)
@pytest.mark.parametrize("fn", list(SEED_FUNCTIONS))
def test_non_integer_seeds_are_type_errors(a, fn, value, typename):
    if value is None and fn != "train_parametric":
        # None is dropout's default: a fresh seed per call (test_numpy_api.py).
        SEED_FUNCTIONS[fn](a, value)
        return
    check_raises(lambda: SEED_FUNCTIONS[fn](a, value), "TypeError", fn,
                 [f"seed is a {typename}", "expected a whole number in [0, 2**64)"])


@pytest.mark.parametrize("value", [-1, -(2**70), 2**64, 2**64 + 5], ids=str)
@pytest.mark.parametrize("fn", list(SEED_FUNCTIONS))
def test_seeds_outside_64_bits_are_value_errors(a, fn, value):
    check_raises(lambda: SEED_FUNCTIONS[fn](a, value), "ValueError", fn,
                 [f"seed = {value} is outside [0, 2**64)"])


@pytest.mark.parametrize("fn", list(SEED_FUNCTIONS))
def test_whole_number_seeds_of_any_integer_type_are_taken(a, fn):
    # NumPy integers and the ends of the range are whole numbers in [0, 2**64).
    for value in (0, 2**64 - 1, np.uint64(2**64 - 1), np.int32(5), np.int64(5)):
        SEED_FUNCTIONS[fn](a, value)


# ---- shapes and values: qkv.Error / ValueError ----------------------------------------

def sdpa_case(**changes):
    def call(a):
        kw = dict(queries=a.q, keys=a.k, values=a.v)
        kw.update({k: (v(a) if callable(v) else v) for k, v in changes.items()})
        return lambda: qkv.scaled_dot_product_attention(**kw)
    return call


SDPA = "scaled_dot_product_attention"
SDPA_B = "scaled_dot_product_attention_backward"
ADD = "additive_attention"
ADD_B = "additive_attention_backward"

SHAPE_CASES = [
    # id, call maker, kind, function, message parts
    ("sdpa D", lambda a: lambda: qkv.scaled_dot_product_attention(a.q[..., :2], a.k[..., :3], a.v),
     "qkv.Error", SDPA,
     ["keys has D = 3 but queries has D = 2 (keys [2, 5, 3], queries [2, 3, 2])"]),
    ("sdpa keys B", lambda a: lambda: qkv.scaled_dot_product_attention(a.q, a.k[:1], a.v),
     "qkv.Error", SDPA,
     ["keys has B = 1 but queries has B = 2 (keys [1, 5, 4], queries [2, 3, 4])"]),
    ("sdpa values B", lambda a: lambda: qkv.scaled_dot_product_attention(a.q, a.k, a.v[:1]),
     "qkv.Error", SDPA,
     ["values has B = 1 but keys has B = 2 (values [1, 5, 6], keys [2, 5, 4])"]),
    ("sdpa values Nk", lambda a: lambda: qkv.scaled_dot_product_attention(a.q, a.k, a.v[:, :4]),
     "qkv.Error", SDPA,
     ["values has Nk = 4 but keys has Nk = 5 (values [2, 4, 6], keys [2, 5, 4])"]),
    ("sdpa 1-D queries", lambda a: lambda: qkv.scaled_dot_product_attention(a.q[0, 0], a.k, a.v),
     "ValueError", SDPA,
     ["queries has shape [4]; expected rank 4 (B, H, Nq, D), rank 3 (B, Nq, D) or rank 2 (Nq, D), "
      "a batch of one"]),
    ("sdpa 4-D queries", lambda a: lambda: qkv.scaled_dot_product_attention(a.q[None], a.k, a.v),
     "ValueError", SDPA, ["queries, keys and values must be all 2-D, all 3-D or all 4-D; got "
                          "ranks 4, 3, 3"]),
    ("sdpa 1-D all", lambda a: lambda: qkv.scaled_dot_product_attention(a.q[0, 0], a.k[0, 0],
                                                                         a.v[0, 0]),
     "ValueError", SDPA, ["queries has shape [4]; expected rank 4 (B, H, Nq, D), rank 3"]),
    ("sdpa 2-D queries 3-D keys", lambda a: lambda: qkv.scaled_dot_product_attention(a.q[0], a.k,
                                                                                      a.v),
     "ValueError", SDPA,
     ["queries, keys and values must be all 2-D, all 3-D or all 4-D; got ranks 2, 3, 3"]),
    ("sdpa 4-D keys", lambda a: lambda: qkv.scaled_dot_product_attention(a.q, a.k[None], a.v),
     "ValueError", SDPA, ["must be all 2-D, all 3-D or all 4-D; got ranks 3, 4, 3"]),
    ("sdpa 1-D values", lambda a: lambda: qkv.scaled_dot_product_attention(a.q[0], a.k[0],
                                                                            a.v[0, 0]),
     "ValueError", SDPA, ["must be all 2-D, all 3-D or all 4-D; got ranks 2, 2, 1"]),
    ("sdpa lens shape", lambda a: lambda: qkv.scaled_dot_product_attention(a.q, a.k, a.v,
                                                                            [1, 2, 3]),
     "qkv.Error", SDPA, ["valid_lens has shape [3] but scores has shape [2, 3, 5]; "
                         "expected [2] or [2, 3]"]),
    ("sdpa lens (1, Nq)", lambda a: lambda: qkv.scaled_dot_product_attention(a.q, a.k, a.v,
                                                                              [[1, 2, 3]]),
     "qkv.Error", SDPA, ["valid_lens has shape [1, 3] but scores has shape [2, 3, 5]"]),
    ("sdpa lens 3-D", lambda a: lambda: qkv.scaled_dot_product_attention(
        a.q, a.k, a.v, np.ones((2, 3, 1), int)),
     "qkv.Error", SDPA, ["valid_lens has shape [2, 3, 1] but scores has shape [2, 3, 5]"]),
    ("sdpa lens scalar 3-D", lambda a: lambda: qkv.scaled_dot_product_attention(a.q, a.k, a.v, 2),
     "qkv.Error", SDPA, ["valid_lens has shape [] but scores has shape [2, 3, 5]"]),
    ("sdpa lens > Nk", lambda a: lambda: qkv.scaled_dot_product_attention(a.q, a.k, a.v, [1, 6]),
     "qkv.Error", SDPA, ["valid_lens[1] = 6 is outside [0, 5] (scores has shape [2, 3, 5])"]),
    ("sdpa lens < 0", lambda a: lambda: qkv.scaled_dot_product_attention(
        a.q, a.k, a.v, np.array([-1, 2], np.int32)),
     "qkv.Error", SDPA, ["valid_lens[0] = -1 is outside [0, 5]"]),
    ("sdpa lens per query", lambda a: lambda: qkv.scaled_dot_product_attention(
        a.q, a.k, a.v, [[1, 2, 3], [4, 9, 0]]),
     "qkv.Error", SDPA, ["valid_lens[1, 1] = 9 is outside [0, 5]"]),
    ("sdpa 2-D lens shape", lambda a: lambda: qkv.scaled_dot_product_attention(
        a.q[0], a.k[0], a.v[0], [1, 2]),
     "qkv.Error", SDPA, ["valid_lens has shape [2] but queries has shape [3, 4]; expected [] or "
                         "[1] (one length), or [3] or [1, 3] (one per query)"]),
    ("sdpa 2-D lens (2, Nq)", lambda a: lambda: qkv.scaled_dot_product_attention(
        a.q[0], a.k[0], a.v[0], np.ones((2, 3), int)),
     "qkv.Error", SDPA, ["valid_lens has shape [2, 3] but queries has shape [3, 4]"]),
    ("sdpa 2-D lens > Nk", lambda a: lambda: qkv.scaled_dot_product_attention(
        a.q[0], a.k[0], a.v[0], 6),
     "qkv.Error", SDPA, ["valid_lens[0] = 6 is outside [0, 5]"]),
    ("sdpa dropout 1.5", sdpa_case(dropout_p=1.5), "qkv.Error", SDPA,
     ["dropout_p = 1.5", "is outside [0, 1]"]),
    ("sdpa dropout -0.1", sdpa_case(dropout_p=-0.1), "qkv.Error", SDPA,
     ["dropout_p = -0.1", "is outside [0, 1]"]),
    ("sdpa dropout nan", sdpa_case(dropout_p=math.nan), "qkv.Error", SDPA,
     ["dropout_p = nan is outside [0, 1]"]),
    ("sdpa dropout inf", sdpa_case(dropout_p=math.inf), "qkv.Error", SDPA,
     ["dropout_p = inf is outside [0, 1]"]),
    ("sdpa scale inf", sdpa_case(scale=math.inf), "qkv.Error", SDPA,
     ["scale = inf is not finite"]),
    ("sdpa scale -inf", sdpa_case(scale=-math.inf), "qkv.Error", SDPA,
     ["scale = -inf is not finite"]),
    ("sdpa scale nan", sdpa_case(scale=math.nan), "qkv.Error", SDPA,
     ["scale = nan is not finite"]),
    ("sdpa D = 0 default scale", lambda a: lambda: qkv.scaled_dot_product_attention(
        a.q[..., :0], a.k[..., :0], a.v),
     "qkv.Error", SDPA, ["queries has D = 0", "scale"]),
    # backward
    ("sdpa_b output", lambda a: lambda: qkv.scaled_dot_product_attention_backward(
        a.q, a.k, a.v, a.out[:, :2], a.lse, a.out),
     "qkv.Error", SDPA_B, ["output has shape [2, 2, 6]; expected [2, 3, 6]"]),
    ("sdpa_b output Dv", lambda a: lambda: qkv.scaled_dot_product_attention_backward(
        a.q, a.k, a.v, a.out[..., :5], a.lse, a.out),
     "qkv.Error", SDPA_B, ["output has shape [2, 3, 5]; expected [2, 3, 6]"]),
    ("sdpa_b lse", lambda a: lambda: qkv.scaled_dot_product_attention_backward(
        a.q, a.k, a.v, a.out, a.lse[:, :2], a.out),
     "qkv.Error", SDPA_B, ["lse has shape [2, 2]; expected [2, 3]"]),
    ("sdpa_b lse 3-D", lambda a: lambda: qkv.scaled_dot_product_attention_backward(
        a.q, a.k, a.v, a.out, a.lse[..., None], a.out),
     "qkv.Error", SDPA_B, ["lse has shape [2, 3, 1]; expected [2, 3]"]),
    ("sdpa_b d_output", lambda a: lambda: qkv.scaled_dot_product_attention_backward(
        a.q, a.k, a.v, a.out, a.lse, a.out[..., :5]),
     "qkv.Error", SDPA_B, ["d_output has shape [2, 3, 5]; expected [2, 3, 6]"]),
    ("sdpa_b d_output B", lambda a: lambda: qkv.scaled_dot_product_attention_backward(
        a.q, a.k, a.v, a.out, a.lse, a.out[:1]),
     "qkv.Error", SDPA_B, ["d_output has shape [1, 3, 6]; expected [2, 3, 6]"]),
    ("sdpa_b 2-D lse (B, Nq)", lambda a: lambda: qkv.scaled_dot_product_attention_backward(
        a.q[0], a.k[0], a.v[0], a.out[0], a.lse, a.out[0]),
     "qkv.Error", SDPA_B, ["lse has shape [2, 3]; expected [1, 3]"]),
    ("sdpa_b keys D", lambda a: lambda: qkv.scaled_dot_product_attention_backward(
        a.q, a.k[..., :3], a.v, a.out, a.lse, a.out),
     "qkv.Error", SDPA_B, ["keys has D = 3 but queries has D = 4"]),
    ("sdpa_b lens", lambda a: lambda: qkv.scaled_dot_product_attention_backward(
        a.q, a.k, a.v, a.out, a.lse, a.out, [9, 1]),
     "qkv.Error", SDPA_B, ["valid_lens[0] = 9 is outside [0, 5]"]),
    ("sdpa_b dropout", lambda a: lambda: qkv.scaled_dot_product_attention_backward(
        a.q, a.k, a.v, a.out, a.lse, a.out, dropout_p=2.0),
     "qkv.Error", SDPA_B, ["dropout_p = 2", "is outside [0, 1]"]),
    ("sdpa_b scale", lambda a: lambda: qkv.scaled_dot_product_attention_backward(
        a.q, a.k, a.v, a.out, a.lse, a.out, scale=math.nan),
     "qkv.Error", SDPA_B, ["scale = nan is not finite"]),
    ("sdpa_b 1-D queries", lambda a: lambda: qkv.scaled_dot_product_attention_backward(
        a.q[0, 0], a.k, a.v, a.out, a.lse, a.out),
     "ValueError", SDPA_B, ["queries has shape [4]; expected rank 4 (B, H, Nq, D), rank 3"]),
    ("sdpa_b mixed ranks", lambda a: lambda: qkv.scaled_dot_product_attention_backward(
        a.q[0], a.k, a.v[0], a.out, a.lse, a.out),
     "ValueError", SDPA_B, ["must be all 2-D, all 3-D or all 4-D; got ranks 2, 3, 2"]),
    # additive
    ("add W_q Dq", lambda a: lambda: qkv.additive_attention(a.q, a.k, a.v, a.Wq[:, :3], a.Wk,
                                                            a.wv),
     "qkv.Error", ADD, ["has shape [7, 3] but queries has Dq = 4; expected [7, 4]"]),
    ("add W_k Dk", lambda a: lambda: qkv.additive_attention(a.q, a.k, a.v, a.Wq, a.Wk[:, :3],
                                                            a.wv),
     "qkv.Error", ADD, ["has shape [7, 3] but", "keys has Dk = 4; expected [7, 4]"]),
    ("add W_k H", lambda a: lambda: qkv.additive_attention(a.q, a.k, a.v, a.Wq, a.Wk[:5], a.wv),
     "qkv.Error", ADD, ["has shape [5, 4] but", "has shape [7, 4]", "expected [7, 4]"]),
    ("add w_v H", lambda a: lambda: qkv.additive_attention(a.q, a.k, a.v, a.Wq, a.Wk, a.wv[:5]),
     "qkv.Error", ADD, ["w_v has shape [5] but", "expected [7] or [1, 7]"]),
    ("add w_v (2, H)", lambda a: lambda: qkv.additive_attention(
        a.q, a.k, a.v, a.Wq, a.Wk, np.stack([a.wv, a.wv])),
     "qkv.Error", ADD, ["w_v has shape [2, 7] but", "expected [7] or [1, 7]"]),
    ("add w_v 3-D", lambda a: lambda: qkv.additive_attention(a.q, a.k, a.v, a.Wq, a.Wk,
                                                             a.wv[None, None]),
     "qkv.Error", ADD, ["w_v has shape [1, 1, 7] but", "expected [7] or [1, 7]"]),
    ("add W_q 1-D", lambda a: lambda: qkv.additive_attention(a.q, a.k, a.v, a.wv, a.Wk, a.wv),
     "qkv.Error", ADD, ["has shape [7]; expected rank 2 (H, Dq)"]),
    ("add keys B", lambda a: lambda: qkv.additive_attention(a.q, a.k[:1], a.v, a.Wq, a.Wk, a.wv),
     "qkv.Error", ADD, ["keys has B = 1 but queries has B = 2"]),
    ("add values Nk", lambda a: lambda: qkv.additive_attention(a.q, a.k, a.v[:, :3], a.Wq, a.Wk,
                                                               a.wv),
     "qkv.Error", ADD, ["values has Nk = 3 but keys has Nk = 5"]),
    ("add lens", lambda a: lambda: qkv.additive_attention(a.q, a.k, a.v, a.Wq, a.Wk, a.wv,
                                                          [6, 0]),
     "qkv.Error", ADD, ["valid_lens[0] = 6 is outside [0, 5]"]),
    ("add dropout", lambda a: lambda: qkv.additive_attention(a.q, a.k, a.v, a.Wq, a.Wk, a.wv,
                                                             dropout_p=-1.0),
     "qkv.Error", ADD, ["dropout_p = -1", "is outside [0, 1]"]),
    ("add 1-D queries", lambda a: lambda: qkv.additive_attention(a.q[0, 0], a.k, a.v, a.Wq, a.Wk,
                                                                 a.wv),
     "ValueError", ADD, ["queries has shape [4]; expected rank 3 (B, Nq, Dq) or rank 2 (Nq, Dq)"]),
    ("add mixed ranks", lambda a: lambda: qkv.additive_attention(a.q[0], a.k[0], a.v, a.Wq, a.Wk,
                                                                 a.wv),
     "ValueError", ADD, ["must be all 2-D or all 3-D; got ranks 2, 2, 3"]),
    ("add_b output", lambda a: lambda: qkv.additive_attention_backward(
        a.q, a.k, a.v, a.Wq, a.Wk, a.wv, a.aout[:1], a.alse, a.aout),
     "qkv.Error", ADD_B, ["output has shape [1, 3, 6]; expected [2, 3, 6]"]),
    ("add_b lse", lambda a: lambda: qkv.additive_attention_backward(
        a.q, a.k, a.v, a.Wq, a.Wk, a.wv, a.aout, a.alse[:, :1], a.aout),
     "qkv.Error", ADD_B, ["lse has shape [2, 1]; expected [2, 3]"]),
    ("add_b d_output", lambda a: lambda: qkv.additive_attention_backward(
        a.q, a.k, a.v, a.Wq, a.Wk, a.wv, a.aout, a.alse, a.aout[..., :2]),
     "qkv.Error", ADD_B, ["d_output has shape [2, 3, 2]; expected [2, 3, 6]"]),
    ("add_b W_q", lambda a: lambda: qkv.additive_attention_backward(
        a.q, a.k, a.v, a.Wq[:, :2], a.Wk, a.wv, a.aout, a.alse, a.aout),
     "qkv.Error", ADD_B, ["has shape [7, 2] but queries has Dq = 4; expected [7, 4]"]),
    ("add_b w_v", lambda a: lambda: qkv.additive_attention_backward(
        a.q, a.k, a.v, a.Wq, a.Wk, a.wv[:3], a.aout, a.alse, a.aout),
     "qkv.Error", ADD_B, ["w_v has shape [3] but", "expected [7] or [1, 7]"]),
    ("add_b dropout", lambda a: lambda: qkv.additive_attention_backward(
        a.q, a.k, a.v, a.Wq, a.Wk, a.wv, a.aout, a.alse, a.aout, dropout_p=math.nan),
     "qkv.Error", ADD_B, ["dropout_p = nan is outside [0, 1]"]),
    # masked softmax
    ("softmax 1-D", lambda a: lambda: qkv.masked_softmax(a.X[0, 0]),
     "ValueError", "masked_softmax",
     ["X has shape [5]; expected rank 3 (B, Nq, Nk) or rank 2 (Nq, Nk), a batch of one"]),
    ("softmax 4-D", lambda a: lambda: qkv.masked_softmax(a.X[None]),
     "ValueError", "masked_softmax", ["X has shape [1, 2, 3, 5]; expected rank 3"]),
    ("softmax 0-D", lambda a: lambda: qkv.masked_softmax(a.X[0, 0, 0]),
     "ValueError", "masked_softmax", ["X has shape []; expected rank 3"]),
    ("softmax lens shape", lambda a: lambda: qkv.masked_softmax(a.X, [1, 2, 3]),
     "qkv.Error", "masked_softmax",
     ["valid_lens has shape [3] but scores has shape [2, 3, 5]; expected [2] or [2, 3]"]),
    ("softmax lens > Nk", lambda a: lambda: qkv.masked_softmax(a.X, [1, 7]),
     "qkv.Error", "masked_softmax", ["valid_lens[1] = 7 is outside [0, 5] (scores has shape "
                                     "[2, 3, 5])"]),
    ("softmax lens < 0", lambda a: lambda: qkv.masked_softmax(a.X, [[0, 1, 2], [3, -2, 5]]),
     "qkv.Error", "masked_softmax", ["valid_lens[1, 1] = -2 is outside [0, 5]"]),
    ("softmax 2-D lens shape", lambda a: lambda: qkv.masked_softmax(a.X[0], [1, 2]),
     "qkv.Error", "masked_softmax", ["valid_lens has shape [2] but X has shape [3, 5]; expected "
                                     "[] or [1] (one length), or [3] or [1, 3] (one per query)"]),
    ("softmax 2-D lens > Nk", lambda a: lambda: qkv.masked_softmax(a.X[0], 6),
     "qkv.Error", "masked_softmax", ["valid_lens[0] = 6 is outside [0, 5]"]),
    ("softmax_b d_weights shape", lambda a: lambda: qkv.masked_softmax_backward(a.X, a.X[..., :4]),
     "qkv.Error", "masked_softmax_backward", ["d_weights has shape [2, 3, 4]; expected [2, 3, 5]"]),
    ("softmax_b ranks", lambda a: lambda: qkv.masked_softmax_backward(a.X, a.X[0]),
     "ValueError", "masked_softmax_backward",
     ["weights and d_weights must be all 2-D or all 3-D; got ranks 3, 2"]),
    ("softmax_b 1-D", lambda a: lambda: qkv.masked_softmax_backward(a.X[0, 0], a.X[0, 0]),
     "ValueError", "masked_softmax_backward", ["weights has shape [5]; expected rank 3"]),
    ("softmax_b lens", lambda a: lambda: qkv.masked_softmax_backward(a.X, a.X, [6, 1]),
     "qkv.Error", "masked_softmax_backward", ["valid_lens[0] = 6 is outside [0, 5]"]),
    ("softmax_b 2-D lens shape", lambda a: lambda: qkv.masked_softmax_backward(
        a.X[0], a.X[0], [[1], [2]]),
     "qkv.Error", "masked_softmax_backward", ["valid_lens has shape [2, 1] but",
                                              "has shape [3, 5]; expected [] or [1]"]),
    # pooling
    ("pool Nk", lambda a: lambda: qkv.attention_pooling(a.X[..., :4], a.v),
     "qkv.Error", "attention_pooling",
     ["values has shape [2, 5, 6] but weights has shape [2, 3, 4]; expected [2, 4, value_dim]"]),
    ("pool B", lambda a: lambda: qkv.attention_pooling(a.X[:1], a.v),
     "qkv.Error", "attention_pooling", ["values has shape [2, 5, 6] but weights has shape "
                                        "[1, 3, 5]"]),
    ("pool ranks", lambda a: lambda: qkv.attention_pooling(a.X[0], a.v),
     "ValueError", "attention_pooling", ["weights and values must be all 2-D or all 3-D; got "
                                         "ranks 2, 3"]),
    ("pool 1-D", lambda a: lambda: qkv.attention_pooling(a.X[0, 0], a.v[0, 0]),
     "ValueError", "attention_pooling", ["weights has shape [5]; expected rank 3 (B, Nq, Nk)"]),
    ("average lens", lambda a: lambda: qkv.average_pooling(a.v, 3, [1, 7]),
     "qkv.Error", "average_pooling", ["valid_lens[1] = 7 is outside [0, 5]"]),
    ("average lens shape", lambda a: lambda: qkv.average_pooling(a.v, 3, [[1, 2]]),
     "qkv.Error", "average_pooling", ["valid_lens has shape [1, 2] but", "expected [2] or [2, 3]"]),
    ("average num_queries", lambda a: lambda: qkv.average_pooling(a.v, -1),
     "qkv.Error", "average_pooling", ["num_queries = -1 must be >= 0"]),
    ("average 1-D", lambda a: lambda: qkv.average_pooling(a.v[0, 0], 3),
     "ValueError", "average_pooling", ["values has shape [6]; expected rank 3 (B, Nk, Dv)"]),
    ("average 2-D lens", lambda a: lambda: qkv.average_pooling(a.v[0], 3, [1, 2]),
     "qkv.Error", "average_pooling", ["valid_lens has shape [2] but", "has shape [3, 5]"]),
    ("lookup index > Nk", lambda a: lambda: qkv.one_hot_lookup([[0, 1, 5], [0, 0, 0]], a.v),
     "qkv.Error", "one_hot_lookup", ["index[0, 2] = 5 is outside [0, 5)"]),
    ("lookup index < 0", lambda a: lambda: qkv.one_hot_lookup([[0, 1, 2], [0, -1, 0]], a.v),
     "qkv.Error", "one_hot_lookup", ["index[1, 1] = -1 is outside [0, 5)"]),
    ("lookup 2-D index > Nk", lambda a: lambda: qkv.one_hot_lookup([7], a.v[0]),
     "qkv.Error", "one_hot_lookup", ["index[0, 0] = 7 is outside [0, 5)"]),
    ("lookup B", lambda a: lambda: qkv.one_hot_lookup([[0, 1, 2]], a.v),
     "qkv.Error", "one_hot_lookup", ["index has shape [1, 3] but values has shape [2, 5, 6]"]),
    ("lookup 3-D index", lambda a: lambda: qkv.one_hot_lookup(np.zeros((2, 3, 1), int), a.v),
     "qkv.Error", "one_hot_lookup", ["index has shape [2, 3, 1]; expected rank 2 (B, Nq)"]),
    ("one_hot_weights index", lambda a: lambda: qkv.one_hot_weights([[0, 3]], 3),
     "qkv.Error", "one_hot_weights", ["index[0, 1] = 3 is outside [0, 3)"]),
    ("one_hot_weights negative", lambda a: lambda: qkv.one_hot_weights([-1], 3),
     "qkv.Error", "one_hot_weights", ["index[0, 0] = -1 is outside [0, 3)"]),
    ("one_hot_weights num_keys", lambda a: lambda: qkv.one_hot_weights([0], -1),
     "qkv.Error", "one_hot_weights", ["num_keys = -1 must be >= 0"]),
    ("one_hot_weights 3-D", lambda a: lambda: qkv.one_hot_weights(np.zeros((1, 1, 1), int), 2),
     "qkv.Error", "one_hot_weights", ["index has shape [1, 1, 1]; expected rank 2 (B, Nq)"]),
    ("uniform sizes", lambda a: lambda: qkv.uniform_weights(-1, 2, 3),
     "qkv.Error", "uniform_weights", ["sizes must be >= 0; got batch -1, num_queries 2, "
                                      "num_keys 3"]),
    ("uniform lens", lambda a: lambda: qkv.uniform_weights(2, 2, 3, [4, 1]),
     "qkv.Error", "uniform_weights", ["valid_lens[0] = 4 is outside [0, 3]"]),
    ("uniform lens shape", lambda a: lambda: qkv.uniform_weights(2, 2, 3, [1]),
     "qkv.Error", "uniform_weights", ["valid_lens has shape [1] but", "expected [2] or [2, 2]"]),
]


@pytest.mark.parametrize("case", SHAPE_CASES, ids=[c[0] for c in SHAPE_CASES])
def test_shape_and_value_errors(a, case):
    _, make, kind, fn, parts = case
    check_raises(make(a), kind, fn, parts)


def test_the_documented_example_message(rng):
    # semantics.md's and the qkv.Error docstring's example, verbatim.
    q = rng.standard_normal((2, 1, 2)).astype(F4)
    k = rng.standard_normal((2, 10, 3)).astype(F4)
    v = rng.standard_normal((2, 10, 4)).astype(F4)
    with pytest.raises(qkv.Error) as info:
        qkv.scaled_dot_product_attention(q, k, v)
    assert str(info.value) == ("scaled_dot_product_attention: keys has D = 3 but queries has "
                               "D = 2 (keys [2, 10, 3], queries [2, 1, 2])")


BINDING_SHAPE_CASES = [c for c in SHAPE_CASES if c[2] == "ValueError"]


def test_binding_shape_errors_are_qkv_errors(a):
    # The docstrings (and qkv's module docstring: "Bad arguments raise qkv.Error
    # (a ValueError) ... or a TypeError for a wrong dtype") list shapes that do
    # not fit under qkv.Error, so `except qkv.Error` must catch a wrong rank as
    # it catches a wrong size. One test for every rank check of the binding.
    wrong = []
    for case_id, make, _, fn, parts in BINDING_SHAPE_CASES:
        try:
            make(a)()
        except ValueError as e:
            if type(e) is not qkv.Error:
                wrong.append(f"{case_id}: {type(e).__name__}: {e}")
    assert not wrong, "not qkv.Error:\n" + "\n".join(wrong)


def test_masked_softmax_backward_names_its_own_argument(a):
    # masked_softmax_backward has no argument X: its messages name `weights`.
    with pytest.raises(qkv.Error) as info:
        qkv.masked_softmax_backward(a.X[0], a.X[0], [1, 2])
    assert "but weights has shape [3, 5]" in str(info.value), str(info.value)


# ---- regression --------------------------------------------------------------------------

def with_nan(values, index, what=math.nan):
    values = values.copy()
    values.flat[index] = what
    return values


REGRESSION_CASES = [
    # id, call maker, kind, message parts
    ("unknown kernel", lambda a: lambda: qkv.nadaraya_watson(a.x, a.y, a.x, kernel="cosine"),
     "qkv.Error", ["nadaraya_watson: kernel = 'cosine' is not a kernel", "'gaussian'",
                   "'boxcar'", "'epanechnikov'", "'triangular'"]),
    ("KernelRegression unknown kernel", lambda a: lambda: qkv.KernelRegression("nope"),
     "qkv.Error", ["KernelRegression: kernel = 'nope' is not a kernel"]),
    ("unknown rule", lambda a: lambda: qkv.nadaraya_watson(a.x, a.y, a.x, bandwidth="foo"),
     "qkv.Error", ["nadaraya_watson: bandwidth = 'foo' is not a rule", "'silverman'", "'scott'",
                   "'cv'", "'cv-fast'"]),
    ("cv-fast of a compact kernel", lambda a: lambda: qkv.KernelRegression(
        "epanechnikov", "cv-fast").fit(a.x, a.y),
     "qkv.Error", ["KernelRegression.fit: bandwidth = 'cv-fast' is cv through the fast 1-D "
                   "Gaussian path; x has 1 feature and the kernel is 'epanechnikov' "
                   "(use bandwidth='cv')"]),
    ("cv-fast of 2 features", lambda a: lambda: qkv.nadaraya_watson(
        np.stack([a.x, a.y], 1), a.y, np.stack([a.x, a.x], 1), bandwidth="cv-fast"),
     "qkv.Error", ["nadaraya_watson: bandwidth = 'cv-fast' is cv through the fast 1-D Gaussian "
                   "path; x has 2 features and the kernel is 'gaussian' (use bandwidth='cv')"]),
    ("cv-fast of one point", lambda a: lambda: qkv.KernelRegression(bandwidth="cv-fast").fit(
        a.x[:1], a.y[:1]), "qkv.Error", ["needs at least 2 points"]),
    ("KernelRegression unknown rule", lambda a: lambda: qkv.KernelRegression(bandwidth="learn"),
     "qkv.Error", ["KernelRegression: bandwidth = 'learn' is not a rule"]),
    ("bandwidth 0", lambda a: lambda: qkv.nadaraya_watson(a.x, a.y, a.x, bandwidth=0.0),
     "qkv.Error", ["nadaraya_watson: bandwidth = 0 is not a bandwidth", "finite value >="]),
    ("bandwidth negative", lambda a: lambda: qkv.nadaraya_watson(a.x, a.y, a.x, bandwidth=-1),
     "qkv.Error", ["nadaraya_watson: bandwidth = -1 is not a bandwidth"]),
    ("bandwidth nan", lambda a: lambda: qkv.nadaraya_watson(a.x, a.y, a.x, bandwidth=math.nan),
     "qkv.Error", ["nadaraya_watson: bandwidth = nan is not a bandwidth"]),
    ("bandwidth inf", lambda a: lambda: qkv.nadaraya_watson(a.x, a.y, a.x, bandwidth=math.inf),
     "qkv.Error", ["nadaraya_watson: bandwidth = inf is not a bandwidth"]),
    ("bandwidth subnormal", lambda a: lambda: qkv.nadaraya_watson(a.x, a.y, a.x,
                                                                  bandwidth=1e-320),
     "qkv.Error", ["smallest normal double"]),
    ("bandwidth count", lambda a: lambda: qkv.nadaraya_watson(
        np.stack([a.x, a.y], 1), a.y, np.stack([a.x, a.x], 1), bandwidth=[1.0, 2.0, 3.0]),
     "qkv.Error", ["bandwidth has 3 values but x has 2 features"]),
    ("bandwidth bool", lambda a: lambda: qkv.nadaraya_watson(a.x, a.y, a.x, bandwidth=True),
     "TypeError", ["nadaraya_watson: bandwidth is a bool"]),
    ("bandwidth None", lambda a: lambda: qkv.KernelRegression(bandwidth=None),
     "TypeError", ["KernelRegression: bandwidth is a NoneType"]),
    ("nan in x", lambda a: lambda: qkv.nadaraya_watson(with_nan(a.x, 5), a.y, a.x),
     "qkv.Error", ["nadaraya_watson: x_train[5] is nan (x_train has shape [20])", "finite"]),
    ("inf in x", lambda a: lambda: qkv.nadaraya_watson(with_nan(a.x, 3, math.inf), a.y, a.x),
     "qkv.Error", ["nadaraya_watson: x_train[3] is inf (x_train has shape [20])"]),
    ("nan in y", lambda a: lambda: qkv.nadaraya_watson(a.x, with_nan(a.y, 7), a.x),
     "qkv.Error", ["nadaraya_watson: y_train[7] is nan (y_train has shape [20])"]),
    ("nan in 2-D y", lambda a: lambda: qkv.nadaraya_watson(
        a.x, with_nan(np.stack([a.y, a.y], 1), 5), a.x),
     "qkv.Error", ["nadaraya_watson: y_train[2, 1] is nan (y_train has shape [20, 2])"]),
    ("nan in queries", lambda a: lambda: qkv.nadaraya_watson(a.x, a.y, with_nan(a.x[:4], 2)),
     "qkv.Error", ["[2] is nan", "has shape [4]"]),
    ("nan in fit", lambda a: lambda: qkv.KernelRegression().fit(with_nan(a.x, 0), a.y),
     "qkv.Error", ["x[0] is nan"]),
    ("nan in predict", lambda a: lambda: qkv.KernelRegression().fit(a.x, a.y).predict(
        with_nan(a.x, 1)), "qkv.Error", ["[1] is nan"]),
    ("nan in train_parametric", lambda a: lambda: qkv.train_parametric(a.x, with_nan(a.y, 4)),
     "qkv.Error", ["train_parametric: y[4] is nan"]),
    ("n differs", lambda a: lambda: qkv.nadaraya_watson(a.x, a.y[:9], a.x),
     "qkv.Error", ["y has 9 points but x has 20 (x [20], y [9])"]),
    ("no points", lambda a: lambda: qkv.nadaraya_watson(a.x[:0], a.y[:0], a.x),
     "qkv.Error", ["x has shape [0]; expected at least 1 point"]),
    ("x 3-D", lambda a: lambda: qkv.nadaraya_watson(a.x[:, None, None], a.y, a.x),
     "qkv.Error", ["x has shape [20, 1, 1]; expected rank 1 (n) or 2 (n, p)"]),
    ("y 3-D", lambda a: lambda: qkv.nadaraya_watson(a.x, a.y[:, None, None], a.x),
     "qkv.Error", ["y has shape [20, 1, 1]; expected rank 1 (n) or 2 (n, m)"]),
    ("query features", lambda a: lambda: qkv.nadaraya_watson(
        np.stack([a.x, a.y], 1), a.y, np.zeros((3, 3))),
     "qkv.Error", ["has 3 features but x has 2", "[3, 3]", "[20, 2]"]),
    ("predict features", lambda a: lambda: qkv.KernelRegression().fit(a.x, a.y).predict(
        np.zeros((2, 2))), "qkv.Error", ["has 2 features but x has 1"]),
    ("int x", lambda a: lambda: qkv.nadaraya_watson(np.arange(20), a.y, a.x),
     "TypeError", ["nadaraya_watson: x_train has dtype int64; expected float32 or float64"]),
    ("int y", lambda a: lambda: qkv.nadaraya_watson(a.x, np.arange(20), a.x),
     "TypeError", ["nadaraya_watson: y_train has dtype int64"]),
    ("complex queries", lambda a: lambda: qkv.nadaraya_watson(a.x, a.y, a.x.astype(complex)),
     "TypeError", ["nadaraya_watson: x_query has dtype complex128"]),
    ("int fit", lambda a: lambda: qkv.KernelRegression().fit(np.arange(20), a.y),
     "TypeError", ["KernelRegression.fit: x has dtype int64"]),
    ("silverman constant", lambda a: lambda: qkv.silverman_bandwidth(np.ones(10)),
     "qkv.Error", ["silverman_bandwidth: feature 0 of x (shape [10]) is constant"]),
    ("scott constant", lambda a: lambda: qkv.scott_bandwidth(np.ones((10, 2))),
     "qkv.Error", ["scott_bandwidth: feature 0 of x (shape [10, 2]) is constant"]),
    ("scott 3-D", lambda a: lambda: qkv.scott_bandwidth(np.zeros((3, 3, 3))),
     "qkv.Error", ["scott_bandwidth: x has shape [3, 3, 3]; expected rank 1 (n) or 2 (n, p)"]),
    ("silverman rule of constant x", lambda a: lambda: qkv.nadaraya_watson(
        np.ones(10), a.y[:10], a.x, bandwidth="silverman"), "qkv.Error", ["is constant"]),
    ("cv of one point", lambda a: lambda: qkv.KernelRegression(bandwidth="cv").fit(
        a.x[:1], a.y[:1]), "qkv.Error", ["needs at least 2 points"]),
    ("loo_error of a rule", lambda a: lambda: qkv.KernelRegression().fit(a.x, a.y).loo_error("cv"),
     "qkv.Error", ["KernelRegression.loo_error: bandwidth must be numbers, not a rule"]),
    ("train_parametric epochs", lambda a: lambda: qkv.train_parametric(a.x, a.y, epochs=-1),
     "qkv.Error", ["train_parametric: options.epochs = -1; expected >= 0"]),
    ("train_parametric overflow", lambda a: lambda: qkv.train_parametric(a.x, a.y * 1e160),
     "qkv.Error", ["train_parametric: the loss at epoch 1 is inf", "not finite in float64"]),
]


@pytest.mark.parametrize("case", REGRESSION_CASES, ids=[c[0] for c in REGRESSION_CASES])
def test_regression_errors(a, case):
    _, make, kind, parts = case
    check_raises(make(a), kind, None, parts)


NOT_FITTED = ["predict", "weights", "loo_error", "bandwidth_", "cv_loo_error_", "cv_iterations_",
              "n_features_in_"]


@pytest.mark.parametrize("member", NOT_FITTED)
def test_kernel_regression_before_fit(a, member):
    model = qkv.KernelRegression(bandwidth=0.5)
    if member in ("predict", "weights"):
        call = lambda: getattr(model, member)(a.x)  # noqa: E731
    elif member == "loo_error":
        call = model.loo_error
    else:
        call = lambda: getattr(model, member)  # noqa: E731
    check_raises(call, "ValueError", f"KernelRegression.{member}",
                 ["the model is not fitted; call fit(x, y) first"])
    # What is known before fit is there.
    assert model.kernel == "gaussian" and model.bandwidth == 0.5


def test_failed_fit_keeps_the_previous_fit(a):
    model = qkv.KernelRegression(bandwidth=0.5).fit(a.x, a.y)
    before = model.predict(a.x[:3])
    with pytest.raises(qkv.Error):
        model.fit(with_nan(a.x, 2), a.y)
    assert model.predict(a.x[:3]).tobytes() == before.tobytes()


REGRESSION_NAMING = [
    # The Python function the user called, and the call.
    ("nadaraya_watson", "kernel", lambda a: qkv.nadaraya_watson(a.x, a.y, a.x, kernel="cosine")),
    ("nadaraya_watson", "x_train",
     lambda a: qkv.nadaraya_watson(with_nan(a.x, 5), a.y, a.x)),
    ("nadaraya_watson", "x_query",
     lambda a: qkv.nadaraya_watson(a.x, a.y, with_nan(a.x[:4], 2))),
    ("nadaraya_watson", "bandwidth", lambda a: qkv.nadaraya_watson(a.x, a.y, a.x, bandwidth=0.0)),
    ("KernelRegression", "kernel", lambda a: qkv.KernelRegression("nope")),
    ("KernelRegression.predict", "x_query",
     lambda a: qkv.KernelRegression().fit(a.x, a.y).predict(with_nan(a.x, 1))),
]


def test_regression_errors_name_the_python_function_and_argument(a):
    # DESIGN.md §4: the message names the function and the argument, those of
    # the call the user made (as every attention op's messages do), not the
    # C++ helpers underneath (kernel_from_name, KernelRegression::predict).
    wrong = []
    for fn, argument, call in REGRESSION_NAMING:
        with pytest.raises(ValueError) as info:
            call(a)
        message = str(info.value)
        if not message.startswith(f"{fn}: ") or argument not in message:
            wrong.append(f"{fn}, argument {argument}: {message}")
    assert not wrong, "messages not naming the call:\n" + "\n".join(wrong)


# ---- runtime settings --------------------------------------------------------------------

@pytest.mark.parametrize("n", [-1, -100, 1025, 2000], ids=str)
def test_set_num_threads_out_of_range(n):
    before = qkv.get_num_threads()
    check_raises(lambda: qkv.set_num_threads(n), "qkv.Error", "set_num_threads",
                 [f"n = {n} is outside [0, 1024]"])
    assert qkv.get_num_threads() == before


@pytest.mark.parametrize("n", [1.5, "2", None, 2**70], ids=repr)
def test_set_num_threads_not_a_number(n):
    before = qkv.get_num_threads()
    with pytest.raises(TypeError):
        qkv.set_num_threads(n)
    assert qkv.get_num_threads() == before


@pytest.mark.parametrize("name", ["nope", "AVX2", "avx2 ", "neon", "sve"])
def test_set_simd_target_unknown(name):
    before = qkv.simd_target()
    check_raises(lambda: qkv.set_simd_target(name), "qkv.Error", "set_simd_target",
                 [f'name is "{name}"', "expected one of: " + ", ".join(qkv.simd_targets())])
    assert qkv.simd_target() == before


@pytest.mark.parametrize("name", [None, 3, ["avx2"]], ids=repr)
def test_set_simd_target_not_a_string(name):
    before = qkv.simd_target()
    with pytest.raises(TypeError):
        qkv.set_simd_target(name)
    assert qkv.simd_target() == before


# ---- garbage never crashes ---------------------------------------------------------------
# The sweep runs in a child process, so a crash is a failed test with the
# signal's number rather than the end of the test run.

GARBAGE = {
    "None": None, "str": "abc", "bytes": b"xy", "dict": {}, "set": {1, 2}, "object": object(),
    "function": print, "ragged": [[1.0], [1.0, 2.0]], "ragged3": [[[1.0, 2.0]], [[1.0]]],
    "nested str": [["a", "b"], ["c", "d"]], "complex": 1j, "slice": slice(1, 2),
}


def legal(fn, name, label):
    """Whether garbage `label` is a legal value of argument `name` of `fn`: None
    means no lengths (valid_lens), the default (scale, dropout_p, initial_w,
    loo_error's bandwidth, an attention function's seed: a fresh one) or
    false (a flag, as pybind11 converts it), and a flag takes any number's
    truth value."""
    if label == "None" and name in ("valid_lens", "scale", "dropout_p", "initial_w"):
        return True
    if label == "None" and name == "seed" and fn != "train_parametric":
        return True
    if label == "None" and fn == "KernelRegression.loo_error":
        return True
    return name in ("return_weights", "return_lse", "exact") and label in ("None", "complex")


def sweep_calls(rng):
    """(function name, argument name, kwargs of a valid call) for every argument of
    every public function."""
    a = Arrays(rng)
    x2 = np.stack([a.x, a.y], 1)
    calls = [
        ("masked_softmax", {"X": a.X, "valid_lens": [1, 2]}),
        ("masked_softmax_backward", {"weights": a.X, "d_weights": a.X, "valid_lens": [1, 2]}),
        ("scaled_dot_product_attention", {**sdpa_kwargs(a), "valid_lens": [1, 2], "scale": 0.5,
                                          "dropout_p": 0.1, "seed": 3, "return_weights": True,
                                          "return_lse": True}),
        ("scaled_dot_product_attention_backward", {**sdpa_backward_kwargs(a),
                                                   "valid_lens": [5, 5], "scale": None,
                                                   "dropout_p": 0.0, "seed": 0}),
        ("additive_attention", {**additive_kwargs(a), "valid_lens": [1, 2], "dropout_p": 0.1,
                                "seed": 3, "return_weights": True, "return_lse": True}),
        ("additive_attention_backward", {**additive_backward_kwargs(a), "valid_lens": [5, 5],
                                         "dropout_p": 0.0, "seed": 0}),
        ("attention_pooling", {"weights": a.X, "values": a.v}),
        ("average_pooling", {"values": a.v, "num_queries": 3, "valid_lens": [1, 2]}),
        ("one_hot_lookup", {"index": [[0, 1, 2], [2, 1, 0]], "values": a.v}),
        ("one_hot_weights", {"index": [[0, 1, 2]], "num_keys": 3}),
        ("uniform_weights", {"batch": 2, "num_queries": 3, "num_keys": 5, "valid_lens": [1, 2]}),
        ("nadaraya_watson", {"x_train": x2, "y_train": a.y, "x_query": x2[:3],
                             "kernel": "gaussian", "bandwidth": [0.5, 0.5], "exact": True}),
        ("silverman_bandwidth", {"x": a.x}),
        ("scott_bandwidth", {"x": x2}),
        ("train_parametric", {"x": a.x, "y": a.y, "epochs": 2, "lr": 0.1, "initial_w": 0.5,
                              "seed": 1}),
        ("set_num_threads", {"n": 0}),
        ("set_simd_target", {"name": ""}),
        ("KernelRegression", {"kernel": "gaussian", "bandwidth": 0.5}),
        ("KernelRegression.fit", {"x": x2, "y": a.y}),
        ("KernelRegression.predict", {"x_query": x2, "exact": False}),
        ("KernelRegression.weights", {"x_query": x2}),
        ("KernelRegression.loo_error", {"bandwidth": 0.5}),
    ]
    return calls, x2, a.y


def run_sweep(seed):
    """Every argument of every call replaced by each garbage value in turn; prints one
    JSON line per call: [function, argument, garbage, outcome]."""
    calls, x2, y = sweep_calls(np.random.default_rng(seed))
    for fn, kwargs in calls:
        if fn.startswith("KernelRegression."):
            target = getattr(qkv.KernelRegression(bandwidth=0.5).fit(x2, y), fn.split(".")[1])
        else:
            target = getattr(qkv, fn)
        target(**kwargs)  # the valid call works
        for name in kwargs:
            for label, value in GARBAGE.items():
                if legal(fn, name, label):
                    continue
                try:
                    target(**dict(kwargs, **{name: value}))
                    outcome = "returned"
                except (TypeError, ValueError) as e:
                    outcome = "TypeError" if isinstance(e, TypeError) else "ValueError"
                    if not str(e):
                        outcome += " without a message"
                except Exception as e:  # noqa: BLE001 (reported, and fails the test)
                    outcome = f"{type(e).__module__}.{type(e).__name__}: {e}"
                print(json.dumps([fn, name, label, outcome]), flush=True)
    qkv.set_simd_target("")
    qkv.set_num_threads(0)
    print("done", flush=True)


def test_garbage_gives_type_or_value_errors_never_a_crash(seed):
    proc = subprocess.run([sys.executable, __file__, "--sweep", str(seed)], capture_output=True,
                          text=True, timeout=300)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, (f"the sweep died (status {proc.returncode}) after "
                                  f"{lines[-1] if lines else 'nothing'}: {proc.stderr[-2000:]}")
    assert lines and lines[-1] == "done", proc.stderr[-2000:]
    results = [json.loads(line) for line in lines[:-1]]
    assert len(results) > 300
    wrong = [r for r in results if r[3] not in ("TypeError", "ValueError")]
    assert not wrong, "\n".join(f"{fn}({name}={label}): {outcome}"
                                for fn, name, label, outcome in wrong)


# Empty tensors: every size 0 in turn (B, Nq, Nk, D, Dv), 3-D and 2-D.
EMPTY_SHAPES = [(0, 2, 3, 4, 5), (2, 0, 3, 4, 5), (2, 3, 0, 4, 5), (2, 3, 4, 0, 5),
                (2, 3, 4, 5, 0), (0, 0, 0, 0, 0), (None, 0, 3, 4, 5), (None, 2, 0, 4, 5)]
EMPTY_OPS = ["scaled_dot_product_attention", "scaled_dot_product_attention_backward",
             "additive_attention", "additive_attention_backward", "masked_softmax",
             "masked_softmax_backward", "attention_pooling", "average_pooling",
             "uniform_weights", "one_hot_lookup"]


def empty_case(shape, op, dtype=np.float32):
    """(call, expected result shapes) of `op` on zeros of the sizes in `shape`."""
    B, Nq, Nk, D, Dv = shape
    lead = () if B is None else (B,)
    batch = 1 if B is None else B
    z = lambda *s: np.zeros(lead + s, dtype)  # noqa: E731
    p = lambda *s: np.ones(s, dtype)  # noqa: E731
    q, k, v, out, lse = z(Nq, D), z(Nk, D), z(Nk, Dv), z(Nq, Dv), z(Nq)
    X = z(Nq, Nk)
    cases = {
        "scaled_dot_product_attention": (
            lambda: qkv.scaled_dot_product_attention(q, k, v, scale=1.0, return_weights=True,
                                                     return_lse=True),
            [out.shape, X.shape, lse.shape]),
        "scaled_dot_product_attention_backward": (
            lambda: qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, out, scale=1.0),
            [q.shape, k.shape, v.shape]),
        "additive_attention": (
            lambda: qkv.additive_attention(q, k, v, p(3, D), p(3, D), p(3), return_weights=True,
                                           return_lse=True),
            [out.shape, X.shape, lse.shape]),
        "additive_attention_backward": (
            lambda: qkv.additive_attention_backward(q, k, v, p(3, D), p(3, D), p(3), out, lse,
                                                    out),
            [q.shape, k.shape, v.shape, (3, D), (3, D), (3,)]),
        "masked_softmax": (lambda: qkv.masked_softmax(X), [X.shape]),
        "masked_softmax_backward": (lambda: qkv.masked_softmax_backward(X, X), [X.shape]),
        "attention_pooling": (lambda: qkv.attention_pooling(X, v), [out.shape]),
        "average_pooling": (lambda: qkv.average_pooling(v, Nq), [out.shape]),
        "uniform_weights": (lambda: qkv.uniform_weights(batch, Nq, Nk), [(batch, Nq, Nk)]),
        "one_hot_lookup": (lambda: qkv.one_hot_lookup(np.zeros(lead + (Nq,), int)[..., :0]
                                                      if Nk == 0 else np.zeros(lead + (Nq,), int),
                                                      v),
                           [(*lead, 0 if Nk == 0 else Nq, Dv)]),
    }
    return cases[op]


def run_empty(skip):
    """Runs every (shape, op) not in `skip`, printing a JSON line before each call and
    its outcome after: a crash shows as the last case started."""
    for shape in EMPTY_SHAPES:
        for op in EMPTY_OPS:
            case = f"{op}{shape}"
            if case in skip:
                continue
            call, shapes = empty_case(shape, op)
            print(json.dumps(["start", case]), flush=True)
            try:
                got = call()
                got = list(got) if isinstance(got, tuple) else [got]
                if [tuple(g.shape) for g in got] == [tuple(s) for s in shapes]:
                    outcome = "ok"
                else:
                    outcome = f"shapes {[g.shape for g in got]}, expected {shapes}"
            except ValueError:
                outcome = "ok"  # refusing an empty tensor is an answer too
            except Exception as e:  # noqa: BLE001 (reported)
                outcome = f"{type(e).__name__}: {e}"
            print(json.dumps(["done", case, outcome]), flush=True)
    print("done", flush=True)


def test_empty_tensors_never_crash():
    # Each crash is recorded and the child run again without that case, so one
    # run names every case that crashes.
    crashed, outcomes = [], {}
    for _ in range(len(EMPTY_SHAPES) * len(EMPTY_OPS)):
        proc = subprocess.run([sys.executable, __file__, "--empty", json.dumps(crashed)],
                              capture_output=True, text=True, timeout=300)
        lines = proc.stdout.splitlines()
        for line in lines[:-1] if lines and lines[-1] == "done" else lines:
            record = json.loads(line)
            if record[0] == "done":
                outcomes[record[1]] = record[2]
        if proc.returncode == 0:
            assert lines[-1] == "done", proc.stderr[-2000:]
            break
        started = json.loads(lines[-1])
        assert started[0] == "start", f"the child failed outside a case: {proc.stderr[-2000:]}"
        crashed.append(started[1])
        outcomes[started[1]] = f"crashed (status {proc.returncode})"
    assert len(outcomes) == len(EMPTY_SHAPES) * len(EMPTY_OPS)
    wrong = {case: outcome for case, outcome in outcomes.items() if outcome != "ok"}
    assert not wrong, "\n".join(f"{case}: {outcome}" for case, outcome in wrong.items())


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--sweep":
        run_sweep(int(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "--empty":
        run_empty(set(json.loads(sys.argv[2])))


OLD_DROPOUT_CALLS = {
    "scaled_dot_product_attention": lambda q, k, v, **kw: qkv.scaled_dot_product_attention(
        q, k, v, [3, 5], seed=4, return_lse=True, **kw),
    "additive_attention": lambda q, k, v, **kw: qkv.additive_attention(
        q, k, v, np.ones((6, 4)), np.ones((6, 4)), np.ones(6), [3, 5], seed=4, **kw),
    "bilinear_attention": lambda q, k, v, **kw: qkv.bilinear_attention(
        q, k, v, np.eye(4), [3, 5], seed=4, **kw),
    "distance_attention": lambda q, k, v, **kw: qkv.distance_attention(
        q, k, v, [3, 5], seed=4, **kw),
}


@pytest.mark.parametrize("fn", sorted(OLD_DROPOUT_CALLS))
def test_the_old_dropout_spelling_still_works_and_warns(fn, rng):
    """dropout=, dropout_p's old name, gives the same bits for one release with
    a DeprecationWarning that names the function; both together are a TypeError."""
    q, k, v = (rng.normal(size=(2, n, 4)) for n in (3, 5, 5))
    call = OLD_DROPOUT_CALLS[fn]
    new = call(q, k, v, dropout_p=0.4)
    with pytest.warns(DeprecationWarning, match=rf"^{fn}: dropout= is deprecated and goes in the "
                                                 r"next release; use dropout_p=$"):
        old = call(q, k, v, dropout=0.4)
    for a, b in zip(new if isinstance(new, tuple) else (new,),
                    old if isinstance(old, tuple) else (old,)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(np.asarray(new if not isinstance(new, tuple) else new[0]),
                              np.asarray(call(q, k, v)[0] if isinstance(new, tuple)
                                         else call(q, k, v))), "dropout had no effect"
    with pytest.raises(TypeError, match=rf"{fn}\(\) got dropout_p and dropout, its old name"):
        call(q, k, v, dropout_p=0.4, dropout=0.4)
