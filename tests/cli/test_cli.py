#!/usr/bin/python3
"""Tests of the `qkv` command's plumbing: options, file conventions, exit
statuses, error messages and atomic outputs. The ops' numerics are tested
elsewhere; here a few results are compared with small NumPy computations.

Usage: test_cli.py --qkv PATH [unittest arguments, e.g. a TestCase name]
NumPy is required: if it cannot be imported this script fails.
"""

import os
import pty
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

QKV = None  # path of the qkv binary, from --qkv

# Pass if |got - ref| <= atol + rtol * |ref|; float32 keeps ~7 digits through
# sums over a few dozen terms, float64 ~16.
TOL = {np.float32: dict(rtol=1e-5, atol=1e-6), np.float64: dict(rtol=1e-12, atol=1e-13)}


def run(*args, env=None):
    return subprocess.run([QKV] + [str(a) for a in args], capture_output=True, text=True,
                          timeout=120, env=env)


def run_on_a_terminal(*args):
    """Runs qkv with its stderr on a pseudo-terminal (where progress is a
    bar): (exit status, stdout bytes, what the terminal showed)."""
    leader, follower = pty.openpty()
    p = subprocess.Popen([QKV] + [str(a) for a in args], stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    shown = b""
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the terminal's other end closed: qkv exited
            break
        if not data:
            break
        shown += data
    os.close(leader)
    status = p.wait(timeout=120)
    out = p.stdout.read()
    p.stdout.close()
    return status, out, shown.decode()


# ---- NumPy references (float64) ----------------------------------------------

def lengths_of(lens, batch, num_queries, num_keys):
    if lens is None:
        return np.full((batch, num_queries), num_keys)
    lens = np.asarray(lens)
    return np.repeat(lens[:, None], num_queries, 1) if lens.ndim == 1 else lens


def np_masked_softmax(x, lens=None):
    x = np.asarray(x, dtype=np.float64)
    lengths = lengths_of(lens, *x.shape)
    mask = np.arange(x.shape[2])[None, None, :] < lengths[:, :, None]
    m = np.where(mask, x, -np.inf).max(axis=2, keepdims=True)
    e = np.where(mask, np.exp(np.where(mask, x, 0.0) - np.where(np.isfinite(m), m, 0.0)), 0.0)
    s = e.sum(axis=2, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):  # L = 0: zeros, lse -inf
        return np.where(s > 0, e / np.where(s > 0, s, 1.0), 0.0), (np.log(s) + m)[:, :, 0]


def np_attention(scores, values, lens=None):
    w, lse = np_masked_softmax(scores, lens)
    return w @ np.asarray(values, dtype=np.float64), w, lse


def np_dot(q, k, v, lens=None, scale=None):
    q, k = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    return np_attention(q @ k.transpose(0, 2, 1) * scale, v, lens)


def np_additive(q, k, v, w_q, w_k, w_v, lens=None):
    f64 = lambda a: np.asarray(a, dtype=np.float64)
    features = np.tanh((f64(q) @ f64(w_q).T)[:, :, None, :] + (f64(k) @ f64(w_k).T)[:, None, :, :])
    return np_attention(features @ f64(w_v).reshape(-1), v, lens)


# ---- the harness ---------------------------------------------------------------

class CliTest(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="qkv-cli-test-")
        self.dir = self._tmp.name
        self.rng = np.random.default_rng(abs(hash(self.id())) % 2**32)

    def tearDown(self):
        self._tmp.cleanup()

    def path(self, name):
        return os.path.join(self.dir, name)

    def save(self, name, array):
        path = self.path(name)
        np.save(path, array)
        return path

    def ok(self, *args, env=None):
        r = run(*args, env=env)
        self.assertEqual(r.returncode, 0,
                         f"qkv {' '.join(map(str, args))}\nstdout: {r.stdout}\nstderr: {r.stderr}")
        self.assertEqual(r.stderr, "", "a successful run prints nothing on stderr")
        return r

    def load(self, path, dtype, shape):
        self.assertTrue(os.path.exists(path), f"qkv wrote no {path}")
        got = np.load(path)
        self.assertEqual(got.dtype, np.dtype(dtype), path)
        self.assertEqual(got.shape, tuple(shape), path)
        return got

    def assertClose(self, got, ref, dtype):
        np.testing.assert_allclose(got.astype(np.float64), ref, **TOL[dtype])

    def listing(self, directories):
        return {d: sorted(os.listdir(d)) for d in directories if os.path.isdir(d)}

    def expect_error(self, command, args, outputs=(), fragments=()):
        """Runs qkv twice, first with every output absent and then with each
        output (whose directory exists) holding a sentinel: both runs must exit
        2 with `qkv <command>: error:` and the fragments on stderr, nothing on
        stdout, and leave the outputs and their directories as they were."""
        directories = {os.path.dirname(p) or "." for p in outputs}
        for existing in (False, True):
            sentinels = {}
            for p in outputs:
                if os.path.isdir(p):
                    continue
                if existing and os.path.isdir(os.path.dirname(p) or "."):
                    sentinels[p] = b"sentinel " + p.encode()
                    with open(p, "wb") as f:
                        f.write(sentinels[p])
                elif os.path.exists(p):
                    os.remove(p)
            before = self.listing(directories)
            r = run(*args)
            context = (f"qkv {' '.join(map(str, args))}\nexit {r.returncode}\n"
                       f"stderr: {r.stderr}")
            self.assertEqual(r.returncode, 2, context)
            prefix = f"qkv {command}: error: " if command else "qkv: error: "
            self.assertTrue(r.stderr.startswith(prefix), context)
            for fragment in fragments:
                self.assertIn(fragment, r.stderr, context)
            self.assertEqual(r.stdout, "", context)
            for p in outputs:
                if os.path.isdir(p):
                    continue
                if p in sentinels:
                    with open(p, "rb") as f:
                        self.assertEqual(f.read(), sentinels[p], f"{p} was clobbered\n{context}")
                else:
                    self.assertFalse(os.path.exists(p), f"{p} was written\n{context}")
            self.assertEqual(self.listing(directories), before, f"files left behind\n{context}")
        return r

    def interrupted(self, args, took):
        """Runs qkv with args and sends it a catchable signal at a random
        moment of the `took` seconds it takes; its exit status and how long
        it ran."""
        start = time.monotonic()
        p = subprocess.Popen([QKV, *args], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        time.sleep(self.rng.uniform(0.0, took * 0.9))
        p.send_signal(self.rng.choice([signal.SIGINT, signal.SIGTERM, signal.SIGHUP]))
        status = p.wait(timeout=300)
        return status, time.monotonic() - start

    def signal_at_random_moments(self, args, took, prepare, check):
        """Interrupts `args` at random moments, at least 6 times and until a
        signal has landed mid-run, calling prepare() before and check(status)
        after each run; how many runs it stopped. A run that finished before
        its signal sets the next runs' window to its own length: on a loaded
        machine the timed run may take several times longer than the later
        ones (CI once saw 6 of 6 finish first), so a fixed window can miss."""
        stopped = 0
        for attempt in range(40):
            if attempt >= 6 and stopped > 0:
                break
            prepare()
            status, ran = self.interrupted(args, took)
            check(status)
            if status < 0:
                stopped += 1
            else:
                took = ran
        self.assertGreater(stopped, 0)  # the signals did land mid-run
        return stopped

    # Inputs shared by many tests.
    def attention_inputs(self, dtype, batch=2, num_queries=3, num_keys=5, head_dim=4,
                         value_dim=6):
        q = self.rng.normal(size=(batch, num_queries, head_dim)).astype(dtype)
        k = self.rng.normal(size=(batch, num_keys, head_dim)).astype(dtype)
        v = self.rng.normal(size=(batch, num_keys, value_dim)).astype(dtype)
        return q, k, v

    def additive_params(self, dtype, hiddens=7, query_size=4, key_size=4, w_v_2d=False):
        w_q = self.rng.normal(size=(hiddens, query_size)).astype(dtype)
        w_k = self.rng.normal(size=(hiddens, key_size)).astype(dtype)
        w_v = self.rng.normal(size=(1, hiddens) if w_v_2d else (hiddens,)).astype(dtype)
        return w_q, w_k, w_v

    def dot_args(self, q, k, v, out="o.npy"):
        return ["attend", "--scoring", "dot", "--queries", self.save("q.npy", q),
                "--keys", self.save("k.npy", k), "--values", self.save("v.npy", v),
                "--out", self.path(out)]

    def additive_args(self, q, k, v, w_q, w_k, w_v, out="o.npy"):
        return ["attend", "--scoring", "additive", "--queries", self.save("q.npy", q),
                "--keys", self.save("k.npy", k), "--values", self.save("v.npy", v),
                "--wq", self.save("wq.npy", w_q), "--wk", self.save("wk.npy", w_k),
                "--wv", self.save("wv.npy", w_v), "--out", self.path(out)]


# ---- qkv info --------------------------------------------------------------------

def cpu_flags():
    """The CPU's feature flags from /proc/cpuinfo (the reference for qkv info)."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def cpu_vendor():
    """The CPU's vendor_id from /proc/cpuinfo (GenuineIntel, AuthenticAMD)."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    return ""


class InfoTest(CliTest):
    """`qkv info`: the CPU's features, the SIMD targets compiled and supported, the
    one chosen (QKV_SIMD_TARGET caps it), the bf16 path; text and --json."""

    def info(self, target=None):
        env = dict(os.environ)
        env.pop("QKV_SIMD_TARGET", None)
        if target is not None:
            env["QKV_SIMD_TARGET"] = target
        r = run("info", "--json", env=env)
        self.assertEqual(r.returncode, 0, r.stderr)
        return __import__("json").loads(r.stdout)

    def test_json_describes_this_machine(self):
        info = self.info()
        self.assertEqual(info["version"], self.ok("--version").stdout.split()[1])
        flags = cpu_flags()
        # /proc/cpuinfo spells them sse4_2, avx512_bf16, amx_tile; qkv the compiler's way.
        spelled = {"sse4.2": "sse4_2", "avx512bf16": "avx512_bf16", "amx-tile": "amx_tile",
                   "amx-bf16": "amx_bf16"}
        for feature in info["cpu_features"]:
            self.assertIn(spelled.get(feature, feature), flags, feature)
        for feature in info["cpu_features_missing"]:
            self.assertNotIn(spelled.get(feature, feature), flags, feature)
        compiled, supported = info["simd_targets_compiled"], info["simd_targets_supported"]
        self.assertEqual([t for t in compiled if t in supported], supported)
        self.assertEqual(supported[-1], "scalar")
        # (the sanitizer build compiles only the best target and scalar)
        self.assertEqual("avx2" in supported, "avx2" in compiled and {"avx2", "fma"} <= flags)
        self.assertEqual(info["simd_target"], supported[0])
        self.assertIsNone(info["simd_cap"])
        # bf16 products: AMX where the CPU has it; VDPBF16PS only off Intel,
        # whose cores issue it at half the FMA rate (slower than float32).
        intel = cpu_vendor() == "GenuineIntel"
        amx = {"amx_tile", "amx_bf16"} <= flags and "avx512" in supported
        dot = "avx512_bf16" in flags and "avx512" in supported and not intel
        expected = "amx" if amx else "avx512_bf16" if dot else "widen"
        self.assertEqual(info["bf16_products"], expected)
        if "avx512_bf16" in flags and intel and not amx:
            self.assertIn("Intel cores issue VDPBF16PS at half the FMA rate",
                          info["bf16_products_why"])
        self.assertTrue(info["bf16_products_why"])
        self.assertTrue(info["blas"].startswith("OpenBLAS"), info["blas"])
        self.assertGreaterEqual(info["threads"], 1)

    def test_the_cap_chooses_the_target(self):
        supported = self.info()["simd_targets_supported"]
        for target in supported:
            info = self.info(target)
            self.assertEqual(info["simd_target"], target)
            self.assertEqual(info["simd_cap"], target)
            if not target.startswith("avx512"):
                self.assertEqual(info["bf16_products"], "widen", target)

    def test_text(self):
        r = self.ok("info")
        for label in ("CPU:", "CPU features qkv uses:", "SIMD targets compiled:",
                      "this CPU runs:", "chosen:", "bf16 products:", "threads:", "BLAS:"):
            self.assertIn(label, r.stdout)
        chosen = next(line for line in r.stdout.splitlines() if "chosen:" in line)
        self.assertIn("the best this CPU supports", chosen)

    def test_openblas_runs_the_best_core_type_this_cpu_runs(self):
        """OpenBLAS's kernels: started on the oldest (OPENBLAS_CORETYPE=Prescott,
        what Debian's OpenBLAS runs on a CPU it does not know), qkv switches it
        to the best this CPU runs (per /proc/cpuinfo); QKV_BLAS_CORE=keep keeps
        Prescott, a cap at avx2 gives Haswell, and an unknown QKV_BLAS_CORE is
        a usage error."""
        flags = cpu_flags()
        if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
            best = {"SkylakeX", "Cooperlake"}
        elif {"avx2", "fma"} <= flags:
            best = {"Haswell", "Zen"}
        else:
            best = {"Prescott"}
        base = {k: v for k, v in os.environ.items()
                if k not in ("QKV_BLAS_CORE", "QKV_SIMD_TARGET")}
        base["OPENBLAS_CORETYPE"] = "Prescott"

        def info(**extra):
            r = run("info", "--json", env=dict(base, **extra))
            self.assertEqual(r.returncode, 0, r.stderr)
            return __import__("json").loads(r.stdout)

        chosen = info()
        self.assertEqual(chosen["blas_core_found"], "Prescott")
        self.assertEqual(chosen["blas_core_from"], "OPENBLAS_CORETYPE=Prescott")
        self.assertIn(chosen["blas_core"], best)
        self.assertIn(chosen["blas_core"], chosen["blas"])
        if chosen["blas_core"] != "Prescott":
            self.assertTrue(chosen["blas_core_action"].startswith(
                "switched from Prescott to " + chosen["blas_core"]), chosen["blas_core_action"])
        kept = info(QKV_BLAS_CORE="keep")
        self.assertEqual(kept["blas_core"], "Prescott")
        self.assertEqual(kept["blas_core_action"], "kept (QKV_BLAS_CORE=keep)")
        if "avx2" in chosen["simd_targets_supported"] and {"avx2", "fma"} <= flags:
            self.assertEqual(info(QKV_SIMD_TARGET="avx2")["blas_core"], "Haswell")
        text = run("info", env=base).stdout
        self.assertIn("BLAS kernels:           " + chosen["blas_core"] +
                      " (OpenBLAS chose Prescott, from OPENBLAS_CORETYPE=Prescott; qkv ", text)
        r = run("info", env=dict(base, QKV_BLAS_CORE="Pentium9"))
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn('QKV_BLAS_CORE is "Pentium9", which is not a core type of this OpenBLAS',
                      r.stderr)
        self.assertEqual(r.stdout, "")

    def test_an_unknown_target_is_a_usage_error(self):
        for target in ("avx3", "neon", "AVX2"):
            env = dict(os.environ, QKV_SIMD_TARGET=target)
            r = run("info", env=env)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertTrue(r.stderr.startswith("qkv info: error: "), r.stderr)
            self.assertIn(f'QKV_SIMD_TARGET is "{target}"', r.stderr)
            self.assertIn("expected one of: " + ", ".join(self.info()["simd_targets_supported"]),
                          r.stderr)
            self.assertEqual(r.stdout, "")


# ---- version and help ----------------------------------------------------------

class BasicsTest(CliTest):
    def test_version(self):
        r = self.ok("--version")
        self.assertRegex(r.stdout.strip(), r"^qkv \d+\.\d+\.\d+ \(MIT license\)$")
        # The license it names is the one the sources ship.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        with open(os.path.join(root, "LICENSE")) as f:
            self.assertEqual(f.readline().strip(), "MIT License")

    def test_runs_itself_once_with_openblas_single_threaded(self):
        """qkv runs itself again with OPENBLAS_NUM_THREADS=1 before any library
        starts (cli/main.cc): seen from outside while it waits on a FIFO, the
        running image has that setting (replacing another value, or added),
        the rest of the environment as given, and one thread (no OpenBLAS
        pool); then it finishes its work."""
        fifo = self.path("table.csv")
        os.mkfifo(fifo)
        for setting in (None, "4", "1"):
            with self.subTest(OPENBLAS_NUM_THREADS=setting):
                env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
                env["QKV_TEST_MARK"] = "a=b"
                if setting is not None:
                    env["OPENBLAS_NUM_THREADS"] = setting
                p = subprocess.Popen([QKV, "lookup", "--table", fifo, "--query", "Li"], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                try:
                    # /proc/PID/environ is the environment the image started
                    # with: the first image's until the restart.
                    deadline = time.monotonic() + 30
                    while True:
                        with open(f"/proc/{p.pid}/environ", "rb") as f:
                            seen = [e.decode() for e in f.read().split(b"\0") if e]
                        if "OPENBLAS_NUM_THREADS=1" in seen or time.monotonic() > deadline:
                            break
                        time.sleep(0.01)
                    expected = dict(env, OPENBLAS_NUM_THREADS="1")
                    self.assertEqual(dict(e.split("=", 1) for e in seen), expected)
                    self.assertEqual(len(seen), len(expected), "one entry per name")
                    self.assertEqual(os.listdir(f"/proc/{p.pid}/task"), [str(p.pid)])
                finally:
                    # Without blocking on a FIFO nobody will open (qkv gone).
                    while p.poll() is None:
                        try:
                            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                        except OSError:  # ENXIO: qkv has not opened it yet
                            time.sleep(0.01)
                            continue
                        os.write(fd, b"key,value\nLi,Mu\nLipton,Zachary\n")
                        os.close(fd)
                        break
                    out, err = p.communicate(timeout=60)
                self.assertEqual((p.returncode, err), (0, ""))
                self.assertIn("1     Li      Mu", out)

    def test_help(self):
        r = self.ok("--help")
        for command in ("softmax", "attend", "demo"):
            self.assertIn(command, r.stdout)

    def test_help_of_each_command(self):
        expected = {
            "softmax": ["--scores", "--valid-lens", "--out", "--threads"],
            "attend": ["--scoring", "--queries", "--keys", "--values", "--valid-lens", "--scale",
                       "--wq", "--wk", "--wv", "--dropout", "--train", "--seed", "--out",
                       "--weights", "--lse", "--threads"],
            "demo": ["--seed", "--threads"],
        }
        for command, options in expected.items():
            for flag in ("--help", "-h"):
                r = self.ok(command, flag)
                for option in options:
                    self.assertIn(option, r.stdout, f"qkv {command} {flag}")

    def test_no_command_prints_help_and_exits_2(self):
        r = run()
        self.assertEqual(r.returncode, 2)
        self.assertTrue(r.stderr.startswith("qkv: error: "), r.stderr)
        for command in ("softmax", "attend", "demo"):
            self.assertIn(command, r.stderr)

    def test_unknown_command_or_option(self):
        self.expect_error("", ["frobnicate"])
        self.expect_error("", ["--frobnicate"])
        x = self.save("x.npy", np.ones((2, 3), np.float32))
        self.expect_error("softmax", ["softmax", "--scores", x, "--out", self.path("w.npy"),
                                      "--frobnicate"], [self.path("w.npy")], ["--frobnicate"])

    def test_a_typo_is_named_first_with_the_nearest_word(self):
        """A typo hid itself: --querys gave "--queries is required",
        --valid-len listed the unknown words in reverse, `qkv atend` a
        garbled line. The unknown word comes first, with the nearest known
        one of the (sub)command it follows."""
        x = self.save("x.npy", np.ones((2, 3), np.float32))
        out = self.path("o.npy")
        attend = ["attend", "--keys", x, "--values", x, "--out", out]
        for args, command, said in (
                (attend + ["--querys", x], "attend",
                 "unknown option --querys; did you mean --queries?"),
                (attend + ["--queries", x, "--valid-len", x], "attend",
                 "unknown option --valid-len; did you mean --valid-lens?"),
                (attend + ["--queries=" + x, "--scoring", "dot", "--scael", "2"], "attend",
                 "unknown option --scael; did you mean --scale?"),
                (["atend"] + attend[1:], "", "unknown command atend; did you mean attend?"),
                (["store", "craete", self.path("s")], "store",
                 "unknown command craete; did you mean create?"),
                (["softmax", "--scores", x, "--out", out, "--frobnicate"], "softmax",
                 "unknown option --frobnicate\n")):
            r = run(*args)
            prefix = f"qkv {command}: error: " if command else "qkv: error: "
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertTrue(r.stderr.startswith(prefix + said), r.stderr)
            self.assertFalse(os.path.exists(out))
        # A value that looks like a command is a value, not a typo.
        r = run("attend", "--queries", x, "--keys", x, "--values", x, "--out", out,
                "--scoring", "dto")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertNotIn("unknown", r.stderr)


# ---- qkv softmax -------------------------------------------------------------------

class SoftmaxTest(CliTest):
    def softmax(self, scores, lens=None, extra=()):
        args = ["softmax", "--scores", self.save("x.npy", scores), "--out", self.path("w.npy")]
        if lens is not None:
            args += ["--valid-lens", self.save("l.npy", lens)]
        self.ok(*args, *extra)
        return self.load(self.path("w.npy"), scores.dtype, scores.shape)

    def test_3d_without_lens(self):
        for dtype in (np.float32, np.float64):
            x = self.rng.normal(size=(2, 3, 5)).astype(dtype)
            self.assertClose(self.softmax(x), np_masked_softmax(x)[0], dtype)

    def test_3d_with_1d_and_2d_lens(self):
        for dtype in (np.float32, np.float64):
            for int_type in (np.int32, np.int64):
                x = self.rng.normal(size=(2, 3, 5)).astype(dtype)
                for lens in (np.array([2, 5]), np.array([[1, 3, 5], [4, 2, 0]])):
                    lens = lens.astype(int_type)
                    got = self.softmax(x, lens)
                    self.assertClose(got, np_masked_softmax(x, lens)[0], dtype)

    def test_2d_is_a_batch_of_one(self):
        for dtype in (np.float32, np.float64):
            x = self.rng.normal(size=(3, 5)).astype(dtype)
            self.assertClose(self.softmax(x), np_masked_softmax(x[None])[0][0], dtype)

    def test_2d_with_one_length(self):
        x = self.rng.normal(size=(3, 5)).astype(np.float32)
        ref = np_masked_softmax(x[None], np.array([2]))[0][0]
        for lens in (np.array(2), np.array([2]), np.array([2], dtype=np.int32)):
            self.assertClose(self.softmax(x, lens), ref, np.float32)
        self.assertTrue(np.all(self.softmax(x, np.array([2]))[:, 2:] == 0))

    def test_2d_with_one_length_per_query(self):
        x = self.rng.normal(size=(3, 5)).astype(np.float64)
        per_query = np.array([1, 5, 3])
        ref = np_masked_softmax(x[None], per_query[None])[0][0]
        self.assertClose(self.softmax(x, per_query), ref, np.float64)
        self.assertClose(self.softmax(x, per_query[None]), ref, np.float64)

    def test_threads_give_identical_results(self):
        x = self.rng.normal(size=(3, 17, 33)).astype(np.float32)
        lens = self.rng.integers(0, 34, size=(3, 17))
        one = self.softmax(x, lens, ["--threads", "1"])
        two = self.softmax(x, lens, ["--threads", "2"])
        np.testing.assert_array_equal(one, two)

    def test_replaces_an_existing_output(self):
        with open(self.path("w.npy"), "wb") as f:
            f.write(b"old contents")
        x = self.rng.normal(size=(2, 2, 4)).astype(np.float32)
        self.softmax(x)
        self.assertEqual(sorted(os.listdir(self.dir)), ["w.npy", "x.npy"])

    def test_output_in_the_current_directory(self):
        x = self.rng.normal(size=(2, 4)).astype(np.float32)
        np.save(self.path("x.npy"), x)
        r = subprocess.run([QKV, "softmax", "--scores", "x.npy", "--out", "w.npy"],
                           capture_output=True, text=True, timeout=120, cwd=self.dir)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertClose(np.load(self.path("w.npy")), np_masked_softmax(x[None])[0][0], np.float32)


# ---- qkv attend --------------------------------------------------------------------

class AttendTest(CliTest):
    def test_dot_3d_f4_and_f8(self):
        for dtype in (np.float32, np.float64):
            q, k, v = self.attention_inputs(dtype)
            lens = np.array([3, 5])
            args = self.dot_args(q, k, v) + ["--valid-lens", self.save("l.npy", lens)]
            self.ok(*args)
            ref, _, _ = np_dot(q, k, v, lens)
            self.assertClose(self.load(self.path("o.npy"), dtype, (2, 3, 6)), ref, dtype)

    def test_dot_2d_f4_and_f8(self):
        for dtype in (np.float32, np.float64):
            q, k, v = self.attention_inputs(dtype, batch=1)
            lens = np.array([2, 5, 1], dtype=np.int32)
            self.ok(*self.dot_args(q[0], k[0], v[0]), "--valid-lens", self.save("l.npy", lens),
                    "--weights", self.path("w.npy"), "--lse", self.path("lse.npy"))
            ref, w, lse = np_dot(q, k, v, lens[None])
            self.assertClose(self.load(self.path("o.npy"), dtype, (3, 6)), ref[0], dtype)
            self.assertClose(self.load(self.path("w.npy"), dtype, (3, 5)), w[0], dtype)
            self.assertClose(self.load(self.path("lse.npy"), dtype, (3,)), lse[0], dtype)

    def test_dot_weights_lse_and_scale(self):
        q, k, v = self.attention_inputs(np.float64)
        lens = np.array([[1, 2, 3], [5, 4, 2]], dtype=np.int64)
        self.ok(*self.dot_args(q, k, v), "--valid-lens", self.save("l.npy", lens),
                "--scale", "0.3", "--weights", self.path("w.npy"), "--lse", self.path("lse.npy"))
        ref, w, lse = np_dot(q, k, v, lens, scale=0.3)
        self.assertClose(self.load(self.path("o.npy"), np.float64, (2, 3, 6)), ref, np.float64)
        self.assertClose(self.load(self.path("w.npy"), np.float64, (2, 3, 5)), w, np.float64)
        self.assertClose(self.load(self.path("lse.npy"), np.float64, (2, 3)), lse, np.float64)

    def test_dot_causal_top_left_and_bottom_right(self):
        # --causal is per-query lengths min(L, i + 1 + offset): the NumPy
        # reference gets them written out. 3 queries, 5 keys; bottom-right's
        # offset is Nk - Nq = 2; --causal alone means top-left.
        q, k, v = self.attention_inputs(np.float64)
        given = np.array([4, 2])
        for flag, offset in ((["--causal"], 0), (["--causal", "top-left"], 0),
                             (["--causal", "bottom-right"], 2)):
            with self.subTest(flag=flag):
                self.ok(*self.dot_args(q, k, v), "--valid-lens", self.save("l.npy", given),
                        *flag, "--lse", self.path("lse.npy"))
                cap = np.clip(np.arange(3) + 1 + offset, 0, 5)
                lens = np.minimum(given[:, None], cap[None, :])
                ref, _, lse = np_dot(q, k, v, lens)
                self.assertClose(self.load(self.path("o.npy"), np.float64, (2, 3, 6)), ref,
                                 np.float64)
                self.assertClose(self.load(self.path("lse.npy"), np.float64, (2, 3)), lse,
                                 np.float64)
        r = run(*self.dot_args(q, k, v), "--causal", "diagonal")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--causal", r.stderr)

    def test_dot_heads_and_grouped_query_attention(self):
        # (B, H, Nq, D) queries against (B, Hkv, Nk, D) keys and values: query
        # head h reads key head h // (H // Hkv); lengths (B) shared by the
        # heads; results (B, H, Nq, .). The reference: the heads folded into
        # a batch of B H with the key heads repeated.
        batch, heads, kv_heads, nq, nk, d, dv = 2, 4, 2, 3, 5, 4, 6
        for dtype in (np.float32, np.float64):
            q = self.rng.normal(size=(batch, heads, nq, d)).astype(dtype)
            k = self.rng.normal(size=(batch, kv_heads, nk, d)).astype(dtype)
            v = self.rng.normal(size=(batch, kv_heads, nk, dv)).astype(dtype)
            lens = np.array([4, 2])
            self.ok(*self.dot_args(q, k, v), "--valid-lens", self.save("l.npy", lens), "--causal",
                    "bottom-right", "--weights", self.path("w.npy"), "--lse", self.path("lse.npy"))
            group = heads // kv_heads
            flat = [x.reshape(batch * x.shape[1], *x.shape[2:])
                    for x in (q, np.repeat(k, group, 1), np.repeat(v, group, 1))]
            cap = np.clip(np.arange(nq) + 1 + nk - nq, 0, nk)
            flat_lens = np.minimum(np.repeat(lens, heads)[:, None], cap[None, :])
            ref, w, lse = np_dot(*flat, flat_lens)
            self.assertClose(self.load(self.path("o.npy"), dtype, (batch, heads, nq, dv)),
                             ref.reshape(batch, heads, nq, dv), dtype)
            self.assertClose(self.load(self.path("w.npy"), dtype, (batch, heads, nq, nk)),
                             w.reshape(batch, heads, nq, nk), dtype)
            self.assertClose(self.load(self.path("lse.npy"), dtype, (batch, heads, nq)),
                             lse.reshape(batch, heads, nq), dtype)
        q = np.zeros((2, 3, 3, 4), np.float32)
        k = np.zeros((2, 2, 5, 4), np.float32)
        self.expect_error("attend", self.dot_args(q, k, k), [self.path("o.npy")],
                          ["queries has H = 3 heads, not a multiple of the Hkv = 2 heads",
                           "[2, 3, 3, 4]", "[2, 2, 5, 4]"])
        self.expect_error("attend", self.dot_args(q, k[0], k), [self.path("o.npy")],
                          ["queries, keys and values must be all 2-D, all 3-D or all 4-D"])
        w = np.zeros((3, 4), np.float32)
        self.expect_error("attend", self.additive_args(q, k, k, w, w, w[0]), [self.path("o.npy")],
                          ["has shape [2, 3, 3, 4]; expected 2-D (Nq, D) or 3-D (B, Nq, D)"])

    def test_dot_window(self):
        # --window L,R: query i sees keys i + Nk - Nq - L <= j <= i + Nk - Nq + R;
        # the reference writes that out as per-(query, key) -inf scores.
        q, k, v = self.attention_inputs(np.float64)  # (2, 3, 4), (2, 5, 4), (2, 5, 6)
        for left, right in ((1, 0), (-1, 0), (0, 1), (2, -1)):
            with self.subTest(window=(left, right)):
                self.ok(*self.dot_args(q, k, v), "--window", f"{left},{right}",
                        "--lse", self.path("lse.npy"))
                i = np.arange(3)[:, None] + 5 - 3
                j = np.arange(5)[None, :]
                keep = ((j >= i - left) | (left < 0)) & ((j <= i + right) | (right < 0))
                scores = np.where(keep, q @ k.transpose(0, 2, 1) / 2.0, -np.inf)
                w = np.exp(scores - scores.max(-1, keepdims=True))
                w /= w.sum(-1, keepdims=True)
                self.assertClose(self.load(self.path("o.npy"), np.float64, (2, 3, 6)), w @ v,
                                 np.float64)
        for bad in ("1", "a,b", "-2,0", "1,2,3", "1,"):
            with self.subTest(bad=bad):
                r = run(*self.dot_args(q, k, v), "--window", bad)
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn("--window", r.stderr)
        w_q, w_k, w_v = self.additive_params(np.float64, key_size=4)
        self.expect_error("attend", [*self.additive_args(q, k, v, w_q, w_k, w_v), "--window",
                                     "1,0"], [self.path("o.npy")],
                          ["--window is for --scoring dot"])

    def test_dot_mask_and_key_mask(self):
        # --mask (bool or uint8, broadcast against the scores) and --key-mask
        # (B, Nk): the reference gives the masked scores -inf.
        q, k, v = self.attention_inputs(np.float64)  # (2, 3, 4), (2, 5, 4), (2, 5, 6)
        mask = self.rng.random((3, 5)) < 0.6
        mask[:, 0] = True
        keys = self.rng.random((2, 5)) < 0.7
        keys[:, 0] = True
        for mask_file in (mask, mask.astype(np.uint8), mask[None].repeat(2, 0)):
            with self.subTest(mask=(mask_file.dtype, mask_file.shape)):
                self.ok(*self.dot_args(q, k, v), "--mask", self.save("m.npy", mask_file),
                        "--key-mask", self.save("km.npy", keys))
                keep = mask[None] & keys[:, None, :]
                scores = np.where(keep, q @ k.transpose(0, 2, 1) / 2.0, -np.inf)
                w = np.exp(scores - scores.max(-1, keepdims=True))
                w /= w.sum(-1, keepdims=True)
                self.assertClose(self.load(self.path("o.npy"), np.float64, (2, 3, 6)), w @ v,
                                 np.float64)
        # 2-D inputs: a (Nk) key mask is the batch of one's.
        self.ok(*self.dot_args(q[0], k[0], v[0]), "--key-mask", self.save("km.npy", keys[0]))
        scores = np.where(keys[0][None, :], q[0] @ k[0].T / 2.0, -np.inf)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        self.assertClose(self.load(self.path("o.npy"), np.float64, (3, 6)),
                         (w / w.sum(-1, keepdims=True)) @ v[0], np.float64)
        out = [self.path("o.npy")]
        self.expect_error("attend", [*self.dot_args(q, k, v), "--mask",
                                     self.save("mf.npy", mask.astype(np.float32))], out,
                          ["--mask", "holds float32; a mask must be bool or uint8"])
        self.expect_error("attend", [*self.dot_args(q, k, v), "--mask",
                                     self.save("m4.npy", np.ones((4, 5), bool))], out,
                          ["options.mask has shape [4, 5], which does not broadcast to the "
                           "scores [2, 3, 5]"])
        self.expect_error("attend", [*self.dot_args(q, k, v), "--key-mask",
                                     self.save("k3.npy", np.ones((2, 3), bool))], out,
                          ["options.key_mask has shape [2, 3]; expected [2, 5]"])
        w_q, w_k, w_v = self.additive_params(np.float64, key_size=4)
        self.expect_error("attend", [*self.additive_args(q, k, v, w_q, w_k, w_v), "--mask",
                                     self.save("m.npy", mask)], out,
                          ["--mask is for --scoring dot"])

    def test_dot_bias(self):
        # --bias (the inputs' float type, broadcast against the scores, -inf
        # leaves a key out): the reference adds it to the scaled scores.
        for dtype in (np.float32, np.float64):
            q, k, v = self.attention_inputs(dtype)  # (2, 3, 4), (2, 5, 4), (2, 5, 6)
            bias = (2.0 * self.rng.normal(size=(3, 5))).astype(dtype)
            bias[1, 2] = -np.inf
            mask = np.ones((3, 5), bool)
            mask[0, 4] = False
            for bias_file in (bias, bias[None].repeat(2, 0), bias[None, :, :1]):
                with self.subTest(dtype=dtype, bias=bias_file.shape):
                    self.ok(*self.dot_args(q, k, v), "--bias", self.save("b.npy", bias_file),
                            "--mask", self.save("m.npy", mask), "--causal", "bottom-right",
                            "--lse", self.path("lse.npy"))
                    i = np.arange(3)[:, None] + 5 - 3
                    keep = mask & (np.arange(5)[None, :] <= i)
                    scores = q.astype(np.float64) @ k.astype(np.float64).transpose(0, 2, 1) / 2.0
                    scores = np.where(keep, scores + bias_file, -np.inf)
                    w = np.exp(scores - scores.max(-1, keepdims=True))
                    w /= w.sum(-1, keepdims=True)
                    self.assertClose(self.load(self.path("o.npy"), dtype, (2, 3, 6)),
                                     w @ v.astype(np.float64), dtype)
        q, k, v = self.attention_inputs(np.float32)
        out = [self.path("o.npy")]
        self.expect_error("attend", [*self.dot_args(q, k, v), "--bias",
                                     self.save("b64.npy", np.zeros((3, 5)))], out,
                          ["--bias", "is float64 but", "is float32; the bias must have the "
                           "inputs' float type"])
        self.expect_error("attend", [*self.dot_args(q, k, v), "--bias",
                                     self.save("b4.npy", np.zeros((4, 5), np.float32))], out,
                          ["options.bias has shape [4, 5], which does not broadcast to the "
                           "scores [2, 3, 5]"])
        self.expect_error("attend", [*self.dot_args(q, k, v), "--bias",
                                     self.save("bb.npy", np.zeros((3, 5), bool))], out,
                          ["--bias"])
        w_q, w_k, w_v = self.additive_params(np.float32, key_size=4)
        self.expect_error("attend", [*self.additive_args(q, k, v, w_q, w_k, w_v), "--bias",
                                     self.save("b.npy", np.zeros((3, 5), np.float32))], out,
                          ["--bias is for --scoring dot"])

    def test_additive_3d_f4_and_f8(self):
        for dtype in (np.float32, np.float64):
            q, k, v = self.attention_inputs(dtype)
            w_q, w_k, w_v = self.additive_params(dtype, key_size=4, w_v_2d=dtype == np.float64)
            lens = np.array([4, 1])
            self.ok(*self.additive_args(q, k, v, w_q, w_k, w_v), "--valid-lens",
                    self.save("l.npy", lens), "--weights", self.path("w.npy"),
                    "--lse", self.path("lse.npy"))
            ref, w, lse = np_additive(q, k, v, w_q, w_k, w_v, lens)
            self.assertClose(self.load(self.path("o.npy"), dtype, (2, 3, 6)), ref, dtype)
            self.assertClose(self.load(self.path("w.npy"), dtype, (2, 3, 5)), w, dtype)
            self.assertClose(self.load(self.path("lse.npy"), dtype, (2, 3)), lse, dtype)

    def test_additive_2d_f4_and_f8_with_other_key_size(self):
        for dtype in (np.float32, np.float64):
            q = self.rng.normal(size=(3, 20)).astype(dtype)
            k = self.rng.normal(size=(10, 2)).astype(dtype)
            v = self.rng.normal(size=(10, 4)).astype(dtype)
            w_q, w_k, w_v = self.additive_params(dtype, hiddens=8, query_size=20, key_size=2)
            self.ok(*self.additive_args(q, k, v, w_q, w_k, w_v), "--valid-lens",
                    self.save("l.npy", np.array(6)), "--lse", self.path("lse.npy"))
            ref, _, lse = np_additive(q[None], k[None], v[None], w_q, w_k, w_v, np.array([6]))
            self.assertClose(self.load(self.path("o.npy"), dtype, (3, 4)), ref[0], dtype)
            self.assertClose(self.load(self.path("lse.npy"), dtype, (3,)), lse[0], dtype)

    def test_bilinear_and_distance_f4_and_f8(self):
        """--scoring bilinear (q^T W k, queries and keys of other sizes) and
        --scoring distance (-|q - k|^2 scale / 2, keys far from the origin)
        against float64 NumPy loops."""
        for dtype in (np.float32, np.float64):
            q = self.rng.normal(size=(2, 3, 5)).astype(dtype)
            k = self.rng.normal(size=(2, 7, 4)).astype(dtype)
            v = self.rng.normal(size=(2, 7, 6)).astype(dtype)
            w = self.rng.normal(size=(5, 4)).astype(dtype)
            lens = np.array([[7, 2, 0], [3, 7, 5]])
            common = ["--valid-lens", self.save("l.npy", lens), "--weights", self.path("w.npy"),
                      "--lse", self.path("lse.npy"), "--out", self.path("o.npy")]
            self.ok("attend", "--scoring", "bilinear", "--queries", self.save("q.npy", q),
                    "--keys", self.save("k.npy", k), "--values", self.save("v.npy", v),
                    "--w", self.save("wb.npy", w), *common)
            f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
            ref, wts, lse = np_attention(f64(q) @ f64(w) @ f64(k).transpose(0, 2, 1), v, lens)
            self.assertClose(self.load(self.path("o.npy"), dtype, (2, 3, 6)), ref, dtype)
            self.assertClose(self.load(self.path("w.npy"), dtype, (2, 3, 7)), wts, dtype)
            self.assertClose(self.load(self.path("lse.npy"), dtype, (2, 3)), lse, dtype)
            # Distance: queries and keys 100 from the origin, scale 0.5.
            qd = (self.rng.normal(size=(2, 3, 4)) + 100).astype(dtype)
            kd = (self.rng.normal(size=(2, 7, 4)) + 100).astype(dtype)
            self.ok("attend", "--scoring", "distance", "--scale", "0.5", "--queries",
                    self.save("q.npy", qd), "--keys", self.save("k.npy", kd), "--values",
                    self.save("v.npy", v), *common)
            diff = f64(qd)[:, :, None, :] - f64(kd)[:, None, :, :]
            ref, wts, lse = np_attention(-0.25 * (diff ** 2).sum(-1), v, lens)
            self.assertClose(self.load(self.path("o.npy"), dtype, (2, 3, 6)), ref, dtype)
            self.assertClose(self.load(self.path("w.npy"), dtype, (2, 3, 7)), wts, dtype)
            got_lse = self.load(self.path("lse.npy"), dtype, (2, 3))
            finite = np.isfinite(lse)
            np.testing.assert_array_equal(np.isfinite(got_lse), finite)
            np.testing.assert_allclose(got_lse[finite], lse[finite],
                                       rtol=1e-4 if dtype == np.float32 else 1e-10)

    def test_bilinear_and_distance_errors(self):
        q, k, v = self.attention_inputs(np.float32)
        base = ["attend", "--queries", self.save("q.npy", q), "--keys", self.save("k.npy", k),
                "--values", self.save("v.npy", v), "--out", self.path("o.npy")]
        out = [self.path("o.npy")]
        self.expect_error("attend", base + ["--scoring", "bilinear"], out,
                          ["--scoring bilinear needs --w (w (Dq, Dk)); missing --w"])
        self.expect_error("attend", base + ["--scoring", "dot", "--bandwidth", "1"], out,
                          ["--bandwidth is for --scoring distance"])
        self.expect_error("attend", base + ["--scoring", "bilinear", "--bandwidth", "1"], out,
                          ["--bandwidth is for --scoring distance", "bilinear takes no scale"])
        w = self.save("wb.npy", np.zeros((3, 4), np.float32))
        self.expect_error("attend", base + ["--scoring", "dot", "--w", w], out,
                          ["--w is for --scoring bilinear"])
        self.expect_error("attend", base + ["--scoring", "bilinear", "--w", w, "--scale", "2"],
                          out, ["--scale", "bilinear"])
        self.expect_error("attend", base + ["--scoring", "distance", "--mask", w], out,
                          ["--mask is for --scoring dot"])
        # W (3, 4) against queries of D = 4: the library names the shapes.
        self.expect_error("attend", base + ["--scoring", "bilinear", "--w", w], out,
                          ["bilinear_attention", "w"])
        self.expect_error("attend", base + ["--scoring", "distance", "--scale", "-1"], out,
                          ["distance_attention", "scale"])
        # --bandwidth H is distance scoring's scale 1/H^2: the same bits.
        for h in ("0.5", "3"):
            self.ok(*base, "--scoring", "distance", "--bandwidth", h, "--lse", self.path("l1.npy"))
            by_h = np.load(self.path("o.npy")), np.load(self.path("l1.npy"))
            self.ok(*base, "--scoring", "distance", "--scale", repr(1 / float(h) ** 2), "--lse",
                    self.path("l2.npy"))
            for a, b in zip(by_h, (np.load(self.path("o.npy")), np.load(self.path("l2.npy")))):
                np.testing.assert_array_equal(a, b)

    def test_tiny_bandwidths_are_the_limit_or_refused_in_the_users_terms(self):
        """Distance scoring with a tiny bandwidth: while 1/H^2 |q - k|^2 fits
        the float type, the output is each query's nearest key's value (the
        limit); a scale past the float type's range (1e-25 in float32 gave
        every output NaN, exit 0) is refused as the user typed it (1e-200 was
        named as options.scale = inf, and as 9.9999999999999998e-201). Scores
        that overflow for the data alone (a NaN row) are refused too; when
        that happens depends on the kernel's algebra, so no input here
        forces it."""
        for dtype in (np.float32, np.float64):
            q, k, v = self.attention_inputs(dtype)
            base = ["attend", "--queries", self.save("q.npy", q), "--keys",
                    self.save("k.npy", k), "--values", self.save("v.npy", v), "--out",
                    self.path("o.npy"), "--scoring", "distance"]
            q64, k64 = q.astype(np.float64), k.astype(np.float64)
            d2 = ((q64[:, :, None, :] - k64[:, None, :, :]) ** 2).sum(-1)
            nearest = np.take_along_axis(v, d2.argmin(-1)[:, :, None], 1)
            self.ok(*base, "--bandwidth", "1e-6")
            np.testing.assert_array_equal(np.load(self.path("o.npy")), nearest)
            if dtype == np.float32:
                # A scale beyond float32's range: every score overflows
                # whatever the data; refused before computing.
                for option, value, shown, said in (
                        ("--bandwidth", "1e-25", "1e+50", "--bandwidth 1e-25 is too small"),
                        ("--scale", "1e305", "1e+305", "--scale 1e+305 is too large")):
                    self.expect_error("attend", base + [option, value], [self.path("o.npy")],
                                      [f"{said} for float32 inputs",
                                       f"1/H^2 = {shown} is beyond float32's range",
                                       "give a bandwidth of at least 5.4"])
            self.expect_error("attend", base + ["--bandwidth", "1e-200"], [self.path("o.npy")],
                              ["--bandwidth 1e-200: 1/H^2 = inf is beyond float64's range",
                               "between 1e-154 and 1e154"])
            self.expect_error("attend", base + ["--bandwidth", "-1e-9"], [self.path("o.npy")],
                              ["--bandwidth -1e-09: expected a finite number > 0"])

    def chapter_inputs(self):
        # d2l 11.3: keys all ones, values arange(40) as (10, 4) in both batch
        # elements, valid_lens [2, 6]; the weights are uniform over the valid keys.
        keys = np.ones((2, 10, 2), dtype=np.float32)
        values = np.tile(np.arange(40, dtype=np.float32).reshape(1, 10, 4), (2, 1, 1))
        return keys, values, np.array([2, 6])

    def test_chapter_example(self):
        keys, values, lens = self.chapter_inputs()
        expected = np.array([[[2, 3, 4, 5]], [[10, 11, 12, 13]]], dtype=np.float64)
        queries = self.rng.normal(size=(2, 1, 20)).astype(np.float32)
        w_q, w_k, w_v = self.additive_params(np.float32, hiddens=8, query_size=20, key_size=2,
                                             w_v_2d=True)
        # The book's AdditiveAttention(dropout=0.1) in eval mode: no --dropout without --train.
        self.ok(*self.additive_args(queries, keys, values, w_q, w_k, w_v), "--valid-lens",
                self.save("l.npy", lens))
        self.assertClose(self.load(self.path("o.npy"), np.float32, (2, 1, 4)), expected,
                         np.float32)
        queries = self.rng.normal(size=(2, 1, 2)).astype(np.float32)
        self.ok(*self.dot_args(queries, keys, values), "--valid-lens", self.save("l.npy", lens),
                "--weights", self.path("w.npy"))
        self.assertClose(self.load(self.path("o.npy"), np.float32, (2, 1, 4)), expected,
                         np.float32)
        weights = self.load(self.path("w.npy"), np.float32, (2, 1, 10))
        uniform = np.zeros((2, 1, 10))
        uniform[0, 0, :2], uniform[1, 0, :6] = 1 / 2, 1 / 6
        self.assertClose(weights, uniform, np.float32)

    def test_dropout_with_train(self):
        q, k, v = self.attention_inputs(np.float32, num_queries=8, num_keys=16)
        base = self.dot_args(q, k, v)

        def output(*extra):
            self.ok(*base, *extra)
            return np.load(self.path("o.npy"))

        eval_out = output()
        # --train without --dropout drops nothing (--dropout without --train is an
        # error: test_dropout_needs_train).
        np.testing.assert_array_equal(output("--train"), eval_out)
        first = output("--dropout", "0.5", "--train", "--seed", "7")
        self.assertFalse(np.array_equal(first, eval_out))
        np.testing.assert_array_equal(output("--dropout", "0.5", "--train", "--seed", "7"), first)
        np.testing.assert_array_equal(
            output("--dropout", "0.5", "--train", "--seed", "7", "--threads", "2"), first)
        self.assertFalse(np.array_equal(output("--dropout", "0.5", "--train", "--seed", "8"),
                                        first))
        # p = 1 drops every weight: an all-zero output.
        np.testing.assert_array_equal(output("--dropout", "1", "--train"), np.zeros_like(first))

    def test_dropout_leaves_weights_and_keeps_additive_reproducible(self):
        q, k, v = self.attention_inputs(np.float64, num_queries=6, num_keys=9)
        w_q, w_k, w_v = self.additive_params(np.float64)
        base = self.additive_args(q, k, v, w_q, w_k, w_v) + ["--weights", self.path("w.npy")]
        self.ok(*base, "--dropout", "0.3", "--train", "--seed", "123")
        first, weights = np.load(self.path("o.npy")), np.load(self.path("w.npy"))
        ref, w, _ = np_additive(q, k, v, w_q, w_k, w_v)
        # The weights are the softmax before dropout, as d2l's attention_weights.
        self.assertClose(weights, w, np.float64)
        self.assertFalse(np.allclose(first, ref))
        self.ok(*base, "--dropout", "0.3", "--train", "--seed", "123")
        np.testing.assert_array_equal(np.load(self.path("o.npy")), first)


# ---- qkv demo ------------------------------------------------------------------------

DEMO_FIGURES = ("identity.png", "average-pooling.png", "average-pooling-attention.png",
                "nonparametric.png", "nonparametric-attention.png", "parametric-loss.png",
                "parametric.png", "parametric-attention.png", "cross-validated.png",
                "cross-validated-attention.png", "additive-attention.png",
                "dot-product-attention.png", "random-keys-attention.png")


def png_size(path):
    """(width, height) of a PNG file, or None if it does not start like one."""
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return None
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


class DemoTest(CliTest):
    def demo(self, *args):
        return self.ok("demo", "--out", self.path("figures"), *args).stdout

    def test_demo_prints_the_chapter_examples(self):
        out = self.demo()
        for text in ("Masked softmax", "Additive attention", "Scaled dot-product attention",
                     "valid_lens [2, 3]", "valid_lens [[1, 3], [2, 4]]",
                     "d2l 11.1", "d2l 11.2", "d2l 11.3", "-> Mu",
                     "top records: (Lipton, Zachary", "Average pooling", "bandwidth h = 1,",
                     "Cross-validated bandwidth"):
            self.assertIn(text, out)
        rows = [line.split() for line in out.splitlines()]
        first = ["b=0", "q=0", "2.0000", "3.0000", "4.0000", "5.0000"]
        second = ["b=1", "q=0", "10.0000", "11.0000", "12.0000", "13.0000"]
        self.assertEqual(rows.count(first), 2, out)  # additive and dot-product
        self.assertEqual(rows.count(second), 2, out)
        uniform_2 = ["b=0", "q=0"] + ["0.5000"] * 2 + ["0.0000"] * 8
        uniform_6 = ["b=1", "q=0"] + ["0.1667"] * 6 + ["0.0000"] * 4
        self.assertEqual(rows.count(uniform_2), 2, out)
        self.assertEqual(rows.count(uniform_6), 2, out)
        self.assertIn("average pooling: weights" + " 0.1667" * 6, out)
        self.assertIn("exact(\"Li\"): weights 0.0000 0.0000 1.0000 0.0000 0.0000 0.0000", out)

    def test_demo_random_keys_weights_differ(self):
        """Section 4: over random keys the additive and dot-product weights are
        each a distribution over the valid keys, and they are not the same."""
        out = self.demo()
        self.assertIn("4. The same two attentions over random keys", out)
        part = out[out.index("4. The same two attentions"):]
        rows = [line.split() for line in part.splitlines()]
        weights = [r for r in rows if len(r) == 12 and r[0].startswith("b=")][:4]
        self.assertEqual(len(weights), 4, part)
        w = np.array([[float(x) for x in r[2:]] for r in weights]).reshape(2, 2, 10)
        for kind in range(2):
            for b, length in enumerate((2, 6)):
                self.assertTrue(np.all(w[kind, b, length:] == 0), w[kind, b])
                self.assertAlmostEqual(w[kind, b].sum(), 1.0, delta=5e-4)
        self.assertGreater(np.abs(w[0] - w[1]).max(), 0.01, w)

    def test_demo_masked_softmax_rows(self):
        rows = [line.split() for line in self.demo().splitlines()]
        softmax_rows = [r for r in rows if len(r) == 6 and r[0].startswith("b=")][:8]
        self.assertEqual(len(softmax_rows), 8)
        weights = np.array([[float(x) for x in r[2:]] for r in softmax_rows]).reshape(2, 2, 2, 4)
        lengths = np.array([[[2, 2], [3, 3]], [[1, 3], [2, 4]]])
        for c, b, i in np.ndindex(2, 2, 2):
            row, length = weights[c, b, i], lengths[c, b, i]
            self.assertTrue(np.all(row[length:] == 0), row)
            self.assertTrue(np.all(row[:length] > 0), row)
            self.assertAlmostEqual(row.sum(), 1.0, delta=5e-4)

    def test_parametric_loss_decreases_and_loo_errors(self):
        out = self.demo()
        losses = [float(line.split("loss ")[1].split(",")[0]) for line in out.splitlines()
                  if line.strip().startswith("epoch ")]
        self.assertEqual(len(losses), 5, out)
        self.assertTrue(all(b < a for a, b in zip(losses, losses[1:])), losses)
        errors = [float(line.split("LOO error ")[1]) for line in out.splitlines()
                  if "LOO error " in line]
        self.assertEqual(len(errors), 4, out)  # average, h = 1, parametric, cross-validated
        self.assertTrue(all(e > 0 for e in errors), errors)
        # Cross-validation minimises the LOO error: no other fit beats it.
        self.assertEqual(min(errors), errors[3], errors)

    def test_figures_and_index_html(self):
        out = self.demo()
        folder = self.path("figures")
        for name in DEMO_FIGURES:
            size = png_size(os.path.join(folder, name))
            self.assertIsNotNone(size, name)
            self.assertTrue(size[0] > 50 and size[1] > 50, (name, size))
            self.assertIn("figure: " + name, out)
        index = os.path.join(folder, "index.html")
        with open(index, encoding="utf-8") as f:
            html = f.read()
        # Dot-product attention's figure over equal keys is additive attention's byte for
        # byte: the page shows it once and says why (test_demo_page.py checks the layout).
        shown = [name for name in DEMO_FIGURES if name != "dot-product-attention.png"]
        for name in shown:
            self.assertIn(f'<img src="{name}"', html)
        self.assertEqual(html.count("<img "), len(shown))
        self.assertIn("dot-product-attention.png is byte for byte additive-attention.png", html)
        for heading in ("11.1 Queries, Keys, and Values", "11.2 Attention Pooling by Similarity",
                        "11.3 Attention Scoring Functions"):
            self.assertIn(f"<h2>{heading}</h2>", html)
        self.assertIn("[[2, 3, 4, 5]]", html)  # the report is on the page
        self.assertIn("<pre>", html)
        self.assertEqual(out.splitlines()[-1], "figures: " + os.path.realpath(index))

    def test_out_folder_is_created_and_defaults_to_qkv_demo(self):
        nested = self.path("a/b/c")
        self.ok("demo", "--out", nested)
        self.assertTrue(os.path.isfile(os.path.join(nested, "index.html")))
        r = subprocess.run([QKV, "demo"], capture_output=True, text=True, timeout=120,
                           cwd=self.dir)
        self.assertEqual(r.returncode, 0, r.stderr)
        default = os.path.join(os.path.realpath(self.dir), "qkv-demo")
        self.assertTrue(os.path.isfile(os.path.join(default, "identity.png")))
        self.assertTrue(r.stdout.endswith("figures: " + os.path.join(default, "index.html") + "\n"))

    def test_out_that_is_a_file_exits_2(self):
        blocker = self.path("file")
        with open(blocker, "w") as f:
            f.write("x")
        r = run("demo", "--out", blocker)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertTrue(r.stderr.startswith("qkv demo: error: "), r.stderr)
        self.assertIn(blocker, r.stderr)

    def test_missing_gnuplot_names_the_package(self):
        env = dict(os.environ, PATH=self.path("empty-path"))
        r = run("demo", "--out", self.path("figures"), env=env)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("gnuplot-nox", r.stderr)

    def test_seed_and_threads(self):
        default = self.demo()
        self.assertEqual(self.demo("--seed", "0"), default)
        self.assertEqual(self.demo("--seed", "0", "--threads", "2"), default)
        other = self.demo("--seed", "42")
        self.assertNotEqual(other, default)
        self.assertEqual(self.demo("--seed", "42"), other)

    def test_a_report_that_cannot_be_written_exits_1(self):
        # Not bad usage but a failure of the system: status 1 (DESIGN.md section 4).
        with open("/dev/full", "w") as full:
            r = subprocess.run([QKV, "demo", "--out", self.path("figures")], stdout=full,
                               stderr=subprocess.PIPE, text=True, timeout=120)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertTrue(r.stderr.startswith("qkv demo: error: "), r.stderr)


# ---- every error path ------------------------------------------------------------

class ErrorsTest(CliTest):
    def setUp(self):
        super().setUp()
        self.x = self.save("x.npy", self.rng.normal(size=(2, 3, 4)).astype(np.float32))
        self.out = self.path("out.npy")
        q, k, v = self.attention_inputs(np.float32)
        self.q, self.k, self.v = (self.save(n, a) for n, a in (("q.npy", q), ("k.npy", k),
                                                                 ("v.npy", v)))
        w_q, w_k, w_v = self.additive_params(np.float32)
        self.wq, self.wk, self.wv = (self.save(n, a) for n, a in (("wq.npy", w_q),
                                                                    ("wk.npy", w_k),
                                                                    ("wv.npy", w_v)))

    def dot(self, **replace):
        args = {"--queries": self.q, "--keys": self.k, "--values": self.v, "--out": self.out}
        args.update(replace)
        return ["attend", "--scoring", "dot"] + [str(a) for kv in args.items() for a in kv
                                                 if kv[1] is not None]

    def additive(self, **replace):
        args = {"--queries": self.q, "--keys": self.k, "--values": self.v, "--wq": self.wq,
                "--wk": self.wk, "--wv": self.wv, "--out": self.out}
        args.update(replace)
        return ["attend", "--scoring", "additive"] + [str(a) for kv in args.items() for a in kv
                                                      if kv[1] is not None]

    def test_missing_required_options(self):
        self.expect_error("softmax", ["softmax", "--out", self.out], [self.out], ["--scores"])
        self.expect_error("softmax", ["softmax", "--scores", self.x], [], ["--out"])
        self.expect_error("attend", self.dot(**{"--keys": None}), [self.out], ["--keys"])
        self.expect_error("attend", ["attend", "--queries", self.q, "--keys", self.k, "--values",
                                     self.v, "--out", self.out], [self.out], ["--scoring"])
        self.expect_error("softmax", ["softmax", "--scores"], [], ["--scores"])

    def test_missing_input_file(self):
        missing = self.path("missing.npy")
        self.expect_error("softmax", ["softmax", "--scores", missing, "--out", self.out],
                          [self.out], ["--scores", missing, "No such file"])
        self.expect_error("attend", self.dot(**{"--values": missing}), [self.out],
                          ["--values", missing])
        self.expect_error("softmax", ["softmax", "--scores", self.x, "--valid-lens", missing,
                                      "--out", self.out], [self.out], ["--valid-lens", missing])
        self.expect_error("softmax", ["softmax", "--scores", self.dir, "--out", self.out],
                          [self.out], ["directory"])

    def test_bad_npy(self):
        garbage = self.path("garbage.npy")
        with open(garbage, "wb") as f:
            f.write(b"this is not a .npy file at all")
        truncated = self.path("truncated.npy")
        with open(self.x, "rb") as f:
            data = f.read()
        with open(truncated, "wb") as f:
            f.write(data[:-5])
        empty = self.path("empty.npy")
        open(empty, "wb").close()
        fortran = self.save("fortran.npy", np.asfortranarray(np.ones((3, 4), np.float32)))
        for bad in (garbage, truncated, empty, fortran):
            self.expect_error("softmax", ["softmax", "--scores", bad, "--out", self.out],
                              [self.out], [os.path.basename(bad)])
        self.expect_error("attend", self.dot(**{"--queries": truncated}), [self.out],
                          ["truncated.npy"])

    def test_input_of_the_wrong_dtype(self):
        ints = self.save("ints.npy", np.ones((2, 3, 4), np.int32))
        self.expect_error("softmax", ["softmax", "--scores", ints, "--out", self.out],
                          [self.out], ["--scores", "int32", "float32 or float64"])
        self.expect_error("attend", self.dot(**{"--keys": ints}), [self.out], ["--keys", "int32"])

    def test_wrong_ranks(self):
        for shape in ((4,), (2, 2, 3, 4), ()):
            bad = self.save("bad.npy", np.ones(shape, np.float32))
            self.expect_error("softmax", ["softmax", "--scores", bad, "--out", self.out],
                              [self.out], ["--scores", str(list(shape))])
            self.expect_error("attend", self.dot(**{"--queries": bad}), [self.out],
                              ["--queries"])
        keys_2d = self.save("k2.npy", np.ones((5, 4), np.float32))
        self.expect_error("attend", self.dot(**{"--keys": keys_2d}), [self.out],
                          ["--keys", "[5, 4]", "[2, 3, 4]"])
        values_2d = self.save("v2.npy", np.ones((5, 6), np.float32))
        self.expect_error("attend", self.dot(**{"--values": values_2d}), [self.out],
                          ["--values", "[5, 6]"])

    def test_mismatched_sizes(self):
        k3 = self.save("k3.npy", np.ones((2, 5, 3), np.float32))
        self.expect_error("attend", self.dot(**{"--keys": k3}), [self.out], ["[2, 5, 3]"])
        v7 = self.save("v7.npy", np.ones((2, 7, 6), np.float32))
        self.expect_error("attend", self.dot(**{"--values": v7}), [self.out], ["[2, 7, 6]"])
        b3 = self.save("k_b3.npy", np.ones((3, 5, 4), np.float32))
        self.expect_error("attend", self.dot(**{"--keys": b3}), [self.out], ["[3, 5, 4]"])
        wq_bad = self.save("wq_bad.npy", np.ones((7, 9), np.float32))
        self.expect_error("attend", self.additive(**{"--wq": wq_bad}), [self.out], ["[7, 9]"])
        lens3 = self.save("l3.npy", np.array([1, 2, 3]))
        self.expect_error("softmax", ["softmax", "--scores", self.x, "--valid-lens", lens3,
                                      "--out", self.out], [self.out], ["[3]", "[2, 3, 4]"])
        lens_q = self.save("lq.npy", np.ones((2, 4), np.int64))
        self.expect_error("attend", self.dot(**{"--valid-lens": lens_q}), [self.out],
                          ["[2, 4]", "[2, 3, 5]", "expected [2] or [2, 3]"])
        lens_3d = self.save("l3d.npy", np.ones((2, 3, 1), np.int64))
        self.expect_error("softmax", ["softmax", "--scores", self.x, "--valid-lens", lens_3d,
                                      "--out", self.out], [self.out], ["[2, 3, 1]"])

    def test_lens_that_do_not_fit_2d_inputs(self):
        x2 = self.save("x2.npy", np.ones((3, 4), np.float32))
        for shape in ((2,), (4,), (3, 3), (2, 3)):
            lens = self.save("l.npy", np.ones(shape, np.int64))
            self.expect_error("softmax", ["softmax", "--scores", x2, "--valid-lens", lens,
                                          "--out", self.out], [self.out],
                              ["--valid-lens", str(list(shape)), "[3, 4]"])

    def test_lens_out_of_range(self):
        for lens in ([1, 6], [-1, 2]):
            path = self.save("l.npy", np.array(lens, np.int64))
            self.expect_error("softmax", ["softmax", "--scores", self.x, "--valid-lens", path,
                                          "--out", self.out], [self.out],
                              [str(min(lens) if min(lens) < 0 else max(lens))])
            self.expect_error("attend", self.dot(**{"--valid-lens": path}), [self.out], [])

    def test_float_lens(self):
        for dtype, name in ((np.float32, "float32"), (np.float64, "float64")):
            path = self.save("l.npy", np.array([1, 2], dtype))
            self.expect_error("softmax", ["softmax", "--scores", self.x, "--valid-lens", path,
                                          "--out", self.out], [self.out],
                              ["--valid-lens", name, "int32 or int64"])
            self.expect_error("attend", self.dot(**{"--valid-lens": path}), [self.out], [name])

    def test_mixed_dtypes(self):
        k64 = self.save("k64.npy", np.load(self.k).astype(np.float64))
        self.expect_error("attend", self.dot(**{"--keys": k64}), [self.out],
                          ["float32", "float64", "k64.npy", "q.npy"])
        wv64 = self.save("wv64.npy", np.load(self.wv).astype(np.float64))
        self.expect_error("attend", self.additive(**{"--wv": wv64}), [self.out],
                          ["--wv", "wv64.npy", "float64", "float32"])

    def test_additive_missing_parameters(self):
        cases = [({"--wq": None}, "missing --wq"),
                 ({"--wk": None, "--wv": None}, "missing --wk and --wv"),
                 ({"--wq": None, "--wk": None, "--wv": None}, "missing --wq, --wk and --wv")]
        for replace, fragment in cases:
            self.expect_error("attend", self.additive(**replace), [self.out], [fragment])

    def test_parameters_with_dot(self):
        self.expect_error("attend", self.dot(**{"--wq": self.wq}), [self.out],
                          ["--wq", "additive"])
        self.expect_error("attend", self.dot(**{"--wk": self.wk, "--wv": self.wv}), [self.out],
                          ["--wk and --wv"])

    def test_scale_with_additive(self):
        self.expect_error("attend", self.additive(**{"--scale": "0.5"}), [self.out], ["--scale"])

    def test_bad_option_values(self):
        for threads in ("0", "-1", "two", "1.5"):
            self.expect_error("softmax", ["softmax", "--scores", self.x, "--out", self.out,
                                          "--threads", threads], [self.out], ["--threads"])
            self.expect_error("demo", ["demo", "--threads", threads], [], ["--threads"])
        self.expect_error("attend", self.dot(**{"--threads": "0"}), [self.out], ["--threads"])
        for seed in ("-1", "x", "1.5"):
            self.expect_error("attend", self.dot(**{"--seed": seed}), [self.out], ["--seed"])
            self.expect_error("demo", ["demo", "--seed", seed], [], ["--seed"])
        for p in ("1.5", "-0.1", "x"):
            self.expect_error("attend", self.dot(**{"--dropout": p}), [self.out], ["--dropout"])

    def test_dropout_needs_train(self):
        # --dropout without --train would silently do nothing (dropout applies only
        # in training mode): an error naming both options and the value, nothing written.
        weights = self.path("w.npy")
        for p in ("0.1", "1", "0.25"):
            self.expect_error("attend", self.dot(**{"--dropout": p, "--weights": weights}),
                              [self.out, weights],
                              [f"--dropout {p} has no effect without --train",
                               "add --train or drop --dropout"])
        self.expect_error("attend", self.additive(**{"--dropout": "0.5"}), [self.out],
                          ["--dropout 0.5 has no effect without --train"])
        # --dropout 0 asks for nothing; with --train it drops.
        self.assertEqual(run(*self.dot(**{"--dropout": "0"})).returncode, 0)
        self.assertEqual(run(*self.dot(**{"--dropout": "0.1"}), "--train").returncode, 0)
        self.expect_error("attend", self.dot(**{"--scale": "x"}), [self.out], ["--scale"])
        self.expect_error("attend", ["attend", "--scoring", "cosine"] + self.dot()[3:],
                          [self.out], ["--scoring"])

    def test_output_into_a_nonexistent_directory(self):
        nowhere = self.path("no/such/dir/out.npy")
        self.expect_error("softmax", ["softmax", "--scores", self.x, "--out", nowhere], [nowhere],
                          [nowhere])
        # The second output fails after the first was staged: neither appears.
        weights = self.path("w.npy")
        self.expect_error("attend", self.dot(**{"--weights": weights, "--lse": nowhere}),
                          [self.out, weights, nowhere], ["--lse", nowhere])

    def test_output_that_is_a_directory_or_repeated(self):
        self.expect_error("softmax", ["softmax", "--scores", self.x, "--out", self.dir], [],
                          ["directory"])
        self.expect_error("attend", self.dot(**{"--weights": self.out}), [self.out],
                          ["--out and --weights"])
        same = os.path.join(self.dir, ".", "out.npy")
        self.expect_error("attend", self.dot(**{"--lse": same}), [self.out], ["--lse"])


def main():
    """The entry point of every CLI test file: `FILE --qkv PATH [unittest arguments]`
    runs the test classes of the file that was started (unittest's __main__)."""
    global QKV
    argv = list(sys.argv)
    name = os.path.basename(argv[0])
    if len(argv) < 3 or argv[1] != "--qkv":
        sys.exit(f"usage: {name} --qkv PATH [unittest arguments]")
    QKV = os.path.abspath(argv[2])
    if not os.access(QKV, os.X_OK):
        sys.exit(f"{name}: {QKV} is not an executable (build the qkv_cli target)")
    unittest.main(module="__main__", argv=[argv[0]] + argv[3:], verbosity=2)


if __name__ == "__main__":
    main()
