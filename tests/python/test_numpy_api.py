"""The NumPy API's promises to Python users (issue 32, item 5):

- dropout draws a fresh seed per call unless one is given (it used to drop
  the same weights in every call, seed 0), from NumPy's global generator
  (np.random.seed repeats a run); a backward with dropout needs the
  forward's seed, given;
- one set of argument names across the NumPy and torch APIs, by the table
  in docs/architecture.md ("One name per concept across the front ends"):
  qkv.torch's scoring functions take no name the NumPy ones spell otherwise,
  and the old spelling dropout= still works with a DeprecationWarning;
- qkv.show_heatmaps writes d2l's grid of heatmaps to a PNG (SVG, PDF) of
  the size the qkv command gives it, and refuses bad arguments by name.
"""

import inspect
import os
import re
import struct

import numpy as np
import pytest

import qkv
import qkv.torch


def draw(rng, dtype=np.float32):
    q, k, v = (rng.normal(size=(2, n, 4)).astype(dtype) for n in (3, 9, 9))
    return q, k, v


FORWARDS = {
    "scaled_dot_product_attention": lambda q, k, v, **kw: qkv.scaled_dot_product_attention(
        q, k, v, **kw),
    "additive_attention": lambda q, k, v, **kw: qkv.additive_attention(
        q, k, v, np.ones((6, 4), q.dtype), np.ones((6, 4), q.dtype), np.ones(6, q.dtype), **kw),
    "bilinear_attention": lambda q, k, v, **kw: qkv.bilinear_attention(
        q, k, v, np.eye(4, dtype=q.dtype), **kw),
    "distance_attention": lambda q, k, v, **kw: qkv.distance_attention(q, k, v, **kw),
}
BACKWARDS = {
    "scaled_dot_product_attention": lambda q, k, v, o, lse, **kw:
        qkv.scaled_dot_product_attention_backward(q, k, v, o, lse, o, **kw),
    "additive_attention": lambda q, k, v, o, lse, **kw: qkv.additive_attention_backward(
        q, k, v, np.ones((6, 4), q.dtype), np.ones((6, 4), q.dtype), np.ones(6, q.dtype), o, lse,
        o, **kw),
    "bilinear_attention": lambda q, k, v, o, lse, **kw: qkv.bilinear_attention_backward(
        q, k, v, np.eye(4, dtype=q.dtype), o, lse, o, **kw),
    "distance_attention": lambda q, k, v, o, lse, **kw: qkv.distance_attention_backward(
        q, k, v, o, lse, o, **kw),
}


# ---- dropout's seed ---------------------------------------------------------------------

@pytest.mark.parametrize("fn", sorted(FORWARDS))
def test_dropout_without_a_seed_draws_a_fresh_mask_per_call(fn, rng):
    q, k, v = draw(rng)
    call = FORWARDS[fn]
    first, second = call(q, k, v, dropout_p=0.5), call(q, k, v, dropout_p=0.5)
    assert not np.array_equal(first, second), "two calls without a seed dropped the same weights"
    np.testing.assert_array_equal(call(q, k, v, dropout_p=0.5, seed=11),
                                  call(q, k, v, dropout_p=0.5, seed=11))
    state = np.random.get_state()
    try:
        np.random.seed(3)
        again = call(q, k, v, dropout_p=0.5)
        np.random.seed(3)
        np.testing.assert_array_equal(again, call(q, k, v, dropout_p=0.5))
    finally:
        np.random.set_state(state)
    # Without dropout no seed is drawn: NumPy's generator is left as it was.
    before = np.random.get_state()[1].copy()
    call(q, k, v)
    call(q, k, v, dropout_p=0.0)
    np.testing.assert_array_equal(np.random.get_state()[1], before)


@pytest.mark.parametrize("fn", sorted(BACKWARDS))
def test_backward_with_dropout_needs_the_forwards_seed(fn, rng):
    q, k, v = draw(rng, np.float64)
    output, lse = FORWARDS[fn](q, k, v, dropout_p=0.3, seed=5, return_lse=True)
    with pytest.raises(qkv.Error, match=rf"^{fn}_backward: dropout_p = 0.3 needs seed=, the "
                                        r"forward's: the backward replays"):
        BACKWARDS[fn](q, k, v, output, lse, dropout_p=0.3)
    given = BACKWARDS[fn](q, k, v, output, lse, dropout_p=0.3, seed=5)
    other = BACKWARDS[fn](q, k, v, output, lse, dropout_p=0.3, seed=6)
    assert not np.array_equal(given[2], other[2]), "the backward ignored its seed"
    plain_out, plain_lse = FORWARDS[fn](q, k, v, return_lse=True)
    BACKWARDS[fn](q, k, v, plain_out, plain_lse)  # no dropout: no seed needed


def test_seed_default_is_none_in_the_signatures():
    for fn in list(FORWARDS) + [f + "_backward" for f in BACKWARDS]:
        line = getattr(qkv, fn).__doc__.split("\n")[0]
        assert "seed: handle = None" in line, (fn, line)


# ---- one name per concept ------------------------------------------------------------

def numpy_names(fn):
    """The argument names of a NumPy-level function, from pybind11's signature line."""
    line = getattr(qkv, fn).__doc__.split("\n")[0]
    return re.findall(r"(\w+): ", line[line.index("(") + 1:])


# qkv.torch's scaled_dot_product_attention keeps torch 2's signature (the
# table's exception): its own names for the NumPy API's queries, keys,
# values, mask and causal (is_causal=True; causal= is the shared name), and
# FlashAttention's window_size for the NumPy API's window (docs/python.md).
TORCHS_OWN = {"query", "key", "value", "attn_mask", "is_causal", "enable_gqa", "window_size"}


@pytest.mark.parametrize("fn", ["masked_softmax", "scaled_dot_product_attention",
                                "additive_attention", "bilinear_attention",
                                "distance_attention"])
def test_torch_and_numpy_spell_each_argument_alike(fn):
    torch_names = set(inspect.signature(getattr(qkv.torch, fn)).parameters)
    other = torch_names - set(numpy_names(fn)) - TORCHS_OWN
    assert not other, f"qkv.torch.{fn} spells {sorted(other)}, which qkv.{fn} does not"


@pytest.mark.parametrize("fn", sorted(FORWARDS))
def test_the_old_dropout_name_warns(fn, rng):
    q, k, v = draw(rng)
    with pytest.warns(DeprecationWarning, match=rf"^{fn}: dropout= is deprecated"):
        FORWARDS[fn](q, k, v, dropout=0.2, seed=1)


# ---- show_heatmaps ---------------------------------------------------------------------

def png_size(path):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    assert b"IEND" in data[-16:], f"{path} is cut short"
    return struct.unpack(">II", data[16:24])


def test_show_heatmaps_writes_the_commands_figure(rng, tmp_path, qkv_cli, monkeypatch):
    monkeypatch.setenv("QKV_CLI", qkv_cli)
    sizes = {}
    for shape in ((1, 1, 4, 6), (1, 3, 4, 6), (2, 3, 4, 6)):
        weights = rng.random(shape)
        path = str(tmp_path / f"{'x'.join(map(str, shape))}.png")
        assert qkv.show_heatmaps(weights, xlabel="Keys", ylabel="Queries", out=path) == path
        sizes[shape[:2]] = png_size(path)
    # 2.5 inches (250 px) per panel, as `qkv heatmap` and d2l's default figsize.
    assert sizes[(1, 3)][0] - sizes[(1, 1)][0] >= 2 * 250
    assert sizes[(1, 3)][1] == sizes[(1, 1)][1]
    assert sizes[(2, 3)][0] == sizes[(1, 3)][0]
    assert sizes[(2, 3)][1] - sizes[(1, 3)][1] >= 250
    # A torch tensor (d2l passes attention_weights), titles, SVG.
    import torch
    svg = str(tmp_path / "titled.svg")
    qkv.show_heatmaps(torch.rand(1, 2, 3, 3), titles=["first", "second"], cmap="Blues", out=svg)
    with open(svg, encoding="utf-8") as f:
        text = f.read()
    assert "first" in text and "second" in text


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(matrices=np.ones((2, 2, 2, 2, 2))), ValueError,
     r"^show_heatmaps: matrices has shape \[2, 2, 2, 2, 2\]; expected \(rows, cols, Nq, Nk\)"),
    (dict(out="figure.jpg"), ValueError,
     r"^show_heatmaps: out = 'figure.jpg' names no figure format; expected"),
    (dict(titles=["a"]), ValueError,
     r"^show_heatmaps: titles has 1 titles but matrices \(shape \[1, 2, 3, 3\]\) has 2 columns$"),
    (dict(cmap="jet"), ValueError, r"^show_heatmaps: cmap = 'jet' is not one of Reds, Blues"),
    (dict(matrices=np.array([["a"]])), TypeError, r"^show_heatmaps: matrices has dtype <U1"),
    (dict(matrices=np.full((1, 1, 2, 2), np.nan)), qkv.Error,
     r"^show_heatmaps: .*nan; the values must be finite"),
])
def test_show_heatmaps_errors(kwargs, error, message, tmp_path, qkv_cli, monkeypatch):
    monkeypatch.setenv("QKV_CLI", qkv_cli)
    arguments = dict(matrices=np.ones((1, 2, 3, 3)), out=str(tmp_path / "fig.png"))
    arguments.update(kwargs)
    with pytest.raises(error, match=message):
        qkv.show_heatmaps(**arguments)
    assert not os.path.exists(tmp_path / "fig.png")


def test_show_heatmaps_without_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("QKV_CLI", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(qkv._heatmaps, "__file__", str(tmp_path / "qkv" / "_heatmaps.py"))
    with pytest.raises(RuntimeError, match=r"^show_heatmaps: draws with the qkv command"):
        qkv.show_heatmaps(np.eye(3), out=str(tmp_path / "fig.png"))
