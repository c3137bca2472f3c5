#!/usr/bin/python3
"""docs/scale.md's alternative: what a user of the book's PyTorch code does
today with a key-value database of N = 10^7 rows. The keys and values are
loaded into PyTorch (the resident float32 store's chunk files, which are .npy
files: np.load each, torch.cat), then d2l 11.3's DotProductAttention runs on
all of them at once (its (Q, N) scores fit in this machine's memory at
Q <= 64; chunks of keys would need the log-sum-exp merge the book does not
have). float32, torch.set_num_threads(threads), eval mode, no_grad.

Prints one JSON object per case: the load time, the attention's median time
over --repeats runs after a warm-up, and the memory beyond the loaded keys and
values that the attention needed (bench/perf_torch.py's measure: VmHWM after
a reset) and the process's peak RSS. bench/scale.py runs it under Debian's
/usr/bin/python3 (python3-torch).
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from perf_torch import DotProductAttention, measure, status_bytes  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="the resident float32 store's directory")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with open(os.path.join(args.store, "manifest.json")) as f:
        manifest = json.load(f)
    start = time.perf_counter()
    keys = torch.cat([torch.from_numpy(np.load(os.path.join(args.store, c["keys"])))
                      for c in manifest["chunks"]])
    values = torch.cat([torch.from_numpy(np.load(os.path.join(args.store, c["values"])))
                        for c in manifest["chunks"]])
    load_seconds = time.perf_counter() - start
    keys, values = keys.unsqueeze(0), values.unsqueeze(0)  # a batch of one, as d2l's shapes
    attention = DotProductAttention(dropout=0.0).eval()
    generator = torch.Generator().manual_seed(5)
    for nq in (64, 1):
        queries = torch.rand((1, nq, keys.shape[2]), generator=generator) * 3.46 - 1.73
        with torch.no_grad():
            result = measure(lambda: (attention(queries, keys, values),), args.repeats)
        print(json.dumps({"kind": "torch", "rows": keys.shape[1], "queries": nq,
                          "load_seconds": load_seconds, "seconds": result["seconds"],
                          "runs": result["runs"], "extra_bytes": result["extra_bytes"],
                          "loaded_bytes": (keys.numel() + values.numel()) * 4,
                          "peak_rss_bytes": status_bytes("VmHWM"), "threads": args.threads}),
              flush=True)


if __name__ == "__main__":
    main()
