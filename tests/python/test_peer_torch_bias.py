"""Peer test: a float attn_mask (an additive bias) against PyTorch.

Debian's torch 1.13 has no scaled_dot_product_attention, so the peer is torch
2.x's documented math written in torch, in float64: scores Q K^T * scale +
attn_mask (broadcast against (B, H, Nq, Nk) as torch broadcasts it; -inf
leaves a key out), -inf where is_causal or a boolean mask leaves a key out,
softmax, times V; autograd of that for the gradients of query, key, value and
the bias itself (summed by autograd over the axes the bias broadcasts along).
Fresh random cases: biases N(0, 2) with a tenth of the entries -inf (key 0
always finite, so torch's math has no NaN rows) in every broadcast form
((Nq, Nk), (B, 1, Nq, Nk), (1, H, 1, Nk), (B, H, Nq, Nk), (B, 1, Nq, 1);
3-D inputs' (B, Nq, Nk)), heads grouped or not, Nq from 1 to 300, Nk up to
500, with is_causal and dropout-free; float32, float64 and bf16 through
qkv.torch, and the NumPy API's bias= and d_bias. gradcheck in float64 for
the bias.

Tolerances as test_peer_torch_masks.py: 1e-5 (float32) and 1e-12 (float64)
of max|ref|, gradients 10x that with a floor of 1.
"""

import math

import numpy as np
import pytest
import torch

import qkv
import qkv.torch
from torch_formulas import heads_shapes, randn, random_heads_case, relative_error

NUM_CASES = 100
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def biased_math(q, k, v, bias, causal=False):
    """torch 2.x's math with an additive bias, key heads repeat_interleave'd to
    the query heads; q's dtype."""
    if q.dim() == 4 and q.shape[1] != k.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + bias
    if causal:
        nq, nk = scores.shape[-2:]
        keep = torch.ones(nq, nk, dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def bias_shape(rng, three_d, batch, heads, nq, nk):
    if three_d:
        return [(nq, nk), (batch, nq, nk), (1, nq, nk), (batch, nq, 1)][int(rng.integers(4))]
    return [(nq, nk), (batch, 1, nq, nk), (1, heads, 1, nk), (batch, heads, nq, nk),
            (batch, 1, nq, 1)][int(rng.integers(5))]


def random_bias(rng, shape, dtype):
    """N(0, 2) with a tenth -inf, key 0 finite."""
    values = 2.0 * rng.standard_normal(shape)
    values[rng.random(shape) < 0.1] = -np.inf
    values[..., 0] = 2.0 * rng.standard_normal(values[..., 0].shape)
    return torch.from_numpy(values).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float_attn_mask_matches_torch_math_forward_and_backward(dtype, seed):
    rng = np.random.default_rng(seed)
    for case in range(NUM_CASES):
        three_d, batch, heads, kv_heads, nq, nk, dim, dv = c = random_heads_case(rng)
        q, k, v = (randn(rng, s, dtype, requires_grad=True) for s in heads_shapes(*c))
        bias = random_bias(rng, bias_shape(rng, three_d, batch, heads, nq, nk), dtype)
        bias.requires_grad_()
        causal = bool(rng.random() < 0.3)
        got = qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal,
                                                     enable_gqa=True)
        qd, kd, vd, bd = (t.detach().double().requires_grad_() for t in (q, k, v, bias))
        want = biased_math(qd, kd, vd, bd, causal)
        what = (f"case {case}: 3-D {three_d} B {batch} H {heads} Hkv {kv_heads} Nq {nq} Nk {nk} "
                f"D {dim} Dv {dv} bias {list(bias.shape)} causal {causal}")
        assert relative_error(got, want) <= TOL[dtype], what
        g = randn(rng, got.shape, dtype)
        grads = torch.autograd.grad(got, (q, k, v, bias), g)
        want_grads = torch.autograd.grad(want, (qd, kd, vd, bd), g.double())
        for name, a, b in zip(("d_query", "d_key", "d_value", "d_bias"), grads, want_grads):
            assert a.shape == b.shape, f"{what}: {name}"
            assert relative_error(a, b, floor=1.0) <= 10 * TOL[dtype], f"{what}: {name}"


def test_float_attn_mask_bf16_matches_the_float64_math(seed):
    rng = np.random.default_rng(seed)
    for case in range(NUM_CASES // 2):
        three_d, batch, heads, kv_heads, nq, nk, dim, dv = c = random_heads_case(rng)
        q, k, v = (randn(rng, s, torch.float32).bfloat16().requires_grad_()
                   for s in heads_shapes(*c))
        bias = random_bias(rng, bias_shape(rng, three_d, batch, heads, nq, nk), torch.bfloat16)
        bias.requires_grad_()
        got = qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
        assert got.dtype == torch.bfloat16
        bd = bias.detach().double().requires_grad_()
        want = biased_math(q.detach().double(), k.detach().double(), v.detach().double(), bd)
        bound = 4e-3 * v.double().abs().max() + 2.0 ** -8 * want.abs()
        assert bool(((got.double() - want).abs() <= bound).all()), f"case {case}"
        # The bias gradient in the bias's dtype, within bf16 rounding of its terms' size.
        g = randn(rng, got.shape, torch.float32).bfloat16()
        (d_bias,) = torch.autograd.grad(got, (bias,), g)
        (want_bias,) = torch.autograd.grad(want, (bd,), g.double())
        assert d_bias.dtype == torch.bfloat16 and d_bias.shape == bias.shape
        assert relative_error(d_bias, want_bias, floor=1.0) <= 5e-2, f"case {case}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_bias_and_its_gradient_match_torch_math(dtype, seed):
    rng = np.random.default_rng(seed)
    tdtype = torch.float32 if dtype == np.float32 else torch.float64
    for case in range(NUM_CASES // 2):
        three_d, batch, heads, kv_heads, nq, nk, dim, dv = c = random_heads_case(rng)
        q, k, v = (rng.standard_normal(s).astype(dtype) for s in heads_shapes(*c))
        bias = random_bias(rng, bias_shape(rng, three_d, batch, heads, nq, nk), tdtype).numpy()
        out, lse = qkv.scaled_dot_product_attention(q, k, v, bias=bias, return_lse=True)
        qd, kd, vd, bd = (torch.from_numpy(x).double().requires_grad_() for x in (q, k, v, bias))
        want = biased_math(qd, kd, vd, bd)
        what = f"case {case}: {c} bias {bias.shape}"
        assert relative_error(torch.from_numpy(out), want) <= TOL[tdtype], what
        g = rng.standard_normal(out.shape).astype(dtype)
        grads = qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, g, bias=bias)
        assert isinstance(grads, qkv.ScaledDotProductAttentionBiasGrads)
        want_grads = torch.autograd.grad(want, (qd, kd, vd, bd), torch.from_numpy(g).double())
        for name, a, b in zip(grads._fields, grads, want_grads):
            assert a.shape == tuple(b.shape) and a.dtype == dtype, f"{what}: {name}"
            assert relative_error(torch.from_numpy(a), b, floor=1.0) <= 10 * TOL[tdtype], \
                f"{what}: {name}"
        # bias_grad=False: the three-field tuple, the same gradients.
        plain = qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, g, bias=bias,
                                                          bias_grad=False)
        assert type(plain) is qkv.ScaledDotProductAttentionGrads
        for a, b in zip(plain, grads):
            np.testing.assert_array_equal(a, b)


def test_bias_constant_along_the_keys_changes_nothing_and_has_gradient_zero(seed):
    rng = np.random.default_rng(seed)
    q, k, v = (randn(rng, s, torch.float64, requires_grad=True) for s in
               ((2, 3, 9, 8), (2, 3, 11, 8), (2, 3, 11, 5)))
    row_bias = randn(rng, (2, 3, 9, 1), torch.float64, requires_grad=True)
    out = qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=row_bias)
    plain = qkv.torch.scaled_dot_product_attention(q, k, v)
    assert relative_error(out, plain) <= 1e-15
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
    assert relative_error(a, b) <= 1e-15


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
