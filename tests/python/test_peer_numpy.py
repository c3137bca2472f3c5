"""Peer test: qkv's NumPy API against d2l's PyTorch attention code.

qkv.masked_softmax, qkv.scaled_dot_product_attention and qkv.additive_attention
(and their backwards) on fresh random cases, against the book's formulations
(tests/peer/d2l_reference.py) run by torch in the same float type, and torch
autograd of them for the gradients. Each op runs NUM_CASES forward and
NUM_CASES backward cases (peer_harness: softmax_case, attention_case) cycling
float32/float64, valid_lens None, (B) or (B, Nq) (int32, int64, sometimes
lists; scalars and (Nq) for 2-D inputs), 2-D inputs (a batch of one),
strided inputs, and sizes around the SIMD widths (1, 7, 8, 9, 15, 16, 17,
...) up to 100 keys (300 in a few cases). Forward cases check the output
and, as the case index cycles the return flags, the weights and lse (lse
against the exact log-sum-exp of d2l's scores). The backwards get d2l's
forward output and the exact lse (in the case's dtype) as their saved
forward, so each direction is tested on its own. Every comparison is
peer_harness.check_peer's, by the one rule of d2l_reference.check_close.

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
from peer_harness import (  # first: puts tests/peer (d2l_reference) on sys.path
    NP_DTYPE,
    NUM_CASES,
    SIZES,
    ZERO_LENGTH_LENS,
    as_numpy,
    attention_case,
    check_close,
    check_peer,
    d2l_formula,
    d2l_softmax_formula,
    keys_for_qkv,
    numpy_layouts,
    report_worst,
    softmax_case,
    zero_length_case,
)
from d2l_reference import d2l_masked_softmax, row_lengths, softmax_grad_scale

CASES = range(NUM_CASES)


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


# ---- masked softmax -------------------------------------------------------------------

def qkv_masked_softmax(case):
    return {"weights": qkv.masked_softmax(as_numpy(case, case.inputs["scores"], "scores"),
                                          case.lens.value)}


def qkv_masked_softmax_backward(case):
    """Given d2l's weights (inputs["weights"]) and the case's d_output."""
    weights = as_numpy(case, case.inputs["weights"], "weights")
    d_weights = as_numpy(case, case.d_output, "d_weights")
    return {"d_scores": qkv.masked_softmax_backward(weights, d_weights, case.lens.value)}


@pytest.mark.parametrize("index", CASES)
def test_masked_softmax(index, rng):
    case = softmax_case(rng, index, dtype_of(index))
    numpy_layouts(rng, case, ["scores"])
    check_peer(qkv_masked_softmax, d2l_softmax_formula, case)


@pytest.mark.parametrize("index", CASES)
def test_masked_softmax_backward(index, rng):
    case = softmax_case(rng, index, dtype_of(index))
    case.add_input("weights", d2l_softmax_formula(case)["weights"].value)
    numpy_layouts(rng, case, ["weights", "d_weights"])
    check_peer(qkv_masked_softmax_backward, lambda c: d2l_softmax_formula(c, backward=True), case)


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
                desc, ("row", "k"))

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
                desc, ("row", "k"), scale=softmax_grad_scale(weights, d_weights))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_masked_softmax_counts_scores_below_sentinel(dtype):
    """Valid scores of -3e6 still count (d2l's -1e6 sentinel would outweigh them)."""
    scores = np.array([[[-3e6, -3e6 + 2.0, 5.0]]], dtype=NP_DTYPE[dtype])
    e2 = math.exp(2.0)
    expect = np.array([[[1.0 / (1.0 + e2), e2 / (1.0 + e2), 0.0]]])
    got = qkv.masked_softmax(scores, np.array([2]))
    check_close("weights", got, expect, dtype, "scores [-3e6, -3e6 + 2, 5], L = 2",
                ("b", "q", "k"))


# ---- scaled dot-product and additive attention ----------------------------------------

def numpy_inputs(case):
    """The case's queries, keys (NaN where no query may look, when the case
    says so) and values, and additive attention's W_q, W_k, w_v, as qkv's
    NumPy API gets them."""
    inputs = [as_numpy(case, case.inputs["queries"], "queries"),
              as_numpy(case, keys_for_qkv(case), "keys"),
              as_numpy(case, case.inputs["values"], "values")]
    if case.options["op"] == "additive":
        inputs += [as_numpy(case, case.inputs[n], n) for n in ("W_q", "W_k", "w_v")]
    return inputs


def qkv_attention(case, want_weights=False, want_lse=False):
    """The case through qkv's NumPy forward of its op, asking for the weights
    and the lse as told: {"output"[, "weights"][, "lse"]}."""
    flags = dict(return_weights=want_weights, return_lse=want_lse)
    if case.options["op"] == "dot":
        result = qkv.scaled_dot_product_attention(*numpy_inputs(case), case.lens.value,
                                                  scale=case.options["scale"], **flags)
    else:
        result = qkv.additive_attention(*numpy_inputs(case), case.lens.value, **flags)
    names = ["output"] + ["weights"] * want_weights + ["lse"] * want_lse
    if len(names) > 1:
        assert isinstance(result, tuple) and len(result) == len(names), case.desc()
        return dict(zip(names, result))
    assert isinstance(result, np.ndarray), f"expected one array; {case.desc()}"
    return {"output": result}


def qkv_attention_backward(case):
    """qkv's NumPy backward of the case's op, given the saved forward
    (inputs["output"], inputs["lse"]) and the case's d_output."""
    saved = [as_numpy(case, case.inputs[n], n) for n in ("output", "lse")]
    saved.append(as_numpy(case, case.d_output, "d_output"))
    if case.options["op"] == "dot":
        grads = qkv.scaled_dot_product_attention_backward(*numpy_inputs(case), *saved,
                                                          case.lens.value,
                                                          scale=case.options["scale"])
    else:
        grads = qkv.additive_attention_backward(*numpy_inputs(case), *saved, case.lens.value)
    return dict(zip(grads._fields, grads))


@pytest.mark.parametrize("op", ["dot", "additive"])
@pytest.mark.parametrize("index", CASES)
def test_attention_forward(op, index, rng):
    case = attention_case(op, index, rng, dtype_of(index))
    numpy_layouts(rng, case, ["queries", "keys", "values"])
    # The index cycles what is asked for: output only, + weights, + lse, + both.
    want_weights, want_lse = bool(index & 4), bool(index & 8)
    case.notes.append(f"weights {want_weights} lse {want_lse}")
    check_peer(lambda c: qkv_attention(c, want_weights, want_lse), d2l_formula, case)


def saved_forward(case, rng, rows=None):
    """d2l's output and exact lse as the backward's saved forward (zero output
    on the queries outside `rows`), and a d_output of the output's shape."""
    ref = d2l_formula(case)
    output = ref["output"].value.numpy()
    if rows is not None:
        output = np.where(rows[..., None], output, 0.0)
    case.add_input("output", output)
    case.add_input("lse", ref["lse"].value)
    case.d_output = case.add_input("d_output", rng.normal(size=output.shape))


@pytest.mark.parametrize("op", ["dot", "additive"])
@pytest.mark.parametrize("index", CASES)
def test_attention_backward(op, index, rng):
    case = attention_case(op, index, rng, dtype_of(index))
    saved_forward(case, rng)
    numpy_layouts(rng, case, ["queries", "keys", "values", "output", "lse", "d_output"])
    check_peer(qkv_attention_backward, lambda c: d2l_formula(c, d_output=c.d_output), case)


@pytest.mark.parametrize("op", ["dot", "additive"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("form", ["B/int32", "BNq/int64"])
def test_attention_zero_length(op, dtype, form, rng):
    """L = 0: d2l's sentinel makes the query's output the mean of all values;
    qkv's is zero (an empty sum), its weights zero, its lse -inf, its gradient
    zero and it adds nothing to the keys' and values' gradients. Queries with
    L >= 1 agree with d2l."""
    case = zero_length_case(op, dtype, rng, ZERO_LENGTH_LENS[form])
    live = case.lens.rows > 0
    desc = case.desc()
    ref = d2l_formula(case)
    mean = case.inputs["values"].mean(axis=1, keepdims=True).repeat(4, axis=1)
    assert np.allclose(ref["output"].value.numpy()[~live], mean[~live], atol=1e-5), \
        "d2l averages all values"

    got = check_peer(lambda c: qkv_attention(c, want_weights=True, want_lse=True),
                     lambda c: d2l_formula(c, rows=live), case)
    output, weights, lse = got["output"], got["weights"], got["lse"]
    for b, i in np.argwhere(~live):
        assert np.all(output[b, i] == 0) and np.all(weights[b, i] == 0), (
            f"L = 0 must give zero output and weights: b={b} q={i} output {output[b, i]}, "
            f"weights {weights[b, i]}; {desc}")
        assert np.isneginf(lse[b, i]), f"L = 0 must give lse = -inf: b={b} q={i} got {lse[b, i]}"

    # Backward: with d_output zero on the L = 0 queries, d2l's gradients are
    # what qkv's must be for any d_output (those queries are constant zeros).
    saved_forward(case, rng, rows=live)
    d_output_live = np.where(live[..., None], case.d_output, 0.0)
    grads = check_peer(qkv_attention_backward,
                       lambda c: d2l_formula(c, rows=live, d_output=d_output_live), case)
    for b, i in np.argwhere(~live):
        assert np.all(grads["d_queries"][b, i] == 0), (
            f"L = 0 query b={b} q={i} must get a zero gradient, got {grads['d_queries'][b, i]}")
