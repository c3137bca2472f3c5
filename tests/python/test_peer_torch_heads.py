"""Peer test: attention heads and grouped-query attention against PyTorch.

Debian's torch 1.13 has no scaled_dot_product_attention, so the peer is torch
2.x's documented math written in torch, in float64: with enable_gqa, key and
value heads repeat_interleave'd to the query heads (query head h reads key
head h // (H // Hkv)); scores Q K^T * scale; is_causal's mask
torch.ones(Nq, Nk).tril(diagonal) and d2l's valid lengths (shared by the
heads) filled with -inf; softmax; times V; autograd of that for the
gradients of a random linear functional. Fresh random cases: B, H, Hkv with
H / Hkv in 1..8, Nq and Nk from 1 to 300, D and Dv from 1 to 64, lengths
none, (B) or (B, Nq), causal off, top-left and (NumPy API) bottom-right,
layouts contiguous, (B, N, H, D) memory transposed to (B, H, N, D) as one
fused projection leaves it, one head slice of a wider tensor, and D strided
(which the library copies); float32, float64 and bfloat16.

Dropout has no torch peer (torch draws its own mask), so a 4-D call with
dropout must equal the 3-D call on the heads folded into the batch, bit for
bit (the definition: docs/semantics.md, "Heads").

Tolerances as test_peer_torch_causal.py: max|got - ref| / max|ref| <= 1e-5
(float32), 1e-12 (float64); gradients 10x that with a floor of 1; bf16 output
within 4e-3 max|v| + 2^-8 |out|, bf16 gradients within 2e-2 of the size of
their terms (d2l_reference's sdpa_grad_scales, times H / Hkv for the key
heads' sums).
"""

import math

import numpy as np
import pytest
import torch

import qkv
import qkv.torch
from torch_formulas import randn, relative_error  # first: puts tests/peer on sys.path
from d2l_reference import sdpa_grad_scales  # noqa: E402

NUM_CASES = 100
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
GROUPS = [(1, 1), (2, 2), (4, 2), (6, 3), (8, 2), (8, 1), (3, 1), (5, 5)]
LAYOUTS = ["contiguous", "token-major", "head slice", "D strided"]


def torch_heads_reference(q, k, v, diagonal=None, valid_lens=None):
    """torch 2.x's math with enable_gqa, a causal tril(diagonal) mask (None:
    no mask) and d2l's (B) or (B, Nq) lengths; fully masked rows are NaN."""
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=-3)
        v = v.repeat_interleave(heads // kv_heads, dim=-3)
    nq, nk = q.shape[-2], k.shape[-2]
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    keep = torch.ones(nq, nk, dtype=torch.bool)
    if diagonal is not None:
        keep = keep.tril(diagonal)
    if valid_lens is not None:
        lens = valid_lens if valid_lens.dim() == 2 else valid_lens[:, None].expand(-1, nq)
        keep = keep & (torch.arange(nk) < lens[:, None, :, None])  # (B, 1, Nq, Nk)
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def random_case(rng):
    heads, kv_heads = GROUPS[int(rng.integers(len(GROUPS)))]
    batch = int(rng.integers(1, 4))
    nq = int(rng.choice([1, 2, 4, 7, 33, 300]))
    nk = int(rng.choice([1, 5, 31, 300]))
    dim = int(rng.choice([1, 4, 17, 64]))
    dv = int(rng.choice([1, 3, 24, 64]))
    return batch, heads, kv_heads, nq, nk, dim, dv


def layout_base(rng, shape, dtype, layout):
    """The memory a (B, H, N, D) tensor of `layout` is a view of (laid_out_view)."""
    b, h, n, d = shape
    return randn(rng, {"contiguous": (b, h, n, d), "token-major": (b, n, h, d),
                       "head slice": (b, n, 3 * h, d), "D strided": (b, h, d, n)}[layout], dtype)


def laid_out_view(base, layout, shape):
    """The (B, H, N, D) view of `layout` over a layout_base: contiguous; (B, N,
    H, D) memory transposed; the middle H of 3 H heads (rows 3 H D apart); D
    strided (which the library copies)."""
    h = shape[1]
    if layout == "contiguous":
        return base
    if layout == "token-major":
        return base.transpose(1, 2)
    if layout == "head slice":
        return base[:, :, h:2 * h].transpose(1, 2)
    return base.transpose(2, 3)


def lens_for(rng, batch, nq, nk):
    """None, or (B) / (B, Nq) lengths in [1, Nk], shared by the heads."""
    if rng.random() < 0.4:
        return None
    shape = (batch,) if rng.random() < 0.5 else (batch, nq)
    return torch.from_numpy(rng.integers(1, nk + 1, size=shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_heads_match_torch_math_forward_and_backward(dtype, seed):
    rng = np.random.default_rng(seed)
    for case in range(NUM_CASES):
        batch, heads, kv_heads, nq, nk, dim, dv = random_case(rng)
        layout = LAYOUTS[int(rng.integers(len(LAYOUTS)))]
        causal = bool(rng.random() < 0.4)
        lens = lens_for(rng, batch, nq, nk)
        shapes = ((batch, heads, nq, dim), (batch, kv_heads, nk, dim), (batch, kv_heads, nk, dv))
        q, k, v = (laid_out_view(layout_base(rng, s, dtype, layout).requires_grad_(), layout, s)
                   for s in shapes)
        got = qkv.torch.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                     enable_gqa=True, valid_lens=lens)
        assert got.shape == (batch, heads, nq, dv)
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        # With lengths >= 1 and the top-left diagonal 0 every query keeps key 0.
        want = torch_heads_reference(qd, kd, vd, 0 if causal else None, lens)
        what = (f"case {case}: B {batch} H {heads} Hkv {kv_heads} Nq {nq} Nk {nk} D {dim} "
                f"Dv {dv} {layout} causal {causal} lens {None if lens is None else lens.dim()}")
        assert relative_error(got, want) <= TOL[dtype], what
        g = randn(rng, got.shape, dtype)
        grads = torch.autograd.grad(got, (q, k, v), g)
        want_grads = torch.autograd.grad(want, (qd, kd, vd), g.double())
        for name, a, b in zip(("d_query", "d_key", "d_value"), grads, want_grads):
            assert a.shape == b.shape, f"{what}: {name}"
            assert relative_error(a, b, floor=1.0) <= 10 * TOL[dtype], f"{what}: {name}"


def test_heads_bf16_match_the_float64_math(seed):
    rng = np.random.default_rng(seed)
    for case in range(NUM_CASES):
        batch, heads, kv_heads, nq, nk, dim, dv = random_case(rng)
        layout = LAYOUTS[int(rng.integers(len(LAYOUTS)))]
        causal = bool(rng.random() < 0.4)
        shapes = ((batch, heads, nq, dim), (batch, kv_heads, nk, dim), (batch, kv_heads, nk, dv))
        q, k, v = (laid_out_view(layout_base(rng, s, torch.float32, layout).bfloat16()
                                 .requires_grad_(), layout, s) for s in shapes)
        got = qkv.torch.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        assert got.dtype == torch.bfloat16
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        want = torch_heads_reference(qd, kd, vd, 0 if causal else None)
        what = (f"case {case}: B {batch} H {heads} Hkv {kv_heads} Nq {nq} Nk {nk} D {dim} "
                f"Dv {dv} {layout} causal {causal}")
        err = (got.double() - want).abs()
        bound = 4e-3 * vd.detach().abs().max() + 2.0 ** -8 * want.detach().abs()
        assert bool((err <= bound).all()), what
        g = randn(rng, got.shape, torch.float32)
        grads = torch.autograd.grad(got, (q, k, v), g.bfloat16())
        want_grads = torch.autograd.grad(want, (qd, kd, vd), g.bfloat16().double())
        # The size of the terms each gradient sums, from the heads folded into
        # a batch with the key heads repeated; a key head sums H / Hkv of them.
        group = heads // kv_heads
        with torch.no_grad():
            scores = torch.matmul(qd, kd.repeat_interleave(group, dim=1).transpose(-1, -2))
            scores = scores / math.sqrt(dim)
            if causal:
                scores = scores.masked_fill(~torch.ones(nq, nk, dtype=torch.bool).tril(),
                                            float("-inf"))
            weights = torch.nan_to_num(torch.softmax(scores, dim=-1))

        def fold(t):
            return t.reshape(-1, *t.shape[-2:]).numpy()

        sizes = sdpa_grad_scales(fold(weights), fold(qd.detach()),
                                 fold(kd.detach().repeat_interleave(group, dim=1)),
                                 fold(vd.detach().repeat_interleave(group, dim=1)),
                                 fold(g.bfloat16().double()), 1 / math.sqrt(dim))
        for name, key, a, b in zip(("d_query", "d_key", "d_value"), "qkv", grads, want_grads):
            scale = max(float(b.abs().max()), sizes[key] * (group if key != "q" else 1), 1e-30)
            assert float((a.double() - b).abs().max()) <= 2e-2 * scale, f"{what}: {name}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_heads_negative_strides_and_bottom_right(dtype, seed):
    """The NumPy API with heads and batch reversed (negative strides, read in
    place) and causal='bottom-right' (diagonal Nk - Nq), against the math."""
    rng = np.random.default_rng(seed)
    for case in range(NUM_CASES // 2):
        batch, heads, kv_heads, nq, nk, dim, dv = random_case(rng)
        nq = min(nq, nk)  # every query keeps a key: no NaN rows in torch's math
        q, k, v = (rng.standard_normal(s).astype(dtype)[::-1, ::-1] for s in (
            (batch, heads, nq, dim), (batch, kv_heads, nk, dim), (batch, kv_heads, nk, dv)))
        assert q.strides[0] < 0 and q.strides[1] < 0
        out, lse = qkv.scaled_dot_product_attention(q, k, v, causal="bottom-right",
                                                    return_lse=True)
        qd, kd, vd = (torch.tensor(x.tolist(), dtype=torch.float64) for x in (q, k, v))
        want = torch_heads_reference(qd, kd, vd, nk - nq)
        what = f"case {case}: B {batch} H {heads} Hkv {kv_heads} Nq {nq} Nk {nk}"
        tol = TOL[torch.float32 if dtype == np.float32 else torch.float64]
        assert relative_error(torch.from_numpy(out), want) <= tol, what
        g = rng.standard_normal(out.shape).astype(dtype)
        grads = qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, g,
                                                          causal="bottom-right")
        leaves = [t.clone().requires_grad_() for t in (qd, kd, vd)]
        want_grads = torch.autograd.grad(torch_heads_reference(*leaves, nk - nq),
                                         leaves, torch.from_numpy(g).double())
        for name, a, b in zip(grads._fields, grads, want_grads):
            assert a.shape == tuple(b.shape), f"{what}: {name}"
            assert relative_error(torch.from_numpy(a), b, floor=1.0) <= 10 * tol, f"{what}: {name}"


def test_dropout_heads_are_the_batch_of_their_rows(seed):
    """With dropout there is no torch peer; the definition: a 4-D call is the
    3-D call on (B H, N, D) with key heads repeated and lengths repeated per
    head, the same mask (seed, b H + h, i, j), bit for bit, forward and
    backward."""
    rng = np.random.default_rng(seed)
    for case in range(NUM_CASES // 4):
        batch, heads, kv_heads, nq, nk, dim, dv = random_case(rng)
        group = heads // kv_heads
        lens = lens_for(rng, batch, nq, nk)
        q = randn(rng, (batch, heads, nq, dim), torch.float32, requires_grad=True)
        k = randn(rng, (batch, kv_heads, nk, dim), torch.float32, requires_grad=True)
        v = randn(rng, (batch, kv_heads, nk, dv), torch.float32, requires_grad=True)
        s = int(rng.integers(2**62))
        got = qkv.torch.scaled_dot_product_attention(q, k, v, dropout_p=0.3, enable_gqa=True,
                                                     valid_lens=lens, seed=s)
        q3 = q.detach().reshape(batch * heads, nq, dim).requires_grad_()
        k3, v3 = (t.detach().repeat_interleave(group, dim=1).flatten(0, 1).requires_grad_()
                  for t in (k, v))
        lens3 = None if lens is None else lens.repeat_interleave(heads, dim=0)
        want = qkv.torch.scaled_dot_product_attention(q3, k3, v3, dropout_p=0.3,
                                                      valid_lens=lens3, seed=s)
        what = f"case {case}: B {batch} H {heads} Hkv {kv_heads} Nq {nq} Nk {nk}"
        assert torch.equal(got, want.reshape(got.shape)), what
        g = randn(rng, got.shape, torch.float32)
        dq, dk, dv_ = torch.autograd.grad(got, (q, k, v), g)
        dq3, dk3, dv3 = torch.autograd.grad(want, (q3, k3, v3), g.reshape(want.shape))
        # A key head's gradient is the sum over its query heads, and with
        # grouped heads the key blocks split differently among the tasks: to
        # rounding then, bit for bit without groups.
        for name, a, b in (("d_query", dq, dq3), ("d_key", dk, dk3), ("d_value", dv_, dv3)):
            if name != "d_query":
                b = b.reshape(batch, kv_heads, group, *b.shape[-2:]).sum(dim=2)
            b = b.reshape(a.shape)
            if group == 1:
                assert torch.equal(a, b), f"{what}: {name}"
            else:
                assert relative_error(a, b, floor=1.0) <= 1e-5, f"{what}: {name}"
