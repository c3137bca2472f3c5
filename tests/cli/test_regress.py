#!/usr/bin/python3
"""Tests of `qkv regress`: Nadaraya-Watson kernel regression from CSV and .npy
tables. Predictions are held to a float64 NumPy reference of the estimator;
the bandwidth rules, --json, --weights and every error path are checked
through the command line. The harness (running qkv, temporary directories,
expect_error) is test_cli.py's.

Usage: test_regress.py --qkv PATH [unittest arguments, e.g. a TestCase name]
NumPy is required: if it cannot be imported this script fails.
"""

import json
import os
import struct
import subprocess
import sys
import xml.dom.minidom
import zlib
from fractions import Fraction

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_cli  # noqa: E402  (the harness; its QKV is set in main())

# Exact evaluation against the float64 reference; the 1-D Gaussian fast path
# has the bound kernel_regression.h documents for it.
EXACT = dict(rtol=1e-12, atol=1e-13)
FAST = dict(rtol=1e-7, atol=1e-7)

SUMMARY_KEYS = {"kernel", "bandwidth", "bandwidth_rule", "loo_error", "num_train", "num_queries",
                "num_undefined", "fast_path", "timings_s"}
TIMING_KEYS = {"load", "bandwidth", "predict", "write"}


# ---- float64 references ----------------------------------------------------------

PROFILES = {
    "gaussian": lambda u: np.exp(-u * u / 2),
    "boxcar": lambda u: (np.abs(u) <= 1).astype(np.float64),
    "epanechnikov": lambda u: np.where(np.abs(u) <= 1, 1 - u * u, 0.0),
    "triangular": lambda u: np.where(np.abs(u) <= 1, 1 - np.abs(u), 0.0),
}


def np_weights(x, q, h, kernel="gaussian"):
    """(t, n) Nadaraya-Watson weights of a product kernel; x (n, p), q (t, p),
    h a scalar or (p). Gaussian in softmax form; rows with no key in reach of
    a compact kernel are NaN."""
    x, q = np.atleast_2d(x.T).T, np.atleast_2d(q.T).T
    u = (q[:, None, :] - x[None, :, :]) / np.broadcast_to(np.asarray(h, float), (x.shape[1],))
    if kernel == "gaussian":
        s = -0.5 * (u * u).sum(axis=2)
        k = np.exp(s - s.max(axis=1, keepdims=True))
    else:
        k = PROFILES[kernel](u).prod(axis=2)
    total = k.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, k / np.where(total > 0, total, 1), np.nan)


def np_predict(x, y, q, h, kernel="gaussian"):
    return np_weights(x, q, h, kernel) @ y


def chapter_data(rng, n=50):
    """d2l §11.2: sorted x ~ U(0, 5), y = 2 sin x + x^0.8 + N(0, 0.5)."""
    x = np.sort(rng.uniform(0, 5, n))
    y = 2 * np.sin(x) + x ** 0.8 + rng.normal(0, 0.5, n)
    return x, y


# ---- the harness -----------------------------------------------------------------------

class RegressTest(test_cli.CliTest):
    def write_csv(self, name, header, columns, text=None):
        """Writes columns (each a 1-D array) under `header` with %.17g, or the
        raw `text` if given; returns the path."""
        path = self.path(name)
        if text is None:
            rows = np.column_stack(columns)
            text = ",".join(header) + "\n" + "".join(
                ",".join("%.17g" % v for v in row) + "\n" for row in rows)
        with open(path, "w") as f:
            f.write(text)
        return path

    def regress(self, *args):
        """Runs `qkv regress ARGS`, which must succeed; returns (stdout, stderr)
        and, with --json, the summary (else None). With --json stderr must be
        empty (it is not a terminal here)."""
        r = test_cli.run("regress", *args)
        context = f"qkv regress {' '.join(map(str, args))}\nstdout: {r.stdout}\nstderr: {r.stderr}"
        self.assertEqual(r.returncode, 0, context)
        summary = None
        if "--json" in args:
            self.assertEqual(r.stderr, "", context)
            lines = r.stdout.strip().splitlines()
            self.assertEqual(len(lines), 1, f"--json prints one line\n{context}")
            summary = json.loads(lines[0])
            self.assertLessEqual(SUMMARY_KEYS, set(summary), context)
            self.assertEqual(set(summary["timings_s"]), TIMING_KEYS, context)
            for key in TIMING_KEYS:
                self.assertGreaterEqual(summary["timings_s"][key], 0.0, context)
        else:
            self.assertEqual(r.stdout, "", context)
        return r, summary

    def read_predictions(self, path):
        """The output CSV: (header, (t, columns) float64 array; "nan" read as NaN)."""
        self.assertTrue(os.path.exists(path), f"qkv wrote no {path}")
        with open(path) as f:
            lines = f.read().splitlines()
        header = lines[0].split(",")
        rows = np.array([[float(v) for v in line.split(",")] for line in lines[1:]])
        self.assertEqual(rows.shape[1], len(header), path)
        return header, rows


# ---- the chapter's estimator ----------------------------------------------------------

class ChapterTest(RegressTest):
    """d2l §11.2's data: the nonparametric Gaussian estimator with h = 1."""

    def setUp(self):
        super().setUp()
        self.x, self.y = chapter_data(self.rng)
        self.train = self.write_csv("train.csv", ["x", "y"], [self.x, self.y])
        self.out = self.path("pred.csv")

    def test_grid_with_bandwidth_1_equals_the_reference(self):
        for exact in (True, False):
            args = ["--train", self.train, "--grid", "0:5:0.1", "--kernel", "gaussian",
                    "--bandwidth", "1", "--out", self.out, "--json"] + (["--exact"] if exact else [])
            _, summary = self.regress(*args)
            header, got = self.read_predictions(self.out)
            self.assertEqual(header, ["x", "y_pred"])
            grid = np.arange(0, 5, 0.1)
            self.assertEqual(got.shape, (50, 2))
            np.testing.assert_allclose(got[:, 0], grid, rtol=1e-15, atol=1e-15)
            ref = np_predict(self.x, self.y, grid, 1.0)
            tol = FAST if summary["fast_path"] else EXACT
            np.testing.assert_allclose(got[:, 1], ref, **tol)
            if exact:
                self.assertFalse(summary["fast_path"])
            self.assertEqual(summary["kernel"], "gaussian")
            self.assertEqual(summary["bandwidth"], [1.0])
            self.assertEqual(summary["bandwidth_rule"], "fixed")
            self.assertEqual((summary["num_train"], summary["num_queries"]), (50, 50))
            self.assertEqual(summary["num_undefined"], 0)
            self.assertNotIn("epochs", summary)
            # The leave-one-out error, mean over i of (f_{-i}(x_i) - y_i)^2.
            w = np_weights(self.x, self.x, 1.0)
            np.fill_diagonal(w, 0)
            loo = np.mean((w @ self.y / w.sum(axis=1) - self.y) ** 2)
            self.assertAlmostEqual(summary["loo_error"], loo, delta=1e-12 * loo)

    def test_query_csv_with_extra_columns(self):
        q = np.array([0.0, 1.25, 2.5, 4.75, -3.0, 40.0])  # the last two far outside the data
        query = self.write_csv("q.csv", ["label", "x"], [np.arange(6.0), q])
        self.regress("--train", self.train, "--query", query, "--kernel", "gaussian",
                     "--bandwidth", "1", "--exact", "--out", self.out)
        header, got = self.read_predictions(self.out)
        self.assertEqual(header, ["x", "y_pred"])
        np.testing.assert_array_equal(got[:, 0], q)
        np.testing.assert_allclose(got[:, 1], np_predict(self.x, self.y, q, 1.0), **EXACT)
        # x = 40 is ~35 bandwidths from every key: its nearest keys' values, not 0/0.
        self.assertTrue(np.isfinite(got[:, 1]).all())

    def test_human_summary_on_stderr(self):
        r, _ = self.regress("--train", self.train, "--grid", "0:5:0.5", "--kernel", "gaussian",
                            "--bandwidth", "scott", "--out", self.out)
        self.assertTrue(r.stderr.startswith("qkv regress: 50 training points, 10 queries"),
                        r.stderr)
        for piece in ("bandwidth (scott): ", "LOO error: ", "undefined predictions: 0"):
            self.assertIn(piece, r.stderr)
        self.assertNotIn("cv:", r.stderr)  # no progress: stderr is not a terminal
        r, _ = self.regress("--train", self.train, "--grid", "0:5:0.5", "--kernel", "gaussian",
                            "--bandwidth", "cv", "--out", self.out, "--verbose")
        self.assertIn("qkv regress: cv: ", r.stderr)

    def test_other_kernels_equal_the_reference(self):
        q = np.arange(0, 5, 0.25)
        for kernel in ("boxcar", "uniform", "epanechnikov", "triangular"):
            _, summary = self.regress("--train", self.train, "--grid", "0:5:0.25", "--kernel",
                                      kernel, "--bandwidth", "0.75", "--out", self.out, "--json")
            _, got = self.read_predictions(self.out)
            profile = "boxcar" if kernel == "uniform" else kernel
            np.testing.assert_allclose(got[:, 1], np_predict(self.x, self.y, q, 0.75, profile),
                                       **EXACT, err_msg=kernel)
            self.assertEqual(summary["kernel"], profile)
            self.assertEqual(summary["num_undefined"], 0)


# ---- several features, .npy tables ------------------------------------------------------

class FeaturesTest(RegressTest):
    def setUp(self):
        super().setUp()
        n = 60
        self.a, self.b, self.c = (self.rng.normal(size=n) for _ in range(3))
        self.y = np.sin(self.a) + self.c ** 2 + 0.1 * self.rng.normal(size=n)
        self.out = self.path("pred.csv")

    def test_x_cols_names_order_and_per_feature_bandwidths(self):
        train = self.write_csv("train.csv", ["a", "b", "c", "price"],
                               [self.a, self.b, self.c, self.y])
        q = self.rng.normal(size=(7, 2))  # columns c, a
        query = self.write_csv("q.csv", ["a", "other", "c"], [q[:, 1], np.zeros(7), q[:, 0]])
        _, summary = self.regress("--train", train, "--x-cols", "c, a", "--y-col", "price",
                                  "--query", query, "--kernel", "gaussian", "--bandwidth",
                                  "0.5,2", "--out", self.out, "--json")
        header, got = self.read_predictions(self.out)
        self.assertEqual(header, ["c", "a", "price_pred"])
        np.testing.assert_array_equal(got[:, :2], q)
        ref = np_predict(np.column_stack([self.c, self.a]), self.y, q, [0.5, 2.0])
        np.testing.assert_allclose(got[:, 2], ref, **EXACT)
        self.assertEqual(summary["bandwidth"], [0.5, 2.0])
        self.assertFalse(summary["fast_path"])

    def test_default_columns_and_one_bandwidth_for_all(self):
        train = self.write_csv("train.csv", ["a", "b", "y"], [self.a, self.b, self.y])
        query = self.write_csv("q.csv", ["b", "a"], [self.b[:5], self.a[:5]])
        _, summary = self.regress("--train", train, "--query", query, "--kernel", "epanechnikov",
                                  "--bandwidth", "1.5", "--out", self.out, "--json")
        header, got = self.read_predictions(self.out)
        self.assertEqual(header, ["a", "b", "y_pred"])
        x = np.column_stack([self.a, self.b])
        np.testing.assert_allclose(got[:, 2], np_predict(x, self.y, x[:5], 1.5, "epanechnikov"),
                                   **EXACT)
        self.assertEqual(summary["bandwidth"], [1.5, 1.5])
        # --y-col alone: the x columns are all the others.
        query = self.write_csv("q2.csv", ["y", "b"], [self.y[:5], self.b[:5]])
        self.regress("--train", train, "--y-col", "a", "--query", query, "--kernel", "gaussian",
                     "--bandwidth", "1", "--out", self.out)
        header, got = self.read_predictions(self.out)
        self.assertEqual(header, ["b", "y", "a_pred"])

    def test_quoted_header_names_round_trip(self):
        text = '"size, m2",  "the ""y"""\n' + "".join(
            f"{a!r},{y!r}\n" for a, y in zip(self.a, self.y))
        train = self.write_csv("train.csv", None, None, text=text)
        self.regress("--train", train, "--grid", "-1:1:0.5", "--kernel", "gaussian",
                     "--bandwidth", "0.5", "--out", self.out)
        with open(self.out) as f:
            self.assertEqual(f.readline(), '"size, m2","the ""y""_pred"\n')

    def test_npy_train_and_query(self):
        x, y = chapter_data(self.rng)
        train = self.save("train.npy", np.column_stack([x, y]))
        q = np.linspace(-1, 6, 9)
        for name, query in (("q1.npy", q), ("q2.npy", q[:, None]),
                            ("q32.npy", q.astype(np.float32))):
            self.regress("--train", train, "--query", self.save(name, query), "--kernel",
                         "gaussian", "--bandwidth", "0.7", "--exact", "--out", self.out)
            header, got = self.read_predictions(self.out)
            self.assertEqual(header, ["x0", "y_pred"])
            q64 = query.astype(np.float64).reshape(-1)
            np.testing.assert_array_equal(got[:, 0], q64)
            np.testing.assert_allclose(got[:, 1], np_predict(x, y, q64, 0.7), **EXACT)
        # float32 training data is read as float64.
        train32 = self.save("train32.npy", np.column_stack([x, y]).astype(np.float32))
        self.regress("--train", train32, "--grid", "0:5:1", "--kernel", "gaussian",
                     "--bandwidth", "0.7", "--exact", "--out", self.out)
        _, got = self.read_predictions(self.out)
        x32, y32 = (v.astype(np.float32).astype(np.float64) for v in (x, y))
        np.testing.assert_allclose(got[:, 1], np_predict(x32, y32, np.arange(5.0), 0.7), **EXACT)

    def test_npy_column_indices_and_csv_query(self):
        table = np.column_stack([self.a, self.y, self.c])
        train = self.save("train.npy", table)
        q = self.rng.normal(size=(4, 2))
        # A CSV query names the .npy columns x<index>.
        query = self.write_csv("q.csv", ["x2", "x0"], [q[:, 1], q[:, 0]])
        self.regress("--train", train, "--x-cols", "0,2", "--y-col", "1", "--query", query,
                     "--kernel", "gaussian", "--bandwidth", "0.8,1.2", "--out", self.out)
        header, got = self.read_predictions(self.out)
        self.assertEqual(header, ["x0", "x2", "y_pred"])
        ref = np_predict(np.column_stack([self.a, self.c]), self.y, q, [0.8, 1.2])
        np.testing.assert_allclose(got[:, 2], ref, **EXACT)
        self.regress("--train", train, "--x-cols", "0,2", "--y-col", "1", "--query",
                     self.save("q.npy", q), "--kernel", "gaussian", "--bandwidth", "0.8,1.2",
                     "--out", self.out)
        _, got = self.read_predictions(self.out)
        np.testing.assert_allclose(got[:, 2], ref, **EXACT)


# ---- bandwidth rules ---------------------------------------------------------------------

class BandwidthTest(RegressTest):
    def setUp(self):
        super().setUp()
        self.x, self.y = chapter_data(self.rng, n=80)
        self.train = self.write_csv("train.csv", ["x", "y"], [self.x, self.y])
        self.out = self.path("pred.csv")

    def summary(self, rule, *extra):
        _, summary = self.regress("--train", self.train, "--grid", "0:5:0.1", "--kernel",
                                  "gaussian", "--bandwidth", rule, "--out", self.out, "--json",
                                  *extra)
        self.assertEqual(summary["bandwidth_rule"], rule)
        self.assertEqual(len(summary["bandwidth"]), 1)
        h = summary["bandwidth"][0]
        # A learned w may be near 0 after a short or slow training: h = 1/|w| large.
        self.assertTrue(0 < h < (np.inf if rule == "learn" else 10), summary)
        self.assertTrue(0 < summary["loo_error"] < 10, summary)
        return summary

    def test_rules_of_thumb(self):
        silverman, scott = self.summary("silverman"), self.summary("scott")
        s = self.x.std(ddof=1)
        # Both scale like the spread times n^(-1/5); neither is far from it.
        for summary in (silverman, scott):
            self.assertTrue(0.2 < summary["bandwidth"][0] / (s * 80 ** -0.2) < 1.5, summary)

    def test_cv_is_no_worse_than_scott(self):
        scott, cv = self.summary("scott"), self.summary("cv")
        self.assertLessEqual(cv["loo_error"], scott["loo_error"] * (1 + 1e-9))
        # The reported LOO error is the one at the reported bandwidth.
        w = np_weights(self.x, self.x, cv["bandwidth"][0])
        np.fill_diagonal(w, 0)
        loo = np.mean((w @ self.y / w.sum(axis=1) - self.y) ** 2)
        self.assertAlmostEqual(cv["loo_error"], loo, delta=1e-9 * loo)

    def test_learn(self):
        # The chapter's set-up with fixed data and seed (SGD at lr 0.5 on the
        # summed loss need not descend on every draw of 80 points).
        self.x, self.y = chapter_data(np.random.default_rng(0), n=50)
        self.train = self.write_csv("train.csv", ["x", "y"], [self.x, self.y])
        summary = self.summary("learn", "--seed", "3")
        epochs = summary["epochs"]
        self.assertEqual([e["epoch"] for e in epochs], [1, 2, 3, 4, 5])
        losses = [e["loss"] for e in epochs]
        self.assertTrue(all(b < a for a, b in zip(losses, losses[1:])), losses)
        self.assertAlmostEqual(summary["bandwidth"][0], 1 / abs(summary["w"]), delta=1e-12)
        # The predictions are the Gaussian estimator's at h = 1/|w|.
        _, got = self.read_predictions(self.out)
        ref = np_predict(self.x, self.y, np.arange(0, 5, 0.1), summary["bandwidth"][0])
        np.testing.assert_allclose(got[:, 1], ref, rtol=1e-10, atol=1e-12)
        # Same seed, same run; --epochs and --lr are honoured.
        self.assertEqual(self.summary("learn", "--seed", "3")["w"], summary["w"])
        short = self.summary("learn", "--seed", "3", "--epochs", "2", "--lr", "0.1")
        self.assertEqual(len(short["epochs"]), 2)
        self.assertEqual(short["epochs"][0]["w"], epochs[0]["w"])


    def test_loo_error_is_not_computed_above_50000_points(self):
        x = np.linspace(0, 5, 50001)
        train = self.save("big.npy", np.column_stack([x, np.sin(x)]))
        _, summary = self.regress("--train", train, "--grid", "0:5:1", "--kernel", "gaussian",
                                  "--bandwidth", "0.1", "--out", self.out, "--json")
        self.assertIsNone(summary["loo_error"])
        r, _ = self.regress("--train", train, "--grid", "0:5:1", "--kernel", "gaussian",
                            "--bandwidth", "0.1", "--out", self.out)
        self.assertIn("LOO error: not computed (n > 50000; see --loo)", r.stderr)


# ---- weights and undefined predictions -----------------------------------------------------

class WeightsTest(RegressTest):
    def setUp(self):
        super().setUp()
        self.x, self.y = chapter_data(self.rng, n=40)
        self.train = self.write_csv("train.csv", ["x", "y"], [self.x, self.y])
        self.out, self.weights = self.path("pred.csv"), self.path("w.npy")

    def test_weights_rows_sum_to_one(self):
        for rule in ("0.5", "learn"):
            self.regress("--train", self.train, "--grid", "-1:6:0.5", "--kernel", "gaussian",
                         "--bandwidth", rule, "--out", self.out, "--weights", self.weights)
            w = self.load(self.weights, np.float64, (14, 40))
            np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-12)
            self.assertTrue((w >= 0).all())
            _, got = self.read_predictions(self.out)
            np.testing.assert_allclose(w @ self.y, got[:, 1], rtol=1e-7, atol=1e-7)
            if rule == "0.5":
                np.testing.assert_allclose(w, np_weights(self.x, np.arange(-1, 6, 0.5), 0.5),
                                           rtol=1e-12, atol=1e-300)

    def test_compact_kernel_empty_neighbourhood(self):
        # Queries at 7 and 9 are more than h = 0.5 from every x in [0, 5).
        query = self.write_csv("q.csv", ["x"], [np.array([1.0, 7.0, 2.0, 9.0])])
        for kernel in ("boxcar", "epanechnikov", "triangular"):
            _, summary = self.regress("--train", self.train, "--query", query, "--kernel", kernel,
                                      "--bandwidth", "0.5", "--out", self.out, "--weights",
                                      self.weights, "--json")
            self.assertEqual(summary["num_undefined"], 2, kernel)
            with open(self.out) as f:
                lines = f.read().splitlines()
            self.assertEqual([line.split(",")[1] for line in lines[1:]][1::2], ["nan", "nan"])
            _, got = self.read_predictions(self.out)
            ref = np_predict(self.x, self.y, np.array([1.0, 7.0, 2.0, 9.0]), 0.5, kernel)
            np.testing.assert_allclose(got[:, 1], ref, **EXACT)  # NaN where ref is NaN
            w = self.load(self.weights, np.float64, (4, 40))
            self.assertTrue(np.isnan(w[[1, 3]]).all())
            np.testing.assert_allclose(w[[0, 2]].sum(axis=1), 1.0, rtol=1e-12)
        r, _ = self.regress("--train", self.train, "--query", query, "--kernel", "boxcar",
                            "--bandwidth", "0.5", "--out", self.out)
        self.assertIn("undefined predictions: 2", r.stderr)


# ---- degenerate data: huge y, subnormal spreads and bandwidths, far queries ------------------

def np_loo(x, y, h):
    """The Gaussian leave-one-out error in float64 (for y of ordinary size)."""
    w = np_weights(x, x, h)
    np.fill_diagonal(w, 0)
    return np.mean((w @ y / w.sum(axis=1) - y) ** 2)


def exact_nearest(x, q):
    """For each query: the index of its nearest key, from exact rational
    distances (float64 |q - x| ties for q = 1e308 and keys 0 and 5), and the
    Gaussian exponent gap to the next key at h = 1, ((q - x2)^2 - (q - x1)^2) / 2."""
    keys = [Fraction(v) for v in x]
    result = []
    for v in q:
        d = sorted((abs(Fraction(v) - k), j) for j, k in enumerate(keys))
        result.append((d[0][1], (d[1][0] ** 2 - d[0][0] ** 2) / 2))
    return result


class DegenerateDataTest(RegressTest):
    """The adversarial run's failures at 6a8f229: --bandwidth cv crashed
    (exit 139) when every leave-one-out error was inf (y ~ 1e160) or x had a
    subnormal spread; --bandwidth 1e-320 and far queries gave NaN."""

    def setUp(self):
        super().setUp()
        self.out, self.weights = self.path("pred.csv"), self.path("w.npy")
        self.x = np.sort(self.rng.uniform(0, 5, 50))

    def fails(self, train, bandwidth, *fragments, kernel="gaussian"):
        self.expect_error("regress", ["regress", "--train", train, "--grid", "0:5:1", "--kernel",
                                      kernel, "--bandwidth", bandwidth, "--out", self.out],
                          [self.out], fragments)

    def test_cv_with_huge_y_works_for_every_kernel(self):
        # Squared errors of y ~ 1e160 overflow float64; the search runs on y
        # scaled by a power of two and finds what it finds for y ~ 1. The
        # factor is chosen from y's own LOO error (1e-12 to 1e-2 over 50
        # random x), so the scaled one is beyond float64 on every draw: a
        # fixed 1e160 once gave 7.8e307.
        y = np.sin(self.x) + 1.5
        unit = self.write_csv("y.csv", ["x", "y"], [self.x, y])
        for kernel in ("gaussian", "boxcar", "epanechnikov", "triangular"):
            args = ["--grid", "0:5:1", "--kernel", kernel, "--bandwidth", "cv", "--out", self.out]
            _, small = self.regress("--train", unit, *args, "--json")
            self.assertGreater(small["loo_error"], 0, small)
            factor = 10.0 ** np.ceil((311 - np.log10(small["loo_error"])) / 2)
            huge = self.write_csv("bigy.csv", ["x", "y"], [self.x, y * factor])
            _, big = self.regress("--train", huge, *args, "--json")
            h = big["bandwidth"][0]
            self.assertTrue(np.isfinite(h) and h > 0, big)
            self.assertIsNone(big["loo_error"], "about 1e311: beyond float64, null in JSON")
            if kernel == "gaussian":
                self.assertAlmostEqual(h, small["bandwidth"][0], delta=1e-6 * h)
                # No worse than Scott's rule, in NumPy on y / factor.
                scott = 1.059 * self.x.std(ddof=1) * 50 ** -0.2
                self.assertLessEqual(np_loo(self.x, y, h), np_loo(self.x, y, scott) * (1 + 1e-9))
                _, got = self.read_predictions(self.out)
                np.testing.assert_allclose(got[:, 1], np_predict(self.x, y * factor,
                                                                 np.arange(0, 5, 1.0), h), **EXACT)
            r, _ = self.regress("--train", huge, *args)
            self.assertRegex(r.stderr, r"LOO error: \d\.\d+e\+31\d \(beyond the largest double",
                             kernel)

    def test_subnormal_x_spread_is_an_error_for_the_rules_that_need_spread(self):
        issue = self.write_csv("sub.csv", ["x", "y"], None, text="x,y\n0,1\n1e-320,2\n2e-320,3\n")
        x = np.ldexp(self.rng.integers(0, 2 ** 14, 20).astype(float), -1074)
        x[:2] = [0.0, 2.0 ** -1060]
        y = self.rng.uniform(-3, 3, 20)
        random = self.write_csv("subr.csv", ["x", "y"], [x, y])
        for train, ys in ((issue, np.array([1.0, 2.0, 3.0])), (random, y)):
            for kernel in ("gaussian", "boxcar", "epanechnikov", "triangular"):
                self.fails(train, "cv", "cv_bandwidth", "feature 0", "smallest normal double",
                           kernel=kernel)
            self.fails(train, "silverman", "silverman_bandwidth", "smallest normal double")
            self.fails(train, "scott", "scott_bandwidth", "smallest normal double")
            # A fixed or learned bandwidth works: every weight is equal, the mean of y.
            for rule in ("1", "learn"):
                self.regress("--train", train, "--grid", "0:5:1", "--kernel", "gaussian",
                             "--bandwidth", rule, "--out", self.out)
                _, got = self.read_predictions(self.out)
                np.testing.assert_allclose(got[:, 1], np.mean(ys), rtol=1e-14, atol=1e-14)

    def test_learn_with_huge_y_is_an_error(self):
        huge = self.write_csv("bigy.csv", ["x", "y"], [self.x, (np.sin(self.x) + 1.5) * 1e160])
        self.fails(huge, "learn", "train_parametric", "not finite", "rescale y")

    def test_subnormal_bandwidth_is_an_error(self):
        train = self.write_csv("t.csv", ["x", "y"], [self.x, np.sin(self.x)])
        for h in ("1e-320", "4.9e-324", "2e-308"):
            self.fails(train, h, "--bandwidth", "subnormal", "smallest normal double")
        multi = self.write_csv("m.csv", ["a", "b", "y"], [self.x, self.x ** 2, np.sin(self.x)])
        query = self.write_csv("q.csv", ["a", "b"], [self.x[:3], self.x[:3]])
        self.expect_error("regress", ["regress", "--train", multi, "--query", query, "--kernel",
                                      "gaussian", "--bandwidth", "1,1e-310", "--out", self.out],
                          [self.out], ["--bandwidth", '"1e-310"', "subnormal"])
        # The smallest normal double is a bandwidth: each query its nearest key.
        _, summary = self.regress("--train", train, "--query", self.write_csv(
            "qk.csv", ["x"], [self.x[::7]]), "--kernel", "gaussian", "--bandwidth",
            "2.2250738585072014e-308", "--out", self.out, "--json")
        _, got = self.read_predictions(self.out)
        np.testing.assert_array_equal(got[:, 1], np.sin(self.x[::7]))
        self.assertEqual(summary["num_undefined"], 0)

    def test_far_queries_get_the_nearest_keys_value(self):
        top = np.finfo(np.float64).max
        x = np.concatenate([[-1e308, 1e308], self.rng.uniform(0, 5, 8)])
        y = self.rng.uniform(-3, 3, x.size)
        train = self.write_csv("far.csv", ["x", "y"], [x, y])
        q = np.array([1.5e308, -1.5e308, top, -top, 1e300, -1e300, 7e307, -3e200, 1e20, 1e160])
        query = self.write_csv("q.csv", ["x"], [q])
        nearest = exact_nearest(x, q)
        for extra in ([], ["--exact"]):
            _, summary = self.regress("--train", train, "--query", query, "--kernel", "gaussian",
                                      "--bandwidth", "1", "--out", self.out, "--weights",
                                      self.weights, "--json", *extra)
            self.assertEqual(summary["num_undefined"], 0)
            self.assertIsNotNone(summary["loo_error"])
            _, got = self.read_predictions(self.out)
            w = self.load(self.weights, np.float64, (q.size, x.size))
            for i, (j, gap) in enumerate(nearest):
                self.assertGreater(gap, 2000, "the next key's weight is exp(-gap) = 0")
                self.assertEqual(got[i, 1], y[j], f"q={q[i]!r}: nearest key {x[j]!r}")
                np.testing.assert_array_equal(w[i], np.eye(x.size)[j], f"q={q[i]!r}")
        # The 1-D fast path (n t > 1e6): the same, within its bound.
        big_x = np.concatenate([x, self.rng.uniform(0, 5, 1200)])
        big_y = np.concatenate([y, self.rng.uniform(-3, 3, 1200)])
        many = np.concatenate([q, self.rng.uniform(-1, 6, 1000)])
        _, summary = self.regress("--train", self.write_csv("big.csv", ["x", "y"], [big_x, big_y]),
                                  "--query", self.write_csv("qq.csv", ["x"], [many]), "--kernel",
                                  "gaussian", "--bandwidth", "1", "--out", self.out, "--json")
        self.assertTrue(summary["fast_path"])
        _, got = self.read_predictions(self.out)
        self.assertTrue(np.isfinite(got[:, 1]).all())
        for i, (j, _) in enumerate(exact_nearest(big_x, q)):
            self.assertAlmostEqual(got[i, 1], big_y[j], delta=1e-7 * abs(big_y[j]),
                                   msg=f"q={q[i]!r}")


# ---- errors ---------------------------------------------------------------------------------

class ErrorsTest(RegressTest):
    def setUp(self):
        super().setUp()
        self.x, self.y = chapter_data(self.rng, n=20)
        self.train = self.write_csv("data.csv", ["x", "y"], [self.x, self.y])
        self.out, self.weights = self.path("pred.csv"), self.path("w.npy")
        self.outputs = [self.out, self.weights]

    def args(self, train=None, query=("--grid", "0:5:0.5"), bandwidth="1", kernel="gaussian",
             extra=()):
        return (["regress", "--train", train or self.train, *query, "--kernel", kernel,
                 "--bandwidth", bandwidth, "--out", self.out, "--weights", self.weights]
                + list(extra))

    def fails(self, args, *fragments):
        return self.expect_error("regress", args, self.outputs, fragments)

    def bad_csv(self, text, *fragments, name="data.csv"):
        path = self.write_csv(name, None, None, text=text)
        self.fails(self.args(train=path), *fragments)

    def test_malformed_csv_names_line_and_column(self):
        self.bad_csv("x,y,price\n" + "1,2,3\n" * 5 + "1,2,abc\n", "data.csv: ",
                     'line 7, column 3 ("price"): "abc" is not a number')
        self.bad_csv("x,y,price\n1,2,3\n1,,3\n", 'line 3, column 2 ("y")', "empty")
        self.bad_csv("x,y,price\n1,2,3\n1,nan,3\n", 'line 3, column 2 ("y")', '"nan"')
        self.bad_csv("x,y,price\n1,2,3\n1,2,inf\n", 'line 3, column 3 ("price")', '"inf"')
        self.bad_csv("x,y,price\n" + "1,2,3\n" * 7 + "1,2\n",
                     "data.csv: line 9 has 2 fields but the header has 3")
        self.bad_csv("x,y\n1,\"2\n", "line 2, column 2", "never closed")
        self.bad_csv("x,y\n", "data.csv", "no data rows")
        self.bad_csv("", "data.csv", "empty")
        self.bad_csv("x,x\n1,2\n", '"x" appears twice')

    def test_unknown_columns(self):
        self.fails(self.args(extra=["--y-col", "z"]),
                   '--y-col "z" is not a column of', "data.csv (columns: x, y)")
        self.fails(self.args(extra=["--x-cols", "x,w"]), '--x-cols "w" is not a column of')
        self.fails(self.args(extra=["--x-cols", "x", "--y-col", "x"]), "--y-col", "--x-cols")
        self.fails(self.args(extra=["--x-cols", "y"]), "defaults to the last column")
        self.fails(self.args(extra=["--x-cols", "x,,y"]), "--x-cols", "empty item")
        one = self.write_csv("one.csv", ["y"], [self.y])
        self.fails(self.args(train=one), "one.csv", "x columns")
        npy = self.save("t.npy", np.column_stack([self.x, self.y]))
        self.fails(self.args(train=npy, extra=["--y-col", "y"]), "--y-col", "column indices 0 to 1")
        self.fails(self.args(train=npy, extra=["--x-cols", "2"]), "--x-cols", "t.npy")

    def test_bad_data_files(self):
        self.fails(self.args(train=self.path("missing.csv")), "--train", "missing.csv",
                   "cannot open")
        table = np.column_stack([self.x, self.y])
        table[4, 1] = np.nan
        self.fails(self.args(train=self.save("nan.npy", table)), "nan.npy", "row 4, column 1",
                   "finite")
        self.fails(self.args(train=self.save("flat.npy", self.x)), "flat.npy", "shape [20]")
        self.fails(self.args(train=self.save("int.npy", np.ones((3, 2), np.int64))), "int64")
        constant = self.write_csv("c.csv", ["x", "y"], [np.ones(20), self.y])
        self.fails(self.args(train=constant, bandwidth="silverman"), "silverman")

    def test_bad_grid(self):
        for grid, piece in (("0:5", "start:stop:step"), ("0:5:0", "step must be > 0"),
                            ("0:5:-1", "step must be > 0"), ("5:0:1", "no points"),
                            ("0:1e9:1", "at most 1e8"), ("a:5:1", '"a" is not'),
                            ("0:5:0.1:1", "three numbers"), ("0:nan:1", "not a finite")):
            self.fails(self.args(query=("--grid", grid)), "--grid", piece)
        multi = self.write_csv("m.csv", ["a", "b", "y"], [self.x, self.x ** 2, self.y])
        self.fails(self.args(train=multi), "--grid", "2 x columns (a, b)")

    def test_bad_bandwidth(self):
        for text in ("abc", "0", "-1", "1,,2", "nan", "inf", "1e999", "", "Scott"):
            self.fails(self.args(bandwidth=text), "--bandwidth")
        multi = self.write_csv("m.csv", ["a", "b", "y"], [self.x, self.x ** 2, self.y])
        query = self.write_csv("q.csv", ["a", "b"], [self.x[:3], self.x[:3]])
        self.fails(self.args(train=multi, query=("--query", query), bandwidth="1,2,3"),
                   "--bandwidth has 3 values", "2 x columns (a, b)")
        self.fails(self.args(bandwidth="1,2"), "--bandwidth has 2 values", "1 x column")

    def test_learn_options(self):
        for kernel in ("boxcar", "epanechnikov", "triangular"):
            self.fails(self.args(bandwidth="learn", kernel=kernel), "learn", kernel)
        for epochs in ("0", "-2"):
            self.fails(self.args(bandwidth="learn", extra=["--epochs", epochs]),
                       "--epochs must be >= 1")
        self.fails(self.args(bandwidth="learn", extra=["--epochs", "x"]), "--epochs")
        self.fails(self.args(bandwidth="learn", extra=["--lr", "0"]), "--lr")
        self.fails(self.args(bandwidth="scott", extra=["--epochs", "3"]),
                   "--epochs is for --bandwidth learn")
        self.fails(self.args(extra=["--seed", "1", "--lr", "0.1"]), "--lr and --seed")

    def test_queries(self):
        multi = self.write_csv("m.csv", ["a", "b", "y"], [self.x, self.x ** 2, self.y])
        wide = self.save("q3.npy", np.zeros((4, 3)))
        self.fails(self.args(train=multi, query=("--query", wide)), "--query", "q3.npy",
                   "shape [4, 3]", "2 x columns")
        self.fails(self.args(train=multi, query=("--query", self.save("q1.npy", np.zeros(4)))),
                   "shape [4]")
        self.fails(self.args(query=("--query", self.save("q2.npy", np.zeros((4, 2))))),
                   "shape [4, 2]", "1 x column")
        self.fails(self.args(query=("--query", self.save("qn.npy", np.array([0.0, np.nan])))),
                   "qn.npy", "row 1", "finite")
        missing = self.write_csv("qm.csv", ["b"], [self.x[:3]])
        self.fails(self.args(train=multi, query=("--query", missing)),
                   'has no column "a"', "(columns: b)")
        self.fails(self.args(query=("--query", self.write_csv("qb.csv", ["x"], None,
                                                                 text="x\n1\nfoo\n"))),
                   "qb.csv: line 3, column 1", '"foo" is not a number')
        self.fails(self.args(query=()), "--query FILE or --grid")
        self.fails(self.args(query=("--grid", "0:1:0.5", "--query", missing)), "alternatives")
        self.fails(self.args(query=("--query", self.path("nope.csv"))), "nope.csv", "cannot open")

    def test_options_and_outputs(self):
        self.fails(self.args(kernel="cosine"), "--kernel")
        self.fails(["regress", "--train", self.train, "--grid", "0:1:1", "--kernel", "gaussian",
                    "--bandwidth", "1"], "--out")
        same = self.args()
        same[same.index("--weights") + 1] = self.out
        self.fails(same, "--out and --weights name the same file")
        nowhere = self.path("no/dir/w.npy")
        args = self.args()
        args[args.index("--weights") + 1] = nowhere
        self.expect_error("regress", args, [self.out, nowhere], [nowhere])


# ---- --plot: the fit drawn -----------------------------------------------------------------

def png_pixels(data):
    """A PNG's (height, width, 3) RGB pixels, decoded here (zlib and the five
    scanline filters of the PNG spec), every chunk's CRC checked: 8-bit RGB or
    RGBA, not interlaced, as gnuplot's pngcairo writes them."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    pos, chunks = 8, []
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        crc, = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind}"
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b""), [c[0] for c in chunks]
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert depth == 8 and colour in (2, 6) and interlace == 0, (depth, colour, interlace)
    channels = 3 if colour == 2 else 4
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = width * channels
    rows, previous = [], np.zeros(stride, np.int64)
    for r in range(height):
        line = raw[r * (stride + 1):(r + 1) * (stride + 1)]
        kind, cur = line[0], np.frombuffer(line[1:], np.uint8).astype(np.int64)
        out = np.zeros(stride, np.int64)
        for i in range(stride):
            a = out[i - channels] if i >= channels else 0
            b, c = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 0:
                pred = 0
            elif kind == 1:
                pred = a
            elif kind == 2:
                pred = b
            elif kind == 3:
                pred = (a + b) // 2
            else:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
            out[i] = (cur[i] + pred) % 256
        rows.append(out)
        previous = out
    return np.array(rows).reshape(height, width, channels)[:, :, :3]


class PlotTest(RegressTest):
    def setUp(self):
        super().setUp()
        self.x, self.y = chapter_data(self.rng, n=40)
        self.train = self.write_csv("train.csv", ["x", "y"], [self.x, self.y])
        self.out, self.fig = self.path("pred.csv"), self.path("fit.png")

    def test_png_of_the_points_and_the_fitted_curve(self):
        self.regress("--train", self.train, "--grid", "0:5:0.05", "--kernel", "gaussian",
                     "--bandwidth", "0.5", "--out", self.out, "--plot", self.fig, "--json")
        with open(self.fig, "rb") as f:
            pixels = png_pixels(f.read())
        self.assertEqual(pixels.shape, (400, 600, 3))  # 6 x 4 in at 100 pixels per inch
        colours = pixels.reshape(-1, 3)
        # The curve in magenta (#bf00bf) and the data as orange dots
        # (#ff7f0e at alpha 0.5 over white, about (255, 191, 134)).
        curve = np.all(np.abs(colours - [191, 0, 191]) <= 40, axis=1).sum()
        dots = np.all(np.abs(colours - [255, 191, 134]) <= 40, axis=1).sum()
        self.assertGreater(curve, 400, "the fitted curve spans the plot")
        self.assertGreater(dots, 40 * 5, "every training point is drawn")
        # The legend names the fit (an SVG's text can be read back).
        svg = self.path("fit.svg")
        self.regress("--train", self.train, "--grid", "0:5:0.05", "--kernel", "gaussian",
                     "--bandwidth", "0.5", "--out", self.out, "--plot", svg, "--json")
        with open(svg, encoding="utf-8") as f:
            text = f.read()
        self.assertIn("Nadaraya-Watson, gaussian, h = 0.5", text)
        self.assertEqual(xml.dom.minidom.parseString(text).documentElement.tagName, "svg")

    def test_queries_in_any_order_and_an_existing_figure_replaced(self):
        q = self.rng.permutation(np.linspace(0, 5, 30))
        query = self.write_csv("q.csv", ["x"], [q])
        with open(self.fig, "wb") as f:
            f.write(b"old")
        self.regress("--train", self.train, "--query", query, "--kernel", "gaussian",
                     "--bandwidth", "cv", "--out", self.out, "--plot", self.fig, "--json")
        with open(self.fig, "rb") as f:
            self.assertEqual(png_pixels(f.read()).shape, (400, 600, 3))

    def test_errors_write_nothing(self):
        base = ["regress", "--train", self.train, "--grid", "0:5:0.5", "--kernel", "gaussian",
                "--bandwidth", "1", "--out", self.out]
        outputs = [self.out, self.fig]
        self.expect_error("regress", base + ["--plot", self.path("fit.jpg")],
                          [self.out, self.path("fit.jpg")],
                          ['--plot ' + self.path("fit.jpg") + ' has extension ".jpg"; expected '
                           '.png, .svg or .pdf'])
        same = list(base)
        same[same.index(self.out)] = self.fig
        self.expect_error("regress", same + ["--plot", self.fig], [self.fig],
                          ["--out and --plot name the same file"])
        self.expect_error("regress", base + ["--plot", self.path("no/dir/fit.png")], [self.out],
                          [self.path("no/dir/fit.png")])
        two = self.write_csv("two.csv", ["a", "b", "y"], [self.x, self.x, self.y])
        args = list(base)
        args[args.index(self.train)] = two
        args[args.index("--grid"):args.index("--grid") + 2] = ["--query", two]
        self.expect_error("regress", args + ["--plot", self.fig], outputs,
                          ["--plot draws y against one x column; there are 2 x columns (a, b)"])
        # No prediction defined (a compact kernel, queries out of every key's reach).
        far = list(base)
        far[far.index("0:5:0.5")] = "100:101:0.5"
        far[far.index("gaussian")] = "boxcar"
        self.expect_error("regress", far + ["--plot", self.fig], outputs,
                          ["--plot " + self.fig + ": every prediction is undefined"])

    def test_missing_or_failing_gnuplot_writes_nothing(self):
        args = ["--train", self.train, "--grid", "0:5:0.5", "--kernel", "gaussian",
                "--bandwidth", "1", "--out", self.out, "--plot", self.fig]
        empty = self.path("empty")
        os.mkdir(empty)
        r = test_cli.run("regress", *args, env=dict(os.environ, PATH=empty))
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertEqual(r.stderr, "qkv regress: error: gnuplot_path: gnuplot not found: "
                                   "install Debian package gnuplot-nox\n")
        # A gnuplot that stops half-way: no figure, and no --out either (all or none).
        fake = self.path("bin")
        os.mkdir(fake)
        with open(os.path.join(fake, "gnuplot"), "w") as f:
            f.write("#!/bin/sh\ncat >/dev/null\nprintf '\\211PNG\\r\\n\\032\\n'\n")
        os.chmod(os.path.join(fake, "gnuplot"), 0o755)
        with open(self.out, "w") as f:
            f.write("mine")
        r = test_cli.run("regress", *args, env=dict(os.environ, PATH=fake + ":/usr/bin:/bin"))
        self.assertNotEqual(r.returncode, 0, r.stderr)
        self.assertIn("qkv regress: error: ", r.stderr)
        self.assertIn("incomplete", r.stderr)
        self.assertFalse(os.path.exists(self.fig))
        with open(self.out) as f:
            self.assertEqual(f.read(), "mine")
        self.assertEqual(sorted(os.listdir(self.dir)), ["bin", "empty", "pred.csv", "train.csv"])


# ---- --bandwidth cv on many points: progress and the warning --------------------------------

class CvProgressTest(RegressTest):
    def data(self, n):
        x = self.rng.uniform(0, 5, n)
        y = np.sin(x) + self.rng.normal(0, 0.3, n)
        return self.save(f"train{n}.npy", np.column_stack([x, y]))

    def test_a_bar_with_the_time_left_on_a_terminal_and_the_same_result(self):
        train = self.data(1500)
        args = ["regress", "--train", train, "--grid", "0:5:1", "--kernel", "gaussian",
                "--bandwidth", "cv", "--out", self.path("pred.csv"), "--json"]
        status, out, shown = test_cli.run_on_a_terminal(*args)
        self.assertEqual(status, 0, shown)
        self.assertRegex(shown, r"qkv regress: cv: \[[#.]{30}\] +\d+% of \d+ points, \d+ points/s, "
                                r"[0-9a-z ]+ left")
        self.assertIn("qkv regress: cv: done, ", shown)
        on_a_terminal = json.loads(out)
        # Not a terminal (a line every 5 s: none with --quiet): the same bandwidth.
        _, piped = self.regress(*args[1:], "--quiet")
        self.assertEqual(piped["bandwidth"], on_a_terminal["bandwidth"])
        self.assertEqual(piped["loo_error"], on_a_terminal["loo_error"])
        # --quiet: no bar.
        status, _, shown = test_cli.run_on_a_terminal(*args, "--quiet")
        self.assertEqual(status, 0, shown)
        self.assertNotIn("qkv regress: cv", shown)

    def test_a_warning_with_the_estimate_before_a_long_run(self):
        train = self.data(40000)
        proc = subprocess.Popen([test_cli.QKV, "regress", "--train", train, "--grid", "0:5:1",
                                 "--kernel", "gaussian", "--bandwidth", "cv", "--out",
                                 self.path("pred.csv"), "--quiet"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stderr.readline()
        finally:
            proc.terminate()
            proc.communicate(timeout=60)
        self.assertRegex(line, r"^qkv regress: warning: --bandwidth cv on n = 40000 points "
                               r"evaluates the leave-one-out error about \d+ times, "
                               r"n\^2 = 1.6e\+09 kernel evaluations each: about [0-9a-z ]+ "
                               r"on \d+ threads? "
                               r"\(estimated\)\. A rule of thumb takes milliseconds: "
                               r"--bandwidth scott or silverman; --bandwidth cv-fast minimises "
                               r"the same error through the fast 1-D path in seconds$")
        self.assertFalse(os.path.exists(self.path("pred.csv")))
        # A short run warns of nothing (above: nothing on stderr with --json).

    def test_cv_fast_finds_cvs_bandwidth(self):
        train = self.data(1500)
        out = self.path("pred.csv")
        args = ["--train", train, "--grid", "0:5:0.5", "--kernel", "gaussian", "--out", out,
                "--json", "--quiet"]  # no progress lines: cv may pass 5 s on a busy machine
        _, exact = self.regress(*args, "--bandwidth", "cv")
        _, fast = self.regress(*args, "--bandwidth", "cv-fast")
        self.assertEqual(fast["bandwidth_rule"], "cv-fast")
        self.assertAlmostEqual(fast["bandwidth"][0], exact["bandwidth"][0],
                               delta=2e-3 * exact["bandwidth"][0])
        self.assertLessEqual(fast["loo_error"], exact["loo_error"] * (1 + 1e-7))
        _, got = self.read_predictions(out)
        data = np.load(train)
        ref = np_predict(data[:, 0], data[:, 1], np.arange(0, 5, 0.5), fast["bandwidth"][0])
        np.testing.assert_allclose(got[:, 1], ref, rtol=1e-10, atol=1e-12)
        # Only where the fast path applies: exit 2 otherwise, nothing written.
        os.remove(out)
        boxcar = ["regress", "--train", train, "--grid", "0:5:0.5", "--kernel", "boxcar",
                  "--bandwidth", "cv-fast", "--out", out]
        self.expect_error("regress", boxcar, [out],
                          ["--bandwidth cv-fast is cv through the fast 1-D Gaussian path; "
                           "--kernel boxcar has none (use --bandwidth cv)"])
        two = self.save("two.npy", np.column_stack([data[:, 0], data[:, 0] ** 2, data[:, 1]]))
        query = self.save("q.npy", data[:5, :2])
        self.expect_error("regress", ["regress", "--train", two, "--query", query, "--kernel",
                                      "gaussian", "--bandwidth", "cv-fast", "--out", out], [out],
                          ["--bandwidth cv-fast is cv through the fast 1-D Gaussian path; there "
                           "are 2 x columns (x0, x1): use --bandwidth cv"])


if __name__ == "__main__":
    test_cli.main()
