"""Peer test: boolean masks, key masks and sliding windows against PyTorch.

Debian's torch 1.13 has no scaled_dot_product_attention, so the peer is torch
2.x's documented math written in torch, in float64: scores Q K^T * scale,
masked_fill(-inf) where the boolean attn_mask is False (broadcast against
(B, H, Nq, Nk) as torch broadcasts it) and where a key mask, a window or
is_causal leaves a key out, softmax, times V; autograd of that for the
gradients. Fresh random cases: masks of half the keys in every broadcast form
((Nq, Nk), (B, 1, Nq, Nk), (1, H, 1, Nk), (B, H, Nq, Nk), and 3-D inputs'
(B, Nq, Nk)), heads grouped or not, Nq from 1 to 300, Nk up to 500,
combined with is_causal, through qkv.torch's attn_mask (float32, float64,
bf16) and through the NumPy API's mask, key_mask and window. Every query
keeps key 0 or its diagonal, so torch's math has no NaN rows; a query left
with no key (torch: NaN, qkv: 0) is checked on its own.

Tolerances as test_peer_torch_causal.py: 1e-5 (float32) and 1e-12 (float64)
of max|ref|, gradients 10x that with a floor of 1; bf16 output within
4e-3 max|v| + 2^-8 |out|.
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


def masked_math(q, k, v, keep):
    """torch 2.x's math with a boolean keep (broadcast against the scores) and
    key heads repeat_interleave'd to the query heads; q's dtype."""
    if q.dim() == 4 and q.shape[1] != k.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def random_mask(rng, three_d, batch, heads, nq, nk):
    """A bool mask of a random broadcast form, half True, with key 0 kept for
    every query (so no row of torch's math is all -inf)."""
    if three_d:
        shape = [(nq, nk), (batch, nq, nk), (1, nq, nk)][int(rng.integers(3))]
    else:
        shape = [(nq, nk), (batch, 1, nq, nk), (1, heads, 1, nk),
                 (batch, heads, nq, nk)][int(rng.integers(4))]
    keep = torch.from_numpy(rng.random(shape) < 0.5)
    keep[..., 0] = True
    return keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attn_mask_matches_torch_math_forward_and_backward(dtype, seed):
    rng = np.random.default_rng(seed)
    for case in range(NUM_CASES):
        three_d, batch, heads, kv_heads, nq, nk, dim, dv = c = random_heads_case(rng)
        q, k, v = (randn(rng, s, dtype, requires_grad=True) for s in heads_shapes(*c))
        keep = random_mask(rng, three_d, batch, heads, nq, nk)
        causal = bool(rng.random() < 0.3)
        got = qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=causal,
                                                     enable_gqa=True)
        full = keep & torch.ones(nq, nk, dtype=torch.bool).tril() if causal else keep
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        want = masked_math(qd, kd, vd, full)
        what = (f"case {case}: 3-D {three_d} B {batch} H {heads} Hkv {kv_heads} Nq {nq} Nk {nk} "
                f"D {dim} Dv {dv} mask {list(keep.shape)} causal {causal}")
        assert relative_error(got, want) <= TOL[dtype], what
        g = randn(rng, got.shape, dtype)
        grads = torch.autograd.grad(got, (q, k, v), g)
        want_grads = torch.autograd.grad(want, (qd, kd, vd), g.double())
        for name, a, b in zip(("d_query", "d_key", "d_value"), grads, want_grads):
            assert relative_error(a, b, floor=1.0) <= 10 * TOL[dtype], f"{what}: {name}"


def test_attn_mask_bf16_matches_the_float64_math(seed):
    rng = np.random.default_rng(seed)
    for case in range(NUM_CASES // 2):
        three_d, batch, heads, kv_heads, nq, nk, dim, dv = c = random_heads_case(rng)
        q, k, v = (randn(rng, s, torch.float32).bfloat16() for s in heads_shapes(*c))
        keep = random_mask(rng, three_d, batch, heads, nq, nk)
        got = qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
        assert got.dtype == torch.bfloat16
        want = masked_math(q.double(), k.double(), v.double(), keep)
        bound = 4e-3 * v.double().abs().max() + 2.0 ** -8 * want.abs()
        assert bool(((got.double() - want).abs() <= bound).all()), f"case {case}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_key_mask_and_window_match_torch_math(dtype, seed):
    """The NumPy API's key_mask (B, Nk) and window (left, right), aligned at
    the bottom right (FlashAttention's window_size), with a mask on top,
    forward and backward. Each query's diagonal key j = i + Nk - Nq is kept
    by all three; where that is before key 0 a query may be left with no
    key (torch: NaN rows, compared apart: qkv gives 0)."""
    rng = np.random.default_rng(seed)
    for case in range(NUM_CASES):
        three_d, batch, heads, kv_heads, nq, nk, dim, dv = c = random_heads_case(rng)
        q, k, v = (rng.standard_normal(s).astype(dtype) for s in heads_shapes(*c))
        left, right = int(rng.integers(-1, 100)), int(rng.integers(-1, 10))
        diagonal = np.arange(nq) + nk - nq
        inside = (diagonal >= 0) & (diagonal < nk)
        keys = rng.random((batch, nk)) < 0.7
        keys[:, diagonal[inside]] = True
        mask = rng.random((batch, nq, nk) if three_d else (batch, 1, nq, nk)) < 0.6
        mask[..., np.arange(nq)[inside], diagonal[inside]] = True
        jj = np.arange(nk)[None, :]
        window = (((jj >= diagonal[:, None] - left) | (left < 0)) &
                  ((jj <= diagonal[:, None] + right) | (right < 0)))
        keys_b = keys[:, None, :] if three_d else keys[:, None, None, :]
        keep = torch.from_numpy(window & keys_b & mask)
        out, lse = qkv.scaled_dot_product_attention(q, k, v, mask=mask, key_mask=keys,
                                                    window=(left, right), return_lse=True)
        leaves = [torch.from_numpy(x).double().requires_grad_() for x in (q, k, v)]
        want = masked_math(*leaves, keep)
        what = f"case {case}: 3-D {three_d} B {batch} Nq {nq} Nk {nk} window ({left}, {right})"
        tol = TOL[torch.float32 if dtype == np.float32 else torch.float64]
        rows = keep.any(dim=-1)  # queries left with a key
        rows = rows.expand(want.shape[:-1]) if rows.shape != want.shape[:-1] else rows
        assert relative_error(torch.from_numpy(out)[rows], want.detach()[rows]) <= tol, what
        assert not out[~rows.numpy()].any(), what
        assert np.all(lse[~rows.numpy()] == -np.inf), what
        # Gradients of a functional over the rows that have keys: d_output is
        # 0 on the others, where torch's math gets key 0 back so it has no NaN
        # to differentiate (those rows then add nothing).
        g = rng.standard_normal(out.shape).astype(dtype) * rows.numpy()[..., None]
        grads = qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, g, mask=mask,
                                                          key_mask=keys, window=(left, right))
        first = torch.zeros(nk, dtype=torch.bool)
        first[0] = True
        want = masked_math(*leaves, keep | (~rows[..., None] & first))
        want_grads = torch.autograd.grad(want, leaves, torch.from_numpy(g).double())
        for name, a, b in zip(grads._fields, grads, want_grads):
            assert relative_error(torch.from_numpy(a), b, floor=1.0) <= 10 * tol, f"{what}: {name}"


def test_no_key_left_gives_zeros_with_zero_gradients(seed):
    """A query whose mask is all False: output 0, lse -inf, gradients 0
    (torch's math gives NaN)."""
    rng = np.random.default_rng(seed)
    q, k, v = (randn(rng, s, torch.float64, requires_grad=True) for s in
               ((2, 2, 4, 8), (2, 2, 6, 8), (2, 2, 6, 5)))
    keep = torch.from_numpy(rng.random((4, 6)) < 0.5)
    keep[:, 0] = True
    keep[2] = False
    out = qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    assert not out[:, :, 2].any()
    assert torch.isnan(masked_math(q.detach(), k.detach(), v.detach(), keep)[:, :, 2]).all()
    g = torch.zeros_like(out)
    g[:, :, 2] = 1.0
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    assert not dq.any() and not dk.any() and not dv.any()
