#!/usr/bin/python3
"""The performance suite's PyTorch side: d2l's formulations of the ops in bench_perf.cc.

The code of the book's chapter (d2l 11.2 and 11.3, PyTorch tab) as written
there: masked_softmax through sequence_mask with the -1e6 sentinel,
DotProductAttention with torch.bmm, AdditiveAttention with
nn.Linear(bias=False) layers and features = q.unsqueeze(2) + k.unsqueeze(1),
and Nadaraya-Watson as softmax(-(X_repeat - x_train)**2 / 2) @ y_train.
float32, torch.set_num_threads(threads), eval mode and torch.no_grad() for
forwards, autograd for forward + backward (out.backward(d_out)).

Each case: one warm-up run, then the median of --repeats runs. Peak memory
beyond inputs and outputs is measured on every run the same way as in
bench_perf.cc (malloc_trim, write 5 to /proc/self/clear_refs, run, read VmHWM;
extra = VmHWM - RSS at the reset - bytes of the returned tensors) and the
median reported. Case names match bench_perf.cc's, with implementation
"d2l_torch". Writes JSON (--out). bench/performance.py runs it; run it under
Debian's /usr/bin/python3 (python3-torch, torch 1.13). The rows with a heads
layout (issue 15's) use torch 2's documented math for
scaled_dot_product_attention, which torch 1.13 lacks; torch 2.13's own
scaled_dot_product_attention is timed by bench/perf_torch2.py in the
project's venv (the two torches never share a process).
"""

import argparse
import ctypes
import gc
import json
import math
import statistics
import sys
import time

import numpy as np
import torch
from torch import nn

GIB = 2 ** 30
LIBC = ctypes.CDLL("libc.so.6")


# ---- d2l (the book's code, PyTorch tab) ---------------------------------------------

def sequence_mask(X, valid_len, value=0):
    """Mask irrelevant entries in sequences."""
    maxlen = X.size(1)
    mask = torch.arange((maxlen), dtype=torch.float32,
                        device=X.device)[None, :] < valid_len[:, None]
    X[~mask] = value
    return X


def masked_softmax(X, valid_lens):
    """Perform softmax operation by masking elements on the last axis."""
    # X: 3D tensor, valid_lens: 1D or 2D tensor
    if valid_lens is None:
        return nn.functional.softmax(X, dim=-1)
    else:
        shape = X.shape
        if valid_lens.dim() == 1:
            valid_lens = torch.repeat_interleave(valid_lens, shape[1])
        else:
            valid_lens = valid_lens.reshape(-1)
        # On the last axis, replace masked elements with a very large negative
        # value, whose exponentiation outputs 0
        X = sequence_mask(X.reshape(-1, shape[-1]), valid_lens, value=-1e6)
        return nn.functional.softmax(X.reshape(shape), dim=-1)


class AdditiveAttention(nn.Module):
    """Additive attention."""
    def __init__(self, key_size, query_size, num_hiddens, dropout, **kwargs):
        super(AdditiveAttention, self).__init__(**kwargs)
        self.W_k = nn.Linear(key_size, num_hiddens, bias=False)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=False)
        self.w_v = nn.Linear(num_hiddens, 1, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, queries, keys, values, valid_lens):
        queries, keys = self.W_q(queries), self.W_k(keys)
        # After dimension expansion, shape of queries: (batch_size, no. of
        # queries, 1, num_hiddens) and shape of keys: (batch_size, 1, no. of
        # key-value pairs, num_hiddens). Sum them up with broadcasting
        features = queries.unsqueeze(2) + keys.unsqueeze(1)
        features = torch.tanh(features)
        # There is only one output of self.w_v, so we remove the last
        # one-dimensional entry from the shape. Shape of scores: (batch_size,
        # no. of queries, no. of key-value pairs)
        scores = self.w_v(features).squeeze(-1)
        self.attention_weights = masked_softmax(scores, valid_lens)
        # Shape of values: (batch_size, no. of key-value pairs, value
        # dimension)
        return torch.bmm(self.dropout(self.attention_weights), values)


class DotProductAttention(nn.Module):
    """Scaled dot product attention."""
    def __init__(self, dropout, **kwargs):
        super(DotProductAttention, self).__init__(**kwargs)
        self.dropout = nn.Dropout(dropout)

    # Shape of queries: (batch_size, no. of queries, d)
    # Shape of keys: (batch_size, no. of key-value pairs, d)
    # Shape of values: (batch_size, no. of key-value pairs, value dimension)
    # Shape of valid_lens: (batch_size,) or (batch_size, no. of queries)
    def forward(self, queries, keys, values, valid_lens=None):
        d = queries.shape[-1]
        # Set transpose_b=True to swap the last two dimensions of keys
        scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(d)
        self.attention_weights = masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)


def nadaraya_watson(x_train, y_train, x_test):
    """d2l 11.2's nonparametric attention pooling (Gaussian kernel, h = 1)."""
    n_train = len(x_train)
    # Shape of X_repeat: (n_test, n_train), where each row contains the same
    # testing inputs (i.e., same queries)
    X_repeat = x_test.repeat_interleave(n_train).reshape((-1, n_train))
    # Shape of attention_weights: (n_test, n_train), where each row contains
    # attention weights to be assigned among the values (y_train) given each query
    attention_weights = nn.functional.softmax(-(X_repeat - x_train)**2 / 2, dim=1)
    # Each element of y_hat is weighted average of values, where weights are
    # attention weights
    return torch.matmul(attention_weights, y_train)


# ---- measurement ----------------------------------------------------------------------

def status_bytes(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def available_bytes():
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss():
    """Resets VmHWM to the current RSS (after handing free heap pages back) and returns it."""
    gc.collect()
    LIBC.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return status_bytes("VmRSS")


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def measure(fn, repeats, before=None):
    """fn() -> tuple of returned tensors. Warm-up, then `repeats` timed runs.

    Returns the median seconds, all runs' seconds and the median extra bytes.
    `before` (untimed) runs before each call, e.g. to clear gradients.
    """
    seconds, extras = [], []
    for run in range(repeats + 1):
        if before is not None:
            before()
        rss = reset_peak_rss()
        start = time.perf_counter()
        outputs = fn()
        elapsed = time.perf_counter() - start
        extra = status_bytes("VmHWM") - rss - tensor_bytes(outputs)
        del outputs
        if run > 0:  # run 0 is the warm-up
            seconds.append(elapsed)
            extras.append(extra)
    return {"seconds": statistics.median(seconds), "runs": seconds,
            "extra_bytes": statistics.median(extras)}


# ---- the cases ----------------------------------------------------------------------------

def sdpa_inputs(batch, n, dim=64, grad=False):
    gen = torch.Generator().manual_seed(batch * 100003 + n)
    q, k, v, d_out = (torch.randn(batch, n, dim, generator=gen) for _ in range(4))
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v, d_out


def sdpa_forward(batch, n, lens, repeats):
    q, k, v, _ = sdpa_inputs(batch, n)
    attention = DotProductAttention(dropout=0.0).eval()

    def clear():
        attention.attention_weights = None  # the module keeps the last weights

    def run():
        with torch.no_grad():
            return (attention(q, k, v, lens),)
    return measure(run, repeats, before=clear)


def sdpa_forward_backward(batch, n, lens, repeats):
    q, k, v, d_out = sdpa_inputs(batch, n, grad=True)
    attention = DotProductAttention(dropout=0.0).train()

    def clear():
        attention.attention_weights = None  # the module keeps the last weights
        for t in (q, k, v):
            t.grad = None

    def run():
        out = attention(q, k, v, lens)
        out.backward(d_out)
        return (out.detach(), q.grad, k.grad, v.grad)
    return measure(run, repeats, before=clear)


def additive(batch, n, backward, repeats):
    torch.manual_seed(7)
    q, k, v, d_out = sdpa_inputs(batch, n, grad=backward)
    attention = AdditiveAttention(key_size=64, query_size=64, num_hiddens=64, dropout=0.0)
    params = list(attention.parameters())
    if not backward:
        attention.eval()

        def clear_weights():
            attention.attention_weights = None  # the module keeps the last weights

        def run():
            with torch.no_grad():
                return (attention(q, k, v, None),)
        return measure(run, repeats, before=clear_weights)

    attention.train()

    def clear():
        attention.attention_weights = None
        for t in [q, k, v] + params:
            t.grad = None

    def run():
        out = attention(q, k, v, None)
        out.backward(d_out)
        return (out.detach(), q.grad, k.grad, v.grad) + tuple(p.grad for p in params)
    return measure(run, repeats, before=clear)


def softmax_forward(batch, n, lens, repeats):
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(batch, n, n, generator=gen)

    def run():
        with torch.no_grad():
            # d2l's sequence_mask writes the sentinel into its argument (a view
            # of the scores): same positions every run, so the input stays valid.
            return (masked_softmax(scores, lens),)
    return measure(run, repeats)


# ---- transformer attention (issue 15): torch 2.x's documented math -------------------
# Debian's torch 1.13 has no scaled_dot_product_attention; this is the
# reference implementation its documentation gives (scores, += bias or
# masked_fill(-inf), softmax, @ V; key heads repeat_interleave'd for GQA).

def math_attention(q, k, v, keep=None, bias=None):
    if q.shape[1] != k.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1]))
    if bias is not None:
        scores += bias
    if keep is not None:
        scores.masked_fill_(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def heads_keep_and_bias(form, n):
    """The mask or bias of bench_perf.cc's form (the same kind, its own random draw)."""
    gen = torch.Generator().manual_seed(5)
    if form == "causal":
        return torch.ones(n, n, dtype=torch.bool).tril(), None
    if form == "mask":
        keep = torch.rand(n, n, generator=gen) < 0.5
        keep[:, 0] = True
        return keep, None
    if form == "window256":
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        return (j <= i) & (j > i - 256), None
    if form == "bias":
        return None, torch.randn(n, n, generator=gen)
    return None, None


def heads_attention(form, backward, repeats, batch=2, heads=8, n=4096, dim=64):
    gen = torch.Generator().manual_seed(11)
    q, k, v, d_out = (torch.randn(batch, heads, n, dim, generator=gen) for _ in range(4))
    keep, bias = heads_keep_and_bias(form, n)
    if not backward:
        def run():
            with torch.no_grad():
                return (math_attention(q, k, v, keep, bias),)
        return measure(run, repeats)
    for t in (q, k, v):
        t.requires_grad_(True)

    def clear():
        for t in (q, k, v):
            t.grad = None

    def run():
        out = math_attention(q, k, v, keep, bias)
        out.backward(d_out)
        return (out.detach(), q.grad, k.grad, v.grad)
    return measure(run, repeats, before=clear)


def gqa_decode(repeats, heads=32, kv_heads=8, keys=65536, dim=128):
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(1, heads, 1, dim, generator=gen)
    k, v = (torch.randn(1, kv_heads, keys, dim, generator=gen) for _ in range(2))

    def run():
        with torch.no_grad():
            return (math_attention(q, k, v),)
    return measure(run, repeats)


def nw_exact(n, repeats):
    rng = np.random.default_rng(8)
    x = np.sort(rng.uniform(0.0, 5.0, n))
    y = 2.0 * np.sin(x) + x ** 0.8 + rng.normal(0.0, 0.5, n)
    x_train = torch.from_numpy(x).float()
    y_train = torch.from_numpy(y).float()
    x_test = torch.arange(0, 5, 5 / n, dtype=torch.float32)[:n]

    def run():
        with torch.no_grad():
            return (nadaraya_watson(x_train, y_train, x_test),)
    return measure(run, repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdpa-lens", required=True, help="2 valid lengths in [1, 4096], comma-separated")
    parser.add_argument("--softmax-lens", required=True, help="32 valid lengths in [1, 512]")
    parser.add_argument("--sweep", default="512,1024,2048,4096,8192,16384,32768",
                        help="N values of the SDPA scaling sweep (B = 1, d = 64)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case (median)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-gib", type=float, default=12.0,
                        help="skip a case whose estimated peak exceeds this (GiB)")
    parser.add_argument("--only", default="", help="run only cases whose name contains this")
    parser.add_argument("--out", required=True, help="JSON output file")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    sdpa_lens = torch.tensor([int(s) for s in args.sdpa_lens.split(",")])
    softmax_lens = torch.tensor([int(s) for s in args.softmax_lens.split(",")])
    results = {}

    def case(name, need_bytes, fn):
        """Runs fn() -> result dict unless it would need more than --max-gib (or than is free)."""
        if args.only and args.only not in name:
            return
        available = available_bytes()
        if need_bytes > args.max_gib * GIB or need_bytes > available - GIB:
            results[name] = {"skipped": f"needs about {need_bytes / GIB:.1f} GiB (limit "
                                        f"{args.max_gib:g} GiB, {available / GIB:.1f} GiB free)"}
            print(f"{name}: skipped, {results[name]['skipped']}", file=sys.stderr, flush=True)
            return
        result = fn()
        results[name] = result
        print(f"{name}: {result['seconds']:.4g} s (runs {', '.join(f'{s:.4g}' for s in result['runs'])}), "
              f"extra {result['extra_bytes'] / 2 ** 20:.1f} MiB", file=sys.stderr, flush=True)

    # Estimated needs: d2l holds a few (B, Q, K) float32 tensors at once.
    def scores_bytes(batch, nq, nk):
        return batch * nq * nk * 4

    for masked, suffix in ((False, "B2_N4096_nomask"), (True, "B2_N4096_lens")):
        lens = sdpa_lens if masked else None
        case("sdpa_fwd/d2l_torch/" + suffix, 4 * scores_bytes(2, 4096, 4096),
             lambda: sdpa_forward(2, 4096, lens, args.repeats))
        case("sdpa_fwdbwd/d2l_torch/" + suffix, 6 * scores_bytes(2, 4096, 4096),
             lambda: sdpa_forward_backward(2, 4096, lens, args.repeats))
    case("additive_fwd/d2l_torch/B4_N512", 4 * scores_bytes(4, 512, 512) * 64,
         lambda: additive(4, 512, False, args.repeats))
    case("additive_fwdbwd/d2l_torch/B4_N512", 6 * scores_bytes(4, 512, 512) * 64,
         lambda: additive(4, 512, True, args.repeats))
    case("softmax_fwd/d2l_torch/B32_N512_lens", 4 * scores_bytes(32, 512, 512),
         lambda: softmax_forward(32, 512, softmax_lens, args.repeats))
    case("softmax_fwd/d2l_torch/B32_N512_nomask", 4 * scores_bytes(32, 512, 512),
         lambda: softmax_forward(32, 512, None, args.repeats))
    case("nw_exact/d2l_torch/N30000", 3 * scores_bytes(1, 30000, 30000),
         lambda: nw_exact(30000, args.repeats))
    # Issue 15's rows: (B, H, N, N) float32 scores are 1 GiB at B=2, H=8, N=4096.
    heads_scores = scores_bytes(16, 4096, 4096)
    for form in ("", "_causal", "_mask", "_window256", "_bias"):
        case("mha_fwd/d2l_torch/B2_H8_N4096" + form, 3 * heads_scores,
             lambda: heads_attention(form.lstrip("_"), False, args.repeats))
    for form in ("", "_causal"):
        case("mha_fwdbwd/d2l_torch/B2_H8_N4096" + form, 6 * heads_scores,
             lambda: heads_attention(form.lstrip("_"), True, args.repeats))
    case("gqa_decode/d2l_torch/B1_H32_Hkv8_Nk65536", 3 * 32 * 65536 * 128 * 4,
         lambda: gqa_decode(args.repeats))
    # The sweep: each N's need estimated as 4x the previous N's measured peak
    # (the d2l formulation is quadratic), else 4 score matrices.
    previous = None
    for n in (int(s) for s in args.sweep.split(",")):
        name = f"sdpa_fwd/d2l_torch/B1_N{n}"
        io_bytes = 4 * n * 64 * 4
        need = 4 * scores_bytes(1, n, n)
        if previous is not None and "extra_bytes" in previous:
            need = 4 * (previous["extra_bytes"] + io_bytes / 2)
        case(name, need, lambda: sdpa_forward(1, n, None, args.repeats))
        previous = results.get(name)

    info = {"torch": torch.__version__, "numpy": np.__version__, "threads": torch.get_num_threads(),
            "python": sys.version.split()[0]}
    with open(args.out, "w") as out:
        json.dump({"info": info, "results": results}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
