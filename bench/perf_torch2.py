#!/usr/bin/env python3
"""The performance suite's peer: torch 2's scaled_dot_product_attention on qkv's rows.

Times torch.nn.functional.scaled_dot_product_attention (the call a PyTorch 2
user makes; on the CPU it picks its own kernel: a fused flash kernel where it
has one, oneDNN/AMX for bf16 on Intel) on every row of docs/performance.md
that has a torch 2 counterpart, with the shapes, masks and types of
bench/bench_perf.cc's rows:

  - one head, B=2, N=4096, d=64 (given to torch as (B, 1, N, d)), float32 and
    bf16, no mask and random valid lengths (as a boolean key mask (B, 1, 1, N)),
    forward and forward + backward (float32), and the scaling sweep B=1,
    N=512..32768;
  - heads, B=2, H=8, N=4096, d=64: no mask, (B, N, H, d) memory viewed as
    heads, is_causal, a random boolean (N, N) mask, a causal window of 256 keys
    (a boolean mask), a float (N, N) bias; d=128; bf16 unmasked, causal and
    d=128; forward + backward unmasked, causal and d=128, float32 and bf16;
  - decoding, one query: B=8, Nk=131072, d=64, and grouped-query B=1, H=32,
    Hkv=8, Nk=65536, d=128 (enable_gqa=True), float32 and bf16.

Forward under torch.no_grad(); forward + backward as out = sdpa(q, k, v) and
torch.autograd.grad(out, (q, k, v), d_out) (the gradients qkv returns).
torch.set_num_threads(--threads), the thread count qkv runs at. Each case:
one warm-up call, then --repeats repetitions, each the mean of as many calls
as fill --min-time seconds (at least one), as Google Benchmark times qkv;
the median repetition is reported. Case names are bench_perf.cc's with the
implementation "torch2_sdpa" (float32 inputs) or "torch2_sdpa_bf16" (bf16
inputs; qkv's row is "bf16"). Writes JSON (--out).

bench/performance.py runs it in the project's venv (build/venv/bin/python,
torch==2.13.0 CPU), never in the same process as Debian's torch 1.13:

  build/venv/bin/python bench/perf_torch2.py --sdpa-lens 2748,3298 --out torch2.json
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def timed(fn, repeats, min_time):
    """Median over repetitions of the mean time of fn() (one warm-up call first)."""
    fn()
    means = []
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        means.append(elapsed / calls)
    return {"seconds": statistics.median(means), "runs": means}


def randn(shape, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


def attention_case(q_shape, kv_shape, dtype, backward, repeats, min_time, mask=None,
                   is_causal=False, enable_gqa=False, heads_from_bnhd=False):
    """Times SDPA on fresh N(0, 1) inputs of the given (B, ..., N, d) shapes.

    heads_from_bnhd: the inputs are (B, N, H, d) memory viewed as (B, H, N, d)
    (a transpose, no copy), as qkv reads them in the strided row.
    """
    def make(shape, seed):
        if heads_from_bnhd:
            b, h, n, d = shape
            return randn((b, n, h, d), seed, dtype).transpose(1, 2)
        return randn(shape, seed, dtype)

    q, k, v = make(q_shape, 1), make(kv_shape, 2), make(kv_shape, 3)
    if mask is not None and mask.is_floating_point():
        mask = mask.to(dtype)

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              enable_gqa=enable_gqa)

    if not backward:
        def run():
            with torch.no_grad():
                return attend(q, k, v)
        return timed(run, repeats, min_time)
    for t in (q, k, v):
        t.requires_grad_(True)
    d_out = randn(q_shape, 4, dtype)

    def run():
        out = attend(q, k, v)
        return torch.autograd.grad(out, (q, k, v), d_out)
    return timed(run, repeats, min_time)


def key_padding_mask(lens, n):
    """Valid lengths as SDPA's boolean mask: (B, 1, 1, N), True where the key takes part."""
    return (torch.arange(n)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]


def heads_mask(form, n):
    """The boolean keep-mask or float bias of bench_perf.cc's form (same kind, own draw)."""
    gen = torch.Generator().manual_seed(5)
    if form == "mask":
        keep = torch.rand(n, n, generator=gen) < 0.5
        keep[:, 0] = True
        return keep
    if form == "window256":
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        return (j <= i) & (j > i - 256)
    if form == "bias":
        return torch.randn(n, n, generator=gen)
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdpa-lens", required=True,
                        help="the 2 valid lengths of the one-head rows, comma-separated")
    parser.add_argument("--sweep", default="512,1024,2048,4096,8192,16384,32768",
                        help="N values of the SDPA scaling sweep (B = 1, d = 64)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions per case (median)")
    parser.add_argument("--min-time", type=float, default=0.5,
                        help="seconds of calls per repetition")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--only", default="", help="run only cases whose name contains this")
    parser.add_argument("--out", required=True, help="JSON output file")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    sdpa_lens = [int(s) for s in args.sdpa_lens.split(",")]
    results = {}
    types = {"torch2_sdpa": torch.float32, "torch2_sdpa_bf16": torch.bfloat16}

    def case(op, impl, shape, **kwargs):
        name = f"{op}/{impl}/{shape}"
        if args.only and args.only not in name:
            return
        try:
            result = attention_case(dtype=types[impl], backward=op.endswith("fwdbwd"),
                                    repeats=args.repeats, min_time=args.min_time, **kwargs)
        except RuntimeError as e:  # out of memory, or a combination torch refuses
            result = {"error": str(e).splitlines()[0][:200]}
            print(f"{name}: error: {result['error']}", file=sys.stderr, flush=True)
        else:
            print(f"{name}: {result['seconds']:.4g} s (repetitions "
                  f"{', '.join(f'{s:.4g}' for s in result['runs'])})", file=sys.stderr, flush=True)
        results[name] = result

    # One head (issue 5's rows): B=2, N=4096, d=64. qkv's (B, N, d) is given to torch as
    # (B, 1, N, d): torch 2's fused CPU kernels take 4-d inputs only, and a 3-d call
    # would fall back to the math path, whose (N, N) scores are 4 GiB at N = 32768.
    one_head = (2, 1, 4096, 64)
    for shape, mask in (("B2_N4096_nomask", None),
                        ("B2_N4096_lens", key_padding_mask(sdpa_lens, 4096))):
        case("sdpa_fwd", "torch2_sdpa", shape, q_shape=one_head, kv_shape=one_head, mask=mask)
        case("sdpa_fwd", "torch2_sdpa_bf16", shape, q_shape=one_head, kv_shape=one_head,
             mask=mask)
        case("sdpa_fwdbwd", "torch2_sdpa", shape, q_shape=one_head, kv_shape=one_head, mask=mask)
    # Decoding, one head: B=8, one query against 131072 keys, d=64.
    for impl in types:
        case("sdpa_decode", impl, "B8_Nk131072", q_shape=(8, 1, 1, 64),
             kv_shape=(8, 1, 131072, 64))
    # Heads: B=2, H=8, N=4096.
    heads, heads_128 = (2, 8, 4096, 64), (2, 8, 4096, 128)
    base = "B2_H8_N4096"
    case("mha_fwd", "torch2_sdpa", base, q_shape=heads, kv_shape=heads)
    case("mha_fwd", "torch2_sdpa", base + "_bnhd", q_shape=heads, kv_shape=heads,
         heads_from_bnhd=True)
    case("mha_fwd", "torch2_sdpa", base + "_causal", q_shape=heads, kv_shape=heads,
         is_causal=True)
    for form in ("mask", "window256", "bias"):
        case("mha_fwd", "torch2_sdpa", f"{base}_{form}", q_shape=heads, kv_shape=heads,
             mask=heads_mask(form, 4096))
    case("mha_fwd", "torch2_sdpa", base + "_d128", q_shape=heads_128, kv_shape=heads_128)
    case("mha_fwd", "torch2_sdpa_bf16", base, q_shape=heads, kv_shape=heads)
    case("mha_fwd", "torch2_sdpa_bf16", base + "_causal", q_shape=heads, kv_shape=heads,
         is_causal=True)
    case("mha_fwd", "torch2_sdpa_bf16", base + "_d128", q_shape=heads_128, kv_shape=heads_128)
    for impl in types:
        case("mha_fwdbwd", impl, base, q_shape=heads, kv_shape=heads)
        case("mha_fwdbwd", impl, base + "_d128", q_shape=heads_128, kv_shape=heads_128)
    case("mha_fwdbwd", "torch2_sdpa", base + "_causal", q_shape=heads, kv_shape=heads,
         is_causal=True)
    # Grouped-query decoding: B=1, H=32 query heads sharing Hkv=8 key/value heads.
    for impl in types:
        case("gqa_decode", impl, "B1_H32_Hkv8_Nk65536", q_shape=(1, 32, 1, 128),
             kv_shape=(1, 8, 65536, 128), enable_gqa=True)
    # The scaling sweep: B=1, d=64, no mask.
    for n in (int(s) for s in args.sweep.split(",")):
        case("sdpa_fwd", "torch2_sdpa", f"B1_N{n}", q_shape=(1, 1, n, 64),
             kv_shape=(1, 1, n, 64))

    info = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkldnn": torch.backends.mkldnn.is_available(),
            "python": sys.version.split()[0]}
    with open(args.out, "w") as out:
        json.dump({"info": info, "results": results}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
