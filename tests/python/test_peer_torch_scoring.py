"""Peer test: bilinear and distance attention (qkv.bilinear_attention,
qkv.distance_attention and their qkv.torch autograd functions), and causal
additive attention, against PyTorch formulations written plainly here, as a
list of cases:

- bilinear: scores = torch.einsum("bqc,ce,bke->bqk", q, W, k);
- distance: scores = -scale/2 * ((q[:, :, None] - k[:, None]) ** 2).sum(-1)
  (torch.cdist's squared distances without its matrix-product shortcut);
- additive with causal (torch_formulas.additive_scores, d2l's formula; the
  causal cap as lengths), whose other cases test_peer_torch.py holds;

then the exact masked softmax of torch_formulas.py and the product with V.
Each op gets NUM_CASES fresh random cases per dtype, one test each (sizes
across the SIMD widths and block sizes, valid_lens None, (B) or (B, Nq)
with 0 and Nk among them, some strided inputs, some causal, distance scales
in [0.05, 3], and keys and queries offset up to 1000 from the origin in a
quarter of the distance cases): forward output and lse against torch in
float64, and the gradients of every input and W through .backward() of
sum(out * G) against torch autograd. Each row of PEERS is drawn, run and
compared by peer_harness, by the one rule (d2l_reference.check_close) with
the scale 1, the size of the inputs: a gradient that is exactly 0 in the
formulas, dQ with one valid key, is rounding noise in both; distance's dQ
and dK take the size of their terms, scale max|q - k|, instead. Then
torch.autograd.gradcheck of qkv.torch's functions (float64, with dropout at
a fixed seed, causal, valid lengths), and the errors.
"""

import math

import numpy as np
import pytest
import torch
from torch.autograd import gradcheck

import qkv
import qkv.torch
from peer_harness import (  # first: puts tests/peer (d2l_reference) on sys.path
    SCORING_TOLERANCE,
    Peer,
    Want,
    draw_case,
    peer_params,
    report_worst,
    run_case,
    torch_inputs,
)
from torch_formulas import additive_scores, exact_masked_softmax, key_mask, lens_tensor

NUM_CASES = 60
SIZES = (1, 2, 3, 7, 8, 16, 17, 33, 65, 100)
NAMES = ("queries", "keys", "values")
PARAMETERS = {"bilinear": ("W",), "additive": ("W_q", "W_k", "w_v"), "distance": ()}


@pytest.fixture(scope="module", autouse=True)
def torch_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
    report_worst("test_peer_torch_scoring: worst relative errors")


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


def capped_lens(case):
    sizes = case.sizes
    return causal_lens(case.valid_lens(), case.options["causal"], sizes["B"], sizes["Nq"],
                       sizes["Nk"])


def torch_attention(scores, v, lens):
    """(output, lse) of the exact masked softmax of `scores` times v; lse -inf for no key."""
    keep = key_mask(lens, scores.shape)
    lse = torch.logsumexp(scores.masked_fill(~keep, -math.inf), dim=-1)
    return exact_masked_softmax(scores, lens) @ v, lse


# ---- the cases ----------------------------------------------------------------------------

def scoring_case(op, rng, index, dtype):
    """B from 1 to 3, Nq and Nk from SIZES, Dq, Dk and Dv from 1 to 20 (distance:
    Dk = Dq); lengths None, (B) or (B, Nq) in [0, Nk]; causal None (half the
    time), top-left or bottom-right (causal additive: alternately top-left and
    bottom-right); queries and keys uniform in [-1, 1] (distance: offset by
    +-1000 a quarter of the time), values normal; each input strided (every
    other element) half the time. Bilinear's W uniform in +-2/sqrt(Dq);
    additive's W_q, W_k, w_v uniform in [-1, 1], H from 1 to 17; distance's
    scale in [0.05, 3]."""
    dq, dk, dv = (int(rng.choice((1, 2, 5, 16, 20))) for _ in range(3))
    sizes = {"B": int(rng.integers(1, 4)), "Nq": int(rng.choice(SIZES)),
             "Nk": int(rng.choice(SIZES)), "Dq": dq, "Dk": dq if op == "distance" else dk,
             "Dv": dv}
    lens = [None, "B", "BNq"][int(rng.integers(3))]
    causal = [None, None, "top-left", "bottom-right"][int(rng.integers(4))]
    if op == "additive":
        causal = ["top-left", "bottom-right"][index % 2]
        sizes["hidden"] = int(rng.choice((1, 3, 8, 17)))
    offset = 0.0
    if op == "distance":
        offset = float(rng.choice([0.0, 0.0, 0.0, 1000.0 * rng.choice([-1, 1])]))
    case = draw_case(rng, index, dtype, sizes, lens=lens, lens_low=0, uniform=True, offset=offset,
                     op=op, causal=causal)
    if op == "bilinear":
        case.add_input("W", rng.uniform(-1, 1, (dq, dk)) * 2 / math.sqrt(dq))
    if op == "additive":
        hidden = sizes["hidden"]
        case.add_input("W_q", rng.uniform(-1, 1, (hidden, dq)))
        case.add_input("W_k", rng.uniform(-1, 1, (hidden, dk)))
        case.add_input("w_v", rng.uniform(-1, 1, (1, hidden)))
    if op == "distance":
        case.options["scale"] = float(rng.uniform(0.05, 3.0))
        case.notes += [f"scale {case.options['scale']:.4g}", f"offset {offset:g}"]
    case.options["layouts"] = {n: ("contiguous", "every other")[int(rng.random() >= 0.5)]
                               for n in NAMES + PARAMETERS[op]}
    case.notes.append(f"causal {causal}")
    return case


# ---- qkv ------------------------------------------------------------------------------------

def qkv_scoring(case):
    """qkv.torch's function of the case's op: output (additive: and weights),
    the gradients of sum(out * G) by .backward(), and lse from the NumPy
    function on the same (strided) arrays."""
    op, causal, lens = case.options["op"], case.options["causal"], case.valid_lens()
    names = NAMES + PARAMETERS[op]
    inputs = {n: torch_inputs(case, [n], case.options["layouts"][n])[n] for n in names}
    args = list(inputs.values())
    numpy_args = [t.detach().numpy() for t in args]
    results = {}
    if op == "bilinear":
        output = qkv.torch.bilinear_attention(*args, lens, causal=causal)
        _, lse = qkv.bilinear_attention(*numpy_args, lens, causal=causal, return_lse=True)
    elif op == "additive":
        output, results["weights"] = qkv.torch.additive_attention(
            *args, lens, causal=causal, return_weights=True)
        _, lse = qkv.additive_attention(*numpy_args, lens, causal=causal, return_lse=True)
    else:
        scale = case.options["scale"]
        output = qkv.torch.distance_attention(*args, lens, scale=scale, causal=causal)
        _, lse = qkv.distance_attention(*numpy_args, lens, scale=scale, causal=causal,
                                        return_lse=True)
    (output * torch.tensor(case.d_output, dtype=output.dtype)).sum().backward()
    results.update(output=output, lse=torch.from_numpy(lse))
    results.update({f"d_{n}": t.grad for n, t in inputs.items()})
    return results


def check_lse_is_finite_where_a_key_is(case, got):
    """lse is -inf exactly where the capped length is 0 (no key)."""
    capped = capped_lens(case)
    finite = torch.ones(got["lse"].shape, dtype=torch.bool)
    if capped is not None:
        finite = (capped[:, None] if capped.dim() == 1 else capped) > 0
    assert torch.equal(torch.isfinite(got["lse"]), finite.expand(got["lse"].shape)), case.desc()


# ---- torch ----------------------------------------------------------------------------------

def torch_scoring(case):
    """The op's scores in float64 on the case's values, the exact masked
    softmax with the capped lengths, times V; lse over the rows with a key;
    autograd for the gradients. Everything against the scale 1 (distance's
    dQ and dK: max(1, scale max|q - k|)) at SCORING_TOLERANCE."""
    op = case.options["op"]
    names = NAMES + PARAMETERS[op]
    leaves = {n: torch.from_numpy(case.inputs[n]).requires_grad_() for n in names}
    q, k, v = (leaves[n] for n in NAMES)
    if op == "bilinear":
        scores = bilinear_scores(q, k, leaves["W"])
    elif op == "additive":
        scores = additive_scores(q, k, *(leaves[n] for n in PARAMETERS[op]))
    else:
        scores = distance_scores(q, k, case.options["scale"])
    capped = capped_lens(case)
    output, lse = torch_attention(scores, v, capped)
    grads = torch.autograd.grad(output, list(leaves.values()), torch.from_numpy(case.d_output))
    tolerance = SCORING_TOLERANCE[case.dtype]
    want = {"output": Want(output.detach(), 1.0, tolerance),
            "lse": Want(lse.detach(), 1.0, tolerance, rows=torch.isfinite(lse).numpy()),
            "weights": Want(exact_masked_softmax(scores.detach(), capped), 1.0, tolerance)}
    floors = {}
    if op == "distance":
        # dQ and dK sum terms scale (q - k) dS: their size, not the sum's, sets the floor.
        spread = case.options["scale"] * (q.detach()[:, :, None] - k.detach()[:, None]).abs().max()
        floors = {"queries": max(1.0, float(spread)), "keys": max(1.0, float(spread))}
    want.update({f"d_{n}": Want(g, floors.get(n, 1.0), tolerance) for n, g in zip(leaves, grads)})
    return want


PEERS = [Peer(op, lambda rng, index, dtype, op=op: scoring_case(op, rng, index, dtype),
              qkv_scoring, torch_scoring, ("float32", "float64"),
              NUM_CASES // 2 if op == "additive" else NUM_CASES, check_lse_is_finite_where_a_key_is)
         for op in ("bilinear", "additive", "distance")]


@pytest.mark.parametrize("peer, dtype, index", peer_params(PEERS, each_case=True))
def test_scoring_matches_torch(peer, dtype, index, rng):
    run_case(peer, dtype, index, rng)


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
    lens = lens_tensor(rng, lens_kind, 2, 4, 6)
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
    lens = lens_tensor(rng, lens_kind, 2, 4, 6)
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
