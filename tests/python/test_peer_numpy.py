"""Peer test: qkv's NumPy API against d2l's PyTorch attention code.

qkv.masked_softmax, qkv.scaled_dot_product_attention and qkv.additive_attention
(and their backwards) on fresh random cases, against the book's formulations
(tests/peer/d2l_reference.py) run by torch in the same float type, and torch
autograd of them for the gradients. Each op runs NUM_CASES forward and
NUM_CASES backward cases cycling float32/float64, valid_lens None, (B) or
(B, Nq) (int32, int64, sometimes lists; scalars and (Nq) for 2-D inputs), 2-D
inputs (a batch of one), strided inputs, and sizes around the SIMD widths
(1, 7, 8, 9, 15, 16, 17, ...) up to 100 keys (300 in a few cases). Forward
cases check the output and, as the case index cycles the return flags, the
weights and lse (lse against the exact log-sum-exp of d2l's scores).

Pass if max|got - ref| / max(max|ref|, scale) <= 1e-5 (float32) or 1e-12
(float64), scale the size of the terms the result sums (d2l_reference:
pooled_scale for outputs, lse_scale for lse, *_grad_scale(s) for gradients),
as in the CLI's peer test. The backwards get d2l's forward output and the
exact lse (in the case's dtype) as their saved forward, so each direction is
tested on its own.

Where qkv and d2l differ by design (docs/semantics.md), the random cases
avoid the difference (lengths >= 1, scores far above d2l's -1e6 sentinel)
and tests of their own pin qkv's side: L = 0 gives zero weights, output and
gradients and lse = -inf; valid scores below -1e6 still count.
"""

import math

import numpy as np
import pytest
import torch

import qkv
from peer_cases import (  # first: puts tests/peer (d2l_reference) on sys.path
    GRAD_NAMES,
    NP_DTYPE,
    NUM_CASES,
    SIZES,
    TORCH_DTYPE,
    ZERO_LENGTH_LENS,
    AttentionCase,
    Reference,
    SoftmaxCase,
    check_close,
    is_strided,
    report_worst,
    strided,
    zero_length_case,
)
from d2l_reference import (
    additive_grad_scales,
    d2l_masked_softmax,
    lse_scale,
    pooled_scale,
    row_lengths,
    sdpa_grad_scales,
    softmax_grad_scale,
)

CASES = range(NUM_CASES)
GRAD_AXES = {"q": ("q", "d"), "k": ("k", "d"), "v": ("k", "d")}


@pytest.fixture(scope="module", autouse=True)
def torch_threads():
    """The references are small: one torch thread, so qkv has the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
    report_worst("test_peer_numpy: worst relative errors")


def dtype_of(index):
    return ("float32", "float64")[index % 2]


def maybe_strided(rng, index, arrays):
    """Two cases in eight pass their inputs as non-contiguous views."""
    if not is_strided(index):
        return arrays, []
    return [strided(rng, a) for a in arrays], ["strided inputs"]


# ---- masked softmax -------------------------------------------------------------------

def d2l_softmax(case, torch_dtype, d_weights=None):
    """d2l's masked softmax of the case's scores; with d_weights also d scores by autograd."""
    x = torch.tensor(case.scores, dtype=torch_dtype, requires_grad=d_weights is not None)
    weights = d2l_masked_softmax(x, case.lens.tensor())
    if d_weights is None:
        return weights.detach(), None
    weights.backward(torch.from_numpy(d_weights))
    return weights.detach(), x.grad


@pytest.mark.parametrize("index", CASES)
def test_masked_softmax(index, rng):
    dtype = dtype_of(index)
    case = SoftmaxCase(index, rng, dtype)
    scores = case.unbatch(case.scores.astype(NP_DTYPE[dtype]))
    (scores,), notes = maybe_strided(rng, index, [scores])
    desc = case.desc(*notes)
    got = qkv.masked_softmax(scores, case.lens.value)
    ref, _ = d2l_softmax(case, TORCH_DTYPE[dtype])
    assert got.dtype == NP_DTYPE[dtype], f"weights dtype {got.dtype}; {desc}"
    check_close("weights", got, case.unbatch(ref.numpy()), dtype, case.axes(), desc)


@pytest.mark.parametrize("index", CASES)
def test_masked_softmax_backward(index, rng):
    dtype = dtype_of(index)
    case = SoftmaxCase(index, rng, dtype)
    d_weights = rng.normal(size=case.scores.shape).astype(NP_DTYPE[dtype])
    ref_weights, ref_grad = d2l_softmax(case, TORCH_DTYPE[dtype], d_weights)
    weights, grads = case.unbatch(ref_weights.numpy()), case.unbatch(d_weights)
    (weights, grads), notes = maybe_strided(rng, index, [weights, grads])
    desc = case.desc(*notes)
    got = qkv.masked_softmax_backward(weights, grads, case.lens.value)
    assert got.dtype == NP_DTYPE[dtype], f"d_scores dtype {got.dtype}; {desc}"
    check_close("d_scores", got, case.unbatch(ref_grad.numpy()), dtype, case.axes(), desc,
                scale=softmax_grad_scale(ref_weights, d_weights))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("form", ["1d/int32", "2d/int64"])
def test_masked_softmax_zero_length_rows(dtype, form, rng):
    """L = 0: d2l's sentinel gives uniform weights 1/Nk; qkv a row of zeros, and a
    zero gradient. The other rows agree with d2l."""
    num_keys = int(rng.choice(SIZES[1:]))
    scores = rng.normal(size=(3, 4, num_keys)).astype(NP_DTYPE[dtype])
    if form == "1d/int32":
        lens = np.array([2, 0, num_keys], dtype=np.int32)
    else:
        lens = np.array([[0, 1, num_keys, 2], [2, 0, 0, 1], [num_keys, 1, 1, 0]], dtype=np.int64)
    empty = row_lengths(lens, 3, 4, num_keys) == 0
    desc = f"dtype={dtype} lens={lens.tolist()} Nk={num_keys}"
    x = torch.tensor(scores, requires_grad=True)
    ref = d2l_masked_softmax(x, torch.from_numpy(lens))
    assert np.allclose(ref.detach().numpy()[empty], 1.0 / num_keys), "d2l gives uniform rows"

    got = qkv.masked_softmax(scores, lens)
    for b, i in np.argwhere(empty):
        assert np.all(got[b, i] == 0), f"L = 0 row b={b} q={i} must be zeros, got {got[b, i]}"
    check_close("weights (rows with L >= 1)", got[~empty], ref.detach().numpy()[~empty], dtype,
                ("row", "k"), desc)

    # Backward: qkv's L = 0 rows are constant zeros, so their gradient is zero;
    # d2l's uniform rows would give w (dw - mean dw).
    d_weights = rng.normal(size=scores.shape).astype(NP_DTYPE[dtype])
    weights = np.where(empty[..., None], 0.0, ref.detach().numpy()).astype(NP_DTYPE[dtype])
    ref.backward(torch.from_numpy(d_weights))
    got_grad = qkv.masked_softmax_backward(weights, d_weights, lens)
    for b, i in np.argwhere(empty):
        assert np.all(got_grad[b, i] == 0), (f"L = 0 row b={b} q={i} must have a zero "
                                             f"gradient, got {got_grad[b, i]}")
    check_close("d_scores (rows with L >= 1)", got_grad[~empty], x.grad.numpy()[~empty], dtype,
                ("row", "k"), desc, scale=softmax_grad_scale(weights, d_weights))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_masked_softmax_counts_scores_below_sentinel(dtype):
    """Valid scores of -3e6 still count (d2l's -1e6 sentinel would outweigh them)."""
    scores = np.array([[[-3e6, -3e6 + 2.0, 5.0]]], dtype=NP_DTYPE[dtype])
    e2 = math.exp(2.0)
    expect = np.array([[[1.0 / (1.0 + e2), e2 / (1.0 + e2), 0.0]]])
    got = qkv.masked_softmax(scores, np.array([2]))
    check_close("weights", got, expect, dtype, ("b", "q", "k"), "scores [-3e6, -3e6 + 2, 5], L = 2")


# ---- scaled dot-product and additive attention ----------------------------------------

def qkv_forward(case, dtype, rng, **flags):
    """The case through qkv's NumPy forward of its op; (result, notes)."""
    np_type = NP_DTYPE[dtype]
    inputs = [case.unbatch(a.astype(np_type))
              for a in (case.queries, case.keys_for_qkv(), case.values)]
    inputs, notes = maybe_strided(rng, case.index, inputs)
    if case.op == "dot":
        return qkv.scaled_dot_product_attention(*inputs, case.lens.value, scale=case.scale,
                                                **flags), notes
    params = [a.astype(np_type) for a in (case.W_q, case.W_k, case.w_v)]
    return qkv.additive_attention(*inputs, *params, case.lens.value, **flags), notes


@pytest.mark.parametrize("op", ["dot", "additive"])
@pytest.mark.parametrize("index", CASES)
def test_attention_forward(op, index, rng):
    dtype = dtype_of(index)
    case = AttentionCase(op, index, rng, dtype)
    # The index cycles what is asked for: output only, + weights, + lse, + both.
    want_weights, want_lse = bool(index & 4), bool(index & 8)
    result, notes = qkv_forward(case, dtype, rng, return_weights=want_weights,
                                return_lse=want_lse)
    desc = case.desc(*notes, f"weights {want_weights} lse {want_lse}")
    ref = Reference(case, TORCH_DTYPE[dtype])
    if want_weights or want_lse:
        assert isinstance(result, tuple) and len(result) == 1 + want_weights + want_lse, desc
        parts = list(result)
    else:
        assert isinstance(result, np.ndarray), f"expected one array; {desc}"
        parts = [result]
    output = parts.pop(0)
    assert output.dtype == NP_DTYPE[dtype], f"output dtype {output.dtype}; {desc}"
    check_close("output", output, case.unbatch(ref.out.numpy()), dtype, case.axes("q", "d"),
                desc, scale=pooled_scale(ref.weights, case.values))
    if want_weights:
        weights = parts.pop(0)
        assert weights.dtype == NP_DTYPE[dtype], f"weights dtype {weights.dtype}; {desc}"
        check_close("weights", weights, case.unbatch(ref.weights.numpy()), dtype,
                    case.axes("q", "k"), desc)
    if want_lse:
        lse = parts.pop(0)
        assert lse.dtype == NP_DTYPE[dtype], f"lse dtype {lse.dtype}; {desc}"
        check_close("lse", lse, case.unbatch(ref.lse), dtype, case.axes("q"), desc,
                    scale=lse_scale(ref.scores, case.lens.tensor()))


def qkv_backward(case, dtype, rng, output, lse, d_output):
    """qkv's NumPy backward of the case's op, given the saved forward; (grads, notes)."""
    np_type = NP_DTYPE[dtype]
    inputs = [case.unbatch(a.astype(np_type))
              for a in (case.queries, case.keys_for_qkv(), case.values)]
    saved = [case.unbatch(np.asarray(a).astype(np_type)) for a in (output, lse, d_output)]
    arrays, notes = maybe_strided(rng, case.index, inputs + saved)
    inputs, saved = arrays[:3], arrays[3:]
    if case.op == "dot":
        return qkv.scaled_dot_product_attention_backward(*inputs, *saved, case.lens.value,
                                                         scale=case.scale), notes
    params = [a.astype(np_type) for a in (case.W_q, case.W_k, case.w_v)]
    return qkv.additive_attention_backward(*inputs, *params, *saved, case.lens.value), notes


def grad_scales(case, ref, d_output):
    args = (ref.weights, case.queries, case.keys, case.values)
    if case.op == "dot":
        return sdpa_grad_scales(*args, d_output, case.attention_scale)
    return additive_grad_scales(*args, case.W_q, case.W_k, case.w_v, d_output)


def check_grads(case, dtype, grads, ref_grads, scales, desc):
    for name, ref_grad in ref_grads.items():
        got = getattr(grads, GRAD_NAMES[name])
        assert got.dtype == NP_DTYPE[dtype], f"{GRAD_NAMES[name]} dtype {got.dtype}; {desc}"
        if name in GRAD_AXES:  # inputs: as qkv returns them (no batch axis for 2-D)
            ref_grad, axes = case.unbatch(ref_grad.numpy()), case.axes(*GRAD_AXES[name])
        else:  # parameters: W_q, W_k (H, D); w_v (H) or (1, H)
            ref_grad = ref_grad.numpy()
            axes = ("h", "d") if name != "w_v" else ("o", "h")[-ref_grad.ndim:]
        check_close(GRAD_NAMES[name], got, ref_grad, dtype, axes, desc, scale=scales[name])


@pytest.mark.parametrize("op", ["dot", "additive"])
@pytest.mark.parametrize("index", CASES)
def test_attention_backward(op, index, rng):
    dtype = dtype_of(index)
    case = AttentionCase(op, index, rng, dtype)
    d_output = rng.normal(size=case.queries.shape[:2] + case.values.shape[2:])
    d_output = d_output.astype(NP_DTYPE[dtype])
    ref = Reference(case, TORCH_DTYPE[dtype], d_output)
    grads, notes = qkv_backward(case, dtype, rng, ref.out.numpy(), ref.lse, d_output)
    desc = case.desc(*notes)
    check_grads(case, dtype, grads, ref.grads, grad_scales(case, ref, d_output), desc)


@pytest.mark.parametrize("op", ["dot", "additive"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("form", ["1d/int32", "2d/int64"])
def test_attention_zero_length(op, dtype, form, rng):
    """L = 0: d2l's sentinel makes the query's output the mean of all values;
    qkv's is zero (an empty sum), its weights zero, its lse -inf, its gradient
    zero and it adds nothing to the keys' and values' gradients. Queries with
    L >= 1 agree with d2l."""
    lens = ZERO_LENGTH_LENS[form]
    case = zero_length_case(op, dtype, rng, lens)
    empty = case.lens.rows == 0
    desc = case.desc()
    ref = Reference(case, TORCH_DTYPE[dtype])
    mean = case.values.mean(axis=1, keepdims=True).repeat(4, axis=1)
    assert np.allclose(ref.out.numpy()[empty], mean[empty], atol=1e-5), "d2l averages all values"

    output, weights, lse = qkv_forward(case, dtype, rng, return_weights=True, return_lse=True)[0]
    for b, i in np.argwhere(empty):
        assert np.all(output[b, i] == 0) and np.all(weights[b, i] == 0), (
            f"L = 0 must give zero output and weights: b={b} q={i} output {output[b, i]}, "
            f"weights {weights[b, i]}; {desc}")
        assert np.isneginf(lse[b, i]), f"L = 0 must give lse = -inf: b={b} q={i} got {lse[b, i]}"
    check_close("output (queries with L >= 1)", output[~empty], ref.out.numpy()[~empty], dtype,
                ("row", "d"), desc, scale=pooled_scale(ref.weights, case.values))
    check_close("weights (queries with L >= 1)", weights[~empty], ref.weights.numpy()[~empty],
                dtype, ("row", "k"), desc)
    check_close("lse (queries with L >= 1)", lse[~empty], ref.lse[~empty], dtype, ("row",),
                desc, scale=lse_scale(ref.scores, case.lens.tensor()))

    # Backward: with d_output zero on the L = 0 queries, d2l's gradients are
    # what qkv's must be for any d_output (those queries are constant zeros).
    d_output = rng.normal(size=(lens.shape[0], 4, case.values.shape[-1])).astype(NP_DTYPE[dtype])
    d_output_live = np.where(empty[..., None], 0.0, d_output)
    ref = Reference(case, TORCH_DTYPE[dtype], d_output_live)
    saved_out = np.where(empty[..., None], 0.0, ref.out.numpy())
    grads, _ = qkv_backward(case, dtype, rng, saved_out, ref.lse, d_output)
    for b, i in np.argwhere(empty):
        assert np.all(grads.d_queries[b, i] == 0), (
            f"L = 0 query b={b} q={i} must get a zero gradient, got {grads.d_queries[b, i]}")
    ref_weights = np.where(empty[..., None], 0.0, ref.weights.numpy())
    ref.weights = torch.from_numpy(ref_weights)
    check_grads(case, dtype, grads, ref.grads, grad_scales(case, ref, d_output_live), desc)
