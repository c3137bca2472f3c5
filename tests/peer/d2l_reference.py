"""d2l's PyTorch attention code, the reference of qkv's peer tests, and the rule they compare by.

The book's formulations (masked softmax with its -1e6 sentinel,
DotProductAttention, AdditiveAttention, MultiHeadAttention), written out
from the chapter's formulas, plus the exact lse and per-row lengths they
need. One copy serves the CLI peer test (tests/peer/test_torch_peer.py) and
the Python package's peer tests (tests/python/test_peer_*.py, through
tests/python/peer_harness.py), and so do the comparison rule (check_close,
relative_error and the tolerances, below) and the one drawer of valid
lengths (draw_lens).
"""

import math

import numpy as np
import torch
from torch import nn

# ---- the book's code ------------------------------------------------------------

def d2l_masked_softmax(x, valid_lens):
    """Softmax over the last axis after overwriting every position at or beyond
    the row's valid length with -1e6, as d2l does. x: (B, Nq, Nk); valid_lens:
    None, (B) (shared by the batch element's queries) or (B, Nq)."""
    if valid_lens is None:
        return nn.functional.softmax(x, dim=-1)
    batch, num_queries, num_keys = x.shape
    if valid_lens.dim() == 1:
        per_row = torch.repeat_interleave(valid_lens.long(), num_queries)
    else:
        per_row = valid_lens.long().reshape(-1)
    rows = x.reshape(-1, num_keys)
    inside = torch.arange(num_keys)[None, :] < per_row[:, None]
    sentinel = torch.full_like(rows, -1e6)
    rows = torch.where(inside, rows, sentinel)
    return nn.functional.softmax(rows.reshape(x.shape), dim=-1)


class D2lDotProductAttention(nn.Module):
    """softmax(Q K^T / sqrt(d)) V with d2l's masked softmax and dropout on the
    weights. `scale`, when given, multiplies Q K^T instead (qkv's --scale)."""

    def __init__(self, dropout, scale=None):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.scale = scale

    def forward(self, queries, keys, values, valid_lens=None):
        products = torch.bmm(queries, keys.transpose(1, 2))
        if self.scale is None:
            self.scores = products / math.sqrt(queries.shape[-1])
        else:
            self.scores = products * self.scale
        self.attention_weights = d2l_masked_softmax(self.scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)


class D2lAdditiveAttention(nn.Module):
    """score(q, k) = w_v^T tanh(W_q q + W_k k), bias-free linear layers, then
    d2l's masked softmax, dropout on the weights, and the weighted sum of V."""

    def __init__(self, key_size, query_size, num_hiddens, dropout):
        super().__init__()
        self.W_k = nn.Linear(key_size, num_hiddens, bias=False)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=False)
        self.w_v = nn.Linear(num_hiddens, 1, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, queries, keys, values, valid_lens):
        # (B, Nq, 1, H) + (B, 1, Nk, H): every query meets every key.
        hidden = torch.tanh(self.W_q(queries).unsqueeze(2) + self.W_k(keys).unsqueeze(1))
        self.scores = self.w_v(hidden).squeeze(-1)
        self.attention_weights = d2l_masked_softmax(self.scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)


# ---- the book's multi-head attention (§11.5) --------------------------------

def transpose_qkv(X, num_heads):
    """(B, N, num_hiddens) -> (B * heads, N, num_hiddens / heads), heads folded into the batch."""
    X = X.reshape(X.shape[0], X.shape[1], num_heads, -1).permute(0, 2, 1, 3)
    return X.reshape(-1, X.shape[2], X.shape[3])


def transpose_output(X, num_heads):
    """The inverse of transpose_qkv."""
    X = X.reshape(-1, num_heads, X.shape[1], X.shape[2]).permute(0, 2, 1, 3)
    return X.reshape(X.shape[0], X.shape[1], -1)


class D2lMultiHeadAttention(nn.Module):
    """d2l §11.5's MultiHeadAttention around any attention module taking
    (queries, keys, values, valid_lens) with the heads folded into the batch."""

    def __init__(self, attention, query_size, key_size, value_size, num_hiddens, num_heads,
                 bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.attention = attention
        self.W_q = nn.Linear(query_size, num_hiddens, bias=bias)
        self.W_k = nn.Linear(key_size, num_hiddens, bias=bias)
        self.W_v = nn.Linear(value_size, num_hiddens, bias=bias)
        self.W_o = nn.Linear(num_hiddens, num_hiddens, bias=bias)

    def forward(self, queries, keys, values, valid_lens):
        queries = transpose_qkv(self.W_q(queries), self.num_heads)
        keys = transpose_qkv(self.W_k(keys), self.num_heads)
        values = transpose_qkv(self.W_v(values), self.num_heads)
        if valid_lens is not None:
            valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
        output = self.attention(queries, keys, values, valid_lens)
        return self.W_o(transpose_output(output, self.num_heads))


def exact_lse(scores, valid_lens):
    """log sum_{j < L} exp(scores[b, i, j]) as float64 numpy, -inf when L = 0."""
    scores = scores.detach().to(torch.float64)
    lens = row_lengths(valid_lens, *scores.shape)
    inside = torch.arange(scores.shape[-1])[None, None, :] < torch.from_numpy(lens)[..., None]
    masked = torch.where(inside, scores, torch.full_like(scores, -math.inf))
    return torch.logsumexp(masked, dim=-1).numpy()


def row_lengths(valid_lens, batch, num_queries, num_keys):
    """Valid length of every row (b, i) as an int64 numpy (B, Nq) array."""
    if valid_lens is None:
        return np.full((batch, num_queries), num_keys, dtype=np.int64)
    lens = np.asarray(valid_lens.numpy() if torch.is_tensor(valid_lens) else valid_lens)
    lens = lens.astype(np.int64)
    if lens.ndim == 1:
        return np.repeat(lens[:, None], num_queries, axis=1)
    return lens


def describe(**fields):
    """A case's sizes for failure messages: "B=2 Nq=3 ..."."""
    return " ".join(f"{k}={v}" for k, v in fields.items())


# ---- valid lengths ---------------------------------------------------------------

def draw_lens(rng, form, batch, num_queries, num_keys, *, low, int_type=np.int64):
    """The one drawer of valid lengths: None for form None, else integers in
    [low, Nk] of shape (B) for form "B" (one per batch element) or (B, Nq) for
    "BNq" (one per query), of int_type. With low = 0 and two entries or more,
    the first is 0 and the last Nk, so both ends of the range always occur."""
    if form is None:
        return None
    shape = (batch,) if form == "B" else (batch, num_queries)
    lens = rng.integers(low, num_keys + 1, size=shape)
    if low == 0 and lens.size >= 2:
        lens.flat[0] = 0
        lens.flat[-1] = num_keys
    return lens.astype(int_type)


# ---- the comparison rule ----------------------------------------------------------
#
# Every peer comparison, the CLI's and the Python package's, passes if
#
#     max |got - ref| <= tolerance * max(max |ref|, scale)
#
# over the elements compared (relative_error). `scale` is the size of the
# terms the result sums: its rounding error grows with them, while
# cancellation can make the result itself small (Dv = 1 and near-uniform
# weights give an output near the mean of the values, maybe 0.01). The d2l
# peers compute it (pooled_scale for outputs, lse_scale for lse,
# *_grad_scale(s) for gradients); the torch-math peers, whose inputs and
# d_output are O(1), take 1 for gradients and max|v| for outputs (which
# average the values; pooled_scale is at most that).
# `tolerance` is TOLERANCE[dtype] unless a comparison names one of the
# others below, each with its reason. "Worst seen": the largest error of 30
# runs of the seven tests/python/test_peer_*.py files (about 2,400 cases
# and 10,000 comparisons a run).

# qkv and the reference sum the same terms in other orders (SIMD lanes, key
# blocks of 256, threads): float32 rounds at 6e-8, float64 at 1.1e-16, once
# per term. Worst seen: 3.7e-6 (float32), 8.4e-15 (float64); an output held
# to max|ref| alone, without its terms' size, cancelled past it once (1.5e-5,
# Dv = 1: the causal peer, before its outputs took max|v|).
TOLERANCE = {"float32": 1e-5, "float64": 1e-12}
# Gradients held to the floor 1 rather than to the size of their terms (the
# torch-math peers: heads, masks, bias, causal): dK and dV sum up to 300
# queries of up to 8 heads, dQ up to 500 keys, each term up to Dv = 64
# products. Worst seen: 5.8e-5 (float32), 1.9e-13 (float64); once 1.009e-4,
# a dK that is 0 exactly (Nk = 1) summed over 1200 query rows (heads peer).
GRADIENT_TOLERANCE = {"float32": 1e-4, "float64": 1e-11}
# The bilinear, distance and causal additive peers (test_peer_torch_scoring.py)
# hold every quantity to the floor 1, and additive's d_w_v sums B Nq Nk, up
# to 30000, terms. Worst seen: 2.1e-6 (float32; 8.9e-6 in one other run),
# 7.7e-15 (float64).
SCORING_TOLERANCE = {"float32": 2e-5, "float64": 1e-11}
# bfloat16 inputs (docs/semantics.md, "bfloat16 inputs"): qkv rounds the
# weights to bf16 (2^-8 relative) before P V, so its float32 output is within
# 2^-8 sum_j P_j |v_j| <= 4e-3 max|v| of attention on the bf16 values (scale
# max|v|); qkv.torch then rounds it to bf16, half an ulp, <= 2^-8 of the
# element, allowed on top (check_close's `rounding`). bf16 gradients carry
# errors of 2^-8 times the size of their terms: within 2e-2 of it; the
# gradient of a bf16 bias, rounded to bf16 itself and summed over the axes
# it broadcasts along, within 5e-2 of max(max|ref|, 1). Worst seen: output
# 1.2e-3, gradients 5.5e-3, bias gradient 4.3e-3.
BF16_OUTPUT_TOLERANCE = 4e-3
BF16_ROUNDING = 2.0**-8
BF16_GRADIENT_TOLERANCE = 2e-2
BF16_BIAS_GRADIENT_TOLERANCE = 5e-2
TINY = 1e-300  # the denominator's floor: a reference of zeros must be met exactly

# The worst relative error per (dtype, quantity) since the last report_worst.
WORST = {}


def _f64(a):
    if torch.is_tensor(a):
        a = a.detach().to(torch.float64).numpy()
    return np.asarray(a, dtype=np.float64)


def relative_error(got, ref, scale=None):
    """(err, index, denominator): err = max|got - ref| / max(max|ref|, scale, TINY)
    over the finite entries of ref (equal values, NaN included, count as 0; a NaN
    on one side only as inf), and the index of the largest difference."""
    got64, ref64 = _f64(got), _f64(ref)
    diff = np.abs(got64 - ref64)
    both_equal = (got64 == ref64) | (np.isnan(got64) & np.isnan(ref64))
    diff = np.where(both_equal, 0.0, diff)
    diff = np.where(np.isnan(diff), math.inf, diff)
    finite_ref = np.abs(ref64[np.isfinite(ref64)])
    denom = max(finite_ref.max() if finite_ref.size else 0.0, scale or 0.0, TINY)
    if not diff.size:
        return 0.0, (), denom
    at = np.unravel_index(int(np.argmax(diff)), diff.shape)
    return float(diff[at]) / denom, at, denom


def check_close(what, got, ref, dtype, desc="", axes=None, scale=None, tolerance=None,
                rounding=None):
    """Asserts the rule above: relative_error(got, ref, scale) <= tolerance
    (TOLERANCE[dtype] when None; dtype a name or a torch dtype, which also
    files the error in WORST), the message naming the worst element's
    coordinates (`axes` names them). With `rounding`, each element's difference
    counts only beyond rounding * min(|got|, |ref|): the result was rounded to
    a type of that relative half-ulp. Returns the error; records the worst."""
    dtype = str(dtype).removeprefix("torch.")
    got64, ref64 = _f64(got), _f64(ref)
    assert got64.shape == ref64.shape, (f"{what}: shape {list(got64.shape)}, expected "
                                        f"{list(ref64.shape)}; {desc}")
    tol = TOLERANCE[dtype] if tolerance is None else tolerance
    compared = got64
    if rounding is not None:
        slack = rounding * np.minimum(np.abs(got64), np.abs(ref64))
        diff = got64 - ref64
        compared = np.where(np.abs(diff) <= slack, ref64, got64 - np.sign(diff) * slack)
    err, at, denom = relative_error(compared, ref64, scale)
    key = (dtype, what.split(" ")[0])  # "output (queries with L >= 1)" counts as output
    WORST[key] = max(WORST.get(key, 0.0), err)
    axes = axes or tuple(f"i{n}" for n in range(got64.ndim))
    where = " ".join(f"{name}={index}" for name, index in zip(axes, at))
    allowed = f" beyond a rounding of {rounding:g}" if rounding is not None else ""
    assert err <= tol, (f"{what}: rel err {err:.3g} > {tol:g} at {where}: got {got64[at]!r}, "
                        f"ref {ref64[at]!r}{allowed} (denominator {denom:.6g}); {desc}")
    return err


def report_worst(title):
    """Prints, one line per dtype, the worst relative errors since the last
    report (by quantity), and starts over."""
    lines = [title]
    for dtype in sorted({d for d, _ in WORST}):
        parts = ", ".join(f"{what} {err:.2g}" for (d, what), err in sorted(WORST.items())
                          if d == dtype)
        lines.append(f"  {dtype}: {parts}")
    print("\n".join(lines))
    WORST.clear()


def pooled_scale(weights, values):
    """max_{b,i,d} sum_j |w_bij| |v_bjd|: the size of the terms an output sums."""
    return float(np.matmul(np.abs(_f64(weights)), np.abs(_f64(values))).max(initial=0.0))


def lse_scale(scores, valid_lens):
    """The largest valid |score|, and at least 1: lse's rounding error scales
    with the scores it sums (lse itself can be near 0), and an absolute error
    e in lse is a relative error e in the normaliser exp(lse)."""
    scores = _f64(scores)
    lengths = row_lengths(valid_lens, *scores.shape)
    inside = np.arange(scores.shape[-1])[None, None, :] < lengths[..., None]
    valid = np.abs(scores[inside])
    valid = valid[np.isfinite(valid)]
    return max(float(valid.max(initial=0.0)), 1.0)


def softmax_grad_scale(weights, d_weights):
    """max_{b,i,j} w_j (|dw_j| + sum_k w_k |dw_k|): the size of the terms of
    dx_j = w_j (dw_j - sum_k w_k dw_k)."""
    w, g = np.abs(_f64(weights)), np.abs(_f64(d_weights))
    return float((w * (g + (w * g).sum(axis=-1, keepdims=True))).max(initial=0.0))


def _score_grad_terms(weights, values, d_output):
    """E[b,i,j] = P_ij (A_ij + sum_j' P_ij' A_ij'), A = |dO| |V|^T: a bound on
    the terms of dS = P (dO V^T - rowsum(dO * O)), the gradient of the scores."""
    p = np.abs(_f64(weights))
    a = np.matmul(np.abs(_f64(d_output)), np.abs(_f64(values)).transpose(0, 2, 1))
    return p * (a + (p * a).sum(axis=-1, keepdims=True))


def sdpa_grad_scales(weights, queries, keys, values, d_output, scale):
    """The size of the terms of dQ, dK, dV of scaled dot-product attention
    (3-D arrays, weights the softmax's (B, Nq, Nk)), as a dict q, k, v."""
    p = np.abs(_f64(weights))
    e = _score_grad_terms(weights, values, d_output)
    q, k = np.abs(_f64(queries)), np.abs(_f64(keys))
    return {
        "q": abs(scale) * float(np.matmul(e, k).max(initial=0.0)),
        "k": abs(scale) * float(np.matmul(e.transpose(0, 2, 1), q).max(initial=0.0)),
        "v": float(np.matmul(p.transpose(0, 2, 1), np.abs(_f64(d_output))).max(initial=0.0)),
    }


def additive_grad_scales(weights, queries, keys, values, W_q, W_k, w_v, d_output):
    """The size of the terms of the six gradients of additive attention, as a
    dict q, k, v, W_q, W_k, w_v (3-D inputs, nn.Linear-shaped parameters)."""
    p = np.abs(_f64(weights))
    e = _score_grad_terms(weights, values, d_output)
    q, k = _f64(queries), _f64(keys)
    wq, wk, wv = _f64(W_q), _f64(W_k), _f64(w_v).reshape(-1)
    t = np.tanh((q @ wq.T)[:, :, None, :] + (k @ wk.T)[:, None, :, :])  # (B, Nq, Nk, H)
    d_hidden = e[..., None] * np.abs(wv) * (1.0 - t * t)
    g_q, g_k = d_hidden.sum(axis=2), d_hidden.sum(axis=1)  # (B, Nq, H), (B, Nk, H)
    return {
        "q": float((g_q @ np.abs(wq)).max(initial=0.0)),
        "k": float((g_k @ np.abs(wk)).max(initial=0.0)),
        "v": float(np.matmul(p.transpose(0, 2, 1), np.abs(_f64(d_output))).max(initial=0.0)),
        "W_q": float(np.einsum("bih,bid->hd", g_q, np.abs(q)).max(initial=0.0)),
        "W_k": float(np.einsum("bjh,bjd->hd", g_k, np.abs(k)).max(initial=0.0)),
        "w_v": float(np.einsum("bij,bijh->h", e, np.abs(t)).max(initial=0.0)),
    }
