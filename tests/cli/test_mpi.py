#!/usr/bin/python3
"""Tests of `mpirun -np R qkv attend --store ...` (R = 1 to 4, on this machine):
one store whose chunks the ranks share, and a shard store per rank, against
the same attention in one process; the same bits in every run with the same
R; a rank with a damaged shard or a rank that is killed ends every rank with
no output file. With --index, a shard store and its index per rank: the same
bits as one process through every shard's index, and against attention over
a store of all the rows and NumPy (the certificate's bound, compact kernels);
the refusals. The harness is test_cli.py's, the store helpers test_store.py's.

Usage: test_mpi.py --qkv PATH [unittest arguments, e.g. a TestCase name]
NumPy and OpenMPI's mpirun are required: without them this script fails.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_cli  # noqa: E402  (the harness; its QKV is set in main())
from test_store import StoreCase  # noqa: E402
from test_index import SUMMARY, number  # noqa: E402  (the line attend --index prints)

MPIRUN = shutil.which("mpirun") or "/usr/bin/mpirun"


def mpirun(ranks, *args, threads=1):
    env = dict(os.environ, QKV_NUM_THREADS=str(threads))
    return subprocess.run([MPIRUN, "--oversubscribe", "--allow-run-as-root", "-np", str(ranks),
                           test_cli.QKV] + [str(a) for a in args],
                          capture_output=True, text=True, timeout=300, env=env)


class MpiCase(StoreCase):
    def setUp(self):
        super().setUp()
        self.assertTrue(os.access(MPIRUN, os.X_OK), "mpirun is missing (openmpi-bin)")

    def attend_args(self, stores, q, out, *extra):
        args = ["attend", "--queries", q, "--out", out, "--lse", out + ".lse.npy",
                "--top-k", 4, "--top-ids", out + ".ids.npy", "--top-weights", out + ".tw.npy"]
        for s in stores:
            args += ["--store", s]
        return args + list(extra)

    def results(self, out):
        return [np.load(p) for p in (out, out + ".lse.npy", out + ".ids.npy", out + ".tw.npy")]


class ShareTest(MpiCase):
    def test_one_store_shared_by_1_to_4_ranks(self):
        n, d, dv, nq = 6000, 24, 8, 9
        k = self.rng.normal(size=(n, d)).astype(np.float32)
        v = self.rng.normal(size=(n, dv)).astype(np.float32)
        q = self.save("q.npy", self.rng.normal(size=(nq, d)).astype(np.float32))
        # 13 chunks: not divisible by 2, 3 or 4.
        store = self.create("s", k, v, "--chunk-rows", 470)
        lens = self.save("lens.npy", np.array([0, 1, 470, 471, 3000, 6000, 5999, 2, 940], np.int64))
        for extra in ([], ["--valid-lens", lens]):
            single = self.path("single.npy")
            self.ok(*self.attend_args([store], q, single, *extra))
            want = self.results(single)
            for ranks in (1, 2, 3, 4):
                outs = []
                for run in range(2):
                    out = self.path(f"r{ranks}-{run}.npy")
                    r = mpirun(ranks, *self.attend_args([store], q, out, *extra))
                    self.assertEqual(r.returncode, 0, f"{ranks} ranks: {r.stderr}")
                    outs.append(self.results(out))
                got, again = outs
                for a, b in zip(got, again):  # the same bits in every run with R ranks
                    np.testing.assert_array_equal(a, b)
                np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
                np.testing.assert_allclose(got[1], want[1], rtol=2e-6, atol=2e-6)
                np.testing.assert_allclose(got[3], want[3], rtol=1e-4, atol=1e-6)
                same = got[2] == want[2]
                np.testing.assert_allclose(got[3][~same], want[3][~same], atol=1e-6)  # near-ties only

    def test_a_shard_per_rank(self):
        d, dv, nq = 16, 4, 5
        sizes = [900, 0, 1234]  # the second rank holds no rows
        parts = [(self.rng.normal(size=(m, d)).astype(np.float32),
                  self.rng.normal(size=(m, dv)).astype(np.float32)) for m in sizes]
        shards = [self.create(f"shard{i}", pk, pv, "--chunk-rows", 300) for i, (pk, pv) in enumerate(parts)]
        whole = self.create("whole", np.concatenate([p[0] for p in parts]),
                            np.concatenate([p[1] for p in parts]), "--chunk-rows", 500)
        q = self.save("q.npy", self.rng.normal(size=(nq, d)).astype(np.float32))
        lens = self.save("lens.npy", np.array([0, 900, 901, 2134, 1500], np.int64))
        for extra in ([], ["--valid-lens", lens]):
            listed, one, sharded = self.path("listed.npy"), self.path("one.npy"), self.path("mpi.npy")
            self.ok(*self.attend_args(shards, q, listed, *extra))  # the shards in one process
            self.ok(*self.attend_args([whole], q, one, *extra))
            r = mpirun(3, *self.attend_args(shards, q, sharded, *extra))
            self.assertEqual(r.returncode, 0, r.stderr)
            # One process over the shards merges the same parts in the same
            # order as the ranks: the same bits.
            for a, b in zip(self.results(sharded), self.results(listed)):
                np.testing.assert_array_equal(a, b)
            got, want = self.results(sharded), self.results(one)
            np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(got[1], want[1], rtol=2e-6, atol=2e-6)
        r = mpirun(2, *self.attend_args(shards, q, self.path("x.npy")))
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("3 --store shards for 2 ranks", r.stderr)
        self.assertFalse(os.path.exists(self.path("x.npy")))


class FailureTest(MpiCase):
    def test_a_damaged_shard_ends_every_rank_without_output(self):
        k = self.rng.normal(size=(100, 4)).astype(np.float32)
        shards = [self.create(f"shard{i}", k, k, "--chunk-rows", 30) for i in range(3)]
        chunk = os.path.join(shards[2], "values-000001.npy")
        os.truncate(chunk, 200)
        q = self.save("q.npy", k[:3])
        out = self.path("o.npy")
        with open(out, "wb") as f:
            f.write(b"sentinel")
        r = mpirun(3, *self.attend_args(shards, q, out))
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("qkv attend: error: rank 2 of 3: ", r.stderr)
        self.assertIn(chunk, r.stderr)
        self.assertEqual(r.stderr.count("qkv attend: error:"), 1, r.stderr)  # rank 0 tells, once
        with open(out, "rb") as f:
            self.assertEqual(f.read(), b"sentinel")
        self.assertEqual(sorted(f for f in os.listdir(self.dir) if f.startswith(".")), [])

    def test_a_killed_rank_ends_the_job_without_output(self):
        n, d = 400000, 64
        k = self.rng.normal(size=(n, d)).astype(np.float32)
        store = self.create("s", k, k, "--quiet", "--chunk-rows", 20000)
        # 1024 queries: about 3 s of work for three ranks on two cores.
        q = self.save("q.npy", self.rng.normal(size=(1024, d)).astype(np.float32))
        out = self.path("o.npy")
        env = dict(os.environ, QKV_NUM_THREADS="1")
        p = subprocess.Popen([MPIRUN, "--oversubscribe", "--allow-run-as-root", "-np", "3", test_cli.QKV,
                              "attend", "--store", store, "--queries", q, "--out", out, "--quiet"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        # The ranks are mpirun's children; kill the last once all three run.
        deadline = time.monotonic() + 60
        while True:
            children = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True,
                                      text=True).stdout.split()
            if len(children) >= 3:
                break
            self.assertIsNone(p.poll(), "the job ended before a rank could be killed")
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.01)
        time.sleep(0.3)
        os.kill(int(sorted(children, key=int)[-1]), signal.SIGKILL)
        _, err = p.communicate(timeout=300)
        self.assertNotEqual(p.returncode, 0, err)
        self.assertIn("signal 9", err)  # mpirun tells which rank died, and ends the others
        self.assertFalse(os.path.exists(out), err)
        self.assertEqual(sorted(f for f in os.listdir(self.dir) if f.startswith(".")), [])


class IndexTest(MpiCase):
    """mpirun -np R qkv attend --store S_0 ... --index I_0 ...: rank r attends
    through I_r over S_r, rank 0 merges."""

    def shards(self, sizes, d, dv, apart=0.0, name="s"):
        """Shard stores of clustered keys (shard r's moved `apart` * r along
        the first axis) with their indexes, and every row; queries near the
        keys."""
        n = sum(sizes)
        centres = self.rng.normal(size=(12, d)) * 1.5
        k = centres[self.rng.integers(0, 12, n)] + self.rng.normal(size=(n, d)) * 0.5
        k[:, 0] += apart * np.repeat(np.arange(len(sizes)), sizes)
        k, v = k.astype(np.float32), self.rng.normal(size=(n, dv)).astype(np.float32)
        stores, indexes, first = [], [], 0
        for r, m in enumerate(sizes):
            stores.append(self.create(f"{name}{r}", k[first:first + m], v[first:first + m],
                                      "--chunk-rows", 300))
            indexes.append(self.path(f"{name}{r}.index"))
            self.ok("index", "build", stores[-1], "--out", indexes[-1], "--quiet")
            first += m
        at = self.rng.integers(0, n, 10)
        q = (k[at] + self.rng.normal(size=(10, d)) * 0.05).astype(np.float32)
        return stores, indexes, k, v, q

    def index_args(self, stores, indexes, q, out, *extra):
        args = ["attend", "--queries", q, "--out", out, "--lse", out + ".lse.npy",
                "--certificate", out + ".c.npy", "--top-k", 4, "--top-ids", out + ".ids.npy",
                "--top-weights", out + ".tw.npy"]
        for s in stores:
            args += ["--store", s]
        for i in indexes:
            args += ["--index", i]
        return args + list(extra)

    def index_results(self, out):
        return [np.load(out + suffix)
                for suffix in ("", ".lse.npy", ".c.npy", ".ids.npy", ".tw.npy")]

    def lists_of(self, indexes):
        return sum(json.loads(self.ok("index", "info", i, "--json").stdout)["lists"]
                   for i in indexes)

    def test_an_index_per_rank_against_one_process_and_numpy(self):
        d, dv = 8, 4
        # One rank, and four with rank 1 empty (tests/mpi runs the merge at 1 to 4).
        for ranks in (1, 4):
            sizes = [0 if r == 1 and ranks >= 3 else int(self.rng.integers(200, 900))
                     for r in range(ranks)]  # with 3 or more ranks, rank 1 holds no rows
            stores, indexes, k, v, q_rows = self.shards(sizes, d, dv, name=f"r{ranks}-")
            q = self.save(f"q{ranks}.npy", q_rows)
            whole = self.create(f"whole{ranks}", k, v, "--chunk-rows", 500)
            scores = q_rows.astype(np.float64) @ k.astype(np.float64).T / np.sqrt(d)
            m = scores.max(axis=1, keepdims=True)
            weights = np.exp(scores - m)
            exact_lse = np.log(weights.sum(axis=1)) + m[:, 0]
            exact = weights @ v.astype(np.float64) / weights.sum(axis=1, keepdims=True)
            max_v = np.linalg.norm(v, axis=1).max()
            for epsilon in ("0", "1e-3", "0.05"):
                what = f"{ranks} ranks, --epsilon {epsilon}"
                out = self.path(f"mpi{ranks}-{epsilon}.npy")
                one = self.path(f"one{ranks}-{epsilon}.npy")
                r = mpirun(ranks, *self.index_args(stores, indexes, q, out, "--epsilon", epsilon))
                self.assertEqual(r.returncode, 0, f"{what}: {r.stderr}")
                # One process through the same indexes, merged in the same
                # order: the same bits and the same summary (one index is
                # not merged: its top weights may differ in the last bit).
                r1 = test_cli.run(*self.index_args(stores, indexes, q, one, "--epsilon", epsilon))
                self.assertEqual(r1.returncode, 0, r1.stderr)
                self.assertEqual(r.stderr, r1.stderr)
                got = self.index_results(out)
                for a, b in zip(got[:4] if ranks == 1 else got, self.index_results(one)):
                    np.testing.assert_array_equal(a, b, what)
                match = SUMMARY.match(r.stderr)
                self.assertIsNotNone(match, r.stderr)
                self.assertEqual(number(match[4]), self.lists_of(indexes))
                self.assertEqual(number(match[6]), sum(sizes))
                self.assertEqual(match[7], "; top 4 certain for 10 of 10 queries")
                o, lse, c, ids, tw = got
                self.assertEqual((c.dtype, c.shape), (np.float64, (10,)))
                self.assertTrue((c >= 0).all() and (c <= float(epsilon)).all(), (what, c))
                self.assertAlmostEqual(float(match[1]), c.max(), delta=0.051 * c.max())
                # Within the certificate's bound of attention over every row.
                error = np.linalg.norm(o.astype(np.float64) - exact, axis=1)
                self.assertTrue((error <= 2 * c * max_v + 1e-5).all(), (what, error, c))
                self.assertTrue((lse <= exact_lse + 1e-5).all(), what)
                self.assertTrue((exact_lse <= lse + np.log1p(c) + 1e-5).all(), what)
                # The top rows: the exact ones (ids count through the shards).
                for i in range(10):
                    np.testing.assert_allclose(scores[i, ids[i]], np.sort(scores[i])[::-1][:4],
                                               rtol=0, atol=1e-5, err_msg=what)
                np.testing.assert_allclose(tw, np.exp(np.take_along_axis(scores, ids, 1) -
                                                      exact_lse[:, None]),
                                           rtol=float(epsilon) + 1e-4, atol=1e-6, err_msg=what)
                if epsilon == "0":
                    # Epsilon 0: attention over a store of every row.
                    store_out = self.path(f"store{ranks}.npy")
                    self.ok(*self.attend_args([whole], q, store_out), "--quiet")
                    want = self.results(store_out)
                    np.testing.assert_allclose(o, want[0], rtol=1e-5, atol=1e-6, err_msg=what)
                    np.testing.assert_allclose(lse, want[1], rtol=1e-5, atol=1e-6, err_msg=what)
                    np.testing.assert_allclose(o, exact, rtol=1e-5, atol=1e-6, err_msg=what)
            # The same bits in a second run.
            again = self.path(f"again{ranks}.npy")
            r = mpirun(ranks, *self.index_args(stores, indexes, q, again, "--epsilon", "1e-3"))
            self.assertEqual(r.returncode, 0, r.stderr)
            first = self.index_results(self.path(f"mpi{ranks}-1e-3.npy"))
            for a, b in zip(self.index_results(again), first):
                np.testing.assert_array_equal(a, b)

    def test_compact_kernels_over_every_rank(self):
        """Shard r's keys moved 20 r along the first axis: a query near one of
        them has rows in reach on that rank only; one far query on none."""
        d, dv, h = 3, 2, 0.6
        sizes = [700, 0, 500]
        stores, indexes, k, v, q_rows = self.shards(sizes, d, dv, apart=20.0)
        q_rows = np.concatenate([q_rows, np.full((1, d), -100.0, np.float32)])
        q = self.save("q.npy", q_rows)
        u = (q_rows.astype(np.float64)[:, None, :] - k.astype(np.float64)[None, :, :]) / h
        w = np.where(np.abs(u) <= 1, 1 - u * u, 0).prod(axis=2)
        total = w.sum(axis=1)
        reach = total > 0
        self.assertFalse(reach[-1])
        out = self.path("o.npy")
        r = mpirun(3, *self.index_args(stores, indexes, q, out, "--kernel", "epanechnikov",
                                       "--bandwidth", h))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRegex(r.stderr, r"^qkv attend --index: epanechnikov kernel of width 0\.6, "
                                   r"exact; visited [\d.,]+ of [\d,]+ lists, [\d.,]+ of 1,200 rows")
        o, lse, c, ids, tw = self.index_results(out)
        want = (w @ v.astype(np.float64))[reach] / total[reach, None]
        np.testing.assert_allclose(o[reach], want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[reach], np.log(total[reach]), rtol=1e-5, atol=1e-6)
        self.assertTrue((o[~reach] == 0).all() and np.isneginf(lse[~reach]).all())
        self.assertTrue((c == 0).all())
        for i in np.flatnonzero(reach):
            best = np.sort(w[i])[::-1][:4]
            np.testing.assert_allclose(tw[i], best / total[i], rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(w[i, ids[i][best > 0]], best[best > 0], rtol=1e-6)
        self.assertTrue((ids[~reach] == -1).all())

    def test_refusals(self):
        stores, indexes, k, v, q_rows = self.shards([300, 200, 250], 4, 2)
        q = self.save("q.npy", q_rows)
        out = self.path("o.npy")

        def refused(ranks, args, fragments, once=True):
            with open(out, "wb") as f:
                f.write(b"sentinel")
            r = mpirun(ranks, *args)
            self.assertEqual(r.returncode, 2, r.stderr)
            for fragment in fragments:
                self.assertIn(fragment, r.stderr)
            if once:  # rank 0 tells
                self.assertEqual(r.stderr.count("qkv attend: error:"), 1, r.stderr)
            with open(out, "rb") as f:
                self.assertEqual(f.read(), b"sentinel")
            self.assertEqual(sorted(f for f in os.listdir(self.dir) if f.startswith(".")), [])

        base = ["attend", "--queries", q, "--out", out]
        base += [a for s in stores for a in ("--store", s)]
        # Counts: of --index against --store (checked before MPI starts, by
        # every rank), and against the ranks.
        refused(3, base + ["--index", indexes[0], "--index", indexes[1]],
                ["qkv attend: error: --index given 2 times and --store 3 times",
                 "give each store's index"], once=False)
        refused(2, base + [a for i in indexes for a in ("--index", i)],
                ["qkv attend: error: 3 --store and --index for 2 ranks",
                 "one shard store and its index per rank"])
        # An index not built over its store: rank 1 gets rank 2's.
        refused(3, base + ["--index", indexes[0], "--index", indexes[2], "--index", indexes[1]],
                ["qkv attend: error: rank 1 of 3: StoreIndex::check_built_over: index " +
                 indexes[2],
                 "another store than store " + stores[1]])
        # In one process too.
        self.expect_error("attend", base + ["--index", indexes[0], "--index", indexes[2],
                                            "--index", indexes[1]], [out],
                          ["StoreIndex::check_built_over", "index " + indexes[2]])
        # --valid-lens still does not go with --index.
        lens = self.save("lens.npy", np.int64(5))
        refused(3, base + [a for i in indexes for a in ("--index", i)] + ["--valid-lens", lens],
                ["--valid-lens does not go with --index"], once=False)
        # Rows appended to rank 2's shard since its index was built: stale.
        self.ok("store", "append", stores[2], "--keys", self.save("ak.npy", k[:7]),
                "--values", self.save("av.npy", v[:7]), "--quiet")
        refused(3, base + [a for i in indexes for a in ("--index", i)],
                ["qkv attend: error: rank 2 of 3: ", "index " + indexes[2], "stale"])


if __name__ == "__main__":
    test_cli.main()
