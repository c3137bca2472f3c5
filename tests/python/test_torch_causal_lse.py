"""qkv.torch.scaled_dot_product_attention's causal='bottom-right', key_mask and
return_lse (issue 33 item 5), and every qkv.torch function refusing values
of the wrong type or outside their set.

- Formula: attention written in plain torch in float64 (torch_formulas'
  rules: masked keys -inf, a query with no key gives output 0 and lse
  -inf), with causal top-left (tril(0)) or bottom-right (tril(Nk - Nq)),
  key_mask and valid_lens combined; qkv.torch's output, lse and the
  gradients of sum(out * G) + sum(lse * h) (its autograd, through the lse
  too) against the formula's autograd, float32 and float64, for Nq < Nk,
  Nq = Nk and Nq > Nk, 2-D, 3-D, 4-D (grouped heads) and 5-D inputs, and a
  float attn_mask whose gradient gains the lse's term.
- gradcheck: torch.autograd.gradcheck of (output, lse) in float64 through
  bottom-right causal, key_mask and a float attn_mask.
- The lse does not depend on dropout, so neither does its gradient: the
  gradients of sum(lse * h) with dropout_p = 0.5 equal those without.
- bfloat16 and float16: lse in float32 (FlashAttention's softmax_lse).
- The NumPy API's scaled_dot_product_attention_backward(..., d_lse=)
  against the formula's autograd, and its d_lse errors.
- Errors: every argument of every qkv.torch function given a value of the
  wrong type or outside its set is refused (TypeError, ValueError or
  qkv.Error) with a message naming the function, the argument and the value.
- Peer (the venv run, `--torch 2.13.0`): torch 2.13's own
  F.scaled_dot_product_attention with torch.nn.attention.bias.causal_lower_right
  for causal='bottom-right' and a boolean attn_mask for key_mask, forward
  and backward; under Debian's torch 1.13 (pytest) the Peer class checks
  only that the run is torch 1.13, which has no causal_lower_right.

Inputs are drawn fresh each run; QKV_TEST_SEED=<seed> replays one.
"""

import math
import os
import secrets
import sys
import unittest
import zlib

import numpy as np
import torch

import qkv
import qkv.torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peer"))
from d2l_reference import (  # noqa: E402
    BF16_GRADIENT_TOLERANCE,
    BF16_OUTPUT_TOLERANCE,
    GRADIENT_TOLERANCE,
    TOLERANCE,
    check_close,
)

EXPECTED_TORCH = "1.13"  # the script's --torch VERSION replaces it (the venv run)
SEED = int(os.environ.get("QKV_TEST_SEED") or secrets.randbits(32))
CASES = 30
SDPA = qkv.torch.scaled_dot_product_attention


def rng_for(test, index=0):
    return np.random.default_rng([SEED, zlib.crc32(test.id().encode()), index])


def randn(rng, shape, dtype, requires_grad=False):
    t = torch.from_numpy(rng.standard_normal(shape)).to(dtype)
    return t.requires_grad_(requires_grad)


def formula(q, k, v, *, causal=None, key_mask=None, valid_lens=None, bias=None, scale=None):
    """(output, lse) of attention in plain torch, in q's dtype: scores
    Q K^T * scale (+ bias); a key takes part where causal (top-left:
    j <= i; bottom-right: j <= i + Nk - Nq), key_mask (B, Nk) ((Nk) for 2-D)
    and valid_lens (B) or (B, Nq) all let it; a query with no key gets
    output 0 and lse -inf, with zero gradients. Grouped heads: key head
    h // (H / Hkv)."""
    if q.dim() >= 4 and q.shape[-3] != k.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    nq, nk = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias
    keep = torch.ones(scores.shape, dtype=torch.bool)
    if causal is not None:
        diagonal = 0 if causal == "top-left" else nk - nq
        keep = keep & torch.ones(nq, nk, dtype=torch.bool).tril(diagonal)
    if key_mask is not None:
        mask = key_mask.bool()
        keep = keep & (mask[:, None, None, :] if q.dim() == 4 else mask[..., None, :])
    if valid_lens is not None:
        lens = valid_lens if valid_lens.dim() == 2 else valid_lens[:, None].expand(-1, nq)
        inside = torch.arange(nk) < lens[..., None]
        keep = keep & (inside[:, None] if q.dim() == 4 else inside)
    any_key = keep.any(dim=-1, keepdim=True)
    filled = scores.masked_fill(~keep, -math.inf).masked_fill(~any_key, 0.0)
    lse = torch.logsumexp(filled, dim=-1)
    weights = torch.softmax(filled, dim=-1) * keep
    lse = torch.where(any_key[..., 0], lse, torch.full_like(lse, -math.inf))
    return weights @ v, lse


def finite(lse):
    """lse with -inf (queries with no key) as 0: a loss that reads it stays finite."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def draw(rng, dtype, rank=None):
    """A case: shapes, inputs (float64 and `dtype`), causal, key_mask, valid_lens."""
    nq = int(rng.choice([1, 2, 5, 16, 33]))
    nk = int(rng.choice([1, 3, 16, 31, 70]))
    rank = rank or int(rng.choice([2, 3, 4, 5]))
    d, dv = int(rng.choice([1, 4, 8, 17])), int(rng.choice([1, 3, 8]))
    heads, kv_heads = [(1, 1), (2, 2), (4, 2), (3, 1)][int(rng.integers(0, 4))]
    lead = {2: [], 3: [int(rng.integers(1, 4))], 4: [2, heads], 5: [2, 2, heads]}[rank]
    kv_lead = lead[:-1] + [kv_heads] if rank >= 4 else lead
    q64 = randn(rng, lead + [nq, d], torch.float64)
    k64 = randn(rng, kv_lead + [nk, d], torch.float64)
    v64 = randn(rng, kv_lead + [nk, dv], torch.float64)
    causal = [None, "top-left", "bottom-right"][int(rng.integers(0, 3))]
    key_mask = valid_lens = None
    if rank <= 4 and rng.random() < 0.6:
        batch_shape = [nk] if rank == 2 else [lead[0], nk]
        key_mask = torch.from_numpy(rng.random(batch_shape) < 0.7)
        if rng.random() < 0.3:  # a batch element with no key at all
            key_mask.view(-1, nk)[0] = False
    if rank in (3, 4) and rng.random() < 0.4:
        valid_lens = torch.from_numpy(rng.integers(0, nk + 1, size=lead[0]))
    desc = (f"seed {SEED}: rank {rank}, q {list(q64.shape)}, k {list(k64.shape)}, causal "
            f"{causal}, key_mask {None if key_mask is None else list(key_mask.shape)}, "
            f"valid_lens {valid_lens}")
    return dict(q64=q64, k64=k64, v64=v64, causal=causal, key_mask=key_mask,
                valid_lens=valid_lens, enable_gqa=heads != kv_heads, desc=desc,
                tensors=[t.to(dtype).requires_grad_() for t in (q64, k64, v64)])


def run_qkv(case, dtype, **extra):
    q, k, v = case["tensors"]
    return SDPA(q, k, v, is_causal=False, causal=case["causal"], key_mask=case["key_mask"],
                valid_lens=case["valid_lens"], enable_gqa=case["enable_gqa"], return_lse=True,
                **extra)


class TorchVersion(unittest.TestCase):
    def test_the_torch_this_run_names(self):
        self.assertTrue(torch.__version__.startswith(EXPECTED_TORCH),
                        f"this run holds qkv to torch {EXPECTED_TORCH}; found torch "
                        f"{torch.__version__} at {torch.__file__}")


class Formula(unittest.TestCase):
    """Output, lse and the gradients through both against the float64 formula."""

    def check(self, dtype):
        name = str(dtype).removeprefix("torch.")
        for index in range(CASES):
            rng = rng_for(self, index)
            case = draw(rng, dtype)
            desc = case["desc"] + f" (case {index})"
            out, lse = run_qkv(case, dtype)
            self.assertEqual(lse.dtype, dtype, desc)
            self.assertEqual(list(lse.shape), list(case["q64"].shape[:-1]), desc)
            refs = [t.detach().clone().requires_grad_() for t in (case["q64"], case["k64"],
                                                                   case["v64"])]
            ref_out, ref_lse = formula(*refs, causal=case["causal"], key_mask=case["key_mask"],
                                       valid_lens=case["valid_lens"])
            check_close("output", out, ref_out, name, desc)
            self.assertTrue(torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), desc)
            check_close("lse", finite(lse), finite(ref_lse), name, desc)
            g_out = randn(rng, out.shape, torch.float64)
            g_lse = randn(rng, lse.shape, torch.float64)
            ((out * g_out.to(dtype)).sum() + (finite(lse) * g_lse.to(dtype)).sum()).backward()
            ((ref_out * g_out).sum() + (finite(ref_lse) * g_lse).sum()).backward()
            for what, got, ref in zip(("d_query", "d_key", "d_value"), case["tensors"], refs):
                check_close(what, got.grad, ref.grad, name, desc, scale=1.0,
                            tolerance=GRADIENT_TOLERANCE[name])

    def test_float64(self):
        self.check(torch.float64)

    def test_float32(self):
        self.check(torch.float32)

    def test_lse_alone_and_float_attn_mask(self):
        """Only the lse read (the output's gradient absent), with a float
        attn_mask: its gradient is the weights times d_lse, summed over the
        axes it broadcasts along."""
        for index in range(10):
            rng = rng_for(self, index)
            case = draw(rng, torch.float64, rank=3)
            nq, nk = case["q64"].shape[-2], case["k64"].shape[-2]
            bias64 = randn(rng, [nq, nk], torch.float64)
            q, k, v = case["tensors"]
            bias = bias64.clone().requires_grad_()
            _, lse = SDPA(q, k, v, attn_mask=bias, causal=case["causal"],
                          key_mask=case["key_mask"], valid_lens=case["valid_lens"],
                          return_lse=True)
            refs = [t.detach().clone().requires_grad_() for t in (case["q64"], case["k64"],
                                                                   case["v64"], bias64)]
            _, ref_lse = formula(*refs[:3], causal=case["causal"], key_mask=case["key_mask"],
                                 valid_lens=case["valid_lens"], bias=refs[3])
            g = randn(rng, lse.shape, torch.float64)
            (finite(lse) * g).sum().backward()
            (finite(ref_lse) * g).sum().backward()
            for what, got, ref in zip(("d_query", "d_key", "d_bias"), (q, k, bias),
                                      refs[:2] + refs[3:]):
                check_close(what, got.grad, ref.grad, "float64", case["desc"], scale=1.0,
                            tolerance=GRADIENT_TOLERANCE["float64"])
            self.assertTrue(torch.equal(v.grad, torch.zeros_like(v)), case["desc"])

    def test_causal_true_is_top_left_and_bottom_right_differs(self):
        rng = rng_for(self)
        q, k, v = (randn(rng, [2, n, 4], torch.float64) for n in (3, 7, 7))
        torch.testing.assert_close(SDPA(q, k, v, is_causal=True), SDPA(q, k, v, causal="top-left"),
                                   rtol=0, atol=0)
        bottom = SDPA(q, k, v, causal="bottom-right")
        ref, _ = formula(q, k, v, causal="bottom-right")
        torch.testing.assert_close(bottom, ref, rtol=1e-12, atol=1e-12)
        self.assertGreater((bottom - SDPA(q, k, v, is_causal=True)).abs().max().item(), 1e-3)


class NumpyDLse(unittest.TestCase):
    """The NumPy API's scaled_dot_product_attention_backward(..., d_lse=):
    the gradients of sum(out * G) + sum(lse * h) against the formula's
    autograd in float64; d_lse of another shape or dtype is refused."""

    def test_d_lse_against_the_formula(self):
        for index in range(10):
            rng = rng_for(self, index)
            case = draw(rng, torch.float64, rank=int(rng.choice([2, 3, 4])))
            q, k, v = (t.detach().numpy() for t in (case["q64"], case["k64"], case["v64"]))
            km = None if case["key_mask"] is None else case["key_mask"].numpy()
            lens = None if case["valid_lens"] is None else case["valid_lens"].numpy()
            out, lse = qkv.scaled_dot_product_attention(q, k, v, lens, causal=case["causal"],
                                                        key_mask=km, return_lse=True)
            g_out = rng.standard_normal(out.shape)
            g_lse = np.where(np.isfinite(lse), rng.standard_normal(lse.shape), 0.0)
            grads = qkv.scaled_dot_product_attention_backward(
                q, k, v, out, lse, g_out, lens, causal=case["causal"], key_mask=km, d_lse=g_lse)
            refs = [t.detach().clone().requires_grad_() for t in (case["q64"], case["k64"],
                                                                   case["v64"])]
            ref_out, ref_lse = formula(*refs, causal=case["causal"], key_mask=case["key_mask"],
                                       valid_lens=case["valid_lens"])
            ((ref_out * torch.from_numpy(g_out)).sum()
             + (finite(ref_lse) * torch.from_numpy(g_lse)).sum()).backward()
            for what, got, ref in zip(("d_queries", "d_keys", "d_values"), grads, refs):
                check_close(what, got, ref.grad, "float64", case["desc"], scale=1.0,
                            tolerance=GRADIENT_TOLERANCE["float64"])

    def test_d_lse_errors(self):
        q, k, v = np.ones((2, 3, 4)), np.ones((2, 5, 4)), np.ones((2, 5, 2))
        out, lse = qkv.scaled_dot_product_attention(q, k, v, return_lse=True)
        fn = "scaled_dot_product_attention_backward"
        with self.assertRaisesRegex(qkv.Error, rf"{fn}: d_lse has shape \[2, 4\]"):
            qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, out,
                                                      d_lse=np.ones((2, 4)))
        with self.assertRaisesRegex(TypeError, rf"{fn}: d_lse has dtype float32 but lse"):
            qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, out,
                                                      d_lse=lse.astype(np.float32))


class GradCheck(unittest.TestCase):
    def test_gradcheck_output_and_lse(self):
        for index, (nq, nk, causal) in enumerate([(3, 5, "bottom-right"), (5, 3, "bottom-right"),
                                                  (4, 4, "top-left"), (2, 6, None)]):
            rng = rng_for(self, index)
            q, k, v = (randn(rng, s, torch.float64, True)
                       for s in ([2, 2, nq, 3], [2, 1, nk, 3], [2, 1, nk, 2]))
            key_mask = torch.from_numpy(rng.random((2, nk)) < 0.8)
            bias = randn(rng, [1, 2, nq, nk], torch.float64, True)

            def attention(q, k, v, bias):
                out, lse = SDPA(q, k, v, attn_mask=bias, causal=causal, key_mask=key_mask,
                                enable_gqa=True, return_lse=True)
                return out, finite(lse)

            self.assertTrue(torch.autograd.gradcheck(attention, (q, k, v, bias)),
                            f"seed {SEED}: Nq {nq}, Nk {nk}, causal {causal}")


class Dropout(unittest.TestCase):
    def test_lse_and_its_gradient_do_not_depend_on_dropout(self):
        rng = rng_for(self)
        for dtype in (torch.float32, torch.float64):
            case = draw(rng, dtype, rank=4)
            g = randn(rng, case["q64"].shape[:-1], torch.float64).to(dtype)
            results = []
            for p in (0.0, 0.5):
                tensors = [t.detach().clone().requires_grad_() for t in case["tensors"]]
                q, k, v = tensors
                _, lse = SDPA(q, k, v, causal=case["causal"], key_mask=case["key_mask"],
                              enable_gqa=case["enable_gqa"], dropout_p=p, seed=7,
                              return_lse=True)
                (finite(lse) * g).sum().backward()
                results.append([lse.detach()] + [t.grad for t in tensors])
            name = str(dtype).removeprefix("torch.")
            for what, a, b in zip(("lse", "d_query", "d_key", "d_value"), *results):
                check_close(what, finite(b), finite(a), name, case["desc"], scale=1.0,
                            tolerance=GRADIENT_TOLERANCE[name])


class LowPrecision(unittest.TestCase):
    def test_bfloat16_and_float16_give_a_float32_lse(self):
        for dtype in (torch.bfloat16, torch.float16):
            for index in range(6):
                rng = rng_for(self, index)
                case = draw(rng, dtype, rank=int(rng.choice([3, 4])))
                out, lse = run_qkv(case, dtype)
                self.assertEqual((out.dtype, lse.dtype), (dtype, torch.float32), case["desc"])
                rounded = [t.detach().to(torch.float64) for t in case["tensors"]]
                ref_out, ref_lse = formula(*rounded, causal=case["causal"],
                                           key_mask=case["key_mask"],
                                           valid_lens=case["valid_lens"])
                check_close("output", out, ref_out, "bfloat16", case["desc"],
                            scale=float(rounded[2].abs().max()),
                            tolerance=BF16_OUTPUT_TOLERANCE, rounding=2.0**-8)
                check_close("lse", finite(lse), finite(ref_lse), "bfloat16", case["desc"],
                            tolerance=BF16_OUTPUT_TOLERANCE)
                finite(lse).sum().backward()  # the lse's gradient reaches the inputs
                self.assertEqual(case["tensors"][0].grad.dtype, dtype)
                ref = [t.clone().requires_grad_() for t in rounded]
                finite(formula(*ref, causal=case["causal"], key_mask=case["key_mask"],
                               valid_lens=case["valid_lens"])[1]).sum().backward()
                check_close("d_query", case["tensors"][0].grad, ref[0].grad, "bfloat16",
                            case["desc"], scale=1.0, tolerance=BF16_GRADIENT_TOLERANCE)


def refused(test, error, pattern, call):
    with test.assertRaisesRegex(error, pattern):
        call()


class Errors(unittest.TestCase):
    """Each argument of each qkv.torch function, given a value of the wrong
    type or outside its set, is refused with its name and the value."""

    def setUp(self):
        self.q, self.k, self.v = torch.ones(2, 3, 4), torch.ones(2, 5, 4), torch.ones(2, 5, 2)

    def test_scaled_dot_product_attention(self):
        q, k, v = self.q, self.k, self.v
        fn = "scaled_dot_product_attention"
        bad = [
            (TypeError, f"{fn}: is_causal is 'bottom-right'; expected True or False.*"
                        "causal='bottom-right'", dict(is_causal="bottom-right")),
            (TypeError, f"{fn}: is_causal is 1; expected True or False", dict(is_causal=1)),
            (TypeError, f"{fn}: is_causal is None", dict(is_causal=None)),
            (TypeError, f"{fn}: enable_gqa is 'yes'", dict(enable_gqa="yes")),
            (TypeError, f"{fn}: return_lse is 'yes'", dict(return_lse="yes")),
            (TypeError, f"{fn}: causal is True; expected None, 'top-left'", dict(causal=True)),
            (qkv.Error, f"{fn}: causal = 'upper' is not one of", dict(causal="upper")),
            (ValueError, f"{fn}: is_causal=True and causal='bottom-right' both given",
             dict(is_causal=True, causal="bottom-right")),
            (TypeError, f"{fn}: dropout_p is '0.1'; expected a number", dict(dropout_p="0.1")),
            (TypeError, f"{fn}: dropout_p is True", dict(dropout_p=True)),
            (ValueError, f"{fn}: dropout_p = nan is outside", dict(dropout_p=float("nan"))),
            (ValueError, f"{fn}: dropout_p = 1.5 is outside", dict(dropout_p=1.5)),
            (TypeError, f"{fn}: scale is '2'; expected a number", dict(scale="2")),
            (TypeError, f"{fn}: scale is True", dict(scale=True)),
            (TypeError, f"{fn}: seed is 0.0; expected None or a whole number", dict(seed=0.0)),
            (TypeError, f"{fn}: seed is True", dict(seed=True)),
            (TypeError, f"{fn}: seed is 'x'", dict(seed="x")),
            (TypeError, f"{fn}: softcap is 'x'", dict(softcap="x")),
            (TypeError, f"{fn}: window_size is 'x'", dict(window_size="x")),
            (TypeError, f"{fn}: alibi_slopes must be a float tensor", dict(alibi_slopes=[1.0])),
            (TypeError, f"{fn}: attn_mask is a list", dict(attn_mask=[[True]])),
            (TypeError, f"{fn}: valid_lens has dtype float32", dict(valid_lens=torch.ones(2))),
            (TypeError, f"{fn}: key_mask is a list; expected a bool torch.Tensor",
             dict(key_mask=[[True] * 5] * 2)),
            (TypeError, f"{fn}: key_mask has dtype float32", dict(key_mask=torch.ones(2, 5))),
            (qkv.Error, rf"{fn}: key_mask has shape \[2, 4\]; expected \[2, 5\] \(B, Nk\)",
             dict(key_mask=torch.ones(2, 4, dtype=torch.bool))),
            (qkv.Error, rf"{fn}: key_mask has shape \[5\]; expected \[2, 5\]",
             dict(key_mask=torch.ones(5, dtype=torch.bool))),
        ]
        for error, pattern, kwargs in bad:
            with self.subTest(kwargs=kwargs):
                refused(self, error, pattern, lambda: SDPA(q, k, v, **kwargs))
        refused(self, TypeError, f"{fn}: query is a ndarray", lambda: SDPA(q.numpy(), k, v))
        refused(self, qkv.Error, rf"{fn}: key_mask has shape \[2, 5\]; expected \[5\] \(Nk\)",
                lambda: SDPA(q[0], k[0], v[0], key_mask=torch.ones(2, 5, dtype=torch.bool)))
        five = torch.ones(1, 2, 1, 3, 4)
        refused(self, ValueError, rf"{fn}: key_mask takes inputs of rank 2 to 4; got query "
                rf"\[1, 2, 1, 3, 4\]",
                lambda: SDPA(five, five, five, key_mask=torch.ones(1, 3, dtype=torch.bool)))

    def test_scoring_functions(self):
        q, k, v = self.q, self.k, self.v
        calls = {
            "additive_attention": lambda **kw: qkv.torch.additive_attention(
                q, k, v, torch.ones(3, 4), torch.ones(3, 4), torch.ones(3), **kw),
            "bilinear_attention": lambda **kw: qkv.torch.bilinear_attention(
                q, k, v, torch.ones(4, 4), **kw),
            "distance_attention": lambda **kw: qkv.torch.distance_attention(q, k, v, **kw),
        }
        for fn, call in calls.items():
            bad = [
                (TypeError, f"{fn}: return_weights is 'yes'", dict(return_weights="yes")),
                (TypeError, f"{fn}: causal is True", dict(causal=True)),
                (qkv.Error, f"{fn}: causal = 'upper' is not one of", dict(causal="upper")),
                (TypeError, f"{fn}: dropout_p is 'x'", dict(dropout_p="x")),
                (ValueError, f"{fn}: dropout_p = -0.5 is outside", dict(dropout_p=-0.5)),
                (TypeError, f"{fn}: seed is 0.5", dict(seed=0.5)),
                (TypeError, f"{fn}: valid_lens has dtype float32",
                 dict(valid_lens=torch.ones(2))),
            ]
            if fn == "distance_attention":
                bad.append((TypeError, f"{fn}: scale is 'x'", dict(scale="x")))
            for error, pattern, kwargs in bad:
                with self.subTest(fn=fn, kwargs=kwargs):
                    refused(self, error, pattern, lambda: call(**kwargs))
        refused(self, TypeError, "masked_softmax: X is a list",
                lambda: qkv.torch.masked_softmax([[1.0]]))

    def test_modules(self):
        T = qkv.torch
        bad = [
            (TypeError, "DotProductAttention: dropout is '0.1'",
             lambda: T.DotProductAttention("0.1")),
            (ValueError, "DotProductAttention: dropout = 2.0 is outside",
             lambda: T.DotProductAttention(2)),
            (TypeError, "DotProductAttention: keep_attention_weights is 'no'",
             lambda: T.DotProductAttention(0.1, keep_attention_weights="no")),
            (TypeError, "AdditiveAttention: key_size is 2.5",
             lambda: T.AdditiveAttention(2.5, 4, 8, 0.1)),
            (ValueError, "AdditiveAttention: num_hiddens = 0",
             lambda: T.AdditiveAttention(2, 4, 0, 0.1)),
            (TypeError, "AdditiveAttention: dropout is None",
             lambda: T.AdditiveAttention(2, 4, 8, None)),
            (TypeError, "MultiHeadAttention: num_heads is '2'",
             lambda: T.MultiHeadAttention(8, "2", 0.1)),
            (TypeError, "MultiHeadAttention: num_kv_heads is 1.0",
             lambda: T.MultiHeadAttention(8, 2, 0.1, num_kv_heads=1.0)),
            (TypeError, "MultiHeadAttention: bias is 'yes'",
             lambda: T.MultiHeadAttention(8, 2, 0.1, bias="yes")),
            (TypeError, "MultiHeadAttention: dropout is '0'",
             lambda: T.MultiHeadAttention(8, 2, "0")),
        ]
        for error, pattern, call in bad:
            with self.subTest(pattern=pattern):
                refused(self, error, pattern, call)
        mha = T.MultiHeadAttention(8, 2, 0.0).eval()
        x = torch.ones(2, 3, 8)
        refused(self, TypeError, "MultiHeadAttention.forward: is_causal is 'bottom-right'",
                lambda: mha(x, x, x, is_causal="bottom-right"))
        torch_mha = T.MultiheadAttention(embed_dim=8, num_heads=2, batch_first=True)
        for name, value in (("is_causal", "bottom-right"), ("need_weights", "no"),
                            ("average_attn_weights", None)):
            refused(self, TypeError, f"MultiheadAttention.forward: {name} is {value!r}",
                    lambda: torch_mha(x, x, x, **{name: value}))


class Peer(unittest.TestCase):
    """torch 2.13's own SDPA: causal_lower_right and a boolean key mask."""

    def test_against_torch2_sdpa(self):
        if EXPECTED_TORCH.startswith("1."):
            self.assertTrue(torch.__version__.startswith("1."))  # no causal_lower_right there
            return
        import torch.nn.functional as F
        from torch.nn.attention.bias import causal_lower_right

        for dtype in (torch.float32, torch.float64):
            name = str(dtype).removeprefix("torch.")
            for index in range(CASES):
                rng = rng_for(self, index)
                case = draw(rng, dtype, rank=int(rng.choice([3, 4])))
                if case["valid_lens"] is not None or case["causal"] == "top-left":
                    case["valid_lens"], case["causal"] = None, "bottom-right"
                    case["desc"] += " -> here causal bottom-right, valid_lens None"
                q, k, v = case["tensors"]
                nq, nk = q.shape[-2], k.shape[-2]
                out, _ = run_qkv(case, dtype)
                peer = [t.detach().clone().requires_grad_() for t in case["tensors"]]
                mask = None
                if case["key_mask"] is not None:
                    km = case["key_mask"]
                    mask = km[:, None, None, :] if q.dim() == 4 else km[:, None, :]
                if case["causal"] == "bottom-right":
                    lower_right = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
                    if mask is None and nq <= nk:
                        mask = causal_lower_right(nq, nk)  # torch's own bias object
                    else:
                        mask = lower_right if mask is None else mask & lower_right
                ref = F.scaled_dot_product_attention(*peer, attn_mask=mask,
                                                     enable_gqa=case["enable_gqa"])
                # torch 2.13 gives a query with no key 0 (its math and flash paths)
                # or NaN (the formula its bias objects take): qkv gives 0.
                empty = torch.isnan(ref)
                check_close("output", out, ref.detach().masked_fill(empty, 0.0), name,
                            case["desc"] + f" (case {index})", tolerance=4 * TOLERANCE[name])
                if empty.any():
                    continue
                g = randn(rng, out.shape, torch.float64)
                (out * g.to(dtype)).sum().backward()
                (ref * g.to(dtype)).sum().backward()
                for what, got, want in zip(("d_query", "d_key", "d_value"), case["tensors"],
                                           peer):
                    check_close(what, got.grad, want.grad, name, case["desc"], scale=1.0,
                                tolerance=4 * GRADIENT_TOLERANCE[name])


if __name__ == "__main__":
    import torch_versions
    torch_versions.main(sys.modules[__name__])
