"""FlashAttention's own tests, adapted to qkv on the CPU.

Adapted from Dao-AILab/flash-attention at commit
0251105a2fb19d2957484b7f023cd8c115286ced (2026-08-15): tests/test_flash_attn.py
(test_flash_attn_output, test_flash_attn_causal, test_flash_attn_splitkv,
test_flash_attn_varlen_output, test_flash_attn_kvcache) and
hopper/test_flash_attn.py (test_flash_attn_combine), with their reference
functions (attention_ref, construct_local_mask, attn_bias_from_alibi_slopes,
generate_random_padding_mask, attention_combine_ref) rewritten in plain torch
where they use einops, and their rule kept:

    max |qkv - ref| <= mult * max |pt - ref| + atol

where ref is attention_ref with upcast=True and pt the same computation in
the test's own precision with reorder_ops=True (the scale applied to K
instead of Q), and mult is the test's own (2 for outputs; 2 or 3 for
gradients; 8 with ALiBi in split-KV; 3 or 5 in the KV-cache test).

What changes on a CPU, and why:
- dtypes: FlashAttention tests float16 and bfloat16 against a float32
  reference. qkv computes float32 and bfloat16 (float16 as float32), so the
  tests run float32 against a float64 reference and bfloat16 against a
  float32 one (FlashAttention's own upcast).
- atol: tests/test_flash_attn.py's additive slack (1e-5 on outputs, 2e-4 on
  split-KV gradients) is sized for float16; the adaptation takes the one
  hopper/test_flash_attn.py uses instead, which scales with the dtype and
  the values: two roundings at |ref| + 0.3 in the test's dtype,
  2 * max |(ref + 0.3 - 0.3) - ref| (float32: about 1e-7 where outputs are
  about 1), and hopper's multiple of 3 where a softcap is given.
- float32's allowance: FlashAttention never applies its rule between two
  float32 computations (float16's and bfloat16's reference errors are 2^13
  to 2^16 times larger), and there the ratio of two largest errors has a
  tail: torch's own float32 with the scale on K instead of Q, against
  torch's float32, exceeded 2x in 5 and 3x in 1 of 2,265 gradient checks
  (bench/fa_grad_rule.py). qkv's float32 fails FlashAttention's multiples
  as they are in 1 of 4,320 checks (6 runs of 40 cases a group: a softcap
  output dq at 3.03 times pt against a multiple of 3), so the suite holds
  float32 to FLOAT32_ALLOWANCE (1.5) times them: still a failure for a
  wrong mask, a dropped lse gradient or a wrong alignment (errors of order
  1); --strict applies the multiples as they are. Until issue 33's
  backward kept the forward's softmax statistics and the softcap took
  Highway's tanh, 10 of 1,440 checks failed them (up to 6.33x with softcap)
  and the allowance was 3.
- sizes: batch and heads are cut (B = 2, H <= 6) and the grid is sampled:
  each run draws QKV_FA_CASES cases per group (default 6) from the test's
  own parametrization, with fresh inputs, leaving out the cases of more than
  2^21 (query, key) pairs (memory: small()); `python test_peer_flash_attn.py
  --full` runs every case of every group (a benchmark-style command, about
  an hour on 2 cores) and prints the counts and the worst ratios.
- layout: FlashAttention's (B, N, H, d) tensors are passed to
  qkv.torch.scaled_dot_product_attention as (B, H, N, d) views (no copy);
  causal is causal='bottom-right' (FlashAttention's alignment); mqa/gqa is
  enable_gqa.
- varlen and KV cache: qkv has no packed variable-length API and no cache
  append; a variable-length batch is what it computes, each sequence on its
  own, so each sequence is its own call, padded back as FlashAttention's
  pad_input does. The KV-cache test runs without new keys appended, rotary
  embedding, paging or left padding (none of which is attention).
- not adapted: dropout (FlashAttention returns its dropout mask in S_dmask
  and compares against it; qkv does not expose its mask, and its dropout is
  held to torch 2.13's by statistics in test_peer_torch2_sdpa.py), the
  packed qkv/kv entry points (the same kernels with other strides), and the
  GPU-only tests (race conditions, overflow of fp16 accumulators, paged
  block tables, determinism flags: qkv is deterministic, tested elsewhere).

Run by the venv's Python (tests/CMakeLists.txt's qkv_venv_test) with the build
tree's qkv on PYTHONPATH. QKV_TEST_SEED=<seed> replays a run.
"""

import itertools
import math
import os
import random
import secrets
import sys
import unittest

import torch

import qkv
import qkv.torch

SEED = int(os.environ.get("QKV_TEST_SEED", secrets.randbits(32)))
REPLAY = f"QKV_TEST_SEED={SEED}"
CASES = int(os.environ.get("QKV_FA_CASES", "6"))
FULL = "--full" in sys.argv
STRICT = "--strict" in sys.argv
FLOAT32_ALLOWANCE = 1 if STRICT else 1.5

# The reference dtype of each test dtype: FlashAttention's upcast.
REF_DTYPE = {torch.float32: torch.float64, torch.bfloat16: torch.float32}


# ---- FlashAttention's reference functions, in plain torch ------------------------------

def attn_bias_from_alibi_slopes(slopes, seqlen_q, seqlen_k, query_padding_mask=None,
                                key_padding_mask=None, causal=False):
    slopes = slopes[:, :, None, None]
    if causal:
        return torch.arange(-seqlen_k + 1, 1, dtype=torch.float32) * slopes
    row_idx = torch.arange(seqlen_q, dtype=torch.long)[:, None]
    col_idx = torch.arange(seqlen_k, dtype=torch.long)
    sk = seqlen_k if key_padding_mask is None else key_padding_mask.sum(-1)[:, None, None, None]
    sq = seqlen_q if query_padding_mask is None else query_padding_mask.sum(-1)[:, None, None,
                                                                                None]
    relative_pos = torch.abs(row_idx + sk - sq - col_idx)
    return -slopes * relative_pos.to(dtype=slopes.dtype)


def generate_random_padding_mask(max_seqlen, batch_size, mode="random"):
    assert mode in ["full", "random", "third"]
    if mode == "full":
        lengths = torch.full((batch_size, 1), max_seqlen, dtype=torch.int32)
    elif mode == "random":
        lengths = torch.randint(max(1, max_seqlen - 20), max_seqlen + 1, (batch_size, 1))
    else:
        lengths = torch.randint(max_seqlen // 3, max_seqlen + 1, (batch_size, 1))
    return torch.arange(max_seqlen)[None, :].expand(batch_size, -1) < lengths


def construct_local_mask(seqlen_q, seqlen_k, window_size=(-1, -1), query_padding_mask=None,
                         key_padding_mask=None):
    row_idx = torch.arange(seqlen_q, dtype=torch.long)[:, None]
    col_idx = torch.arange(seqlen_k, dtype=torch.long)
    sk = seqlen_k if key_padding_mask is None else key_padding_mask.sum(-1)[:, None, None, None]
    sq = seqlen_q if query_padding_mask is None else query_padding_mask.sum(-1)[:, None, None,
                                                                                None]
    if window_size[0] < 0:
        return col_idx > row_idx + sk - sq + window_size[1]
    sk = torch.full_like(col_idx, seqlen_k) if key_padding_mask is None else sk
    return torch.logical_or(
        col_idx > torch.minimum(row_idx + sk - sq + window_size[1], sk),
        col_idx < row_idx + sk - sq - window_size[0])


def attention_ref(q, k, v, query_padding_mask=None, key_padding_mask=None, attn_bias=None,
                  causal=False, window_size=(-1, -1), softcap=0.0, upcast=True,
                  reorder_ops=False):
    """FlashAttention's attention_ref without dropout, qv and descaling.
    q (B, Nq, H, d), k and v (B, Nk, Hkv, d). upcast computes in REF_DTYPE."""
    if causal:
        window_size = (window_size[0], 0)
    dtype_og = q.dtype
    if upcast:
        q, k, v = (t.to(REF_DTYPE[dtype_og]) for t in (q, k, v))
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if not reorder_ops:
        scores = torch.einsum("bthd,bshd->bhts", q * softmax_scale, k)
    else:
        scores = torch.einsum("bthd,bshd->bhts", q, k * softmax_scale)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if key_padding_mask is not None:
        scores.masked_fill_(~key_padding_mask[:, None, None, :], float("-inf"))
    local_mask = None
    if window_size[0] >= 0 or window_size[1] >= 0:
        local_mask = construct_local_mask(seqlen_q, seqlen_k, window_size, query_padding_mask,
                                          key_padding_mask)
        scores.masked_fill_(local_mask, float("-inf"))
    if attn_bias is not None:
        scores = scores + attn_bias
    attention = torch.softmax(scores, dim=-1).to(v.dtype)
    if query_padding_mask is not None:
        attention = attention.masked_fill(~query_padding_mask[:, None, :, None], 0.0)
    if key_padding_mask is not None:
        attention = attention.masked_fill(~key_padding_mask[:, None, None, :], 0.0)
    if local_mask is not None:
        attention = attention.masked_fill(torch.all(local_mask, dim=-1, keepdim=True), 0.0)
    output = torch.einsum("bhts,bshd->bthd", attention, v)
    if query_padding_mask is not None:
        output.masked_fill_(~query_padding_mask[:, :, None, None], 0.0)
    return output.to(dtype=dtype_og)


def attention_combine_ref(out_partial, lse_partial):
    """out_partial (splits, B, seqlen, H, d), lse_partial (splits, B, seqlen, H)."""
    lse = torch.logsumexp(lse_partial, dim=0)
    scale = torch.exp(lse_partial - lse)
    scale = torch.where(torch.isinf(scale) | torch.isnan(scale), torch.zeros_like(scale), scale)
    return (scale.unsqueeze(-1) * out_partial).sum(0), lse


# ---- qkv as FlashAttention's flash_attn_func -------------------------------------------

def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None):
    """FlashAttention's flash_attn_func (dropout 0) on qkv.torch: (B, N, H, d)
    tensors read as (B, H, N, d) views; causal is qkv's causal='bottom-right'
    (FlashAttention's alignment), which with a window keeps its right side at
    0 as FlashAttention's does."""
    window_size = (int(window_size[0]), int(window_size[1]))
    out = qkv.torch.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        enable_gqa=k.shape[2] != q.shape[2], causal="bottom-right" if causal else None,
        window_size=None if window_size == (-1, -1) else window_size,
        softcap=softcap, alibi_slopes=alibi_slopes)
    return out.transpose(1, 2)


def flash_attn_varlen_func(q, k, v, query_padding_mask, key_padding_mask, **kwargs):
    """The variable-length batch, each sequence its own call, padded back."""
    outs = []
    for b in range(q.shape[0]):
        lq, lk = int(query_padding_mask[b].sum()), int(key_padding_mask[b].sum())
        slopes = kwargs.get("alibi_slopes")
        call = dict(kwargs, alibi_slopes=None if slopes is None else slopes[b:b + 1])
        out = flash_attn_func(q[b:b + 1, :lq], k[b:b + 1, :lk], v[b:b + 1, :lk], **call)
        outs.append(torch.nn.functional.pad(out, (0, 0, 0, 0, 0, q.shape[1] - lq)))
    return torch.cat(outs)


# ---- the rule ------------------------------------------------------------------------

WORST = {}  # group -> (ratio, description)
COUNTS = {}  # group -> [passed, failed]


def check(group, case, what, got, ref, pt, mult, failures, allowance=True):
    """FlashAttention's rule: got's error at most mult times pt's, plus hopper's
    atol (ref is in the test's dtype, as FlashAttention's attention_ref returns it)."""
    if got.numel() == 0:
        return
    err = (got.double() - ref.double()).abs().max().item()
    err_pt = (pt.double() - ref.double()).abs().max().item()
    atol = 2 * ((ref + 0.3 - 0.3) - ref).abs().max().item()
    if allowance and got.dtype == torch.float32:
        mult *= FLOAT32_ALLOWANCE
    bound = mult * err_pt + atol
    ratio = err / err_pt if err_pt > 0 else (0.0 if err == 0 else math.inf)
    if ratio > WORST.get(group, (-1.0, ""))[0]:
        WORST[group] = (ratio, f"{what} of {case}")
    ok = err <= bound
    COUNTS.setdefault(group, [0, 0])[0 if ok else 1] += 1
    if not ok:
        failures.append(f"{what}: max error {err:.3g} > {mult} x {err_pt:.3g} (pt) + {atol:.2g} "
                        f"= {bound:.3g} (ratio {ratio:.2f}) in {case}")


def check_outputs_and_grads(group, case, dtype, tensors, out, out_ref, out_pt, out_mult,
                            grad_mult):
    failures = []
    check(group, case, "out", out, out_ref, out_pt, out_mult, failures)
    if grad_mult is not None:
        g = torch.randn_like(out)
        # The three graphs share q * softcap: keep it for the next.
        grads = torch.autograd.grad(out, tensors, g, retain_graph=True)
        grads_ref = torch.autograd.grad(out_ref, tensors, g, retain_graph=True)
        grads_pt = torch.autograd.grad(out_pt, tensors, g)
        for name, d, d_ref, d_pt in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
            check(group, case, name, d, d_ref, d_pt, grad_mult, failures)
    return failures


def small(seqlens=(1, 1), **_):
    """Without --full, cases of at most 2^21 (query, key) pairs a head: the
    float64 reference's autograd of (2048, 2048) holds about 13 GB, and the
    suite runs two tests at a time on 24 GiB."""
    return FULL or seqlens[0] * seqlens[1] <= 2**21


def sample(grid, fits=small):
    """CASES cases of the grid (every case with --full), drawn by the run's seed;
    only those that fit in this machine's memory."""
    cases = [c for c in itertools.product(*grid.values()) if fits(**dict(zip(grid, c)))]
    if not FULL:
        cases = random.Random(f"{SEED}{sorted(grid)}").sample(cases, min(CASES, len(cases)))
    return [dict(zip(grid, c)) for c in cases]


def window_for(local, seqlen_k):
    return tuple(torch.randint(0, seqlen_k, (2,)).tolist()) if local else (-1, -1)


def randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float32) * scale).to(dtype).requires_grad_()


DTYPES = [torch.float32, torch.bfloat16]


def output_inputs(dtype, mha_type, alibi, local, d, seqlens, softcap):
    """The draw test_flash_attn_output and test_flash_attn_varlen_output share:
    q, the q passed in (times softcap, which the kernels divide back), k, v,
    the ALiBi slopes or None, and the window."""
    (seqlen_q, seqlen_k), batch_size = seqlens, 2
    nheads = 6 if softcap == 0.0 else 4
    nheads_k = nheads if mha_type == "mha" else (1 if mha_type == "mqa" else 2)
    window_size = window_for(local, seqlen_k)
    q = randn(batch_size, seqlen_q, nheads, d, dtype=dtype)
    q_in = q * softcap if softcap > 0 else q
    k = randn(batch_size, seqlen_k, nheads_k, d, dtype=dtype)
    v = randn(batch_size, seqlen_k, nheads_k, d, dtype=dtype)
    alibi_slopes = torch.rand(batch_size, nheads) * 0.3 if alibi else None
    return q, q_in, k, v, alibi_slopes, window_size


class FlashAttnTests(unittest.TestCase):
    def run_group(self, group, grid, one_case, fits=small):
        failures = []
        for i, params in enumerate(sample(grid, fits)):
            torch.manual_seed(SEED + i)
            case = ", ".join(f"{k}={getattr(v, '__name__', v)}" for k, v in params.items())
            failures += one_case(f"{group}({case})", **params)
        self.assertEqual(failures, [], "\n".join(failures[:20]) + f"\n{REPLAY}")

    # tests/test_flash_attn.py::test_flash_attn_output (dropout 0; kvpacked is
    # the same kernels with other strides)
    def test_output(self):
        grid = {
            "dtype": DTYPES, "mha_type": ["mha", "mqa", "gqa"], "alibi": [False, True],
            "local": [False, True], "causal": [False, True],
            "d": [32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256],
            "seqlens": [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512),
                        (512, 256), (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048)],
            "softcap": [0.0, 50.0],
        }

        def one(case, dtype, mha_type, alibi, local, causal, d, seqlens, softcap):
            q, q_in, k, v, alibi_slopes, window_size = output_inputs(
                dtype, mha_type, alibi, local, d, seqlens, softcap)
            attn_bias = (attn_bias_from_alibi_slopes(alibi_slopes, *seqlens, causal=causal)
                         if alibi else None)
            out = flash_attn_func(q_in, k, v, causal=causal, window_size=window_size,
                                  softcap=softcap, alibi_slopes=alibi_slopes)
            common = dict(attn_bias=attn_bias, causal=causal, window_size=window_size,
                          softcap=softcap)
            out_ref = attention_ref(q_in, k, v, **common)
            out_pt = attention_ref(q_in, k, v, **common, upcast=False, reorder_ops=True)
            return check_outputs_and_grads("output", f"{case}, window={window_size}", dtype,
                                           (q, k, v), out, out_ref, out_pt, 2 if softcap == 0 else 3, 3)
        self.run_group("output", grid, one)

    # tests/test_flash_attn.py::test_flash_attn_causal
    def test_causal(self):
        grid = {
            "dtype": DTYPES, "local": [False, True],
            "d": [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256],
            "swap_sq_sk": [False, True],
            "seqlens": [(1, 239), (3, 799), (127, 512), (127, 513), (113, 203), (128, 217),
                        (113, 211), (108, 256), (256, 512), (1023, 1024)],
        }

        def one(case, dtype, local, d, swap_sq_sk, seqlens):
            seqlen_q, seqlen_k = seqlens[::-1] if swap_sq_sk else seqlens
            batch_size, nheads = 2, 3
            window_size = window_for(local, seqlen_k)
            q = randn(batch_size, seqlen_q, nheads, d, dtype=dtype)
            k = randn(batch_size, seqlen_k, nheads, d, dtype=dtype)
            v = randn(batch_size, seqlen_k, nheads, d, dtype=dtype)
            out = flash_attn_func(q, k, v, causal=True, window_size=window_size)
            out_ref = attention_ref(q, k, v, causal=True, window_size=window_size)
            out_pt = attention_ref(q, k, v, causal=True, window_size=window_size, upcast=False,
                                   reorder_ops=True)
            return check_outputs_and_grads("causal", f"{case}, window={window_size}", dtype,
                                           (q, k, v), out, out_ref, out_pt, 2, 2)
        self.run_group("causal", grid, one)

    # tests/test_flash_attn.py::test_flash_attn_splitkv
    def test_splitkv(self):
        grid = {
            "dtype": DTYPES, "alibi": [False, True], "local": [False, True],
            "causal": [False, True],
            "d": [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256],
            "swap_sq_sk": [False, True],
            "seqlens": [(1, 239), (3, 799), (127, 512), (127, 513), (113, 203), (128, 217),
                        (113, 211), (108, 256), (256, 512), (1023, 1024)],
        }

        def one(case, dtype, alibi, local, causal, d, swap_sq_sk, seqlens):
            seqlen_q, seqlen_k = seqlens[::-1] if swap_sq_sk else seqlens
            batch_size, nheads = 1, 4
            window_size = window_for(local, seqlen_k)
            q = randn(batch_size, seqlen_q, nheads, d, dtype=dtype)
            k = randn(batch_size, seqlen_k, nheads, d, dtype=dtype)
            v = randn(batch_size, seqlen_k, nheads, d, dtype=dtype)
            alibi_slopes = torch.rand(batch_size, nheads) * 0.3 if alibi else None
            attn_bias = (attn_bias_from_alibi_slopes(alibi_slopes, seqlen_q, seqlen_k,
                                                     causal=causal) if alibi else None)
            out = flash_attn_func(q, k, v, causal=causal, window_size=window_size,
                                  alibi_slopes=alibi_slopes)
            common = dict(attn_bias=attn_bias, causal=causal, window_size=window_size)
            out_ref = attention_ref(q, k, v, **common)
            out_pt = attention_ref(q, k, v, **common, upcast=False, reorder_ops=True)
            return check_outputs_and_grads("splitkv", f"{case}, window={window_size}", dtype,
                                           (q, k, v), out, out_ref, out_pt, 2,
                                           2 if not alibi else 8)
        self.run_group("splitkv", grid, one)

    # tests/test_flash_attn.py::test_flash_attn_varlen_output (dropout 0)
    def test_varlen_output(self):
        grid = {
            "dtype": DTYPES, "mha_type": ["mha", "mqa", "gqa"], "alibi": [False, True],
            "local": [False, True], "causal": [False, True],
            "d": [32, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256],
            "seqlens": [(1, 147), (113, 203), (128, 217), (113, 211), (108, 256), (256, 512),
                        (512, 256), (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048)],
            "softcap": [0.0, 50.0],
        }

        def one(case, dtype, mha_type, alibi, local, causal, d, seqlens, softcap):
            q, q_in, k, v, alibi_slopes, window_size = output_inputs(
                dtype, mha_type, alibi, local, d, seqlens, softcap)
            (seqlen_q, seqlen_k), batch_size = seqlens, q.shape[0]
            query_padding_mask = generate_random_padding_mask(seqlen_q, batch_size)
            key_padding_mask = generate_random_padding_mask(seqlen_k, batch_size)
            attn_bias = (attn_bias_from_alibi_slopes(alibi_slopes, seqlen_q, seqlen_k,
                                                     query_padding_mask, key_padding_mask,
                                                     causal=causal) if alibi else None)
            out = flash_attn_varlen_func(q_in, k, v, query_padding_mask, key_padding_mask,
                                         causal=causal, window_size=window_size,
                                         softcap=softcap, alibi_slopes=alibi_slopes)
            common = dict(attn_bias=attn_bias, causal=causal, window_size=window_size,
                          softcap=softcap)
            out_ref = attention_ref(q_in, k, v, query_padding_mask, key_padding_mask, **common)
            out_pt = attention_ref(q_in, k, v, query_padding_mask, key_padding_mask, **common,
                                   upcast=False, reorder_ops=True)
            return check_outputs_and_grads("varlen", f"{case}, window={window_size}", dtype,
                                           (q, k, v), out, out_ref, out_pt, 2 if softcap == 0 else 3, 3)
        self.run_group("varlen", grid, one)

    # tests/test_flash_attn.py::test_flash_attn_kvcache (no new keys, rotary,
    # paging or left padding; forward only, as FlashAttention's)
    def test_kvcache(self):
        grid = {
            "dtype": DTYPES, "mha_type": ["mha", "mqa", "gqa"], "alibi": [False, True],
            "local": [False, True], "causal": [False, True], "d": [32, 59, 64, 80, 128, 256],
            "seqlens": [(1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799),
                        (64, 2048), (16, 20000), (1, 128 * 1024), (16, 128 * 1024), (128, 128)],
        }

        def one(case, dtype, mha_type, alibi, local, causal, d, seqlens):
            (seqlen_q, seqlen_k), batch_size, nheads = seqlens, 2, 6
            nheads_k = nheads if mha_type == "mha" else (1 if mha_type == "mqa" else 3)
            window_size = window_for(local, seqlen_k)
            with torch.no_grad():
                q = randn(batch_size, seqlen_q, nheads, d, dtype=dtype).detach()
                k_cache = randn(batch_size, seqlen_k, nheads_k, d, dtype=dtype).detach()
                v_cache = randn(batch_size, seqlen_k, nheads_k, d, dtype=dtype).detach()
                cache_seqlens = torch.randint(1, seqlen_k + 1, (batch_size,))
                key_padding_mask = torch.arange(seqlen_k)[None, :] < cache_seqlens[:, None]
                alibi_slopes = torch.rand(batch_size, nheads) * 0.3 if alibi else None
                attn_bias = (attn_bias_from_alibi_slopes(alibi_slopes, seqlen_q, seqlen_k, None,
                                                         key_padding_mask, causal=causal)
                             if alibi else None)
                full_queries = torch.ones(batch_size, seqlen_q, dtype=torch.bool)
                out = flash_attn_varlen_func(q, k_cache, v_cache, full_queries,
                                             key_padding_mask, causal=causal,
                                             window_size=window_size, alibi_slopes=alibi_slopes)
                common = dict(attn_bias=attn_bias, causal=causal, window_size=window_size)
                out_ref = attention_ref(q, k_cache, v_cache, None, key_padding_mask, **common)
                out_pt = attention_ref(q, k_cache, v_cache, None, key_padding_mask, **common,
                                       upcast=False, reorder_ops=True)
            return check_outputs_and_grads(
                "kvcache", f"{case}, window={window_size}, cache_seqlens={cache_seqlens.tolist()}",
                dtype, (), out, out_ref, out_pt, 3 if not alibi else 5, None)
        self.run_group("kvcache", grid, one)

    # hopper/test_flash_attn.py::test_flash_attn_combine (float32 partials;
    # the output rounded to the test dtype). Batch 5 and 16 heads as theirs,
    # but only cases of at most 2^25 partial values: their largest (133 splits
    # of 1024 x 512, drawn twice as large to be sliced) is 45 GB.
    def test_combine(self):
        grid = {
            "dtype": [torch.float32, torch.bfloat16], "d": [64, 96, 128, 192, 256, 512],
            "seqlen": [1, 2, 3, 32, 64, 256, 113, 108, 640, 1024],
            "num_splits": [1, 2, 3, 5, 17, 32, 55, 97, 133],
        }

        def one(case, dtype, d, seqlen, num_splits):
            batch_size, nheads = 5, 16
            out_partial = torch.randn(num_splits * 2, batch_size, nheads, seqlen,
                                      d).transpose(2, 3)[:num_splits]
            lse_partial = torch.randn(num_splits, batch_size, nheads * 2,
                                      seqlen).transpose(-1, -2)[:, :, :, :nheads]
            lse_partial[num_splits // 2:, :batch_size // 3] = -float("inf")
            # qkv's merge takes outputs (..., Nq, Dv) and lses (..., Nq): here
            # (B, seqlen, H, d) and (B, seqlen, H), the heads as the rows.
            merged = qkv.merge_attention([o.numpy() for o in out_partial],
                                         [lse.numpy() for lse in lse_partial])
            out = torch.from_numpy(merged.output).to(dtype)
            lse = torch.from_numpy(merged.lse)
            out_ref, lse_ref = attention_combine_ref(out_partial.double(), lse_partial.double())
            out_pt = out_ref.to(dtype)
            failures = []
            if not torch.allclose(lse.double(), lse_ref, atol=1e-5, rtol=1e-5):
                failures.append(f"lse: max error {(lse.double() - lse_ref).abs().max():.3g} "
                                f"beyond 1e-5 in {case}")
            if not torch.allclose(out.double(), out_pt.double(), atol=1e-5, rtol=1e-5):
                check("combine", case, "out", out, out_ref, out_pt, 2, failures,
                      allowance=False)
            else:
                COUNTS.setdefault("combine", [0, 0])[0] += 1
            return failures

        def fits(dtype, d, seqlen, num_splits):
            return num_splits * 5 * 16 * seqlen * d <= 2**25
        self.run_group("combine", grid, one, fits)


def print_summary():
    for group, (passed, failed) in sorted(COUNTS.items()):
        ratio, where = WORST.get(group, (0.0, ""))
        print(f"{group:8s} {passed:5d} checks pass, {failed:4d} fail; worst ratio to pt "
              f"{ratio:.2f} ({where})", file=sys.stderr)


if __name__ == "__main__":
    torch.set_num_threads(2)
    for flag in ("--full", "--strict"):
        if flag in sys.argv:
            sys.argv.remove(flag)
    print(f"torch {torch.__version__}, qkv {qkv.__version__} on {qkv.simd_target()}; "
          f"{'every case' if FULL else f'{CASES} cases per group'}; float32 multiples "
          f"x{FLOAT32_ALLOWANCE}; {REPLAY}", file=sys.stderr)
    program = unittest.main(exit=False, verbosity=2)
    print_summary()
    print(REPLAY, file=sys.stderr)
    sys.exit(not program.result.wasSuccessful())
