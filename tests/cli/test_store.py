#!/usr/bin/python3
"""Tests of `qkv store` (create, append, info, verify) and `qkv attend --store`
through the command line: the rows read back with NumPy (chunks are .npy
files), appends killed at random moments (the store opens and verifies, and
holds the rows before or after the append, never between), two appenders at
once (one wins, the other is told, nothing is lost), signals and failed
writes during create, append and search index leaving nothing behind, a
link where a chunk goes never written through, damage named with exit 2,
progress on a terminal, and attention over a store against a float64 NumPy
reference. The harness (running qkv, temporary directories, expect_error) is
test_cli.py's.

Usage: test_store.py --qkv PATH [unittest arguments, e.g. a TestCase name]
NumPy is required: if it cannot be imported this script fails.
"""

import json
import os
import resource
import signal
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_cli  # noqa: E402  (the harness; its QKV is set in main())
import test_search  # noqa: E402  (the search index's build arguments)


def bf16(x):
    """float32 rounded to bfloat16 (nearest, ties to even), as float32."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32)


class StoreCase(test_cli.CliTest):
    def create(self, name, keys, values, *extra):
        store = self.path(name)
        self.ok("store", "create", store, "--keys", self.save(name + "-k.npy", keys),
                "--values", self.save(name + "-v.npy", values), *extra)
        return store

    def info(self, store):
        return json.loads(self.ok("store", "info", store, "--json").stdout)

    def rows(self, store):
        """The store's keys and values, read with NumPy from its manifest and chunks."""
        with open(os.path.join(store, "manifest.json")) as f:
            manifest = json.load(f)
        keys, values = [], []
        for chunk in manifest["chunks"]:
            for name, out in (("keys", keys), ("values", values)):
                a = np.load(os.path.join(store, chunk[name]))
                self.assertEqual(a.shape[0], chunk["rows"])
                if manifest["dtype"] == "bfloat16":
                    self.assertEqual(a.dtype, np.uint16)
                    a = (a.astype(np.uint32) << 16).view(np.float32)
                out.append(a)
        d, dv = manifest["key_dim"], manifest["value_dim"]
        return (np.concatenate(keys) if keys else np.zeros((0, d), np.float32),
                np.concatenate(values) if values else np.zeros((0, dv), np.float32))


class CreateTest(StoreCase):
    def test_rows_come_back_in_every_dtype_and_chunking(self):
        for dtype in ("float32", "bfloat16"):
            for n, chunk_rows in ((0, 5), (1, 5), (23, 5), (23, 23), (23, 1000)):
                k = self.rng.normal(size=(n, 6)).astype(np.float32)
                v = self.rng.normal(size=(n, 3))  # float64, stored as float32 or bfloat16
                name = f"{dtype}-{n}-{chunk_rows}"
                r = self.ok("store", "create", self.path(name), "--keys", self.save(name + "k.npy", k),
                            "--values", self.save(name + "v.npy", v),
                            "--dtype", dtype, "--chunk-rows", chunk_rows, "--json")
                summary = json.loads(r.stdout)
                self.assertEqual(summary["rows"], n)
                self.assertEqual(summary["chunks"], -(-n // chunk_rows))
                self.assertEqual((summary["key_dim"], summary["value_dim"]), (6, 3))
                self.assertEqual(summary["dtype"], dtype)
                self.assertEqual(self.info(self.path(name)), summary)
                got_k, got_v = self.rows(self.path(name))
                want_k, want_v = k, v.astype(np.float32)
                if dtype == "bfloat16":
                    want_k, want_v = bf16(want_k), bf16(want_v)
                np.testing.assert_array_equal(got_k, want_k)
                np.testing.assert_array_equal(got_v, want_v)
                self.assertIn("ok", self.ok("store", "verify", self.path(name)).stdout)

    def test_text_summary(self):
        store = self.create("s", np.ones((10, 4), np.float32), np.ones((10, 2), np.float32),
                            "--chunk-rows", 4)
        out = self.ok("store", "info", store).stdout
        for fragment in (store, "10 rows", "D = 4", "Dv = 2", "float32", "3 chunks"):
            self.assertIn(fragment, out)

    def test_progress_on_a_terminal_and_quiet(self):
        k = self.rng.normal(size=(50000, 64)).astype(np.float32)
        args = ["store", "create", "--keys", self.save("k.npy", k), "--values", self.save("v.npy", k)]
        for quiet in (False, True):
            store = self.path(f"s{quiet}")
            status, _, text = test_cli.run_on_a_terminal(
                *args, store, *(["--quiet"] if quiet else []))
            self.assertEqual(status, 0, text)
            if quiet:
                self.assertEqual(text, "")
            else:
                for fragment in ("qkv store create: [", "100%", "MiB", "/s", "done"):
                    self.assertIn(fragment, text)

    def test_the_old_out_spelling_still_works_and_says_it_is_deprecated(self):
        k = self.rng.normal(size=(7, 3)).astype(np.float32)
        old, new = self.path("old"), self.path("new")
        r = test_cli.run("store", "create", "--keys", self.save("k.npy", k), "--values",
                         self.save("v.npy", k), "--out", old, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("qkv store create: warning: --out is deprecated", r.stderr)
        self.assertIn("use STORE (positional)", r.stderr)
        r_new = self.ok("store", "create", new, "--keys", self.path("k.npy"), "--values",
                        self.path("v.npy"), "--json")
        self.assertEqual(r_new.stderr, "")
        got_old, got_new = self.rows(old), self.rows(new)
        for a, b in zip(got_old, got_new):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(got_new[0], k)

    def test_errors(self):
        k, v = self.save("k.npy", np.ones((5, 3), np.float32)), self.save("v.npy", np.ones((5, 2)))
        exists = self.create("exists", np.ones((2, 3), np.float32), np.ones((2, 2), np.float32))
        new = self.path("new")
        self.expect_error("store", ["store", "create", exists, "--keys", k, "--values", v],
                          [], ["already exists"])
        self.expect_error("store", ["store", "create", new, "--keys", k, "--values",
                                    self.save("v4.npy", np.ones((4, 2)))],
                          [], ["[5, 3]", "[4, 2]", "same N"])
        self.expect_error("store", ["store", "create", new, "--keys",
                                    self.save("k1.npy", np.ones(5)), "--values", v], [], ["(N, D)"])
        self.expect_error("store", ["store", "create", new, "--keys", k, "--values", v,
                                    "--chunk-rows", "0"], [], ["--chunk-rows"])
        self.expect_error("store", ["store", "create", new, "--keys", k, "--values", v,
                                    "--dtype", "float16"], [], ["--dtype"])
        self.expect_error("store", ["store", "create", new, "--keys", self.path("missing.npy"),
                                    "--values", v], [], ["--keys", "missing.npy"])
        # STORE is required; the old --out spelling cannot come with it.
        self.expect_error("store", ["store", "create", "--keys", k, "--values", v], [],
                          ["STORE is required"])
        self.expect_error("store", ["store", "create", new, "--keys", k, "--values", v,
                                    "--out", self.path("other")], [], ["--out", "excludes"])
        self.expect_error("store", ["store", "info", self.path("nothing")], [], ["nothing"])
        self.expect_error("store", ["store"], [], ["subcommand"])
        # float64 beyond float32's range is refused, not stored as inf.
        for big, text in ((1e300, "is 1e+300,"), (-3.5e38, "is -3.5e+38,")):
            huge = np.ones((5, 3))
            huge[2, 1] = big
            self.expect_error("store", ["store", "create", new, "--keys",
                                        self.save("huge.npy", huge), "--values", v],
                              [], ["--keys", "element [2, 1]", text, "beyond float32's range"])
        self.expect_error("store", ["store", "append", exists, "--keys", k, "--values",
                                    self.save("huge.npy", np.full((5, 2), 1e39))],
                          [], ["--values", "element [0, 0]", "beyond float32's range"])
        self.assertEqual(self.info(exists)["rows"], 2)
        self.assertFalse(os.path.exists(new))
        self.assertEqual(sorted(os.listdir(self.dir)),
                         sorted(["exists", "exists-k.npy", "exists-v.npy", "k.npy", "v.npy",
                                 "v4.npy", "k1.npy", "huge.npy"]))


class AppendTest(StoreCase):
    def test_appends_keep_every_row(self):
        k = self.rng.normal(size=(40, 5)).astype(np.float32)
        v = self.rng.normal(size=(40, 2)).astype(np.float32)
        store = self.create("s", k[:7], v[:7], "--chunk-rows", 4)
        for a, b in ((7, 20), (20, 21), (21, 40)):
            r = self.ok("store", "append", store, "--keys", self.save("ak.npy", k[a:b]),
                        "--values", self.save("av.npy", v[a:b]), "--json")
            self.assertEqual(json.loads(r.stdout)["rows"], b)
        got_k, got_v = self.rows(store)
        np.testing.assert_array_equal(got_k, k)
        np.testing.assert_array_equal(got_v, v)
        self.ok("store", "verify", store)

    def test_errors_change_nothing(self):
        store = self.create("s", np.ones((4, 3), np.float32), np.ones((4, 2), np.float32))
        def contents():
            out = {}
            for name in os.listdir(store):
                with open(os.path.join(store, name), "rb") as f:
                    out[name] = f.read()
            return out

        before = contents()
        self.expect_error("store", ["store", "append", store,
                                    "--keys", self.save("k.npy", np.ones((2, 4), np.float32)),
                                    "--values", self.save("v.npy", np.ones((2, 2), np.float32))],
                          [], ["D = 3", "[2, 4]"])
        self.expect_error("store", ["store", "append", self.path("nothing"),
                                    "--keys", self.path("k.npy"), "--values", self.path("v.npy")],
                          [], ["nothing"])
        self.assertEqual(contents(), before)

    def test_two_appenders_at_once(self):
        """The second append while the first holds the lock: exit 1, told why,
        nothing of its rows written; the first's rows all there."""
        store = self.create("s", np.zeros((1, 64), np.float32), np.zeros((1, 64), np.float32),
                            "--chunk-rows", 4096)
        big = self.rng.normal(size=(400000, 64)).astype(np.float32)
        first = subprocess.Popen([test_cli.QKV, "store", "append", store, "--quiet",
                                  "--keys", self.save("big.npy", big), "--values", self.path("big.npy")],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # Wait until the first writes its chunks, into its hidden staging
        # directory (it holds the lock from before that).
        deadline = time.monotonic() + 60
        while not any(f.startswith(".append.qkv-") for f in os.listdir(store)):
            self.assertIsNone(first.poll(), "the first append ended before it was caught writing")
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.002)
        second = test_cli.run("store", "append", store, "--keys", self.save("k.npy", np.ones((3, 64), np.float32)),
                              "--values", self.path("k.npy"))
        out, err = first.communicate(timeout=300)
        self.assertEqual(first.returncode, 0, err)
        self.assertEqual(second.returncode, 1, second.stderr)
        self.assertTrue(second.stderr.startswith("qkv store: error: "), second.stderr)
        for fragment in ("another process", os.path.join(store, "lock"), "nothing was written"):
            self.assertIn(fragment, second.stderr)
        self.assertEqual(self.info(store)["rows"], 400001)
        got_k, _ = self.rows(store)
        np.testing.assert_array_equal(got_k[1:], big)
        self.ok("store", "verify", store)


class KillTest(StoreCase):
    def test_killed_appends_leave_the_store_before_or_after(self):
        """Appends killed (SIGKILL, or SIGTERM) at random moments: each time the
        store opens, verifies and holds the rows from before the append or
        after it; the next append clears what the killed one left."""
        n0, n1 = 1000, 150000
        k = self.rng.normal(size=(n0 + n1, 32)).astype(np.float32)
        v = self.rng.normal(size=(n0 + n1, 16)).astype(np.float32)
        store = self.create("s", k[:n0], v[:n0], "--chunk-rows", 2000)
        add_k, add_v = self.save("ak.npy", k[n0:]), self.save("av.npy", v[n0:])
        original = self.path("original")
        os.rename(store, original)

        def append(at):
            subprocess.run(["cp", "-a", original, store], check=True)
            p = subprocess.Popen([test_cli.QKV, "store", "append", store, "--quiet",
                                  "--keys", add_k, "--values", add_v],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            start = time.monotonic()
            if at is None:
                p.wait(timeout=300)
                return time.monotonic() - start, p.returncode
            time.sleep(at)
            p.send_signal(signal.SIGKILL if self.rng.random() < 0.75 else signal.SIGTERM)
            p.wait(timeout=300)
            return at, p.returncode

        took, status = append(None)
        self.assertEqual(status, 0)
        outcomes = {"before": 0, "after": 0}
        # 16 kills, and more until one lands mid-append: a kill at `at` that
        # found the append done means it takes less than `at` (the timed run
        # may have been slowed by a loaded machine), so the window shrinks.
        for attempt in range(48):
            if attempt >= 16 and outcomes["before"] > 0:
                break
            subprocess.run(["rm", "-rf", store], check=True)
            at = self.rng.uniform(0.0, took * 1.1)
            append(at)
            r = test_cli.run("store", "verify", store, "--json")
            self.assertEqual(r.returncode, 0, f"killed at {at:.3f} s of {took:.3f} s: {r.stderr}")
            rows = self.info(store)["rows"]
            self.assertIn(rows, (n0, n0 + n1), f"killed at {at:.3f} s")
            outcomes["before" if rows == n0 else "after"] += 1
            if rows != n0:
                took = min(took, at / 1.1)
            got_k, got_v = self.rows(store)
            np.testing.assert_array_equal(got_k, k[:rows])
            np.testing.assert_array_equal(got_v, v[:rows])
        # The next append after a killed one clears its leftovers and succeeds.
        r = test_cli.run("store", "append", store, "--keys", self.save("ek.npy", k[:5]),
                         "--values", self.save("ev.npy", v[:5]), "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertFalse([f for f in os.listdir(store) if f.startswith(".")])
        self.ok("store", "verify", store)
        print(f"\n  appends of {took:.2f} s killed at random: {outcomes}", file=sys.stderr)
        self.assertGreater(outcomes["before"], 0, outcomes)  # the kills did land mid-append


class InterruptTest(StoreCase):
    """Signals a program can catch (SIGINT, SIGTERM, SIGHUP) and failed
    writes leave nothing behind: the docs promise only SIGKILL may."""

    def hidden(self, directory):
        return sorted(f for f in os.listdir(directory) if f.startswith("."))

    def test_signals_during_create_and_append_leave_nothing(self):
        """store create left its hidden staging directory (.S.qkv-XXXXXX) and
        an interrupted append up to 138 chunk files."""
        n = 120000
        k = self.rng.normal(size=(n, 32)).astype(np.float32)
        v = self.rng.normal(size=(n, 16)).astype(np.float32)
        keys, values = self.save("k.npy", k), self.save("v.npy", v)
        parent = self.path("stores")
        os.mkdir(parent)
        store = os.path.join(parent, "s")
        create = ["store", "create", store, "--keys", keys, "--values", values,
                  "--chunk-rows", "1000", "--quiet"]
        start = time.monotonic()
        self.ok(*create)
        took = time.monotonic() - start

        def check_create(status):
            left = sorted(os.listdir(parent))
            self.assertEqual(self.hidden(parent), [], f"exit {status}")
            self.assertIn(left, ([], ["s"]), f"exit {status}")
            if left:  # finished before the signal: whole
                self.ok("store", "verify", store)

        remove_store = lambda: subprocess.run(["rm", "-rf", store], check=True)  # noqa: E731
        self.signal_at_random_moments(create, took, remove_store, check_create)
        remove_store()
        small = self.create("stores/s", k[:10], v[:10], "--chunk-rows", "1000")
        before = sorted(os.listdir(small))
        append = ["store", "append", small, "--keys", keys, "--values", values, "--quiet"]

        def check_append(status):
            rows = self.info(small)["rows"]
            if rows == 10:
                self.assertEqual(sorted(os.listdir(small)), before, f"exit {status}")
            else:  # finished before the signal
                self.assertEqual(rows, 10 + n)
                subprocess.run(["rm", "-rf", small], check=True)
                self.create("stores/s", k[:10], v[:10], "--chunk-rows", "1000")
            self.assertEqual(self.hidden(small), [], f"exit {status}")

        self.signal_at_random_moments(append, took, lambda: None, check_append)

    def test_signals_during_search_index_leave_nothing(self):
        parent = self.path("indexes")
        os.mkdir(parent)
        index = os.path.join(parent, "i")
        build = test_search.index_args(index)
        start = time.monotonic()
        self.ok(*build)
        took = time.monotonic() - start

        def check_build(status):
            self.assertEqual(self.hidden(parent), [], f"exit {status}")
            self.assertIn(sorted(os.listdir(parent)), ([], ["i"]), f"exit {status}")

        self.signal_at_random_moments(build, took, lambda: subprocess.run(["rm", "-rf", index], check=True),
                         check_build)

    def test_a_failed_append_removes_what_it_wrote(self):
        """A write that fails (the file-size limit, EFBIG: the path a full
        disk's ENOSPC takes) while the chunks are written, or while the
        manifest is, after the chunks were renamed into place (12 files were
        left, the disk 99 % full until the next append): exit 1, and the
        store is as it was."""
        def limited(limit):
            def set_limit():
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not death
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
            return set_limit

        k = self.rng.normal(size=(60, 1)).astype(np.float32)
        v = self.rng.normal(size=(60, 1)).astype(np.float32)
        keys, values = self.save("k.npy", k[10:]), self.save("v.npy", v[10:])
        # Chunks of one row: 132-byte chunk files; 50 new chunks make a
        # manifest of about 9 KB.
        for limit, stage in ((100, "chunks"), (4096, "manifest")):
            store = self.create(f"s-{stage}", k[:10], v[:10], "--chunk-rows", "1")
            before = sorted(os.listdir(store))
            r = subprocess.run([test_cli.QKV, "store", "append", store, "--keys", keys,
                                "--values", values], capture_output=True, text=True,
                               timeout=120, preexec_fn=limited(limit))
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("qkv store: error:", r.stderr)
            self.assertIn("File too large", r.stderr)
            self.assertEqual(sorted(os.listdir(store)), before, stage)
            self.ok("store", "verify", store)
            self.assertEqual(self.info(store)["rows"], 10)

    def test_a_link_where_a_chunk_goes_is_not_written_through(self):
        """A dangling symbolic link named as the next chunk: append wrote the
        chunk through it, outside the store, and the manifest then named it."""
        k = self.rng.normal(size=(8, 2)).astype(np.float32)
        v = self.rng.normal(size=(8, 1)).astype(np.float32)
        store = self.create("s", k[:4], v[:4], "--chunk-rows", "4")
        outside = self.path("outside")
        os.mkdir(outside)
        link = os.path.join(store, "keys-000001.npy")
        os.symlink(os.path.join(outside, "chunk.npy"), link)
        before = sorted(os.listdir(store))
        self.expect_error("store", ["store", "append", store, "--keys",
                                           self.save("k.npy", k[4:]), "--values",
                                           self.save("v.npy", v[4:])],
                          fragments=[link, "a symbolic link", "nothing was appended"])
        self.assertEqual(os.listdir(outside), [])
        self.assertEqual(sorted(os.listdir(store)), before)
        self.assertTrue(os.path.islink(link))
        self.assertEqual(self.info(store)["rows"], 4)


class DamageTest(StoreCase):
    def test_damage_is_named_with_exit_2(self):
        k = self.rng.normal(size=(30, 4)).astype(np.float32)
        store = self.create("s", k, k, "--chunk-rows", 8)
        q = self.save("q.npy", k[:2])
        out = self.path("o.npy")
        with open(os.path.join(store, "manifest.json")) as f:
            manifest = json.load(f)
        chunk = os.path.join(store, manifest["chunks"][1]["values"])
        with open(chunk, "rb") as f:
            data = bytearray(f.read())
        data[-1] ^= 0x20
        with open(chunk, "wb") as f:
            f.write(data)
        self.expect_error("store", ["store", "verify", store], [], [chunk, "checksum", "altered"])
        self.ok("store", "info", store)  # sizes and headers are whole
        os.truncate(chunk, len(data) - 4)
        self.expect_error("store", ["store", "verify", store], [], [chunk, "truncated"])
        self.expect_error("store", ["store", "info", store], [], [chunk, "truncated"])
        self.expect_error("attend", ["attend", "--store", store, "--queries", q, "--out", out],
                          [out], [chunk, "truncated"])
        with open(os.path.join(store, "manifest.json"), "w") as f:
            f.write("{not json")
        self.expect_error("store", ["store", "info", store], [], ["manifest.json", "not valid JSON"])


class SpecialFilesTest(StoreCase):
    def test_special_files_are_refused_at_once(self):
        """A FIFO in place of a manifest or chunk would block its open, and
        /dev/zero would be read until memory runs out: refused by what they
        are, exit 2, before a byte is read (test_cli's runs time out after
        120 s, so a blocked open fails the test)."""
        k = self.rng.normal(size=(20, 4)).astype(np.float32)
        q = self.save("q.npy", k[:2])
        out = self.path("o.npy")
        store = self.create("s", k, k, "--chunk-rows", 8)
        with open(os.path.join(store, "manifest.json")) as f:
            chunk = os.path.join(store, json.load(f)["chunks"][1]["keys"])
        manifest = os.path.join(store, "manifest.json")
        for path, make, what in ((manifest, os.mkfifo, "a FIFO"),
                                 (manifest, lambda p: os.symlink("/dev/zero", p),
                                  "a character device"),
                                 (chunk, os.mkfifo, "a FIFO")):
            saved = path + ".saved"
            os.rename(path, saved)
            make(path)
            try:
                for args in (["store", "info", store], ["store", "verify", store],
                             ["store", "append", store, "--keys", q, "--values", q]):
                    self.expect_error("store", args, [], [path, "not a regular file", what])
                self.expect_error("attend", ["attend", "--store", store, "--queries", q,
                                             "--out", out], [out],
                                  [path, "not a regular file", what])
            finally:
                os.remove(path)
                os.rename(saved, path)
        self.ok("store", "verify", store)


class AttendStoreTest(StoreCase):
    def reference(self, q, k, v, lens, scale=None):
        q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
        s = q @ k.T * (1 / np.sqrt(q.shape[1]) if scale is None else scale)
        mask = np.arange(k.shape[0])[None, :] < np.asarray(lens)[:, None]
        m = np.where(mask, s, -np.inf).max(axis=1, keepdims=True)
        e = np.where(mask, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
        total = e.sum(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            w = np.where(total > 0, e / total, 0)
            return w @ v, (np.log(total) + m)[:, 0], w

    def test_against_numpy(self):
        for dtype in ("float32", "bfloat16"):
            n, d, dv, nq = 900, 16, 8, 7
            k = self.rng.normal(size=(n, d)).astype(np.float32)
            v = self.rng.normal(size=(n, dv)).astype(np.float32)
            q = self.rng.normal(size=(nq, d)).astype(np.float32)
            store = self.create(dtype, k, v, "--dtype", dtype, "--chunk-rows", 128)
            if dtype == "bfloat16":
                k, v, q = bf16(k), bf16(v), bf16(q)
            per_query = np.array([0, 1, 128, 129, 500, 900, 77], np.int64)
            for lens_arg, lens in ((None, [n] * nq), (np.int32(300), [300] * nq),
                                   (per_query, per_query)):
                args = ["attend", "--store", store, "--queries", self.save("q.npy", q),
                        "--out", self.path("o.npy"), "--lse", self.path("lse.npy"),
                        "--top-k", 5, "--top-ids", self.path("ids.npy"),
                        "--top-weights", self.path("tw.npy"), "--scale", 0.3]
                if lens_arg is not None:
                    args += ["--valid-lens", self.save("lens.npy", lens_arg)]
                self.ok(*args)
                ref_o, ref_lse, ref_w = self.reference(q, k, v, lens, 0.3)
                # bfloat16: where the CPU has AVX-512 BF16 the kernel rounds the
                # weights to bf16 for P V (2^-8 relative; test_sdpa_flash's bound).
                out_tol = (dict(rtol=0, atol=2**-8 * np.abs(v).max() + 1e-5)
                           if dtype == "bfloat16" else dict(rtol=1e-4, atol=1e-5))
                w_rtol = 2**-7 if dtype == "bfloat16" else 1e-4
                np.testing.assert_allclose(self.load(self.path("o.npy"), np.float32, (nq, dv)),
                                           ref_o, **out_tol)
                np.testing.assert_allclose(self.load(self.path("lse.npy"), np.float32, (nq,)),
                                           ref_lse, rtol=2e-6, atol=2e-6)
                ids = self.load(self.path("ids.npy"), np.int64, (nq, 5))
                tw = self.load(self.path("tw.npy"), np.float32, (nq, 5))
                for i in range(nq):
                    order = np.argsort(-ref_w[i], kind="stable")[:min(5, lens[i])]
                    np.testing.assert_allclose(tw[i, :len(order)], ref_w[i, order], rtol=w_rtol,
                                               atol=1e-6)
                    np.testing.assert_allclose(ref_w[i, ids[i, :len(order)]], ref_w[i, order],
                                               rtol=w_rtol, atol=1e-6)
                    self.assertTrue((ids[i, len(order):] == -1).all())
                    self.assertTrue((tw[i, len(order):] == 0).all())

    def test_distance_scoring_against_numpy(self):
        """Nadaraya-Watson's Gaussian kernel over a store (--scoring distance
        --bandwidth h, the same as --scale 1/h^2), keys far from the origin;
        --scoring gaussian, its old name, gives the same bits with a warning."""
        n, d, dv, nq, h = 700, 3, 2, 6, 0.4
        k = (1000 + self.rng.uniform(-1, 1, size=(n, d))).astype(np.float32)
        v = self.rng.normal(size=(n, dv)).astype(np.float32)
        q = (1000 + self.rng.uniform(-1, 1, size=(nq, d))).astype(np.float32)
        store = self.create("g", k, v, "--chunk-rows", 256)
        queries = self.save("q.npy", q)

        def attend(name, *scoring, ok=True):
            paths = [self.path(f"{name}-{part}.npy") for part in ("o", "lse", "ids")]
            args = ["attend", "--store", store, *scoring, "--queries", queries, "--out", paths[0],
                    "--lse", paths[1], "--top-k", 1, "--top-ids", paths[2]]
            r = self.ok(*args) if ok else test_cli.run(*args)
            self.assertEqual(r.returncode, 0, r.stderr)
            return r, [np.load(p) for p in paths]

        _, (out, lse, ids) = attend("h", "--scoring", "distance", "--bandwidth", h)
        dist = ((q.astype(np.float64)[:, None, :] - k.astype(np.float64)[None, :, :]) ** 2).sum(-1)
        s = -dist / (2 * h * h)
        m = s.max(axis=1, keepdims=True)
        w = np.exp(s - m)
        self.assertEqual((out.dtype, out.shape, lse.shape, ids.shape),
                         (np.float32, (nq, dv), (nq,), (nq, 1)))
        np.testing.assert_allclose(out, (w / w.sum(1, keepdims=True)) @ v, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(lse, np.log(w.sum(1)) + m[:, 0], rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(ids[:, 0], dist.argmin(axis=1))
        _, by_scale = attend("s", "--scoring", "distance", "--scale", repr(1 / (h * h)))
        r, by_old_name = attend("g", "--scoring", "gaussian", "--bandwidth", h, ok=False)
        self.assertEqual(r.stderr, "qkv attend: warning: --scoring gaussian is deprecated and goes "
                                   "in the next release; use --scoring distance (--bandwidth H as "
                                   "before)\n")
        for a, b, c in zip((out, lse, ids), by_scale, by_old_name):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(a, c)

    def test_default_scale_and_output_only(self):
        k = self.rng.normal(size=(50, 4)).astype(np.float32)
        store = self.create("s", k, k)
        q = self.rng.normal(size=(3, 4)).astype(np.float32)
        self.ok("attend", "--store", store, "--queries", self.save("q.npy", q), "--out", self.path("o.npy"))
        np.testing.assert_allclose(self.load(self.path("o.npy"), np.float32, (3, 4)),
                                   self.reference(q, k, k, [50] * 3)[0], rtol=1e-4, atol=1e-5)

    def test_errors(self):
        k = np.ones((10, 4), np.float32)
        store = self.create("s", k, k)
        q = self.save("q.npy", np.ones((2, 4), np.float32))
        out, ids = self.path("o.npy"), self.path("ids.npy")
        base = ["attend", "--store", store, "--queries", q, "--out", out]
        self.expect_error("attend", base + ["--keys", q], [out], ["--keys", "--store"])
        for scoring in ("additive", "bilinear"):
            self.expect_error("attend", base + ["--scoring", scoring], [out],
                              [f"--scoring {scoring} does not take --store", "dot or distance"])
        self.expect_error("attend", base + ["--scoring", "distance", "--scale", 2, "--bandwidth", 1],
                          [out], ["--bandwidth H and --scale S are one setting"])
        for h in (0, -1, "inf"):
            self.expect_error("attend", base + ["--scoring", "distance", "--bandwidth", h], [out],
                              ["--bandwidth", "expected a finite number > 0"])
        # The same store twice, however spelled, would count its rows twice.
        again = os.path.join(store, "..", os.path.basename(store))
        self.expect_error("attend", base + ["--store", again], [out],
                          [f"--store {again} is --store {store} again",
                           "each store's rows count once"])
        self.expect_error("attend", base + ["--scoring", "distance", "--bandwidth", "1e-300"],
                          [out], ["--bandwidth 1e-300: 1/H^2 = inf is beyond float64's range"])
        # A bandwidth whose scores overflow float32 for every row: refused in
        # the user's terms, not written as NaN.
        self.expect_error("attend", base + ["--scoring", "distance", "--bandwidth", "1e-25"],
                          [out], ["--bandwidth 1e-25 is too small for float32 inputs",
                                  "1/H^2 = 1e+50 is beyond float32's range"])
        self.expect_error("attend", base + ["--scoring", "distance", "--scale", 0], [out],
                          ["attend", "scale = 0", "> 0 for distance scoring"])
        self.expect_error("attend", base + ["--bandwidth", 1], [out],
                          ["--bandwidth is for --scoring distance", "--scoring dot takes --scale"])
        self.expect_error("attend", base + ["--causal", "--mask", q], [out],
                          ["--causal and --mask", "--store"])
        self.expect_error("attend", base + ["--weights", ids], [out, ids], ["--weights"])
        self.expect_error("attend", base + ["--top-ids", ids], [out, ids], ["--top-k"])
        self.expect_error("attend", base + ["--top-k", 2], [out], ["--top-ids", "--top-weights"])
        self.expect_error("attend", base + ["--top-k", 11, "--top-ids", ids], [out, ids],
                          ["top_k = 11", "10 rows"])
        # No output may be one of the store's files, however its path is
        # spelled (the manifest, through "..", through a link to the store).
        with open(os.path.join(store, "manifest.json"), "rb") as f:
            manifest = f.read()
        os.symlink(store, self.path("link"))
        for option, inside in (("--out", os.path.join(store, "manifest.json")),
                               ("--out", os.path.join(store, "..", "s", "manifest.json")),
                               ("--lse", os.path.join(self.path("link"), "manifest.json")),
                               ("--out", os.path.join(store, "new.npy"))):
            args = ["attend", "--store", store, "--queries", q, "--out", out, "--lse", ids]
            args[args.index(option) + 1] = inside
            self.expect_error("attend", args, [], [option, inside, "is inside --store " + store])
            with open(os.path.join(store, "manifest.json"), "rb") as f:
                self.assertEqual(f.read(), manifest)
            self.assertFalse(os.path.exists(os.path.join(store, "new.npy")))
        self.ok("store", "verify", store)
        self.expect_error("attend", ["attend", "--store", store, "--queries",
                                     self.save("q5.npy", np.ones((2, 5), np.float32)), "--out", out],
                          [out], ["[2, 5]", "D = 4"])
        self.expect_error("attend", ["attend", "--store", store, "--queries",
                                     self.save("q3.npy", np.ones((1, 2, 4), np.float32)), "--out", out],
                          [out], ["2-D (Nq, D)"])
        self.expect_error("attend", base + ["--valid-lens", self.save("l.npy", np.array([11, 2]))],
                          [out], ["11"])
        self.expect_error("attend", ["attend", "--store", self.path("nothing"), "--queries", q,
                                     "--out", out], [out], ["nothing"])
        self.expect_error("attend", ["attend", "--scoring", "dot", "--queries", q, "--keys", q,
                                     "--values", q, "--out", out, "--top-k", 1], [out],
                          ["--top-k", "--store"])


if __name__ == "__main__":
    test_cli.main()
