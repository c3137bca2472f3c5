#!/usr/bin/python3
"""The cost of `qkv attend --store --top-k` (docs/scale.md, "top_k"): a store
of 1,048,576 rows (D = Dv = 64, float32) in a temporary directory, then
attention over it with and without --top-k K for a few query counts and K,
each the median of --repeats runs. CPU time (user + system of the qkv
process) is the figure: wall time on a shared machine measures the others.

Usage: bench/topk.py --qkv build/release/qkv [--rows N] [--repeats 3]
"""

import argparse
import os
import resource
import statistics
import subprocess
import tempfile
import time

import numpy as np


def timed(command):
    """(wall seconds, CPU seconds) of one run of `command`, which must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    subprocess.run(command, check=True)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qkv", required=True)
    parser.add_argument("--rows", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="qkv-topk-") as tmp:
        path = lambda name: os.path.join(tmp, name)  # noqa: E731
        np.save(path("K.npy"), rng.standard_normal((args.rows, 64), dtype=np.float32))
        np.save(path("V.npy"), rng.standard_normal((args.rows, 64), dtype=np.float32))
        subprocess.run([args.qkv, "store", "create", path("S.qkv"), "--keys", path("K.npy"),
                        "--values", path("V.npy"), "--quiet"],
                       check=True, stdout=subprocess.DEVNULL)
        print(f"qkv attend --store over {args.rows} rows, D = Dv = 64, float32; "
              f"medians of {args.repeats} runs")
        print(f"{'queries':>8} {'top-k':>6} {'CPU s':>8} {'wall s':>8} {'x plain CPU':>12}")
        for nq in (1, 64, 256):
            np.save(path("Q.npy"), rng.standard_normal((nq, 64), dtype=np.float32))
            plain = None
            for k in (0, 1, 10, 100):
                command = [args.qkv, "attend", "--store", path("S.qkv"), "--queries", path("Q.npy"),
                           "--out", path("O.npy"), "--quiet"]
                if k:
                    command += ["--top-k", str(k), "--top-ids", path("I.npy")]
                runs = [timed(command) for _ in range(args.repeats)]
                cpu = statistics.median(r[1] for r in runs)
                wall = statistics.median(r[0] for r in runs)
                plain = plain or cpu
                print(f"{nq:>8} {k if k else '-':>6} {cpu:>8.2f} {wall:>8.2f} {cpu / plain:>12.1f}")


if __name__ == "__main__":
    main()
