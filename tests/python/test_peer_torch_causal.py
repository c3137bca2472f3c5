"""Peer test: causal scaled dot-product attention against PyTorch.

Debian's torch 1.13 has no scaled_dot_product_attention, so the peer is torch
2.x's documented math written in torch: scores Q K^T * scale, the causal
mask (torch.ones(Nq, Nk).tril(diagonal)) and d2l's valid lengths filled with
-inf, softmax, times V; autograd of that for the gradients. qkv.torch's
is_causal (top-left, diagonal 0) and qkv.scaled_dot_product_attention's
causal='bottom-right' (diagonal Nk - Nq) run on fresh random cases: Nq < Nk,
Nq = Nk, Nq > Nk, one query, 2-D, 3-D and 4-D inputs, lengths combined with
the mask, float32, float64 and bfloat16, forward and the gradients of a
random linear functional. Where every key of a query is masked torch's math
gives NaN and qkv gives 0 (DESIGN.md section 3): checked separately.

Tolerances as test_peer_torch.py: max|got - ref| / max(max|ref|, floor) <=
1e-5 (float32), 1e-12 (float64) against a float64 reference, and 10x that
for gradients with a floor of 1 (the size of their terms: inputs and the
functional's weights are O(1); a gradient that is 0 in exact arithmetic, dQ
with one key, is rounding noise of that size); bf16 output within
4e-3 max|v| + 2^-8 |out| (docs/semantics.md, "bfloat16 inputs").
"""

import math

import numpy as np
import pytest
import torch

import qkv
import qkv.torch
from torch_formulas import randn, relative_error

NUM_CASES = 40
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def torch_causal_reference(q, k, v, diagonal, valid_lens=None):
    """torch 2.x's math path with a causal mask tril(diagonal) and d2l's
    lengths, in q's dtype; fully masked rows are NaN as in torch."""
    nq, nk = q.shape[-2], k.shape[-2]
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    keep = torch.ones(nq, nk, dtype=torch.bool).tril(diagonal)
    if valid_lens is not None:
        lens = valid_lens if valid_lens.dim() == 2 else valid_lens[:, None].expand(-1, nq)
        keep = keep & (torch.arange(nk) < lens[..., None])
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def random_case(rng):
    nq = int(rng.choice([1, 2, 7, 16, 33, 300]))
    nk = int(rng.choice([1, 5, 16, 31, 300, 700]))
    rank = int(rng.choice([2, 3, 4]))
    lead = {2: (), 3: (int(rng.integers(1, 4)),), 4: (2, int(rng.integers(1, 3)))}[rank]
    dim = int(rng.choice([1, 4, 8, 17, 64]))
    dv = int(rng.choice([1, 3, 8, 24]))
    return lead, nq, nk, dim, dv


def lens_for(rng, lead, nq, nk):
    """None, or (B) / (B, Nq) lengths in [1, Nk] for 3-D inputs."""
    if len(lead) != 1 or rng.random() < 0.4:
        return None
    shape = lead if rng.random() < 0.5 else (lead[0], nq)
    return torch.from_numpy(rng.integers(1, nk + 1, size=shape))


def finite_rows_error(got, want):
    """Relative error over the rows torch's math leaves finite."""
    finite = torch.isfinite(want).all(dim=-1, keepdim=True).expand_as(want)
    if not finite.any():
        return 0.0
    return relative_error(got[finite], want[finite])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_is_causal_matches_torch_math_forward_and_backward(dtype, seed):
    rng = np.random.default_rng(seed)
    for case in range(NUM_CASES):
        lead, nq, nk, dim, dv = random_case(rng)
        lens = lens_for(rng, lead, nq, nk)
        q = randn(rng, (*lead, nq, dim), dtype, requires_grad=True)
        k = randn(rng, (*lead, nk, dim), dtype, requires_grad=True)
        v = randn(rng, (*lead, nk, dv), dtype, requires_grad=True)
        # With lengths, every query keeps key 0 (lengths >= 1 and the
        # diagonal >= 0), so no row is empty and the gradients compare whole.
        got = qkv.torch.scaled_dot_product_attention(q, k, v, is_causal=True, valid_lens=lens)
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        want = torch_causal_reference(qd, kd, vd, 0, lens)
        what = f"case {case}: lead {lead} Nq {nq} Nk {nk} D {dim} Dv {dv} lens {lens is not None}"
        assert relative_error(got, want) <= TOL[dtype], what
        g = randn(rng, got.shape, dtype)
        grads = torch.autograd.grad(got, (q, k, v), g)
        want_grads = torch.autograd.grad(want, (qd, kd, vd), g.double())
        for name, a, b in zip(("d_query", "d_key", "d_value"), grads, want_grads):
            assert relative_error(a, b, floor=1.0) <= 10 * TOL[dtype], f"{what}: {name}"


def test_is_causal_bf16_matches_the_float64_math(seed):
    rng = np.random.default_rng(seed)
    for case in range(NUM_CASES // 2):
        lead, nq, nk, dim, dv = random_case(rng)
        qb, kb, vb = (randn(rng, (*lead, n, d), torch.float32).bfloat16()
                      for n, d in ((nq, dim), (nk, dim), (nk, dv)))
        got = qkv.torch.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
        assert got.dtype == torch.bfloat16
        want = torch_causal_reference(qb.double(), kb.double(), vb.double(), 0)
        err = (got.double() - want).abs()
        bound = 4e-3 * vb.double().abs().max() + 2.0 ** -8 * want.abs()
        assert bool((err <= bound).all()), f"case {case}: lead {lead} Nq {nq} Nk {nk}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bottom_right_matches_torch_math(dtype, seed):
    rng = np.random.default_rng(seed)
    for case in range(NUM_CASES):
        _, nq, nk, dim, dv = random_case(rng)
        batch = int(rng.integers(1, 4))
        q, k, v = (rng.standard_normal((batch, n, d)).astype(dtype)
                   for n, d in ((nq, dim), (nk, dim), (nk, dv)))
        out, lse = qkv.scaled_dot_product_attention(q, k, v, causal="bottom-right",
                                                    return_lse=True)
        qd, kd, vd = (torch.from_numpy(x).double().requires_grad_() for x in (q, k, v))
        want = torch_causal_reference(qd, kd, vd, nk - nq)
        what = f"case {case}: B {batch} Nq {nq} Nk {nk} D {dim} Dv {dv}"
        tol = TOL[torch.float32 if dtype == np.float32 else torch.float64]
        assert finite_rows_error(torch.from_numpy(out), want) <= tol, what
        # The first Nq - Nk queries see no key: torch's math gives NaN, qkv 0
        # with lse -inf.
        empty = max(nq - nk, 0)
        assert bool(torch.isnan(want[:, :empty]).all()), what
        assert not out[:, :empty].any(), what
        assert np.all(lse[:, :empty] == -np.inf), what
        # Gradients: torch's math differentiates NaN rows to NaN, so its
        # functional runs over the other queries alone (the same problem with
        # Nq - empty queries, still bottom-right aligned); qkv's gradients for
        # the empty rows are 0, checked below.
        g = rng.standard_normal(out.shape).astype(dtype)
        grads = qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, g,
                                                          causal="bottom-right")
        rows = torch_causal_reference(qd[:, empty:], kd, vd, nk - nq + empty)
        loss = (rows * torch.from_numpy(g[:, empty:]).double()).sum()
        want_grads = list(torch.autograd.grad(loss, (qd, kd, vd)))
        for name, a, b in zip(grads._fields, grads, want_grads):
            assert relative_error(torch.from_numpy(a), b, floor=1.0) <= 10 * tol, \
                f"{what}: {name}"
        assert not grads.d_queries[:, :empty].any(), what


def test_causal_value_must_be_known():
    x = np.ones((1, 2, 3))
    with pytest.raises(qkv.Error, match="causal = 'diagonal'"):
        qkv.scaled_dot_product_attention(x, x, x, causal="diagonal")
    with pytest.raises(qkv.Error, match="causal = 'lower'"):
        qkv.scaled_dot_product_attention_backward(x, x, x, x, np.zeros((1, 2)), x,
                                                  causal="lower")
