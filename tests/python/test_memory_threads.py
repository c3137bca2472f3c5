"""Memory and threads: zero copies, the GIL released, thread safety, no leaks.

- Zero-copy: in a fresh child process (so no earlier peak hides an
  allocation), 1 GiB of float32 keys go through scaled_dot_product_attention
  and the call raises the peak resident set (VmHWM) by far less than the
  array (< 64 MiB), with the right result, and so do 1 GiB of keys stored
  (B, Nk, H, D) and read as heads (B, H, Nk, D) through a transposed view
  (grouped-query attention, 4 query heads per key head); a 1 GiB masked_softmax input raises
  it by the 1 GiB of its new output, not 2; a backward whose d_keys is 1 GiB
  hands the library's buffer to NumPy without a copy (+1 GiB, not 2).
- The GIL is released: while one Python thread is inside a long qkv call, a
  second Python thread runs (it records time stamps in the middle half of the
  call); a call that holds the GIL (sorted() of a long list) is the control
  showing that the measurement tells the two apart.
- Thread safety: two Python threads calling different ops concurrently, many
  times, get bitwise the results of sequential calls.
- No leaks: 10^5 small calls (every op, backward passes, conversions and error
  paths that raise) in a child process keep its RSS flat after a warm-up of
  10^4, and input arrays' reference counts are unchanged after calls.
"""

import json
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import qkv

MiB = 2**20
GiB = 2**30


def run_child(code, timeout=300):
    """Runs `code` in a fresh interpreter (same environment); returns its last stdout line
    as JSON."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"child failed ({proc.returncode}): {proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


PEAK = """
import json
import numpy as np
import qkv

def peak():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")

rng = np.random.default_rng(SEED)
"""


def child_code(seed, body):
    return PEAK.replace("SEED", str(seed)) + textwrap.dedent(body)


# ---- zero copies -------------------------------------------------------------------------

def test_sdpa_reads_1_gib_of_keys_in_place(seed):
    # Keys and values repeat a block of 4096 rows 1024 times, so the result is
    # the attention over one block (each repetition gets the same weights).
    result = run_child(child_code(seed, """
        Nk, D, R = 2**22, 64, 4096
        k_block = rng.standard_normal((R, D)).astype(np.float32)
        v_block = rng.standard_normal((R, 1)).astype(np.float32)
        q = rng.standard_normal((1, 4, D)).astype(np.float32)
        keys = np.empty((1, Nk, D), np.float32)          # 1 GiB, every page written
        values = np.empty((1, Nk, 1), np.float32)
        for start in range(0, Nk, R):
            keys[0, start:start + R] = k_block
            values[0, start:start + R] = v_block
        before = peak()
        out = qkv.scaled_dot_product_attention(q, keys, values)
        after = peak()
        s = q[0].astype(np.float64) @ k_block.T.astype(np.float64) / 8.0
        p = np.exp(s - s.max(1, keepdims=True))
        ref = (p / p.sum(1, keepdims=True)) @ v_block.astype(np.float64)
        print(json.dumps({"added": after - before, "size": keys.nbytes,
                          "shape": list(out.shape), "error": float(np.abs(out[0] - ref).max())}))
    """))
    assert result["size"] == GiB
    assert result["shape"] == [1, 4, 1]
    assert result["error"] < 1e-4, result
    assert result["added"] < 64 * MiB, \
        f"scaled_dot_product_attention added {result['added'] / MiB:.0f} MiB to the peak"


def test_sdpa_reads_1_gib_of_token_major_heads_in_place(seed):
    # Keys and values of 8 heads stored (B, Nk, H, D), as one fused projection
    # leaves them, and read as (B, H, Nk, D) through a transposed view (rows
    # H D apart): no copy. Each head's keys repeat a block of R rows, so each
    # head's result is the attention over its block. 4 query heads per key
    # head (grouped-query attention).
    result = run_child(child_code(seed, """
        Nk, H, Hq, D, R = 2**19, 8, 32, 64, 2048
        k_block = rng.standard_normal((R, H, D)).astype(np.float32)
        v_block = rng.standard_normal((R, H, 1)).astype(np.float32)
        q = rng.standard_normal((1, Hq, 2, D)).astype(np.float32)
        keys = np.empty((1, Nk, H, D), np.float32)       # 1 GiB, every page written
        values = np.empty((1, Nk, H, 1), np.float32)
        for start in range(0, Nk, R):
            keys[0, start:start + R] = k_block
            values[0, start:start + R] = v_block
        k4, v4 = keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)
        before = peak()
        out = qkv.scaled_dot_product_attention(q, k4, v4)
        after = peak()
        error = 0.0
        for h in range(Hq):
            kb, vb = k_block[:, h // 4].astype(np.float64), v_block[:, h // 4].astype(np.float64)
            s = q[0, h].astype(np.float64) @ kb.T / 8.0
            p = np.exp(s - s.max(1, keepdims=True))
            ref = (p / p.sum(1, keepdims=True)) @ vb
            error = max(error, float(np.abs(out[0, h] - ref).max()))
        print(json.dumps({"added": after - before, "size": keys.nbytes,
                          "shape": list(out.shape), "error": error}))
    """))
    assert result["size"] == GiB
    assert result["shape"] == [1, 32, 2, 1]
    assert result["error"] < 1e-4, result
    assert result["added"] < 64 * MiB, \
        f"scaled_dot_product_attention added {result['added'] / MiB:.0f} MiB to the peak"


def test_masked_softmax_of_1_gib_adds_only_its_output(seed):
    result = run_child(child_code(seed, """
        n = 2**14
        X = np.empty((1, n, n), np.float32)              # 1 GiB
        row = rng.standard_normal(n).astype(np.float32)
        X[0] = row
        before = peak()
        W = qkv.masked_softmax(X, [n - 3])
        after = peak()
        x = row.astype(np.float64)[: n - 3]
        ref = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
        err = max(float(np.abs(W[0, i, : n - 3] - ref).max()) for i in (0, n // 2, n - 1))
        print(json.dumps({"added": after - before, "size": X.nbytes, "out": W.nbytes,
                          "error": err, "masked": float(np.abs(W[0, :, n - 3:]).max())}))
    """))
    assert result["size"] == result["out"] == GiB
    assert result["error"] < 1e-9 and result["masked"] == 0, result
    assert GiB - 64 * MiB < result["added"] < GiB + 64 * MiB, \
        f"masked_softmax of 1 GiB added {result['added'] / MiB:.0f} MiB to the peak (its " \
        f"output is 1024 MiB)"


def test_backward_hands_its_gradients_to_numpy_without_a_copy(seed):
    result = run_child(child_code(seed, """
        Nk, D = 2**22, 64
        keys = np.empty((1, Nk, D), np.float32)          # 1 GiB
        keys[...] = 0.25
        values = np.ones((1, Nk, 1), np.float32)
        q = rng.standard_normal((1, 4, D)).astype(np.float32)
        out, lse = qkv.scaled_dot_product_attention(q, keys, values, return_lse=True)
        before = peak()
        g = qkv.scaled_dot_product_attention_backward(q, keys, values, out, lse,
                                                      np.ones_like(out))
        after = peak()
        d_keys = g.d_keys
        print(json.dumps({"added": after - before, "d_keys": d_keys.nbytes,
                          "owner": type(d_keys.base).__name__,
                          "writeable": bool(d_keys.flags.writeable),
                          "contiguous": bool(d_keys.flags.c_contiguous)}))
    """))
    assert result["d_keys"] == GiB
    assert result["writeable"] and result["contiguous"]
    assert GiB - 64 * MiB < result["added"] < GiB + 128 * MiB, \
        f"a backward with a 1 GiB d_keys added {result['added'] / MiB:.0f} MiB to the peak"


# ---- the GIL -------------------------------------------------------------------------------

def stamps_during(call):
    """Runs call() on this thread while another Python thread records time stamps
    (at most one per 0.5 ms); returns (t0, t1, stamps) with [t0, t1] the call."""
    stamps, state = [], {"active": False, "stop": False}

    def counter():
        last = 0.0
        while not state["stop"]:
            if state["active"]:
                now = time.perf_counter()
                if now - last >= 0.0005:
                    stamps.append(now)
                    last = now

    thread = threading.Thread(target=counter)
    thread.start()
    try:
        time.sleep(0.02)
        state["active"] = True
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        state["active"] = False
    finally:
        state["stop"] = True
        thread.join()
    return t0, t1, stamps


def in_middle(t0, t1, stamps):
    """Stamps in the middle half of [t0, t1]: with the GIL held by the call the
    other thread can run only before the call enters C or after it returns
    (within a switch interval, 5 ms, of either end), never there."""
    lo, hi = t0 + 0.25 * (t1 - t0), t1 - 0.25 * (t1 - t0)
    return sum(lo <= s <= hi for s in stamps)


def long_calls():
    """Makers of calls of about 0.05-0.5 s each on one thread: maker(rng) -> call."""
    n = lambda rng, *s: rng.standard_normal(s)  # noqa: E731

    def sdpa(rng):
        q, k, v = n(rng, 1, 4096, 64), n(rng, 1, 4096, 64), n(rng, 1, 4096, 64)
        return lambda: qkv.scaled_dot_product_attention(q, k, v)

    def sdpa_backward(rng):
        q, k, v = (n(rng, 1, 4096, 64).astype(np.float32) for _ in range(3))
        out, lse = qkv.scaled_dot_product_attention(q, k, v, return_lse=True)
        return lambda: qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, out)

    def scores(rng):
        X = np.empty((64, 1024, 1024), np.float32)  # rows repeat: quick to make
        X[...] = n(rng, 1024)
        return X

    def softmax(rng):
        X = scores(rng)
        return lambda: qkv.masked_softmax(X)

    def softmax_backward(rng):
        X = scores(rng)
        return lambda: qkv.masked_softmax_backward(X, X)

    def additive(rng):
        q, k, v = n(rng, 1, 768, 32), n(rng, 1, 1024, 32), n(rng, 1, 1024, 8)
        Wq, Wk, wv = n(rng, 64, 32), n(rng, 64, 32), n(rng, 64)
        return lambda: qkv.additive_attention(q, k, v, Wq, Wk, wv)

    def pooling(rng):
        w, v = np.empty((4, 1024, 1024)), np.empty((4, 1024, 512))
        w[...], v[...] = n(rng, 1024), n(rng, 512)
        return lambda: qkv.attention_pooling(w, v)

    def regression(rng):
        x, xq = rng.uniform(0, 5, (10000, 2)), rng.uniform(0, 5, (20000, 2))
        y = np.sin(x).sum(1)
        return lambda: qkv.nadaraya_watson(x, y, xq, bandwidth=0.3)

    def cv(rng):
        x = rng.uniform(0, 5, (400, 2))
        y = np.sin(x).sum(1) + rng.normal(0, 0.1, 400)
        return lambda: qkv.KernelRegression(bandwidth="cv").fit(x, y)

    def parametric(rng):
        x = rng.uniform(0, 5, 1500)
        y = np.sin(x) + rng.normal(0, 0.1, 1500)
        return lambda: qkv.train_parametric(x, y, initial_w=1.0)

    return {"scaled_dot_product_attention": sdpa,
            "scaled_dot_product_attention_backward": sdpa_backward,
            "masked_softmax": softmax, "masked_softmax_backward": softmax_backward,
            "additive_attention": additive, "attention_pooling": pooling,
            "nadaraya_watson": regression, "KernelRegression.fit(cv)": cv,
            "train_parametric": parametric}


@pytest.fixture
def one_thread():
    before = qkv.get_num_threads()
    qkv.set_num_threads(1)
    yield
    qkv.set_num_threads(before)


def test_a_call_holding_the_gil_stops_the_other_thread(rng):
    # The control: sorted() of ints runs in C without releasing the GIL.
    values = rng.integers(0, 2**62, size=2_000_000).tolist()
    t0, t1, stamps = stamps_during(lambda: sorted(values))
    assert t1 - t0 > 0.1, "the control call was too short to tell"
    assert in_middle(t0, t1, stamps) == 0


@pytest.mark.parametrize("op", list(long_calls()))
def test_calls_release_the_gil(op, rng, one_thread):
    # Up to 3 tries, in case the machine's other work kept the second thread
    # off the CPUs for a whole try; a call that held the GIL would fail all 3.
    call = long_calls()[op](rng)
    tries = []
    for _ in range(3):
        t0, t1, stamps = stamps_during(call)
        assert t1 - t0 > 0.04, f"{op} took {1e3 * (t1 - t0):.0f} ms: too short to tell"
        tries.append((round(1e3 * (t1 - t0)), in_middle(t0, t1, stamps), len(stamps)))
        if tries[-1][1] > 0:
            return
    raise AssertionError(f"{op}: no other Python thread ran in the middle half of the call "
                         f"in 3 tries (ms, stamps in the middle, stamps in all): {tries}")


# ---- thread safety -------------------------------------------------------------------------

def as_tuple(value):
    return tuple(value) if isinstance(value, tuple) else (value,)


def concurrent_workloads(rng):
    n = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q, k, v = n(2, 40, 16), n(2, 300, 16), n(2, 300, 8)
    lens = rng.integers(0, 301, size=(2, 40))
    out, lse = qkv.scaled_dot_product_attention(q, k, v, lens, dropout_p=0.1, seed=3,
                                                return_lse=True)
    Wq, Wk, wv = n(12, 16), n(12, 16), n(12)
    aout, alse = qkv.additive_attention(q, k, v, Wq, Wk, wv, lens, return_lse=True)
    X = n(4, 50, 200)
    x = rng.uniform(0, 5, 300)
    y = np.sin(x)
    first = [
        lambda: qkv.scaled_dot_product_attention(q, k, v, lens, dropout_p=0.1, seed=3,
                                                 return_weights=True, return_lse=True),
        lambda: qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, out, lens,
                                                          dropout_p=0.1, seed=3),
        lambda: qkv.masked_softmax(X, [10, 200, 0, 57]),
    ]
    second = [
        lambda: qkv.additive_attention(q, k, v, Wq, Wk, wv, lens, return_weights=True),
        lambda: qkv.additive_attention_backward(q, k, v, Wq, Wk, wv, aout, alse, aout, lens),
        lambda: qkv.nadaraya_watson(x, y, x[:50], kernel="epanechnikov", bandwidth=0.4),
        lambda: qkv.attention_pooling(X, X.transpose(0, 2, 1)),
    ]
    return first, second


def test_concurrent_calls_give_the_sequential_results(rng):
    workloads = concurrent_workloads(rng)
    expected = [[as_tuple(call()) for call in calls] for calls in workloads]
    rounds = 200
    got = [[], []]
    errors = []
    barrier = threading.Barrier(2)

    def worker(w):
        try:
            barrier.wait()
            for _ in range(rounds):
                got[w].append([as_tuple(call()) for call in workloads[w]])
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for w in (0, 1):
        assert len(got[w]) == rounds
        for r, results in enumerate(got[w]):
            for c, (result, want) in enumerate(zip(results, expected[w])):
                for i, (g, e) in enumerate(zip(result, want)):
                    assert g.tobytes() == e.tobytes(), \
                        f"thread {w}, round {r}, call {c}, result {i} differs from sequential"


# ---- leaks ---------------------------------------------------------------------------------

LEAK_CHILD = """
import gc, json
import numpy as np
import qkv

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

rng = np.random.default_rng(SEED)
n = lambda *s: rng.standard_normal(s).astype(np.float32)
q, k, v = n(2, 3, 8), n(2, 9, 8), n(2, 9, 4)
q64 = q.astype(np.float64)
lens32 = np.array([3, 9], np.int32)
lens8 = np.array([[1, 2, 3], [9, 0, 4]], np.uint8)
Wq, Wk, wv = n(5, 8), n(5, 8), n(5)
out, lse = qkv.scaled_dot_product_attention(q, k, v, lens32, return_lse=True)
aout, alse = qkv.additive_attention(q, k, v, Wq, Wk, wv, return_lse=True)
X = n(2, 3, 9)
big_endian = X.astype(">f4")
misaligned = np.frombuffer(b"\\0" + X.tobytes(), np.float32, X.size, offset=1).reshape(X.shape)
x = rng.uniform(0, 5, 20)
y = np.sin(x)
model = qkv.KernelRegression(bandwidth=0.5).fit(x, y)

def call_all():
    qkv.masked_softmax(X, lens8)
    qkv.masked_softmax(big_endian, [3, 9])
    qkv.masked_softmax(misaligned)
    qkv.masked_softmax_backward(X, X, lens32)
    qkv.scaled_dot_product_attention(q, k, v, lens32, dropout_p=0.5, seed=1,
                                     return_weights=True, return_lse=True)
    qkv.scaled_dot_product_attention(q64[0], k[0].astype(np.float64),
                                     v[0].astype(np.float64), 4)
    qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, out, lens32)
    qkv.additive_attention(q, k, v, Wq, Wk, wv, lens8[:, :3])
    qkv.additive_attention_backward(q, k, v, Wq, Wk, wv, aout, alse, aout)
    qkv.attention_pooling(X, v)
    qkv.average_pooling(v, 3, [1, 2])
    qkv.one_hot_lookup([[0, 1, 2], [3, 4, 5]], v)
    qkv.one_hot_weights([1, 2], 4)
    qkv.uniform_weights(2, 3, 4, [1, 2])
    qkv.nadaraya_watson(x, y, x[:5], bandwidth=[0.4])
    model.predict(x[:4])
    model.weights(x[:4])
    for bad in (lambda: qkv.scaled_dot_product_attention(q, k[..., :3], v),    # qkv.Error
                lambda: qkv.masked_softmax(X, [1, 99]),                          # qkv.Error
                lambda: qkv.scaled_dot_product_attention(q, k.astype(int), v),  # TypeError
                lambda: qkv.masked_softmax(X[0, 0]),                             # ValueError
                lambda: qkv.scaled_dot_product_attention(q, k, v, seed=-1),     # ValueError
                lambda: qkv.nadaraya_watson(x, y, x, kernel="nope"),             # qkv.Error
                lambda: qkv.KernelRegression().predict(x)):                      # not fitted
        try:
            bad()
        except (TypeError, ValueError):
            pass
        else:
            raise AssertionError("no error")

# One thread in 4 rounds of 5 (quick), two in the fifth (the threaded paths).
CALLS_PER_ROUND = 24
for r in range(10_000 // CALLS_PER_ROUND):
    qkv.set_num_threads(2 if r % 5 == 4 else 1)
    call_all()
gc.collect()
warm = rss()
for r in range(100_000 // CALLS_PER_ROUND):
    qkv.set_num_threads(2 if r % 5 == 4 else 1)
    call_all()
gc.collect()
end = rss()
print(json.dumps({"warm": warm, "end": end}))
"""


def test_many_calls_keep_rss_flat(seed):
    result = run_child(LEAK_CHILD.replace("SEED", str(seed)), timeout=600)
    grown = result["end"] - result["warm"]
    assert grown < 4 * MiB, f"RSS grew by {grown / MiB:.1f} MiB over 10^5 calls after warm-up"


def test_reference_counts_are_unchanged(rng):
    n = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q, k, v = n(2, 3, 8), n(2, 9, 8), n(2, 9, 4)
    lens = np.array([[1, 2, 3], [9, 0, 4]], np.int32)
    lens_u8 = lens.astype(np.uint8)
    Wq, Wk, wv = n(5, 8), n(5, 8), n(5)
    X = n(2, 3, 9)
    x = rng.uniform(0, 5, 20)
    y = np.sin(x)
    arrays = {"q": q, "k": k, "v": v, "lens": lens, "lens_u8": lens_u8, "Wq": Wq, "Wk": Wk,
              "wv": wv, "X": X, "x": x, "y": y}
    before = {name: sys.getrefcount(a) for name, a in arrays.items()}
    results = []
    for _ in range(50):
        out, w, lse = qkv.scaled_dot_product_attention(q, k, v, lens, return_weights=True,
                                                       return_lse=True)
        g = qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, out, lens)
        aout, alse = qkv.additive_attention(q, k, v, Wq, Wk, wv, lens_u8, return_lse=True)
        ga = qkv.additive_attention_backward(q, k, v, Wq, Wk, wv, aout, alse, aout, lens_u8)
        results.append((qkv.masked_softmax(X, lens), qkv.masked_softmax_backward(X, X, lens),
                        qkv.attention_pooling(X, v), qkv.average_pooling(v, 3, lens),
                        qkv.nadaraya_watson(x, y, x, bandwidth=0.3), g, ga))
        for bad in (lambda: qkv.scaled_dot_product_attention(q, k[..., :3], v, lens),
                    lambda: qkv.masked_softmax(X, lens + 100),
                    lambda: qkv.scaled_dot_product_attention(q, k, v.astype(np.float64)),
                    lambda: qkv.additive_attention(q, k, v, Wq, Wk, wv[:2], lens_u8)):
            with pytest.raises((TypeError, ValueError)):
                bad()
    del out, w, lse, g, aout, alse, ga
    after = {name: sys.getrefcount(a) for name, a in arrays.items()}
    assert after == before
    # Results hold no references to the inputs: dropping them changes nothing.
    results.clear()
    assert {name: sys.getrefcount(a) for name, a in arrays.items()} == before
    # A result is referenced only by its name (and getrefcount's argument).
    result = qkv.masked_softmax(X)
    assert sys.getrefcount(result) == 2
