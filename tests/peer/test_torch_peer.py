#!/usr/bin/python3
"""Peer test: the qkv command against d2l's PyTorch attention code.

Runs one op (--op softmax, dot or additive) of the `qkv` command on fresh
random cases and compares its outputs with d2l's PyTorch implementations of
masked softmax, DotProductAttention and AdditiveAttention, written out from
the chapter's formulas in d2l_reference.py (next to this file, shared with
the Python package's peer tests). The seed is printed first and in every
failure; `--seed S` replays a run and `--case N` one case of it.

Compared by the one rule of the peer tests (d2l_reference.check_close, which
says why): max|got - ref| / max(max|ref|, scale) <= 1e-5 (float32) or 1e-12
(float64), torch computing in the same float type as qkv, scale the size of
the terms the result sums (pooled_scale for outputs, lse_scale for lse).
Outputs are checked in every case, weights and lse in every third.

Where qkv and d2l differ by design (DESIGN.md section 3), the comparison avoids
the difference and a separate check pins down qkv's side of it:
  - valid length L = 0: d2l's -1e6 sentinel turns a fully masked row into
    uniform weights 1/Nk (its output is the mean of all values); qkv masks
    exactly and gives a row of zeros (and a zero output, lse = -inf). Random
    cases therefore draw L >= 1; the L = 0 check asserts qkv's zeros.
  - valid scores below -1e6: the sentinel then outweighs them and d2l puts the
    weight on masked positions; qkv never reads masked positions. Random
    scores stay far above -1e6; a separate softmax check uses -3e6.
  - dropout: torch draws its own mask, so only eval mode is compared; training
    mode is checked on qkv alone (reproducible, mask independent of the data
    and of the thread count, kept weights scaled by 1 / (1 - p)).

Must run under Debian's /usr/bin/python3 (python3-torch, python3-numpy). If
torch or numpy cannot be imported or the qkv binary cannot run, the test fails.
"""

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time


def die(message):
    print(f"peer: error: {message}", file=sys.stderr)
    sys.exit(1)


try:
    import numpy as np
except ImportError as exc:
    die(f"cannot import numpy ({exc}); this test needs Debian's python3-numpy "
        f"and must run under /usr/bin/python3 (running: {sys.executable})")
try:
    import torch
except ImportError as exc:
    die(f"cannot import torch ({exc}); this test needs Debian's python3-torch "
        f"and must run under /usr/bin/python3 (running: {sys.executable})")

NP_DTYPE = {"float32": np.float32, "float64": np.float64}
TORCH_DTYPE = {"float32": torch.float32, "float64": torch.float64}
NP_INT = {"int32": np.int32, "int64": np.int64}

# d2l's implementations (from the chapter's formulas), the comparison rule and
# the drawer of valid lengths live next to this file, shared with the Python
# package's peer tests.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from d2l_reference import (  # noqa: E402
    WORST,
    D2lAdditiveAttention,
    D2lDotProductAttention,
    check_close,
    d2l_masked_softmax,
    describe,
    draw_lens,
    exact_lse,
    lse_scale,
    pooled_scale,
    row_lengths,
)


# ---- the harness ------------------------------------------------------------

class Failure(Exception):
    """A disagreement or a failed qkv run; the message says what and where."""


class Runner:
    def __init__(self, qkv, op, seed, workdir):
        self.qkv = qkv
        self.op = op
        self.seed = seed
        self.workdir = workdir
        self.files = 0
        self.desc = ""  # the case being run, for failure messages

    def path(self, stem):
        self.files += 1
        return os.path.join(self.workdir, f"{stem}_{self.files}.npy")

    def save(self, stem, array):
        path = self.path(stem)
        np.save(path, np.ascontiguousarray(array))
        return path

    def run(self, args, threads=None):
        env = dict(os.environ)
        if threads is not None:
            env["QKV_NUM_THREADS"] = str(threads)
        cmd = [self.qkv] + [str(a) for a in args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        except subprocess.TimeoutExpired:
            raise Failure(f"qkv timed out after 120 s: {' '.join(cmd)}")
        if proc.returncode != 0:
            raise Failure(f"qkv exited with status {proc.returncode}: {' '.join(cmd)}\n"
                          f"    stderr: {proc.stderr.strip()}")
        return proc

    def load(self, path, dtype, shape, what):
        if not os.path.exists(path):
            raise Failure(f"{what}: qkv wrote no file {path}")
        got = np.load(path)
        if got.dtype != np.dtype(NP_DTYPE[dtype]):
            raise Failure(f"{what}: qkv wrote dtype {got.dtype}, expected {dtype}")
        if tuple(got.shape) != tuple(shape):
            raise Failure(f"{what}: qkv wrote shape {list(got.shape)}, expected {list(shape)}")
        return got

    def compare(self, what, got, ref, dtype, axes, scale=None):
        """The peer tests' rule (d2l_reference.check_close); raises Failure past
        the tolerance, with the worst element's coordinates."""
        try:
            return check_close(what, got, ref, dtype, axes=axes, scale=scale)
        except AssertionError as exc:
            raise Failure(str(exc).removesuffix("; ")) from None

    def worst(self, dtype):
        return max((err for (d, _), err in WORST.items() if d == dtype), default=0.0)


def case_plan(index, rng):
    """Cycles dtype, lens form and lens int type so every combination occurs;
    about one case in six uses 2-D inputs (a batch of one)."""
    dtype = ("float32", "float64")[index % 2]
    form = (None, "B", "BNq")[(index // 2) % 3]
    int_type = ("int32", "int64")[(index // 6) % 2]
    two_d = index % 7 == 3 or rng.random() < 0.05
    return dtype, form, int_type, two_d


def lens_file_form(rng, lens, two_d):
    """The valid lens as written for the command. 3-D inputs: (B) or (B, Nq).
    2-D inputs (a batch of one) also take one length as a scalar and one per
    query as (Nq); the reference always sees the batched (1) or (1, Nq)."""
    if not two_d or rng.random() < 0.5:
        return lens
    return lens.reshape(()) if lens.ndim == 1 else lens.reshape(-1)


def mask_dead_keys(keys, lens, num_queries):
    """Fills keys that no query of their batch element may see with NaN: qkv
    must never read them (DESIGN 3), and d2l overwrites their scores with the
    sentinel, so both sides must still agree."""
    lengths = row_lengths(lens, keys.shape[0], num_queries, keys.shape[1])
    hit = False
    for b in range(keys.shape[0]):
        reach = int(lengths[b].max())
        if reach < keys.shape[1]:
            keys[b, reach:, :] = np.nan
            hit = True
    return hit


# ---- softmax ----------------------------------------------------------------

def softmax_case(runner, index, rng):
    dtype, form, int_type, two_d = case_plan(index, rng)
    batch = 1 if two_d else int(rng.integers(1, 5))
    num_queries, num_keys = int(rng.integers(1, 10)), int(rng.integers(1, 13))
    spread = float(rng.choice([0.1, 1.0, 3.0, 10.0]))
    # Logits near 90 overflow exp() in float32 unless the max is subtracted.
    offset = float(rng.choice([0.0, 0.0, 0.0, 90.0, -100.0]))
    scores = rng.normal(offset, spread, size=(batch, num_queries, num_keys))
    # Lengths >= 1: L = 0 has its own check.
    lens = draw_lens(rng, form, batch, num_queries, num_keys, low=1, int_type=NP_INT[int_type])
    lengths = row_lengths(lens, batch, num_queries, num_keys)
    notes = []
    if rng.random() < 0.25 and num_keys > 1:
        # -inf is a legal score (weight 0); keep column 0 finite so no valid row is all -inf.
        holes = rng.random(scores.shape) < 0.2
        holes[..., 0] = False
        scores[holes] = -math.inf
        notes.append("-inf scores")
    if lens is not None and rng.random() < 0.5:
        # Masked positions are never read: garbage there must not matter.
        garbage = np.array([math.nan, math.inf, -math.inf, 1e30])
        for b in range(batch):
            for i in range(num_queries):
                tail = scores[b, i, lengths[b, i]:]
                tail[:] = rng.choice(garbage, size=tail.shape)
        notes.append("garbage in masked positions")
    scores = scores.astype(NP_DTYPE[dtype])
    desc = describe(dtype=dtype, shape=list(scores.shape[1:] if two_d else scores.shape),
                    lens="none" if lens is None else f"{form}/{int_type}",
                    spread=spread, offset=offset) + "".join(f" [{n}]" for n in notes)
    runner.desc = desc

    ref = d2l_masked_softmax(torch.from_numpy(scores),
                             None if lens is None else torch.from_numpy(lens)).numpy()
    files = ["softmax", "--scores", runner.save("scores", scores[0] if two_d else scores)]
    if lens is not None:
        file_lens = lens_file_form(rng, lens, two_d)
        files += ["--valid-lens", runner.save("lens", file_lens)]
        desc += f" [lens file {list(file_lens.shape)}]"
        runner.desc = desc
    out = runner.path("weights")
    runner.run(files + ["--out", out])
    expect = ref[0] if two_d else ref
    got = runner.load(out, dtype, expect.shape, "weights")
    axes = ("q", "k") if two_d else ("b", "q", "k")
    runner.compare("weights", got, expect, dtype, axes)


def softmax_checks(runner):
    """qkv-only semantics that d2l does not share."""
    checks = []

    def zero_length_rows(dtype, int_type, form):
        # d2l would give the fully masked rows uniform weights 1/Nk; qkv gives zeros.
        rng = np.random.default_rng([runner.seed, 1001])
        scores = rng.normal(size=(3, 4, 5)).astype(NP_DTYPE[dtype])
        if form == "1d":
            lens = np.array([2, 0, 5], dtype=NP_INT[int_type])
        else:
            lens = np.array([[0, 1, 5, 3], [2, 0, 0, 4], [5, 5, 1, 0]], dtype=NP_INT[int_type])
        out = runner.path("weights")
        runner.run(["softmax", "--scores", runner.save("scores", scores),
                    "--valid-lens", runner.save("lens", lens), "--out", out])
        got = runner.load(out, dtype, scores.shape, "weights")
        lengths = row_lengths(lens, 3, 4, 5)
        empty = lengths == 0
        d2l = d2l_masked_softmax(torch.from_numpy(scores), torch.from_numpy(lens)).numpy()
        assert np.allclose(d2l[empty], 1.0 / 5), "d2l's sentinel should give uniform rows"
        bad = empty & np.any(got != 0, axis=-1)
        if np.any(bad):
            b, i = np.argwhere(bad)[0]
            raise Failure(f"L = 0 rows must be all zeros (DESIGN 3): b={b} q={i} got {got[b, i]}")
        runner.compare("weights (rows with L >= 1)", got[~empty], d2l[~empty], dtype, ("row", "k"))

    def below_sentinel(dtype):
        # Valid scores of -3e6 still count; d2l's sentinel (-1e6) would win over them.
        scores = np.array([[[-3e6, -3e6 + 2.0, 5.0]]], dtype=NP_DTYPE[dtype])
        lens = np.array([2], dtype=np.int64)
        out = runner.path("weights")
        runner.run(["softmax", "--scores", runner.save("scores", scores),
                    "--valid-lens", runner.save("lens", lens), "--out", out])
        got = runner.load(out, dtype, scores.shape, "weights")
        e2 = math.exp(2.0)
        expect = np.array([[[1.0 / (1.0 + e2), e2 / (1.0 + e2), 0.0]]])
        runner.compare("weights with valid scores below -1e6", got, expect, dtype, ("b", "q", "k"))

    for dtype in ("float32", "float64"):
        checks.append((f"L = 0 rows give zeros, 1-D int32 lens, {dtype}",
                       lambda d=dtype: zero_length_rows(d, "int32", "1d")))
        checks.append((f"L = 0 rows give zeros, 2-D int64 lens, {dtype}",
                       lambda d=dtype: zero_length_rows(d, "int64", "2d")))
        checks.append((f"valid scores below d2l's -1e6 sentinel, {dtype}",
                       lambda d=dtype: below_sentinel(d)))
    return checks


# ---- dot and additive attention --------------------------------------------

def attention_inputs(runner, index, rng, op):
    """Draws one case; returns (description, torch module in eval mode, numpy inputs
    (queries, keys, values, lens), CLI arguments, two_d, dtype)."""
    dtype, form, int_type, two_d = case_plan(index, rng)
    batch = 1 if two_d else int(rng.integers(1, 5))
    num_queries, num_keys = int(rng.integers(1, 10)), int(rng.integers(1, 13))
    value_dim = int(rng.integers(1, 17))
    notes = []
    if op == "dot":
        head_dim = int(rng.integers(1, 17))
        while value_dim == head_dim:
            value_dim = int(rng.integers(1, 18))
        query_dim = key_dim = head_dim
        query_spread = float(rng.choice([0.3, 1.0, 2.0]))
    else:
        query_dim, key_dim = int(rng.integers(1, 17)), int(rng.integers(1, 17))
        while key_dim == query_dim:
            key_dim = int(rng.integers(1, 17))
        num_hiddens = int(rng.integers(1, 25))
        query_spread = 1.0
    queries = rng.normal(0.0, query_spread, size=(batch, num_queries, query_dim))
    keys = rng.normal(size=(batch, num_keys, key_dim))
    values = rng.normal(size=(batch, num_keys, value_dim))
    # Lengths >= 1: L = 0 has its own check.
    lens = draw_lens(rng, form, batch, num_queries, num_keys, low=1, int_type=NP_INT[int_type])
    if lens is not None and rng.random() < 0.3 and mask_dead_keys(keys, lens, num_queries):
        notes.append("NaN in keys no query may see")
    np_type = NP_DTYPE[dtype]
    queries, keys, values = (a.astype(np_type) for a in (queries, keys, values))

    def batch_arg(a):
        return a[0] if two_d else a

    args = ["attend", "--scoring", op,
            "--queries", runner.save("queries", batch_arg(queries)),
            "--keys", runner.save("keys", batch_arg(keys)),
            "--values", runner.save("values", batch_arg(values))]
    if lens is not None:
        file_lens = lens_file_form(rng, lens, two_d)
        args += ["--valid-lens", runner.save("lens", file_lens)]
        notes.append(f"lens file {list(file_lens.shape)}")

    torch.manual_seed(int(rng.integers(2**62)))
    if op == "dot":
        scale = None
        if rng.random() < 0.25:
            scale = float(rng.uniform(0.05, 2.0))
            args += ["--scale", repr(scale)]
        module = D2lDotProductAttention(dropout=0.5, scale=scale)
        shape_desc = describe(B=batch, Nq=num_queries, Nk=num_keys, D=head_dim, Dv=value_dim)
        if scale is not None:
            notes.append(f"scale {scale:.6g}")
    else:
        module = D2lAdditiveAttention(key_dim, query_dim, num_hiddens, dropout=0.5)
        with torch.no_grad():
            if rng.random() < 0.3:
                module.w_v.weight.mul_(5.0)  # sharper weights
                notes.append("w_v x5")
        module = module.to(TORCH_DTYPE[dtype])
        w_v = module.w_v.weight.detach().numpy()
        if rng.random() < 0.5:
            w_v = w_v.reshape(-1)
        args += ["--wq", runner.save("wq", module.W_q.weight.detach().numpy()),
                 "--wk", runner.save("wk", module.W_k.weight.detach().numpy()),
                 "--wv", runner.save("wv", w_v)]
        shape_desc = describe(B=batch, Nq=num_queries, Nk=num_keys, Dq=query_dim, Dk=key_dim,
                              H=num_hiddens, Dv=value_dim)
        notes.append(f"w_v {list(w_v.shape)}")
    module.eval()  # no dropout: torch's dropout mask is not qkv's
    desc = (f"dtype={dtype} {shape_desc}{' 2-D' if two_d else ''} "
            f"lens={'none' if lens is None else f'{form}/{int_type}'}"
            + "".join(f" [{n}]" for n in notes))
    return desc, module, (queries, keys, values, lens), args, two_d, dtype


def attention_reference(module, queries, keys, values, lens):
    with torch.no_grad():
        out = module(torch.from_numpy(queries), torch.from_numpy(keys), torch.from_numpy(values),
                     None if lens is None else torch.from_numpy(lens))
    return out.numpy(), module.attention_weights.numpy(), module.scores


def attention_case(runner, index, rng):
    op = runner.op
    desc, module, inputs, args, two_d, dtype = attention_inputs(runner, index, rng, op)
    runner.desc = desc
    queries, keys, values, lens = inputs
    ref_out, ref_weights, scores = attention_reference(module, *inputs)
    with_extras = index % 3 == 0
    out = runner.path("out")
    args += ["--out", out]
    if with_extras:
        weights_path, lse_path = runner.path("weights"), runner.path("lse")
        args += ["--weights", weights_path, "--lse", lse_path]
        desc += " [+weights +lse]"
        runner.desc = desc
    runner.run(args)

    def unbatch(a):
        return a[0] if two_d else a

    prefix = () if two_d else ("b",)
    got = runner.load(out, dtype, unbatch(ref_out).shape, "output")
    runner.compare("output", got, unbatch(ref_out), dtype, prefix + ("q", "d"),
                   scale=pooled_scale(ref_weights, values))
    if with_extras:
        got_w = runner.load(weights_path, dtype, unbatch(ref_weights).shape, "weights")
        runner.compare("weights", got_w, unbatch(ref_weights), dtype, prefix + ("q", "k"))
        ref_lse = exact_lse(scores, lens)
        got_lse = runner.load(lse_path, dtype, unbatch(ref_lse).shape, "lse")
        # The denominator takes the size of the valid scores, at least 1
        # (d2l_reference.lse_scale says why).
        runner.compare("lse", got_lse, unbatch(ref_lse), dtype, prefix + ("q",),
                       scale=lse_scale(scores, lens))


def fixed_attention_inputs(op, dtype, seed, batch, num_queries, num_keys, value_dim,
                           query_spread=1.0):
    """A reproducible attention problem (numpy inputs, torch module, CLI weight args)."""
    rng = np.random.default_rng(seed)
    np_type = NP_DTYPE[dtype]
    if op == "dot":
        query_dim = key_dim = 8
    else:
        query_dim, key_dim, num_hiddens = 6, 5, 7
    queries = rng.normal(0.0, query_spread, size=(batch, num_queries, query_dim)).astype(np_type)
    keys = rng.normal(size=(batch, num_keys, key_dim)).astype(np_type)
    values = rng.normal(size=(batch, num_keys, value_dim)).astype(np_type)
    torch.manual_seed(int(rng.integers(2**62)))
    if op == "dot":
        module = D2lDotProductAttention(dropout=0.5)
    else:
        module = D2lAdditiveAttention(key_dim, query_dim, num_hiddens, dropout=0.5)
        with torch.no_grad():
            module.w_v.weight.mul_(0.3)  # flat weights: every kept weight is identifiable
        module = module.to(TORCH_DTYPE[dtype])
    module.eval()
    return queries, keys, values, module


def attention_checks(runner):
    """qkv-only semantics: L = 0, dropout in training mode, thread-count independence."""
    op = runner.op
    checks = []

    def base_args(queries, keys, values, module, stem):
        args = ["attend", "--scoring", op,
                "--queries", runner.save(f"{stem}q", queries),
                "--keys", runner.save(f"{stem}k", keys),
                "--values", runner.save(f"{stem}v", values)]
        if op == "additive":
            args += ["--wq", runner.save("wq", module.W_q.weight.detach().numpy()),
                     "--wk", runner.save("wk", module.W_k.weight.detach().numpy()),
                     "--wv", runner.save("wv", module.w_v.weight.detach().numpy())]
        return args

    def zero_length(dtype, int_type, form):
        # d2l's sentinel would make an L = 0 query's output the mean of all
        # values; qkv's is zero (an empty sum), its weights zero, its lse -inf.
        queries, keys, values, module = fixed_attention_inputs(
            op, dtype, [runner.seed, 2001], 3, 4, 6, 5)
        if form == "1d":
            lens = np.array([0, 6, 3], dtype=NP_INT[int_type])
        else:
            lens = np.array([[1, 0, 6, 2], [0, 0, 0, 0], [3, 5, 0, 4]], dtype=NP_INT[int_type])
        args = base_args(queries, keys, values, module, "z")
        out, weights_path, lse_path = runner.path("out"), runner.path("w"), runner.path("lse")
        args += ["--valid-lens", runner.save("lens", lens), "--out", out,
                 "--weights", weights_path, "--lse", lse_path]
        runner.run(args)
        ref_out, ref_weights, scores = attention_reference(module, queries, keys, values, lens)
        got = runner.load(out, dtype, ref_out.shape, "output")
        got_w = runner.load(weights_path, dtype, ref_weights.shape, "weights")
        got_lse = runner.load(lse_path, dtype, ref_out.shape[:2], "lse")
        empty = row_lengths(lens, 3, 4, 6) == 0
        assert np.allclose(ref_out[empty], values.mean(axis=1, keepdims=True)
                           .repeat(4, axis=1)[empty], atol=1e-5), "d2l averages all values"
        for b, i in np.argwhere(empty):
            if np.any(got[b, i] != 0) or np.any(got_w[b, i] != 0):
                raise Failure(f"L = 0 must give zero output and weights (DESIGN 3): b={b} q={i} "
                              f"output {got[b, i]}, weights {got_w[b, i]}")
            if not (np.isneginf(got_lse[b, i])):
                raise Failure(f"L = 0 must give lse = -inf (attention.h): b={b} q={i} "
                              f"got {got_lse[b, i]}")
        runner.compare("output (queries with L >= 1)", got[~empty], ref_out[~empty], dtype,
                       ("row", "d"), scale=pooled_scale(ref_weights, values))
        runner.compare("weights (queries with L >= 1)", got_w[~empty], ref_weights[~empty],
                       dtype, ("row", "k"))

    def dropout(dtype):
        # Training mode with p = 0.5: torch's mask is its own, so this checks
        # qkv alone. out[b, i] = sum_j w[b, i, j] * keep[b, i, j] * 2 * v[b, j]
        # with keep a function of (seed, b, i, j) only (DESIGN 3). With
        # Dv >= Nk the keep pattern of each query is recovered exactly by
        # trying all 2^Nk of them against qkv's output and (pre-dropout) weights.
        batch, num_queries, num_keys, value_dim = 4, 9, 10, 16
        queries, keys, values, module = fixed_attention_inputs(
            op, dtype, [runner.seed, 3001], batch, num_queries, num_keys, value_dim,
            query_spread=0.3)
        other_values = np.random.default_rng([runner.seed, 3002]).normal(
            size=values.shape).astype(values.dtype)
        seed = int(np.random.default_rng([runner.seed, 3003]).integers(2**31))

        def attend(vals, train_seed, threads, stem):
            out, weights_path = runner.path(f"{stem}out"), runner.path(f"{stem}w")
            args = base_args(queries, keys, vals, module, stem) + ["--out", out,
                                                                   "--weights", weights_path]
            if train_seed is not None:
                args += ["--dropout", "0.5", "--train", "--seed", train_seed]
            runner.run(args, threads=threads)
            shape = (batch, num_queries)
            return (runner.load(out, dtype, shape + (value_dim,), "output"),
                    runner.load(weights_path, dtype, shape + (num_keys,), "weights"))

        eval_out, eval_w = attend(values, None, None, "e")
        out1, w1 = attend(values, seed, 1, "a")
        out1b, _ = attend(values, seed, 1, "b")
        out2, w2 = attend(values, seed, 2, "c")
        if not np.array_equal(out1, out1b):
            raise Failure("dropout with the same seed is not reproducible (two runs differ)")
        if not (np.array_equal(out1, out2) and np.array_equal(w1, w2)):
            raise Failure("dropout output differs between QKV_NUM_THREADS=1 and 2 "
                          "(DESIGN 3: bitwise identical for any thread count)")
        if np.array_equal(out1, eval_out):
            raise Failure("--dropout 0.5 --train gives the eval-mode output")
        runner.compare("weights with --train (before dropout) vs eval", w1, eval_w, dtype,
                       ("b", "q", "k"))
        _, ref_weights, _ = attention_reference(module, queries, keys, values, None)
        runner.compare("eval weights vs d2l", eval_w, ref_weights, dtype, ("b", "q", "k"))

        patterns = ((np.arange(2**num_keys)[:, None] >> np.arange(num_keys)[None, :]) & 1)
        patterns = patterns.astype(np.float64)

        def recover(out, weights, vals):
            keep = np.zeros((batch, num_queries, num_keys), dtype=np.int64)
            tol = {"float32": 1e-5, "float64": 1e-12}[dtype] * max(1.0, np.abs(vals).max())
            for b in range(batch):
                for i in range(num_queries):
                    terms = weights[b, i].astype(np.float64)[:, None] * vals[b]  # (Nk, Dv)
                    candidates = 2.0 * patterns @ terms  # scaled by 1 / (1 - p) = 2
                    residual = np.abs(candidates - out[b, i]).max(axis=1)
                    best = int(np.argmin(residual))
                    if residual[best] > tol:
                        raise Failure(f"dropout: b={b} q={i}: output is not 2 * (w o keep) v for "
                                      f"any keep pattern (best residual {residual[best]:.3g}); "
                                      f"got {out[b, i]}")
                    keep[b, i] = patterns[best]
            return keep

        keep = recover(out1, w1, values)
        fraction = keep.mean()
        if not 0.35 <= fraction <= 0.65:
            raise Failure(f"dropout p = 0.5 kept {fraction:.3f} of {keep.size} weights")
        other_out, other_w = attend(other_values, seed, None, "o")
        if not np.array_equal(recover(other_out, other_w, other_values), keep):
            raise Failure("dropout keep pattern changed with the values (DESIGN 3: it is a "
                          "function of (seed, b, i, j) only)")
        new_out, new_w = attend(values, seed + 1, None, "n")
        if np.array_equal(recover(new_out, new_w, values), keep):
            raise Failure("dropout keep pattern is the same for seeds "
                          f"{seed} and {seed + 1}")
        return f"kept {fraction:.3f} of {keep.size}"

    def threads_eval(dtype):
        queries, keys, values, module = fixed_attention_inputs(
            op, dtype, [runner.seed, 4001], 3, 37, 45, 11)
        lens = np.random.default_rng([runner.seed, 4002]).integers(1, 46, size=(3, 37))
        outputs = []
        for threads in (1, 2):
            out, weights_path = runner.path("out"), runner.path("w")
            runner.run(base_args(queries, keys, values, module, "t") +
                       ["--valid-lens", runner.save("lens", lens), "--out", out,
                        "--weights", weights_path], threads=threads)
            outputs.append((runner.load(out, dtype, (3, 37, 11), "output"),
                            runner.load(weights_path, dtype, (3, 37, 45), "weights")))
        if not all(np.array_equal(a, b) for a, b in zip(*outputs)):
            raise Failure("output differs between QKV_NUM_THREADS=1 and 2 "
                          "(DESIGN 3: bitwise identical for any thread count)")
        ref_out, ref_weights, _ = attention_reference(module, queries, keys, values, lens)
        runner.compare("output", outputs[0][0], ref_out, dtype, ("b", "q", "d"),
                       scale=pooled_scale(ref_weights, values))

    for dtype in ("float32", "float64"):
        checks.append((f"L = 0 gives zero output, weights and lse = -inf, 1-D int32 lens, {dtype}",
                       lambda d=dtype: zero_length(d, "int32", "1d")))
        checks.append((f"L = 0 gives zero output, weights and lse = -inf, 2-D int64 lens, {dtype}",
                       lambda d=dtype: zero_length(d, "int64", "2d")))
        checks.append((f"dropout 0.5 --train: reproducible, 2x kept weights, data-independent "
                       f"mask, {dtype}", lambda d=dtype: dropout(d)))
        checks.append((f"same bits with 1 and 2 threads (B=3 Nq=37 Nk=45), {dtype}",
                       lambda d=dtype: threads_eval(d)))
    return checks


# ---- main -------------------------------------------------------------------

def check_binary(qkv):
    if not os.path.isfile(qkv):
        die(f"qkv binary {qkv!r} does not exist (build the qkv_cli target)")
    try:
        proc = subprocess.run([qkv, "--help"], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        die(f"cannot run the qkv binary {qkv!r}: {exc}")
    except subprocess.TimeoutExpired:
        die(f"`{qkv} --help` did not finish in 60 s")
    if proc.returncode != 0:
        die(f"`{qkv} --help` exited with status {proc.returncode}: {proc.stderr.strip()}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qkv", required=True, help="path of the qkv command")
    parser.add_argument("--op", required=True, choices=("softmax", "dot", "additive"))
    parser.add_argument("--seed", type=int, help="replay a run (default: fresh from os.urandom)")
    parser.add_argument("--cases", type=int, default=60, help="random cases (default 60)")
    parser.add_argument("--case", type=int, help="run only this random case (with --seed)")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per case")
    args = parser.parse_args()

    check_binary(args.qkv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    np.set_printoptions(precision=9, linewidth=150, threshold=64)
    torch.set_num_threads(1)  # the cases are tiny; threads only add start-up cost
    replay = (f"{sys.executable} {os.path.abspath(__file__)} --qkv {args.qkv} --op {args.op} "
              f"--seed {seed}")
    print(f"peer {args.op}: seed {seed} (replay: {replay})", flush=True)

    start = time.monotonic()
    passed, failed = 0, 0
    with tempfile.TemporaryDirectory(prefix=f"qkv_peer_{args.op}_") as workdir:
        runner = Runner(args.qkv, args.op, seed, workdir)
        case_fn = softmax_case if args.op == "softmax" else attention_case
        indices = [args.case] if args.case is not None else range(args.cases)
        for index in indices:
            rng = np.random.default_rng([seed, index])
            runner.desc = "(failed while drawing the case)"
            try:
                case_fn(runner, index, rng)
                passed += 1
                if args.verbose:
                    print(f"  ok   case {index}: {runner.desc}")
            except (Failure, AssertionError) as exc:
                failed += 1
                print(f"  FAIL case {index}: {runner.desc}\n    {exc}\n"
                      f"    replay: {replay} --case {index}", flush=True)
        if args.case is None:
            checks = softmax_checks(runner) if args.op == "softmax" else attention_checks(runner)
            for name, check in checks:
                try:
                    note = check()
                    passed += 1
                    if args.verbose:
                        print(f"  ok   check: {name}" + (f" ({note})" if note else ""))
                except (Failure, AssertionError) as exc:
                    failed += 1
                    print(f"  FAIL check: {name}\n    {exc}\n    replay: {replay}", flush=True)

    elapsed = time.monotonic() - start
    if args.verbose:
        print(f"  ({elapsed:.1f} s)")
    print(f"peer {args.op}: {passed} passed, {failed} failed (worst rel err "
          f"float32 {runner.worst('float32'):.2g}, float64 {runner.worst('float64'):.2g})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
