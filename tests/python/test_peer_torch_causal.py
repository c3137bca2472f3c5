"""Peer test: causal scaled dot-product attention against PyTorch, as a list of cases.

The peer is torch 2.x's documented math (torch_formulas.sdpa_math: the
causal mask torch.ones(Nq, Nk).tril(diagonal) and d2l's valid lengths filled
with -inf) in float64 on the same values, autograd of it for the gradients
of sum(out * G). qkv.torch's is_causal (top-left, diagonal 0) and
qkv.scaled_dot_product_attention's causal='bottom-right' (diagonal Nk - Nq)
run on fresh random cases: Nq < Nk, Nq = Nk, Nq > Nk, one query, 2-D, 3-D
and 4-D inputs, lengths combined with the mask, float32, float64 and
bfloat16. Where every key of a query is masked torch's math gives NaN and
qkv gives 0 with lse -inf (DESIGN.md section 3): checked beside the peer.
Each row of PEERS is drawn, run and compared by peer_harness (the one rule:
d2l_reference.check_close).
"""

import numpy as np
import pytest
import torch

import qkv
import qkv.torch
from peer_harness import (  # first: puts tests/peer (d2l_reference) on sys.path
    GRADIENT_TOLERANCE,
    Peer,
    Want,
    draw_case,
    peer_params,
    run_peer,
    torch_formula,
    torch_inputs,
    with_gradients,
)
from torch_formulas import sdpa_math

NUM_CASES = 40


def causal_sizes(rng):
    """Nq and Nk from 1 to 700 (Nq > Nk too), D from 1 to 64, and 2-D, 3-D or
    4-D inputs (B = 2 and one or two heads)."""
    nq = int(rng.choice([1, 2, 7, 16, 33, 300]))
    nk = int(rng.choice([1, 5, 16, 31, 300, 700]))
    rank = int(rng.choice([2, 3, 4]))
    sizes = {2: {}, 3: {"B": int(rng.integers(1, 4))}}.get(rank)
    if sizes is None:
        heads = int(rng.integers(1, 3))
        sizes = {"B": 2, "H": heads, "Hkv": heads}
    sizes.update(Nq=nq, Nk=nk, D=int(rng.choice([1, 4, 8, 17, 64])),
                 Dv=int(rng.choice([1, 3, 8, 24])))
    return sizes


def causal_case(rng, index, dtype):
    """causal_sizes; 3-D inputs get (B) or (B, Nq) lengths in [1, Nk] 60 % of
    the time; bf16: the forward alone, without lengths."""
    sizes = causal_sizes(rng)
    bf16 = dtype == "bfloat16"
    lens = None
    if not bf16 and "B" in sizes and "H" not in sizes and rng.random() >= 0.4:
        lens = ("B", "BNq")[int(rng.random() >= 0.5)]
    return draw_case(rng, index, dtype, sizes, lens=lens, grad=not bf16)


# ---- qkv.torch's is_causal (top-left) ----------------------------------------------------

def qkv_is_causal(case):
    inputs = torch_inputs(case, ["queries", "keys", "values"])
    output = qkv.torch.scaled_dot_product_attention(
        *inputs.values(), is_causal=True, valid_lens=case.valid_lens())
    results = {"output": output}
    return results if case.d_output is None else with_gradients(results, output, inputs,
                                                                case.d_output)


def torch_is_causal(case):
    """With lengths, every query keeps key 0 (lengths >= 1 and the diagonal
    >= 0), so no row is empty and the gradients compare whole."""
    return torch_formula(lambda c, queries, keys, values: sdpa_math(
        queries, keys, values, diagonal=0, valid_lens=c.valid_lens()), case)


# ---- qkv.scaled_dot_product_attention's causal='bottom-right' -----------------------------

def empty_rows(case):
    """The first Nq - Nk queries see no key (bottom-right aligned)."""
    return max(case.sizes["Nq"] - case.sizes["Nk"], 0)


def qkv_bottom_right(case):
    """Output and gradients through the NumPy API; the first Nq - Nk queries
    (no key) must give 0, lse -inf and a zero gradient."""
    q, k, v = (case.inputs[n].astype(case.dtype) for n in ("queries", "keys", "values"))
    output, lse = qkv.scaled_dot_product_attention(q, k, v, causal="bottom-right",
                                                   return_lse=True)
    empty, desc = empty_rows(case), case.desc()
    assert not output[:, :empty].any(), desc
    assert np.all(lse[:, :empty] == -np.inf), desc
    grads = qkv.scaled_dot_product_attention_backward(
        q, k, v, output, lse, case.d_output.astype(case.dtype), causal="bottom-right")
    assert not grads.d_queries[:, :empty].any(), desc
    return {"output": output, **dict(zip(grads._fields, grads))}


def torch_bottom_right(case):
    """The output on the rows torch's math leaves finite (its first Nq - Nk
    rows are NaN); the gradients of the functional over the other queries
    alone (the same problem with Nq - empty queries, still bottom-right
    aligned), as torch's math differentiates NaN rows to NaN."""
    nq, nk = case.sizes["Nq"], case.sizes["Nk"]
    empty = empty_rows(case)
    leaves = [torch.from_numpy(case.inputs[n]).requires_grad_()
              for n in ("queries", "keys", "values")]
    output = sdpa_math(*leaves, diagonal=nk - nq)
    assert bool(torch.isnan(output[:, :empty]).all()), case.desc()
    rows = np.arange(nq) >= empty
    want = {"output": Want(output.detach(), rows=np.broadcast_to(rows, output.shape[:-1]))}
    live = sdpa_math(leaves[0][:, empty:], *leaves[1:], diagonal=nk - nq + empty)
    loss = (live * torch.from_numpy(case.d_output[:, empty:])).sum()
    grads = torch.autograd.grad(loss, leaves)
    want.update({f"d_{n}": Want(g, scale=1.0, tolerance=GRADIENT_TOLERANCE[case.dtype])
                 for n, g in zip(("queries", "keys", "values"), grads)})
    return want


def bottom_right_case(rng, index, dtype):
    """causal_sizes' Nq, Nk, D and Dv, 3-D with B from 1 to 3, no lengths."""
    sizes = {a: n for a, n in causal_sizes(rng).items() if a not in ("B", "H", "Hkv")}
    return draw_case(rng, index, dtype, {"B": int(rng.integers(1, 4)), **sizes})


PEERS = [
    Peer("is_causal", causal_case, qkv_is_causal, torch_is_causal,
         ("float32", "float64"), NUM_CASES),
    Peer("is_causal", causal_case, qkv_is_causal, torch_is_causal, ("bfloat16",),
         NUM_CASES // 2),
    Peer("bottom-right", bottom_right_case, qkv_bottom_right, torch_bottom_right,
         ("float32", "float64"), NUM_CASES),
]


@pytest.mark.parametrize("peer, dtype", peer_params(PEERS))
def test_causal_matches_torch_math(peer, dtype, seed):
    run_peer(peer, dtype, seed)


def test_causal_value_must_be_known():
    x = np.ones((1, 2, 3))
    with pytest.raises(qkv.Error, match="causal = 'diagonal'"):
        qkv.scaled_dot_product_attention(x, x, x, causal="diagonal")
    with pytest.raises(qkv.Error, match="causal = 'lower'"):
        qkv.scaled_dot_product_attention_backward(x, x, x, x, np.zeros((1, 2)), x,
                                                  causal="lower")
