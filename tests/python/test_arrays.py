"""How the NumPy API takes and gives arrays (python/src/arrays.h).

Checked for every op of the NumPy API:
  - inputs are read with any strides: transposed and Fortran-order storage,
    negative strides, gaps (every other element), stride-0 broadcasts
    (np.broadcast_to), misaligned memory (np.frombuffer at offset 1) and record
    fields (strides that are not whole elements), big-endian floats and
    read-only arrays; results are bitwise those of the same call on
    np.ascontiguousarray copies in native byte order;
  - inputs are never written (their whole buffers compare equal afterwards);
  - results are new, writeable, C-contiguous arrays of the inputs' dtype that
    share no memory with the inputs;
  - 2-D inputs (a batch of one) give results without the batch axis, bitwise
    the 3-D call with B = 1 without it;
  - forward results are the output alone or the tuple (output[, weights][,
    lse]), the same bits in each form; gradients are named tuples shaped like
    what they differentiate (d_w_v like w_v);
  - valid_lens as a list, tuple, Python or NumPy scalar (2-D inputs), 0-d
    array, and integer arrays of every width, signedness and byte order,
    strided or misaligned, all give the bits of an int64 array;
  - scaled_dot_product_attention's out= writes into the caller's array (any
    layout with contiguous, non-overlapping rows), returns it, and leaves a
    bad one as it was;
  - the bits of the C++ library: the same inputs through the `qkv` command
    (`qkv softmax`, `qkv attend --scoring dot|additive`, with valid lengths,
    scale, dropout, weights and lse), float32 and float64, equal the Python
    results byte for byte.
"""

import re
import subprocess

import numpy as np
import pytest

import qkv

DTYPES = [np.float32, np.float64]


# ---- layouts: the same values in other memory ----------------------------------------
# Each takes a C-contiguous native array and returns (view, owner): a view
# holding the same values in another memory layout, and the buffer that holds
# them (to check that nothing was written anywhere in it).

def transposed(a):
    """Storage with the last two axes swapped (a transposed view)."""
    owner = np.ascontiguousarray(np.swapaxes(a, -1, -2))
    return np.swapaxes(owner, -1, -2), owner


def fortran(a):
    owner = np.asfortranarray(a)
    return owner, owner


def negative(a):
    """Every axis reversed in memory: all strides negative."""
    rev = (slice(None, None, -1),) * a.ndim
    owner = np.ascontiguousarray(a[rev])
    return owner[rev], owner


def negative_last(a):
    """x[..., ::-1] of a reversed copy: a negative stride on the last axis only."""
    owner = np.ascontiguousarray(a[..., ::-1])
    return owner[..., ::-1], owner


def gaps(a):
    """Every other element of a larger array on every axis (strides of 2 elements)."""
    owner = np.full(tuple(2 * n + 1 for n in a.shape), np.nan, a.dtype)
    view = owner[(slice(1, None, 2),) * a.ndim]
    view[...] = a
    return view, owner


def misaligned(a):
    """np.frombuffer of a bytes object at offset 1: read-only, not aligned."""
    owner = b"\0" + a.tobytes()
    view = np.frombuffer(owner, a.dtype, a.size, offset=1).reshape(a.shape)
    assert not view.flags.aligned
    return view, owner


def record_field(a):
    """A field of a packed record array: strides not a whole number of elements."""
    owner = np.zeros(a.shape, np.dtype([("tag", np.uint8), ("x", a.dtype)]))
    owner["x"] = a
    view = owner["x"]
    assert view.strides[-1] % a.itemsize != 0
    return view, owner


def big_endian(a):
    owner = a.astype(a.dtype.newbyteorder(">"))
    return owner, owner


def read_only(a):
    owner = a.copy()
    owner.flags.writeable = False
    return owner, owner


LAYOUTS = [transposed, fortran, negative, negative_last, gaps, misaligned, record_field,
           big_endian, read_only]


def native_copy(a):
    """np.ascontiguousarray in native byte order: the reference layout."""
    return np.ascontiguousarray(a, dtype=np.dtype(a.dtype).newbyteorder("="))


def buffer_bytes(owner):
    return bytes(owner) if isinstance(owner, bytes) else np.asarray(owner).tobytes()


def assert_same_bits(got, want, what):
    assert isinstance(got, np.ndarray), f"{what}: a {type(got).__name__}, not an array"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    bits = f"u{got.dtype.itemsize}"
    differ = np.ascontiguousarray(got).view(bits) != np.ascontiguousarray(want).view(bits)
    if differ.any():
        first = tuple(int(i) for i in np.argwhere(differ)[0])
        raise AssertionError(f"{what}: bits differ at {int(differ.sum())} of {got.size} "
                             f"elements, first at {first}: got {got[first]!r}, "
                             f"want {want[first]!r}")


def assert_new_result(result, dtype, inputs, what):
    """A new, writeable, C-contiguous array of `dtype` sharing no memory with any input."""
    assert isinstance(result, np.ndarray), f"{what}: a {type(result).__name__}"
    assert result.dtype == np.dtype(dtype), f"{what}: dtype {result.dtype}, expected {dtype}"
    assert result.dtype.isnative, f"{what}: byte order {result.dtype.byteorder}"
    assert result.flags.c_contiguous, f"{what}: not C-contiguous (strides {result.strides})"
    assert result.flags.writeable, f"{what}: not writeable"
    for name, a in inputs.items():
        if isinstance(a, np.ndarray):
            assert not np.shares_memory(result, a), f"{what}: shares memory with {name}"


def results(value):
    """An op's result as a tuple of arrays (a single array, a tuple or a named tuple)."""
    return tuple(value) if isinstance(value, tuple) else (value,)


# ---- the ops, as (name, make inputs, call) --------------------------------------------
# make(rng, dtype, batch) -> dict of float inputs (3-D with `batch`, or 2-D
# for batch None) and of other arguments; call(**inputs) -> the op's result.
# Sizes straddle the SIMD widths (Nk = 37, D = 19) without being slow.
NQ, NK, D, DV, H = 5, 37, 19, 7, 9


def lead(batch, *shape):
    return shape if batch is None else (batch, *shape)


def normal(rng, dtype, shape):
    return rng.standard_normal(shape).astype(dtype)


def per_query_lens(rng, batch):
    lens = rng.integers(0, NK + 1, size=lead(batch, NQ))
    lens.flat[0] = NK  # one full row, whatever the draw
    return lens


def make_softmax(rng, dtype, batch):
    return {"X": normal(rng, dtype, lead(batch, NQ, NK)), "valid_lens": per_query_lens(rng, batch)}


def make_softmax_backward(rng, dtype, batch):
    lens = per_query_lens(rng, batch)
    w = qkv.masked_softmax(normal(rng, dtype, lead(batch, NQ, NK)), lens)
    return {"weights": w, "d_weights": normal(rng, dtype, w.shape), "valid_lens": lens}


def make_qkv(rng, dtype, batch):
    return {"queries": normal(rng, dtype, lead(batch, NQ, D)),
            "keys": normal(rng, dtype, lead(batch, NK, D)),
            "values": normal(rng, dtype, lead(batch, NK, DV)),
            "valid_lens": per_query_lens(rng, batch)}


def make_sdpa_backward(rng, dtype, batch):
    a = make_qkv(rng, dtype, batch)
    out, lse = qkv.scaled_dot_product_attention(**a, scale=0.3, dropout_p=0.25, seed=11,
                                                return_lse=True)
    return {**a, "output": out, "lse": lse, "d_output": normal(rng, dtype, out.shape)}


def make_additive(rng, dtype, batch):
    a = make_qkv(rng, dtype, batch)
    a["queries"] = normal(rng, dtype, lead(batch, NQ, D + 3))  # Dq != Dk
    return {**a, "W_q": normal(rng, dtype, (H, D + 3)), "W_k": normal(rng, dtype, (H, D)),
            "w_v": normal(rng, dtype, (1, H))}


def make_additive_backward(rng, dtype, batch):
    a = make_additive(rng, dtype, batch)
    out, lse = qkv.additive_attention(**a, dropout_p=0.25, seed=12, return_lse=True)
    return {**a, "output": out, "lse": lse, "d_output": normal(rng, dtype, out.shape)}


def make_pooling(rng, dtype, batch):
    return {"weights": normal(rng, dtype, lead(batch, NQ, NK)),
            "values": normal(rng, dtype, lead(batch, NK, DV))}


def make_average(rng, dtype, batch):
    return {"values": normal(rng, dtype, lead(batch, NK, DV)), "num_queries": NQ,
            "valid_lens": per_query_lens(rng, batch)}


def make_lookup(rng, dtype, batch):
    return {"index": rng.integers(0, NK, size=lead(batch, NQ)),
            "values": normal(rng, dtype, lead(batch, NK, DV))}


def make_merge(rng, dtype, batch):
    # Attention over keys [0, 15) and [15, NK), each with its output and lse.
    a = make_qkv(rng, dtype, batch)
    parts = {}
    for s, (lo, hi) in enumerate(((0, 15), (15, NK))):
        out, lse = qkv.scaled_dot_product_attention(
            a["queries"], a["keys"][..., lo:hi, :], a["values"][..., lo:hi, :],
            np.clip(a["valid_lens"] - lo, 0, hi - lo), return_lse=True)
        parts[f"output{s}"], parts[f"lse{s}"] = out, lse
    return parts


OPS = {
    "masked_softmax": (make_softmax, qkv.masked_softmax),
    "masked_softmax_backward": (make_softmax_backward, qkv.masked_softmax_backward),
    "scaled_dot_product_attention": (
        make_qkv, lambda **a: qkv.scaled_dot_product_attention(
            **a, scale=0.3, dropout_p=0.25, seed=11, return_weights=True, return_lse=True)),
    "scaled_dot_product_attention_backward": (
        make_sdpa_backward, lambda **a: qkv.scaled_dot_product_attention_backward(
            **a, scale=0.3, dropout_p=0.25, seed=11)),
    "additive_attention": (
        make_additive, lambda **a: qkv.additive_attention(
            **a, dropout_p=0.25, seed=12, return_weights=True, return_lse=True)),
    "additive_attention_backward": (
        make_additive_backward, lambda **a: qkv.additive_attention_backward(
            **a, dropout_p=0.25, seed=12)),
    "attention_pooling": (make_pooling, qkv.attention_pooling),
    "average_pooling": (make_average, qkv.average_pooling),
    "one_hot_lookup": (make_lookup, qkv.one_hot_lookup),
    "merge_attention": (
        make_merge, lambda output0, output1, lse0, lse1: qkv.merge_attention(
            [output0, output1], [lse0, lse1])),
}


def float_names(inputs):
    return [n for n, a in inputs.items() if isinstance(a, np.ndarray) and a.dtype.kind == "f"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("op", list(OPS))
def test_any_layout_gives_the_bits_of_contiguous_copies(op, dtype, layout, rng):
    make, call = OPS[op]
    inputs = make(rng, dtype, 3)
    views, owners = dict(inputs), {}
    for name in float_names(inputs):
        views[name], owners[name] = layout(inputs[name])
    before = {name: buffer_bytes(owner) for name, owner in owners.items()}
    got = results(call(**views))
    copies = {n: native_copy(a) if n in owners else a for n, a in views.items()}
    want = results(call(**copies))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same_bits(g, w, f"{op} result {i}, {layout.__name__} inputs")
        assert_new_result(g, dtype, views, f"{op} result {i}")
    for name, owner in owners.items():
        assert buffer_bytes(owner) == before[name], f"{op} wrote into its input {name}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("op", list(OPS))
def test_inputs_are_never_written_and_results_are_new(op, dtype, rng):
    make, call = OPS[op]
    inputs = make(rng, dtype, 2)
    before = {n: a.copy() for n, a in inputs.items() if isinstance(a, np.ndarray)}
    first = results(call(**inputs))
    second = results(call(**inputs))
    for n, a in before.items():
        assert inputs[n].tobytes() == a.tobytes(), f"{op} modified {n}"
        assert inputs[n].flags.writeable
    for i, (r1, r2) in enumerate(zip(first, second)):
        assert_new_result(r1, dtype, inputs, f"{op} result {i}")
        assert not np.shares_memory(r1, r2), f"{op} result {i}: two calls share memory"
        assert_same_bits(r2, r1, f"{op} result {i}, called twice")
        r1[...] = 7  # writeable, and writing into it changes nothing else
    for n, a in before.items():
        assert inputs[n].tobytes() == a.tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("op", list(OPS))
def test_broadcast_inputs_with_zero_strides(op, dtype, rng):
    # Each float input in turn is a stride-0 broadcast along one axis: the
    # batch, a middle axis or the last one.
    make, call = OPS[op]
    inputs = make(rng, dtype, 3)
    for name in float_names(inputs):
        a = inputs[name]
        for axis in range(a.ndim):
            one = np.take(a, [0], axis=axis)
            view = np.broadcast_to(one, a.shape)
            assert view.strides[axis] == 0
            args = dict(inputs, **{name: view})
            got = results(call(**args))
            want = results(call(**dict(inputs, **{name: np.ascontiguousarray(view)})))
            for i, (g, w) in enumerate(zip(got, want)):
                assert_same_bits(g, w, f"{op} result {i}, {name} broadcast along axis {axis}")
                assert_new_result(g, dtype, args, f"{op} result {i}")


# ---- the forms of results ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("op", ["scaled_dot_product_attention", "additive_attention"])
def test_forward_result_forms(op, dtype, rng):
    # output alone, or the tuple (output[, weights][, lse]): the same bits in each.
    make = make_qkv if op == "scaled_dot_product_attention" else make_additive
    inputs = make(rng, dtype, 2)
    call = getattr(qkv, op)
    out, w, lse = call(**inputs, return_weights=True, return_lse=True)
    assert out.shape == (2, NQ, DV) and w.shape == (2, NQ, NK) and lse.shape == (2, NQ)
    alone = call(**inputs)
    assert isinstance(alone, np.ndarray)
    assert_same_bits(alone, out, f"{op} output alone")
    pair = call(**inputs, return_weights=True)
    assert type(pair) is tuple and len(pair) == 2
    assert_same_bits(pair[0], out, f"{op} output with weights")
    assert_same_bits(pair[1], w, f"{op} weights")
    pair = call(**inputs, return_lse=True)
    assert type(pair) is tuple and len(pair) == 2
    assert_same_bits(pair[0], out, f"{op} output with lse")
    assert_same_bits(pair[1], lse, f"{op} lse")
    one = call(**unbatched({**inputs, "valid_lens": inputs["valid_lens"][:1]}),
               return_weights=True, return_lse=True)
    assert [r.shape for r in one] == [(NQ, DV), (NQ, NK), (NQ,)]


@pytest.mark.parametrize("w_v_shape", [(H,), (1, H)], ids=["(H)", "(1, H)"])
def test_gradient_tuples(w_v_shape, rng):
    a = make_sdpa_backward(rng, np.float64, 2)
    g = qkv.scaled_dot_product_attention_backward(**a, scale=0.3, dropout_p=0.25, seed=11)
    assert type(g) is qkv.ScaledDotProductAttentionGrads and isinstance(g, tuple)
    assert g._fields == ("d_queries", "d_keys", "d_values")
    assert [x.shape for x in g] == [a["queries"].shape, a["keys"].shape, a["values"].shape]
    assert g.d_queries is g[0] and g.d_values is g[2]
    b = make_additive(rng, np.float64, 2)
    b["w_v"] = b["w_v"].reshape(w_v_shape)
    out, lse = qkv.additive_attention(**b, return_lse=True)
    ga = qkv.additive_attention_backward(**b, output=out, lse=lse, d_output=np.ones_like(out))
    assert type(ga) is qkv.AdditiveAttentionGrads
    assert ga._fields == ("d_queries", "d_keys", "d_values", "d_W_q", "d_W_k", "d_w_v")
    assert [x.shape for x in ga] == [b[n].shape for n in ("queries", "keys", "values", "W_q",
                                                          "W_k", "w_v")]


# ---- 2-D inputs: a batch of one --------------------------------------------------------

def unbatched(inputs):
    """The inputs of a B = 1 call as a batch of one: 2-D tensors (parameters unchanged)."""
    out = {}
    for name, a in inputs.items():
        if name in ("W_q", "W_k", "w_v") or not isinstance(a, np.ndarray):
            out[name] = a
        else:
            out[name] = a[0]
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("op", list(OPS))
def test_2d_inputs_are_a_batch_of_one(op, dtype, rng):
    make, call = OPS[op]
    inputs3 = make(rng, dtype, 1)
    want = results(call(**inputs3))
    got = results(call(**unbatched(inputs3)))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if op == "additive_attention_backward" and i >= 3:
            # d_W_q, d_W_k, d_w_v: parameters have no batch axis.
            assert_same_bits(g, w, f"{op} result {i}")
        else:
            assert w.shape[0] == 1
            assert_same_bits(g, w[0], f"{op} result {i} of 2-D inputs")
        assert_new_result(g, dtype, inputs3, f"{op} result {i}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
def test_2d_lengths_in_every_form(dtype, rng):
    # For 2-D inputs one length is a scalar, (1) or a 0-d array; one per query
    # is (Nq) or (1, Nq); both equal the 3-D call with (1) or (1, Nq) lengths.
    X = normal(rng, dtype, (NQ, NK))
    q, k, v = (normal(rng, dtype, s) for s in ((NQ, D), (NK, D), (NK, DV)))
    length = int(rng.integers(0, NK + 1))
    per_query = rng.integers(0, NK + 1, size=NQ)
    ones = [length, np.int64(length), np.int32(length), np.array(length), [length], (length,),
            np.array([length], np.int32)]
    per = [per_query, per_query.tolist(), tuple(per_query.tolist()), per_query[None],
           per_query.astype(np.int32)[None], per_query.astype(np.uint8)]
    for lens_forms, lens3 in ((ones, np.array([length])), (per, per_query[None])):
        want_w = qkv.masked_softmax(X[None], lens3)[0]
        want_o = qkv.scaled_dot_product_attention(q[None], k[None], v[None], lens3)[0]
        want_a = qkv.average_pooling(v[None], NQ, lens3)[0]
        for lens in lens_forms:
            what = f"valid_lens {lens!r}"
            assert_same_bits(qkv.masked_softmax(X, lens), want_w, f"masked_softmax, {what}")
            assert_same_bits(qkv.scaled_dot_product_attention(q, k, v, lens), want_o,
                             f"scaled_dot_product_attention, {what}")
            assert_same_bits(qkv.average_pooling(v, NQ, lens), want_a, f"average_pooling, {what}")


def test_one_hot_weights_batch_of_one(rng):
    index = rng.integers(0, NK, size=NQ)
    want = qkv.one_hot_weights(index[None], NK)
    got = qkv.one_hot_weights(index, NK)
    assert want.shape == (1, NQ, NK)
    assert_same_bits(got, want[0], "one_hot_weights of a 1-D index")
    assert_new_result(got, np.float32, {"index": index}, "one_hot_weights")


# ---- valid_lens in every form ------------------------------------------------------------

def length_forms(lens):
    """(description, value) pairs holding the integers of `lens` (int64, any rank)."""
    forms = [("list", lens.tolist())]
    if lens.ndim == 1:
        forms.append(("tuple", tuple(lens.tolist())))
    else:
        forms.append(("tuple of tuples", tuple(tuple(r) for r in lens.tolist())))
    for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64):
        forms.append((np.dtype(t).name, lens.astype(t)))
    forms.append((">i4", lens.astype(">i4")))
    forms.append((">i8", lens.astype(">i8")))
    # int32 and int64 are read in place: strided, reversed and misaligned too.
    for t in (np.int32, np.int64):
        wide = np.zeros((*lens.shape[:-1], 2 * lens.shape[-1]), t)
        wide[..., ::2] = lens
        forms.append((f"{np.dtype(t).name} every other", wide[..., ::2]))
        forms.append((f"{np.dtype(t).name} reversed",
                      np.ascontiguousarray(lens.astype(t)[..., ::-1])[..., ::-1]))
        raw = b"\0" + lens.astype(t).tobytes()
        forms.append((f"{np.dtype(t).name} misaligned",
                      np.frombuffer(raw, t, lens.size, offset=1).reshape(lens.shape)))
    forms.append(("int64 Fortran", np.asfortranarray(lens)))
    return forms


@pytest.mark.parametrize("per", ["batch", "query"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
def test_valid_lens_every_integer_form(dtype, per, rng):
    B = 3
    lens = rng.integers(0, NK + 1, size=(B,) if per == "batch" else (B, NQ))
    X = normal(rng, dtype, (B, NQ, NK))
    q, k, v = (normal(rng, dtype, s) for s in ((B, NQ, D), (B, NK, D), (B, NK, DV)))
    Wq, Wk, wv = (normal(rng, dtype, s) for s in ((H, D), (H, D), (H,)))
    calls = {
        "masked_softmax": lambda L: qkv.masked_softmax(X, L),
        "scaled_dot_product_attention": lambda L: qkv.scaled_dot_product_attention(
            q, k, v, L, return_weights=True, return_lse=True),
        "additive_attention": lambda L: qkv.additive_attention(q, k, v, Wq, Wk, wv, L),
        "average_pooling": lambda L: qkv.average_pooling(v, NQ, L),
        "uniform_weights": lambda L: qkv.uniform_weights(B, NQ, NK, L),
    }
    for op, call in calls.items():
        want = results(call(lens))
        for desc, form in length_forms(lens):
            before = form.tobytes() if isinstance(form, np.ndarray) else None
            got = results(call(form))
            for i, (g, w) in enumerate(zip(got, want)):
                assert_same_bits(g, w, f"{op} result {i}, valid_lens as {desc}")
            if before is not None:
                assert form.tobytes() == before, f"{op} modified valid_lens ({desc})"


# ---- regression: float64, any layout ------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda f: f.__name__)
def test_regression_any_layout(layout, rng):
    x = rng.uniform(0, 5, (40, 2))
    y = rng.standard_normal((40, 3))
    xq = rng.uniform(0, 5, (11, 2))
    views, owners = {}, {}
    for name, a in (("x", x), ("y", y), ("xq", xq)):
        views[name], owners[name] = layout(a)
    before = {n: buffer_bytes(o) for n, o in owners.items()}
    got = qkv.nadaraya_watson(views["x"], views["y"], views["xq"], bandwidth=[0.6, 0.9])
    want = qkv.nadaraya_watson(x, y, xq, bandwidth=[0.6, 0.9])
    assert_same_bits(got, want, f"nadaraya_watson, {layout.__name__} inputs")
    assert_new_result(got, np.float64, views, "nadaraya_watson")
    model = qkv.KernelRegression(bandwidth=[0.6, 0.9]).fit(views["x"], views["y"])
    ref_model = qkv.KernelRegression(bandwidth=[0.6, 0.9]).fit(x, y)
    assert_same_bits(model.predict(views["xq"]), ref_model.predict(xq), "KernelRegression.predict")
    assert_same_bits(model.weights(views["xq"]), ref_model.weights(xq), "KernelRegression.weights")
    for n, o in owners.items():
        assert buffer_bytes(o) == before[n], f"nadaraya_watson wrote into {n}"


def test_regression_float32_inputs_are_converted(rng):
    x = rng.uniform(0, 5, 30)
    y = rng.standard_normal(30)
    xq = rng.uniform(0, 5, 9)
    x32, y32, q32 = (a.astype(np.float32) for a in (x, y, xq))
    got = qkv.nadaraya_watson(x32, y32, q32, bandwidth=0.5)
    want = qkv.nadaraya_watson(*(a.astype(np.float64) for a in (x32, y32, q32)), bandwidth=0.5)
    assert_same_bits(got, want, "nadaraya_watson of float32 inputs")
    assert got.dtype == np.float64


# ---- the bits of the C++ library, through the qkv command -----------------------------------

def run_cli(cli, *args):
    proc = subprocess.run([cli, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"qkv {' '.join(map(str, args))}: {proc.stderr}"


def save(tmp_path, name, array):
    path = tmp_path / f"{name}.npy"
    np.save(path, array)
    return path


def lens_case(rng, kind, batch, nq, nk):
    """Valid lengths of `kind` for `batch` (None: 2-D inputs), including a 0 and an nk."""
    if kind == "none":
        return None
    if kind == "per_batch":
        if batch is None:
            return np.array(rng.integers(0, nk + 1))  # a 0-d array: one length
        lens = rng.integers(0, nk + 1, size=batch)
    else:
        lens = rng.integers(0, nk + 1, size=lead(batch, nq))
    lens.flat[0] = 0
    lens.flat[-1] = nk
    return lens


SOFTMAX_CASES = [  # (batch, Nq, Nk, lengths)
    (3, 4, 33, "none"), (2, 5, 100, "per_batch"), (2, 3, 17, "per_query"),
    (None, 6, 40, "per_query"), (None, 2, 9, "per_batch")]


@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
def test_softmax_bits_equal_the_cli(qkv_cli, tmp_path, dtype, case, rng):
    batch, nq, nk, kind = case
    X = normal(rng, dtype, lead(batch, nq, nk)) * 4
    X.flat[1] = -np.inf  # a legal score
    lens = lens_case(rng, kind, batch, nq, nk)
    args = ["softmax", "--scores", save(tmp_path, "x", X), "--out", tmp_path / "w.npy",
            "--threads", 1]
    if lens is not None:
        args += ["--valid-lens", save(tmp_path, "lens", lens.astype(np.int32))]
    run_cli(qkv_cli, *args)
    assert_same_bits(qkv.masked_softmax(X, lens), np.load(tmp_path / "w.npy"),
                     f"masked_softmax vs qkv softmax, {case}")


ATTEND_CASES = [  # (scoring, batch, Nq, Nk, D, Dv, lengths, extra)
    ("dot", 2, 5, 33, 16, 7, "per_batch", {}),
    ("dot", 3, 4, 300, 64, 8, "per_query", {"scale": 0.37}),
    ("dot", 2, 3, 40, 3, 2, "none", {}),  # D, Dv <= 4: the small-head kernel
    ("dot", 2, 7, 70, 8, 5, "per_query", {"dropout": 0.3, "seed": 1234}),
    ("dot", None, 6, 50, 12, 4, "per_query", {"scale": 2.0, "dropout": 0.5, "seed": 7}),
    ("dot", None, 3, 20, 5, 6, "per_batch", {}),
    ("additive", 2, 4, 30, 6, 5, "per_batch", {"wv_rank": 1}),
    ("additive", 2, 3, 45, 10, 3, "per_query", {"wv_rank": 2, "dropout": 0.2, "seed": 99}),
    ("additive", None, 5, 21, 4, 4, "per_query", {"wv_rank": 2}),
]


@pytest.mark.parametrize("case", ATTEND_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[6]}-{sorted(c[7])}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
def test_attention_bits_equal_the_cli(qkv_cli, tmp_path, dtype, case, rng):
    scoring, batch, nq, nk, d, dv, kind, extra = case
    dk = d + 2 if scoring == "additive" else d
    q = normal(rng, dtype, lead(batch, nq, d))
    k = normal(rng, dtype, lead(batch, nk, dk))
    v = normal(rng, dtype, lead(batch, nk, dv))
    lens = lens_case(rng, kind, batch, nq, nk)
    args = ["attend", "--scoring", scoring, "--queries", save(tmp_path, "q", q),
            "--keys", save(tmp_path, "k", k), "--values", save(tmp_path, "v", v),
            "--out", tmp_path / "o.npy", "--weights", tmp_path / "w.npy",
            "--lse", tmp_path / "lse.npy", "--threads", 1]
    if lens is not None:
        args += ["--valid-lens", save(tmp_path, "lens", lens)]
    kwargs = {"return_weights": True, "return_lse": True}
    if "scale" in extra:
        args += ["--scale", repr(extra["scale"])]
        kwargs["scale"] = extra["scale"]
    if "dropout" in extra:
        args += ["--dropout", repr(extra["dropout"]), "--train", "--seed", extra["seed"]]
        kwargs.update(dropout_p=extra["dropout"], seed=extra["seed"])
    if scoring == "additive":
        h = 8
        Wq, Wk = normal(rng, dtype, (h, d)), normal(rng, dtype, (h, dk))
        wv = normal(rng, dtype, (h,) if extra["wv_rank"] == 1 else (1, h))
        args += ["--wq", save(tmp_path, "wq", Wq), "--wk", save(tmp_path, "wk", Wk),
                 "--wv", save(tmp_path, "wv", wv)]
        got = qkv.additive_attention(q, k, v, Wq, Wk, wv, lens, **kwargs)
    else:
        got = qkv.scaled_dot_product_attention(q, k, v, lens, **kwargs)
    run_cli(qkv_cli, *args)
    for name, g in zip(("o", "w", "lse"), got):
        assert_same_bits(g, np.load(tmp_path / f"{name}.npy"), f"{scoring} {name} vs qkv attend")



@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sdpa_writes_into_out(dtype, rng):
    """out=: the output written into the caller's array (heads as (B, Nq, H, Dv)
    memory viewed as (B, H, Nq, Dv), a 3-D slice of a wider array) and that
    array returned, with the bits of the call without it; bad destinations are
    errors that leave them as they were."""
    B, H, Hkv, Nq, Nk, D, Dv = 2, 4, 2, 5, 9, 8, 6
    q = rng.standard_normal((B, H, Nq, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Nk, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Nk, Dv)).astype(dtype)
    want, lse = qkv.scaled_dot_product_attention(q, k, v, [3, 9], return_lse=True)
    memory = np.full((B, Nq, H, Dv), np.nan, dtype)
    out = memory.transpose(0, 2, 1, 3)
    got, got_lse = qkv.scaled_dot_product_attention(q, k, v, [3, 9], return_lse=True, out=out)
    assert got is out
    assert np.array_equal(memory.transpose(0, 2, 1, 3), want) and np.array_equal(got_lse, lse)
    wide = np.full((B, Nq, Dv + 3), np.nan, dtype)  # 3-D, rows Dv + 3 apart
    q3, k3, v3 = q[:, 0], k[:, 0], v[:, 0]
    got = qkv.scaled_dot_product_attention(q3, k3, v3, out=wide[:, :, 1:Dv + 1])
    assert np.array_equal(got, qkv.scaled_dot_product_attention(q3, k3, v3))
    assert np.isnan(wide[:, :, 0]).all() and np.isnan(wide[:, :, Dv + 1:]).all()
    bad = [(np.zeros((B, H, Nq, Dv), np.float32 if dtype == np.float64 else np.float64),
            TypeError, "out has dtype"),
           ([0.0], TypeError, "out is a list; expected a NumPy array to write into"),
           (np.zeros((B, H, Nq, Dv + 1), dtype), qkv.Error,
            "outputs.output has shape [2, 4, 5, 7]; expected [2, 4, 5, 6]"),
           (np.zeros((B, H, Nq, 2 * Dv), dtype)[..., ::2], qkv.Error,
            "contiguous rows (stride 1 along Dv) that do not overlap"),
           (np.broadcast_to(np.zeros(Dv, dtype), (B, H, Nq, Dv)), qkv.Error, "read-only")]
    for array, error, message in bad:
        before = np.array(array, copy=True)
        with pytest.raises(error, match=re.escape(message)):
            qkv.scaled_dot_product_attention(q, k, v, out=array)
        assert np.array_equal(np.asarray(array), before)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sdpa_out_sharing_an_inputs_memory_is_refused(dtype, rng):
    """out=q (0.73 off), out=v, out=k, or a view into one of them: the
    kernels read the inputs while they write out, so the result was wrong
    and nothing said so. Refused (by the span of the bytes, as NumPy's
    may_share_memory), the arrays as they were."""
    B, Nq, Nk, D = 2, 5, 5, 4
    memory = rng.standard_normal((3, B, Nq, 2 * D)).astype(dtype)
    q, k, v = memory[0, :, :, :D], memory[1, :, :, :D], memory[2, :, :, :D]
    want = qkv.scaled_dot_product_attention(q, k, v)
    for name, out in (("queries", q), ("keys", k), ("values", v),
                      ("values", memory[2, :, :, 2:2 + D]), ("queries", memory[0, :, ::-1, :D])):
        before = memory.copy()
        with pytest.raises(qkv.Error, match=re.escape(
                f"scaled_dot_product_attention: out shares memory with {name}")):
            qkv.scaled_dot_product_attention(q, k, v, out=out)
        assert np.array_equal(memory, before, equal_nan=True)
    # An array of its own is written, with the bits of the call without out.
    got = qkv.scaled_dot_product_attention(q, k, v, out=np.empty((B, Nq, D), dtype))
    assert np.array_equal(got, want)
