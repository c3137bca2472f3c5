"""Peer test: qkv.torch against d2l's PyTorch attention code.

qkv.torch.masked_softmax, scaled_dot_product_attention and additive_attention
on fresh random cases (sizes around the SIMD widths, valid_lens None, (B) or
(B, Nq) as tensors, lists or ints, 2-D and 4-D inputs, strided tensors),
against the book's formulations (tests/peer/d2l_reference.py): forward
outputs, and the gradients of every input (and parameter) through .backward()
of a random linear functional sum(out * G), against torch autograd of the
book's code; forwards under torch.no_grad() (qkv.torch's path without
autograd) too. Then d2l's modules: qkv.torch.DotProductAttention and
AdditiveAttention exchange state_dicts with the book's modules and give the
same outputs, attention_weights and gradients (inputs and W_q, W_k, w_v) in
eval mode. In training mode qkv's dropout mask is its own (a pure function of
a seed drawn from torch's generator), so it is checked on qkv alone:
reproducible under torch.manual_seed, fresh for each forward, and each output
is d2l's weights times the kept mask times 1/(1-p), with gradients that are
autograd's for that mask.

Tolerances: as test_peer_numpy.py and the CLI's peer test, rel err
max|got - ref| / max(max|ref|, scale) <= 1e-5 (float32) or 1e-12 (float64),
torch computing in the same float type, scale the size of the terms the
result sums (d2l_reference). bfloat16 scaled dot-product attention (docs/
semantics.md, "bfloat16 inputs") is compared with the float64 reference on
the same bf16 values: output within 4e-3 * max|v| (the bound of qkv's float32
result) plus the rounding of the result to bf16 (half an ulp, <= 2^-8 |out|),
gradients within 2e-2 of max(max|gradient|, the size of its terms).
"""

import math

import numpy as np
import pytest
import torch

import qkv.torch
from peer_cases import (  # first: puts tests/peer (d2l_reference) on sys.path
    GRAD_NAMES,
    NUM_CASES,
    TORCH_DTYPE,
    ZERO_LENGTH_LENS,
    AttentionCase,
    Reference,
    SoftmaxCase,
    check_close,
    describe,
    is_strided,
    report_worst,
    zero_length_case,
)
from d2l_reference import (
    D2lAdditiveAttention,
    D2lDotProductAttention,
    additive_grad_scales,
    d2l_masked_softmax,
    pooled_scale,
    row_lengths,
    sdpa_grad_scales,
    softmax_grad_scale,
)

CASES = range(NUM_CASES)
MODULE_CASES = range(16)
# bf16 (docs/semantics.md): qkv's float32 result is within 4e-3 * max|v| of
# attention on the bf16 values, and qkv.torch rounds it to bf16, which moves
# each element by up to half a bf16 ulp, <= 2^-8 |output| (8 significant bits).
BF16_OUTPUT_TOL = 4e-3
BF16_ROUNDING = 2.0**-8
BF16_GRAD_TOL = 2e-2
GRAD_AXES = {"q": ("q", "d"), "k": ("k", "d"), "v": ("k", "d")}
PARAM_AXES = {"W_q": ("h", "d"), "W_k": ("h", "d"), "w_v": ("o", "h")}


@pytest.fixture(scope="module", autouse=True)
def torch_threads():
    """The references are small: one torch thread, so qkv has the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
    report_worst("test_peer_torch: worst relative errors")


def leaf(array, dtype, strided=False):
    """A leaf tensor that requires grad; strided: its last two axes in column-major memory."""
    t = torch.tensor(array, dtype=dtype)
    if strided:
        t = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return t.requires_grad_()


def lens_for_torch(lens):
    """The case's lengths as qkv.torch gets them: arrays become tensors; lists and
    ints pass as they are."""
    if isinstance(lens.value, np.ndarray):
        return torch.from_numpy(lens.value)
    return lens.value


def linear_functional(rng, out):
    """sum(out * G) with G random (bf16 values for a bf16 output), and G as float64."""
    g = rng.normal(size=tuple(out.shape))
    g_t = torch.tensor(g, dtype=out.dtype)
    return (out * g_t).sum(), g_t.double().numpy()


# ---- masked softmax ------------------------------------------------------------------

@pytest.mark.parametrize("index", CASES)
def test_masked_softmax(index, rng):
    dtype = ("float32", "float64")[index % 2]
    case = SoftmaxCase(index, rng, dtype)
    torch_dtype = TORCH_DTYPE[dtype]
    strided = is_strided(index)
    x = leaf(case.unbatch(case.scores), torch_dtype, strided)
    desc = case.desc(*(["strided X"] if strided else []))
    weights = qkv.torch.masked_softmax(x, lens_for_torch(case.lens))
    loss, d_weights = linear_functional(rng, weights)
    loss.backward()

    x_ref = torch.tensor(case.scores, dtype=torch_dtype, requires_grad=True)
    ref = d2l_masked_softmax(x_ref, case.lens.tensor())
    ref.backward(torch.tensor(d_weights.reshape(ref.shape), dtype=torch_dtype))
    with torch.no_grad():
        no_grad_weights = qkv.torch.masked_softmax(x, lens_for_torch(case.lens))
    for what, got in (("weights", weights), ("weights (torch.no_grad)", no_grad_weights)):
        assert got.dtype == torch_dtype, f"{what} dtype {got.dtype}; {desc}"
        check_close(what, got, case.unbatch(ref.detach()), dtype, case.axes(), desc)
    assert x.grad.dtype == torch_dtype, f"X.grad dtype {x.grad.dtype}; {desc}"
    check_close("d_scores", x.grad, case.unbatch(x_ref.grad), dtype, case.axes(), desc,
                scale=softmax_grad_scale(ref, d_weights.reshape(ref.shape)))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("form", ["1d/int32", "2d/int64"])
def test_masked_softmax_zero_length_rows(dtype, form, rng):
    """L = 0 rows are zeros with zero gradient (d2l: uniform); other rows are d2l's."""
    lens = ZERO_LENGTH_LENS[form]
    empty = row_lengths(lens, 3, 4, 6) == 0
    torch_dtype = TORCH_DTYPE[dtype]
    scores = rng.normal(size=(3, 4, 6))
    x = leaf(scores, torch_dtype)
    weights = qkv.torch.masked_softmax(x, torch.from_numpy(lens))
    loss, g = linear_functional(rng, weights)
    loss.backward()
    x_ref = torch.tensor(scores, dtype=torch_dtype, requires_grad=True)
    ref = d2l_masked_softmax(x_ref, torch.from_numpy(lens))
    assert np.allclose(ref.detach().numpy()[empty], 1 / 6), "d2l gives uniform rows"
    (ref * torch.tensor(g, dtype=torch_dtype)).sum().backward()
    desc = f"dtype={dtype} lens={lens.tolist()}"
    for b, i in np.argwhere(empty):
        assert torch.all(weights[b, i] == 0), f"L = 0 row b={b} q={i}: {weights[b, i]}; {desc}"
        assert torch.all(x.grad[b, i] == 0), f"L = 0 row b={b} q={i}: grad {x.grad[b, i]}; {desc}"
    live = torch.from_numpy(~empty)
    check_close("weights (rows with L >= 1)", weights[live], ref.detach()[live], dtype,
                ("row", "k"), desc)
    check_close("d_scores (rows with L >= 1)", x.grad[live], x_ref.grad[live], dtype,
                ("row", "k"), desc, scale=softmax_grad_scale(ref.detach(), g))


# ---- scaled dot-product and additive attention -------------------------------------------

def to_bf16_values(array):
    """The float64 values of array rounded to bfloat16 (the values the bf16 kernels see)."""
    return torch.tensor(array).to(torch.bfloat16).double().numpy()


def run_qkv(case, torch_dtype, rng, layout, grad=True):
    """The case through qkv.torch's functional form of its op; returns (output
    as the reference's (B, Nq, Dv), the leaves {name: tensor} with their .grad
    as the reference's shapes, G as float64 (B, Nq, Dv)). grad=False: the
    forward alone under torch.no_grad() (qkv.torch's path without autograd);
    returns (output, None, None)."""
    inputs = {"q": case.queries, "k": case.keys_for_qkv(), "v": case.values}
    if layout == "4-D":
        # (1, B, N, D) read through a transposed view of (1, N, B, D) memory.
        leaves = {n: leaf(a.transpose(1, 0, 2)[None], torch_dtype) for n, a in inputs.items()}
        args = [t.transpose(1, 2) for t in leaves.values()]
    else:
        leaves = {n: leaf(case.unbatch(a), torch_dtype, layout == "strided")
                  for n, a in inputs.items()}
        args = list(leaves.values())
    with torch.set_grad_enabled(grad):
        if case.op == "dot":
            out = qkv.torch.scaled_dot_product_attention(*args, scale=case.scale,
                                                         valid_lens=lens_for_torch(case.lens))
        else:
            params = {"W_q": case.W_q, "W_k": case.W_k, "w_v": case.w_v}
            leaves.update({n: leaf(a, torch_dtype) for n, a in params.items()})
            out = qkv.torch.additive_attention(*args, *(leaves[n] for n in params),
                                               lens_for_torch(case.lens))
    g, grads = None, None
    if grad:
        loss, g = linear_functional(rng, out)
        loss.backward()

        def as_reference(name, t):
            if name not in GRAD_AXES:
                return t
            if layout == "4-D":
                return t[0].transpose(0, 1)
            return t[None] if case.two_d else t

        grads = {n: as_reference(n, t.grad) for n, t in leaves.items()}
    if layout == "4-D":
        out, g = out[0], None if g is None else g[0]
    elif case.two_d:
        out, g = out[None], None if g is None else g[None]
    return out.detach(), grads, g


def check_attention(case, dtype, rng, layout):
    """Output and gradients of qkv.torch vs d2l's module in eval mode."""
    bf16 = dtype == "bfloat16"
    if bf16:
        case.queries, case.keys, case.values = map(to_bf16_values,
                                                   (case.queries, case.keys, case.values))
    notes = [layout] if layout != "3-D" else []
    desc = case.desc(*notes)
    out, grads, g = run_qkv(case, TORCH_DTYPE[dtype], rng, layout)
    ref_dtype = "float64" if bf16 else dtype
    ref = Reference(case, TORCH_DTYPE[ref_dtype], g)
    no_grad_out, _, _ = run_qkv(case, TORCH_DTYPE[dtype], rng, layout, grad=False)
    for what, got in (("output", out), ("output (torch.no_grad)", no_grad_out)):
        assert got.dtype == TORCH_DTYPE[dtype], f"{what} dtype {got.dtype}; {desc}"
        if bf16:
            check_close(what, got, ref.out, dtype, ("b", "q", "d"), desc,
                        scale=float(np.abs(case.values).max()), tolerance=BF16_OUTPUT_TOL,
                        slack=BF16_ROUNDING * got.double().abs().numpy())
        else:
            check_close(what, got, ref.out, dtype, ("b", "q", "d"), desc,
                        scale=pooled_scale(ref.weights, case.values))
    args = (ref.weights, case.queries, case.keys, case.values)
    if case.op == "dot":
        scales = sdpa_grad_scales(*args, g, case.attention_scale)
    else:
        scales = additive_grad_scales(*args, case.W_q, case.W_k, case.w_v, g)
    for name, ref_grad in ref.grads.items():
        got = grads[name]
        assert got is not None, f"{name}.grad is None after backward; {desc}"
        assert got.dtype == TORCH_DTYPE[dtype], f"{name}.grad dtype {got.dtype}; {desc}"
        grad_axes = ("b",) + GRAD_AXES[name] if name in GRAD_AXES else PARAM_AXES[name]
        check_close(GRAD_NAMES[name], got, ref_grad, dtype, grad_axes[-ref_grad.dim():], desc,
                    scale=scales[name], tolerance=BF16_GRAD_TOL if bf16 else None)


def layout_of(index, case):
    """Half the 3-D cases without lengths go 4-D (B as a head axis, transposed
    memory); two in eight strided tensors; the rest contiguous."""
    if case.lens.value is None and not case.two_d and (index // 9) % 2 == 0:
        return "4-D"
    return "strided" if is_strided(index) else "3-D"


@pytest.mark.parametrize("index", range(NUM_CASES + NUM_CASES // 2))
def test_scaled_dot_product_attention(index, rng):
    """90 cases: 30 each in float32, float64 and bfloat16."""
    dtype = ("float32", "float64", "bfloat16")[index % 3]
    case = AttentionCase("dot", index, rng, dtype, lens_index=index // 3 * 2)
    check_attention(case, dtype, rng, layout_of(index, case))


@pytest.mark.parametrize("index", CASES)
def test_additive_attention(index, rng):
    dtype = ("float32", "float64")[index % 2]
    case = AttentionCase("additive", index, rng, dtype)
    check_attention(case, dtype, rng, "strided" if is_strided(index) else "3-D")


@pytest.mark.parametrize("op", ["dot", "additive"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("form", ["1d/int32", "2d/int64"])
def test_attention_zero_length(op, dtype, form, rng):
    """L = 0: zero output and zero gradient for that query, and nothing added to
    the other gradients (d2l: the mean of all values). Compared with d2l run
    with G zero on those queries."""
    case = zero_length_case(op, dtype, rng, ZERO_LENGTH_LENS[form])
    empty = torch.from_numpy(case.lens.rows == 0)
    desc = case.desc()
    out, grads, g = run_qkv(case, TORCH_DTYPE[dtype], rng, "3-D")
    for b, i in torch.nonzero(empty).tolist():
        assert torch.all(out[b, i] == 0), f"L = 0 query b={b} q={i}: output {out[b, i]}; {desc}"
        assert torch.all(grads["q"][b, i] == 0), (f"L = 0 query b={b} q={i}: gradient "
                                                  f"{grads['q'][b, i]}; {desc}")
    g_live = np.where(case.lens.rows[..., None] == 0, 0.0, g)
    ref = Reference(case, TORCH_DTYPE[dtype], g_live)
    check_close("output (queries with L >= 1)", out[~empty], ref.out[~empty], dtype,
                ("row", "d"), desc, scale=pooled_scale(ref.weights, case.values))
    ref_weights = ref.weights.masked_fill(empty[..., None], 0.0)
    args = (ref_weights, case.queries, case.keys, case.values)
    if op == "dot":
        scales = sdpa_grad_scales(*args, g_live, case.attention_scale)
    else:
        scales = additive_grad_scales(*args, case.W_q, case.W_k, case.w_v, g_live)
    for name, ref_grad in ref.grads.items():
        axes = ("b",) + GRAD_AXES[name] if name in GRAD_AXES else PARAM_AXES[name]
        check_close(GRAD_NAMES[name], grads[name], ref_grad, dtype, axes[-ref_grad.dim():], desc,
                    scale=scales[name])


# ---- d2l's modules -------------------------------------------------------------------------

def module_pair(op, case, torch_dtype, rng, direction):
    """(book's module, qkv's module), one's freshly initialised parameters loaded
    into the other through state_dict (direction "book->qkv" or "qkv->book")."""
    torch.manual_seed(int(rng.integers(2**62)))
    dropout = float(rng.choice([0.0, 0.1, 0.5]))
    if op == "dot":
        book = D2lDotProductAttention(dropout)
        ours = qkv.torch.DotProductAttention(dropout)
    else:
        sizes = (case.keys.shape[-1], case.queries.shape[-1], case.W_q.shape[0])
        book = D2lAdditiveAttention(*sizes, dropout)
        ours = qkv.torch.AdditiveAttention(*sizes, dropout)
    book, ours = book.to(torch_dtype), ours.to(torch_dtype)
    source, target = (book, ours) if direction == "book->qkv" else (ours, book)
    target.load_state_dict(source.state_dict())  # strict: the same keys and shapes
    assert list(book.state_dict()) == list(ours.state_dict()), "state_dict keys differ"
    for name, value in book.state_dict().items():
        assert torch.equal(value, ours.state_dict()[name]), f"{name} not loaded ({direction})"
    return book.eval(), ours.eval()


@pytest.mark.parametrize("op", ["dot", "additive"])
@pytest.mark.parametrize("index", MODULE_CASES)
def test_module_eval(op, index, rng):
    """Eval mode: the book's module and qkv's with the same state_dict give the same
    output, attention_weights and gradients (inputs, and W_q, W_k, w_v)."""
    dtype = ("float32", "float64")[index % 2]
    torch_dtype = TORCH_DTYPE[dtype]
    case = AttentionCase(op, index, rng, dtype, two_d=False)
    if op == "dot":  # the modules have d2l's 1/sqrt(D), no scale argument
        case.scale = None
        case.notes = [note for note in case.notes if not note.startswith("scale")]
    direction = ("book->qkv", "qkv->book")[(index // 2) % 2]
    book, ours = module_pair(op, case, torch_dtype, rng, direction)
    desc = case.desc(direction, f"dropout {ours.dropout.p} (eval)")
    lens = case.lens.tensor()

    def run(module, keys):
        q, k, v = (leaf(a, torch_dtype) for a in (case.queries, keys, case.values))
        out = module(q, k, v, lens)
        return out, (q, k, v)

    out, inputs = run(ours, case.keys_for_qkv())
    loss, g = linear_functional(rng, out)
    loss.backward()
    ref_out, ref_inputs = run(book, case.keys)
    ref_out.backward(torch.tensor(g, dtype=torch_dtype))
    ref_weights = book.attention_weights.detach()

    check_close("output", out, ref_out, dtype, ("b", "q", "d"), desc,
                scale=pooled_scale(ref_weights, case.values))
    assert ours.attention_weights is not None, f"attention_weights not set; {desc}"
    check_close("weights", ours.attention_weights, ref_weights, dtype, ("b", "q", "k"), desc)
    with torch.no_grad():  # qkv.torch's path without autograd
        ours.attention_weights = None
        no_grad_out, _ = run(ours, case.keys_for_qkv())
    check_close("output (torch.no_grad)", no_grad_out, ref_out, dtype, ("b", "q", "d"), desc,
                scale=pooled_scale(ref_weights, case.values))
    assert ours.attention_weights is not None, f"attention_weights not set; {desc}"
    check_close("weights (torch.no_grad)", ours.attention_weights, ref_weights, dtype,
                ("b", "q", "k"), desc)
    args = (ref_weights, case.queries, case.keys, case.values)
    if op == "dot":
        scales = sdpa_grad_scales(*args, g, 1 / math.sqrt(case.queries.shape[-1]))
    else:
        params = [book.W_q.weight, book.W_k.weight, book.w_v.weight]
        scales = additive_grad_scales(*args, *(p.detach() for p in params), g)
    for name, got, ref in zip("qkv", inputs, ref_inputs):
        check_close(GRAD_NAMES[name], got.grad, ref.grad, dtype, ("b",) + GRAD_AXES[name], desc,
                    scale=scales[name])
    if op == "additive":
        for name in ("W_q", "W_k", "w_v"):
            got, ref = getattr(ours, name).weight.grad, getattr(book, name).weight.grad
            assert got is not None, f"{name}.weight.grad is None after backward; {desc}"
            check_close(GRAD_NAMES[name], got, ref, dtype, PARAM_AXES[name], desc,
                        scale=scales[name])


@pytest.mark.parametrize("op", ["dot", "additive"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("p", [0.2, 0.5])
def test_module_dropout(op, dtype, p, rng):
    """Training mode, qkv alone (its mask is not torch's): the same torch.manual_seed
    gives the same output, the next forward a fresh mask; with values = I the
    output is the dropped weights, each d2l's weight times 1/(1-p) or 0, and the
    gradients are autograd's of d2l's module with that mask."""
    torch_dtype = TORCH_DTYPE[dtype]
    batch, num_queries, num_keys = 3, 6, 12
    case = AttentionCase(op, 0, rng, dtype, two_d=False, big=False)  # for its feature sizes
    # Near-uniform weights (queries small) so every kept weight is far from 0.
    queries = rng.normal(0.0, 0.3, size=(batch, num_queries, case.queries.shape[-1]))
    keys = rng.normal(size=(batch, num_keys, case.keys.shape[-1]))
    values = np.repeat(np.eye(num_keys)[None], batch, axis=0)
    lens = torch.from_numpy(rng.integers(num_keys // 2, num_keys + 1, size=batch))
    inside = torch.arange(num_keys)[None, None, :] < lens[:, None, None]
    case.queries, case.keys, case.values = queries, keys, values
    book, ours = module_pair(op, case, torch_dtype, rng, "book->qkv")
    ours.dropout.p = p
    ours.train()
    desc = describe(op=op, dtype=dtype, p=p, B=batch, Nq=num_queries, Nk=num_keys,
                    lens=lens.tolist())

    def forward(module):
        q, k, v = (leaf(a, torch_dtype) for a in (queries, keys, values))
        return module(q, k, v, lens), (q, k, v)

    seed = int(rng.integers(2**62))
    torch.manual_seed(seed)
    out, inputs = forward(ours)
    weights = ours.attention_weights
    torch.manual_seed(seed)
    again, _ = forward(ours)
    fresh, _ = forward(ours)
    assert torch.equal(out, again), f"the same torch.manual_seed gave another output; {desc}"
    assert not torch.equal(again, fresh), f"two forwards drew the same dropout mask; {desc}"

    # The book's weights (eval mode: no dropout of its own), then the mask qkv drew.
    ref_inputs = [leaf(a, torch_dtype) for a in (queries, keys, values)]
    book(*ref_inputs, lens)
    ref_weights = book.attention_weights
    check_close("weights (training mode, before dropout)", weights, ref_weights.detach(), dtype,
                ("b", "q", "k"), desc)
    scaled = ref_weights.detach() / (1 - p)
    kept = (out.detach() - scaled).abs() < out.detach().abs()
    check_close("output (dropped weights)", out, torch.where(kept, scaled, 0 * scaled), dtype,
                ("b", "q", "k"), desc, scale=float(scaled.max()))
    fraction = float(kept[inside.expand_as(kept)].double().mean())
    count = int(inside.expand_as(kept).sum())
    spread = 5 * math.sqrt(p * (1 - p) / count)
    assert abs(fraction - (1 - p)) <= spread, (f"kept {fraction:.3f} of {count} valid weights, "
                                               f"expected {1 - p} +- {spread:.3f}; {desc}")

    # Gradients: qkv's backward replays its mask; d2l's module with that mask
    # applied by hand is the reference.
    loss, g = linear_functional(rng, out)
    loss.backward()
    ref_out = torch.bmm(ref_weights * kept / (1 - p), ref_inputs[2])
    ref_out.backward(torch.tensor(g, dtype=torch_dtype))
    # The terms' sizes without dropout, times 1/(1-p): a bound on them with it.
    args = (ref_weights.detach(), queries, keys, values)
    if op == "dot":
        scales = sdpa_grad_scales(*args, g, 1 / math.sqrt(queries.shape[-1]))
    else:
        scales = additive_grad_scales(*args, book.W_q.weight.detach(), book.W_k.weight.detach(),
                                      book.w_v.weight.detach(), g)
    scales = {name: scale / (1 - p) for name, scale in scales.items()}
    for name, got, ref in zip("qkv", inputs, ref_inputs):
        check_close(f"{GRAD_NAMES[name]} (training mode)", got.grad, ref.grad, dtype,
                    ("b",) + GRAD_AXES[name], desc, scale=scales[name])
    if op == "additive":
        for name in ("W_q", "W_k", "w_v"):  # from `out` alone: only its graph ran backward
            check_close(f"{GRAD_NAMES[name]} (training mode)", getattr(ours, name).weight.grad,
                        getattr(book, name).weight.grad, dtype, PARAM_AXES[name], desc,
                        scale=scales[name])
