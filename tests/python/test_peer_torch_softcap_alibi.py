"""Peer test: FlashAttention's softcap, alibi_slopes and window_size against a float64 torch formula.

The formula is FlashAttention's definition (flash_attn_func's docstring and
its tests' reference), written out here in float64: scores = Q K^T * scale,
then softcap * tanh(scores / softcap) when softcap > 0, then -inf where the
window (bottom-right aligned: keys i + Nk - Nq - left .. i + Nk - Nq + right),
is_causal (torch's top-left) or a boolean attn_mask leave a key out, then
ALiBi's -slope * |i + Nk - Nq - j| and a float attn_mask added; softmax;
times V; grouped heads by repeat_interleave. Gradients by autograd through
it. qkv computes all of it fused, forward and backward, through qkv.torch's
scaled_dot_product_attention (float32, float64, bf16) and the NumPy API's
scaled_dot_product_attention(_backward) (softcap, alibi_slopes, window).
Every query keeps its diagonal key, so the formula has no NaN row. Errors
name the function, the argument and the value.
"""

import math

import numpy as np
import pytest
import torch

import qkv
import qkv.torch
from peer_harness import (  # first: puts tests/peer (d2l_reference) on sys.path
    BF16_BIAS_GRADIENT_TOLERANCE,
    BF16_GRADIENT_TOLERANCE,
    BF16_OUTPUT_TOLERANCE,
    BF16_ROUNDING,
    GRADIENT_TOLERANCE,
    check_close,
)

NUM_CASES = 30


def fa_formula(q, k, v, *, softcap=0.0, slopes=None, window=(-1, -1), causal=False,
               keep=None, bias=None, scale=None):
    """FlashAttention's semantics in q's dtype (float64 here); q (B, H, Nq, D)
    or (B, Nq, D), slopes (H) or (B, H)."""
    three_d = q.dim() == 3
    if three_d:
        q, k, v = q[:, None], k[:, None], v[:, None]
    if q.shape[1] != k.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    batch, heads, nq, d = q.shape
    nk = k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    diagonal = i + nk - nq
    sees = torch.ones(nq, nk, dtype=torch.bool)
    if window[0] >= 0:
        sees &= j >= diagonal - window[0]
    if window[1] >= 0:
        sees &= j <= diagonal + window[1]
    if causal:
        sees &= j <= i
    if keep is not None:
        sees = sees & (keep[:, None] if three_d and keep.dim() == 3 else keep)
    scores = scores.masked_fill(~sees, float("-inf"))
    if slopes is not None:
        s = slopes.to(q.dtype)
        s = s[None, :] if s.dim() == 1 else s
        scores = scores - s[:, :, None, None] * (diagonal - j).abs().to(q.dtype)
    if bias is not None:
        scores = scores + (bias[:, None] if three_d and bias.dim() == 3 else bias)
    out = torch.matmul(torch.softmax(scores, dim=-1), v)
    return out[:, 0] if three_d else out


def draw(rng, dtype):
    """A random case: sizes (3-D or heads, grouped or not, Nq <= Nk), softcap
    (0 or 1 to 30, scores up to ~3x it), slopes none, (H) or (B, H), a window,
    is_causal (Nq = Nk then, so the diagonal stays seen) and a float or bool
    attn_mask some of the time."""
    heads4 = bool(rng.random() < 0.7)
    batch = int(rng.integers(1, 3))
    heads, kv_heads = [(1, 1), (4, 4), (4, 2), (6, 1)][int(rng.integers(4))] if heads4 else (1, 1)
    nk = int(rng.integers(1, 400))
    nq = min(int(rng.integers(1, 4)), nk) if rng.random() < 0.2 else int(rng.integers(1, nk + 1))
    causal = bool(rng.random() < 0.3)
    if causal:
        nq = nk
    d, dv = int(rng.choice([4, 16, 64])), int(rng.choice([4, 16, 64]))
    shape = (lambda *s: (batch, *s)) if heads4 else (lambda h, n, e: (batch, n, e))
    torch_dtype = {"float32": torch.float32, "float64": torch.float64,
                   "bfloat16": torch.bfloat16}[dtype]
    q = torch.from_numpy(rng.standard_normal(shape(heads, nq, d))).to(torch_dtype)
    k = torch.from_numpy(rng.standard_normal(shape(kv_heads, nk, d))).to(torch_dtype)
    v = torch.from_numpy(rng.standard_normal(shape(kv_heads, nk, dv))).to(torch_dtype)
    options = {"softcap": float(rng.uniform(1, 30)) if rng.random() < 0.7 else 0.0}
    form = int(rng.integers(3))
    if form:
        options["alibi_slopes"] = torch.from_numpy(
            rng.uniform(0, 1, (heads,) if form == 1 else (batch, heads))).float()
    if rng.random() < 0.5:
        options["window_size"] = (int(rng.integers(-1, 100)), int(rng.integers(-1, 10)))
    extra = {"is_causal": causal}
    kind = rng.random()
    scores_shape = (batch, heads, nq, nk) if heads4 else (batch, nq, nk)
    if kind < 0.2:
        bias = torch.from_numpy(rng.normal(0, 2, (nq, nk))).to(
            torch.float32 if dtype == "bfloat16" else torch_dtype)
        extra["attn_mask"] = bias
    elif kind < 0.4:
        keep = torch.from_numpy(rng.random(scores_shape) < 0.6)
        diag = torch.arange(nq) + nk - nq
        keep[..., torch.arange(nq), diag] = True
        extra["attn_mask"] = keep
    d_out = torch.from_numpy(rng.standard_normal((*q.shape[:-1], dv))).to(torch_dtype)
    return q, k, v, options, extra, d_out


def formula_of(q, k, v, options, extra):
    """The float64 formula on the case's values, with its gradients' inputs."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    mask = extra.get("attn_mask")
    out = fa_formula(q64, k64, v64, softcap=options["softcap"],
                     slopes=options.get("alibi_slopes"),
                     window=options.get("window_size", (-1, -1)), causal=extra["is_causal"],
                     keep=mask if mask is not None and mask.dtype == torch.bool else None,
                     bias=mask.double() if mask is not None and mask.dtype != torch.bool else None)
    return out, (q64, k64, v64)


def describe_case(q, k, v, options, extra):
    mask = extra.get("attn_mask")
    return (f"q {list(q.shape)} k {list(k.shape)} v {list(v.shape)} softcap {options['softcap']:.3g}"
            f" slopes {None if 'alibi_slopes' not in options else list(options['alibi_slopes'].shape)}"
            f" window {options.get('window_size')} causal {extra['is_causal']}"
            f" attn_mask {None if mask is None else (mask.dtype, list(mask.shape))}")


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_torch_api_matches_the_float64_formula(dtype, rng):
    """qkv.torch's output and gradients (query, key, value, a float
    attn_mask) against autograd through the float64 formula."""
    for _ in range(NUM_CASES if dtype != "bfloat16" else NUM_CASES // 2):
        q, k, v, options, extra, d_out = draw(rng, dtype)
        desc = describe_case(q, k, v, options, extra)
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        mask = extra.get("attn_mask")
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.clone().requires_grad_()
            inputs.append(mask)
        out = qkv.torch.scaled_dot_product_attention(
            *inputs[:3], attn_mask=mask, is_causal=extra["is_causal"], enable_gqa=True, **options)
        want, leaves = formula_of(q, k, v, options, extra)
        if dtype == "bfloat16":
            check_close("output", out, want, dtype, desc, tolerance=BF16_OUTPUT_TOLERANCE,
                        rounding=BF16_ROUNDING)
        else:
            check_close("output", out, want, dtype, desc)
        grads = torch.autograd.grad(out, inputs, d_out)
        if mask is not None and mask.dtype != torch.bool:
            leaves = (*leaves, extra["attn_mask"].double().requires_grad_())
            want = fa_formula(*leaves[:3], softcap=options["softcap"],
                              slopes=options.get("alibi_slopes"),
                              window=options.get("window_size", (-1, -1)),
                              causal=extra["is_causal"], bias=leaves[3])
        wanted = torch.autograd.grad(want, leaves, d_out.double())
        for name, g, w in zip(("d_query", "d_key", "d_value", "d_attn_mask"), grads, wanted):
            tol = (GRADIENT_TOLERANCE[dtype] if dtype != "bfloat16" else
                   BF16_BIAS_GRADIENT_TOLERANCE if name == "d_attn_mask" else
                   BF16_GRADIENT_TOLERANCE)
            check_close(name, g, w, dtype, desc, scale=1.0, tolerance=tol)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_numpy_api_matches_the_float64_formula(dtype, rng):
    """The NumPy API's softcap, alibi_slopes and window, forward and backward."""
    for _ in range(NUM_CASES):
        q, k, v, options, extra, d_out = draw(rng, dtype)
        extra = {"is_causal": extra["is_causal"]}
        desc = describe_case(q, k, v, options, extra)
        arrays = [t.numpy() for t in (q, k, v)]
        slopes = options.get("alibi_slopes")
        kwargs = {"softcap": options["softcap"],
                  "alibi_slopes": None if slopes is None else slopes.numpy(),
                  "window": options.get("window_size"),
                  "causal": "top-left" if extra["is_causal"] else None}
        out, lse = qkv.scaled_dot_product_attention(*arrays, return_lse=True, **kwargs)
        want, leaves = formula_of(q, k, v, options, extra)
        check_close("output", out, want, dtype, desc)
        grads = qkv.scaled_dot_product_attention_backward(*arrays, out, lse, d_out.numpy(),
                                                          **kwargs)
        wanted = torch.autograd.grad(want, leaves, d_out.double())
        for name, g, w in zip(grads._fields, grads, wanted):
            check_close(name, g, w, dtype, desc, scale=1.0, tolerance=GRADIENT_TOLERANCE[dtype])


def test_window_size_is_the_numpy_window_and_minus_one_is_none(rng):
    q, k, v = (torch.from_numpy(rng.standard_normal(s)) for s in
               ((2, 3, 50, 8), (2, 3, 80, 8), (2, 3, 80, 8)))
    plain = qkv.torch.scaled_dot_product_attention(q, k, v)
    assert torch.equal(qkv.torch.scaled_dot_product_attention(q, k, v, window_size=(-1, -1)),
                       plain)
    got = qkv.torch.scaled_dot_product_attention(q, k, v, window_size=(20, 3))
    want = qkv.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), window=(20, 3))
    assert np.array_equal(got.numpy(), want)
    assert not torch.equal(got, plain)


def test_causal_alibi_gives_flash_attentions_causal_outputs(rng):
    """With causal masking FlashAttention adds slope * (j - Nk + 1), which
    differs from -slope * |i + Nk - Nq - j| by a constant per query row:
    the same weights and output (the lse differs by that constant)."""
    q, k, v = (torch.from_numpy(rng.standard_normal(s)) for s in
               ((2, 4, 30, 16), (2, 4, 50, 16), (2, 4, 50, 8)))
    slopes = torch.from_numpy(rng.uniform(0, 1, (4,)))
    got = qkv.torch.scaled_dot_product_attention(q, k, v, window_size=(-1, 0),
                                                 alibi_slopes=slopes)
    nq, nk = 30, 50
    scores = torch.matmul(q, k.transpose(-1, -2)) / 4.0
    j = torch.arange(nk)
    scores = scores + slopes[:, None, None] * (j - nk + 1).double()
    scores = scores.masked_fill(j[None, :] > torch.arange(nq)[:, None] + nk - nq, float("-inf"))
    want = torch.matmul(torch.softmax(scores, dim=-1), v)
    check_close("output", got, want, "float64")


def test_softcap_caps_huge_scores():
    """Scores of 1e4: every one capped to softcap, so uniform weights."""
    q = torch.full((1, 1, 2, 4), 100.0)
    k = torch.full((1, 1, 3, 4), 100.0)
    v = torch.tensor([[[[0.0], [3.0], [6.0]]]])
    out = qkv.torch.scaled_dot_product_attention(q, k, v, softcap=2.0)
    assert torch.allclose(out, torch.full_like(out, 3.0))


def test_errors_name_the_argument_and_value():
    q = torch.zeros(2, 4, 5, 8)
    k = v = torch.zeros(2, 4, 7, 8)
    sdpa = qkv.torch.scaled_dot_product_attention
    with pytest.raises(ValueError, match=r"scaled_dot_product_attention: softcap = -1\.0; "
                                         r"expected a finite number >= 0"):
        sdpa(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="softcap = nan"):
        sdpa(q, k, v, softcap=float("nan"))
    with pytest.raises(ValueError, match="softcap = inf"):
        sdpa(q, k, v, softcap=math.inf)
    with pytest.raises(TypeError, match="softcap is '1'; expected a number"):
        sdpa(q, k, v, softcap="1")
    with pytest.raises(TypeError, match="softcap is True"):
        sdpa(q, k, v, softcap=True)
    with pytest.raises(ValueError, match=r"alibi_slopes has shape \[3\]; expected \[4\]"):
        sdpa(q, k, v, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match=r"alibi_slopes has shape \[3, 4\]"):
        sdpa(q, k, v, alibi_slopes=torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"alibi_slopes\[1, 2\] = inf is not finite"):
        slopes = torch.ones(2, 4)
        slopes[1, 2] = math.inf
        sdpa(q, k, v, alibi_slopes=slopes)
    with pytest.raises(TypeError, match="alibi_slopes must be a float tensor.*list"):
        sdpa(q, k, v, alibi_slopes=[1.0, 1.0, 1.0, 1.0])
    with pytest.raises(TypeError, match="alibi_slopes must be a float tensor.*torch.int64"):
        sdpa(q, k, v, alibi_slopes=torch.ones(4, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"window_size is \(1,\); expected \(left, right\)"):
        sdpa(q, k, v, window_size=(1,))
    with pytest.raises(TypeError, match=r"window_size is 5; expected \(left, right\)"):
        sdpa(q, k, v, window_size=5)
    with pytest.raises(TypeError, match=r"window_size is \(1\.5, 0\)"):
        sdpa(q, k, v, window_size=(1.5, 0))
    with pytest.raises(ValueError, match=r"window_size = \(-2, 0\) has a side below -1"):
        sdpa(q, k, v, window_size=(-2, 0))
    # The NumPy API: the same rules, its own names.
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    with pytest.raises(ValueError, match="scaled_dot_product_attention: softcap = -3"):
        qkv.scaled_dot_product_attention(qn, kn, vn, softcap=-3)
    with pytest.raises(TypeError, match="scaled_dot_product_attention: softcap is 'x'"):
        qkv.scaled_dot_product_attention(qn, kn, vn, softcap="x")
    with pytest.raises(ValueError, match=r"alibi_slopes has shape \[\]; expected \[4\]"):
        qkv.scaled_dot_product_attention(qn, kn, vn, alibi_slopes=0.5)
    with pytest.raises(ValueError, match=r"alibi_slopes has shape \[\]; expected \[4\]"):
        sdpa(q, k, v, alibi_slopes=torch.tensor(0.5))
    with pytest.raises(TypeError, match="alibi_slopes has dtype int64"):
        qkv.scaled_dot_product_attention(qn, kn, vn, alibi_slopes=np.ones(4, np.int64))
    with pytest.raises(ValueError, match=r"scaled_dot_product_attention_backward: "
                                         r"options.alibi_slopes has shape \[2\]"):
        out = np.zeros((2, 4, 5, 8), np.float32)
        qkv.scaled_dot_product_attention_backward(qn, kn, vn, out, np.zeros((2, 4, 5), np.float32),
                                                  out, alibi_slopes=np.ones(2))
