"""Random cases and the comparison of the Python package's peer tests (test_peer_*.py).

The book's code and the tolerance rule come from tests/peer/d2l_reference.py
(one copy, shared with the CLI's peer test); this module draws the cases both
pytest files run (sizes around the SIMD widths, valid lengths in every form
the API takes) and holds the assertion that compares by that rule.
"""

import math
import os
import sys

import numpy as np
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.environ.get("QKV_SOURCE_DIR", _ROOT), "tests", "peer"))

from d2l_reference import (  # noqa: E402
    TOLERANCE,
    D2lAdditiveAttention,
    D2lDotProductAttention,
    exact_lse,
    relative_error,
    row_lengths,
)

NUM_CASES = 60  # random cases per op and direction (forward, backward)
# Sizes around the SIMD widths (4/8/16 floats, 2/4/8 doubles) and one larger;
# the case index cycles the key axis through all of them.
SIZES = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100)
NP_DTYPE = {"float32": np.float32, "float64": np.float64}
TORCH_DTYPE = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
NP_INT = {"int32": np.int32, "int64": np.int64}
# qkv's names of the gradients (the NumPy API's named tuples); messages use them too.
GRAD_NAMES = {"q": "d_queries", "k": "d_keys", "v": "d_values", "W_q": "d_W_q",
              "W_k": "d_W_k", "w_v": "d_w_v"}

# Worst relative error seen per dtype, reported by each file at its end.
WORST = {}


def check_close(what, got, ref, dtype, axes, desc, scale=None, tolerance=None, slack=None):
    """Asserts relative_error(got, ref, scale) <= the dtype's tolerance (or
    `tolerance`); the message names the coordinates of the worst element.
    `slack` (per element, absolute) is a known error allowed on top: each
    difference counts only beyond it."""
    got, ref = (a.detach().to(torch.float64).numpy() if torch.is_tensor(a) else np.asarray(a)
                for a in (got, ref))
    assert got.shape == ref.shape, (f"{what}: shape {list(got.shape)}, expected "
                                    f"{list(ref.shape)}; {desc}")
    tol = TOLERANCE[dtype] if tolerance is None else tolerance
    compared = got.astype(np.float64)
    if slack is not None:
        diff = compared - ref
        compared = np.where(np.abs(diff) <= slack, ref, compared - np.sign(diff) * slack)
    err, at, denom = relative_error(compared, ref.astype(np.float64), scale)
    key = (dtype, what.split(" ")[0])  # "output (queries with L >= 1)" counts as output
    WORST[key] = max(WORST.get(key, 0.0), err)
    where = " ".join(f"{name}={index}" for name, index in zip(axes, at))
    allowed = ""
    if slack is not None:
        allowed = f" beyond a slack of {np.broadcast_to(slack, got.shape)[at]:.3g}"
    assert err <= tol, (f"{what}: rel err {err:.3g} > {tol:g} at {where}: got {got[at]!r}, "
                        f"ref {ref[at]!r}{allowed} (denominator {denom:.6g}); {desc}")
    return err


def report_worst(title):
    """Prints, one line per dtype, the worst relative errors since the last
    report (by quantity), and starts over."""
    lines = [title]
    for dtype in sorted({d for d, _ in WORST}):
        parts = ", ".join(f"{what} {err:.2g}" for (d, what), err in sorted(WORST.items())
                          if d == dtype)
        lines.append(f"  {dtype}: {parts}")
    print("\n".join(lines))
    WORST.clear()


def is_big(index):
    """Cases 9 and 18 of every 20 (both parities, so both dtypes of a 2-cycle)
    use 300 keys: more than one of the fused kernel's 256-key blocks."""
    return index % 20 in (9, 18)


def is_strided(index):
    """Two cases in eight (both parities) pass non-contiguous inputs."""
    return index % 8 in (1, 6)


def describe(**fields):
    return " ".join(f"{k}={v}" for k, v in fields.items())


# ---- valid lengths ---------------------------------------------------------------

class Lens:
    """A case's valid lengths: `value` as the code under test gets it (array,
    list or int; None when absent), `batched` as an int64 array (B) or (B, Nq)
    for the reference, `rows` the (B, Nq) length of every row."""

    def __init__(self, value, batched, rows, desc):
        self.value, self.batched, self.rows, self.desc = value, batched, rows, desc

    def tensor(self):
        return None if self.batched is None else torch.from_numpy(self.batched)


def draw_lens(rng, index, batch, num_queries, num_keys, two_d):
    """Lengths in [1, Nk] (the random cases keep L >= 1: L = 0 is where d2l
    differs by design, and has its own tests). The index cycles the form
    (None, (B), (B, Nq)) and the integer type; every fifth case with lengths
    passes a list. 2-D inputs (a batch of one) also get the unbatched forms:
    a scalar for (1), (Nq) for (1, Nq)."""
    form = ("none", "1d", "2d")[(index // 2) % 3]
    if form == "none":
        return Lens(None, None, row_lengths(None, batch, num_queries, num_keys), "none")
    int_type = ("int32", "int64")[(index // 6) % 2]
    shape = (batch,) if form == "1d" else (batch, num_queries)
    batched = rng.integers(1, num_keys + 1, size=shape).astype(NP_INT[int_type])
    value, kind = batched, f"{form}/{int_type}"
    if two_d and rng.random() < 0.5:
        value = int(batched[0]) if form == "1d" else batched.reshape(-1)
        kind += " scalar" if form == "1d" else " (Nq)"
    if index % 5 == 4:
        value = value.tolist() if isinstance(value, np.ndarray) else value
        kind += " list"
    rows = row_lengths(batched, batch, num_queries, num_keys)
    return Lens(value, batched.astype(np.int64), rows, kind)


def strided(rng, array):
    """The same values in memory that is not C-contiguous: every other element,
    Fortran order, or a reversed batch axis (a negative stride)."""
    kind = int(rng.integers(3))
    if kind == 0:
        return np.repeat(array, 2, axis=-1)[..., ::2]
    if kind == 1:
        return np.asfortranarray(array)
    return array[::-1].copy()[::-1]


# ---- softmax cases ---------------------------------------------------------------------

class SoftmaxCase:
    """Random scores (B, Nq, Nk) in float64 (cast per test) with lengths >= 1:
    sometimes offset to +90 (exp overflows in float32 unless the max is
    subtracted) or -100, sometimes -inf among the valid scores (weight 0;
    column 0 stays finite), sometimes NaN, +-inf or 1e30 in the masked
    positions, which qkv never reads and d2l overwrites."""

    def __init__(self, index, rng, dtype):
        self.index, self.dtype = index, dtype
        self.two_d = index % 7 == 3
        batch = 1 if self.two_d else int(rng.integers(1, 5))
        num_keys = 300 if is_big(index) else SIZES[index % len(SIZES)]
        num_queries = int(rng.choice(SIZES))
        spread = float(rng.choice([0.1, 1.0, 3.0, 10.0]))
        offset = float(rng.choice([0.0, 0.0, 0.0, 90.0, -100.0]))
        self.scores = rng.normal(offset, spread, size=(batch, num_queries, num_keys))
        self.lens = draw_lens(rng, index, batch, num_queries, num_keys, self.two_d)
        self.notes = [f"spread {spread:g}", f"offset {offset:g}"]
        if rng.random() < 0.25 and num_keys > 1:
            holes = rng.random(self.scores.shape) < 0.2
            holes[..., 0] = False
            self.scores[holes] = -math.inf
            self.notes.append("-inf scores")
        masked = np.arange(num_keys)[None, None, :] >= self.lens.rows[..., None]
        if masked.any() and rng.random() < 0.5:
            garbage = np.array([math.nan, math.inf, -math.inf, 1e30])
            self.scores[masked] = rng.choice(garbage, size=int(masked.sum()))
            self.notes.append("garbage in masked positions")
        self.shape_desc = describe(B=batch, Nq=num_queries, Nk=num_keys)

    def desc(self, *extra):
        return (f"case {self.index}: dtype={self.dtype} {self.shape_desc}"
                f"{' 2-D' if self.two_d else ''} lens={self.lens.desc}"
                + "".join(f" [{n}]" for n in self.notes + list(extra)))

    def unbatch(self, array):
        return array[0] if self.two_d else array

    def axes(self):
        return ("q", "k") if self.two_d else ("b", "q", "k")


# ---- attention cases -----------------------------------------------------------------

class AttentionCase:
    """One random attention problem, in float64 (cast per test). Keys that no
    query of their batch element may see are zero here (the reference's
    inputs); `dead_keys` marks them, and keys_for_qkv fills them with NaN
    when `nan_dead_keys`: qkv must never read them."""

    def __init__(self, op, index, rng, dtype, two_d=None, big=None, lens_index=None):
        self.op, self.index, self.dtype = op, index, dtype
        self.two_d = index % 7 == 3 if two_d is None else two_d
        batch = 1 if self.two_d else int(rng.integers(1, 4))
        num_keys = SIZES[index % len(SIZES)]
        num_queries = int(rng.choice(SIZES))
        if is_big(index) if big is None else big:
            num_keys, num_queries = 300, int(rng.choice((17, 40)))
        value_dim = int(rng.choice(SIZES))
        self.notes = []
        if op == "dot":
            head_dim = SIZES[(index * 4 + 3) % len(SIZES)]
            query_dim = key_dim = head_dim
            spread = float(rng.choice([0.3, 1.0, 2.0]))
            self.scale = None
            if rng.random() < 0.25:
                # A multiple of the default 1/sqrt(D), so the scores stay O(1) at
                # any D: a score's float32 rounding (~eps * scale * sum_d |q_d k_d|)
                # is a relative error of the weights, in torch's float32 as in qkv's.
                self.scale = float(rng.uniform(0.25, 2.0)) / math.sqrt(head_dim)
                self.notes.append(f"scale {self.scale:.4g}")
            self.shape_desc = describe(B=batch, Nq=num_queries, Nk=num_keys, D=head_dim,
                                       Dv=value_dim)
        else:
            query_dim = int(rng.choice(SIZES))
            key_dim = SIZES[(index * 4 + 3) % len(SIZES)]
            if key_dim == query_dim:
                query_dim = SIZES[(index * 4 + 8) % len(SIZES)]
            hidden = int(rng.choice((1, 3, 7, 8, 9, 16, 24, 33)))
            spread = 1.0
            # nn.Linear's initialisation, uniform in +-1/sqrt(fan_in); w_v sometimes
            # x5 for sharper weights, and given as (H) or (1, H).
            self.W_q = rng.uniform(-1, 1, size=(hidden, query_dim)) / math.sqrt(query_dim)
            self.W_k = rng.uniform(-1, 1, size=(hidden, key_dim)) / math.sqrt(key_dim)
            self.w_v = rng.uniform(-1, 1, size=(1, hidden)) / math.sqrt(hidden)
            if rng.random() < 0.3:
                self.w_v *= 5.0
                self.notes.append("w_v x5")
            if rng.random() < 0.5:
                self.w_v = self.w_v.reshape(-1)
            self.notes.append(f"w_v {list(self.w_v.shape)}")
            self.shape_desc = describe(B=batch, Nq=num_queries, Nk=num_keys, Dq=query_dim,
                                       Dk=key_dim, H=hidden, Dv=value_dim)
        self.queries = rng.normal(0.0, spread, size=(batch, num_queries, query_dim))
        self.keys = rng.normal(size=(batch, num_keys, key_dim))
        self.values = rng.normal(size=(batch, num_keys, value_dim))
        # lens_index: the index draw_lens cycles its forms by (a test that cycles
        # three dtypes passes one that keeps the two cycles independent).
        self.lens = draw_lens(rng, index if lens_index is None else lens_index, batch,
                              num_queries, num_keys, self.two_d)
        reach = self.lens.rows.max(axis=1)  # (B): keys at or past it are seen by no query
        self.dead_keys = np.arange(num_keys)[None, :] >= reach[:, None]
        self.keys[self.dead_keys] = 0.0
        self.nan_dead_keys = bool(self.dead_keys.any()) and rng.random() < 0.4
        if self.nan_dead_keys:
            self.notes.append("NaN in keys no query may see")

    @property
    def attention_scale(self):
        if self.op != "dot":
            return 1.0
        return 1.0 / math.sqrt(self.queries.shape[-1]) if self.scale is None else self.scale

    def keys_for_qkv(self):
        keys = self.keys.copy()
        if self.nan_dead_keys:
            keys[self.dead_keys] = np.nan
        return keys

    def desc(self, *extra):
        return (f"case {self.index}: dtype={self.dtype} {self.shape_desc}"
                f"{' 2-D' if self.two_d else ''} lens={self.lens.desc}"
                + "".join(f" [{n}]" for n in self.notes + list(extra)))

    def unbatch(self, array):
        """What qkv returns for this case: 2-D inputs give results without the batch axis."""
        return array[0] if self.two_d else array

    def axes(self, *names):
        return names if self.two_d else ("b",) + names


class Reference:
    """d2l's module run on a case: out, weights, scores (torch tensors), lse
    (float64 numpy), and with a d_output the gradients by autograd: q, k, v
    and, for additive attention, W_q, W_k, w_v (w_v shaped like the case's)."""

    def __init__(self, case, torch_dtype, d_output=None):
        need_grad = d_output is not None
        q, k, v = (torch.tensor(a, dtype=torch_dtype, requires_grad=need_grad)
                   for a in (case.queries, case.keys, case.values))
        if case.op == "dot":
            module = D2lDotProductAttention(dropout=0.5, scale=case.scale)
        else:
            module = D2lAdditiveAttention(case.keys.shape[-1], case.queries.shape[-1],
                                          case.W_q.shape[0], dropout=0.5).to(torch_dtype)
            with torch.no_grad():
                module.W_q.weight.copy_(torch.from_numpy(case.W_q))
                module.W_k.weight.copy_(torch.from_numpy(case.W_k))
                module.w_v.weight.copy_(torch.from_numpy(case.w_v.reshape(1, -1)))
        module.eval()  # no dropout: torch's mask is not qkv's
        out = module(q, k, v, case.lens.tensor())
        self.out = out.detach()
        self.weights = module.attention_weights.detach()
        self.scores = module.scores.detach()
        self.lse = exact_lse(self.scores, case.lens.tensor())
        if need_grad:
            out.backward(torch.as_tensor(d_output, dtype=torch_dtype))
            self.grads = {"q": q.grad, "k": k.grad, "v": v.grad}
            if case.op == "additive":
                self.grads.update(W_q=module.W_q.weight.grad, W_k=module.W_k.weight.grad,
                                  w_v=module.w_v.weight.grad.reshape(case.w_v.shape))


# Lengths with zeros for the L = 0 tests (B = 3, Nq = 4, Nk = 6).
ZERO_LENGTH_LENS = {
    "1d/int32": np.array([0, 6, 3], dtype=np.int32),
    "2d/int64": np.array([[1, 0, 6, 2], [0, 0, 0, 0], [3, 5, 0, 4]], dtype=np.int64),
}


def zero_length_case(op, dtype, rng, lens):
    """A case with B = 3, Nq = 4, Nk = 6 and the given lengths, zeros allowed."""
    case = AttentionCase(op, 0, rng, dtype, two_d=False, big=False)
    batch, num_queries, num_keys = 3, 4, 6
    case.queries = rng.normal(size=(batch, num_queries, case.queries.shape[-1]))
    case.keys = rng.normal(size=(batch, num_keys, case.keys.shape[-1]))
    case.values = rng.normal(size=(batch, num_keys, case.values.shape[-1]))
    case.nan_dead_keys = False
    rows = row_lengths(lens, batch, num_queries, num_keys)
    case.lens = Lens(lens, lens.astype(np.int64), rows, str(lens.tolist()))
    case.shape_desc = describe(B=batch, Nq=num_queries, Nk=num_keys)
    return case
