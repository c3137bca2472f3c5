#!/usr/bin/python3
"""Tests of `qkv index` (build, update, info, verify) and `qkv attend --store S
--index I` through the command line: the index's files read back with NumPy
(its rows are the store's, grouped by list), attention through it against
attention over the whole store (--epsilon 0 equal to it, --epsilon E within
the certificate's bound, --probe P with its summary line; shard stores each
through its index, merged), bad options named
with exit 2, an index over another store or a stale one refused, damage
named by verify, updates with appended rows (each in its nearest list), and
signals during a build or an update leaving nothing behind but the old index
or the new one. The
harness (running qkv, temporary directories, expect_error) is test_cli.py's.

Usage: test_index.py --qkv PATH [unittest arguments, e.g. a TestCase name]
NumPy is required: if it cannot be imported this script fails.
"""

import json
import os
import re
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_cli  # noqa: E402  (the harness; its QKV is set in main())

# The line `qkv attend --index` prints on stderr (unless --quiet).
SUMMARY = re.compile(
    r"^qkv attend --index: certificate: max (\S+) \((epsilon \S+|probe \d+)\); "
    r"visited ([\d.,]+) of ([\d,]+) lists, ([\d.,]+) of ([\d,]+) rows per query on average"
    r"(; top \d+ certain for \d+ of \d+ queries)?\n$")


def number(text):
    return float(text.replace(",", ""))


class IndexCase(test_cli.CliTest):
    def clustered(self, n, d, dv, clusters=20, spread=0.5, apart=3.0):
        """Keys around `clusters` random centres (normal times `apart`),
        values normal; and queries near the centres, where a few lists hold
        most of the weight."""
        centres = self.rng.normal(size=(clusters, d)) * apart
        k = (centres[self.rng.integers(0, clusters, n)] +
             self.rng.normal(size=(n, d)) * spread).astype(np.float32)
        v = self.rng.normal(size=(n, dv)).astype(np.float32)
        q = (centres[self.rng.integers(0, clusters, 12)] +
             self.rng.normal(size=(12, d)) * spread).astype(np.float32)
        return k, v, q

    def create(self, name, keys, values, *extra):
        store = self.path(name)
        self.ok("store", "create", store, "--keys", self.save(name + "-k.npy", keys),
                "--values", self.save(name + "-v.npy", values), "--quiet", *extra)
        return store

    def build(self, store, name, *extra):
        index = self.path(name)
        return index, json.loads(self.ok("index", "build", store, "--out", index, "--json",
                                         "--quiet", *extra).stdout)

    def info(self, index):
        return json.loads(self.ok("index", "info", index, "--json").stdout)

    def attend(self, store, queries, *extra, index=None, name="x"):
        """attend --store (and --index): its outputs and its stderr."""
        paths = {part: self.path(f"{name}-{part}.npy") for part in ("o", "lse", "c")}
        args = ["attend", "--store", store, "--queries", queries, "--out", paths["o"],
                "--lse", paths["lse"], *extra]
        if index is not None:
            args += ["--index", index, "--certificate", paths["c"]]
        r = test_cli.run(*args)
        self.assertEqual(r.returncode, 0, f"qkv {' '.join(map(str, args))}\n{r.stderr}")
        out = {part: np.load(p) for part, p in paths.items() if os.path.exists(p)}
        for p in paths.values():
            if os.path.exists(p):
                os.remove(p)
        return out, r.stderr


class BuildTest(IndexCase):
    def test_the_index_holds_the_stores_rows_by_list(self):
        n, d, dv = 3000, 8, 4
        k, v, _ = self.clustered(n, d, dv)
        store = self.create("s", k, v, "--chunk-rows", 700)
        index, summary = self.build(store, "i")
        self.assertEqual((summary["rows"], summary["key_dim"], summary["value_dim"]), (n, d, dv))
        self.assertEqual(summary["dtype"], "float32")
        self.assertEqual(summary["lists"], round(4 * np.sqrt(n)))  # the default
        self.assertGreaterEqual(summary["seconds"], 0)
        info = self.info(index)
        self.assertEqual(info, {key: value for key, value in summary.items() if key != "seconds"})

        # The files as docs say: the rows in list order, each row's store id.
        load = lambda name: np.load(os.path.join(index, name))
        list_rows, radii, ids = load("list_rows.npy"), load("radii.npy"), load("ids.npy")
        centroids, keys, values = load("centroids.npy"), load("keys.npy"), load("values.npy")
        self.assertEqual(list_rows.sum(), n)
        np.testing.assert_array_equal(np.sort(ids), np.arange(n))
        np.testing.assert_array_equal(keys, k[ids])
        np.testing.assert_array_equal(values, v[ids])
        self.assertEqual(centroids.shape, (summary["lists"], d))
        self.assertEqual(info["list_rows_min"], list_rows.min())
        self.assertEqual(info["list_rows_max"], list_rows.max())
        self.assertEqual(info["list_rows_median"], np.median(list_rows))
        nonempty = list_rows > 0
        self.assertAlmostEqual(info["radius_min"], radii[nonempty].min())
        self.assertAlmostEqual(info["radius_max"], radii[nonempty].max())
        starts = np.concatenate([[0], np.cumsum(list_rows)])
        for j in range(len(list_rows)):
            rows = keys[starts[j]:starts[j + 1]].astype(np.float64)
            if len(rows):  # every key within its list's radius of its centroid
                self.assertLessEqual(np.linalg.norm(rows - centroids[j], axis=1).max(), radii[j])
            self.assertTrue((np.diff(ids[starts[j]:starts[j + 1]]) > 0).all())  # store order

        text = self.ok("index", "info", index).stdout
        for fragment in (index, f"{n} rows", f"D = {d}", f"Dv = {dv}", "float32",
                         f"{summary['lists']} lists of {list_rows.min()} to {list_rows.max()} rows",
                         "radii"):
            self.assertIn(fragment, text)
        r = self.ok("index", "verify", index)
        self.assertTrue(r.stdout.startswith(index + ": ok"), r.stdout)
        self.assertEqual(json.loads(self.ok("index", "verify", index, "--json").stdout),
                         {"index": index, "ok": True, "rows": n, "lists": summary["lists"]})

    def test_options_and_the_same_seed_give_the_same_index(self):
        k, v, _ = self.clustered(1000, 5, 3)
        store = self.create("s", k, v, "--dtype", "bfloat16")
        built = []
        for name in ("a", "b"):
            index, summary = self.build(store, name, "--lists", 17, "--iterations", 3, "--seed", 7)
            self.assertEqual((summary["lists"], summary["dtype"]), (17, "bfloat16"))
            built.append(index)
        for name in sorted(os.listdir(built[0])):
            with open(os.path.join(built[0], name), "rb") as a, \
                    open(os.path.join(built[1], name), "rb") as b:
                self.assertEqual(a.read(), b.read(), name)
        text = self.ok("index", "build", store, "--out", self.path("t"), "--lists", 1).stdout
        for fragment in (self.path("t"), "1000 rows", "bfloat16", "1 list of 1000 to 1000 rows",
                         "built in"):
            self.assertIn(fragment, text)

    def test_progress_on_a_terminal_and_quiet(self):
        k, v, _ = self.clustered(20000, 16, 8)
        store = self.create("s", k, v)
        for quiet in (False, True):
            status, out, text = test_cli.run_on_a_terminal(
                "index", "build", store, "--out", self.path(f"i{quiet}"),
                *(["--quiet"] if quiet else []))
            self.assertEqual(status, 0, text)
            self.assertIn(b"rows", out)
            if quiet:
                self.assertEqual(text, "")
            else:
                for fragment in ("qkv index build: [", "100%", "/s", "done"):
                    self.assertIn(fragment, text)

    def test_help(self):
        for args, options in ((["index", "build"], ["STORE", "--out", "--lists", "--iterations",
                                                     "--seed", "--threads", "--json", "--quiet"]),
                              (["index", "info"], ["INDEX", "--json"]),
                              (["index", "verify"], ["INDEX", "--json"]),
                              (["attend"], ["--index", "--epsilon", "--probe", "--certificate"])):
            r = self.ok(*args, "--help")
            for option in options:
                self.assertIn(option, r.stdout, " ".join(args))
        self.assertIn("index", self.ok("--help").stdout)
        r = test_cli.run("index", "biuld")
        self.assertEqual(r.returncode, 2)
        self.assertIn("qkv index: error: unknown command biuld; did you mean build?", r.stderr)

    def test_errors(self):
        k, v, _ = self.clustered(300, 4, 2)
        store = self.create("s", k, v)
        index, _ = self.build(store, "i")
        with open(self.save("f.npy", k), "rb") as f:
            file_bytes = f.read()

        def refused(args, fragments):
            before = sorted(os.listdir(self.dir)), sorted(os.listdir(store))
            self.expect_error("index", args, [], fragments)
            self.assertEqual((sorted(os.listdir(self.dir)), sorted(os.listdir(store))), before)

        new = self.path("new")
        build = ["index", "build", store, "--out"]
        # --out must be new: an index, a file, a link (even a dangling one).
        refused(build + [index], ["--out " + index, "already exists"])
        refused(build + [self.path("f.npy")], ["--out " + self.path("f.npy"), "already exists"])
        with open(self.path("f.npy"), "rb") as f:
            self.assertEqual(f.read(), file_bytes)
        os.symlink(self.path("nowhere"), self.path("link"))
        refused(build + [self.path("link")], ["already exists"])
        refused(build + [self.path("missing/i")], ["--out", "missing", "does not exist"])
        # ... and outside the store, however spelled.
        for inside in (os.path.join(store, "i"), os.path.join(store, "..", "s", "i")):
            refused(build + [inside], ["--out " + inside, "is inside STORE " + store])
        for lists in (0, -1, 301):
            refused(build + [new, "--lists", lists], [f"--lists {lists}", "300"])
        refused(build + [new, "--lists", "2.5"], ["--lists", "2.5"])
        for iterations in (-1, 1001):
            refused(build + [new, "--iterations", iterations], ["--iterations", str(iterations)])
        refused(build + [new, "--seed", -1], ["--seed", "-1"])
        refused(["index", "build", self.path("nothing"), "--out", new], ["nothing"])
        refused(["index", "build", store], ["--out"])
        refused(["index", "info", self.path("nothing")], ["nothing"])
        refused(["index", "info", store], ["manifest.json"])  # a store is not an index
        refused(["index", "verify", self.path("f.npy")], ["not an index"])
        refused(["index"], ["subcommand"])
        self.assertFalse(os.path.exists(new))
        self.ok("index", "verify", index)


class DamageTest(IndexCase):
    def test_damage_is_named(self):
        k, v, q = self.clustered(500, 6, 3)
        store = self.create("s", k, v)
        index, _ = self.build(store, "i")
        keys = os.path.join(index, "keys.npy")
        with open(keys, "rb") as f:
            data = bytearray(f.read())
        data[-1 - int(self.rng.integers(0, 500 * 6 * 4))] ^= 0x20  # one byte of the keys
        with open(keys, "wb") as f:
            f.write(data)
        self.expect_error("index", ["index", "verify", index], [], [keys, "checksum", "altered"])
        self.ok("index", "info", index)  # sizes and headers are whole
        os.truncate(keys, len(data) - 4)
        self.expect_error("index", ["index", "verify", index], [], [keys])
        self.expect_error("index", ["index", "info", index], [], [keys])
        out = self.path("o.npy")
        self.expect_error("attend", ["attend", "--store", store, "--index", index, "--queries",
                                     self.save("q.npy", q), "--out", out], [out], [keys])
        with open(os.path.join(index, "manifest.json"), "w") as f:
            f.write("{not json")
        self.expect_error("index", ["index", "verify", index], [], ["manifest.json", "not valid JSON"])


class AttendIndexTest(IndexCase):
    def setUp(self):
        super().setUp()
        self.k, self.v, self.queries = self.clustered(3000, 8, 4)
        self.q = self.save("q.npy", self.queries)
        self.store = self.create("s", self.k, self.v, "--chunk-rows", 1000)
        self.index, self.built = self.build(self.store, "i")

    def summary(self, stderr):
        match = SUMMARY.match(stderr)
        self.assertIsNotNone(match, stderr)
        lists, rows = number(match[3]), number(match[5])
        self.assertEqual(number(match[4]), self.built["lists"])
        self.assertEqual(number(match[6]), 3000)
        self.assertTrue(1 <= lists <= self.built["lists"] and 1 <= rows <= 3000, stderr)
        return float(match[1]), match[2], lists, rows

    def test_epsilon_0_is_attention_over_the_store(self):
        """Both compute each score in float32 (the store's kernel by blocks,
        the index's row by row), so they differ by the scores' rounding:
        centres closer together than setUp's keep the scores within about
        +-10, where that is within the tolerance by a factor of 3 (at
        --scale 0.7 with setUp's data, scores up to 50, it was not)."""
        k, v, q = self.clustered(3000, 8, 4, apart=1.5)
        store = self.create("near", k, v, "--chunk-rows", 1000)
        index, _ = self.build(store, "near-i")
        self.built = self.info(index)
        queries = self.save("near-q.npy", q)
        for scoring in ([], ["--scale", 0.2], ["--scoring", "distance", "--bandwidth", 1.5]):
            exact, _ = self.attend(store, queries, *scoring, name="exact")
            got, stderr = self.attend(store, queries, *scoring, "--epsilon", 0, index=index)
            np.testing.assert_allclose(got["o"], exact["o"], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got["lse"], exact["lse"], rtol=1e-5, atol=1e-6)
            self.assertEqual((got["c"].dtype, got["c"].shape), (np.float64, (12,)))
            self.assertTrue((got["c"] == 0).all(), got["c"])
            largest, mode, lists, rows = self.summary(stderr)
            self.assertEqual((largest, mode), (0.0, "epsilon 0.0e+00"))
            self.assertEqual(rows, 3000)

    def test_epsilon_bounds_the_error_by_the_certificate(self):
        exact, _ = self.attend(self.store, self.q, name="exact")
        for epsilon in ([], ["--epsilon", "1e-3"], ["--epsilon", "0.05"]):
            got, stderr = self.attend(self.store, self.q, *epsilon, index=self.index)
            bound = float(epsilon[1]) if epsilon else 1e-3  # the default
            c = got["c"]
            self.assertTrue((c >= 0).all() and (c <= bound).all(), c)
            error = np.linalg.norm(got["o"].astype(np.float64) - exact["o"], axis=1)
            allowed = 2 * c * np.linalg.norm(self.v, axis=1).max() + 1e-5
            self.assertTrue((error <= allowed).all(), (error, allowed))
            # The lse over the visited rows: at most the true one, by log(1 + c).
            self.assertTrue((got["lse"] <= exact["lse"] + 1e-5).all())
            self.assertTrue((exact["lse"] <= got["lse"] + np.log1p(c) + 1e-5).all())
            largest, mode, lists, rows = self.summary(stderr)
            self.assertEqual(mode, f"epsilon {bound:.1e}")
            self.assertAlmostEqual(largest, c.max(), delta=0.051 * c.max() + 1e-300)
            self.assertLess(rows, 3000, "clustered queries need a fraction of the rows")
        # With --top-k the visit goes on until the top rows are certain: the
        # rows of the largest scores over the whole store (float64 here; a
        # near tie may come in either order).
        got, stderr = self.attend(self.store, self.q, "--top-k", 5, "--top-ids",
                                  self.path("ids.npy"), "--top-weights", self.path("tw.npy"),
                                  index=self.index)
        self.assertIn("; top 5 certain for 12 of 12 queries", stderr)
        ids, tw = np.load(self.path("ids.npy")), np.load(self.path("tw.npy"))
        self.assertEqual((ids.dtype, ids.shape, tw.dtype, tw.shape),
                         (np.int64, (12, 5), np.float32, (12, 5)))
        scores = self.queries.astype(np.float64) @ self.k.astype(np.float64).T / np.sqrt(8)
        for i in range(12):
            np.testing.assert_allclose(scores[i, ids[i]], np.sort(scores[i])[::-1][:5],
                                       rtol=0, atol=1e-5)
        self.assertTrue((np.diff(tw, axis=1) <= 0).all())

    def test_probe_visits_that_many_lists(self):
        for probe in (1, 3):
            got, stderr = self.attend(self.store, self.q, "--probe", probe, index=self.index)
            largest, mode, lists, rows = self.summary(stderr)
            self.assertEqual(mode, f"probe {probe}")
            self.assertEqual(lists, probe)
            self.assertEqual(got["o"].shape, (12, 4))
            self.assertAlmostEqual(largest, got["c"].max(), delta=0.051 * got["c"].max())
        # A budget beyond the lists visits them all: exact.
        got, stderr = self.attend(self.store, self.q, "--probe", 100000, index=self.index)
        self.assertTrue((got["c"] == 0).all())
        self.assertEqual(self.summary(stderr)[3], 3000)

    def test_quiet_prints_nothing(self):
        got, stderr = self.attend(self.store, self.q, "--quiet", index=self.index)
        self.assertEqual(stderr, "")
        self.assertEqual(got["c"].shape, (12,))

    def test_progress_on_a_terminal(self):
        q = self.save("q200.npy", np.repeat(self.queries, 20, axis=0))
        for quiet in (False, True):
            status, _, text = test_cli.run_on_a_terminal(
                "attend", "--store", self.store, "--index", self.index, "--queries", q, "--out",
                self.path("o.npy"), *(["--quiet"] if quiet else []))
            self.assertEqual(status, 0, text)
            if quiet:
                self.assertEqual(text, "")
            else:
                for fragment in ("qkv attend --index: [", "100%", "240 queries", "/s", "done",
                                 "certificate: max"):
                    self.assertIn(fragment, text)

    def test_bfloat16(self):
        store = self.create("b", self.k, self.v, "--dtype", "bfloat16", "--chunk-rows", 1000)
        index, summary = self.build(store, "bi")
        self.assertEqual(summary["dtype"], "bfloat16")
        exact, _ = self.attend(store, self.q, name="exact")
        got, _ = self.attend(store, self.q, "--epsilon", 0, index=index)
        # where the CPU has AVX-512 BF16 the store's kernel rounds the weights
        # to bf16 for P V (2^-8 relative; test_store's bound).
        np.testing.assert_allclose(got["o"], exact["o"], rtol=0,
                                   atol=2**-8 * np.abs(self.v).max() + 1e-5)

    def test_compact_kernels_are_exact_and_read_the_lists_in_reach(self):
        """--kernel K --bandwidth H: Nadaraya-Watson's product kernel with a
        compact profile over every row (float64 here), computed through the
        lists whose ball meets each query's box; no row in reach: 0."""
        q = np.concatenate([self.queries, np.full((1, 8), 50.0, np.float32)])
        queries = self.save("qk.npy", q)
        k = self.k.astype(np.float64)
        profiles = {"boxcar": lambda u: np.ones_like(u), "epanechnikov": lambda u: 1 - u * u,
                    "triangular": lambda u: 1 - np.abs(u)}
        for kernel, profile in profiles.items():
            for h in (0.4, 1.5):
                got, stderr = self.attend(self.store, queries, "--kernel", kernel,
                                          "--bandwidth", h, index=self.index)
                u = (q.astype(np.float64)[:, None, :] - k[None, :, :]) / h
                w = np.where(np.abs(u) <= 1, profile(u), 0).prod(axis=2)
                total = w.sum(axis=1)
                reach = total > 0
                want = (w @ self.v.astype(np.float64))[reach] / total[reach, None]
                np.testing.assert_allclose(got["o"][reach], want, rtol=1e-5, atol=1e-6)
                self.assertTrue((got["o"][~reach] == 0).all() and (~reach[-1:]).all())
                np.testing.assert_allclose(got["lse"][reach], np.log(total[reach]), rtol=1e-5,
                                           atol=1e-6)
                self.assertTrue(np.isneginf(got["lse"][~reach]).all())
                self.assertTrue((got["c"] == 0).all())
                self.assertRegex(stderr, rf"^qkv attend --index: {kernel} kernel of width "
                                         rf"{h:g}, exact; visited ")
                if h == 0.4:
                    rows = number(re.search(r"lists, ([\d.,]+) of", stderr)[1])
                    self.assertLess(rows, 3000 / 4, stderr)

    def test_kernel_errors(self):
        out = self.path("o.npy")
        base = ["attend", "--store", self.store, "--index", self.index, "--queries", self.q,
                "--out", out]
        self.expect_error("attend", ["attend", "--store", self.store, "--queries", self.q,
                                     "--out", out, "--kernel", "boxcar", "--bandwidth", 1],
                          [out], ["--kernel boxcar is for attention through --index"])
        self.expect_error("attend", base + ["--kernel", "gaussian", "--bandwidth", 1], [out],
                          ["--kernel gaussian is softmax attention", "--scoring distance"])
        self.expect_error("attend", base + ["--kernel", "boxcar"], [out],
                          ["--kernel boxcar needs --bandwidth H"])
        self.expect_error("attend", base + ["--kernel", "triangular", "--bandwidth", 0], [out],
                          ["--bandwidth 0", "finite number > 0"])
        for option, value in (("--epsilon", "1e-3"), ("--probe", 2), ("--scale", 2),
                              ("--scoring", "distance")):
            self.expect_error("attend", base + ["--kernel", "boxcar", "--bandwidth", 1, option,
                                                value], [out],
                              [f"{option} does not go with --kernel boxcar"])
        self.expect_error("attend", base + ["--kernel", "cosine", "--bandwidth", 1], [out],
                          ["--kernel", "cosine"])

    def test_errors(self):
        out, cert = self.path("o.npy"), self.path("c.npy")
        base = ["attend", "--store", self.store, "--index", self.index, "--queries", self.q,
                "--out", out]
        for epsilon in ("-1", "nan", "inf", "-inf"):
            self.expect_error("attend", base + ["--epsilon", epsilon], [out],
                              [f"--epsilon {epsilon}", "finite number >= 0"])
        for probe in (0, -3):
            self.expect_error("attend", base + ["--probe", probe], [out],
                              [f"--probe {probe}", ">= 1"])
        self.expect_error("attend", base + ["--probe", "1.5"], [out], ["--probe", "1.5"])
        self.expect_error("attend", base + ["--epsilon", "1e-3", "--probe", 2], [out],
                          ["--epsilon 0.001 and --probe 2", "give one"])
        no_index = ["attend", "--store", self.store, "--queries", self.q, "--out", out]
        for option, value in (("--epsilon", "1e-3"), ("--probe", 2), ("--certificate", cert)):
            self.expect_error("attend", no_index + [option, value], [out, cert],
                              [f"{option} is for attention through --index"])
        self.expect_error("attend", ["attend", "--index", self.index, "--queries", self.q,
                                     "--out", out], [out], ["--index", "needs --store"])
        other = self.create("other", self.k[:100], self.v[:100])
        self.expect_error("attend", base + ["--store", other], [out],
                          ["--index given 1 time and --store 2 times", "give each store's index"])
        self.expect_error("attend", base + ["--valid-lens", self.save("l.npy", np.int64(5))],
                          [out], ["--valid-lens does not go with --index"])
        # Outputs inside the index or the store, however spelled.
        for inside, input_option in ((os.path.join(self.index, "keys.npy"), "--index"),
                                     (os.path.join(self.index, "..", "i", "new.npy"), "--index"),
                                     (os.path.join(self.store, "c.npy"), "--store")):
            self.expect_error("attend", base + ["--certificate", inside], [],
                              ["--certificate " + inside, "is inside " + input_option])
        self.assertFalse(os.path.exists(os.path.join(self.index, "new.npy")))
        self.ok("index", "verify", self.index)
        # Queries of another D; two outputs naming one file.
        self.expect_error("attend", ["attend", "--store", self.store, "--index", self.index,
                                     "--queries", self.save("q5.npy", np.ones((2, 5), np.float32)),
                                     "--out", out], [out], ["[2, 5]", "D = 8"])
        self.expect_error("attend", base + ["--certificate", out], [out], ["--certificate"])

    def test_shard_stores_each_through_its_index(self):
        """--store S_0 --store S_1 --index I_0 --index I_1: each shard through
        its index, merged: attention over every row within the certificate's
        bound (epsilon 0: equal to it), ids counting through the shards."""
        k, v, _ = self.clustered(3000, 8, 4, apart=1.5)
        whole = self.create("whole", k, v, "--chunk-rows", 1000)
        stores, indexes = [], []
        for name, rows in (("a", slice(0, 1700)), ("b", slice(1700, 3000))):
            stores.append(self.create(name, k[rows], v[rows]))
            indexes.append(self.build(stores[-1], name + ".index")[0])
        lists = sum(self.info(i)["lists"] for i in indexes)
        # The helper adds --index I_1 (and --certificate) last.
        args = ["--store", stores[1], "--index", indexes[0]]
        ids = self.path("ids.npy")
        scores = self.queries.astype(np.float64) @ k.astype(np.float64).T / np.sqrt(8)
        exact, _ = self.attend(whole, self.q, name="exact")
        for epsilon in ("0", "1e-3"):
            got, stderr = self.attend(stores[0], self.q, *args, "--epsilon", epsilon, "--top-k", 3,
                                      "--top-ids", ids, index=indexes[1])
            c = got["c"]
            self.assertTrue((c >= 0).all() and (c <= float(epsilon)).all(), c)
            error = np.linalg.norm(got["o"].astype(np.float64) - exact["o"], axis=1)
            self.assertTrue((error <= 2 * c * np.linalg.norm(v, axis=1).max() + 1e-5).all(), error)
            self.assertTrue((exact["lse"] <= got["lse"] + np.log1p(c) + 1e-5).all())
            if epsilon == "0":
                np.testing.assert_allclose(got["o"], exact["o"], rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(got["lse"], exact["lse"], rtol=1e-5, atol=1e-6)
            match = SUMMARY.match(stderr)
            self.assertIsNotNone(match, stderr)
            self.assertEqual((number(match[4]), number(match[6])), (lists, 3000))
            self.assertEqual(match[7], "; top 3 certain for 12 of 12 queries")
            top = np.load(ids)
            for i in range(12):
                np.testing.assert_allclose(scores[i, top[i]], np.sort(scores[i])[::-1][:3],
                                           rtol=0, atol=1e-5)
        # The indexes in another order than the stores: refused.
        out = self.path("o.npy")
        self.expect_error("attend", ["attend", "--store", stores[0], "--store", stores[1],
                                     "--index", indexes[1], "--index", indexes[0],
                                     "--queries", self.q, "--out", out], [out],
                          ["StoreIndex::check_built_over", "index " + indexes[1],
                           "another store than store " + stores[0]])

    def test_an_index_of_another_store_or_a_stale_one_is_refused(self):
        out = self.path("o.npy")

        def refused(store, fragments):
            self.expect_error("attend", ["attend", "--store", store, "--index", self.index,
                                         "--queries", self.q, "--out", out], [out], fragments)

        # Other rows of the same shape; other dimensions; the same rows as bfloat16.
        k2, v2, _ = self.clustered(3000, 8, 4)
        refused(self.create("other", k2, v2, "--chunk-rows", 1000),
                ["StoreIndex::check_built_over", "index " + self.index, "another store",
                 "build it again"])
        refused(self.create("narrow", self.k[:, :4], self.v),
                ["index " + self.index, "D = 8", "D = 4"])
        refused(self.create("bf16", self.k, self.v, "--dtype", "bfloat16"),
                ["index " + self.index, "float32", "bfloat16"])
        # Rows appended after the build: stale.
        self.ok("store", "append", self.store, "--keys", self.save("ak.npy", k2[:10]),
                "--values", self.save("av.npy", v2[:10]), "--quiet")
        refused(self.store, ["index " + self.index, "3000 rows", "3010", "stale",
                             "qkv index update", "build it again"])
        # Built again, it is accepted.
        fresh, summary = self.build(self.store, "fresh")
        self.assertEqual(summary["rows"], 3010)
        got, _ = self.attend(self.store, self.q, "--quiet", index=fresh)
        self.assertEqual(got["o"].shape, (12, 4))


class UpdateTest(IndexCase):
    def test_appended_rows_join_their_nearest_lists(self):
        k, v, q = self.clustered(4000, 6, 3)
        store = self.create("s", k[:3000], v[:3000], "--chunk-rows", 700)
        index, built = self.build(store, "i")
        queries = self.save("q.npy", q)
        before = {name: np.load(os.path.join(index, name))
                  for name in ("centroids.npy", "list_rows.npy", "radii.npy", "ids.npy")}
        # Current: nothing to add, nothing written.
        inode = os.stat(index).st_ino
        r = self.ok("index", "update", index, "--store", store)
        self.assertRegex(r.stdout, r"^" + re.escape(index) + r": 3000 rows, .*; already current "
                         r"with the store\n$")
        self.assertEqual(os.stat(index).st_ino, inode)
        self.ok("store", "append", store, "--keys", self.save("ak.npy", k[3000:]),
                "--values", self.save("av.npy", v[3000:]), "--quiet")
        r = self.ok("index", "update", index, "--store", store, "--json", "--quiet")
        self.assertEqual(r.stderr, "")
        summary = json.loads(r.stdout)
        self.assertEqual((summary["rows"], summary["added_rows"], summary["lists"]),
                         (4000, 1000, built["lists"]))
        self.ok("index", "verify", index)
        self.assertEqual([f for f in os.listdir(self.dir) if f.startswith(".")], [])
        # The centroids as built; each list its old rows first, then its new
        # ones, which are nearest to it (NumPy, float64).
        centroids = np.load(os.path.join(index, "centroids.npy"))
        np.testing.assert_array_equal(centroids, before["centroids.npy"])
        rows = np.load(os.path.join(index, "list_rows.npy"))
        ids = np.load(os.path.join(index, "ids.npy"))
        keys = np.load(os.path.join(index, "keys.npy"))
        radii = np.load(os.path.join(index, "radii.npy"))
        np.testing.assert_array_equal(np.sort(ids), np.arange(4000))
        np.testing.assert_array_equal(keys, k[ids])
        self.assertTrue(np.all(rows >= before["list_rows.npy"]))
        self.assertTrue(np.all(radii >= before["radii.npy"]))
        old_starts = np.concatenate([[0], np.cumsum(before["list_rows.npy"])])
        starts = np.concatenate([[0], np.cumsum(rows)])
        c64 = centroids.astype(np.float64)
        for j in range(len(rows)):
            mine = ids[starts[j]:starts[j + 1]]
            old = before["ids.npy"][old_starts[j]:old_starts[j + 1]]
            np.testing.assert_array_equal(mine[:len(old)], old)
            new = mine[len(old):]
            self.assertTrue(np.all(new >= 3000))
            self.assertTrue(np.all(np.diff(mine) > 0))
            distances = np.linalg.norm(k[mine].astype(np.float64) - c64[j], axis=1)
            self.assertTrue(np.all(distances <= radii[j]))
            if len(new):
                all_distances = ((k[new].astype(np.float64)[:, None, :] - c64[None]) ** 2).sum(-1)
                own = all_distances[:, j]
                self.assertTrue(np.all(own <= all_distances.min(axis=1) * (1 + 1e-4) + 1e-5))
        # Attention through it: --epsilon 0 equals attention over the store.
        exact, _ = self.attend(store, queries, "--quiet", name="e")
        got, _ = self.attend(store, queries, "--epsilon", 0, "--quiet", index=index)
        np.testing.assert_allclose(got["o"], exact["o"], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got["c"], 0.0)

    def test_progress_on_a_terminal(self):
        k, v, _ = self.clustered(3000, 6, 3)
        store = self.create("s", k[:2000], v[:2000])
        index, _ = self.build(store, "i")
        self.ok("store", "append", store, "--keys", self.save("ak.npy", k[2000:]),
                "--values", self.save("av.npy", v[2000:]), "--quiet")
        status, out, err = test_cli.run_on_a_terminal("index", "update", index, "--store", store)
        self.assertEqual(status, 0, err)
        self.assertIn("1000 rows added", out.decode())
        self.assertRegex(err, r"\rqkv index update: \[#+\] 100% of [\d.]+ KiB")
        self.assertIn("qkv index update: done", err)

    def test_errors(self):
        k, v, _ = self.clustered(300, 4, 2)
        store = self.create("s", k, v)
        other = self.create("o", k[::-1].copy(), v)
        index, _ = self.build(store, "i")
        self.ok("store", "append", store, "--keys", self.save("ak.npy", k[:5]),
                "--values", self.save("av.npy", v[:5]), "--quiet")
        manifest = os.path.join(index, "manifest.json")
        with open(manifest, "rb") as f:
            text = f.read()

        def refused(args, fragments):
            self.expect_error("index", args, [], fragments)
            with open(manifest, "rb") as f:
                self.assertEqual(f.read(), text)
            self.assertEqual([f for f in os.listdir(self.dir) if f.startswith(".")], [])

        refused(["index", "update", index, "--store", other],
                ["StoreIndex::update", "another store than store " + other])
        refused(["index", "update", index], ["--store"])
        refused(["index", "update", self.path("nothing"), "--store", store], ["nothing"])
        refused(["index", "update", store, "--store", store], ["manifest.json"])
        refused(["index", "update", index, "--store", self.path("nothing")], ["nothing"])
        refused(["index", "update", index, "--store", store, "--threads", 0], ["--threads"])
        self.assertEqual(self.info(index)["rows"], 300)
        self.ok("index", "update", index, "--store", store, "--quiet")
        self.assertEqual(self.info(index)["rows"], 305)


class InterruptTest(IndexCase):
    """Signals a program can catch (SIGINT, SIGTERM, SIGHUP) during a build
    leave nothing behind: no index, no hidden .INDEX.qkv-XXXXXX directory;
    during an update, the old index or the new one, whole, and nothing else."""

    def test_signals_during_build_leave_nothing(self):
        n = 60000  # 150,000 took 51 s under ASan
        k = self.rng.normal(size=(n, 32)).astype(np.float32)
        v = self.rng.normal(size=(n, 16)).astype(np.float32)
        store = self.create("s", k, v, "--chunk-rows", 10000)
        parent = self.path("indexes")
        os.mkdir(parent)
        index = os.path.join(parent, "i")
        build = ["index", "build", store, "--out", index, "--lists", "300", "--quiet"]
        start = time.monotonic()
        self.ok(*build)
        took = time.monotonic() - start

        def check(status):
            left = sorted(os.listdir(parent))
            self.assertEqual([f for f in left if f.startswith(".")], [], f"exit {status}")
            self.assertIn(left, ([], ["i"]), f"exit {status}")
            if left:  # finished before the signal: whole
                self.ok("index", "verify", index)

        stopped = self.signal_at_random_moments(
            build, took, lambda: subprocess.run(["rm", "-rf", index], check=True), check)
        self.assertEqual([f for f in os.listdir(store) if f.startswith(".")], [])
        self.ok("store", "verify", store)

    def test_signals_during_update_leave_the_old_index_or_the_new_one(self):
        n = 60000
        k = self.rng.normal(size=(n, 32)).astype(np.float32)
        v = self.rng.normal(size=(n, 16)).astype(np.float32)
        store = self.create("s", k[:n // 2], v[:n // 2], "--chunk-rows", 10000)
        parent = self.path("indexes")
        os.mkdir(parent)
        index = os.path.join(parent, "i")
        self.ok("index", "build", store, "--out", index, "--lists", "150", "--quiet")
        original = self.path("original")
        subprocess.run(["cp", "-a", index, original], check=True)
        self.ok("store", "append", store, "--keys", self.save("ak.npy", k[n // 2:]),
                "--values", self.save("av.npy", v[n // 2:]), "--quiet")
        update = ["index", "update", index, "--store", store, "--quiet"]
        start = time.monotonic()
        self.ok(*update)
        took = time.monotonic() - start

        def fresh():
            subprocess.run(["rm", "-rf", index], check=True)
            subprocess.run(["cp", "-a", original, index], check=True)

        def check(status):
            left = sorted(os.listdir(parent))
            self.assertEqual(left, ["i"], f"exit {status}")
            self.ok("index", "verify", index)
            self.assertIn(self.info(index)["rows"], (n // 2, n), f"exit {status}")

        stopped = self.signal_at_random_moments(update, took, fresh, check)
        print(f"\n  updates of {took:.2f} s signalled at random: {stopped} stopped",
              file=sys.stderr)
        print(f"\n  builds of {took:.2f} s signalled at random: {stopped} stopped",
              file=sys.stderr)


if __name__ == "__main__":
    test_cli.main()
