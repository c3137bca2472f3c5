"""Peer test: qkv.torch against d2l's PyTorch attention code.

qkv.torch.masked_softmax, scaled_dot_product_attention and additive_attention
on fresh random cases (peer_harness: softmax_case, attention_case; sizes
around the SIMD widths, valid_lens None, (B) or (B, Nq) as tensors, lists or
ints, 2-D and 4-D inputs, strided tensors), against the book's formulations
(tests/peer/d2l_reference.py): forward outputs, and the gradients of every
input (and parameter) through .backward() of a random linear functional
sum(out * G), against torch autograd of the book's code; forwards under
torch.no_grad() (qkv.torch's path without autograd) too. bfloat16 scaled
dot-product attention (docs/semantics.md, "bfloat16 inputs") is compared with
the float64 reference on the same bf16 values. Then d2l's modules:
qkv.torch.DotProductAttention and AdditiveAttention exchange state_dicts with
the book's modules and give the same outputs, attention_weights and
gradients (inputs and W_q, W_k, w_v) in eval mode. In training mode qkv's
dropout mask is its own (a pure function of a seed drawn from torch's
generator), so it is checked on qkv alone: reproducible under
torch.manual_seed, fresh for each forward, and each output is d2l's weights
times the kept mask times 1/(1-p), with gradients that are autograd's for
that mask. Every comparison is by the one rule of d2l_reference.check_close
(peer_harness.check_peer), the reference computing in the case's float type
(float64 for bf16).

Last, qkv.torch's three functions against qkv's exact-mask rules written in
torch (torch_formulas: masked keys weigh exactly 0, L = 0 gives zero rows)
on small random shapes with lengths in [0, Nk], 0 and Nk among them: the
values, and the gradients of sum(out * G) against torch's autograd of the
formulas in float64.
"""

import math

import numpy as np
import pytest
import torch

import qkv.torch
from peer_harness import (  # first: puts tests/peer (d2l_reference) on sys.path
    NUM_CASES,
    Peer,
    TORCH_DTYPE,
    ZERO_LENGTH_LENS,
    Want,
    attention_case,
    attention_scale,
    check_close,
    check_peer,
    d2l_formula,
    d2l_softmax_formula,
    describe,
    draw_case,
    is_strided,
    keys_for_qkv,
    laid_out,
    peer_params,
    pooled_scale,
    report_worst,
    run_peer,
    softmax_case,
    torch_formula,
    torch_inputs,
    with_gradients,
    zero_length_case,
)
from d2l_reference import (
    D2lAdditiveAttention,
    D2lDotProductAttention,
    additive_grad_scales,
    d2l_masked_softmax,
    row_lengths,
    sdpa_grad_scales,
    softmax_grad_scale,
)
from torch_formulas import (additive_reference, exact_masked_softmax, sdpa_reference,
                            small_shapes)

CASES = range(NUM_CASES)
MODULE_CASES = range(16)
PARAMETERS = ("W_q", "W_k", "w_v")


@pytest.fixture(scope="module", autouse=True)
def torch_threads():
    """The references are small: one torch thread, so qkv has the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
    report_worst("test_peer_torch: worst relative errors")


def leaf(array, dtype, layout="contiguous"):
    """A leaf tensor of `array`'s values in `layout` that requires grad."""
    return laid_out(torch.tensor(array, dtype=dtype), layout).requires_grad_()


# ---- masked softmax ------------------------------------------------------------------

def qkv_masked_softmax(case):
    """qkv.torch.masked_softmax of the case's scores (column-major when
    options["layout"] says so): the weights, the weights without autograd, and
    the gradient of sum(weights * d_output)."""
    x = leaf(case.inputs["scores"], TORCH_DTYPE[case.dtype], case.options["layout"])
    weights = qkv.torch.masked_softmax(x, case.lens.for_torch())
    with torch.no_grad():
        no_grad_weights = qkv.torch.masked_softmax(x, case.lens.for_torch())
    results = {"weights": weights, "weights (torch.no_grad)": no_grad_weights}
    return with_gradients(results, weights, {"scores": x}, case.d_output)


@pytest.mark.parametrize("index", CASES)
def test_masked_softmax(index, rng):
    case = softmax_case(rng, index, ("float32", "float64")[index % 2])
    case.options["layout"] = "column-major" if is_strided(index) else "contiguous"
    if is_strided(index):
        case.notes.append("strided X")
    check_peer(qkv_masked_softmax, lambda c: d2l_softmax_formula(c, backward=True), case)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("form", ["B/int32", "BNq/int64"])
def test_masked_softmax_zero_length_rows(dtype, form, rng):
    """L = 0 rows are zeros with zero gradient (d2l: uniform); other rows are d2l's."""
    lens = ZERO_LENGTH_LENS[form]
    empty = row_lengths(lens, 3, 4, 6) == 0
    torch_dtype = TORCH_DTYPE[dtype]
    scores = rng.normal(size=(3, 4, 6))
    x = leaf(scores, torch_dtype)
    weights = qkv.torch.masked_softmax(x, torch.from_numpy(lens))
    g = torch.tensor(rng.normal(size=weights.shape), dtype=torch_dtype)
    (weights * g).sum().backward()
    x_ref = torch.tensor(scores, dtype=torch_dtype, requires_grad=True)
    ref = d2l_masked_softmax(x_ref, torch.from_numpy(lens))
    assert np.allclose(ref.detach().numpy()[empty], 1 / 6), "d2l gives uniform rows"
    (ref * g).sum().backward()
    desc = f"dtype={dtype} lens={lens.tolist()}"
    for b, i in np.argwhere(empty):
        assert torch.all(weights[b, i] == 0), f"L = 0 row b={b} q={i}: {weights[b, i]}; {desc}"
        assert torch.all(x.grad[b, i] == 0), f"L = 0 row b={b} q={i}: grad {x.grad[b, i]}; {desc}"
    live = torch.from_numpy(~empty)
    check_close("weights (rows with L >= 1)", weights[live], ref.detach()[live], dtype, desc,
                ("row", "k"))
    check_close("d_scores (rows with L >= 1)", x.grad[live], x_ref.grad[live], dtype, desc,
                ("row", "k"), scale=softmax_grad_scale(ref.detach(), g.double()))


# ---- scaled dot-product and additive attention -------------------------------------------

def qkv_attention(case):
    """The case through qkv.torch's functional form of its op in
    options["layout"]: "3-D" (contiguous), "strided" (the last two axes of
    queries, keys and values in column-major memory) or "4-D" ((1, B, N, D)
    read through a transposed view of (1, N, B, D) memory). The output with
    and without autograd and the gradients of sum(output * d_output), as the
    reference's shapes."""
    torch_dtype, layout = TORCH_DTYPE[case.dtype], case.options["layout"]
    arrays = {"queries": case.inputs["queries"], "keys": keys_for_qkv(case),
              "values": case.inputs["values"]}
    if layout == "4-D":
        tensors = {n: leaf(a[None], torch_dtype, "token-major") for n, a in arrays.items()}
    else:
        memory = "column-major" if layout == "strided" else "contiguous"
        tensors = {n: leaf(a, torch_dtype, memory) for n, a in arrays.items()}
    if case.options["op"] == "additive":
        tensors.update({n: leaf(case.inputs[n], torch_dtype) for n in PARAMETERS})

    def call():
        if case.options["op"] == "dot":
            return qkv.torch.scaled_dot_product_attention(
                *(tensors[n] for n in arrays), scale=case.options["scale"],
                valid_lens=case.lens.for_torch())
        return qkv.torch.additive_attention(*tensors.values(), case.lens.for_torch())

    output = call()
    with torch.no_grad():
        no_grad_output = call()
    results = with_gradients({"output": output, "output (torch.no_grad)": no_grad_output},
                             output, tensors, case.d_output)
    if layout == "4-D":
        results = {n: r[0] if n in ("output", "output (torch.no_grad)", "d_queries", "d_keys",
                                    "d_values") else r for n, r in results.items()}
    return results


def layout_of(index, case):
    """Half the 3-D cases without lengths go 4-D (B as a head axis, transposed
    memory); two in eight strided tensors; the rest contiguous."""
    if case.lens.value is None and not case.two_d and (index // 9) % 2 == 0:
        return "4-D"
    return "strided" if is_strided(index) else "3-D"


def check_attention(case, layout):
    case.options["layout"] = layout
    if layout != "3-D":
        case.notes.append(layout)
    check_peer(qkv_attention, lambda c: d2l_formula(c, d_output=c.d_output), case)


@pytest.mark.parametrize("index", range(NUM_CASES + NUM_CASES // 2))
def test_scaled_dot_product_attention(index, rng):
    """90 cases: 30 each in float32, float64 and bfloat16."""
    dtype = ("float32", "float64", "bfloat16")[index % 3]
    case = attention_case("dot", index, rng, dtype, lens_index=index // 3 * 2, grad=True)
    check_attention(case, layout_of(index, case))


@pytest.mark.parametrize("index", CASES)
def test_additive_attention(index, rng):
    dtype = ("float32", "float64")[index % 2]
    case = attention_case("additive", index, rng, dtype, grad=True)
    check_attention(case, "strided" if is_strided(index) else "3-D")


@pytest.mark.parametrize("op", ["dot", "additive"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("form", ["B/int32", "BNq/int64"])
def test_attention_zero_length(op, dtype, form, rng):
    """L = 0: zero output and zero gradient for that query, and nothing added to
    the other gradients (d2l: the mean of all values). Compared with d2l run
    with G zero on those queries."""
    case = zero_length_case(op, dtype, rng, ZERO_LENGTH_LENS[form])
    case.d_output = case.add_input("d_output", rng.normal(size=(3, 4, case.sizes["Dv"])))
    case.options["layout"] = "3-D"
    live = case.lens.rows > 0
    d_output_live = np.where(live[..., None], case.d_output, 0.0)
    got = check_peer(qkv_attention, lambda c: d2l_formula(c, rows=live, d_output=d_output_live),
                     case)
    desc = case.desc()
    for b, i in np.argwhere(~live):
        assert torch.all(got["output"][b, i] == 0), (f"L = 0 query b={b} q={i}: output "
                                                     f"{got['output'][b, i]}; {desc}")
        assert torch.all(got["d_queries"][b, i] == 0), (f"L = 0 query b={b} q={i}: gradient "
                                                        f"{got['d_queries'][b, i]}; {desc}")


# ---- d2l's modules -------------------------------------------------------------------------

def module_pair(op, case, rng, direction):
    """(book's module, qkv's module), one's freshly initialised parameters loaded
    into the other through state_dict (direction "book->qkv" or "qkv->book")."""
    torch.manual_seed(int(rng.integers(2**62)))
    dropout = float(rng.choice([0.0, 0.1, 0.5]))
    if op == "dot":
        book = D2lDotProductAttention(dropout)
        ours = qkv.torch.DotProductAttention(dropout)
    else:
        sizes = (case.inputs["keys"].shape[-1], case.inputs["queries"].shape[-1],
                 case.sizes["hidden"])
        book = D2lAdditiveAttention(*sizes, dropout)
        ours = qkv.torch.AdditiveAttention(*sizes, dropout)
    torch_dtype = TORCH_DTYPE[case.dtype]
    book, ours = book.to(torch_dtype), ours.to(torch_dtype)
    source, target = (book, ours) if direction == "book->qkv" else (ours, book)
    target.load_state_dict(source.state_dict())  # strict: the same keys and shapes
    assert list(book.state_dict()) == list(ours.state_dict()), "state_dict keys differ"
    for name, value in book.state_dict().items():
        assert torch.equal(value, ours.state_dict()[name]), f"{name} not loaded ({direction})"
    return book.eval(), ours.eval()


def module_inputs(case, keys):
    torch_dtype = TORCH_DTYPE[case.dtype]
    return {"queries": leaf(case.inputs["queries"], torch_dtype), "keys": leaf(keys, torch_dtype),
            "values": leaf(case.inputs["values"], torch_dtype)}


def qkv_module(case):
    """qkv's module (options["ours"]) in eval mode: output and
    attention_weights with and without autograd, and the gradients of
    sum(output * d_output) of the inputs and the parameters."""
    ours = case.options["ours"]
    inputs = module_inputs(case, keys_for_qkv(case))
    output = ours(*inputs.values(), case.lens.tensor())
    assert ours.attention_weights is not None, f"attention_weights not set; {case.desc()}"
    results = {"output": output, "weights": ours.attention_weights}
    output.backward(torch.tensor(case.d_output, dtype=output.dtype))
    results.update({f"d_{n}": t.grad for n, t in inputs.items()})
    if case.options["op"] == "additive":
        for name in PARAMETERS:
            grad = getattr(ours, name).weight.grad
            assert grad is not None, f"{name}.weight.grad is None after backward; {case.desc()}"
            results[f"d_{name}"] = grad
    with torch.no_grad():  # qkv.torch's path without autograd
        ours.attention_weights = None
        results["output (torch.no_grad)"] = ours(*module_inputs(case, keys_for_qkv(case)).values(),
                                                 case.lens.tensor())
    assert ours.attention_weights is not None, f"attention_weights not set; {case.desc()}"
    results["weights (torch.no_grad)"] = ours.attention_weights
    return results


def book_module(case):
    """The book's module (options["book"]), the same way: output, weights and
    gradients, each against the size of its terms."""
    book = case.options["book"]
    inputs = module_inputs(case, case.inputs["keys"])
    output = book(*inputs.values(), case.lens.tensor())
    output.backward(torch.tensor(case.d_output, dtype=output.dtype))
    weights = book.attention_weights.detach()
    values = case.inputs["values"]
    args = (weights, case.inputs["queries"], case.inputs["keys"], values)
    if case.options["op"] == "dot":
        scales = sdpa_grad_scales(*args, case.d_output, attention_scale(case))
    else:
        scales = additive_grad_scales(
            *args, *(getattr(book, n).weight.detach() for n in PARAMETERS), case.d_output)
    want = {"output": Want(output.detach(), pooled_scale(weights, values)),
            "weights": Want(weights)}
    want.update({f"d_{n}": Want(t.grad, scales[n[0]]) for n, t in inputs.items()})
    for name in PARAMETERS if case.options["op"] == "additive" else ():
        want[f"d_{name}"] = Want(getattr(book, name).weight.grad, scales[name])
    return want


@pytest.mark.parametrize("op", ["dot", "additive"])
@pytest.mark.parametrize("index", MODULE_CASES)
def test_module_eval(op, index, rng):
    """Eval mode: the book's module and qkv's with the same state_dict give the same
    output, attention_weights and gradients (inputs, and W_q, W_k, w_v)."""
    dtype = ("float32", "float64")[index % 2]
    case = attention_case(op, index, rng, dtype, two_d=False, grad=True)
    if op == "dot":  # the modules have d2l's 1/sqrt(D), no scale argument
        case.options["scale"] = None
        case.notes = [note for note in case.notes if not note.startswith("scale")]
    direction = ("book->qkv", "qkv->book")[(index // 2) % 2]
    case.options["book"], case.options["ours"] = module_pair(op, case, rng, direction)
    case.notes += [direction, f"dropout {case.options['ours'].dropout.p} (eval)"]
    check_peer(qkv_module, book_module, case)


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
    case = attention_case(op, 0, rng, dtype, two_d=False, big=False)  # for its feature sizes
    # Near-uniform weights (queries small) so every kept weight is far from 0.
    queries = rng.normal(0.0, 0.3, size=(batch, num_queries, case.inputs["queries"].shape[-1]))
    keys = rng.normal(size=(batch, num_keys, case.inputs["keys"].shape[-1]))
    values = np.repeat(np.eye(num_keys)[None], batch, axis=0)
    lens = torch.from_numpy(rng.integers(num_keys // 2, num_keys + 1, size=batch))
    inside = torch.arange(num_keys)[None, None, :] < lens[:, None, None]
    for name, array in (("queries", queries), ("keys", keys), ("values", values)):
        case.inputs[name] = array
    book, ours = module_pair(op, case, rng, "book->qkv")
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
                desc, ("b", "q", "k"))
    scaled = ref_weights.detach() / (1 - p)
    kept = (out.detach() - scaled).abs() < out.detach().abs()
    check_close("output (dropped weights)", out, torch.where(kept, scaled, 0 * scaled), dtype,
                desc, ("b", "q", "k"), scale=float(scaled.max()))
    fraction = float(kept[inside.expand_as(kept)].double().mean())
    count = int(inside.expand_as(kept).sum())
    spread = 5 * math.sqrt(p * (1 - p) / count)
    assert abs(fraction - (1 - p)) <= spread, (f"kept {fraction:.3f} of {count} valid weights, "
                                               f"expected {1 - p} +- {spread:.3f}; {desc}")

    # Gradients: qkv's backward replays its mask; d2l's module with that mask
    # applied by hand is the reference.
    g = torch.tensor(rng.normal(size=out.shape), dtype=torch_dtype)
    (out * g).sum().backward()
    ref_out = torch.bmm(ref_weights * kept / (1 - p), ref_inputs[2])
    ref_out.backward(g)
    # The terms' sizes without dropout, times 1/(1-p): a bound on them with it.
    args = (ref_weights.detach(), queries, keys, values)
    if op == "dot":
        scales = sdpa_grad_scales(*args, g, 1 / math.sqrt(queries.shape[-1]))
    else:
        scales = additive_grad_scales(*args, book.W_q.weight.detach(), book.W_k.weight.detach(),
                                      book.w_v.weight.detach(), g)
    scales = {name: scale / (1 - p) for name, scale in scales.items()}
    for name, got, ref in zip("qkv", inputs, ref_inputs):
        what = {"q": "d_queries", "k": "d_keys", "v": "d_values"}[name]
        check_close(f"{what} (training mode)", got.grad, ref.grad, dtype, desc,
                    ("b", "k" if name != "q" else "q", "d"), scale=scales[name])
    if op == "additive":
        for name in PARAMETERS:  # from `out` alone: only its graph ran backward
            check_close(f"d_{name} (training mode)", getattr(ours, name).weight.grad,
                        getattr(book, name).weight.grad, dtype, desc, scale=scales[name])


# ---- qkv.torch against qkv's exact-mask formulas, lengths 0 included -----------------------

def formulas_case(op, rng, index, dtype):
    """torch_formulas.small_shapes (B >= 2, the rest from 1 to 5) and lengths
    None, (B) or (B, Nq) as the index cycles, in [0, Nk] with 0 and Nk among
    them; op "masked_softmax" (scores), "sdpa" or "additive" (W_q, W_k, w_v
    (1, H), standard normal)."""
    s = small_shapes(rng)
    sizes = {"B": s["B"], "Nq": s["Nq"], "Nk": s["Nk"]}
    if op == "additive":
        sizes.update(Dq=s["Dq"], Dk=s["Dk"], hidden=s["H"], Dv=s["Dv"])
    else:
        sizes.update(D=s["D"], Dv=s["Dv"])
    case = draw_case(rng, index, dtype, sizes, softmax=op == "masked_softmax",
                     lens=(None, "B", "BNq")[index % 3], lens_low=0, op=op)
    if op == "additive":
        for name, shape in (("W_q", (s["H"], s["Dq"])), ("W_k", (s["H"], s["Dk"])),
                            ("w_v", (1, s["H"]))):
            case.add_input(name, rng.standard_normal(shape))
    return case


FORMULA_INPUTS = {"masked_softmax": ("scores",), "sdpa": ("queries", "keys", "values"),
                  "additive": ("queries", "keys", "values", "W_q", "W_k", "w_v")}


def qkv_function(case):
    op, lens = case.options["op"], case.valid_lens()
    inputs = torch_inputs(case, FORMULA_INPUTS[op])
    args = list(inputs.values())
    if op == "masked_softmax":
        output = qkv.torch.masked_softmax(*args, lens)
    elif op == "sdpa":
        output = qkv.torch.scaled_dot_product_attention(*args, valid_lens=lens)
    else:
        output = qkv.torch.additive_attention(*args, lens)
    return with_gradients({"output": output}, output, inputs, case.d_output)


def exact_formula(case):
    """The formula in float64, output against the floor 1 (the inputs are O(1)),
    gradients at GRADIENT_TOLERANCE against it too."""
    op = case.options["op"]
    formula = {"masked_softmax": exact_masked_softmax, "sdpa": sdpa_reference,
               "additive": additive_reference}[op]
    want = torch_formula(lambda c, **t: formula(*(t[n] for n in FORMULA_INPUTS[op]),
                                                c.valid_lens()), case, FORMULA_INPUTS[op])
    want["output"].scale = 1.0
    return want


FORMULA_PEERS = [Peer(op, lambda rng, index, dtype, op=op: formulas_case(op, rng, index, dtype),
                      qkv_function, exact_formula, ("float32", "float64"), 3)
                 for op in ("masked_softmax", "sdpa", "additive")]


@pytest.mark.parametrize("peer, dtype", peer_params(FORMULA_PEERS))
def test_functions_match_the_exact_formulas(peer, dtype, seed):
    run_peer(peer, dtype, seed)
