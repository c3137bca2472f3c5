"""The book's attention code (d2l §11.3, §11.5) and qkv's exact-mask rules as
plain PyTorch, written from the formulas, for the qkv.torch tests: torch's
own autograd of these is the reference for qkv.torch's fused backwards.
The book's masked_softmax, DotProductAttention, AdditiveAttention and
MultiHeadAttention (§11.5) come from tests/peer/d2l_reference.py, the one copy
of the book's code (shared with the peer tests).

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
    d2l_masked_softmax as book_masked_softmax,
    transpose_output,
    transpose_qkv,
)


# ---- random inputs ----------------------------------------------------------------

def randn(rng, shape, dtype=torch.float64, requires_grad=False):
    """Standard normal entries from `rng`, as a new contiguous CPU tensor."""
    t = torch.from_numpy(rng.standard_normal(shape)).to(dtype)
    return t.requires_grad_(requires_grad)


def random_lens(rng, kind, batch, num_queries, num_keys, low=0):
    """valid_lens of `kind` None, "B" (B) or "BNq" (B, Nq), int64, in [low, Nk].

    With low = 0 and at least two entries, the first is 0 and the last Nk,
    so both ends of the range are always exercised.
    """
    if kind is None:
        return None
    shape = (batch,) if kind == "B" else (batch, num_queries)
    lens = rng.integers(low, num_keys + 1, size=shape)
    if low == 0 and lens.size >= 2:
        lens.flat[0] = 0
        lens.flat[-1] = num_keys
    return torch.from_numpy(lens).to(torch.int64)


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


# Heads and key heads of the mask and bias peer tests: (H, Hkv) pairs.
HEAD_GROUPS = [(1, 1), (2, 2), (4, 2), (6, 1)]


def random_heads_case(rng):
    """(three_d, B, H, Hkv, Nq, Nk, D, Dv): 3-D inputs a quarter of the time
    (H = Hkv = 1), else heads grouped or not; Nq up to 300, Nk up to 500."""
    heads, kv_heads = HEAD_GROUPS[int(rng.integers(len(HEAD_GROUPS)))]
    three_d = rng.random() < 0.25
    if three_d:
        heads = kv_heads = 1
    batch = int(rng.integers(1, 3))
    nq = int(rng.choice([1, 3, 33, 300]))
    nk = int(rng.choice([1, 7, 64, 500]))
    dim, dv = int(rng.choice([4, 17, 64])), int(rng.choice([3, 16, 64]))
    return three_d, batch, heads, kv_heads, nq, nk, dim, dv


def heads_shapes(three_d, batch, heads, kv_heads, nq, nk, dim, dv):
    """The query, key and value shapes of a random_heads_case."""
    if three_d:
        return (batch, nq, dim), (batch, nk, dim), (batch, nk, dv)
    return (batch, heads, nq, dim), (batch, kv_heads, nk, dim), (batch, kv_heads, nk, dv)


def relative_error(got, want, floor=1e-300):
    """max |got - want| / max(max |want|, floor), in float64. A floor of the
    inputs' size keeps a result that is exactly 0 in the formulas (dQ with one
    valid key, say) from dividing rounding noise by 0."""
    got, want = got.detach().double(), want.detach().double()
    if want.numel() == 0:
        return 0.0
    return ((got - want).abs().max() / want.abs().max().clamp_min(floor)).item()


def seed_from(rng):
    """A dropout seed (any 63-bit integer) from `rng`."""
    return int(rng.integers(0, np.iinfo(np.int64).max))
