"""The runtime of the Python package: version, threads, SIMD targets, exceptions.

- qkv.__version__ is the version of CMakeLists.txt's `project(qkv VERSION ..)`
  and what `qkv --version` prints;
- set_num_threads / get_num_threads: the count is taken and reported, 0 goes
  back to the default (QKV_NUM_THREADS, else every core), and every op gives
  bitwise the same results with 1, 2 and 3 threads (dropout included);
- simd_targets / simd_target / set_simd_target: the list is this machine's,
  best first and ending in scalar; each target can be selected, reported,
  and gives results within tolerance of float64 NumPy references; "" lifts
  the cap; each test restores what it found;
- qkv.Error is a ValueError and qkv.IoError an OSError, both named qkv.*;
- Ctrl-C (SIGINT) stops a long call between its tasks with KeyboardInterrupt
  and leaves out= as it was; a SIGINT handler that does not raise does not
  stop it.
"""

import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest

import qkv

SOURCE = os.environ.get("QKV_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORES = len(os.sched_getaffinity(0))  # "every core" of the default thread count


@pytest.fixture
def restore_runtime():
    """Puts back the thread count and SIMD cap a test changes."""
    threads, target = qkv.get_num_threads(), qkv.simd_target()
    yield
    qkv.set_num_threads(0)
    if qkv.get_num_threads() != threads:
        qkv.set_num_threads(threads)
    qkv.set_simd_target(os.environ.get("QKV_SIMD_TARGET", ""))
    if qkv.simd_target() != target:
        qkv.set_simd_target(target)
    assert (qkv.get_num_threads(), qkv.simd_target()) == (threads, target)


# ---- version ---------------------------------------------------------------------

def cmake_version():
    with open(os.path.join(SOURCE, "CMakeLists.txt")) as f:
        match = re.search(r"project\(\s*qkv\s+VERSION\s+(\d+\.\d+\.\d+)", f.read())
    assert match, "CMakeLists.txt has no project(qkv VERSION x.y.z ...)"
    return match.group(1)


def test_version_is_the_projects():
    assert isinstance(qkv.__version__, str)
    assert qkv.__version__ == cmake_version()


def test_version_is_the_commands(qkv_cli):
    proc = subprocess.run([qkv_cli, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"qkv {qkv.__version__} ({qkv.__license__} license)"


# ---- threads ---------------------------------------------------------------------

def test_set_and_get_num_threads(restore_runtime):
    for n in (1, 2, 3, 7, 1024):
        qkv.set_num_threads(n)
        assert qkv.get_num_threads() == n
    qkv.set_num_threads(0)
    default = qkv.get_num_threads()
    env = os.environ.get("QKV_NUM_THREADS")
    if env and env.isdigit() and 1 <= int(env) <= 1024:
        assert default == int(env)
    else:
        assert default == CORES


@pytest.mark.parametrize("env,expected", [("1", 1), ("3", 3), ("1024", 1024), ("", CORES),
                                          ("abc", CORES), ("0", CORES), ("-1", CORES),
                                          ("5000", CORES)])
def test_default_thread_count_reads_the_environment(env, expected):
    # In a child, so the variable is read at start-up as it would be.
    child_env = dict(os.environ, QKV_NUM_THREADS=env)
    code = "import qkv; print(qkv.get_num_threads()); qkv.set_num_threads(0); " \
           "print(qkv.get_num_threads())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=child_env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first, after_reset = (int(s) for s in proc.stdout.split())
    assert first == after_reset == expected


def thread_sensitive_calls(rng, dtype):
    """Calls big enough to be split among threads, with dropout where it exists."""
    B, Nq, Nk, D, Dv, H = 3, 300, 700, 32, 24, 16
    n = lambda *s: rng.standard_normal(s).astype(dtype)  # noqa: E731
    q, k, v = n(B, Nq, D), n(B, Nk, D), n(B, Nk, Dv)
    lens = rng.integers(0, Nk + 1, size=(B, Nq))
    X = n(B, Nq, Nk)
    Wq, Wk, wv = n(H, D), n(H, D), n(H)
    out, lse = qkv.scaled_dot_product_attention(q, k, v, lens, dropout_p=0.2, seed=5,
                                                return_lse=True)
    qa, ka, va = q[:, :64], k[:, :200], v[:, :200]
    aout, alse = qkv.additive_attention(qa, ka, va, Wq, Wk, wv, dropout_p=0.2, seed=6,
                                        return_lse=True)
    dout, daout = n(*out.shape), n(*aout.shape)
    x = rng.uniform(0, 5, (400, 2))
    y = rng.standard_normal(400)
    return {
        "masked_softmax": lambda: qkv.masked_softmax(X, lens),
        "masked_softmax_backward": lambda: qkv.masked_softmax_backward(X, X, lens),
        "sdpa": lambda: qkv.scaled_dot_product_attention(
            q, k, v, lens, dropout_p=0.2, seed=5, return_weights=True, return_lse=True),
        "sdpa_backward": lambda: qkv.scaled_dot_product_attention_backward(
            q, k, v, out, lse, dout, lens, dropout_p=0.2, seed=5),
        "additive": lambda: qkv.additive_attention(qa, ka, va, Wq, Wk, wv, dropout_p=0.2, seed=6,
                                                   return_weights=True, return_lse=True),
        "additive_backward": lambda: qkv.additive_attention_backward(
            qa, ka, va, Wq, Wk, wv, aout, alse, daout, dropout_p=0.2, seed=6),
        "attention_pooling": lambda: qkv.attention_pooling(X, v),
        "nadaraya_watson": lambda: qkv.nadaraya_watson(x, y, x, bandwidth=[0.3, 0.5]),
    }


def as_tuple(value):
    return tuple(value) if isinstance(value, tuple) else (value,)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_results_are_bitwise_the_same_for_1_2_3_threads(dtype, rng, restore_runtime):
    calls = thread_sensitive_calls(rng, dtype)
    results = {}
    for n in (1, 2, 3):
        qkv.set_num_threads(n)
        results[n] = {name: as_tuple(call()) for name, call in calls.items()}
    for name in calls:
        for n in (2, 3):
            for i, (got, want) in enumerate(zip(results[n][name], results[1][name])):
                assert got.tobytes() == want.tobytes(), \
                    f"{name} result {i}: {n} threads differ from 1"


# ---- SIMD targets ----------------------------------------------------------------

KNOWN_TARGETS = ["avx512", "avx2", "sse4", "scalar"]


def test_simd_targets_list():
    targets = qkv.simd_targets()
    assert isinstance(targets, list) and targets
    assert all(isinstance(t, str) for t in targets)
    assert targets[-1] == "scalar"
    assert len(set(targets)) == len(targets)
    # Best first: in the order of the x86-64 list (docs/semantics.md).
    if all(t in KNOWN_TARGETS for t in targets):
        assert targets == sorted(targets, key=KNOWN_TARGETS.index)
    assert qkv.simd_target() in targets
    if not os.environ.get("QKV_SIMD_TARGET"):
        assert qkv.simd_target() == targets[0]


def test_set_simd_target_caps_and_lifts(restore_runtime):
    targets = qkv.simd_targets()
    for t in targets:
        qkv.set_simd_target(t)
        assert qkv.simd_target() == t
        assert qkv.simd_targets() == targets  # the list is the machine's, not the cap's
    qkv.set_simd_target("")
    assert qkv.simd_target() == targets[0]


def test_openblas_core_type_is_chosen_when_the_module_loads():
    """Importing qkv switches its OpenBLAS (loaded RTLD_LOCAL with the
    extension) from the oldest kernels, OPENBLAS_CORETYPE=Prescott, to the
    best core type this CPU runs (per /proc/cpuinfo); QKV_BLAS_CORE=keep
    keeps Prescott. simd_info() says both."""
    with open("/proc/cpuinfo") as f:
        flags = next(set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags"))
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        best = {"SkylakeX", "Cooperlake"}
    elif {"avx2", "fma"} <= flags:
        best = {"Haswell", "Zen"}
    else:
        best = {"Prescott"}
    script = ("import json, qkv; i = qkv.simd_info(); print(json.dumps([i['blas_core'], "
              "i['blas_core_found'], i['blas_core_from'], i['blas_core_action']]))")
    env = {k: v for k, v in os.environ.items() if k not in ("QKV_BLAS_CORE", "QKV_SIMD_TARGET")}
    env["OPENBLAS_CORETYPE"] = "Prescott"
    for keep in (False, True):
        run_env = dict(env, QKV_BLAS_CORE="keep") if keep else env
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             env=run_env, timeout=120, check=True).stdout
        core, found, found_from, action = json.loads(out)
        assert (found, found_from) == ("Prescott", "OPENBLAS_CORETYPE=Prescott")
        if keep:
            assert (core, action) == ("Prescott", "kept (QKV_BLAS_CORE=keep)")
        else:
            assert core in best, (core, best)


def test_simd_info_is_the_commands(qkv_cli, restore_runtime):
    """qkv.simd_info() says what `qkv info --json` says (one library call behind both),
    and follows the cap."""
    env = {k: v for k, v in os.environ.items() if k != "QKV_SIMD_TARGET"}
    command = json.loads(subprocess.run([qkv_cli, "info", "--json"], capture_output=True,
                                        text=True, check=True, env=env).stdout)
    info = qkv.simd_info()
    for key in ("simd_targets_compiled", "simd_targets_supported", "simd_target", "simd_cap",
                "bf16_products", "bf16_products_why", "blas", "blas_core", "blas_core_found",
                "blas_core_from", "blas_core_action"):
        assert info[key] == command[key], key
    assert sorted(n for n, on in info["cpu_features"].items() if on) == sorted(
        command["cpu_features"])
    for target in qkv.simd_targets():
        qkv.set_simd_target(target)
        capped = qkv.simd_info()
        assert capped["simd_target"] == target and capped["simd_cap"] == target
        if not target.startswith("avx512"):
            assert capped["bf16_products"] == "widen"
    qkv.set_simd_target("")
    assert qkv.simd_info()["simd_cap"] is None


def test_simd_target_from_the_environment():
    targets = qkv.simd_targets()
    for t in (targets[-1], targets[len(targets) // 2]):
        proc = subprocess.run([sys.executable, "-c", "import qkv; print(qkv.simd_target())"],
                              capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, QKV_SIMD_TARGET=t))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == t


def ref_masked_softmax(X, lens):
    X = X.astype(np.float64)
    B, Nq, Nk = X.shape
    L = np.broadcast_to(lens.reshape(B, -1), (B, Nq))[..., None]
    valid = np.arange(Nk) < L
    S = np.where(valid, X, -np.inf)
    m = np.max(S, -1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.where(valid, np.exp(S - m), 0)
    s = e.sum(-1, keepdims=True)
    return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


def check_close(got, ref, atol, rtol, what):
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, ref {ref.shape}"
    err = np.abs(got.astype(np.float64) - ref)
    bad = err > atol + rtol * np.abs(ref)
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} elements out of tolerance, first at "
                             f"{i}: got {got[i]!r}, ref {ref[i]!r}")


TOL = {np.float32: (2e-6, 2e-5), np.float64: (1e-13, 1e-12)}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_every_target_meets_the_tolerance(dtype, rng, restore_runtime):
    # Lengths around the vector widths (1, W - 1, W, W + 1, 3W + 2 for W = 4, 8, 16).
    B, Nq, Nk, D, Dv = 2, 5, 67, 17, 9
    q = rng.standard_normal((B, Nq, D)).astype(dtype)
    k = rng.standard_normal((B, Nk, D)).astype(dtype)
    v = rng.standard_normal((B, Nk, Dv)).astype(dtype)
    lens = rng.choice([0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 50, 67], size=(B, Nq))
    X = (rng.standard_normal((B, Nq, Nk)) * 5 + 90).astype(dtype)  # exp(90) overflows float32
    scores = np.einsum("bqd,bkd->bqk", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(D)
    w_ref = ref_masked_softmax(scores, lens)
    o_ref = w_ref @ v.astype(np.float64)
    atol, rtol = TOL[dtype]
    seen = {}
    for t in qkv.simd_targets():
        qkv.set_simd_target(t)
        assert qkv.simd_target() == t
        check_close(qkv.masked_softmax(X, lens), ref_masked_softmax(X, lens), atol, rtol,
                    f"masked_softmax on {t}")
        out, w = qkv.scaled_dot_product_attention(q, k, v, lens, return_weights=True)
        check_close(w, w_ref, atol, rtol, f"sdpa weights on {t}")
        check_close(out, o_ref, 10 * atol, 10 * rtol, f"sdpa output on {t}")
        seen[t] = out
    assert set(seen) == set(qkv.simd_targets())


# ---- exceptions ------------------------------------------------------------------

def test_exception_hierarchy():
    assert issubclass(qkv.Error, ValueError)
    assert issubclass(qkv.IoError, OSError)
    assert qkv.Error.__name__ == "Error" and qkv.Error.__module__ == "qkv"
    assert qkv.IoError.__name__ == "IoError" and qkv.IoError.__module__ == "qkv"
    assert qkv.Error.__doc__ and qkv.IoError.__doc__
    with pytest.raises(ValueError):
        qkv.set_num_threads(-1)
    try:
        qkv.set_simd_target("nope")
    except ValueError as e:
        assert type(e) is qkv.Error
    else:
        raise AssertionError("set_simd_target('nope') did not raise")


def test_public_names():
    for name in qkv.__all__:
        assert hasattr(qkv, name), name
    public = {n for n in dir(qkv._qkv) if not n.startswith("_")}
    # The extension's submodules are packages of their own (qkv.search):
    # each is importable as qkv.NAME and re-exports all of its public names.
    submodules = {n for n in public if isinstance(getattr(qkv._qkv, n), types.ModuleType)}
    assert submodules == {"search"}, submodules
    for name in submodules:
        module = importlib.import_module("qkv." + name)
        inner = {n for n in dir(getattr(qkv._qkv, name)) if not n.startswith("_")}
        assert inner == set(module.__all__), inner ^ set(module.__all__)
    public -= submodules
    assert public <= set(qkv.__all__) | {"__version__"}, public - set(qkv.__all__)


# A long call in a child process: SDPA in float64 over 40,000 queries and keys
# of d = 64 (4e11 flops: about 14 s on 2 cores), out= holding 7.0.
LONG_CALL = """
import signal, sys, time
import numpy as np
import qkv
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGINT, lambda *_: None)
n = int(sys.argv[2])
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, n, 64)) for _ in range(3))
out = np.full((1, n, 64), 7.0)
print("ready", flush=True)
start = time.monotonic()
try:
    qkv.scaled_dot_product_attention(q, k, v, out=out)
    print("finished", time.monotonic() - start, flush=True)
except KeyboardInterrupt:
    print("interrupted", time.monotonic() - start, bool((out == 7.0).all()), flush=True)
"""


def run_interrupted(handler, n, after):
    """Starts LONG_CALL, sends SIGINT `after` seconds into the call; its line
    and the seconds from the signal to that line."""
    proc = subprocess.Popen([sys.executable, "-c", LONG_CALL, handler, str(n)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(after)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        line = proc.stdout.readline().split()
        return line, time.monotonic() - sent
    finally:
        proc.kill()
        proc.wait()


def test_ctrl_c_stops_a_long_call_and_leaves_out_as_it_was():
    """Ctrl-C in a long call arrived only when the call ended (22 s later in
    the test that found it). Now the call stops between its tasks with
    KeyboardInterrupt (0.1-0.2 s after the signal on an idle machine; the
    bound, 3 s, is far from the call's ~14 s, so a loaded machine does not
    fail it), and out= holds what it held before (no partial output)."""
    line, latency = run_interrupted("default", 40000, 0.5)
    assert line[0] == "interrupted", line
    assert float(line[1]) < 0.5 + 3.0, line
    assert line[2] == "True", "out= was left partly written"
    assert latency < 3.0, f"stopped {latency:.2f} s after the signal"


def test_a_sigint_handler_that_does_not_raise_lets_the_call_finish():
    line, _ = run_interrupted("ignore", 6000, 0.05)
    assert line[0] == "finished", line


def test_numpy_2_is_refused_at_import_by_name(tmp_path):
    """pybind11 2.10 reads NumPy 1.x's dtype layout: under NumPy 2.4 every
    array was refused with "has dtype float32; expected float32 or float64".
    A NumPy that says it is 2.x (a stand-in module first on the path) makes
    the import fail, naming the version and what to do."""
    fake = tmp_path / "numpy"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "2.4.6"\n')
    package_root = os.path.dirname(os.path.dirname(qkv.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), package_root]))
    r = subprocess.run([sys.executable, "-c", "import qkv"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    assert "ImportError: qkv: this build's NumPy bindings (pybind11 2.10) read NumPy 1.x arrays " \
           "only, and this Python has NumPy 2.4.6" in r.stderr, r.stderr
    assert "pip install 'numpy<2'" in r.stderr
    # The real NumPy (1.x) imports it.
    r = subprocess.run([sys.executable, "-c", "import qkv, numpy; print(numpy.__version__)"],
                       env=dict(os.environ, PYTHONPATH=package_root), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("1."), r.stderr
