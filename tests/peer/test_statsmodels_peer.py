#!/usr/bin/python3
"""Peer test: `qkv regress` against statsmodels' KernelReg (Nadaraya-Watson).

statsmodels' KernelReg(reg_type='lc', var_type='c' * p) with its default
'gaussian' kernel for continuous variables is the local-constant estimator
f(q) = sum_i K_h(q - x_i) y_i / sum_j K_h(q - x_j), with the product kernel
K_h(u) = prod_c exp(-(u_c / h_c)^2 / 2) (its constant factors cancel) and one
bandwidth per feature: what `qkv regress --kernel gaussian` computes
(DESIGN.md section 3). Two parts, one CTest test each:

--part fixed: fresh random cases with a given bandwidth: the chapter's set-up
  (n = 50 sorted x ~ U(0, 5), y = 2 sin x + x^0.8 + N(0, 0.5), d2l 11.2),
  statsmodels' bundled `engel` data (income -> foodexp, n = 235), random 1-D
  data (some with duplicate keys), random 2-D and 3-D data with features of
  very different scales and one bandwidth per feature, and chapter-like data
  with n = 3000..8000 and 500..900 queries, large enough (n t > 1e6) for the
  1-D fast path. Bandwidths run from tiny (most queries see one or two keys)
  to huge (every weight equal); queries lie inside and outside the data. Pass if every prediction equals
  KernelReg(...).fit(queries)[0] within 1e-10 relative, per query, to the
  size of the terms it sums, sum_i w_i |y_i| (>= |f(q)|; rounding scales with
  it). Where the 1-D fast path served the call (--json "fast_path": true) the
  bound is the one kernel_regression.h documents for it, 1e-7. Each bound
  gets an allowance of 8 eps (|s| + 40) for a query whose largest score is s
  (score = -sum_c u_c^2 / 2): rounding a score of size |s|, however it is
  written, moves the weights by ~eps |s|. It is below 2e-12 wherever
  statsmodels is compared (|s| < 645) and matters only for far queries.
  Where qkv and statsmodels differ by design the comparison avoids it and a
  check pins down qkv's side: statsmodels evaluates exp(-u^2/2) directly, so a
  query far from every key (max_i K < 1e-280) underflows to 0/0 = NaN or loses
  digits to subnormals; qkv evaluates the softmax and gives the nearest keys'
  value. Those queries are compared against a float64 log-sum-exp reference
  written out below (itself checked against statsmodels on every other query).
  Also checked: the output CSV's header (query columns, then `<y>_pred`), its
  query columns echoing the queries, and --json's kernel, bandwidth,
  num_train, num_queries, num_undefined.

--part cv: bandwidth selection. `--bandwidth cv` on engel and on synthetic
  1-D and 2-D data: the LOO error qkv reports must equal the LOO error
  recomputed here in numpy at the bandwidth qkv reports (1e-9 relative), and
  must be no worse than the LOO error at statsmodels' KernelReg(bw='cv_ls').bw
  (same numpy formula; statsmodels' own cv_loo at its bandwidth is checked
  against it), with 1e-9 relative slack. loo_error = mean_i (f_{-i}(x_i) -
  y_i)^2: the sum of squares divided by n, which is what statsmodels' cv_loo
  (its cv_ls objective) returns. Every case prints both bandwidths and errors. Then `--bandwidth silverman` and `scott`: the
  bandwidths in --json must match the formulas of kernel_regression.h
  computed here (sample sd with ddof = 1, IQR from numpy's default
  percentile), 1e-12 relative, and the predictions at them statsmodels'.

The seed is printed first and in every failure; `--seed S` replays a run and
`--case N` one case of it. Must run under Debian's /usr/bin/python3
(python3-statsmodels, python3-pandas, python3-numpy). If statsmodels, pandas
or numpy cannot be imported or the qkv binary cannot run, the test fails: it
never skips. Nothing is cached: statsmodels runs every time.
"""

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings


def die(message):
    print(f"peer: error: {message}", file=sys.stderr)
    sys.exit(1)


try:
    import numpy as np
except ImportError as exc:
    die(f"cannot import numpy ({exc}); this test needs Debian's python3-numpy "
        f"and must run under /usr/bin/python3 (running: {sys.executable})")
try:
    import pandas  # noqa: F401  (statsmodels' datasets load through pandas)
    from statsmodels.datasets import engel
    from statsmodels.nonparametric.kernel_regression import KernelReg
except ImportError as exc:
    die(f"cannot import statsmodels ({exc}); this test needs Debian's python3-statsmodels "
        f"and python3-pandas and must run under /usr/bin/python3 (running: {sys.executable})")

EXACT_TOLERANCE = 1e-10   # qkv's exact path vs statsmodels
FAST_TOLERANCE = 1e-7     # the 1-D Gaussian fast path's documented bound (kernel_regression.h)
CV_SLACK = 1e-9           # LOO error: qkv's report vs numpy, qkv's vs statsmodels'
RULE_TOLERANCE = 1e-12    # silverman / scott bandwidths
FAR_LOG_KERNEL = math.log(1e-280)  # below this max_i K, statsmodels underflows
TINY = 1e-300
SCORE_ROUNDING = 8 * 2.0 ** -52  # per unit of |score|: see Runner.compare


# ---- float64 references (numpy) ----------------------------------------------

def log_kernel(queries, x, h):
    """-sum_c ((q_c - x_ic) / h_c)^2 / 2 for every query and key: (t, n)."""
    u = (queries[:, None, :] - x[None, :, :]) / np.asarray(h, dtype=np.float64)
    return -0.5 * np.sum(u * u, axis=-1)


def nw_reference(x, y, queries, h):
    """The Gaussian estimator in softmax form (never 0/0): predictions, the
    per-query scale sum_i w_i |y_i|, and max_i log K (for the underflow test)."""
    preds, scales, peaks = [], [], []
    for start in range(0, len(queries), 512):
        logk = log_kernel(queries[start:start + 512], x, h)
        peak = logk.max(axis=1)
        w = np.exp(logk - peak[:, None])
        total = w.sum(axis=1)
        preds.append((w @ y) / total)
        scales.append((w @ np.abs(y)) / total)
        peaks.append(peak)
    return np.concatenate(preds), np.concatenate(scales), np.concatenate(peaks)


def loo_error(x, y, h):
    """mean_i (f_{-i}(x_i) - y_i)^2 with f_{-i} the estimator without point i,
    in softmax form. statsmodels' cv_loo returns the same mean."""
    logk = log_kernel(x, x, h)
    np.fill_diagonal(logk, -np.inf)
    peak = logk.max(axis=1)
    w = np.exp(logk - peak[:, None])
    loo = (w @ y) / w.sum(axis=1)
    return float(np.mean((loo - y) ** 2))


def loo_underflows(x, h):
    """True if some point's leave-one-out kernel values all fall below 1e-280
    (an outlier far from every other point): statsmodels evaluates exp(-u^2/2)
    directly and its cv_loo then differs from the softmax form there."""
    logk = log_kernel(x, x, h)
    np.fill_diagonal(logk, -np.inf)
    return bool(np.any(logk.max(axis=1) < FAR_LOG_KERNEL))


def statsmodels_fit(x, y, queries, h):
    """KernelReg(reg_type='lc', var_type='c' * p, bw=h).fit(queries)[0]."""
    p = x.shape[1]
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        model = KernelReg(y, x, var_type="c" * p, reg_type="lc", bw=list(h))
        return np.asarray(model.fit(queries)[0], dtype=np.float64)


def statsmodels_cv(x, y):
    """statsmodels' cv_ls bandwidth (Nelder-Mead on h; the objective is even in
    each h_c, so the sign is dropped) and its own cv_loo value there."""
    p = x.shape[1]
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        model = KernelReg(y, x, var_type="c" * p, reg_type="lc", bw="cv_ls")
        bw = np.abs(np.asarray(model.bw, dtype=np.float64))
        own = float(model.cv_loo(bw, model.est["lc"]))
    return bw, own


def silverman(x):
    n = x.shape[0]
    s = np.std(x, axis=0, ddof=1)
    iqr = np.percentile(x, 75, axis=0) - np.percentile(x, 25, axis=0)
    return 0.9 * np.minimum(s, iqr / 1.349) * n ** (-1.0 / 5.0)


def scott(x):
    n, p = x.shape
    return 1.059 * np.std(x, axis=0, ddof=1) * n ** (-1.0 / (p + 4.0))


# ---- data ---------------------------------------------------------------------

def chapter_data(rng, n=50):
    """d2l 11.2: n sorted x ~ U(0, 5), y = 2 sin x + x^0.8 + N(0, 0.5)."""
    x = np.sort(rng.uniform(0.0, 5.0, size=n))
    y = 2.0 * np.sin(x) + x ** 0.8 + rng.normal(0.0, 0.5, size=n)
    return x[:, None], y


def engel_data():
    frame = engel.load_pandas().data
    return (frame["income"].to_numpy(dtype=np.float64)[:, None],
            frame["foodexp"].to_numpy(dtype=np.float64))


def multi_data(rng, n, p):
    """p features of very different scales (so one bandwidth per feature
    matters) and a smooth target plus noise."""
    centres = np.array([0.0, 10.0, -50.0])[:p]
    spreads = np.array([2.0, 0.05, 40.0])[:p]
    x = centres + spreads * rng.uniform(-1.0, 1.0, size=(n, p))
    z = (x - centres) / spreads
    y = np.sin(2.0 * z[:, 0]) + 0.5 * z[:, 1] ** 2
    if p > 2:
        y = y + np.cos(3.0 * z[:, 2])
    return x, y + rng.normal(0.0, 0.2, size=n)


# ---- the harness ----------------------------------------------------------------

class Failure(Exception):
    """A disagreement or a failed qkv run; the message says what and where."""


def fmt(values):
    return ",".join(repr(float(v)) for v in np.atleast_1d(values))


class Runner:
    def __init__(self, qkv, seed, workdir):
        self.qkv = qkv
        self.seed = seed
        self.workdir = workdir
        self.files = 0
        self.desc = ""
        self.worst_statsmodels = 0.0   # qkv exact path vs statsmodels
        self.worst_fast = 0.0          # qkv fast path vs statsmodels
        self.worst_far = 0.0           # qkv vs the softmax reference where statsmodels underflows
        self.predictions = 0
        self.far_queries = 0
        self.fast_cases = 0

    def path(self, stem, ext):
        self.files += 1
        return os.path.join(self.workdir, f"{stem}_{self.files}.{ext}")

    def write_csv(self, stem, names, columns):
        path = self.path(stem, "csv")
        with open(path, "w", newline="") as f:
            f.write(",".join(names) + "\n")
            for row in zip(*columns):
                f.write(",".join(repr(float(v)) for v in row) + "\n")
        return path

    def run(self, args):
        cmd = [self.qkv] + [str(a) for a in args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            raise Failure(f"qkv timed out after 120 s: {' '.join(cmd)}")
        if proc.returncode != 0:
            raise Failure(f"qkv exited with status {proc.returncode}: {' '.join(cmd)}\n"
                          f"    stderr: {proc.stderr.strip()}")
        return proc

    def regress(self, x, y, x_names, y_name, bandwidth, queries=None, grid=None, exact=False):
        """Runs `qkv regress --kernel gaussian --json` and returns (query
        columns (t, p), predictions (t), the --json summary)."""
        train = self.write_csv("train", list(x_names) + [y_name],
                               [x[:, c] for c in range(x.shape[1])] + [y])
        out = self.path("pred", "csv")
        args = ["regress", "--train", train, "--x-cols", ",".join(x_names), "--y-col", y_name,
                "--kernel", "gaussian", "--bandwidth", bandwidth, "--out", out, "--json"]
        if grid is not None:
            args += ["--grid", grid]
        else:
            args += ["--query", self.write_csv("query", x_names,
                                               [queries[:, c] for c in range(queries.shape[1])])]
        if exact:
            args.append("--exact")
        proc = self.run(args)
        try:
            summary = json.loads(proc.stdout)
        except ValueError as exc:
            raise Failure(f"--json printed no JSON object ({exc}): {proc.stdout[:300]!r}")
        for key in ("kernel", "bandwidth", "loo_error", "num_train", "num_queries",
                    "num_undefined", "fast_path", "timings_s"):
            if key not in summary:
                raise Failure(f"--json has no {key!r}: {proc.stdout.strip()[:300]}")
        if not os.path.exists(out):
            raise Failure(f"qkv wrote no file {out}")
        with open(out, newline="") as f:
            rows = list(csv.reader(f))
        header = list(x_names) + [f"{y_name}_pred"]
        if not rows or rows[0] != header:
            raise Failure(f"output header {rows[0] if rows else None}, expected {header}")
        body = rows[1:]
        if any(len(r) != len(header) for r in body):
            raise Failure(f"output has a row without {len(header)} cells")
        table = np.array([[float(v) for v in r] for r in body], dtype=np.float64).reshape(
            -1, len(header))
        got_queries, preds = table[:, :-1], table[:, -1]
        if queries is not None:
            if got_queries.shape != queries.shape:
                raise Failure(f"output has {got_queries.shape[0]} rows, expected "
                              f"{queries.shape[0]} (one per query)")
            bad = np.abs(got_queries - queries) > 1e-15 * np.maximum(np.abs(queries), 1.0)
            if np.any(bad):
                i = int(np.argwhere(bad)[0][0])
                raise Failure(f"output query columns do not echo the queries: row {i} "
                              f"{got_queries[i]} vs {queries[i]}")
        n = x.shape[0]
        if summary["kernel"] != "gaussian":
            raise Failure(f"--json kernel {summary['kernel']!r}, expected 'gaussian'")
        if summary["num_train"] != n or summary["num_queries"] != len(preds):
            raise Failure(f"--json num_train {summary['num_train']} num_queries "
                          f"{summary['num_queries']}, expected {n} and {len(preds)}")
        if summary["num_undefined"] != 0:
            raise Failure(f"--json num_undefined {summary['num_undefined']} for the Gaussian "
                          f"kernel (DESIGN 3: the softmax form is never undefined)")
        bw = np.asarray(summary["bandwidth"], dtype=np.float64).reshape(-1)
        if bw.shape != (x.shape[1],) or not np.all(np.isfinite(bw) & (bw > 0)):
            raise Failure(f"--json bandwidth {summary['bandwidth']}: expected {x.shape[1]} "
                          f"positive finite values")
        if exact and summary["fast_path"]:
            raise Failure("--exact was given but --json reports fast_path: true")
        return got_queries, preds, summary

    def compare(self, x, y, queries, h, preds, fast):
        """Checks predictions against statsmodels (and the softmax reference where
        statsmodels underflows); returns a note for verbose output."""
        ref, scale, peak = nw_reference(x, y, queries, h)
        sm = statsmodels_fit(x, y, queries, h)
        far = peak < FAR_LOG_KERNEL
        denom = np.maximum(scale, TINY)
        # The reference itself must agree with statsmodels wherever statsmodels is sound.
        ref_err = np.abs(ref - sm)[~far] / denom[~far]
        if ref_err.size and not ref_err.max() <= EXACT_TOLERANCE:
            i = int(np.flatnonzero(~far)[int(np.nanargmax(np.where(np.isnan(ref_err), np.inf,
                                                                     ref_err)))])
            raise Failure(f"test reference vs statsmodels: rel err {ref_err.max():.3g} at query "
                          f"{i} {queries[i]}: reference {ref[i]!r}, statsmodels {sm[i]!r}")
        tol = FAST_TOLERANCE if fast else EXACT_TOLERANCE
        # Errors are measured in units of the tolerance: a far query's scores
        # are huge (h tiny: -u^2/2 ~ -1e6), and rounding them, however they are
        # written, perturbs its weights by ~eps |score| (DESIGN 3 fixes the
        # form, not the rounding); that allowance is added to the tolerance.
        # Near queries have |score| < 650 there, an allowance below 2e-12.
        allowance = SCORE_ROUNDING * (np.abs(peak) + 40.0)
        err = np.abs(preds - sm) / denom / (tol + allowance)
        err = np.where(np.isnan(err), np.inf, err)
        near_err = float(err[~far].max()) if np.any(~far) else 0.0
        far_err = np.abs(preds - ref)[far] / denom[far] / (tol + allowance[far])
        far_err = float(np.where(np.isnan(far_err), np.inf, far_err).max()) if np.any(far) else 0.0
        # Back to relative errors for the record (the tolerance check is below).
        raw = np.where(np.isnan(np.abs(preds - sm)), np.inf, np.abs(preds - sm)) / denom
        raw_far = np.abs(preds - ref)[far] / denom[far]
        near_raw = float(raw[~far].max()) if np.any(~far) else 0.0
        far_raw = float(np.where(np.isnan(raw_far), np.inf, raw_far).max()) if np.any(far) else 0.0
        self.predictions += len(preds)
        self.far_queries += int(far.sum())
        if fast:
            self.fast_cases += 1
            self.worst_fast = max(self.worst_fast, near_raw)
        else:
            self.worst_statsmodels = max(self.worst_statsmodels, near_raw)
        self.worst_far = max(self.worst_far, far_raw)
        if near_err > 1.0:
            i = int(np.flatnonzero(~far)[int(np.argmax(err[~far]))])
            raise Failure(f"predictions vs statsmodels: rel err {raw[i]:.3g} > "
                          f"{tol + allowance[i]:.3g} at query {i} {queries[i]}: qkv {preds[i]!r}, "
                          f"statsmodels {sm[i]!r} (scale {denom[i]:.6g}"
                          f"{', fast path' if fast else ''})")
        if far_err > 1.0:
            j = int(np.argmax(np.where(np.isnan(raw_far), np.inf, raw_far / (tol + allowance[far]))))
            i = int(np.flatnonzero(far)[j])
            raise Failure(f"far query (max K = exp({peak[i]:.4g}), statsmodels gives {sm[i]!r}): "
                          f"rel err {raw_far[j]:.3g} > {tol + allowance[i]:.3g} vs the softmax "
                          f"reference at query {i} {queries[i]}: qkv {preds[i]!r}, reference "
                          f"{ref[i]!r} (DESIGN 3: the nearest keys' value, never 0/0)")
        return (f"{len(preds)} queries, {int(far.sum())} far, worst rel err {near_raw:.2g}"
                + (f" (far {far_raw:.2g})" if far.any() else "") + (" [fast path]" if fast else ""))


def describe(**fields):
    return " ".join(f"{k}={v}" for k, v in fields.items())


def names_for(p):
    return ["x"] if p == 1 else [f"x{c + 1}" for c in range(p)]


# ---- part fixed -------------------------------------------------------------------

CHAPTER_BANDWIDTHS = [1.0, 0.5, 0.2, 0.05, 0.01, 0.002, 3.0, 1e4]
ENGEL_BANDWIDTHS = [1.0, 5.0, 10.0, 40.0, 134.0, 400.0, 2000.0, 1e6]
FAST_BANDWIDTHS = [0.001, 0.02, 0.3, 2.0, 50.0, 0.005, 0.1, 1.0]


def fixed_case(runner, index, rng):
    kind = ("chapter", "engel", "random1d", "random2d", "random3d", "fast1d")[index % 6]
    round_ = index // 6
    exact = index % 3 == 2 and kind != "fast1d"
    grid = None
    queries = None
    notes = []
    if kind == "chapter":
        x, y = chapter_data(rng)
        h = [CHAPTER_BANDWIDTHS[round_ % len(CHAPTER_BANDWIDTHS)]]
        if round_ % 2 == 0:
            grid = "0:5:0.1"  # the chapter's queries, arange(0, 5, 0.1)
        else:
            queries = np.sort(rng.uniform(-2.0, 7.0, size=60))[:, None]
            notes.append("queries in [-2, 7]")
        names, y_name = ["x"], "y"
    elif kind == "engel":
        x, y = engel_data()
        h = [ENGEL_BANDWIDTHS[round_ % len(ENGEL_BANDWIDTHS)]]
        grid_queries = np.arange(300.0, 5600.0, 50.0)
        sample = rng.choice(x[:, 0], size=30, replace=False)
        queries = np.concatenate([grid_queries, sample])[:, None]
        names, y_name = ["income"], "foodexp"
        notes.append("queries: income 300..5550 step 50 and 30 training incomes")
    elif kind == "fast1d":
        # Big enough (n t > 1e6) for predict() to take the 1-D fast path.
        n = int(rng.integers(3000, 8000))
        x, y = chapter_data(rng, n)
        if round_ % 2 == 1:
            x = np.round(x, 2)  # many duplicate keys
            notes.append("duplicate keys")
        h = [FAST_BANDWIDTHS[round_ % len(FAST_BANDWIDTHS)]]
        queries = np.sort(rng.uniform(-1.0, 6.0, size=int(rng.integers(500, 900))))[:, None]
        names, y_name = ["x"], "y"
        notes.append("queries in [-1, 6]")
    else:
        p = {"random1d": 1, "random2d": 2, "random3d": 3}[kind]
        n = int(rng.integers(3, 250))
        if p == 1:
            spread = float(rng.choice([1e-3, 1.0, 1e3]))
            x = rng.uniform(0.0, spread, size=(n, 1))
            if rng.random() < 0.4:
                x = np.round(x / spread * 20.0) * spread / 20.0  # duplicate keys
                notes.append("duplicate keys")
            y = np.cos(6.0 * x[:, 0] / spread) + rng.normal(0.0, 0.3, size=n)
            scales = np.array([spread])
            lo, hi = -0.3 * spread, 1.3 * spread
            queries = rng.uniform(lo, hi, size=(int(rng.integers(1, 80)), 1))
        else:
            x, y = multi_data(rng, n, p)
            scales = np.ptp(x, axis=0)
            lo, hi = x.min(axis=0) - 0.3 * scales, x.max(axis=0) + 0.3 * scales
            queries = rng.uniform(lo, hi, size=(int(rng.integers(1, 80)), p))
        # Per feature, from tiny (1e-3 of the spread) to huge (100 times).
        h = list(scales * 10.0 ** rng.uniform(-3.0, 2.0, size=scales.shape))
        names, y_name = names_for(p), "y"
    runner.desc = (describe(kind=kind, n=x.shape[0], p=x.shape[1], h=fmt(h))
                   + (f" grid={grid}" if grid else f" t={len(queries)}")
                   + (" --exact" if exact else "") + "".join(f" [{note}]" for note in notes))
    got_queries, preds, summary = runner.regress(x, y, names, y_name, fmt(h), queries=queries,
                                                 grid=grid, exact=exact)
    bw = np.asarray(summary["bandwidth"], dtype=np.float64)
    if not np.allclose(bw, h, rtol=1e-15, atol=0.0):
        raise Failure(f"--json bandwidth {summary['bandwidth']}, given {h}")
    if grid is not None:
        start, stop, step = (float(v) for v in grid.split(":"))
        k = np.arange(len(got_queries))
        expect = start + k * step
        if (len(got_queries) < int(math.floor((stop - start) / step))
                or np.any(np.abs(got_queries[:, 0] - expect) > 1e-9 * abs(step))
                or got_queries[-1, 0] > stop + 1e-9 * abs(step)):
            raise Failure(f"--grid {grid} gave queries {got_queries[:, 0]}, expected "
                          f"arange({start}, {stop}, {step}) = {np.arange(start, stop, step)}")
        queries = got_queries
    note = runner.compare(x, y, queries, h, preds, bool(summary["fast_path"]))
    runner.desc += f" -> {note}"


# ---- part cv ------------------------------------------------------------------------

def cv_data(rng, index):
    if index == 0:
        x, y = engel_data()
        return "engel income -> foodexp", x, y, ["income"], "foodexp"
    if index in (1, 2, 3):
        x, y = chapter_data(rng, n=(50, 50, 200)[index - 1])
        return f"chapter set-up n={x.shape[0]}", x, y, ["x"], "y"
    if index == 4:
        n = 300
        x = rng.standard_t(3, size=(n, 1)) * 2.0  # heavy tails: IQR and sd disagree
        y = np.tanh(x[:, 0]) * 3.0 + rng.normal(0.0, 0.4, size=n)
        return f"1-D t(3) x, tanh target n={n}", x, y, ["x"], "y"
    n = (150, 120)[index - 5]
    x, y = multi_data(rng, n, 2)
    return f"2-D scales 2 and 0.05 n={n}", x, y, ["x1", "x2"], "y"


CV_CASES = 7


def cv_case(runner, index, rng):
    what, x, y, names, y_name = cv_data(rng, index)
    runner.desc = what
    queries = x[: min(len(x), 40)]
    _, preds, summary = runner.regress(x, y, names, y_name, "cv", queries=queries)
    h_qkv = np.asarray(summary["bandwidth"], dtype=np.float64)
    reported = float(summary["loo_error"])
    ours = loo_error(x, y, h_qkv)
    if not abs(reported - ours) <= CV_SLACK * ours:
        raise Failure(f"qkv reports loo_error {reported!r} at h={fmt(h_qkv)}, numpy gives "
                      f"{ours!r} (rel diff {abs(reported - ours) / ours:.3g} > {CV_SLACK:g})")
    started = time.monotonic()
    h_sm, sm_own = statsmodels_cv(x, y)
    sm_seconds = time.monotonic() - started
    sm_loo = loo_error(x, y, h_sm)
    # Sanity check of the numpy LOO against statsmodels' own, where both
    # evaluate the same numbers (no underflow; heavy-tailed data can have it).
    if not loo_underflows(x, h_sm) and not abs(sm_own - sm_loo) <= CV_SLACK * sm_loo:
        raise Failure(f"test reference: statsmodels' cv_loo {sm_own!r} at its bandwidth "
                      f"{fmt(h_sm)}, numpy LOO {sm_loo!r}")
    gain = (sm_loo - ours) / sm_loo
    line = (f"qkv h={fmt(h_qkv)} loo={ours:.10g} | statsmodels cv_ls h={fmt(h_sm)} "
            f"loo={sm_loo:.10g} ({sm_seconds:.2f} s) | qkv better by {gain:.3g} (relative)")
    runner.cv_lines.append(f"  cv {what}: {line}")
    runner.worst_cv_gap = max(runner.worst_cv_gap, -gain)
    if ours > sm_loo * (1.0 + CV_SLACK):
        raise Failure(f"qkv's cross-validated bandwidth is worse than statsmodels' cv_ls: {line}")
    note = runner.compare(x, y, queries, h_qkv, preds, bool(summary["fast_path"]))
    runner.desc += f" -> {line}; predictions: {note}"


def rule_case(runner, index, rng):
    rule = ("silverman", "scott")[index % 2]
    which = index // 2
    if which == 0:
        x, y = engel_data()
        names, y_name, what = ["income"], "foodexp", "engel"
    elif which == 1:
        x, y = chapter_data(rng)
        names, y_name, what = ["x"], "y", "chapter set-up"
    elif which == 2:
        n = 200
        x = rng.standard_t(2, size=(n, 1))  # heavy tails: the IQR term of silverman wins
        y = np.sin(x[:, 0]) + rng.normal(0.0, 0.1, size=n)
        names, y_name, what = ["x"], "y", "t(2) x"
    else:
        p = which - 1  # 2, then 3 features
        x, y = multi_data(rng, int(rng.integers(30, 200)), p)
        names, y_name, what = names_for(p), "y", f"{p}-D"
    runner.desc = f"--bandwidth {rule} on {what} n={x.shape[0]} p={x.shape[1]}"
    queries = np.concatenate([x[:25], x.min(axis=0) - np.ptp(x, axis=0)[None, :]])
    _, preds, summary = runner.regress(x, y, names, y_name, rule, queries=queries)
    got = np.asarray(summary["bandwidth"], dtype=np.float64)
    expect = silverman(x) if rule == "silverman" else scott(x)
    err = float(np.max(np.abs(got - expect) / expect))
    runner.worst_rule = max(runner.worst_rule, err)
    if not err <= RULE_TOLERANCE:
        raise Failure(f"{rule} bandwidth {fmt(got)}, formula gives {fmt(expect)} "
                      f"(rel err {err:.3g} > {RULE_TOLERANCE:g})")
    note = runner.compare(x, y, queries, list(got), preds, bool(summary["fast_path"]))
    runner.desc += f" -> h={fmt(got)} (rel err {err:.2g}); predictions: {note}"


RULE_CASES = 10


# ---- main -------------------------------------------------------------------------

def check_binary(qkv):
    if not os.path.isfile(qkv):
        die(f"qkv binary {qkv!r} does not exist (build the qkv_cli target)")
    try:
        proc = subprocess.run([qkv, "regress", "--help"], capture_output=True, text=True,
                              timeout=60)
    except OSError as exc:
        die(f"cannot run the qkv binary {qkv!r}: {exc}")
    except subprocess.TimeoutExpired:
        die(f"`{qkv} regress --help` did not finish in 60 s")
    if proc.returncode != 0:
        die(f"`{qkv} regress --help` exited with status {proc.returncode}: "
            f"{proc.stderr.strip()}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qkv", required=True, help="path of the qkv command")
    parser.add_argument("--part", required=True, choices=("fixed", "cv"))
    parser.add_argument("--seed", type=int, help="replay a run (default: fresh from os.urandom)")
    parser.add_argument("--cases", type=int, default=48,
                        help="random fixed-bandwidth cases (default 48; --part fixed)")
    parser.add_argument("--case", type=int, help="run only this case (with --seed)")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per case")
    args = parser.parse_args()

    check_binary(args.qkv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    np.set_printoptions(precision=17, linewidth=150, threshold=64)
    replay = (f"{sys.executable} {os.path.abspath(__file__)} --qkv {args.qkv} "
              f"--part {args.part} --seed {seed}")
    print(f"peer statsmodels {args.part}: seed {seed} (replay: {replay})", flush=True)

    start = time.monotonic()
    passed, failed = 0, 0
    with tempfile.TemporaryDirectory(prefix=f"qkv_peer_statsmodels_{args.part}_") as workdir:
        runner = Runner(args.qkv, seed, workdir)
        runner.cv_lines, runner.worst_cv_gap, runner.worst_rule = [], -math.inf, 0.0
        if args.part == "fixed":
            cases = [(i, fixed_case) for i in range(args.cases)]
        else:
            cases = ([(i, cv_case) for i in range(CV_CASES)]
                     + [(CV_CASES + i, lambda r, i_, g: rule_case(r, i_ - CV_CASES, g))
                        for i in range(RULE_CASES)])
        if args.case is not None:
            cases = [c for c in cases if c[0] == args.case]
            if not cases:
                die(f"--case {args.case}: no such case in --part {args.part}")
        for index, case_fn in cases:
            rng = np.random.default_rng([seed, index])
            runner.desc = "(failed while drawing the case)"
            try:
                case_fn(runner, index, rng)
                passed += 1
                if args.verbose:
                    print(f"  ok   case {index}: {runner.desc}", flush=True)
            except (Failure, AssertionError) as exc:
                failed += 1
                print(f"  FAIL case {index}: {runner.desc}\n    {exc}\n"
                      f"    replay: {replay} --case {index}", flush=True)

    elapsed = time.monotonic() - start
    if not args.verbose:
        for line in runner.cv_lines:
            print(line)
    summary = (f"worst rel err vs statsmodels {runner.worst_statsmodels:.2g} over "
               f"{runner.predictions} predictions")
    if runner.fast_cases:
        summary += f", fast path {runner.worst_fast:.2g} in {runner.fast_cases} cases"
    summary += (f", far queries vs softmax reference {runner.worst_far:.2g} "
                f"({runner.far_queries} queries)")
    if args.part == "cv":
        summary += (f"; cv: qkv's LOO minus statsmodels' at most {runner.worst_cv_gap:.2g} "
                    f"relative (negative: qkv lower); rule bandwidths rel err "
                    f"{runner.worst_rule:.2g}")
    print(f"peer statsmodels {args.part}: {passed} passed, {failed} failed ({summary}; "
          f"{elapsed:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
