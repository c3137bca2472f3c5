"""qkv.merge_attention: attention over parts of a key set merged by log-sum-exp.

- Peer: PyTorch. Attention over all the keys written in torch (float64,
  softmax(Q K^T / sqrt(D)) V and torch.logsumexp of the scores, valid lengths
  as -inf scores) equals qkv's attention over a random split of the keys
  (empty parts too) merged by qkv.merge_attention, float32 and float64, for
  no, (B) and (B, Nq) valid lengths; the merged lse equals
  torch.logsumexp over the stacked parts' lses.
- The backward of a split key set: torch's autograd of attention over all
  the keys gives the dQ, dK, dV that the parts' qkv backwards return when
  handed the merged output and lse (dQ summed over the parts).
- Rules: a part with lse -inf is not read; all parts -inf give lse -inf and
  output 0; a NaN lse gives a NaN row; the result is a MergedAttention
  named tuple of new arrays in the inputs' dtype.
- Any rank: outputs of rank 2 to 7 (strided parts, empty rows) against the
  formula in float64 NumPy.
- Errors: TypeError for a non-sequence, a non-float dtype or mixed dtypes;
  qkv.Error (a ValueError) for no parts, mismatched counts or shapes (at
  ranks past four too, named as given).
"""

import math

import numpy as np
import pytest
import torch

import qkv
from torch_formulas import draw_lens  # d2l_reference's, the peer tests' one drawer of lengths

DTYPES = [np.float32, np.float64]
TOL = {np.float32: dict(rtol=2e-4, atol=2e-5), np.float64: dict(rtol=1e-10, atol=1e-12)}


def torch_attention(q, k, v, lens):
    """Attention over all keys in float64 torch: (output, lse); valid lens as -inf scores."""
    q, k, v = (torch.from_numpy(np.asarray(a, dtype=np.float64)) for a in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if lens is not None:
        lens_t = torch.from_numpy(lens)
        if lens_t.ndim == 1:
            lens_t = lens_t[:, None].expand(scores.shape[:2])
        keep = torch.arange(k.shape[1])[None, None, :] < lens_t[:, :, None]
        scores = scores.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no key: 0
    return (weights @ v).numpy(), lse.numpy()


def random_split(rng, nk, parts):
    cuts = np.sort(rng.integers(0, nk + 1, size=parts - 1))
    return [0, *cuts.tolist(), nk]


def part_lens(lens, a, b):
    return None if lens is None else np.clip(lens - a, 0, b - a)


def attend_parts(q, k, v, lens, cuts):
    """qkv's attention with lse over each part [a, b) of the keys: ([outputs], [lses])."""
    outputs, lses = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        out, lse = qkv.scaled_dot_product_attention(
            q, k[:, a:b], v[:, a:b], part_lens(lens, a, b), return_lse=True)
        outputs.append(out)
        lses.append(lse)
    return outputs, lses


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [None, "B", "BNq"])
def test_split_attention_merged_equals_torch_over_all_keys(dtype, kind, rng):
    for _ in range(15):
        batch, nq, nk = rng.integers(1, 4), rng.integers(1, 8), rng.integers(0, 50)
        dim, dv, parts = rng.integers(1, 17), rng.integers(1, 9), rng.integers(1, 5)
        q = rng.normal(size=(batch, nq, dim)).astype(dtype)
        k = rng.normal(size=(batch, nk, dim)).astype(dtype)
        v = rng.normal(size=(batch, nk, dv)).astype(dtype)
        lens = draw_lens(rng, kind, batch, nq, nk, low=0)
        cuts = random_split(rng, nk, parts)
        outputs, lses = attend_parts(q, k, v, lens, cuts)
        merged = qkv.merge_attention(outputs, lses)
        assert isinstance(merged, qkv.MergedAttention)
        assert merged.output.dtype == dtype and merged.lse.dtype == dtype
        want_out, want_lse = torch_attention(q, k, v, lens)
        context = f"B={batch} Nq={nq} Nk={nk} cuts={cuts} lens={lens}"
        np.testing.assert_allclose(merged.output, want_out, **TOL[dtype], err_msg=context)
        np.testing.assert_allclose(merged.lse, want_lse, **TOL[dtype], err_msg=context)
        # The merge's own formula, as torch writes it.
        stacked = torch.from_numpy(np.stack(lses).astype(np.float64))
        np.testing.assert_allclose(merged.lse, torch.logsumexp(stacked, dim=0).numpy(),
                                   **TOL[dtype], err_msg=context)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_of_a_split_key_set_equals_torch_autograd(dtype, rng):
    for _ in range(10):
        batch, nq, nk = rng.integers(1, 3), rng.integers(1, 7), rng.integers(1, 40)
        dim, dv, parts = rng.integers(1, 9), rng.integers(1, 6), rng.integers(2, 5)
        q = rng.normal(size=(batch, nq, dim)).astype(dtype)
        k = rng.normal(size=(batch, nk, dim)).astype(dtype)
        v = rng.normal(size=(batch, nk, dv)).astype(dtype)
        d_out = rng.normal(size=(batch, nq, dv)).astype(dtype)
        lens = rng.integers(1, nk + 1, size=(batch, nq)).astype(np.int64)
        cuts = random_split(rng, nk, parts)
        merged = qkv.merge_attention(*attend_parts(q, k, v, lens, cuts))
        d_q = np.zeros_like(q)
        d_k, d_v = np.zeros_like(k), np.zeros_like(v)
        for a, b in zip(cuts[:-1], cuts[1:]):
            g = qkv.scaled_dot_product_attention_backward(
                q, k[:, a:b], v[:, a:b], merged.output, merged.lse, d_out,
                part_lens(lens, a, b))
            d_q += g.d_queries
            d_k[:, a:b] = g.d_keys
            d_v[:, a:b] = g.d_values

        tq, tk, tv = (torch.from_numpy(x.astype(np.float64)).requires_grad_() for x in (q, k, v))
        scores = tq @ tk.transpose(-1, -2) / math.sqrt(dim)
        keep = torch.arange(nk)[None, None, :] < torch.from_numpy(lens)[:, :, None]
        out = torch.softmax(scores.masked_fill(~keep, -math.inf), dim=-1) @ tv
        out.backward(torch.from_numpy(d_out.astype(np.float64)))
        context = f"B={batch} Nq={nq} Nk={nk} cuts={cuts}"
        np.testing.assert_allclose(d_q, tq.grad.numpy(), **TOL[dtype], err_msg=context)
        np.testing.assert_allclose(d_k, tk.grad.numpy(), **TOL[dtype], err_msg=context)
        np.testing.assert_allclose(d_v, tv.grad.numpy(), **TOL[dtype], err_msg=context)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_parts_nan_rows_and_new_arrays(dtype, rng):
    out = rng.normal(size=(2, 3, 4)).astype(dtype)
    lse = rng.normal(size=(2, 3)).astype(dtype)
    nan_out = np.full_like(out, np.nan)
    empty_lse = np.full_like(lse, -np.inf)
    merged = qkv.merge_attention([nan_out, out], (empty_lse, lse))
    np.testing.assert_array_equal(merged.output, out)  # the empty part is not read
    np.testing.assert_array_equal(merged.lse, lse)
    assert not np.shares_memory(merged.output, out) and merged.output.flags.c_contiguous
    none = qkv.merge_attention([nan_out], [empty_lse])
    np.testing.assert_array_equal(none.output, np.zeros_like(out))
    np.testing.assert_array_equal(none.lse, empty_lse)
    bad = lse.copy()
    bad[1, 2] = np.nan
    row = qkv.merge_attention([out, out], [lse, bad])
    assert np.isnan(row.lse[1, 2]) and np.isnan(row.output[1, 2]).all()
    assert np.isfinite(np.delete(row.lse.ravel(), 5)).all()


def test_errors_name_the_argument():
    out = np.zeros((2, 3, 4), np.float32)
    lse = np.zeros((2, 3), np.float32)
    with pytest.raises(TypeError, match="merge_attention: outputs is a ndarray; expected a list"):
        qkv.merge_attention(out, [lse])
    with pytest.raises(TypeError, match=r"merge_attention: lses\[0\] has dtype int64"):
        qkv.merge_attention([out], [np.zeros((2, 3), np.int64)])
    with pytest.raises(TypeError, match=r"outputs\[1\] has dtype float64 but outputs\[0\]"):
        qkv.merge_attention([out, out.astype(np.float64)], [lse, lse])
    with pytest.raises(qkv.Error, match="merge_attention: outputs is empty"):
        qkv.merge_attention([], [])
    with pytest.raises(ValueError, match="outputs has 2 parts but lses has 1"):
        qkv.merge_attention([out, out], [lse])
    with pytest.raises(qkv.Error, match=r"lses\[0\] has shape \[2, 4\]; expected \[2, 3\]"):
        qkv.merge_attention([out], [np.zeros((2, 4), np.float32)])


def numpy_merge(outputs, lses):
    """The merge in float64 NumPy, straight from the formula: lse = log sum_s
    exp(lse_s) (largest taken out), output = sum_s exp(lse_s - lse) output_s;
    a row whose parts are all -inf gets lse -inf and output 0."""
    lse_parts = np.stack([np.asarray(l, np.float64) for l in lses])
    out_parts = np.stack([np.asarray(o, np.float64) for o in outputs])
    top = lse_parts.max(axis=0)
    empty = top == -np.inf
    shifted = np.exp(lse_parts - np.where(empty, 0.0, top))
    total = shifted.sum(axis=0)
    lse = np.where(empty, -np.inf, top + np.log(np.where(empty, 1.0, total)))
    weights = np.where(empty, 0.0, shifted / np.where(empty, 1.0, total))
    # A part of weight 0 is not read (its output may be NaN).
    terms = np.where(weights[..., None] == 0, 0.0, weights[..., None] * out_parts)
    return terms.sum(axis=0), lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [2, 3, 4, 5, 6, 7])
def test_any_rank_against_the_numpy_formula(dtype, rank, rng):
    """Outputs (..., Nq, Dv) of any rank (docs/semantics.md): past qkv's four
    axes the binding folds the leading ones, so rank 5 (xformers' grouped
    heads, (B, G, H, Nq, Dv)) to 7 merge as ranks 2 to 4 do; strided parts
    (a transposed view) too."""
    for _ in range(5):
        shape = [int(n) for n in rng.integers(1, 4, size=rank - 2)] + \
            [int(rng.integers(1, 6)), int(rng.integers(1, 5))]
        parts = int(rng.integers(1, 4))
        outputs = [rng.normal(size=shape).astype(dtype) for _ in range(parts)]
        lses = [(rng.normal(size=shape[:-1]) * 3).astype(dtype) for _ in range(parts)]
        if rank >= 3:  # a strided part: the transpose of contiguous memory
            outputs[0] = np.ascontiguousarray(np.swapaxes(outputs[0], 0, -2)).swapaxes(0, -2)
        lses[0].reshape(-1)[0] = -np.inf  # a part with no keys for one row
        if parts == 1:
            outputs[0].reshape(-1, shape[-1])[0] = np.nan  # not read: its lse is -inf
        merged = qkv.merge_attention(outputs, lses)
        want_out, want_lse = numpy_merge(outputs, lses)
        context = f"shape {shape}, {parts} parts"
        assert merged.output.shape == tuple(shape) and merged.lse.shape == tuple(shape[:-1])
        assert merged.output.dtype == dtype and merged.lse.dtype == dtype
        np.testing.assert_allclose(merged.output, want_out, **TOL[dtype], err_msg=context)
        np.testing.assert_allclose(merged.lse, want_lse, **TOL[dtype], err_msg=context)


def test_errors_at_any_rank_name_the_argument_and_the_shapes():
    out = np.zeros((2, 1, 3, 3, 4), np.float32)
    lse = np.zeros((2, 1, 3, 3), np.float32)
    with pytest.raises(qkv.Error, match=r"merge_attention: outputs\[1\] has shape "
                                        r"\[1, 2, 3, 3, 4\] but outputs\[0\] has shape "
                                        r"\[2, 1, 3, 3, 4\]; every part has one shape"):
        qkv.merge_attention([out, out.reshape(1, 2, 3, 3, 4)], [lse, lse])
    with pytest.raises(qkv.Error, match=r"outputs\[1\] has shape \[2, 3, 3, 4\] but "
                                        r"outputs\[0\] has shape \[2, 1, 3, 3, 4\]"):
        qkv.merge_attention([out, out[:, 0]], [lse, lse])
    with pytest.raises(qkv.Error, match=r"lses\[1\] has shape \[2, 1, 3, 3, 1\]; expected "
                                        r"\[2, 1, 3, 3\] \(the outputs' shape \[2, 1, 3, 3, 4\]"
                                        r" without Dv\)"):
        qkv.merge_attention([out, out], [lse, lse[..., None]])
    with pytest.raises(qkv.Error, match=r"lses\[0\] has shape \[2, 1, 3, 3, 1\]; expected "
                                        r"\[2, 3, 3\]"):
        qkv.merge_attention([out[:, 0]], [lse[..., None]])
    with pytest.raises(qkv.Error, match="outputs has 2 parts but lses has 1"):
        qkv.merge_attention([out, out], [lse])
    with pytest.raises(qkv.Error, match=r"outputs\[0\] has shape \[4\]; expected rank >= 2"):
        qkv.merge_attention([np.zeros(4, np.float32)], [lse])
