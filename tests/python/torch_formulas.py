"""The book's attention code (d2l §11.3, §11.5), qkv's exact-mask rules and
torch 2.x's scaled_dot_product_attention as plain PyTorch, written from the
formulas, for the qkv.torch tests and the torch-math peers: torch's own
autograd of these is the reference for qkv.torch's fused backwards.
The book's masked_softmax, DotProductAttention, AdditiveAttention and
MultiHeadAttention (§11.5) come from tests/peer/d2l_reference.py, the one copy
of the book's code (shared with the peer tests), and so do the comparison
rule (check_close, relative_error) and the drawer of valid lengths (draw_lens).

Also the tests' random inputs (from the `rng` fixture's NumPy generator).
"""

import math
import os
import sys

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peer"))
from d2l_reference import (  # noqa: E402,F401  (re-exported under the tests' names)
    D2lAdditiveAttention as BookAdditiveAttention,
    D2lDotProductAttention as BookDotProductAttention,
    D2lMultiHeadAttention as BookMultiHeadAttention,
    check_close,
    d2l_masked_softmax as book_masked_softmax,
    draw_lens,
    transpose_output,
    transpose_qkv,
)


# ---- random inputs ----------------------------------------------------------------

def randn(rng, shape, dtype=torch.float64, requires_grad=False):
    """Standard normal entries from `rng`, as a new contiguous CPU tensor."""
    t = torch.from_numpy(rng.standard_normal(shape)).to(dtype)
    return t.requires_grad_(requires_grad)


def lens_tensor(rng, kind, batch, num_queries, num_keys, low=0):
    """d2l_reference.draw_lens's lengths (None, "B" or "BNq", in [low, Nk])
    as an int64 tensor, as qkv.torch and the formulas take them."""
    lens = draw_lens(rng, kind, batch, num_queries, num_keys, low=low)
    return None if lens is None else torch.from_numpy(lens)


def small_shapes(rng):
    """Random small sizes: B >= 2 (so lengths 0 and Nk both occur), the rest >= 1."""
    return dict(B=int(rng.integers(2, 4)), Nq=int(rng.integers(1, 5)),
                Nk=int(rng.integers(1, 6)), D=int(rng.integers(1, 5)),
                Dv=int(rng.integers(1, 4)), H=int(rng.integers(1, 5)),
                Dq=int(rng.integers(1, 5)), Dk=int(rng.integers(1, 5)))


# ---- masks --------------------------------------------------------------------------

def key_mask(valid_lens, shape):
    """Boolean (..., Nq, Nk): key j takes part in query i's softmax (j < its length)."""
    num_queries, num_keys = shape[-2], shape[-1]
    positions = torch.arange(num_keys)
    if valid_lens is None:
        return torch.ones(shape, dtype=torch.bool)
    lens = valid_lens.to(torch.int64)
    if lens.dim() == 1:
        lens = lens[:, None].expand(-1, num_queries)
    return (positions < lens[..., None]).expand(shape)


def exact_masked_softmax(X, valid_lens):
    """qkv's masked softmax (DESIGN.md §3): masked keys get weight exactly 0 and
    a row with length 0 is all zeros (no -1e6 sentinel). X: (B, Nq, Nk)."""
    if valid_lens is None:
        return nn.functional.softmax(X, dim=-1)
    keep = key_mask(valid_lens, X.shape)
    scores = X.masked_fill(~keep, float("-inf"))
    # An all-masked row would be softmax(-inf, ..., -inf) = NaN: give it finite
    # scores, and let the mask below zero its weights (and their gradients).
    scores = scores.masked_fill(~keep.any(dim=-1, keepdim=True), 0.0)
    return nn.functional.softmax(scores, dim=-1) * keep


def sdpa_reference(q, k, v, valid_lens=None, scale=None, keep=None):
    """softmax(Q K^T * scale) (exact mask) [times the dropout multipliers `keep`] V.
    Any leading axes; valid_lens for 3-D inputs."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    weights = exact_masked_softmax(scores, valid_lens)
    if keep is not None:
        weights = weights * keep
    return torch.matmul(weights, v)


def additive_scores(q, k, W_q, W_k, w_v):
    """score[b, i, j] = w_v . tanh(W_q q_bi + W_k k_bj), (B, Nq, Nk)."""
    features = torch.tanh((q @ W_q.T).unsqueeze(-2) + (k @ W_k.T).unsqueeze(-3))
    return features @ w_v.reshape(-1)


def additive_reference(q, k, v, W_q, W_k, w_v, valid_lens=None, keep=None):
    weights = exact_masked_softmax(additive_scores(q, k, W_q, W_k, w_v), valid_lens)
    if keep is not None:
        weights = weights * keep
    return weights @ v


def sdpa_math(q, k, v, *, keep=None, bias=None, diagonal=None, valid_lens=None):
    """torch 2.x's documented math of scaled_dot_product_attention, in q's
    dtype (Debian's torch 1.13 has no scaled_dot_product_attention): with
    enable_gqa, key and value heads repeat_interleave'd to the query heads
    (query head h reads key head h // (H / Hkv)); scores Q K^T / sqrt(D) plus
    `bias` (an attn_mask of floats, broadcast against the scores); -inf where
    the boolean `keep` (an attn_mask of bools, broadcast) is False, above the
    diagonal (is_causal: torch.ones(Nq, Nk).tril(diagonal)) and at or past a
    query's valid length (d2l's lengths, (B) or (B, Nq), shared by the
    heads); softmax; times V. A query left with no key gives NaN, as torch's."""
    if q.dim() == 4 and q.shape[1] != k.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    nq, nk = q.shape[-2], k.shape[-2]
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias
    mask = torch.ones(nq, nk, dtype=torch.bool) if keep is None else keep
    if diagonal is not None:
        mask = mask & torch.ones(nq, nk, dtype=torch.bool).tril(diagonal)
    if valid_lens is not None:
        lens = valid_lens if valid_lens.dim() == 2 else valid_lens[:, None].expand(-1, nq)
        inside = torch.arange(nk) < lens[..., None]  # (B, Nq, Nk)
        mask = mask & (inside[:, None] if q.dim() == 4 else inside)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def seed_from(rng):
    """A dropout seed (any 63-bit integer) from `rng`."""
    return int(rng.integers(0, np.iinfo(np.int64).max))
