"""Peer test: boolean masks, key masks and sliding windows against PyTorch, as a list of cases.

The peer is torch 2.x's documented math (torch_formulas.sdpa_math) in float64
on the same values: masked_fill(-inf) where the boolean attn_mask is False
(broadcast against (B, H, Nq, Nk) as torch broadcasts it) and where a key
mask, a window or is_causal leaves a key out; autograd of it for the
gradients of sum(out * G). Fresh random cases (peer_harness.mask_peer_sizes):
masks of half the keys in every broadcast form ((Nq, Nk), (B, 1, Nq, Nk),
(1, H, 1, Nk), (B, H, Nq, Nk), and 3-D inputs' (B, Nq, Nk)), heads grouped
or not, Nq from 1 to 300, Nk up to 500, combined with is_causal, through
qkv.torch's attn_mask (float32, float64, bf16) and through the NumPy API's
mask, key_mask and window. Every query keeps key 0 or its diagonal, so
torch's math has no NaN rows; a query left with no key (torch: NaN, qkv: 0)
is checked on its own. Each row of PEERS is drawn, run and compared by
peer_harness (the one rule: d2l_reference.check_close).
"""

import numpy as np
import pytest
import torch

import qkv
import qkv.torch
from peer_harness import (  # first: puts tests/peer (d2l_reference) on sys.path
    Peer,
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


def random_mask(rng, sizes):
    """A bool mask of a random broadcast form, half True, with key 0 kept for
    every query (so no row of torch's math is all -inf)."""
    batch, nq, nk = sizes["B"], sizes["Nq"], sizes["Nk"]
    if "H" not in sizes:
        shape = [(nq, nk), (batch, nq, nk), (1, nq, nk)][int(rng.integers(3))]
    else:
        shape = [(nq, nk), (batch, 1, nq, nk), (1, sizes["H"], 1, nk),
                 (batch, sizes["H"], nq, nk)][int(rng.integers(4))]
    keep = torch.from_numpy(rng.random(shape) < 0.5)
    keep[..., 0] = True
    return keep


def attn_mask_case(rng, index, dtype):
    """mask_peer_sizes, random_mask, is_causal 30 % of the time; bf16: the
    forward alone, without is_causal."""
    sizes = mask_peer_sizes(rng)
    keep = random_mask(rng, sizes)
    bf16 = dtype == "bfloat16"
    causal = not bf16 and bool(rng.random() < 0.3)
    case = draw_case(rng, index, dtype, sizes, grad=not bf16, keep=keep, causal=causal)
    case.notes += [f"mask {list(keep.shape)}", f"causal {causal}"]
    return case


def qkv_attn_mask(case):
    inputs = torch_inputs(case, NAMES)
    output = qkv.torch.scaled_dot_product_attention(
        *inputs.values(), attn_mask=case.options["keep"], is_causal=case.options["causal"],
        enable_gqa=True)
    results = {"output": output}
    return results if case.d_output is None else with_gradients(results, output, inputs,
                                                                case.d_output)


def torch_attn_mask(case):
    diagonal = 0 if case.options["causal"] else None
    return torch_formula(lambda c, queries, keys, values: sdpa_math(
        queries, keys, values, keep=c.options["keep"], diagonal=diagonal), case)


def window_case(rng, index, dtype):
    """The NumPy API's key_mask (B, Nk) and window (left, right), aligned at
    the bottom right (FlashAttention's window_size), with a mask on top. Each
    query's diagonal key j = i + Nk - Nq is kept by all three; where that is
    before key 0 a query may be left with no key: options["rows"] says which
    have one, and d_output is 0 on the others."""
    sizes = mask_peer_sizes(rng)
    batch, nq, nk = sizes["B"], sizes["Nq"], sizes["Nk"]
    case = draw_case(rng, index, dtype, sizes)
    left, right = int(rng.integers(-1, 100)), int(rng.integers(-1, 10))
    diagonal = np.arange(nq) + nk - nq
    inside = (diagonal >= 0) & (diagonal < nk)
    keys = rng.random((batch, nk)) < 0.7
    keys[:, diagonal[inside]] = True
    mask = rng.random((batch, 1, nq, nk) if "H" in sizes else (batch, nq, nk)) < 0.6
    mask[..., np.arange(nq)[inside], diagonal[inside]] = True
    jj = np.arange(nk)[None, :]
    window = (((jj >= diagonal[:, None] - left) | (left < 0)) &
              ((jj <= diagonal[:, None] + right) | (right < 0)))
    keys_b = keys[:, None, None, :] if "H" in sizes else keys[:, None, :]
    keep = torch.from_numpy(window & keys_b & mask)
    rows = keep.any(dim=-1).expand(case.d_output.shape[:-1]).numpy()
    case.d_output = case.d_output * rows[..., None]
    case.options.update(mask=mask, key_mask=keys, window=(left, right), keep=keep, rows=rows)
    case.notes.append(f"window ({left}, {right})")
    return case


def qkv_window(case):
    """Output and gradients through the NumPy API; a query left with no key
    must give 0 and lse -inf."""
    q, k, v = (case.inputs[n].astype(case.dtype) for n in NAMES)
    masks = {n: case.options[n] for n in ("mask", "key_mask", "window")}
    output, lse = qkv.scaled_dot_product_attention(q, k, v, return_lse=True, **masks)
    rows, desc = case.options["rows"], case.desc()
    assert not output[~rows].any(), desc
    assert np.all(lse[~rows] == -np.inf), desc
    grads = qkv.scaled_dot_product_attention_backward(
        q, k, v, output, lse, case.d_output.astype(case.dtype), **masks)
    return {"output": output, **dict(zip(grads._fields, grads))}


def torch_window(case):
    """The output on the queries that keep a key; the gradients of the
    functional over those (d_output is 0 on the others, where torch's math
    gets key 0 back so it has no NaN to differentiate: those rows then add
    nothing)."""
    keep, rows = case.options["keep"], torch.from_numpy(case.options["rows"])
    first = torch.zeros(case.sizes["Nk"], dtype=torch.bool)
    first[0] = True
    want = torch_formula(lambda c, queries, keys, values: sdpa_math(
        queries, keys, values, keep=keep | (~rows[..., None] & first)), case)
    want["output"].rows = case.options["rows"]
    return want


PEERS = [
    Peer("attn_mask", attn_mask_case, qkv_attn_mask, torch_attn_mask, ("float32", "float64"),
         NUM_CASES),
    Peer("attn_mask", attn_mask_case, qkv_attn_mask, torch_attn_mask, ("bfloat16",),
         NUM_CASES // 2),
    Peer("key_mask and window", window_case, qkv_window, torch_window, ("float32", "float64"),
         NUM_CASES),
]


@pytest.mark.parametrize("peer, dtype", peer_params(PEERS))
def test_masks_match_torch_math(peer, dtype, seed):
    run_peer(peer, dtype, seed)


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
    assert torch.isnan(sdpa_math(q.detach(), k.detach(), v.detach(), keep=keep)[:, :, 2]).all()
    g = torch.zeros_like(out)
    g[:, :, 2] = 1.0
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    assert not dq.any() and not dk.any() and not dv.any()
