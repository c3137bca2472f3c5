"""Peer test: attention heads and grouped-query attention against PyTorch, as a list of cases.

The peer is torch 2.x's documented math (torch_formulas.sdpa_math) in float64
on the same values: with enable_gqa, key and value heads repeat_interleave'd
to the query heads (query head h reads key head h // (H // Hkv)); is_causal's
mask tril(diagonal) and d2l's valid lengths (shared by the heads) filled
with -inf; autograd of it for the gradients of sum(out * G). Fresh random
cases: B, H, Hkv with H / Hkv in 1..8, Nq and Nk from 1 to 300, D and Dv
from 1 to 64, lengths none, (B) or (B, Nq), causal off, top-left and (NumPy
API) bottom-right, layouts contiguous, (B, N, H, D) memory transposed to
(B, H, N, D) as one fused projection leaves it, one head slice of a wider
tensor, and D strided (which the library copies); the NumPy API with batch
and heads reversed (negative strides, read in place); float32, float64 and
bfloat16 (gradients within 2e-2 of the size of their terms: d2l_reference's
sdpa_grad_scales, times H / Hkv for the key heads' sums). Each row of PEERS is
drawn, run and compared by peer_harness (the one rule: d2l_reference.check_close).

Dropout has no torch peer (torch draws its own mask), so a 4-D call with
dropout must equal the 3-D call on the heads folded into the batch, bit for
bit (the definition: docs/semantics.md, "Heads").
"""

import math

import numpy as np
import pytest
import torch

import qkv
import qkv.torch
from peer_harness import (  # first: puts tests/peer (d2l_reference) on sys.path
    BF16_GRADIENT_TOLERANCE,
    Peer,
    Want,
    check_close,
    draw_case,
    laid_out,
    peer_params,
    run_peer,
    torch_formula,
    torch_inputs,
    with_gradients,
)
from d2l_reference import sdpa_grad_scales
from torch_formulas import sdpa_math

NUM_CASES = 100
GROUPS = [(1, 1), (2, 2), (4, 2), (6, 3), (8, 2), (8, 1), (3, 1), (5, 5)]
LAYOUTS = ["contiguous", "token-major", "head slice", "D strided"]
NAMES = ("queries", "keys", "values")


def heads_sizes(rng):
    """B from 1 to 3, (H, Hkv) from GROUPS, Nq and Nk from 1 to 300, D and Dv
    from 1 to 64."""
    heads, kv_heads = GROUPS[int(rng.integers(len(GROUPS)))]
    return {"B": int(rng.integers(1, 4)), "H": heads, "Hkv": kv_heads,
            "Nq": int(rng.choice([1, 2, 4, 7, 33, 300])), "Nk": int(rng.choice([1, 5, 31, 300])),
            "D": int(rng.choice([1, 4, 17, 64])), "Dv": int(rng.choice([1, 3, 24, 64]))}


def lens_form(rng):
    """None 40 % of the time, else (B) or (B, Nq) lengths (in [1, Nk])."""
    return None if rng.random() < 0.4 else ("B", "BNq")[int(rng.random() >= 0.5)]


def heads_case(rng, index, dtype):
    """heads_sizes; a layout from LAYOUTS, causal (top-left) 40 % of the time,
    and lens_form's lengths (bf16: none)."""
    sizes = heads_sizes(rng)
    lens = None if dtype == "bfloat16" else lens_form(rng)
    layout = LAYOUTS[int(rng.integers(len(LAYOUTS)))]
    causal = bool(rng.random() < 0.4)
    case = draw_case(rng, index, dtype, sizes, lens=lens, layout=layout, causal=causal)
    case.notes += [layout, f"causal {causal}"]
    return case


def qkv_heads(case):
    inputs = torch_inputs(case, NAMES, case.options["layout"])
    output = qkv.torch.scaled_dot_product_attention(
        *inputs.values(), is_causal=case.options["causal"], enable_gqa=True,
        valid_lens=case.valid_lens())
    return with_gradients({"output": output}, output, inputs, case.d_output)


def torch_heads(case):
    """With lengths >= 1 and the top-left diagonal 0 every query keeps key 0."""
    diagonal = 0 if case.options["causal"] else None
    bf16 = case.dtype == "bfloat16"
    want = torch_formula(lambda c, queries, keys, values: sdpa_math(
        queries, keys, values, diagonal=diagonal, valid_lens=c.valid_lens()), case,
        grad_tolerance=BF16_GRADIENT_TOLERANCE if bf16 else None)
    if bf16:
        for name, scale in bf16_gradient_scales(case).items():
            want[f"d_{name}"] = Want(want[f"d_{name}"].value, scale, BF16_GRADIENT_TOLERANCE)
    return want


def bf16_gradient_scales(case):
    """The size of the terms each gradient sums, from the heads folded into a
    batch with the key heads repeated; a key head sums H / Hkv of them."""
    q, k, v = (torch.from_numpy(case.inputs[n]) for n in NAMES)
    group = case.sizes["H"] // case.sizes["Hkv"]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(case.sizes["D"])
    if case.options["causal"]:
        nq, nk = case.sizes["Nq"], case.sizes["Nk"]
        scores = scores.masked_fill(~torch.ones(nq, nk, dtype=torch.bool).tril(), float("-inf"))
    weights = torch.nan_to_num(torch.softmax(scores, dim=-1))

    def fold(t):
        return t.reshape(-1, *t.shape[-2:]).numpy()

    sizes = sdpa_grad_scales(fold(weights), fold(q), fold(k), fold(v), fold(
        torch.from_numpy(case.d_output)), 1 / math.sqrt(case.sizes["D"]))
    return {"queries": sizes["q"], "keys": sizes["k"] * group, "values": sizes["v"] * group}


def numpy_case(rng, index, dtype):
    """heads_sizes with Nq <= Nk (so every bottom-right query keeps a key: no
    NaN rows in torch's math), no lengths."""
    sizes = heads_sizes(rng)
    sizes["Nq"] = min(sizes["Nq"], sizes["Nk"])
    case = draw_case(rng, index, dtype, sizes)
    case.notes.append("batch and heads reversed")
    return case


def qkv_numpy_heads(case):
    """The NumPy API with batch and heads reversed in memory (negative
    strides, read in place) and causal='bottom-right' (diagonal Nk - Nq)."""
    q, k, v = (laid_out(case.inputs[n].astype(case.dtype), "reversed heads") for n in NAMES)
    assert q.strides[0] < 0 and q.strides[1] < 0
    output, lse = qkv.scaled_dot_product_attention(q, k, v, causal="bottom-right",
                                                   return_lse=True)
    grads = qkv.scaled_dot_product_attention_backward(
        q, k, v, output, lse, case.d_output.astype(case.dtype), causal="bottom-right")
    return {"output": output, **dict(zip(grads._fields, grads))}


def torch_bottom_right(case):
    nq, nk = case.sizes["Nq"], case.sizes["Nk"]
    return torch_formula(lambda c, queries, keys, values: sdpa_math(
        queries, keys, values, diagonal=nk - nq), case)


PEERS = [
    Peer("is_causal", heads_case, qkv_heads, torch_heads, ("float32", "float64"), NUM_CASES),
    Peer("is_causal", heads_case, qkv_heads, torch_heads, ("bfloat16",), NUM_CASES),
    Peer("bottom-right", numpy_case, qkv_numpy_heads, torch_bottom_right,
         ("float32", "float64"), NUM_CASES // 2),
]


@pytest.mark.parametrize("peer, dtype", peer_params(PEERS))
def test_heads_match_torch_math(peer, dtype, seed):
    run_peer(peer, dtype, seed)


def test_dropout_heads_are_the_batch_of_their_rows(seed):
    """With dropout there is no torch peer; the definition: a 4-D call is the
    3-D call on (B H, N, D) with key heads repeated and lengths repeated per
    head, the same mask (seed, b H + h, i, j), bit for bit, forward and
    backward."""
    rng = np.random.default_rng(seed)
    for index in range(NUM_CASES // 4):
        case = draw_case(rng, index, "float32", heads_sizes(rng), lens=lens_form(rng))
        batch, heads, kv_heads, nq, nk, dim, dv = (case.sizes[a] for a in (
            "B", "H", "Hkv", "Nq", "Nk", "D", "Dv"))
        group = heads // kv_heads
        lens = case.valid_lens()
        q, k, v = torch_inputs(case, NAMES).values()
        s = int(rng.integers(2**62))
        got = qkv.torch.scaled_dot_product_attention(q, k, v, dropout_p=0.3, enable_gqa=True,
                                                     valid_lens=lens, seed=s)
        q3 = q.detach().reshape(batch * heads, nq, dim).requires_grad_()
        k3, v3 = (t.detach().repeat_interleave(group, dim=1).flatten(0, 1).requires_grad_()
                  for t in (k, v))
        lens3 = None if lens is None else lens.repeat_interleave(heads, dim=0)
        want = qkv.torch.scaled_dot_product_attention(q3, k3, v3, dropout_p=0.3,
                                                      valid_lens=lens3, seed=s)
        what = f"case {index}: B {batch} H {heads} Hkv {kv_heads} Nq {nq} Nk {nk}"
        assert torch.equal(got, want.reshape(got.shape)), what
        g = torch.from_numpy(case.d_output).float()
        dq, dk, dv_ = torch.autograd.grad(got, (q, k, v), g)
        dq3, dk3, dv3 = torch.autograd.grad(want, (q3, k3, v3), g.reshape(want.shape))
        # A key head's gradient is the sum over its query heads, and with
        # grouped heads the key blocks split differently among the tasks: to
        # rounding then (the float32 rule, floor 1), bit for bit without groups.
        for name, a, b in (("d_queries", dq, dq3), ("d_keys", dk, dk3), ("d_values", dv_, dv3)):
            if name != "d_queries":
                b = b.reshape(batch, kv_heads, group, *b.shape[-2:]).sum(dim=2)
            b = b.reshape(a.shape)
            if group == 1:
                assert torch.equal(a, b), f"{what}: {name}"
            else:
                check_close(name, a, b, "float32", what, scale=1.0)
