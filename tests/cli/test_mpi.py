#!/usr/bin/python3
"""Tests of `mpirun -np R qkv attend --store ...` (R = 1 to 4, on this machine):
one store whose chunks the ranks share, and a shard store per rank, against
the same attention in one process; the same bits in every run with the same
R; a rank with a damaged shard or a rank that is killed ends every rank with
no output file. The harness is test_cli.py's, the store helpers test_store.py's.

Usage: test_mpi.py --qkv PATH [unittest arguments, e.g. a TestCase name]
NumPy and OpenMPI's mpirun are required: without them this script fails.
"""

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


if __name__ == "__main__":
    test_cli.main()
