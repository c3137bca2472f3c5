#!/usr/bin/python3
"""Tests of the `qkv` command under the conditions an adversarial run broke it
with: thread counts past the limit, labels and paths that try to run gnuplot
commands, a full disk, outputs that are devices, FIFOs or symlinks, running
out of memory, FIFO and endless inputs, unusable output paths, empty option
values, termination signals, and text that is not UTF-8 in JSON output.
The harness (running qkv, temporary directories, expect_error) is
test_cli.py's.

Usage: test_robust.py --qkv PATH [unittest arguments, e.g. a TestCase name]
NumPy is required: if it cannot be imported this script fails.
"""

import json
import os
import resource
import signal
import stat
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_cli  # noqa: E402  (the harness; its QKV is set in main())

PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"


def is_asan_build():
    """AddressSanitizer reserves terabytes of address space, so a binary built
    with it cannot run under an address-space limit at all."""
    with open(test_cli.QKV, "rb") as f:
        return b"__asan_init" in f.read()


class RobustTest(test_cli.CliTest):
    def run_qkv(self, args, *, fsize=None, address_space=None, timeout=60, cwd=None, env=None):
        """Runs qkv with optional limits on file size (SIGXFSZ ignored, so a
        write past it fails with EFBIG as on a full disk) and address space;
        returns the CompletedProcess (stdout and stderr as bytes)."""
        def limit():
            if fsize is not None:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.RLIM_INFINITY))
            if address_space is not None:
                resource.setrlimit(resource.RLIMIT_AS, (address_space, resource.RLIM_INFINITY))
        command = [os.fsencode(test_cli.QKV)] + [a if isinstance(a, bytes) else os.fsencode(str(a))
                                                 for a in args]
        return subprocess.run(command, capture_output=True, timeout=timeout, cwd=cwd, env=env,
                              preexec_fn=limit)

    def expect_exit(self, r, status, command, *fragments):
        stderr = r.stderr.decode(errors="replace")
        context = f"exit {r.returncode}\nstderr: {stderr}"
        self.assertEqual(r.returncode, status, context)
        if status != 0:
            self.assertTrue(stderr.startswith(f"qkv {command}: error: "), context)
        for fragment in fragments:
            self.assertIn(fragment, stderr, context)
        return stderr

    def leftovers(self, *directories):
        """Staged temporary files (.NAME.qkv-XXXXXX) in the directories."""
        found = []
        for d in directories or (self.dir,):
            found += [n for n in os.listdir(d) if n.startswith(".") and ".qkv-" in n]
        return found

    def read(self, path):
        with open(path, "rb") as f:
            return f.read()

    def write(self, name, data):
        path = self.path(name)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def scores(self, name="x.npy", shape=(2, 3, 4)):
        return self.save(name, self.rng.normal(size=shape).astype(np.float32))

    def train_csv(self, name="train.csv", n=30):
        x = np.sort(self.rng.uniform(0, 5, n))
        y = 2 * np.sin(x) + self.rng.normal(0, 0.5, n)
        text = "x,y\n" + "".join(f"{a!r},{b!r}\n" for a, b in zip(x, y))
        return self.write(name, text.encode())


def feed_fifo(path, data):
    """Starts a thread that writes `data` into the FIFO at `path` once (opening
    it blocks until a reader opens it); returns the thread. A daemon, so a
    reader that never comes cannot keep the tests from ending."""
    def writer():
        try:
            with open(path, "wb") as f:
                f.write(data)
        except BrokenPipeError:
            pass  # the reader closed early; the reader's result tells
    t = threading.Thread(target=writer, daemon=True)
    t.start()
    return t


def drain_fifo(path, into):
    """Starts a thread that reads the FIFO at `path` to its end into the list
    `into` (as one bytes object)."""
    def reader():
        with open(path, "rb") as f:
            into.append(f.read())
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    return t


# ---- 2. --threads and QKV_NUM_THREADS: one limit, 1024 ------------------------------

class ThreadsTest(RobustTest):
    def test_counts_above_the_limit_exit_2_naming_it(self):
        x, out = self.scores(), self.path("w.npy")
        for n in ("1025", "50000", "100000", "99999999999999999999"):
            with self.subTest(threads=n):
                self.expect_error("softmax", ["softmax", "--scores", x, "--out", out,
                                              "--threads", n], [out], ["--threads", "1024", n])
                self.expect_error("demo", ["demo", "--out", self.path("d"), "--threads", n],
                                  [], ["--threads", "1024"])
                self.expect_error("attend", ["attend", "--scoring", "dot", "--queries", x,
                                             "--keys", x, "--values", x, "--out", out,
                                             "--threads", n], [out], ["--threads", "1024"])
                self.expect_error("regress", ["regress", "--train", self.train_csv(), "--grid",
                                              "0:5:1", "--kernel", "gaussian", "--bandwidth",
                                              "1", "--out", self.path("p.csv"), "--threads", n],
                                  [self.path("p.csv")], ["--threads", "1024"])

    def test_environment_above_the_limit_exits_2_naming_it(self):
        x, out = self.scores(), self.path("w.npy")
        for n in ("1025", "100000", "0", "two"):
            r = self.run_qkv(["softmax", "--scores", x, "--out", out],
                             env=dict(os.environ, QKV_NUM_THREADS=n))
            self.expect_exit(r, 2, "softmax", "QKV_NUM_THREADS", "1024", n)
            self.assertFalse(os.path.exists(out))

    def test_the_limit_itself_runs_and_gives_the_same_bits(self):
        # Enough rows that every one of the 1024 threads gets a task.
        x = self.scores(shape=(4, 2048, 33))
        one, many, env_many = self.path("one.npy"), self.path("many.npy"), self.path("env.npy")
        self.ok("softmax", "--scores", x, "--out", one, "--threads", "1")
        self.ok("softmax", "--scores", x, "--out", many, "--threads", "1024")
        self.ok("softmax", "--scores", x, "--out", env_many,
                env=dict(os.environ, QKV_NUM_THREADS="1024"))
        self.assertEqual(self.read(many), self.read(one))
        self.assertEqual(self.read(env_many), self.read(one))


# ---- 3. labels and paths never reach gnuplot as commands ---------------------------------

INJECTION = 'x\nsystem "touch PWNED"\ny'


class InjectionTest(RobustTest):
    def assert_not_run(self):
        self.assertFalse(os.path.exists(self.path("PWNED")), "a gnuplot command ran")

    def test_labels_with_a_line_end_are_refused(self):
        w = self.save("w.npy", np.eye(3))
        out = self.path("fig.svg")
        for option, named in (("--xlabel", "xlabel"), ("--ylabel", "ylabel"),
                              ("--titles", "titles[0]")):
            for text in (INJECTION, INJECTION.replace("\n", "\r"), "a\x1b[31mb"):
                with self.subTest(option=option, text=text):
                    r = self.run_qkv(["heatmap", "--weights", w, option, text, "--out", out],
                                     cwd=self.dir)
                    self.expect_exit(r, 2, "heatmap", named, "control character")
                    self.assert_not_run()
                    self.assertFalse(os.path.exists(out))
                    self.assertEqual(self.leftovers(), [])

    def test_quotes_and_backquotes_are_text(self):
        w = self.save("w.npy", np.eye(3))
        out = self.path("fig.svg")
        label = "it's `touch PWNED` \"q\" @x \\"
        r = self.run_qkv(["heatmap", "--weights", w, "--xlabel", label, "--ylabel", label,
                          "--titles", label, "--out", out], cwd=self.dir)
        self.expect_exit(r, 0, "heatmap")
        self.assert_not_run()
        svg = self.read(out).decode()
        self.assertIn("`touch PWNED`", svg)
        self.assertTrue(svg.rstrip().endswith("</svg>"))

    def test_an_output_path_with_line_ends_is_only_a_name(self):
        w = self.save("w.npy", np.eye(3))
        for ext in ("svg", "png"):
            name = f'fig\nsystem "touch PWNED"\n.{ext}'
            r = self.run_qkv(["heatmap", "--weights", w, "--out", name], cwd=self.dir)
            self.expect_exit(r, 0, "heatmap")
            self.assert_not_run()
            data = self.read(self.path(name))
            self.assertTrue(data.rstrip().endswith(b"</svg>") if ext == "svg"
                            else data.endswith(PNG_END))
        self.assertEqual(self.leftovers(), [])

    def test_demo_folder_with_line_ends(self):
        folder = 'figs\nsystem "touch PWNED"\n'
        r = self.run_qkv(["demo", "--out", folder], cwd=self.dir, timeout=300)
        self.expect_exit(r, 0, "demo")
        self.assert_not_run()
        figures = [n for n in os.listdir(self.path(folder)) if n.endswith(".png")]
        self.assertGreaterEqual(len(figures), 10)
        for name in figures:
            self.assertTrue(self.read(os.path.join(self.path(folder), name)).endswith(PNG_END))


# ---- 4. a full disk never clobbers a figure --------------------------------------------------

class FullDiskTest(RobustTest):
    def test_heatmap_keeps_the_old_figure(self):
        w = self.save("w.npy", self.rng.random((40, 40)))
        for ext in ("png", "pdf", "svg"):
            with self.subTest(ext=ext):
                fresh = self.path(f"fresh.{ext}")
                self.ok("heatmap", "--weights", w, "--out", fresh)
                size = os.path.getsize(fresh)
                out = self.write(f"fig.{ext}", b"the old figure " + ext.encode())
                # Room for all but the last bytes, and for a third of the figure.
                for limit in (size - 8, size // 3):
                    r = self.run_qkv(["heatmap", "--weights", w, "--out", out], fsize=limit)
                    self.expect_exit(r, 1, "heatmap", out)
                    self.assertEqual(self.read(out), b"the old figure " + ext.encode())
                    self.assertEqual(self.leftovers(), [])

    def test_demo_leaves_no_incomplete_figure(self):
        folder = self.path("figs")
        r = self.run_qkv(["demo", "--out", folder], fsize=2000, timeout=300)
        self.expect_exit(r, 1, "demo", folder)
        for name in os.listdir(folder):
            self.assertFalse(name.startswith("."), f"left behind: {name}")
            if name.endswith(".png"):
                self.assertTrue(self.read(os.path.join(folder, name)).endswith(PNG_END), name)

    def test_npy_output_keeps_the_old_file(self):
        x = self.scores(shape=(2, 100, 100))
        out = self.write("w.npy", b"the old weights")
        r = self.run_qkv(["softmax", "--scores", x, "--out", out], fsize=4096)
        self.expect_exit(r, 1, "softmax", "--out", "File too large")
        self.assertEqual(self.read(out), b"the old weights")
        self.assertEqual(self.leftovers(), [])


# ---- 5. devices and FIFOs are written through, symlinks to their target ----------------------

class SpecialOutputsTest(RobustTest):
    def null_device(self, name):
        """A character device to write to: as root a private copy of /dev/null
        (so a regression cannot replace the system's), else /dev/null itself,
        which a user cannot replace anyway."""
        if os.geteuid() != 0:
            return "/dev/null"
        path = self.path(name)
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        return path

    def assert_device(self, path):
        self.assertTrue(stat.S_ISCHR(os.stat(path).st_mode), f"{path} is no longer a device")

    def test_devices_stay_devices(self):
        x = self.scores()
        dev = self.null_device("null")
        self.ok("softmax", "--scores", x, "--out", dev)
        self.assert_device(dev)
        self.ok("attend", "--scoring", "dot", "--queries", x, "--keys", x, "--values", x,
                "--out", dev, "--weights", dev, "--lse", dev)
        self.assert_device(dev)
        r = self.run_qkv(["regress", "--train", self.train_csv(), "--grid", "0:5:1", "--kernel",
                          "gaussian", "--bandwidth", "1", "--out", dev])
        self.expect_exit(r, 0, "regress")
        self.assert_device(dev)
        if os.geteuid() == 0:
            fig = self.null_device("fig.png")
            self.ok("heatmap", "--weights", x, "--out", fig)
            self.assert_device(fig)
        self.assertEqual(self.leftovers(), [])

    def test_fifos_get_the_bytes_and_stay_fifos(self):
        x = self.scores()
        expected = self.path("expected.npy")
        self.ok("softmax", "--scores", x, "--out", expected)
        for name, args in (("w.npy", ["softmax", "--scores", x, "--out"]),
                           ("fig.png", ["heatmap", "--weights", x, "--out"])):
            fifo = self.path(name)
            os.mkfifo(fifo)
            got = []
            reader = drain_fifo(fifo, got)
            self.ok(*args, fifo)
            reader.join(30)
            self.assertEqual(len(got), 1, "the reader got nothing")
            self.assertTrue(stat.S_ISFIFO(os.stat(fifo).st_mode))
            if name.endswith(".npy"):
                self.assertEqual(got[0], self.read(expected))
            else:
                self.assertTrue(got[0].startswith(b"\x89PNG") and got[0].endswith(PNG_END))
        self.assertEqual(self.leftovers(), [])

    def test_symlinks_stay_links_and_their_targets_are_replaced(self):
        x = self.scores()
        expected = self.path("expected.npy")
        self.ok("softmax", "--scores", x, "--out", expected)
        os.mkdir(self.path("real"))
        target = self.write("real/w.npy", b"old target")
        os.symlink("real/w.npy", self.path("link.npy"))          # relative, into a folder
        os.symlink(self.path("link.npy"), self.path("chain.npy"))  # a link to the link
        os.symlink("real/new.npy", self.path("dangling.npy"))      # target not there yet
        for link in ("link.npy", "chain.npy", "dangling.npy"):
            with self.subTest(link=link):
                before = os.readlink(self.path(link))
                self.ok("softmax", "--scores", x, "--out", self.path(link))
                self.assertTrue(os.path.islink(self.path(link)))
                self.assertEqual(os.readlink(self.path(link)), before)
        self.assertEqual(self.read(target), self.read(expected))
        self.assertEqual(self.read(self.path("real/new.npy")), self.read(expected))
        os.symlink("real/fig.svg", self.path("fig.svg"))
        self.ok("heatmap", "--weights", x, "--out", self.path("fig.svg"))
        self.assertTrue(os.path.islink(self.path("fig.svg")))
        self.assertTrue(self.read(self.path("real/fig.svg")).rstrip().endswith(b"</svg>"))
        self.assertEqual(self.leftovers(self.dir, self.path("real")), [])


# ---- 6. out of memory: exit 1, promptly -------------------------------------------------------

class OutOfMemoryTest(RobustTest):
    def test_attend_under_a_memory_limit_exits_1(self):
        for name in ("q", "k", "v"):
            self.save(f"{name}.npy", self.rng.normal(size=(1, 8000, 64)).astype(np.float32))
        args = ["attend", "--scoring", "dot", "--queries", self.path("q.npy"), "--keys",
                self.path("k.npy"), "--values", self.path("v.npy"), "--weights",
                self.path("w.npy"), "--out", self.path("o.npy"), "--threads", "2"]
        # The (1, 8000, 8000) float32 weights alone need 256 MB. The release
        # build runs under `ulimit -v 100000` (which also starved OpenBLAS's
        # own threads and hung the exit). AddressSanitizer cannot run under an
        # address-space limit and makes a failed operator new fatal with its
        # own report (never std::bad_alloc), so there the allocator is capped
        # instead and the test holds the run to ending promptly with status 1
        # and an out-of-memory report.
        asan = is_asan_build()
        env = dict(os.environ, ASAN_OPTIONS="allocator_may_return_null=1:"
                   "max_allocation_size_mb=90") if asan else None
        for attempt in range(6):
            with self.subTest(attempt=attempt):
                start = time.monotonic()
                try:
                    r = self.run_qkv(args, address_space=None if asan else 100000 * 1024,
                                     timeout=30, env=env)
                except subprocess.TimeoutExpired:
                    self.fail("qkv attend did not exit within 30 s under the memory limit")
                if asan:
                    self.assertEqual(r.returncode, 1, r.stderr.decode(errors="replace"))
                    self.assertIn(b"out of memory", r.stderr)
                else:
                    self.expect_exit(r, 1, "attend", "out of memory")
                self.assertLess(time.monotonic() - start, 30)
                self.assertFalse(os.path.exists(self.path("o.npy")))
                self.assertEqual(self.leftovers(), [])


# ---- 7. a FIFO input is opened once ------------------------------------------------------------

class FifoInputTest(RobustTest):
    def run_with_fifos(self, command, args, fifos, expected_out, out, tries=20):
        """Runs `args` `tries` times, each time feeding every FIFO of `fifos`
        ({path: bytes}) from a writer thread; each run must finish within
        20 s and write `expected_out` to `out`."""
        for path in fifos:
            os.mkfifo(path)
        for attempt in range(tries):
            with self.subTest(attempt=attempt):
                for path, data in fifos.items():
                    feed_fifo(path, data)
                try:
                    r = self.run_qkv(args, timeout=20)
                except subprocess.TimeoutExpired:
                    # Unblock writers still waiting for a reader.
                    for path in fifos:
                        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                        os.close(fd)
                    self.fail(f"qkv {command} hung reading a FIFO (attempt {attempt})")
                self.expect_exit(r, 0, command)
                self.assertEqual(self.read(out), expected_out)

    def test_npy_inputs(self):
        x = self.scores()
        out, expected = self.path("w.npy"), self.path("expected.npy")
        self.ok("softmax", "--scores", x, "--out", expected)
        fifo = self.path("scores.npy")
        self.run_with_fifos("softmax", ["softmax", "--scores", fifo, "--out", out],
                            {fifo: self.read(x)}, self.read(expected), out)

    def test_attend_with_every_input_a_fifo(self):
        q, k, v = self.attention_inputs(np.float32)
        files = {n: self.save(f"{n}-file.npy", a) for n, a in (("q", q), ("k", k), ("v", v))}
        lens = self.save("lens-file.npy", np.array([2, 5]))
        out, expected = self.path("o.npy"), self.path("expected.npy")
        self.ok("attend", "--scoring", "dot", "--queries", files["q"], "--keys", files["k"],
                "--values", files["v"], "--valid-lens", lens, "--out", expected)
        fifos = {self.path(f"{n}.npy"): self.read(p) for n, p in files.items()}
        fifos[self.path("lens.npy")] = self.read(lens)
        self.run_with_fifos("attend", ["attend", "--scoring", "dot", "--queries",
                                       self.path("q.npy"), "--keys", self.path("k.npy"),
                                       "--values", self.path("v.npy"), "--valid-lens",
                                       self.path("lens.npy"), "--out", out],
                            fifos, self.read(expected), out, tries=10)

    def test_regress_csv_and_npy_inputs(self):
        train = self.train_csv()
        query = self.save("q-file.npy", np.linspace(0, 5, 7))
        out, expected = self.path("p.csv"), self.path("expected.csv")
        common = ["--kernel", "gaussian", "--bandwidth", "1", "--json"]  # no summary on stderr
        self.ok("regress", "--train", train, "--query", query, *common, "--out", expected)
        fifos = {self.path("train.fifo"): self.read(train), self.path("q.fifo"): self.read(query)}
        self.run_with_fifos("regress", ["regress", "--train", self.path("train.fifo"), "--query",
                                        self.path("q.fifo"), *common, "--out", out],
                            fifos, self.read(expected), out, tries=10)

    def test_lookup_table(self):
        fifo = self.path("table.csv")
        os.mkfifo(fifo)
        for attempt in range(10):
            feed_fifo(fifo, b"key,value\napple,red\nbanana,yellow\n")
            try:
                r = self.run_qkv(["lookup", "--table", fifo, "--query", "apple", "--mode",
                                  "exact", "--json"], timeout=20)
            except subprocess.TimeoutExpired:
                os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
                self.fail(f"qkv lookup hung reading a FIFO (attempt {attempt})")
            self.expect_exit(r, 0, "lookup")
            self.assertEqual(json.loads(r.stdout)["match"], {"key": "apple", "value": "red"})


# ---- 8. endless inputs are refused after their first bytes ------------------------------------

class EndlessInputTest(RobustTest):
    def refuses(self, command, args, *fragments):
        # The memory cap only guards the machine should a reader regress and
        # read on; a correct one stops after a few bytes.
        cap = None if is_asan_build() else 2 << 30
        try:
            r = self.run_qkv(args, timeout=20, address_space=cap)
        except subprocess.TimeoutExpired:
            self.fail(f"qkv {' '.join(map(str, args))} kept reading /dev/zero")
        self.expect_exit(r, 2, command, "/dev/zero", *fragments)

    def test_npy_inputs(self):
        x = self.scores()
        q, k, v = self.attention_inputs(np.float32)
        q, k, v = (self.save(f"{n}.npy", a) for n, a in (("q", q), ("k", k), ("v", v)))
        w_q, w_k, w_v = (self.save(f"w{n}.npy", a)
                         for n, a in zip("qkv", self.additive_params(np.float32)))
        out = self.path("o.npy")
        bad = "not a .npy file"
        self.refuses("softmax", ["softmax", "--scores", "/dev/zero", "--out", out], "--scores", bad)
        self.refuses("softmax", ["softmax", "--scores", x, "--valid-lens", "/dev/zero", "--out",
                                 out], "--valid-lens", bad)
        dot = {"--queries": q, "--keys": k, "--values": v}
        for option in ("--queries", "--keys", "--values", "--valid-lens"):
            args = dict(dot, **{option: "/dev/zero"})
            self.refuses("attend", ["attend", "--scoring", "dot", "--out", out]
                         + [a for kv in args.items() for a in kv], option, bad)
        additive = dict(dot, **{"--wq": w_q, "--wk": w_k, "--wv": w_v})
        for option in ("--wq", "--wk", "--wv"):
            args = dict(additive, **{option: "/dev/zero"})
            self.refuses("attend", ["attend", "--scoring", "additive", "--out", out]
                         + [a for kv in args.items() for a in kv], option, bad)
        self.refuses("heatmap", ["heatmap", "--weights", "/dev/zero", "--out",
                                 self.path("f.png")], "--weights", bad)
        self.assertFalse(os.path.exists(out))

    def test_csv_inputs(self):
        common = ["--kernel", "gaussian", "--bandwidth", "1", "--out", self.path("p.csv")]
        self.refuses("regress", ["regress", "--train", "/dev/zero", "--grid", "0:5:1", *common],
                     "NUL byte")
        self.refuses("regress", ["regress", "--train", self.train_csv(), "--query", "/dev/zero",
                                 *common], "NUL byte")
        self.refuses("lookup", ["lookup", "--table", "/dev/zero", "--query", "a"], "--table",
                     "NUL byte")

    def test_a_directory_is_named_as_one(self):
        for args in (["lookup", "--table", self.dir, "--query", "a"],
                     ["regress", "--train", self.dir, "--grid", "0:5:1", "--kernel", "gaussian",
                      "--bandwidth", "1", "--out", self.path("p.csv")],
                     ["softmax", "--scores", self.dir, "--out", self.path("o.npy")]):
            r = self.run_qkv(args)
            self.expect_exit(r, 2, args[0], self.dir, "is a directory")


# ---- 10. unusable output paths are found before any work --------------------------------------

class OutputPathsTest(RobustTest):
    def test_every_output_option(self):
        x = self.scores()
        missing = self.path("missing-input.npy")  # read only if the outputs were accepted
        regress = ["regress", "--train", missing, "--grid", "0:5:1", "--kernel", "gaussian",
                   "--bandwidth", "1"]
        attend = ["attend", "--scoring", "dot", "--queries", missing, "--keys", x, "--values", x]
        cases = [  # (command, the arguments before the output, the output option)
            ("softmax", ["softmax", "--scores", missing], "--out"),
            ("attend", attend, "--out"),
            ("attend", attend + ["--out", self.path("o.npy")], "--weights"),
            ("attend", attend + ["--out", self.path("o.npy")], "--lse"),
            ("regress", regress, "--out"),
            ("regress", regress + ["--out", self.path("p.csv")], "--weights"),
            ("heatmap", ["heatmap", "--weights", missing], "--out"),
        ]
        bad_paths = {"": "empty", self.path("no/such/dir/out.npy"): "No such file or directory",
                     self.dir: "directory"}
        for command, args, option in cases:
            for path, fragment in bad_paths.items():
                if command == "heatmap" and path.endswith(".npy"):
                    path = path[:-4] + ".png"
                with self.subTest(command=command, option=option, path=path):
                    r = self.run_qkv(args + [option, path])
                    stderr = self.expect_exit(r, 2, command, option, fragment)
                    self.assertNotIn("missing-input", stderr, "an input was read first")
        self.assertEqual(os.listdir(self.dir), ["x.npy"])

    def test_demo_folder(self):
        blocker = self.write("file", b"x")
        for path, fragment in (("", "empty"), (os.path.join(blocker, "sub"), blocker)):
            r = self.run_qkv(["demo", "--out", path])
            self.expect_exit(r, 2, "demo", "--out", fragment)


# ---- empty option values are errors, not defaults --------------------------------------------

class EmptyValuesTest(RobustTest):
    def test_numbers_and_paths(self):
        x = self.scores()
        out = self.path("o.npy")
        dot = ["attend", "--scoring", "dot", "--queries", x, "--keys", x, "--values", x,
               "--out", out]
        regress = ["regress", "--train", self.train_csv(), "--grid", "0:5:1", "--kernel",
                   "gaussian", "--out", self.path("p.csv")]
        cases = [
            ("attend", dot, "--scale"), ("attend", dot, "--dropout"), ("attend", dot, "--seed"),
            ("attend", dot, "--threads"), ("attend", dot, "--valid-lens"),
            ("attend", dot, "--weights"), ("attend", dot, "--lse"),
            ("attend", ["attend", "--scoring", "additive", "--queries", x, "--keys", x,
                        "--values", x, "--wk", x, "--wv", x, "--out", out], "--wq"),
            ("softmax", ["softmax", "--scores", x, "--out", out], "--threads"),
            ("softmax", ["softmax", "--scores", x, "--out", out], "--valid-lens"),
            ("lookup", ["lookup", "--query", "Li"], "--temperature"),
            ("lookup", ["lookup", "--query", "Li"], "--top-k"),
            ("lookup", ["lookup", "--query", "Li"], "--top"),
            ("lookup", ["lookup", "--query", "Li"], "--table"),
            ("regress", regress + ["--bandwidth", "learn"], "--epochs"),
            ("regress", regress + ["--bandwidth", "learn"], "--lr"),
            ("regress", regress + ["--bandwidth", "learn"], "--seed"),
            ("regress", regress + ["--bandwidth", "1"], "--weights"),
            ("regress", regress[:3] + regress[5:] + ["--bandwidth", "1"], "--query"),
            ("demo", ["demo", "--out", self.path("d")], "--seed"),
            ("demo", ["demo", "--out", self.path("d")], "--threads"),
        ]
        for command, args, option in cases:
            with self.subTest(command=command, option=option):
                for p in (out, self.path("p.csv")):  # left by a failed case before
                    if os.path.exists(p):
                        os.remove(p)
                r = self.run_qkv(args + [option, ""])
                self.expect_exit(r, 2, command, option)
                self.assertFalse(os.path.exists(out))
                self.assertFalse(os.path.exists(self.path("p.csv")))
        for value in ("x", "1.5x", "--"):
            r = self.run_qkv(dot + ["--scale", value])
            self.expect_exit(r, 2, "attend", "--scale")
        r = self.run_qkv(["lookup", "--query", "Li", "--top-k", "1.5"])
        self.expect_exit(r, 2, "lookup", "--top-k")
        r = self.run_qkv(["lookup", "--query", "Li", "--top", "1.5"])
        self.expect_exit(r, 2, "lookup", "--top")


# ---- SIGTERM and SIGINT remove the staged temporary files ------------------------------------

class SignalsTest(RobustTest):
    def test_a_killed_run_leaves_no_temporary_file(self):
        for name in ("q", "k"):
            self.save(f"{name}.npy", self.rng.normal(size=(1, 7000, 16)).astype(np.float32))
        self.save("v.npy", self.rng.normal(size=(1, 7000, 4)).astype(np.float32))
        args = [test_cli.QKV, "attend", "--scoring", "dot", "--queries", self.path("q.npy"),
                "--keys", self.path("k.npy"), "--values", self.path("v.npy"),
                "--out", self.path("o.npy"), "--weights", self.path("w.npy")]  # 196 MB
        for sig in (signal.SIGTERM, signal.SIGINT):
            killed = 0
            for attempt in range(10):
                # The signal's default action, even if this test runs with it
                # ignored (a background job ignores SIGINT).
                p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
                deadline = time.monotonic() + 60
                while not self.leftovers() and p.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.0005)
                if self.leftovers():
                    p.send_signal(sig)
                p.communicate(timeout=60)
                self.assertEqual(self.leftovers(), [], f"{sig.name}: temporary files left")
                if p.returncode == -sig:
                    killed += 1
                    self.assertFalse(os.path.exists(self.path("w.npy")))
                    if killed == 2:
                        break
                else:  # finished before the signal came: a clean success
                    self.assertEqual(p.returncode, 0)
                for name in ("o.npy", "w.npy"):
                    if os.path.exists(self.path(name)):
                        os.remove(self.path(name))
            self.assertGreater(killed, 0, f"no run was caught writing to send {sig.name} to")


# ---- JSON output is valid whatever the bytes -----------------------------------------------

class JsonTest(RobustTest):
    def test_lookup_query_and_table_that_are_not_utf8(self):
        r = self.run_qkv(["lookup", "--query", b"L\xffi\x01\xc3", "--json"])
        self.expect_exit(r, 0, "lookup")
        result = json.loads(r.stdout)  # bytes: decoded as strict UTF-8
        self.assertEqual(result["query"], "L\ufffdi\x01\ufffd")
        table = self.write("t.csv", "key,value\nna\u00efve,caf\u00e9\n".encode()
                           + b"k\xed\xa0\x80,v\xf8\n\"q\"\"\\\x1f\",x\n")
        r = self.run_qkv(["lookup", "--table", table, "--query", "naive", "--json",
                          "--all"])
        self.expect_exit(r, 0, "lookup")
        records = json.loads(r.stdout)["records"]
        self.assertEqual([(x["key"], x["value"]) for x in records],
                         [("na\u00efve", "caf\u00e9"), ("k\ufffd\ufffd\ufffd", "v\ufffd"),
                          ('q"\\\x1f', "x")])

    def test_regress_column_names_that_are_not_utf8(self):
        train = self.write("t.csv", b"x\xff,y\n1,2\n2,3\n3,5\n")
        r = self.run_qkv(["regress", "--train", train, "--grid", "0:3:1", "--kernel",
                          "gaussian", "--bandwidth", "1", "--out", self.path("p.csv"), "--json"])
        self.expect_exit(r, 0, "regress")
        self.assertEqual(json.loads(r.stdout)["x_cols"], ["x\ufffd"])


if __name__ == "__main__":
    test_cli.main()
