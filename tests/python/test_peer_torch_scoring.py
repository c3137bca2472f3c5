"""Peer test: bilinear and distance attention (qkv.bilinear_attention,
qkv.distance_attention and their qkv.torch autograd functions), and causal
additive attention, against PyTorch formulations written plainly here:

- bilinear: scores = torch.einsum("bqc,ce,bke->bqk", q, W, k);
- distance: scores = -scale/2 * ((q[:, :, None] - k[:, None]) ** 2).sum(-1)
  (torch.cdist's squared distances without its matrix-product shortcut);
- additive with causal (torch_formulas.additive_scores, d2l's formula; the
  causal cap as lengths), whose other cases test_peer_torch.py holds;

then the exact masked softmax of torch_formulas.py and the product with V.
Each op gets NUM_CASES fresh random cases per dtype (sizes across the SIMD
widths and block sizes, valid_lens None, (B) or (B, Nq), some strided
inputs, some causal, distance scales in [0.05, 3], and keys and queries
offset up to 1000 from the origin in a quarter of the distance cases):
forward output and lse against torch in float64, and the gradients of
every input and W through .backward() of sum(out * G) against torch
autograd. Then torch.autograd.gradcheck of qkv.torch's functions (float64,
with dropout at a fixed seed, causal, valid lengths), and the errors.

Tolerance: max|got - ref| / max(max|ref|, 1) <= 2e-5 (float32) or 1e-11
(float64), the reference in float64 on the same values (the floor 1 is the
size of the inputs: a gradient that is exactly 0 in the formulas, dQ with
one valid key, is rounding noise in both; distance's dQ and dK take the
size of their terms, scale max|q - k|, instead).
The worst errors are printed at the end of the module.
"""

import math

import numpy as np
import pytest
import torch
from torch.autograd import gradcheck

import qkv
import qkv.torch
from torch_formulas import (additive_scores, exact_masked_softmax, key_mask, random_lens,
                            relative_error)

NUM_CASES = 60
TOL = {torch.float32: 2e-5, torch.float64: 1e-11}
DTYPES = [torch.float32, torch.float64]
SIZES = (1, 2, 3, 7, 8, 16, 17, 33, 65, 100)
WORST = {}


@pytest.fixture(scope="module", autouse=True)
def report():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
    print("\ntest_peer_torch_scoring: worst relative errors")
    for key, value in sorted(WORST.items()):
        print(f"  {key}: {value:.2e}")


def check(what, op, dtype, got, want, floor=1.0):
    err = relative_error(got, want, floor)
    key = f"{op} {str(dtype).removeprefix('torch.')} {what}"
    WORST[key] = max(WORST.get(key, 0.0), err)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3e} > {TOL[dtype]:.0e}"


def bilinear_scores(q, k, W):
    return torch.einsum("bqc,ce,bke->bqk", q, W, k)


def distance_scores(q, k, scale):
    return -0.5 * scale * ((q[:, :, None, :] - k[:, None, :, :]) ** 2).sum(-1)


def causal_lens(lens, causal, batch, nq, nk):
    """The lengths with the causal cap (top-left: i + 1; bottom-right: i + 1 + Nk - Nq)."""
    if causal is None:
        return lens
    offset = 0 if causal == "top-left" else nk - nq
    cap = torch.clamp(torch.arange(nq) + 1 + offset, 0, nk)[None, :].expand(batch, nq)
    if lens is None:
        return cap.clone()
    full = lens[:, None].expand(batch, nq) if lens.dim() == 1 else lens
    return torch.minimum(full, cap)


def torch_attention(scores, v, lens):
    """(output, lse) of the exact masked softmax of `scores` times v; lse -inf for no key."""
    keep = key_mask(lens, scores.shape)
    lse = torch.logsumexp(scores.masked_fill(~keep, -math.inf), dim=-1)
    return exact_masked_softmax(scores, lens) @ v, lse


def maybe_strided(rng, t):
    """Half the time a view every other element of a bigger tensor (same values)."""
    if rng.random() < 0.5:
        return t
    big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    big[..., ::2] = t
    return big[..., ::2]


def random_case(rng, op):
    batch = int(rng.integers(1, 4))
    nq, nk = int(rng.choice(SIZES)), int(rng.choice(SIZES))
    dq, dk, dv = (int(rng.choice((1, 2, 5, 16, 20))) for _ in range(3))
    if op == "distance":
        dk = dq
    kind = [None, "B", "BNq"][int(rng.integers(3))]
    lens = random_lens(rng, kind, batch, nq, nk)
    causal = [None, None, "top-left", "bottom-right"][int(rng.integers(4))]
    return batch, nq, nk, dq, dk, dv, lens, causal


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("case", range(NUM_CASES))
def test_bilinear_against_torch(rng, dtype, case):
    batch, nq, nk, dq, dk, dv, lens, causal = random_case(rng, "bilinear")
    q64 = torch.from_numpy(rng.uniform(-1, 1, (batch, nq, dq)))
    k64 = torch.from_numpy(rng.uniform(-1, 1, (batch, nk, dk)))
    v64 = torch.from_numpy(rng.standard_normal((batch, nk, dv)))
    W64 = torch.from_numpy(rng.uniform(-1, 1, (dq, dk)) * 2 / math.sqrt(dq))
    G = torch.from_numpy(rng.standard_normal((batch, nq, dv)))
    # The case's values in its dtype, and the float64 reference on those values.
    inputs = [t.to(dtype).requires_grad_() for t in (q64, k64, v64, W64)]
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    capped = causal_lens(lens, causal, batch, nq, nk)
    want, want_lse = torch_attention(bilinear_scores(ref_in[0], ref_in[1], ref_in[3]), ref_in[2],
                                     capped)
    (want * G).sum().backward()

    args = [maybe_strided(rng, t) for t in inputs]
    out = qkv.torch.bilinear_attention(*args, lens, causal=causal)
    (out * G.to(dtype)).sum().backward()
    check("output", "bilinear", dtype, out, want)
    for name, got, ref in zip(("d_queries", "d_keys", "d_values", "d_W"), inputs, ref_in):
        check(name, "bilinear", dtype, got.grad, ref.grad)
    # lse from the NumPy-level call.
    _, lse = qkv.bilinear_attention(*(t.detach().numpy() for t in args), lens, causal=causal,
                                    return_lse=True)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.from_numpy(np.isfinite(lse)), finite)
    check("lse", "bilinear", dtype, torch.from_numpy(lse)[finite], want_lse[finite])


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("case", range(NUM_CASES // 2))
def test_causal_additive_against_torch(rng, dtype, case):
    batch, nq, nk, dq, dk, dv, lens, _ = random_case(rng, "additive")
    causal = ["top-left", "bottom-right"][case % 2]
    hidden = int(rng.choice((1, 3, 8, 17)))
    q64 = torch.from_numpy(rng.uniform(-1, 1, (batch, nq, dq)))
    k64 = torch.from_numpy(rng.uniform(-1, 1, (batch, nk, dk)))
    v64 = torch.from_numpy(rng.standard_normal((batch, nk, dv)))
    W_q64 = torch.from_numpy(rng.uniform(-1, 1, (hidden, dq)))
    W_k64 = torch.from_numpy(rng.uniform(-1, 1, (hidden, dk)))
    w_v64 = torch.from_numpy(rng.uniform(-1, 1, (1, hidden)))
    G = torch.from_numpy(rng.standard_normal((batch, nq, dv)))
    inputs = [t.to(dtype).requires_grad_() for t in (q64, k64, v64, W_q64, W_k64, w_v64)]
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    capped = causal_lens(lens, causal, batch, nq, nk)
    want, want_lse = torch_attention(
        additive_scores(ref_in[0], ref_in[1], ref_in[3], ref_in[4], ref_in[5]), ref_in[2], capped)
    (want * G).sum().backward()

    args = [maybe_strided(rng, t) for t in inputs]
    out, weights = qkv.torch.additive_attention(*args, lens, causal=causal, return_weights=True)
    (out * G.to(dtype)).sum().backward()
    check("output", "additive causal", dtype, out, want)
    check("weights", "additive causal", dtype, weights,
          exact_masked_softmax(additive_scores(*(t.detach() for t in ref_in[:2]),
                                               *(t.detach() for t in ref_in[3:])), capped))
    for name, got, ref in zip(("d_queries", "d_keys", "d_values", "d_W_q", "d_W_k", "d_w_v"),
                              inputs, ref_in):
        check(name, "additive causal", dtype, got.grad, ref.grad)
    _, lse = qkv.additive_attention(*(t.detach().numpy() for t in args), lens, causal=causal,
                                    return_lse=True)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.from_numpy(np.isfinite(lse)), finite)
    check("lse", "additive causal", dtype, torch.from_numpy(lse)[finite], want_lse[finite])


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("case", range(NUM_CASES))
def test_distance_against_torch(rng, dtype, case):
    batch, nq, nk, d, _, dv, lens, causal = random_case(rng, "distance")
    scale = float(rng.uniform(0.05, 3.0))
    offset = float(rng.choice([0.0, 0.0, 0.0, 1000.0 * rng.choice([-1, 1])]))
    q64 = torch.from_numpy(offset + rng.uniform(-1, 1, (batch, nq, d)))
    k64 = torch.from_numpy(offset + rng.uniform(-1, 1, (batch, nk, d)))
    v64 = torch.from_numpy(rng.standard_normal((batch, nk, dv)))
    G = torch.from_numpy(rng.standard_normal((batch, nq, dv)))
    inputs = [t.to(dtype).requires_grad_() for t in (q64, k64, v64)]
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    capped = causal_lens(lens, causal, batch, nq, nk)
    want, want_lse = torch_attention(distance_scores(ref_in[0], ref_in[1], scale), ref_in[2],
                                     capped)
    (want * G).sum().backward()

    args = [maybe_strided(rng, t) for t in inputs]
    out = qkv.torch.distance_attention(*args, lens, scale=scale, causal=causal)
    (out * G.to(dtype)).sum().backward()
    check("output", "distance", dtype, out, want)
    # dQ and dK sum terms scale (q - k) dS: their size, not the sum's, sets the floor.
    spread = scale * (ref_in[0].detach()[:, :, None] - ref_in[1].detach()[:, None]).abs().max()
    floors = (max(1.0, float(spread)),) * 2 + (1.0,)
    for name, got, ref, floor in zip(("d_queries", "d_keys", "d_values"), inputs, ref_in, floors):
        check(name, "distance", dtype, got.grad, ref.grad, floor)
    _, lse = qkv.distance_attention(*(t.detach().numpy() for t in args), lens, scale=scale,
                                    causal=causal, return_lse=True)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.from_numpy(np.isfinite(lse)), finite)
    check("lse", "distance", dtype, torch.from_numpy(lse)[finite], want_lse[finite])


def test_distance_matches_cdist(rng):
    """The plain formulation above is torch.cdist's squared distances."""
    q = torch.from_numpy(rng.standard_normal((2, 5, 3)))
    k = torch.from_numpy(rng.standard_normal((2, 7, 3)))
    want = -0.5 * 1.5 * torch.cdist(q, k, compute_mode="donot_use_mm_for_euclid_dist") ** 2
    assert torch.allclose(distance_scores(q, k, 1.5), want, rtol=1e-12, atol=1e-12)


# ---- gradcheck (float64 finite differences) -------------------------------------------

@pytest.mark.parametrize("lens_kind", [None, "B", "BNq"])
@pytest.mark.parametrize("causal", [None, "bottom-right"])
def test_bilinear_gradcheck(rng, lens_kind, causal):
    q = torch.from_numpy(rng.standard_normal((2, 4, 3))).requires_grad_()
    k = torch.from_numpy(rng.standard_normal((2, 6, 5))).requires_grad_()
    v = torch.from_numpy(rng.standard_normal((2, 6, 2))).requires_grad_()
    W = torch.from_numpy(rng.standard_normal((3, 5)) / 2).requires_grad_()
    lens = random_lens(rng, lens_kind, 2, 4, 6)
    seed = int(rng.integers(1 << 40))
    assert gradcheck(lambda *a: qkv.torch.bilinear_attention(*a, lens, dropout_p=0.3, seed=seed,
                                                             causal=causal),
                     (q, k, v, W))


@pytest.mark.parametrize("lens_kind", [None, "B", "BNq"])
@pytest.mark.parametrize("causal", [None, "top-left"])
def test_distance_gradcheck(rng, lens_kind, causal):
    q = torch.from_numpy(rng.standard_normal((2, 4, 3))).requires_grad_()
    k = torch.from_numpy(rng.standard_normal((2, 6, 3))).requires_grad_()
    v = torch.from_numpy(rng.standard_normal((2, 6, 2))).requires_grad_()
    lens = random_lens(rng, lens_kind, 2, 4, 6)
    seed = int(rng.integers(1 << 40))
    scale = float(rng.uniform(0.2, 2.0))
    assert gradcheck(lambda *a: qkv.torch.distance_attention(*a, lens, scale=scale, dropout_p=0.3,
                                                             seed=seed, causal=causal),
                     (q, k, v))


def test_weights_and_no_grad(rng):
    """return_weights gives the softmax weights; without autograd the same output."""
    q = torch.from_numpy(rng.standard_normal((1, 3, 2)))
    k = torch.from_numpy(rng.standard_normal((1, 4, 2)))
    v = torch.from_numpy(rng.standard_normal((1, 4, 2)))
    out, w = qkv.torch.distance_attention(q, k, v, scale=2.0, return_weights=True)
    assert torch.allclose(w, torch.softmax(distance_scores(q, k, 2.0), -1), atol=1e-14)
    assert torch.allclose(out, w @ v, atol=1e-14)
    W = torch.eye(2, dtype=torch.float64)
    out_b, w_b = qkv.torch.bilinear_attention(q, k, v, W, return_weights=True)
    assert torch.allclose(w_b, torch.softmax(q @ k.transpose(1, 2), -1), atol=1e-14)


# ---- errors ---------------------------------------------------------------------------

def test_errors():
    q, k, v = np.zeros((2, 3, 4)), np.zeros((2, 5, 3)), np.zeros((2, 5, 6))
    with pytest.raises(qkv.Error, match=r"bilinear_attention: w has shape \[3, 4\].*expected \[4, 3\]"):
        qkv.bilinear_attention(q, k, v, np.zeros((3, 4)))
    with pytest.raises(qkv.Error, match=r"distance_attention: keys has D = 3 but queries has D = 4"):
        qkv.distance_attention(q, k, v)
    with pytest.raises(qkv.Error, match=r"distance_attention: options.scale = -1.0+; expected a finite number > 0"):
        qkv.distance_attention(q, q[:, :, :4].repeat(1, 1)[:, :3], v[:, :3], scale=-1.0)
    with pytest.raises(TypeError, match="bilinear_attention"):
        qkv.bilinear_attention(q, k, v, np.zeros((4, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="distance_attention: causal = 'up'"):
        qkv.distance_attention(q, q, v[:, :3], causal="up")
    W_q, W_k, w_v = np.zeros((2, 4)), np.zeros((2, 3)), np.zeros((1, 2))
    with pytest.raises(ValueError, match="additive_attention: causal = 'up'"):
        qkv.additive_attention(q, k, v, W_q, W_k, w_v, causal="up")
    out = np.zeros((2, 3, 6))
    with pytest.raises(ValueError, match="additive_attention_backward: causal = 'lower'"):
        qkv.additive_attention_backward(q, k, v, W_q, W_k, w_v, out, np.zeros((2, 3)), out,
                                        causal="lower")
    with pytest.raises(ValueError, match="dropout_p"):
        qkv.torch.distance_attention(torch.zeros(1, 2, 2), torch.zeros(1, 2, 2),
                                     torch.zeros(1, 2, 2), dropout_p=2.0)
