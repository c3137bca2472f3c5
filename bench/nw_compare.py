#!/usr/bin/python3
"""Benchmark: Nadaraya-Watson regression, `qkv regress` vs d2l's PyTorch code vs statsmodels.

1-D data like the chapter's (d2l 11.2): n sorted x ~ U(0, 5),
y = 2 sin x + x^0.8 + N(0, 0.5), and t = n queries evenly spread over [0, 5],
for n = t = 10^3 ... 10^6 and bandwidths h = 0.1 and 1 (the Gaussian kernel).
Contenders, all on the same data:

  qkv fast    `qkv regress --kernel gaussian --bandwidth h` (the 1-D fast path)
  qkv exact   the same with --exact (all t * n kernel terms)
  torch f32   d2l's formulation in PyTorch, float32, torch.set_num_threads(2):
              X_repeat = x_test.repeat_interleave(n).reshape(-1, n);
              w = softmax(-(X_repeat - x_train)^2 / (2 h^2), dim=1); y_hat = w @ y_train
  torch f64   the same in float64
  statsmodels KernelReg(y, x, 'c', reg_type='lc', bw=[h]).fit(queries)

For qkv the time is the predict time the command reports in --json
(timings_s), with the wall time of the whole command (reading and writing the
CSV files, start-up) beside it; for torch and statsmodels, the time of the
computation on in-memory arrays. Each figure is the median of --repeats runs,
or one run when the first takes longer than 10 s. d2l's code holds about three
(t, n) tensors at once: sizes whose n * t * itemsize * 3 bytes exceed
--torch-mem-gib are not run and the table says how much they would need.
statsmodels is quadratic in pure NumPy: sizes above --statsmodels-max are not
run, and the table gives its time extrapolated from the largest size run
(times (n / n_run)^2). `qkv --exact` above --exact-max likewise.

Accuracy columns: max |fast - exact| / max |exact| for qkv (the fast path's
error, measured on all t predictions), and the same for torch float32 against
qkv's exact float64 predictions.

Prints a Markdown table (the one in docs/regression.md) and the command line.
Run it under Debian's /usr/bin/python3 (python3-torch, python3-statsmodels).
"""

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import torch
from statsmodels.nonparametric.kernel_regression import KernelReg

SLOW_SECONDS = 10.0


def chapter_data(n, seed):
    rng = np.random.default_rng(seed)
    x = np.sort(rng.uniform(0.0, 5.0, size=n))
    y = 2.0 * np.sin(x) + x ** 0.8 + rng.normal(0.0, 0.5, size=n)
    return x, y


def write_csv(path, names, columns):
    np.savetxt(path, np.column_stack(columns), fmt="%.17g", delimiter=",",
               header=",".join(names), comments="")


def timed(fn, repeats):
    """Median over `repeats` runs of fn() -> (seconds, result, extra); one run if slow."""
    runs = []
    result = None
    for i in range(repeats):
        seconds, result = fn()
        runs.append(seconds)
        if i == 0 and seconds[0] > SLOW_SECONDS:
            break
    medians = tuple(statistics.median(r[k] for r in runs) for k in range(len(runs[0])))
    return medians, len(runs), result


def run_qkv(qkv, train, query, out, h, exact, threads):
    args = [qkv, "regress", "--train", train, "--x-cols", "x", "--y-col", "y", "--query", query,
            "--kernel", "gaussian", "--bandwidth", repr(h), "--out", out, "--json"]
    if exact:
        args.append("--exact")
    if threads:
        args += ["--threads", str(threads)]
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"nw_compare: qkv failed ({proc.returncode}): {' '.join(args)}\n{proc.stderr}")
    summary = json.loads(proc.stdout)
    timings = summary["timings_s"]
    predict = float(timings["predict"])
    if exact and summary["fast_path"]:
        sys.exit("nw_compare: --exact run reports fast_path: true")
    preds = np.loadtxt(out, delimiter=",", skiprows=1, usecols=1)
    return (predict, wall), (preds, summary)


def d2l_torch(x_train, y_train, x_test, h, dtype):
    """d2l 11.2's nonparametric attention pooling, with the bandwidth h."""
    xt = torch.from_numpy(x_train).to(dtype)
    yt = torch.from_numpy(y_train).to(dtype)
    qt = torch.from_numpy(x_test).to(dtype)
    start = time.perf_counter()
    with torch.no_grad():
        n_train = xt.shape[0]
        X_repeat = qt.repeat_interleave(n_train).reshape((-1, n_train))
        attention_weights = torch.nn.functional.softmax(-(X_repeat - xt) ** 2 / (2 * h * h), dim=1)
        y_hat = torch.matmul(attention_weights, yt)
    seconds = time.perf_counter() - start
    return (seconds,), y_hat.double().numpy()


def statsmodels_fit(x_train, y_train, x_test, h):
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        model = KernelReg(y_train, x_train, var_type="c", reg_type="lc", bw=[h])
        mean = model.fit(x_test)[0]
        return (time.perf_counter() - start,), mean


def rel_err(got, ref):
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def fmt_s(seconds):
    if seconds >= 100:
        return f"{seconds:.0f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def fmt_n(n):
    exponent = round(math.log10(n))
    if 10 ** exponent == n:
        return f"10^{exponent}"
    return f"{n:,}"


def fmt_ratio(a, b):
    if a is None or b is None or b <= 0:
        return "–"
    return f"{a / b:.3g}×"


def machine():
    model, cores = platform.processor() or "unknown CPU", os.cpu_count()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{model}, {cores} cores"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qkv", required=True, help="path of the qkv command (Release build)")
    parser.add_argument("--sizes", default="1000,10000,100000,1000000",
                        help="n = t values (default 1000,10000,100000,1000000)")
    parser.add_argument("--bandwidths", default="0.1,1", help="h values (default 0.1,1)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--threads", type=int, default=2, help="qkv --threads and torch threads")
    parser.add_argument("--torch-mem-gib", type=float, default=4.0,
                        help="run torch only where n * t * itemsize * 3 fits in this (GiB)")
    parser.add_argument("--statsmodels-max", type=int, default=10000,
                        help="largest n for statsmodels (default 1e4)")
    parser.add_argument("--exact-max", type=int, default=100000,
                        help="largest n for qkv --exact (default 1e5; 1e6 would take ~40 min)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    sizes = [int(float(s)) for s in args.sizes.split(",")]
    bandwidths = [float(h) for h in args.bandwidths.split(",")]
    torch.set_num_threads(args.threads)
    command = "/usr/bin/python3 bench/nw_compare.py " + " ".join(
        a if a != args.qkv else os.path.relpath(a, os.getcwd()) for a in sys.argv[1:])
    load_start = os.getloadavg()[0]
    rows = []
    sm_anchor = {}     # h -> (n, seconds) of the largest statsmodels run
    exact_anchor = {}  # h -> (n, seconds)
    with tempfile.TemporaryDirectory(prefix="qkv_nw_bench_") as work:
        for n in sizes:
            x, y = chapter_data(n, [args.seed, n])
            queries = np.linspace(0.0, 5.0, n)
            train, query = os.path.join(work, "train.csv"), os.path.join(work, "query.csv")
            write_csv(train, ["x", "y"], [x, y])
            write_csv(query, ["x"], [queries])
            out = os.path.join(work, "pred.csv")
            for h in bandwidths:
                row = {"n": n, "h": h}
                print(f"n = t = {n}, h = {h}", file=sys.stderr, flush=True)
                (fast_t, fast_wall), runs, (fast_pred, summary) = timed(
                    lambda: run_qkv(args.qkv, train, query, out, h, False, args.threads),
                    args.repeats)
                row.update(fast=fast_t, fast_wall=fast_wall, fast_path=summary["fast_path"],
                           fast_runs=runs)
                print(f"  qkv fast: {fast_t:.4g} s (wall {fast_wall:.4g} s, "
                      f"fast_path {summary['fast_path']}, timings {summary['timings_s']})",
                      file=sys.stderr, flush=True)
                exact_pred = None
                if n <= args.exact_max:
                    (ex_t, ex_wall), runs, (exact_pred, _) = timed(
                        lambda: run_qkv(args.qkv, train, query, out, h, True, args.threads),
                        args.repeats)
                    row.update(exact=ex_t, exact_wall=ex_wall, exact_runs=runs)
                    row["fast_err"] = rel_err(fast_pred, exact_pred)
                    exact_anchor[h] = (n, ex_t)
                    print(f"  qkv exact: {ex_t:.4g} s (wall {ex_wall:.4g} s); fast vs exact "
                          f"{row['fast_err']:.3g}", file=sys.stderr, flush=True)
                elif h in exact_anchor:
                    n0, t0 = exact_anchor[h]
                    row["exact_est"] = t0 * (n / n0) ** 2
                for name, dtype in (("torch32", torch.float32), ("torch64", torch.float64)):
                    need = n * n * (4 if dtype == torch.float32 else 8) * 3 / 2 ** 30
                    if need > args.torch_mem_gib:
                        row[name + "_need"] = need
                        continue
                    (secs,), runs, pred = timed(
                        lambda: d2l_torch(x, y, queries, h, dtype), args.repeats)
                    row[name] = secs
                    if exact_pred is not None:
                        row[name + "_err"] = rel_err(pred, exact_pred)
                    print(f"  {name}: {secs:.4g} s, vs qkv exact "
                          f"{row.get(name + '_err', float('nan')):.3g}",
                          file=sys.stderr, flush=True)
                if n <= args.statsmodels_max:
                    (secs,), runs, pred = timed(
                        lambda: statsmodels_fit(x, y, queries, h), args.repeats)
                    row["sm"] = secs
                    sm_anchor[h] = (n, secs)
                    if exact_pred is not None:
                        row["sm_err"] = rel_err(pred, exact_pred)
                    print(f"  statsmodels: {secs:.4g} s, vs qkv exact "
                          f"{row.get('sm_err', float('nan')):.3g}", file=sys.stderr, flush=True)
                elif h in sm_anchor:
                    n0, t0 = sm_anchor[h]
                    row["sm_est"] = t0 * (n / n0) ** 2
                rows.append(row)

    print(f"Machine: {machine()}; qkv --threads {args.threads}, torch.set_num_threads("
          f"{args.threads}), torch {torch.__version__}, NumPy {np.__version__}. "
          f"1-minute load average {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} "
          f"at the end (above 1: other work shared the cores).\n")
    print(f"Command: `{command}`\n")
    print("| n = t | h | qkv fast (wall) | qkv --exact (wall) | torch f32 | torch f64 | "
          "statsmodels | torch f32 / qkv fast | torch f64 / qkv exact | "
          "statsmodels / qkv fast | fast vs exact | torch f32 vs exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def torch_cell(name):
            if name in r:
                return fmt_s(r[name])
            return f"out of memory (needs {r[name + '_need']:.0f} GiB)"
        fast = f"{fmt_s(r['fast'])} ({fmt_s(r['fast_wall'])})"
        if not r["fast_path"]:
            fast += " [exact path chosen]"
        if "exact" in r:
            exact = f"{fmt_s(r['exact'])} ({fmt_s(r['exact_wall'])})"
        elif "exact_est" in r:
            exact = f"not run (est. {fmt_s(r['exact_est'])})"
        else:
            exact = "not run"
        if "sm" in r:
            sm = fmt_s(r["sm"])
        elif "sm_est" in r:
            sm = f"not run (est. {fmt_s(r['sm_est'])})"
        else:
            sm = "not run"
        fast_err = f"{r['fast_err']:.1e}" if "fast_err" in r else "–"
        t32_err = f"{r['torch32_err']:.1e}" if "torch32_err" in r else "–"
        print(f"| {fmt_n(r['n'])} | {r['h']:g} | {fast} | {exact} | {torch_cell('torch32')} | "
              f"{torch_cell('torch64')} | {sm} | {fmt_ratio(r.get('torch32'), r['fast'])} | "
              f"{fmt_ratio(r.get('torch64'), r.get('exact'))} | "
              f"{fmt_ratio(r.get('sm'), r['fast'])} | {fast_err} | {t32_err} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
