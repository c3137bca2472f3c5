"""The Python peer harness: qkv's Python API held to PyTorch formulations of the same math.

What tests/attention_suite.h is to the C++ tests, this module is to the
Python peer tests (test_peer_*.py):

- Case: one peer problem, its sizes, its inputs (float64 values already
  rounded to the case's dtype, so qkv and the reference see the same
  numbers), its valid lengths in the form qkv gets them, a random d_output G
  when gradients are checked (those of sum(output * G)), the feature's own
  options (causal, masks, a bias, a layout) and notes for its description;
- draw_case: the one drawer of a Case from its sizes;
- check_peer(qkv_call, formula, case): qkv_call(case) gives qkv's results
  by name ("output", "weights", "lse", "d_queries", ...), formula(case) the
  references (Want: the value and what the rule needs); every result is
  compared by the one rule, tests/peer/d2l_reference.check_close (which
  also serves the CLI's peer test, and says why its tolerances are what
  they are);
- Peer and run_peer: one row of a peer file's list of cases (so many cases
  per dtype, drawn by one function, through one qkv_call and one formula),
  and the loop that runs it.

Then the d2l peers' cases (test_peer_numpy.py, test_peer_torch.py: sizes
around the SIMD widths cycled by the case index, lengths in every form the
API takes) and their formula, the book's modules (tests/peer/d2l_reference.py).
"""

import math
import os
import sys
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.environ.get("QKV_SOURCE_DIR", _ROOT), "tests", "peer"))

from d2l_reference import (  # noqa: E402,F401  (the rule's names, re-exported to the peer files)
    BF16_BIAS_GRADIENT_TOLERANCE,
    BF16_GRADIENT_TOLERANCE,
    BF16_OUTPUT_TOLERANCE,
    BF16_ROUNDING,
    GRADIENT_TOLERANCE,
    SCORING_TOLERANCE,
    D2lAdditiveAttention,
    D2lDotProductAttention,
    additive_grad_scales,
    check_close,
    d2l_masked_softmax,
    describe,
    draw_lens,
    exact_lse,
    lse_scale,
    pooled_scale,
    report_worst,
    row_lengths,
    sdpa_grad_scales,
    softmax_grad_scale,
)

NP_DTYPE = {"float32": np.float32, "float64": np.float64}
TORCH_DTYPE = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def dtype_name(a):
    """The name of an array's or a tensor's dtype: float32, float64 or bfloat16."""
    return str(a.dtype).removeprefix("torch.")


def rounded(array, dtype):
    """float64 values rounded to `dtype` (bf16 through float32, as a float32
    tensor's .bfloat16() rounds), still float64."""
    array = np.asarray(array, dtype=np.float64)
    if dtype == "float64":
        return array
    if dtype == "float32":
        return array.astype(np.float32).astype(np.float64)
    return torch.from_numpy(array.astype(np.float32)).bfloat16().double().numpy()


# ---- the case type --------------------------------------------------------------------

class Lens:
    """A case's valid lengths: `value` as qkv gets it (array, list or int;
    None when absent), `array` the int64 (B) or (B, Nq) array the reference
    gets (None when absent), `rows` the (B, Nq) length of every row."""

    def __init__(self, value, array, rows, desc):
        self.value, self.array, self.rows, self.desc = value, array, rows, desc

    def tensor(self):
        return None if self.array is None else torch.from_numpy(self.array)

    def for_torch(self):
        """`value` as qkv.torch gets it: arrays become tensors; lists and ints stay."""
        if isinstance(self.value, np.ndarray):
            return torch.from_numpy(self.value)
        return self.value


@dataclass
class Case:
    """One peer problem (draw_case draws it). `sizes` names the axes: B (absent:
    2-D inputs, a batch of one), H and Hkv (4-D inputs: query and key heads), Nq,
    Nk, D (or Dq and Dk), Dv, and additive attention's hidden size. `inputs`
    are float64 arrays holding values of the case's dtype: queries, keys,
    values (or scores) and any parameter, bias or weight matrix both sides
    take; `options` what else both sides read (causal, masks, a scale, a
    layout)."""
    index: int
    dtype: str
    sizes: dict
    inputs: dict
    lens: Lens = None
    d_output: np.ndarray = None
    options: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    @property
    def two_d(self):
        return "B" not in self.sizes

    def valid_lens(self):
        """The lengths as an int64 tensor (the batched form), None when absent."""
        return None if self.lens is None else self.lens.tensor()

    def add_input(self, name, array):
        """Adds a float input both sides take, rounded to the case's dtype."""
        self.inputs[name] = rounded(array, self.dtype)
        return self.inputs[name]

    def desc(self, *extra):
        shape = " ".join(f"{k}={v}" for k, v in self.sizes.items())
        lens = "" if self.lens is None else f" lens={self.lens.desc}"
        return (f"case {self.index}: dtype={self.dtype} {shape}{' 2-D' if self.two_d else ''}"
                f"{lens}" + "".join(f" [{n}]" for n in self.notes + list(extra)))

    def unbatch(self, array):
        """What qkv returns for this case: 2-D inputs give results without the batch axis."""
        return array[0] if self.two_d else array

    def axes(self, quantity):
        """Names of a result's axes, for failure messages."""
        heads = "H" if quantity in ("output", "weights", "lse", "d_queries", "d_scores") else "Hkv"
        lead = tuple(a.lower() for a in ("B", heads) if a in self.sizes)
        tail = {"output": ("q", "d"), "weights": ("q", "k"), "d_scores": ("q", "k"),
                "lse": ("q",), "d_queries": ("q", "d"), "d_keys": ("k", "d"),
                "d_values": ("k", "d")}.get(quantity)
        return None if tail is None else lead + tail


# ---- the drawer -----------------------------------------------------------------------

def draw_case(rng, index, dtype, sizes, *, softmax=False, lens=None, lens_low=1,
              lens_int=np.int64, spread=1.0, uniform=False, offset=0.0, grad=True, **options):
    """The one drawer: a Case of `sizes` (see Case) with queries (lead, Nq, Dq),
    keys (lead, Nk, Dk) and values (lead, Nk, Dv), standard normal (queries
    times `spread`), or with `uniform` queries and keys uniform in [-1, 1]
    plus `offset`; with `softmax` scores (lead, Nq, Nk) instead, normal of
    mean `offset` and deviation `spread`; valid lengths of form `lens` (None,
    "B" or "BNq") in [lens_low, Nk] from d2l_reference.draw_lens; and with
    `grad` a standard normal d_output of the output's (or the scores') shape.
    Every float is rounded to `dtype`."""
    sizes = dict(sizes)
    nq, nk = sizes["Nq"], sizes["Nk"]
    lead_q = tuple(sizes[a] for a in ("B", "H") if a in sizes)
    lead_kv = tuple(sizes[a] for a in ("B", "Hkv") if a in sizes)
    case = Case(index, dtype, sizes, {}, options=options)
    if softmax:
        case.add_input("scores", rng.normal(offset, spread, lead_q + (nq, nk)))
    else:
        dq, dk = sizes.get("Dq", sizes.get("D")), sizes.get("Dk", sizes.get("D"))
        if uniform:
            queries = offset + rng.uniform(-1, 1, lead_q + (nq, dq))
            keys = offset + rng.uniform(-1, 1, lead_kv + (nk, dk))
        else:
            queries = rng.normal(0.0, spread, lead_q + (nq, dq))
            keys = rng.standard_normal(lead_kv + (nk, dk))
        values = rng.standard_normal(lead_kv + (nk, sizes["Dv"]))
        for name, array in (("queries", queries), ("keys", keys), ("values", values)):
            case.add_input(name, array)
    batch = sizes.get("B", 1)
    array = draw_lens(rng, lens, batch, nq, nk, low=lens_low, int_type=lens_int)
    if array is not None:
        rows = row_lengths(array, batch, nq, nk)
        case.lens = Lens(array, array.astype(np.int64), rows, f"{lens}/{np.dtype(lens_int).name}")
    if grad:
        last = nk if softmax else sizes["Dv"]
        case.d_output = rounded(rng.standard_normal(lead_q + (nq, last)), dtype)
    return case


# ---- the check --------------------------------------------------------------------------

@dataclass
class Want:
    """A reference quantity and how the rule compares it (d2l_reference.check_close):
    `scale` the size of its terms, `tolerance` when not TOLERANCE[dtype],
    `rounding` the result's relative half-ulp, `rows` a boolean over the
    leading axes: compare those rows only (the others have checks of their own)."""
    value: object
    scale: float = None
    tolerance: float = None
    rounding: float = None
    rows: object = None


def _f64(a):
    if torch.is_tensor(a):
        return a.detach().to(torch.float64).numpy()
    return np.asarray(a, dtype=np.float64)


def check_peer(qkv_call, formula, case):
    """Runs `case` through qkv (qkv_call(case) -> {quantity: result}) and the
    reference (formula(case) -> {quantity: Want}) and compares each result qkv
    gave with the reference of its quantity ("output (torch.no_grad)" is an
    output) by the one rule; each result must be of the case's dtype. Returns
    qkv's results, for a test's checks of its own."""
    got = qkv_call(case)
    want = formula(case)
    desc = case.desc()
    for what, result in got.items():
        quantity = what.split(" (")[0]
        ref = want[quantity]
        assert dtype_name(result) == case.dtype, f"{what} dtype {result.dtype}; {desc}"
        result, value, axes = _f64(result), _f64(ref.value), case.axes(quantity)
        if ref.rows is not None:
            rows = np.broadcast_to(_f64(ref.rows).astype(bool), value.shape[:ref.rows.ndim])
            result, value = result[rows], value[rows]
            axes = None if axes is None else ("row",) + axes[rows.ndim:]
        check_close(what, result, value, case.dtype, desc, axes, scale=ref.scale,
                    tolerance=ref.tolerance, rounding=ref.rounding)
    return got


@dataclass(frozen=True)
class Peer:
    """One row of a peer file's list of cases: `count` cases per dtype, each
    drawn by draw(rng, index, dtype) and checked by check_peer(qkv_call,
    formula, case); `check`, if any, runs after on (case, qkv's results)."""
    name: str
    draw: Callable
    qkv_call: Callable
    formula: Callable
    dtypes: tuple
    count: int
    check: Callable = None


def peer_params(peers, each_case=False):
    """pytest parameters (peer, dtype), one test per peer and dtype, or with
    `each_case` (peer, dtype, index), one test per case."""
    import pytest
    if each_case:
        return [pytest.param(peer, dtype, index, id=f"{peer.name}-{dtype}-{index}")
                for peer in peers for dtype in peer.dtypes for index in range(peer.count)]
    return [pytest.param(peer, dtype, id=f"{peer.name}-{dtype}")
            for peer in peers for dtype in peer.dtypes]


def run_case(peer, dtype, index, rng):
    """One case of the peer: drawn, run through both sides and compared."""
    case = peer.draw(rng, index, dtype)
    got = check_peer(peer.qkv_call, peer.formula, case)
    if peer.check is not None:
        peer.check(case, got)


def run_peer(peer, dtype, seed):
    """The peer's cases of `dtype`, drawn from `seed`."""
    rng = np.random.default_rng(seed)
    for index in range(peer.count):
        run_case(peer, dtype, index, rng)


# Heads and key heads of the mask and bias peers: (H, Hkv) pairs.
HEAD_GROUPS = [(1, 1), (2, 2), (4, 2), (6, 1)]


def mask_peer_sizes(rng):
    """The sizes of the mask and bias peers: 3-D inputs a quarter of the time,
    else heads grouped or not (HEAD_GROUPS); B 1 or 2, Nq up to 300, Nk up
    to 500, D and Dv up to 64."""
    heads, kv_heads = HEAD_GROUPS[int(rng.integers(len(HEAD_GROUPS)))]
    sizes = {"B": int(rng.integers(1, 3))}
    if rng.random() >= 0.25:
        sizes.update(H=heads, Hkv=kv_heads)
    sizes.update(Nq=int(rng.choice([1, 3, 33, 300])), Nk=int(rng.choice([1, 7, 64, 500])),
                 D=int(rng.choice([4, 17, 64])), Dv=int(rng.choice([3, 16, 64])))
    return sizes


# ---- what qkv.torch gets, and its gradients -----------------------------------------------

def laid_out(t, layout):
    """The same values in other memory, as a tensor or an array of the same shape:
    "contiguous"; "column-major" (the last two axes transposed in memory);
    "every other" (every other element of a wider last axis); "token-major"
    ((B, N, H, D) memory read as (B, H, N, D), as one fused projection leaves
    heads); "head slice" (the middle H of 3 H heads of (B, N, 3 H, D) memory);
    "D strided" ((B, H, D, N) memory); arrays only: "Fortran" (every axis
    reversed in memory), "reversed" (a negative stride on the first axis),
    "reversed heads" (on the first two: batch and heads)."""
    is_tensor = torch.is_tensor(t)
    lib = torch if is_tensor else np

    def transposed(a, i, j):
        return a.transpose(i, j) if is_tensor else np.swapaxes(a, i, j)

    def copy(a):
        return a.contiguous() if is_tensor else np.ascontiguousarray(a)

    if layout == "contiguous":
        return t
    if layout == "column-major":
        return transposed(copy(transposed(t, -1, -2)), -1, -2)
    if layout == "every other":
        wide = lib.zeros(tuple(t.shape[:-1]) + (2 * t.shape[-1],), dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    if layout == "token-major":
        return transposed(copy(transposed(t, 1, 2)), 1, 2)
    if layout == "head slice":
        heads = t.shape[1]
        wide = lib.zeros((t.shape[0], t.shape[2], 3 * heads, t.shape[3]), dtype=t.dtype)
        wide[:, :, heads:2 * heads] = transposed(t, 1, 2)
        return transposed(wide[:, :, heads:2 * heads], 1, 2)
    if layout == "D strided":
        return transposed(copy(transposed(t, 2, 3)), 2, 3)
    if layout == "Fortran" and not is_tensor:
        return np.asfortranarray(t)
    if layout in ("reversed", "reversed heads") and not is_tensor:  # torch has no negative strides
        lead = (slice(None, None, -1),) * (1 if layout == "reversed" else 2)
        return t[lead].copy()[lead]  # .copy(): new strides even along axes of size 1
    raise ValueError(f"unknown layout {layout!r}")


def torch_inputs(case, names, layout="contiguous"):
    """The case's inputs `names` as qkv.torch gets them: tensors of the case's
    dtype in `layout`, each a leaf that requires grad."""
    torch_dtype = TORCH_DTYPE[case.dtype]
    return {n: laid_out(torch.tensor(case.inputs[n], dtype=torch_dtype), layout)
            .requires_grad_() for n in names}


def with_gradients(results, output, inputs, d_output):
    """results, with the gradients d_<name> of sum(output * d_output) for the
    tensors `inputs` ({name: tensor}); d_output (a float64 array) in the output's dtype."""
    g = torch.tensor(d_output, dtype=output.dtype).reshape(output.shape)
    grads = torch.autograd.grad(output, list(inputs.values()), g)
    results.update({f"d_{n}": grad for n, grad in zip(inputs, grads)})
    return results


def torch_formula(math_fn, case, names=("queries", "keys", "values"), grad_tolerance=None):
    """The references of a torch-math peer: math_fn(case, **float64 tensors of
    the case's inputs) as "output", held to the size of its terms (max|v|
    for an attention output; bf16 cases by the bf16 rule: d2l_reference),
    and with a d_output the gradients of its inputs `names` by autograd,
    held to the floor 1 (the inputs and d_output are O(1)) at
    GRADIENT_TOLERANCE (or grad_tolerance)."""
    leaves = {n: torch.from_numpy(a).requires_grad_(n in names) for n, a in case.inputs.items()}
    output = math_fn(case, **leaves)
    if case.dtype == "bfloat16":
        want = {"output": Want(output.detach(), float(np.abs(case.inputs["values"]).max()),
                               BF16_OUTPUT_TOLERANCE, BF16_ROUNDING)}
    else:
        # An attention output averages the values: its terms are at most
        # max|v| (the d2l peers' pooled_scale, which needs the weights, is at
        # most that). Others (masked softmax's weights) are held to max|ref|.
        values = case.inputs.get("values")
        scale = None if values is None else float(np.abs(values).max(initial=0.0))
        want = {"output": Want(output.detach(), scale)}
    if case.d_output is not None:
        grads = torch.autograd.grad(output, [leaves[n] for n in names],
                                    torch.from_numpy(case.d_output))
        tolerance = grad_tolerance or GRADIENT_TOLERANCE[case.dtype]  # bf16: name one
        want.update({f"d_{n}": Want(g, scale=1.0, tolerance=tolerance)
                     for n, g in zip(names, grads)})
    return want


# ---- the d2l peers' cases ---------------------------------------------------------------

NUM_CASES = 60  # random cases per op and direction (forward, backward)
# Sizes around the SIMD widths (4/8/16 floats, 2/4/8 doubles) and one larger;
# the case index cycles the key axis through all of them.
SIZES = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100)
NP_INT = {"int32": np.int32, "int64": np.int64}


def is_big(index):
    """Cases 9 and 18 of every 20 (both parities, so both dtypes of a 2-cycle)
    use 300 keys: more than one of the fused kernel's 256-key blocks."""
    return index % 20 in (9, 18)


def is_strided(index):
    """Two cases in eight (both parities) pass non-contiguous inputs."""
    return index % 8 in (1, 6)


def numpy_layouts(rng, case, names):
    """Two cases in eight pass their arrays `names` in memory that is not
    C-contiguous, each its own way (every other element, Fortran order, or a
    negative stride on the first axis): options["layouts"], and a note."""
    if is_strided(case.index):
        case.options["layouts"] = {n: ("every other", "Fortran", "reversed")[int(rng.integers(3))]
                                   for n in names}
        case.notes.append("strided inputs")


def as_numpy(case, array, name):
    """An array of the case as qkv's NumPy API gets it: the case's dtype, laid
    out as options["layouts"] says for `name`."""
    array = np.asarray(array).astype(NP_DTYPE[case.dtype])
    return laid_out(array, case.options.get("layouts", {}).get(name, "contiguous"))


def d2l_lens(rng, index, case):
    """The d2l peers' lengths, in [1, Nk] (L = 0 is where d2l differs by
    design, and has its own tests): the index cycles the form (None, (B),
    (B, Nq)) and the integer type (int32, int64); every fifth case with
    lengths passes a list; 2-D inputs (a batch of one) also get the unbatched
    forms half the time: a scalar for (1), (Nq) for (1, Nq)."""
    form = (None, "B", "BNq")[(index // 2) % 3]
    int_type = ("int32", "int64")[(index // 6) % 2]
    batch, nq, nk = case.sizes.get("B", 1), case.sizes["Nq"], case.sizes["Nk"]
    if form is None:
        return Lens(None, None, row_lengths(None, batch, nq, nk), "none")
    array = draw_lens(rng, form, batch, nq, nk, low=1, int_type=NP_INT[int_type])
    value, kind = array, f"{form}/{int_type}"
    if case.two_d and rng.random() < 0.5:
        value = int(array[0]) if form == "B" else array.reshape(-1)
        kind += " scalar" if form == "B" else " (Nq)"
    if index % 5 == 4:
        value = value.tolist() if isinstance(value, np.ndarray) else value
        kind += " list"
    return Lens(value, array.astype(np.int64), row_lengths(array, batch, nq, nk), kind)


def softmax_case(rng, index, dtype):
    """Random scores (B, Nq, Nk) with lengths >= 1 (index cycles of d2l_lens;
    Nk cycling through SIZES, 300 when is_big), in inputs["scores"]:
    sometimes offset to +90 (exp overflows in float32 unless the max is
    subtracted) or -100, sometimes -inf among the valid scores (weight 0;
    column 0 stays finite), sometimes NaN, +-inf or 1e30 in the masked
    positions, which qkv never reads and d2l overwrites. With a d_output
    (B, Nq, Nk): the gradient of the weights for the backward."""
    two_d = index % 7 == 3
    sizes = {} if two_d else {"B": int(rng.integers(1, 5))}
    sizes.update(Nq=int(rng.choice(SIZES)), Nk=300 if is_big(index) else SIZES[index % len(SIZES)])
    spread = float(rng.choice([0.1, 1.0, 3.0, 10.0]))
    offset = float(rng.choice([0.0, 0.0, 0.0, 90.0, -100.0]))
    case = draw_case(rng, index, dtype, sizes, softmax=True, spread=spread, offset=offset)
    nk = sizes["Nk"]
    scores = batched(case, "scores").copy()
    case.lens = d2l_lens(rng, index, case)
    case.notes = [f"spread {spread:g}", f"offset {offset:g}"]
    if rng.random() < 0.25 and nk > 1:
        holes = rng.random(scores.shape) < 0.2
        holes[..., 0] = False
        scores[holes] = -math.inf
        case.notes.append("-inf scores")
    masked = np.arange(nk)[None, None, :] >= case.lens.rows[..., None]
    if masked.any() and rng.random() < 0.5:
        garbage = np.array([math.nan, math.inf, -math.inf, 1e30])
        scores[masked] = rng.choice(garbage, size=int(masked.sum()))
        case.notes.append("garbage in masked positions")
    case.add_input("scores", case.unbatch(scores))
    return case


def d2l_softmax_formula(case, backward=False):
    """d2l's masked softmax of the case's scores in its dtype: the weights, and
    with `backward` the gradient of the scores for the case's d_output
    (against the size of its terms)."""
    torch_dtype = TORCH_DTYPE[case.dtype]
    x = torch.tensor(batched(case, "scores"), dtype=torch_dtype, requires_grad=backward)
    weights = d2l_masked_softmax(x, case.lens.tensor())
    want = {"weights": Want(case.unbatch(weights.detach()))}
    if backward:
        d_weights = case.d_output.reshape(weights.shape)
        weights.backward(torch.tensor(d_weights, dtype=torch_dtype))
        want["d_scores"] = Want(case.unbatch(x.grad),
                                softmax_grad_scale(weights.detach(), d_weights))
    return want


def attention_case(op, index, rng, dtype, two_d=None, big=None, lens_index=None, grad=False):
    """One random attention problem of op "dot" or "additive", sizes cycled by
    the index (Nk through SIZES, D or Dk four steps apart; 300 keys when
    is_big), lengths by d2l_lens (of lens_index: a test that cycles three
    dtypes passes one that keeps the two cycles independent), with `grad` a
    d_output. Dot: queries of spread 0.3, 1 or 2, a quarter of the cases
    with a scale. Additive:
    W_q, W_k, w_v as nn.Linear initialises them (uniform in +-1/sqrt(fan_in)),
    w_v sometimes x5 for sharper weights, and given as (H) or (1, H). Keys
    that no query of their batch element may see are zero (the reference's
    inputs); options["dead_keys"] marks them, and keys_for_qkv fills them
    with NaN when options["nan_dead_keys"]: qkv must never read them."""
    two_d = index % 7 == 3 if two_d is None else two_d
    sizes = {} if two_d else {"B": int(rng.integers(1, 4))}
    num_keys, num_queries = SIZES[index % len(SIZES)], int(rng.choice(SIZES))
    if is_big(index) if big is None else big:
        num_keys, num_queries = 300, int(rng.choice((17, 40)))
    sizes.update(Nq=num_queries, Nk=num_keys)
    options, notes = {"op": op, "scale": None}, []
    if op == "dot":
        head_dim = SIZES[(index * 4 + 3) % len(SIZES)]
        sizes.update(D=head_dim, Dv=int(rng.choice(SIZES)))
        spread = float(rng.choice([0.3, 1.0, 2.0]))
        if rng.random() < 0.25:
            # A multiple of the default 1/sqrt(D), so the scores stay O(1) at
            # any D: a score's float32 rounding (~eps * scale * sum_d |q_d k_d|)
            # is a relative error of the weights, in torch's float32 as in qkv's.
            options["scale"] = float(rng.uniform(0.25, 2.0)) / math.sqrt(head_dim)
            notes.append(f"scale {options['scale']:.4g}")
    else:
        query_dim = int(rng.choice(SIZES))
        key_dim = SIZES[(index * 4 + 3) % len(SIZES)]
        if key_dim == query_dim:
            query_dim = SIZES[(index * 4 + 8) % len(SIZES)]
        hidden = int(rng.choice((1, 3, 7, 8, 9, 16, 24, 33)))
        sizes.update(Dq=query_dim, Dk=key_dim, hidden=hidden, Dv=int(rng.choice(SIZES)))
        spread = 1.0
    case = draw_case(rng, index, dtype, sizes, spread=spread, grad=grad, **options)
    case.notes = notes
    if op == "additive":
        case.add_input("W_q", rng.uniform(-1, 1, size=(hidden, query_dim)) / math.sqrt(query_dim))
        case.add_input("W_k", rng.uniform(-1, 1, size=(hidden, key_dim)) / math.sqrt(key_dim))
        w_v = rng.uniform(-1, 1, size=(1, hidden)) / math.sqrt(hidden)
        if rng.random() < 0.3:
            w_v *= 5.0
            case.notes.append("w_v x5")
        if rng.random() < 0.5:
            w_v = w_v.reshape(-1)
        case.notes.append(f"w_v {list(w_v.shape)}")
        case.add_input("w_v", w_v)
    case.lens = d2l_lens(rng, index if lens_index is None else lens_index, case)
    reach = case.lens.rows.max(axis=1)  # (B): keys at or past it are seen by no query
    dead_keys = np.arange(num_keys)[None, :] >= reach[:, None]
    keys = case.inputs["keys"].reshape((-1,) + case.inputs["keys"].shape[-2:])
    keys[dead_keys] = 0.0
    case.options["dead_keys"] = dead_keys
    case.options["nan_dead_keys"] = bool(dead_keys.any()) and rng.random() < 0.4
    if case.options["nan_dead_keys"]:
        case.notes.append("NaN in keys no query may see")
    return case


def batched(case, name):
    """An input with the batch axis (B = 1 for 2-D cases), as the book's modules take it."""
    array = case.inputs[name]
    return array[None] if case.two_d and name in ("queries", "keys", "values", "scores") else array


def keys_for_qkv(case):
    """The keys as qkv gets them: NaN where no query may look, when the case says so."""
    keys = batched(case, "keys").copy()
    if case.options.get("nan_dead_keys"):
        keys[case.options["dead_keys"]] = np.nan
    return case.unbatch(keys)


def attention_scale(case):
    if case.options["op"] != "dot":
        return 1.0
    scale = case.options["scale"]
    return 1.0 / math.sqrt(case.inputs["queries"].shape[-1]) if scale is None else scale


class Reference:
    """d2l's module run on a case in its dtype (float64 for bf16 cases, on the
    bf16 values): out, weights, scores (torch tensors, with the batch axis),
    lse (float64 numpy), and with a d_output the gradients by autograd:
    queries, keys, values and, for additive attention, W_q, W_k, w_v (w_v
    shaped like the case's)."""

    def __init__(self, case, d_output=None):
        torch_dtype = TORCH_DTYPE["float64" if case.dtype == "bfloat16" else case.dtype]
        need_grad = d_output is not None
        q, k, v = (torch.tensor(batched(case, n), dtype=torch_dtype, requires_grad=need_grad)
                   for n in ("queries", "keys", "values"))
        if case.options["op"] == "dot":
            module = D2lDotProductAttention(dropout=0.5, scale=case.options["scale"])
        else:
            W_q, W_k, w_v = (case.inputs[n] for n in ("W_q", "W_k", "w_v"))
            module = D2lAdditiveAttention(W_k.shape[1], W_q.shape[1], W_q.shape[0],
                                          dropout=0.5).to(torch_dtype)
            with torch.no_grad():
                module.W_q.weight.copy_(torch.from_numpy(W_q))
                module.W_k.weight.copy_(torch.from_numpy(W_k))
                module.w_v.weight.copy_(torch.from_numpy(w_v.reshape(1, -1)))
        module.eval()  # no dropout: torch's mask is not qkv's
        out = module(q, k, v, case.lens.tensor())
        self.out = out.detach()
        self.weights = module.attention_weights.detach()
        self.scores = module.scores.detach()
        self.lse = exact_lse(self.scores, case.lens.tensor())
        if need_grad:
            d_output = np.asarray(d_output).reshape(out.shape)
            out.backward(torch.as_tensor(d_output, dtype=torch_dtype))
            self.grads = {"queries": q.grad, "keys": k.grad, "values": v.grad}
            if case.options["op"] == "additive":
                self.grads.update(W_q=module.W_q.weight.grad, W_k=module.W_k.weight.grad,
                                  w_v=module.w_v.weight.grad.reshape(case.inputs["w_v"].shape))

    def grad_scales(self, case, d_output, weights=None):
        """The size of the terms of each gradient (d2l_reference), by input name."""
        weights = self.weights if weights is None else weights
        d_output = np.asarray(d_output).reshape(self.out.shape)
        args = (weights, *(batched(case, n) for n in ("queries", "keys", "values")))
        if case.options["op"] == "dot":
            scales = sdpa_grad_scales(*args, d_output, attention_scale(case))
        else:
            scales = additive_grad_scales(*args, *(case.inputs[n] for n in ("W_q", "W_k", "w_v")),
                                          d_output)
        names = {"q": "queries", "k": "keys", "v": "values"}
        return {names.get(n, n): s for n, s in scales.items()}


def d2l_formula(case, rows=None, d_output=None):
    """The d2l peers' references for a case: output (against the size of its
    terms), weights, lse (against the size of the scores), and with a
    d_output the gradients (against the sizes of theirs), as qkv returns them
    (no batch axis for 2-D cases); bf16 cases by the bf16 rule
    (d2l_reference). `rows`: compare those queries only."""
    ref = Reference(case, d_output)
    bf16 = case.dtype == "bfloat16"
    values = batched(case, "values")
    if bf16:
        output = Want(case.unbatch(ref.out), float(np.abs(values).max()),
                      BF16_OUTPUT_TOLERANCE, BF16_ROUNDING, rows)
    else:
        output = Want(case.unbatch(ref.out), pooled_scale(ref.weights, values), rows=rows)
    want = {"output": output,
            "weights": Want(case.unbatch(ref.weights), rows=rows),
            "lse": Want(case.unbatch(ref.lse), lse_scale(ref.scores, case.lens.tensor()),
                        rows=rows)}
    if d_output is not None:
        weights = ref.weights if rows is None else ref.weights * torch.from_numpy(rows[..., None])
        for name, scale in ref.grad_scales(case, d_output, weights).items():
            grad = ref.grads[name]
            if name in ("queries", "keys", "values"):
                grad = case.unbatch(grad)
            want[f"d_{name}"] = Want(grad, scale, BF16_GRADIENT_TOLERANCE if bf16 else None)
    return want


# Lengths with zeros for the L = 0 tests (B = 3, Nq = 4, Nk = 6).
ZERO_LENGTH_LENS = {
    "B/int32": np.array([0, 6, 3], dtype=np.int32),
    "BNq/int64": np.array([[1, 0, 6, 2], [0, 0, 0, 0], [3, 5, 0, 4]], dtype=np.int64),
}


def zero_length_case(op, dtype, rng, lens):
    """A case with B = 3, Nq = 4, Nk = 6 and the given lengths, zeros allowed."""
    case = attention_case(op, 0, rng, dtype, two_d=False, big=False)
    batch, num_queries, num_keys = 3, 4, 6
    for name, n in (("queries", num_queries), ("keys", num_keys), ("values", num_keys)):
        case.add_input(name, rng.normal(size=(batch, n, case.inputs[name].shape[-1])))
    case.sizes.update(B=batch, Nq=num_queries, Nk=num_keys)
    case.options["nan_dead_keys"] = False
    rows = row_lengths(lens, batch, num_queries, num_keys)
    case.lens = Lens(lens, lens.astype(np.int64), rows, str(lens.tolist()))
    return case
