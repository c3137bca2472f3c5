"""Peer test: a float attn_mask (an additive bias) against PyTorch, as a list of cases.

The peer is torch 2.x's documented math (torch_formulas.sdpa_math) in float64
on the same values: scores Q K^T * scale + attn_mask (broadcast against
(B, H, Nq, Nk) as torch broadcasts it; -inf leaves a key out), -inf where
is_causal leaves a key out, softmax, times V; autograd of that for the
gradients of query, key, value and the bias itself (summed by autograd over
the axes the bias broadcasts along). Fresh random cases
(peer_harness.mask_peer_sizes): biases N(0, 2) with a tenth of the entries
-inf (key 0 always finite, so torch's math has no NaN rows) in every
broadcast form ((Nq, Nk), (B, 1, Nq, Nk), (1, H, 1, Nk), (B, H, Nq, Nk),
(B, 1, Nq, 1); 3-D inputs' (B, Nq, Nk)), heads grouped or not, Nq from 1 to
300, Nk up to 500, with is_causal and dropout-free; float32, float64 and bf16
through qkv.torch, and the NumPy API's bias= and d_bias. Each row of PEERS is
drawn, run and compared by peer_harness (the one rule:
d2l_reference.check_close). Then gradcheck in float64 for the bias, and the
errors.
"""

import numpy as np
import pytest
import torch

import qkv
import qkv.torch
from peer_harness import (  # first: puts tests/peer (d2l_reference) on sys.path
    BF16_BIAS_GRADIENT_TOLERANCE,
    Peer,
    check_close,
    draw_case,
    mask_peer_sizes,
    peer_params,
    run_peer,
    torch_formula,
    torch_inputs,
    with_gradients,
)
from torch_formulas import randn, sdpa_math

NUM_CASES = 100
NAMES = ("queries", "keys", "values")


def bias_shape(rng, sizes):
    batch, nq, nk = sizes["B"], sizes["Nq"], sizes["Nk"]
    if "H" not in sizes:
        return [(nq, nk), (batch, nq, nk), (1, nq, nk), (batch, nq, 1)][int(rng.integers(4))]
    return [(nq, nk), (batch, 1, nq, nk), (1, sizes["H"], 1, nk), (batch, sizes["H"], nq, nk),
            (batch, 1, nq, 1)][int(rng.integers(5))]


def bias_case(rng, index, dtype, causal_share=0.3):
    """mask_peer_sizes and a bias N(0, 2) with a tenth -inf, key 0 finite, in
    inputs["bias"]; is_causal `causal_share` of the time."""
    sizes = mask_peer_sizes(rng)
    shape = bias_shape(rng, sizes)
    bias = 2.0 * rng.standard_normal(shape)
    bias[rng.random(shape) < 0.1] = -np.inf
    bias[..., 0] = 2.0 * rng.standard_normal(bias[..., 0].shape)
    causal = bool(rng.random() < causal_share)
    case = draw_case(rng, index, dtype, sizes, causal=causal)
    case.add_input("bias", bias)
    case.notes += [f"bias {list(shape)}", f"causal {causal}"]
    return case


def qkv_attn_mask(case):
    """qkv.torch with the bias as attn_mask, and the gradients of query, key,
    value and bias (bf16: of the bias alone)."""
    names = ("bias",) if case.dtype == "bfloat16" else NAMES + ("bias",)
    inputs = torch_inputs(case, NAMES + ("bias",))
    output = qkv.torch.scaled_dot_product_attention(
        *(inputs[n] for n in NAMES), attn_mask=inputs["bias"], is_causal=case.options["causal"],
        enable_gqa=True)
    return with_gradients({"output": output}, output, {n: inputs[n] for n in names},
                          case.d_output)


def torch_bias(case):
    """bf16: the gradient of the bias (in the bias's dtype) within
    BF16_BIAS_GRADIENT_TOLERANCE of max(max|ref|, 1)."""
    diagonal = 0 if case.options["causal"] else None
    if case.dtype == "bfloat16":
        return torch_formula(lambda c, queries, keys, values, bias: sdpa_math(
            queries, keys, values, bias=bias, diagonal=diagonal), case, names=("bias",),
            grad_tolerance=BF16_BIAS_GRADIENT_TOLERANCE)
    return torch_formula(lambda c, queries, keys, values, bias: sdpa_math(
        queries, keys, values, bias=bias, diagonal=diagonal), case, names=NAMES + ("bias",))


def qkv_numpy_bias(case):
    """The NumPy API's bias= forward and backward (the four gradients, d_bias
    shaped like the bias); with bias_grad=False the three-field tuple of the
    same gradients."""
    q, k, v, bias = (case.inputs[n].astype(case.dtype) for n in NAMES + ("bias",))
    output, lse = qkv.scaled_dot_product_attention(q, k, v, bias=bias, return_lse=True)
    g = case.d_output.astype(case.dtype)
    grads = qkv.scaled_dot_product_attention_backward(q, k, v, output, lse, g, bias=bias)
    assert isinstance(grads, qkv.ScaledDotProductAttentionBiasGrads)
    plain = qkv.scaled_dot_product_attention_backward(q, k, v, output, lse, g, bias=bias,
                                                      bias_grad=False)
    assert type(plain) is qkv.ScaledDotProductAttentionGrads
    for a, b in zip(plain, grads):
        np.testing.assert_array_equal(a, b)
    return {"output": output, **dict(zip(grads._fields, grads))}


PEERS = [
    Peer("attn_mask", bias_case, qkv_attn_mask, torch_bias, ("float32", "float64"), NUM_CASES),
    # bf16: no is_causal; the output and the gradient of the bf16 bias.
    Peer("attn_mask", lambda rng, i, dtype: bias_case(rng, i, dtype, causal_share=0.0),
         qkv_attn_mask, torch_bias, ("bfloat16",), NUM_CASES // 2),
    Peer("bias (NumPy)", lambda rng, i, dtype: bias_case(rng, i, dtype, causal_share=0.0),
         qkv_numpy_bias, torch_bias, ("float32", "float64"), NUM_CASES // 2),
]


@pytest.mark.parametrize("peer, dtype", peer_params(PEERS))
def test_bias_matches_torch_math(peer, dtype, seed):
    run_peer(peer, dtype, seed)


def test_bias_constant_along_the_keys_changes_nothing_and_has_gradient_zero(seed):
    rng = np.random.default_rng(seed)
    q, k, v = (randn(rng, s, torch.float64, requires_grad=True) for s in
               ((2, 3, 9, 8), (2, 3, 11, 8), (2, 3, 11, 5)))
    row_bias = randn(rng, (2, 3, 9, 1), torch.float64, requires_grad=True)
    out = qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=row_bias)
    plain = qkv.torch.scaled_dot_product_attention(q, k, v)
    check_close("output with a bias constant along the keys", out, plain, "float64",
                tolerance=1e-15)
    (d_bias,) = torch.autograd.grad(out, (row_bias,), torch.ones_like(out))
    assert not d_bias.any()


def test_bias_gradcheck_float64(seed):
    rng = np.random.default_rng(seed)
    q, k, v = (randn(rng, s, torch.float64) for s in ((2, 4, 5, 6), (2, 2, 7, 6), (2, 2, 7, 3)))
    for shape in ((5, 7), (2, 1, 5, 7), (1, 4, 1, 7), (2, 4, 5, 7)):
        bias = randn(rng, shape, torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(
            lambda b: qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=b,
                                                             is_causal=True, enable_gqa=True),
            (bias,)), shape


def test_bias_with_bool_semantics_of_minus_inf():
    """-inf in the bias leaves the key out exactly, as a False in a bool mask."""
    q, k, v = (torch.randn(2, 3, n, 4, dtype=torch.float64) for n in (6, 8, 8))
    keep = torch.rand(6, 8) < 0.5
    keep[:, 0] = True
    bias = torch.zeros(6, 8, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    a = qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    b = qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    check_close("output with a -inf bias", a, b, "float64", tolerance=1e-15)


def test_numpy_bias_errors_name_the_function_the_bias_and_both_types_or_shapes():
    """A bias of the wrong float type, a non-float bias and one that does not
    broadcast against the scores: clear errors before anything is computed,
    forward and backward, float32, float64 and bf16 inputs."""
    rng = np.random.default_rng(7)
    q32, k32, v32 = (rng.standard_normal((2, 3, 4, 8)).astype(np.float32) for _ in range(3))
    q64, k64, v64 = (x.astype(np.float64) for x in (q32, k32, v32))
    out, lse = qkv.scaled_dot_product_attention(q32, k32, v32, return_lse=True)
    good = np.zeros((4, 4), np.float32)
    cases = [
        # (call, error type, message fragments)
        (lambda: qkv.scaled_dot_product_attention(q32, k32, v32, bias=good.astype(np.float64)),
         TypeError, ["scaled_dot_product_attention", "bias has dtype float64",
                     "the inputs (float32 for bf16 inputs) has float32"]),
        (lambda: qkv.scaled_dot_product_attention(q64, k64, v64, bias=good),
         TypeError, ["scaled_dot_product_attention", "bias has dtype float32",
                     "the inputs has float64"]),
        (lambda: qkv.scaled_dot_product_attention(q32, k32, v32, bias=good.astype(np.int32)),
         TypeError, ["scaled_dot_product_attention", "bias"]),
        (lambda: qkv.scaled_dot_product_attention_backward(
            q32, k32, v32, out, lse, out, bias=good.astype(np.float64)),
         TypeError, ["scaled_dot_product_attention_backward", "bias has dtype float64"]),
        (lambda: qkv.scaled_dot_product_attention(q32, k32, v32, bias=np.zeros((3, 4), np.float32)),
         qkv.Error, ["scaled_dot_product_attention", "bias has shape [3, 4]", "[2, 3, 4, 4]"]),
        (lambda: qkv.scaled_dot_product_attention_backward(
            q32, k32, v32, out, lse, out, bias=np.zeros((2, 2, 4, 4), np.float32)),
         qkv.Error, ["scaled_dot_product_attention_backward", "bias has shape [2, 2, 4, 4]"]),
    ]
    bits = q32.view(np.int32).astype(np.int16)  # any int16 array serves as bf16 bits here
    # qkv.torch's bf16 path (its private entry point: qkv.torch converts a float
    # attn_mask to float32 before it gets here).
    cases.append((lambda: qkv._qkv._scaled_dot_product_attention_bf16(
        bits, bits, bits, None, None, 0.0, 0, False, False, None, None, None, None,
        good.astype(np.float64)),
        TypeError, ["bias has dtype float64", "float32 for bf16 inputs"]))
    for number, (call, error, fragments) in enumerate(cases):
        with pytest.raises(error) as caught:
            call()
        for fragment in fragments:
            assert fragment in str(caught.value), f"case {number}: {caught.value}"
