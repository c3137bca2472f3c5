"""qkv's scaled dot-product attention against the real thing: torch 2.13.0's
torch.nn.functional.scaled_dot_product_attention (the CPU build in the venv),
forward and backward (the gradients of sum(out * G) for query, key, value
and a float attn_mask), through both of qkv's APIs: qkv.torch's drop-in
scaled_dot_product_attention and the NumPy-level qkv.scaled_dot_product_attention
(+ _backward, for float32 and float64: mask=, bias=, causal="top-left").

The rule (PeerRule): both results are held to a reference computed in
np.longdouble from the same input values (already rounded to the dtype), and
qkv's worst error must be within a small multiple of torch's own worst error
at that dtype, plus one rounding of the largest reference value (both round
their result to the dtype: when torch's happens to be exact, on a tensor of a
few elements, qkv's final rounding alone may still cost u * |ref|; two in
bfloat16, whose intermediates qkv rounds to bfloat16: error_floor). The
multiples are the rule, not a fit: 2 for bfloat16 (errors there are mostly
the final rounding of the result to 8 bits, the same for both), 4 for
float32 and float64 (different summation orders: qkv's online softmax and
blocked products against torch's BLAS or CPU flash kernel). The worst ratio
of each run is printed.

Cases: boolean and float (additive) attn_mask of broadcastable shapes (3-D
and 4-D), is_causal (torch's top-left) for Nq < Nk, Nq = Nk and Nq > Nk,
scale=, enable_gqa (H query heads, Hkv key and value heads), sizes around
SIMD widths (1, 7, 16, 17, 64, 65, 129), with inputs drawn fresh each run.

Fully masked rows (FullyMaskedRows): torch 2.13 gives an output of 0 and
gradients of 0 for a query whose every key is masked (boolean mask all
False, or a float mask all -inf), in its math backend and its CPU flash
kernel alike; so does qkv (docs/semantics.md). Only the formula in torch's
documentation (softmax over all -inf, which is what Debian's torch 1.13
peers in test_peer_torch_*.py compute) gives NaN there.

Dropout (Dropout): qkv (Philox keyed by the seed) and torch (its global
generator) draw different masks, so they are compared by their statistics:
the mean output and gradients over many draws equal the no-dropout ones
within a confidence interval from the sample variance; the kept fraction is
1 - p within a binomial bound; kept weights are scaled by exactly 1/(1 - p);
and one draw's gradients (its mask read back through an identity V) meet the
reference with that mask, so the backward replays the forward's mask.

Errors (Errors): every argument torch rejects that qkv should reject too
(shapes, dtypes, heads, mask shapes, dropout_p > 1), qkv rejects with a
TypeError or ValueError naming the argument. Differences (Differences): where
the two disagree by design, each side's behaviour is asserted (torch
broadcasts query, key and value of different ranks, qkv only batch axes of
1; qkv combines attn_mask with is_causal, takes a float mask of another
float dtype, rejects dropout_p < 0, computes float16 in float32; D = 0
needs an explicit scale in qkv).

Run by the venv's Python (scripts/make-venv.sh) with the build tree's qkv on
PYTHONPATH: tests/CMakeLists.txt's qkv_venv_test. Fails (never skips) when
torch is not 2.13.0. The seed is printed; QKV_TEST_SEED=<seed> replays a run.
"""

import math
import os
import secrets
import statistics
import sys
import unittest
import warnings
import zlib

import numpy as np
import torch

TORCH_VERSION = "2.13.0"
if torch.__version__.split("+")[0] != TORCH_VERSION:
    raise RuntimeError(f"this peer test needs torch {TORCH_VERSION} (the venv's, "
                       f"scripts/peers-requirements.txt); found torch {torch.__version__} at "
                       f"{torch.__file__}")

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import qkv  # noqa: E402
import qkv.torch  # noqa: E402

SEED = int(os.environ.get("QKV_TEST_SEED") or secrets.randbits(32))
REPLAY = (f"seed {SEED}; replay: QKV_TEST_SEED={SEED} build/venv/bin/python "
          f"tests/python/test_peer_torch2_sdpa.py")

TORCH_DTYPE = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
NP_DTYPE = {"float32": np.float32, "float64": np.float64}
# Unit roundoff: half the spacing of the dtype's numbers at 1.
ROUNDOFF = {"bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
# qkv's worst error may be this many times torch's (see the module's docstring).
ERROR_RATIO = {"bfloat16": 2.0, "float32": 4.0, "float64": 4.0}
GRADIENTS = ("d_query", "d_key", "d_value", "d_attn_mask")

# Per dtype and API, the largest share of its bound a qkv error used and the
# largest qkv/torch error ratio (each with where), printed at the end.
WORST = {}


def rng_for(test):
    """A generator for one test, from the run's seed and the test's name."""
    return np.random.default_rng([SEED, zlib.crc32(test.id().encode())])


def rounded(array, dtype):
    """float64 values rounded to `dtype`, still float64 (bf16 as torch rounds float32)."""
    t = torch.from_numpy(np.asarray(array, dtype=np.float64))
    return t.to(TORCH_DTYPE[dtype]).double().numpy()


# ---- the reference: plain formulas in long double -------------------------------------

def reference(q, k, v, G, *, keep=None, bias=None, causal=False, scale=None, drop=None):
    """Forward and backward of softmax(scale Q K^T + bias, masked) V in np.longdouble.

    q (..., Nq, D), k (..., Nk, D), v (..., Nk, Dv) (4-D: key and value heads
    repeated to the query heads, query head h reads h // (H / Hkv)), G the
    output's gradient; keep a boolean attn_mask and bias a float one, each
    broadcast against the scores (..., Nq, Nk); causal: key j <= query i
    (torch's top-left); drop the dropout multipliers (mask / (1 - p)) or None.
    A query with no key left gets weights 0. Returns the output and the
    gradients of sum(output * G): d_query, d_key, d_value (summed over a key
    head's query heads) and d_attn_mask (summed over the axes the bias
    broadcasts along; None without a bias); and under "magnitude" the same
    formulas on absolute values (sum_j P_ij |v_j| for the output, ...): the
    size of the terms each result sums, which its rounding errors scale with
    (a result that cancels to 0, such as d_query with one key, still sums
    terms of that size)."""
    q, k, v, G = (np.asarray(x, dtype=np.longdouble) for x in (q, k, v, G))
    group = 1
    if q.ndim == 4 and q.shape[1] != k.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    nq, nk = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scale = np.longdouble(scale)
    scores = scale * (q @ np.swapaxes(k, -1, -2))
    if bias is not None:
        scores = scores + np.asarray(bias, dtype=np.longdouble)
    allowed = np.ones(scores.shape, dtype=bool)
    if keep is not None:
        allowed &= np.broadcast_to(keep, scores.shape)
    if causal:
        allowed &= np.tril(np.ones((nq, nk), dtype=bool))
    allowed &= scores > -np.inf  # a -inf bias leaves a key out
    scores = np.where(allowed, scores, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0)
    e = np.where(allowed, np.exp(scores - top), 0)
    total = e.sum(axis=-1, keepdims=True)
    p = e / np.where(total > 0, total, 1)
    dropped = p if drop is None else p * drop
    out = dropped @ v
    d_value = np.swapaxes(dropped, -1, -2) @ G
    d_p = G @ np.swapaxes(v, -1, -2)
    if drop is not None:
        d_p = d_p * drop
    d_s = p * (d_p - (p * d_p).sum(axis=-1, keepdims=True))
    d_query = scale * (d_s @ k)
    d_key = scale * (np.swapaxes(d_s, -1, -2) @ q)
    if group > 1:
        b, h = d_key.shape[:2]
        d_key = d_key.reshape(b, h // group, group, *d_key.shape[2:]).sum(axis=2)
        d_value = d_value.reshape(b, h // group, group, *d_value.shape[2:]).sum(axis=2)
    d_mask = None
    if bias is not None:
        d_mask = sum_to_shape(d_s, np.shape(bias))
    # The magnitudes: |dS| <= P (|dP| + |sum_j P_j dP_j|).
    abs_dropped, abs_d_p = np.abs(dropped), np.abs(G) @ np.swapaxes(np.abs(v), -1, -2)
    if drop is not None:
        abs_d_p = abs_d_p * drop
    abs_d_s = p * (abs_d_p + np.abs((p * d_p).sum(axis=-1, keepdims=True)))
    magnitude = {"output": abs_dropped @ np.abs(v),
                 "d_query": abs(scale) * (abs_d_s @ np.abs(k)),
                 "d_key": abs(scale) * (np.swapaxes(abs_d_s, -1, -2) @ np.abs(q)),
                 "d_value": np.swapaxes(abs_dropped, -1, -2) @ np.abs(G),
                 "d_attn_mask": abs_d_s}
    magnitude = {name: float(np.max(m, initial=0.0)) for name, m in magnitude.items()}
    # The size of a score's terms, |scale| sum_d |q_d k_d| + |bias|, over the
    # keys that take part: a score's rounding error scales with it, and the
    # softmax turns that absolute error into a relative error of P.
    score_terms = abs(scale) * (np.abs(q) @ np.swapaxes(np.abs(k), -1, -2))
    if bias is not None:
        score_terms = score_terms + np.abs(np.where(np.isfinite(bias), bias, 0))
    score_size = float(np.max(np.where(allowed, score_terms, 0), initial=0.0))
    return {"output": out, "d_query": d_query, "d_key": d_key, "d_value": d_value,
            "d_attn_mask": d_mask, "magnitude": magnitude, "score_size": score_size}


def sum_to_shape(x, shape):
    """x summed over the axes along which `shape` broadcasts to x's shape."""
    lead = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(lead))) if lead else x
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


# ---- the three implementations on one case -------------------------------------------

class Case:
    """One problem: float64 input values (rounded per dtype by `inputs`), a
    boolean mask `keep` or a float mask `bias` (or neither), is_causal, scale,
    enable_gqa."""

    def __init__(self, name, rng, q_shape, k_shape, dv, *, mask=None, mask_shape=None,
                 causal=False, scale=None, gqa=False, mask_grad=True):
        self.name, self.causal, self.scale, self.gqa = name, causal, scale, gqa
        # torch 2.13 runs a float mask that requires grad in its math backend
        # only; without, 4-D inputs with D = Dv go to its CPU flash kernel.
        self.mask_grad = mask_grad
        v_shape = (*k_shape[:-1], dv)
        out_shape = (*q_shape[:-1], dv)
        self.values = {"q": rng.standard_normal(q_shape), "k": rng.standard_normal(k_shape),
                       "v": rng.standard_normal(v_shape), "G": rng.standard_normal(out_shape)}
        self.keep = self.bias = None
        if mask == "bool":
            self.keep = rng.random(mask_shape) > 0.3
        elif mask == "float":
            bias = 2.0 * rng.standard_normal(mask_shape)
            bias[rng.random(mask_shape) < 0.1] = -np.inf
            self.bias = bias

    def describe(self):
        shapes = [list(self.values[n].shape) for n in ("q", "k", "v")]
        mask = ("" if self.keep is None and self.bias is None else
                f" {'bool' if self.keep is not None else 'float'} attn_mask "
                f"{list((self.keep if self.keep is not None else self.bias).shape)}")
        return (f"{self.name}: q, k, v {shapes}{mask}"
                f"{' is_causal' if self.causal else ''}"
                f"{'' if self.scale is None else f' scale={self.scale}'}"
                f"{' enable_gqa' if self.gqa else ''}")

    def inputs(self, dtype):
        """The inputs rounded to dtype (float64 arrays) and the bias rounded likewise."""
        vals = {n: rounded(x, dtype) for n, x in self.values.items()}
        bias = None if self.bias is None else rounded(self.bias, dtype)
        return vals, bias

    def reference(self, dtype):
        vals, bias = self.inputs(dtype)
        return reference(vals["q"], vals["k"], vals["v"], vals["G"], keep=self.keep, bias=bias,
                         causal=self.causal, scale=self.scale)

    def run_torch_api(self, sdpa, dtype):
        """torch's or qkv.torch's scaled_dot_product_attention: output and gradients."""
        vals, bias = self.inputs(dtype)
        tdtype = TORCH_DTYPE[dtype]
        q, k, v = (torch.tensor(vals[n], dtype=tdtype, requires_grad=True) for n in "qkv")
        attn_mask = None
        if self.keep is not None:
            attn_mask = torch.from_numpy(self.keep)
        elif bias is not None:
            attn_mask = torch.tensor(bias, dtype=tdtype, requires_grad=self.mask_grad)
        out = sdpa(q, k, v, attn_mask=attn_mask, is_causal=self.causal, scale=self.scale,
                   enable_gqa=self.gqa)
        out.backward(torch.tensor(vals["G"], dtype=tdtype))
        results = {"output": out, "d_query": q.grad, "d_key": k.grad, "d_value": v.grad}
        if bias is not None and self.mask_grad:
            results["d_attn_mask"] = attn_mask.grad
        for name, t in results.items():
            if t.dtype != tdtype:
                raise AssertionError(f"{self.describe()}: {name} has dtype {t.dtype}, not {tdtype}")
        return {name: t.detach().double().numpy() for name, t in results.items()}

    def run_numpy_api(self, dtype):
        """qkv.scaled_dot_product_attention and its backward (float32, float64)."""
        vals, bias = self.inputs(dtype)
        q, k, v, G = (vals[n].astype(NP_DTYPE[dtype]) for n in ("q", "k", "v", "G"))
        options = {"scale": self.scale, "causal": "top-left" if self.causal else None,
                   "mask": self.keep,
                   "bias": None if bias is None else bias.astype(NP_DTYPE[dtype])}
        out, lse = qkv.scaled_dot_product_attention(q, k, v, return_lse=True, **options)
        grads = qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, G, **options,
                                                          bias_grad=self.mask_grad)
        results = {"output": out, "d_query": grads.d_queries, "d_key": grads.d_keys,
                   "d_value": grads.d_values}
        if bias is not None and self.mask_grad:
            results["d_attn_mask"] = grads.d_bias
        return {name: np.asarray(a, dtype=np.float64) for name, a in results.items()}


def error_floor(shapes, dtype, largest, magnitude, score_size):
    """The error any sound implementation may have whatever torch's happens
    to be, so that qkv is not held to torch's luck: the final rounding of the
    largest result to the dtype (u largest), plus, in the compute type's u_c
    (float32 for bf16), times the size of the terms the result sums
    (`magnitude`, the reference's):
      - sqrt(n) for the sums over n = Nk + D + Dv terms (the typical error:
        Higham and Mary's probabilistic bound with lambda = 1);
      - 2 score_size for P: a score rounded with an absolute error of
        u_c score_size gives P a relative error of as much, twice where P
        is exp(S - lse) from a rounded lse (FlashAttention's backward, qkv's:
        measured 27.6 ulps of P against torch's softmax's 14.2, scores of
        size 8).
    In bfloat16 the final rounding counts twice: qkv rounds P (forward) and
    dO, P, dS (backward) to bfloat16 for its products (docs/semantics.md,
    "bfloat16 inputs"), so its float32 result may sit past a rounding midpoint
    that torch's, float32 throughout, does not reach, and round to the other
    neighbour: one ulp, where torch is at most half (seed 2411668556: a
    d_query of -2.0156 given as -2.03125, 1.01 of the bound with one rounding).
    It matters where torch's own error is a rounding or two or none:
    float64, a tensor of a few elements, a result that cancels to 0."""
    compute = ROUNDOFF["float64" if dtype == "float64" else "float32"]
    q_shape, k_shape, v_shape = shapes
    n = k_shape[-2] + q_shape[-1] + v_shape[-1]
    roundings = 2 if dtype == "bfloat16" else 1
    return (roundings * ROUNDOFF[dtype] * largest
            + (math.sqrt(n) + 2 * score_size) * compute * magnitude)


def note_error(dtype, api, ours, peer, bound, where):
    used, ratio = WORST.get((dtype, api), ((-1.0, ""), (-1.0, "")))
    if ours / bound >= used[0]:
        used = (ours / bound, where)
    if peer > 0 and ours / peer >= ratio[0]:
        ratio = (ours / peer, where)
    WORST[(dtype, api)] = (used, ratio)


def peer_rule(test, case, dtype, api, ref, ours, theirs):
    """Every result of `ours` (qkv) within ERROR_RATIO x torch's error against
    the reference, plus error_floor (a rounding of the largest reference value,
    two in bfloat16, and the compute type's typical summation error)."""
    test.assertEqual(set(ours), set(theirs), f"{case.describe()} {dtype} {api}: results")
    for name, peer in theirs.items():
        want = np.asarray(ref[name], dtype=np.float64)
        got = ours[name]
        test.assertEqual(got.shape, want.shape, f"{case.describe()} {dtype} {api}: {name} shape")
        test.assertEqual(peer.shape, want.shape, f"{case.describe()} {dtype} torch: {name} shape")
        test.assertFalse(np.isnan(peer).any(), f"{case.describe()} {dtype}: torch's {name} has NaN")
        error = np.abs(got - want)
        ours_error = float(np.max(error, initial=0.0)) if not np.isnan(got).any() else math.inf
        peer_error = float(np.max(np.abs(peer - want), initial=0.0))
        floor = error_floor([case.values[n].shape for n in "qkv"], dtype,
                            float(np.max(np.abs(want), initial=0.0)), ref["magnitude"][name],
                            ref["score_size"])
        bound = ERROR_RATIO[dtype] * peer_error + floor
        note_error(dtype, api, ours_error, peer_error, bound, f"{case.describe()}: {name}")
        if not ours_error <= bound:
            where = np.unravel_index(np.nanargmax(np.where(np.isnan(error), np.inf, error)),
                                     error.shape)
            test.fail(f"{case.describe()} {dtype} {api}: {name} error {ours_error:.3g} > "
                      f"{ERROR_RATIO[dtype]} x torch's {peer_error:.3g} + {floor:.3g}; worst at "
                      f"{tuple(int(i) for i in where)}: qkv {got[where]!r}, torch {peer[where]!r}, "
                      f"reference {want[where]!r}; {REPLAY}")


def check_case(test, case, dtypes=("float32", "bfloat16", "float64")):
    for dtype in dtypes:
        ref = case.reference(dtype)
        theirs = case.run_torch_api(F.scaled_dot_product_attention, dtype)
        ours = case.run_torch_api(qkv.torch.scaled_dot_product_attention, dtype)
        peer_rule(test, case, dtype, "qkv.torch", ref, ours, theirs)
        if dtype != "bfloat16":  # the NumPy API takes float32 and float64
            peer_rule(test, case, dtype, "qkv (NumPy)", ref, case.run_numpy_api(dtype), theirs)


# ---- forward and backward against torch ------------------------------------------------

class Peers(unittest.TestCase):
    """qkv against torch 2.13 on the same inputs, forward and backward (see PeerRule above)."""

    def cases(self, specs):
        rng = rng_for(self)
        for name, q_shape, k_shape, dv, options in specs:
            with self.subTest(case=name):
                check_case(self, Case(name, rng, q_shape, k_shape, dv, **options))

    def test_plain(self):
        self.cases([
            ("one of each", (2, 1, 1), (2, 1, 1), 1, {}),
            ("3-D around 16", (3, 7, 16), (3, 17, 16), 7, {}),
            ("3-D around 64", (1, 65, 64), (1, 129, 64), 65, {}),
            ("4-D", (2, 2, 17, 17), (2, 2, 16, 17), 17, {}),
            ("4-D, torch's CPU flash kernel (D = Dv)", (1, 3, 129, 64), (1, 3, 65, 64), 64, {}),
            ("2-D", (7, 16), (17, 16), 7, {}),
        ])

    def test_boolean_mask(self):
        self.cases([
            ("(Nq, Nk)", (2, 16, 7), (2, 65, 7), 16, {"mask": "bool", "mask_shape": (16, 65)}),
            ("key padding (B, 1, Nk)", (3, 17, 16), (3, 7, 16), 17,
             {"mask": "bool", "mask_shape": (3, 1, 7)}),
            ("(B, H, Nq, Nk)", (2, 2, 16, 17), (2, 2, 65, 17), 17,
             {"mask": "bool", "mask_shape": (2, 2, 16, 65)}),
            ("(1, H, 1, Nk)", (2, 3, 7, 64), (2, 3, 129, 64), 64,
             {"mask": "bool", "mask_shape": (1, 3, 1, 129)}),
            ("(B, 1, Nq, Nk), one key", (2, 2, 17, 16), (2, 2, 1, 16), 16,
             {"mask": "bool", "mask_shape": (2, 1, 17, 1)}),
        ])

    def test_float_mask(self):
        self.cases([
            ("(Nq, Nk)", (2, 16, 7), (2, 65, 7), 16, {"mask": "float", "mask_shape": (16, 65)}),
            ("(1, H, Nq, Nk)", (2, 2, 17, 16), (2, 2, 64, 16), 16,
             {"mask": "float", "mask_shape": (1, 2, 17, 64)}),
            ("(B, 1, 1, Nk)", (2, 3, 7, 64), (2, 3, 129, 64), 64,
             {"mask": "float", "mask_shape": (2, 1, 1, 129)}),
            ("(B, H, Nq, Nk) without its gradient (torch's CPU flash kernel)", (1, 2, 17, 64),
             (1, 2, 65, 64), 64,
             {"mask": "float", "mask_shape": (1, 2, 17, 65), "mask_grad": False}),
            ("(Nq, 1): constant along the keys", (3, 17, 16), (3, 17, 16), 7,
             {"mask": "float", "mask_shape": (17, 1)}),
        ])

    def test_causal(self):
        self.cases([
            ("Nq < Nk", (2, 7, 16), (2, 65, 16), 17, {"causal": True}),
            ("Nq = Nk, 4-D (CPU flash kernel)", (1, 2, 64, 64), (1, 2, 64, 64), 64,
             {"causal": True}),
            ("Nq > Nk", (1, 2, 129, 16), (1, 2, 17, 16), 7, {"causal": True}),
            ("Nq = Nk = 1", (2, 1, 7), (2, 1, 7), 7, {"causal": True}),
        ])

    def test_scale(self):
        self.cases([
            ("scale 0.3", (2, 17, 16), (2, 65, 16), 7, {"scale": 0.3}),
            ("scale 2, causal", (1, 2, 16, 7), (1, 2, 17, 7), 16, {"scale": 2.0, "causal": True}),
            ("scale 0.05, float mask", (2, 2, 7, 64), (2, 2, 65, 64), 64,
             {"scale": 0.05, "mask": "float", "mask_shape": (7, 65)}),
        ])

    def test_grouped_query_attention(self):
        self.cases([
            ("H 4, Hkv 2", (2, 4, 17, 16), (2, 2, 65, 16), 16, {"gqa": True}),
            ("H 6, Hkv 1 (multi-query), bool mask", (1, 6, 16, 7), (1, 1, 17, 7), 7,
             {"gqa": True, "mask": "bool", "mask_shape": (1, 6, 16, 17)}),
            ("H 4, Hkv 2, causal Nq > Nk", (1, 4, 65, 17), (1, 2, 16, 17), 17,
             {"gqa": True, "causal": True}),
            ("H 8, Hkv 2, decoding (Nq 1)", (2, 8, 1, 64), (2, 2, 129, 64), 64, {"gqa": True}),
            ("H 4, Hkv 2, float mask (B, H, 1, Nk)", (2, 4, 7, 16), (2, 2, 65, 16), 16,
             {"gqa": True, "mask": "float", "mask_shape": (2, 4, 1, 65)}),
            ("H = Hkv with enable_gqa", (1, 2, 7, 16), (1, 2, 17, 16), 7, {"gqa": True}),
        ])


# ---- queries with no key left ------------------------------------------------------------

class FullyMaskedRows(unittest.TestCase):
    """A query whose every key is masked: torch 2.13 gives output 0 and
    gradients 0 (its math backend and its CPU flash kernel, for bool and -inf
    float masks, in every dtype), and so does qkv, whose documented rule
    (docs/semantics.md: a query left with no key gets output 0, lse -inf,
    zero gradients) this is. Torch's documentation's formula, a softmax over
    all -inf, gives NaN; torch 2.13 itself does not. Checked exactly (0, not
    close to 0), with no NaN anywhere, and the other rows by the peer rule."""

    def masked_rows_case(self, rng, q_shape, k_shape, mask_kind):
        case = Case("fully masked rows", rng, q_shape, k_shape, k_shape[-1],
                    mask=mask_kind, mask_shape=(*q_shape[:-1], k_shape[-2]))
        rows = rng.random(q_shape[:-1]) < 0.3
        rows.reshape(-1)[0] = True  # at least one
        if mask_kind == "bool":
            case.keep[rows] = False
        else:
            case.bias[rows] = -np.inf
        return case, rows

    def test_zero_output_and_gradients(self):
        rng = rng_for(self)
        for shapes in (((2, 7, 16), (2, 17, 16)), ((1, 2, 16, 64), (1, 2, 65, 64))):
            for mask_kind in ("bool", "float"):
                case, rows = self.masked_rows_case(rng, *shapes, mask_kind)
                for dtype in ("float32", "bfloat16", "float64"):
                    # torch's default dispatch last: its results are the peer's below.
                    backends = [SDPBackend.MATH, None]
                    if len(shapes[0]) == 4:  # its CPU flash kernel needs 4-D and D = Dv
                        backends.insert(0, SDPBackend.FLASH_ATTENTION)
                    for backend in backends:
                        def torch_sdpa(*args, **kwargs):
                            if backend is None:
                                return F.scaled_dot_product_attention(*args, **kwargs)
                            with sdpa_kernel([backend]):
                                return F.scaled_dot_product_attention(*args, **kwargs)
                        where = f"{case.describe()} {dtype} torch backend {backend}; {REPLAY}"
                        # Flash takes no float mask that requires grad.
                        case.mask_grad = backend != SDPBackend.FLASH_ATTENTION
                        theirs = case.run_torch_api(torch_sdpa, dtype)
                        self.assertTrue((theirs["output"][rows] == 0).all(), where)
                        self.assertTrue((theirs["d_query"][rows] == 0).all(), where)
                        if "d_attn_mask" in theirs:  # no gradient reaches a masked row's bias
                            self.assertTrue((theirs["d_attn_mask"][rows] == 0).all(), where)
                        for name, t in theirs.items():
                            self.assertFalse(np.isnan(t).any(), f"{where}: torch's {name}")
                    ours = case.run_torch_api(qkv.torch.scaled_dot_product_attention, dtype)
                    where = f"{case.describe()} {dtype} qkv.torch; {REPLAY}"
                    self.assertTrue((ours["output"][rows] == 0).all(), where)
                    self.assertTrue((ours["d_query"][rows] == 0).all(), where)
                    if "d_attn_mask" in ours:
                        self.assertTrue((ours["d_attn_mask"][rows] == 0).all(), where)
                    for name, t in ours.items():
                        self.assertFalse(np.isnan(t).any(), f"{where}: qkv's {name}")
                    peer_rule(self, case, dtype, "qkv.torch", case.reference(dtype), ours, theirs)


# ---- dropout, by its statistics -------------------------------------------------------------

def bonferroni_z(count, alpha=1e-6):
    """The two-sided normal quantile that keeps `count` tests' family-wise
    false-alarm rate under alpha."""
    return statistics.NormalDist().inv_cdf(1 - alpha / (2 * count))


class Dropout(unittest.TestCase):
    P = 0.3

    def test_mean_over_draws_is_the_no_dropout_result(self):
        """E[dropout(P) V] = P V and, since every gradient is linear in the
        mask, E[gradient] = the no-dropout gradient: the mean over N draws
        within z s / sqrt(N) of the no-dropout result, per element (s the
        sample standard deviation, z Bonferroni's over all elements at a
        family-wise alpha of 1e-6), for qkv.torch and torch alike."""
        rng = rng_for(self)
        draws = 300
        q, k, v, G = (torch.from_numpy(rng.standard_normal(s)) for s in
                      ((2, 2, 16, 17), (2, 2, 17, 17), (2, 2, 17, 7), (2, 2, 16, 7)))

        def run(sdpa, p):
            tensors = [t.clone().requires_grad_() for t in (q, k, v)]
            out = sdpa(*tensors, dropout_p=p)
            out.backward(G)
            return [out.detach()] + [t.grad for t in tensors]

        for name, sdpa in (("qkv.torch", qkv.torch.scaled_dot_product_attention),
                           ("torch", F.scaled_dot_product_attention)):
            exact = run(sdpa, 0.0)
            samples = [torch.stack(s) for s in zip(*(run(sdpa, self.P) for _ in range(draws)))]
            count = sum(e.numel() for e in exact)
            z = bonferroni_z(count)
            for label, e, s in zip(("output", "d_query", "d_key", "d_value"), exact, samples):
                mean, spread = s.mean(0), s.std(0)
                bound = z * spread / math.sqrt(draws) + 1e-12
                worst = ((mean - e).abs() / bound).max().item()
                self.assertLessEqual(worst, 1.0, f"{name} {label}: mean over {draws} draws off "
                                     f"by {worst:.2f} x the bound (z = {z:.2f}); {REPLAY}")
                self.assertTrue((spread > 0).all(), f"{name} {label}: a draw-invariant element")

    def test_kept_fraction_and_scaling(self):
        """With V the identity, each draw's output is the weights times the
        dropout multipliers, P * mask / (1 - p): kept entries are scaled by
        exactly 1/(1 - p) (to float64 rounding) and the kept fraction over
        all draws is 1 - p within 6 binomial standard deviations, for
        qkv.torch and torch alike."""
        rng = rng_for(self)
        nq, nk, draws = 16, 17, 100
        q, k = (torch.from_numpy(rng.standard_normal((2, 2, n, 16))) for n in (nq, nk))
        eye = torch.eye(nk, dtype=torch.float64).expand(2, 2, nk, nk)
        weights = F.scaled_dot_product_attention(q, k, eye)
        for name, sdpa in (("qkv.torch", qkv.torch.scaled_dot_product_attention),
                           ("torch", F.scaled_dot_product_attention)):
            kept = 0
            for _ in range(draws):
                out = sdpa(q, k, eye, dropout_p=self.P)
                keep = out != 0
                kept += int(keep.sum())
                multiplier = out[keep] / weights[keep]
                self.assertLess((multiplier - 1 / (1 - self.P)).abs().max().item(), 1e-12,
                                f"{name}: kept weights not scaled by 1/(1 - p); {REPLAY}")
            n = draws * weights.numel()
            bound = 6 * math.sqrt(self.P * (1 - self.P) / n)
            self.assertLess(abs(kept / n - (1 - self.P)), bound,
                            f"{name}: kept {kept} of {n}, {kept / n:.5f} vs 1 - p = "
                            f"{1 - self.P} (bound {bound:.5f}); {REPLAY}")

    def test_backward_replays_the_forward_mask(self):
        """One draw's mask read back through an identity V (as above), then
        the reference with that mask: qkv.torch's and torch's gradients of
        that same draw both meet it, by the peer rule (float64 and float32)."""
        rng = rng_for(self)
        nq, nk = 17, 16
        for dtype in ("float64", "float32"):
            tdtype = TORCH_DTYPE[dtype]
            vals = {n: rounded(rng.standard_normal(s), dtype) for n, s in
                    (("q", (2, 3, nq, 16)), ("k", (2, 3, nk, 16)), ("v", (2, 3, nk, 7)),
                     ("G", (2, 3, nq, 7)))}
            eye = torch.eye(nk, dtype=tdtype).expand(2, 3, nk, nk)
            results, refs = {}, {}
            for name, sdpa in (("qkv.torch", qkv.torch.scaled_dot_product_attention),
                               ("torch", F.scaled_dot_product_attention)):
                q, k, v = (torch.tensor(vals[n], dtype=tdtype, requires_grad=True) for n in "qkv")
                # The same mask twice: qkv from one seed, torch from one generator state.
                state = torch.get_rng_state()
                seeded = {"seed": 1 + int(rng.integers(2**62))} if name == "qkv.torch" else {}
                mask = sdpa(q.detach(), k.detach(), eye, dropout_p=self.P, **seeded) != 0
                torch.set_rng_state(state)
                out = sdpa(q, k, v, dropout_p=self.P, **seeded)
                out.backward(torch.tensor(vals["G"], dtype=tdtype))
                drop = mask.double().numpy() / (1 - self.P)
                refs[name] = reference(vals["q"], vals["k"], vals["v"], vals["G"], drop=drop)
                results[name] = {"output": out.detach().double().numpy(),
                                 "d_query": q.grad.double().numpy(),
                                 "d_key": k.grad.double().numpy(),
                                 "d_value": v.grad.double().numpy()}
            # Each against the reference of its own mask; torch's error sets the bar.
            where = f"dropout p={self.P}, one draw's mask replayed, {dtype}"
            for label in results["torch"]:
                ref = refs["qkv.torch"][label]
                ours_error = float(np.max(np.abs(results["qkv.torch"][label] - ref)))
                peer_error = float(np.max(np.abs(results["torch"][label] - refs["torch"][label])))
                floor = error_floor([vals[n].shape for n in "qkv"], dtype,
                                    float(np.max(np.abs(ref))),
                                    refs["qkv.torch"]["magnitude"][label],
                                    refs["qkv.torch"]["score_size"])
                bound = ERROR_RATIO[dtype] * peer_error + floor
                note_error(dtype, "dropout", ours_error, peer_error, bound, f"{where}: {label}")
                self.assertLessEqual(ours_error, bound,
                                     f"{where}: {label} error {ours_error:.3g}, torch's "
                                     f"{peer_error:.3g}; {REPLAY}")


# ---- errors ------------------------------------------------------------------------------------

def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


class Errors(unittest.TestCase):
    """Arguments torch 2.13 rejects: qkv.torch rejects them too, with a
    TypeError or ValueError (qkv.Error is a ValueError) whose message names
    the argument (or the tensor, as the message's `words` say)."""

    CASES = [
        # name, arguments, keyword arguments, qkv's exception, words its message must hold
        ("query and key of different D", (randn(2, 3, 4), randn(2, 5, 3), randn(2, 5, 4)), {},
         ValueError, ("keys has D = 3", "queries has D = 4")),
        ("key and value of different Nk", (randn(2, 3, 4), randn(2, 5, 4), randn(2, 6, 4)), {},
         ValueError, ("values has Nk = 6", "keys has Nk = 5")),
        ("batch sizes that do not broadcast", (randn(2, 3, 4), randn(3, 5, 4), randn(3, 5, 4)),
         {}, ValueError, ("keys has B = 3",)),
        ("1-D query", (randn(4), randn(5, 4), randn(5, 4)), {}, ValueError,
         ("same rank, at least 2", "[4]")),
        ("mixed dtypes", (randn(2, 3, 4), randn(2, 5, 4, dtype=torch.float64), randn(2, 5, 4)),
         {}, TypeError, ("key has dtype float64", "query has float32")),
        ("integer tensors", tuple(torch.ones(2, n, 4, dtype=torch.int64) for n in (3, 5, 5)), {},
         TypeError, ("query has dtype int64",)),
        ("a NumPy array for query", (randn(2, 3, 4).numpy(), randn(2, 5, 4), randn(2, 5, 4)), {},
         TypeError, ("query is a ndarray",)),
        ("more query heads without enable_gqa", (randn(1, 4, 3, 4), randn(1, 2, 5, 4),
                                                 randn(1, 2, 5, 4)), {},
         ValueError, ("query has 4 heads but key has 2", "enable_gqa=True")),
        ("query heads not a multiple of key heads",
         (randn(1, 3, 3, 4), randn(1, 2, 5, 4), randn(1, 2, 5, 4)), {"enable_gqa": True},
         ValueError, ("H = 3", "Hkv = 2")),
        ("attn_mask of the wrong Nk", (randn(2, 3, 4), randn(2, 5, 4), randn(2, 5, 4)),
         {"attn_mask": torch.ones(3, 4, dtype=torch.bool)}, ValueError,
         ("attn_mask has shape [3, 4]", "[2, 3, 5]")),
        ("attn_mask of the wrong batch", (randn(2, 3, 4), randn(2, 5, 4), randn(2, 5, 4)),
         {"attn_mask": torch.zeros(3, 3, 5)}, ValueError, ("attn_mask has shape [3, 3, 5]",)),
        ("attn_mask of integers", (randn(2, 3, 4), randn(2, 5, 4), randn(2, 5, 4)),
         {"attn_mask": torch.ones(3, 5, dtype=torch.int64)}, TypeError,
         ("attn_mask has dtype int64",)),
        ("attn_mask a list", (randn(2, 3, 4), randn(2, 5, 4), randn(2, 5, 4)),
         {"attn_mask": [[True] * 5] * 3}, TypeError, ("attn_mask is a list",)),
        ("dropout_p above 1", (randn(2, 3, 4), randn(2, 5, 4), randn(2, 5, 4)),
         {"dropout_p": 1.5}, ValueError, ("dropout_p = 1.5",)),
    ]

    def test_torch_and_qkv_both_reject(self):
        for name, args, kwargs, error, words in self.CASES:
            with self.subTest(case=name):
                with self.assertRaises((RuntimeError, TypeError, ValueError),
                                       msg=f"{name}: torch accepted it"):
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        F.scaled_dot_product_attention(*args, **kwargs)
                with self.assertRaises(error, msg=name) as caught:
                    qkv.torch.scaled_dot_product_attention(*args, **kwargs)
                message = str(caught.exception)
                self.assertTrue(message.startswith("scaled_dot_product_attention: "), message)
                for word in words:
                    self.assertIn(word, message, f"{name}")

    def test_numpy_api_rejects_the_same_shapes(self):
        """The NumPy-level function on the shape errors above: qkv.Error
        naming queries, keys, values or the mask."""
        rng = rng_for(self)
        a = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
        cases = [((a(2, 3, 4), a(2, 5, 3), a(2, 5, 4)), {}, "keys has D = 3"),
                 ((a(2, 3, 4), a(2, 5, 4), a(2, 6, 4)), {}, "values has Nk = 6"),
                 ((a(2, 3, 4), a(3, 5, 4), a(3, 5, 4)), {}, "keys has B = 3"),
                 ((a(1, 3, 3, 4), a(1, 2, 5, 4), a(1, 2, 5, 4)), {}, "H = 3"),
                 ((a(2, 3, 4), a(2, 5, 4), a(2, 5, 4)), {"mask": np.ones((3, 4), bool)},
                  "mask has shape [3, 4]"),
                 ((a(2, 3, 4), a(2, 5, 4), a(2, 5, 4)), {"bias": a(3, 3, 5)},
                  "bias has shape [3, 3, 5]"),
                 ((a(2, 3, 4), a(2, 5, 4), a(2, 5, 4)), {"dropout_p": 1.5}, "1.5")]
        for args, kwargs, words in cases:
            with self.subTest(words=words):
                with self.assertRaises(ValueError) as caught:
                    qkv.scaled_dot_product_attention(*args, **kwargs)
                self.assertIsInstance(caught.exception, qkv.Error)
                self.assertIn(words, str(caught.exception))


class Differences(unittest.TestCase):
    """Where qkv and torch 2.13 differ by design, each side asserted (also in
    docs/semantics.md, "Against torch 2")."""

    def test_batch_axes_broadcast_in_both_ranks_in_torch_only(self):
        """Batch axes of 1 broadcast in both (qkv: tests/python/test_torch_expectations.py);
        ranks that differ, and GQA's key and value heads that differ, only in torch."""
        q, k, v = randn(2, 3, 4), randn(1, 5, 4), randn(1, 5, 4)
        torch.testing.assert_close(qkv.torch.scaled_dot_product_attention(q, k, v),
                                   F.scaled_dot_product_attention(q, k, v))
        q4 = randn(2, 2, 3, 4)  # a 3-D query against 4-D keys: torch broadcasts, qkv does not
        self.assertEqual(F.scaled_dot_product_attention(q, randn(2, 2, 5, 4),
                                                        randn(2, 2, 5, 4)).shape, (2, 2, 3, 4))
        with self.assertRaisesRegex(ValueError, "same rank"):
            qkv.torch.scaled_dot_product_attention(q, randn(2, 2, 5, 4), randn(2, 2, 5, 4))
        with self.assertRaisesRegex(ValueError, "values has Hkv = 1 but keys has Hkv = 2"):
            qkv.torch.scaled_dot_product_attention(q4, randn(2, 2, 5, 4), randn(2, 1, 5, 4),
                                                   enable_gqa=True)
        self.assertEqual(F.scaled_dot_product_attention(q4, randn(2, 2, 5, 4), randn(2, 1, 5, 4),
                                                        enable_gqa=True).shape, (2, 2, 3, 4))

    def test_attn_mask_with_is_causal_combines_in_qkv(self):
        """torch refuses attn_mask with is_causal; qkv lets a key take part
        where both allow it: torch's result with the mask and tril together."""
        q, k, v = (torch.randn(2, n, 8, dtype=torch.float64) for n in (7, 9, 9))
        mask = torch.rand(7, 9) > 0.3
        with self.assertRaisesRegex(RuntimeError, "attn_mask should not be set when is_causal"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
        ours = qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
        theirs = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask & torch.ones(7, 9, dtype=torch.bool).tril())
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)

    def test_float_mask_of_another_float_dtype(self):
        """torch wants a float attn_mask in the query's dtype; qkv converts
        it to the dtype it computes in (float32 for float32 and bf16)."""
        q, k, v = randn(2, 3, 4), randn(2, 5, 4), randn(2, 5, 4)
        bias = torch.randn(3, 5, dtype=torch.float64)
        with self.assertRaisesRegex(RuntimeError, "Expected attn_mask dtype"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        torch.testing.assert_close(
            qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=bias),
            F.scaled_dot_product_attention(q, k, v, attn_mask=bias.float()))

    def test_negative_dropout_and_float16(self):
        """torch takes dropout_p < 0 as no dropout; qkv calls it an error.
        torch computes float16 in float16 on the CPU, qkv in float32 (both return float16)."""
        q, k, v = randn(2, 3, 4), randn(2, 5, 4), randn(2, 5, 4)
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, dropout_p=-0.5),
                                   F.scaled_dot_product_attention(q, k, v))
        with self.assertRaisesRegex(ValueError, r"dropout_p = -0.5 is outside \[0, 1\]"):
            qkv.torch.scaled_dot_product_attention(q, k, v, dropout_p=-0.5)
        theirs = F.scaled_dot_product_attention(q.half(), k.half(), v.half())
        ours = qkv.torch.scaled_dot_product_attention(q.half(), k.half(), v.half())
        self.assertEqual(ours.dtype, torch.float16)
        torch.testing.assert_close(ours, theirs, rtol=2e-3, atol=2e-3)  # float16's 2^-10

    def test_head_dim_zero_needs_a_scale(self):
        """D = 0: torch's default scale 1/sqrt(0) gives the mean of the
        values; qkv asks for an explicit scale (with one, any scale gives
        that mean: every score is 0)."""
        q, k, v = randn(2, 3, 0), randn(2, 5, 0), randn(2, 5, 4)
        mean = v.mean(dim=1, keepdim=True).expand(2, 3, 4)
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v), mean)
        with self.assertRaisesRegex(ValueError, "D = 0.*scale"):
            qkv.torch.scaled_dot_product_attention(q, k, v)
        torch.testing.assert_close(qkv.torch.scaled_dot_product_attention(q, k, v, scale=1.0),
                                   mean)

    def test_no_keys(self):
        """Nk = 0: both give zeros."""
        q, k, v = randn(2, 3, 4), randn(2, 0, 4), randn(2, 0, 5)
        for sdpa in (F.scaled_dot_product_attention, qkv.torch.scaled_dot_product_attention):
            self.assertTrue((sdpa(q, k, v) == 0).all())


def print_worst():
    print("qkv's worst errors: the share of the bound used (1 fails), and the largest "
          "ratio to torch's error", file=sys.stderr)
    for (dtype, api), ((used, where), (ratio, ratio_where)) in sorted(WORST.items()):
        print(f"  {dtype:9} {api:12} {used:5.2f} of the bound ({where})\n"
              f"  {'':22} {ratio:5.2f} x torch's error ({ratio_where})", file=sys.stderr)


if __name__ == "__main__":
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, qkv {qkv.__version__} on {qkv.simd_target()}; {REPLAY}",
          file=sys.stderr)
    program = unittest.main(exit=False, verbosity=2)
    print_worst()
    print(REPLAY, file=sys.stderr)
    sys.exit(not program.result.wasSuccessful())
