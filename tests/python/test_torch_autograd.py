"""qkv.torch's autograd: gradcheck (float64 finite differences) of masked_softmax,
scaled_dot_product_attention, additive_attention and the two modules, with
valid_lens None, (B) and (B, Nq) (lengths 0 included) and dropout at a fixed
seed; how tensors reach the library and come back: values and gradients
against torch's autograd of the formulas (torch_formulas.py) under no_grad,
subsets of requires_grad, non-contiguous, 4-D, 2-D, bf16 and empty inputs.
Random small shapes from the `rng` fixture. The functions' numerics against
the formulas, case by case, are test_peer_torch.py's
(test_functions_match_the_exact_formulas).
"""

import itertools
import os
import subprocess
import sys

import pytest
import torch
from torch.autograd import gradcheck
from torch.nn.utils import stateless

import qkv.torch
from torch_formulas import (additive_reference, check_close, exact_masked_softmax, lens_tensor,
                            randn, sdpa_reference, seed_from, small_shapes)

F64 = torch.float64
LENS = [None, "B", "BNq"]
# Relative tolerance (to the largest reference entry, at least 1: the inputs
# are O(1)) when qkv and torch's autograd of the formulas compute in the same
# dtype: rounding of sums over a few terms. Gradients sum more terms, with
# cancellation (dw_v over all b, i, j): GRAD_TOL.
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
GRAD_TOL = {torch.float32: 1e-4, torch.float64: 1e-10}


def sdpa_inputs(rng, s, dtype=F64, requires_grad=True):
    return [randn(rng, shape, dtype, requires_grad)
            for shape in ((s["B"], s["Nq"], s["D"]), (s["B"], s["Nk"], s["D"]),
                          (s["B"], s["Nk"], s["Dv"]))]


def additive_inputs(rng, s, dtype=F64, requires_grad=True, w_v_shape=None):
    shapes = ((s["B"], s["Nq"], s["Dq"]), (s["B"], s["Nk"], s["Dk"]), (s["B"], s["Nk"], s["Dv"]),
              (s["H"], s["Dq"]), (s["H"], s["Dk"]), w_v_shape or (1, s["H"]))
    return [randn(rng, shape, dtype, requires_grad) for shape in shapes]


def grads_of(output, inputs, d_output):
    """Gradients of sum(output * d_output) w.r.t. inputs (None where not required)."""
    wanted = [t for t in inputs if t.requires_grad]
    got = iter(torch.autograd.grad(output, wanted, d_output, allow_unused=True))
    return [next(got) if t.requires_grad else None for t in inputs]


def assert_close(got, want, rtol, what=""):
    check_close(what, got, want, got.dtype, scale=1.0, tolerance=rtol)


# ---- gradcheck ------------------------------------------------------------------------

@pytest.mark.parametrize("lens_kind", LENS)
def test_masked_softmax_gradcheck(rng, lens_kind):
    s = small_shapes(rng)
    X = randn(rng, (s["B"], s["Nq"], s["Nk"]), requires_grad=True)
    lens = lens_tensor(rng, lens_kind, s["B"], s["Nq"], s["Nk"])
    assert gradcheck(lambda X: qkv.torch.masked_softmax(X, lens), (X,))


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("lens_kind", LENS)
def test_scaled_dot_product_attention_gradcheck(rng, lens_kind, dropout_p):
    s = small_shapes(rng)
    inputs = sdpa_inputs(rng, s)
    lens = lens_tensor(rng, lens_kind, s["B"], s["Nq"], s["Nk"])
    seed = seed_from(rng)
    assert gradcheck(lambda q, k, v: qkv.torch.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout_p, valid_lens=lens, seed=seed), inputs)


def test_scaled_dot_product_attention_gradcheck_with_scale(rng):
    s = small_shapes(rng)
    inputs = sdpa_inputs(rng, s)
    lens = lens_tensor(rng, "BNq", s["B"], s["Nq"], s["Nk"])
    scale = float(rng.uniform(0.2, 3.0))
    assert gradcheck(lambda q, k, v: qkv.torch.scaled_dot_product_attention(
        q, k, v, scale=scale, valid_lens=lens), inputs)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("lens_kind", LENS)
def test_additive_attention_gradcheck(rng, lens_kind, dropout_p):
    s = small_shapes(rng)
    inputs = additive_inputs(rng, s)
    lens = lens_tensor(rng, lens_kind, s["B"], s["Nq"], s["Nk"])
    seed = seed_from(rng)
    assert gradcheck(lambda *args: qkv.torch.additive_attention(
        *args, lens, dropout_p=dropout_p, seed=seed), inputs)


def test_additive_attention_gradcheck_with_1d_w_v(rng):
    s = small_shapes(rng)
    inputs = additive_inputs(rng, s, w_v_shape=(s["H"],))
    lens = lens_tensor(rng, "B", s["B"], s["Nq"], s["Nk"])
    assert gradcheck(lambda *args: qkv.torch.additive_attention(*args, lens), inputs)


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("lens_kind", LENS)
def test_dot_product_module_gradcheck(rng, lens_kind, mode):
    s = small_shapes(rng)
    inputs = sdpa_inputs(rng, s)
    lens = lens_tensor(rng, lens_kind, s["B"], s["Nq"], s["Nk"])
    module = qkv.torch.DotProductAttention(0.3).train(mode == "train")
    torch_seed = seed_from(rng)

    def f(q, k, v):
        torch.manual_seed(torch_seed)  # the same dropout mask in every evaluation
        return module(q, k, v, lens)

    assert gradcheck(f, inputs)


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("lens_kind", LENS)
def test_additive_module_gradcheck(rng, lens_kind, mode):
    s = small_shapes(rng)
    module = qkv.torch.AdditiveAttention(s["Dk"], s["Dq"], s["H"], 0.3).double()
    module.train(mode == "train")
    inputs = additive_inputs(rng, s)
    lens = lens_tensor(rng, lens_kind, s["B"], s["Nq"], s["Nk"])
    torch_seed = seed_from(rng)

    def f(q, k, v, W_q, W_k, w_v):
        torch.manual_seed(torch_seed)
        params = {"W_q.weight": W_q, "W_k.weight": W_k, "w_v.weight": w_v}
        return stateless.functional_call(module, params, (q, k, v, lens))

    assert gradcheck(f, inputs)


# ---- values and gradients against the formulas ----------------------------------------

@pytest.mark.parametrize("lens_kind", ["B", "BNq"])
def test_length_zero_gives_zero_outputs_and_gradients(rng, lens_kind):
    s = small_shapes(rng)
    lens = lens_tensor(rng, lens_kind, s["B"], s["Nq"], s["Nk"])
    keep = (torch.arange(s["Nk"]) < (lens[:, None, None] if lens.dim() == 1
                                      else lens[:, :, None]))  # (B, Nq or 1, Nk)
    empty_query = ~keep.any(-1)                                # (B, Nq or 1)
    unread_key = ~keep.any(-2)                                 # (B, Nk)
    for fn, inputs in (
            (lambda *a: qkv.torch.scaled_dot_product_attention(*a, valid_lens=lens),
             sdpa_inputs(rng, s)),
            (lambda *a: qkv.torch.additive_attention(*a, lens), additive_inputs(rng, s))):
        output = fn(*inputs)
        zero_rows = empty_query.expand(s["B"], s["Nq"])
        assert zero_rows.any()
        assert torch.all(output[zero_rows] == 0)
        d_q, d_k, d_v = grads_of(output, inputs, randn(rng, tuple(output.shape)))[:3]
        assert torch.all(d_q[zero_rows] == 0)
        assert torch.all(d_k[unread_key] == 0) and torch.all(d_v[unread_key] == 0)
    X = randn(rng, (s["B"], s["Nq"], s["Nk"]), requires_grad=True)
    weights = qkv.torch.masked_softmax(X, lens)
    assert torch.all(weights[~keep.expand(weights.shape)] == 0)
    (d_X,) = grads_of(weights, [X], randn(rng, tuple(X.shape)))
    assert torch.all(d_X[~keep.expand(weights.shape)] == 0)


def test_self_attention_with_one_tensor(rng):
    """query, key and value the same tensor: its gradient is the sum of the three."""
    s = small_shapes(rng)
    x = randn(rng, (s["B"], s["Nq"], s["D"]), requires_grad=True)
    lens = lens_tensor(rng, "B", s["B"], s["Nq"], s["Nq"])
    got = qkv.torch.scaled_dot_product_attention(x, x, x, valid_lens=lens)
    want = sdpa_reference(x, x, x, lens)
    assert_close(got, want, TOL[F64], "output")
    d_output = randn(rng, tuple(want.shape))
    assert_close(grads_of(got, [x], d_output)[0], grads_of(want, [x], d_output)[0],
                 GRAD_TOL[F64], "gradient")


# ---- no_grad, subsets of requires_grad --------------------------------------------------

def _all_calls(rng, s, lens):
    module = qkv.torch.AdditiveAttention(s["Dk"], s["Dq"], s["H"], 0.0).double()
    return [
        (lambda X: qkv.torch.masked_softmax(X, lens),
         [randn(rng, (s["B"], s["Nq"], s["Nk"]), requires_grad=True)]),
        (lambda *a: qkv.torch.scaled_dot_product_attention(*a, valid_lens=lens),
         sdpa_inputs(rng, s)),
        (lambda *a: qkv.torch.additive_attention(*a, lens), additive_inputs(rng, s)),
        (lambda *a: qkv.torch.DotProductAttention(0.0)(*a, lens), sdpa_inputs(rng, s)),
        (lambda *a: module(*a, lens), additive_inputs(rng, s)[:3]),
    ]


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_no_grad_gives_no_graph_and_the_same_values(rng, context):
    s = small_shapes(rng)
    lens = lens_tensor(rng, "BNq", s["B"], s["Nq"], s["Nk"])
    for fn, inputs in _all_calls(rng, s, lens):
        with_grad = fn(*inputs)
        assert with_grad.requires_grad
        with torch.no_grad() if context == "no_grad" else torch.inference_mode():
            without = fn(*inputs)
        assert not without.requires_grad and without.grad_fn is None
        assert torch.equal(without, with_grad.detach())


@pytest.mark.parametrize("op", ["sdpa", "additive"])
def test_each_subset_of_requires_grad_gets_the_same_gradients(rng, op):
    s = small_shapes(rng)
    lens = lens_tensor(rng, "BNq", s["B"], s["Nq"], s["Nk"])
    seed = seed_from(rng)
    if op == "sdpa":
        base = sdpa_inputs(rng, s, requires_grad=False)

        def fn(*a):
            return qkv.torch.scaled_dot_product_attention(*a, dropout_p=0.25, valid_lens=lens,
                                                          seed=seed)
    else:
        base = additive_inputs(rng, s, requires_grad=False)

        def fn(*a):
            return qkv.torch.additive_attention(*a, lens, dropout_p=0.25, seed=seed)
    d_output = randn(rng, (s["B"], s["Nq"], s["Dv"]))
    everything = [t.clone().requires_grad_() for t in base]
    full = grads_of(fn(*everything), everything, d_output)
    for size in range(1, len(base)):
        for subset in itertools.combinations(range(len(base)), size):
            inputs = [t.clone().requires_grad_(i in subset) for i, t in enumerate(base)]
            output = fn(*inputs)
            assert output.requires_grad
            got = grads_of(output, inputs, d_output)
            for i in range(len(base)):
                if i in subset:
                    assert_close(got[i], full[i], TOL[F64], f"input {i} of subset {subset}")
                else:
                    assert inputs[i].grad is None
    # None requiring grad: no graph.
    assert fn(*base).grad_fn is None


# ---- non-contiguous inputs ----------------------------------------------------------------

def _view(kind, rng, shape, dtype):
    """(leaf, view): a non-contiguous `view` of `shape` made from the leaf tensor."""
    *lead, n, d = shape
    if kind == "transposed":
        leaf = randn(rng, (*lead, d, n), dtype, True)
        return leaf, leaf.transpose(-1, -2)
    if kind == "strided":
        leaf = randn(rng, (*lead, 2 * n, 3 * d), dtype, True)
        return leaf, leaf[..., ::2, 1::3]
    if kind == "expanded":
        # Broadcast along a different axis for each rank (stride 0).
        if len(shape) == 3:
            leaf = randn(rng, (1, n, d), dtype, True)
        else:
            leaf = randn(rng, (n, 1), dtype, True)
        return leaf, leaf.expand(shape)
    if kind == "batch_last":
        leaf = randn(rng, (n, d, *lead), dtype, True)
        return leaf, leaf.permute(*range(2, 2 + len(lead)), 0, 1)
    raise AssertionError(kind)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("kind", ["transposed", "strided", "expanded", "batch_last"])
@pytest.mark.parametrize("op", ["masked_softmax", "sdpa", "additive"])
def test_non_contiguous_inputs_match_contiguous_copies(rng, op, kind, dtype):
    # Sizes >= 2: a view with a size-1 axis can be contiguous after all.
    s = {name: max(size, 2) for name, size in small_shapes(rng).items()}
    B, Nq, Nk = s["B"], s["Nq"], s["Nk"]
    lens = lens_tensor(rng, "BNq", B, Nq, Nk)
    if op == "masked_softmax":
        shapes = [(B, Nq, Nk)]
        fn = lambda X: qkv.torch.masked_softmax(X, lens)  # noqa: E731
    elif op == "sdpa":
        shapes = [(B, Nq, s["D"]), (B, Nk, s["D"]), (B, Nk, s["Dv"])]
        fn = lambda *a: qkv.torch.scaled_dot_product_attention(*a, valid_lens=lens)  # noqa: E731
    else:
        shapes = [(B, Nq, s["Dq"]), (B, Nk, s["Dk"]), (B, Nk, s["Dv"]), (s["H"], s["Dq"]),
                  (s["H"], s["Dk"]), (1, s["H"])]
        fn = lambda *a: qkv.torch.additive_attention(*a, lens)  # noqa: E731
    pairs = [_view(kind, rng, shape, dtype) for shape in shapes]
    leaves = [leaf for leaf, _ in pairs]
    views = [view for _, view in pairs]
    assert any(not v.is_contiguous() for v in views)
    d_output = None
    results = []
    for inputs in (views, [v.contiguous() for v in views]):
        output = fn(*inputs)
        if d_output is None:
            d_output = randn(rng, tuple(output.shape), dtype)
        results.append((output, grads_of(output, leaves, d_output)))
    (out_view, grads_view), (out_copy, grads_copy) = results
    assert_close(out_view, out_copy, TOL[dtype] / 10, "output")
    for i, (g, w) in enumerate(zip(grads_view, grads_copy)):
        assert_close(g, w, TOL[dtype], f"gradient of input {i}")


@pytest.mark.parametrize("loss", ["transposed", "sum"])
def test_non_contiguous_output_gradient(rng, loss):
    """The incoming gradient may be a transposed view or (for sum()) expanded."""
    s = small_shapes(rng)
    lens = lens_tensor(rng, "B", s["B"], s["Nq"], s["Nk"])
    inputs = sdpa_inputs(rng, s)
    weight = randn(rng, (s["B"], s["Dv"], s["Nq"]))

    def reduce(output):
        if loss == "sum":
            return output.sum()
        return (output.transpose(1, 2) * weight).sum()

    got = torch.autograd.grad(reduce(qkv.torch.scaled_dot_product_attention(
        *inputs, valid_lens=lens)), inputs)
    want = torch.autograd.grad(reduce(sdpa_reference(*inputs, lens)), inputs)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, GRAD_TOL[F64], f"gradient of input {i}")
    X = randn(rng, (s["B"], s["Nq"], s["Nk"]), requires_grad=True)
    weight = randn(rng, (s["B"], s["Nk"], s["Nq"]))
    w_got = qkv.torch.masked_softmax(X, lens)
    w_want = exact_masked_softmax(X, lens)
    if loss == "sum":
        got, want = (torch.autograd.grad(w.sum(), X)[0] for w in (w_got, w_want))
    else:
        got, want = (torch.autograd.grad((w.transpose(1, 2) * weight).sum(), X)[0]
                     for w in (w_got, w_want))
    assert_close(got, want, GRAD_TOL[F64], "masked_softmax gradient")


# ---- other ranks ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_4d_inputs_from_transposed_heads(rng, dtype):
    """(B, H, N, D) views of (B, N, H, D) tensors, as multi-head attention makes them."""
    s = {name: max(size, 2) for name, size in small_shapes(rng).items()}
    B, H = s["B"], int(rng.integers(2, 4))
    leaves = [randn(rng, (B, n, H, d), dtype, True)
              for n, d in ((s["Nq"], s["D"]), (s["Nk"], s["D"]), (s["Nk"], s["Dv"]))]
    inputs = [t.transpose(1, 2) for t in leaves]
    assert not any(t.is_contiguous() for t in inputs)
    got = qkv.torch.scaled_dot_product_attention(*inputs)
    want = sdpa_reference(*inputs)
    assert got.shape == (B, H, s["Nq"], s["Dv"])
    assert_close(got, want, TOL[dtype], "output")
    copy = qkv.torch.scaled_dot_product_attention(*[t.contiguous() for t in inputs])
    assert_close(got, copy, TOL[dtype] / 10, "output of contiguous copies")
    d_output = randn(rng, tuple(got.shape), dtype)
    for i, (g, w) in enumerate(zip(grads_of(got, leaves, d_output),
                                   grads_of(want, leaves, d_output))):
        assert_close(g, w, GRAD_TOL[dtype], f"gradient of input {i}")


def test_4d_and_5d_gradcheck(rng):
    s = small_shapes(rng)
    for lead in ((s["B"], 2), (2, 1, 2)):
        inputs = [randn(rng, (*lead, n, d), requires_grad=True)
                  for n, d in ((s["Nq"], s["D"]), (s["Nk"], s["D"]), (s["Nk"], s["Dv"]))]
        assert gradcheck(qkv.torch.scaled_dot_product_attention, inputs)


@pytest.mark.parametrize("lens_kind", [None, "Nq", "1"])
def test_2d_inputs_are_a_batch_of_one(rng, lens_kind):
    s = small_shapes(rng)
    Nq, Nk = s["Nq"], s["Nk"]
    if lens_kind is None:
        lens = lens3 = None
    elif lens_kind == "1":
        lens = torch.tensor([int(rng.integers(0, Nk + 1))])
        lens3 = lens
    else:
        lens = torch.from_numpy(rng.integers(0, Nk + 1, size=Nq))
        lens3 = lens[None, :]
    calls = [
        (lambda X, lens: qkv.torch.masked_softmax(X, lens), exact_masked_softmax,
         [(Nq, Nk)]),
        (lambda *a: qkv.torch.scaled_dot_product_attention(*a[:3], valid_lens=a[3]),
         sdpa_reference, [(Nq, s["D"]), (Nk, s["D"]), (Nk, s["Dv"])]),
        (qkv.torch.additive_attention, additive_reference,
         [(Nq, s["Dq"]), (Nk, s["Dk"]), (Nk, s["Dv"]), (s["H"], s["Dq"]), (s["H"], s["Dk"]),
          (s["H"],)]),
    ]
    for ours, reference, shapes in calls:
        inputs = [randn(rng, shape, requires_grad=True) for shape in shapes]
        batched = [t.unsqueeze(0) if i < 3 else t for i, t in enumerate(inputs)]
        got = ours(*inputs, lens)
        want = reference(*batched, lens3)[0]
        assert got.shape == want.shape
        assert_close(got, want, TOL[F64], "output")
        d_output = randn(rng, tuple(want.shape))
        for i, (g, w) in enumerate(zip(grads_of(got, inputs, d_output),
                                       grads_of(want, inputs, d_output))):
            assert_close(g, w, GRAD_TOL[F64], f"gradient of input {i}")
        assert gradcheck(lambda *a: ours(*a, lens), inputs)


# ---- bfloat16 -------------------------------------------------------------------------

@pytest.mark.parametrize("lens_kind", LENS)
def test_bf16_smoke(rng, lens_kind):
    """dtype kept, bf16 gradients, close to float32 on the same (widened) inputs
    (docs/semantics.md: output within 4e-3 max|v|, gradients within 2e-2 max|gradient|)."""
    s = small_shapes(rng)
    s.update(Nq=int(rng.integers(1, 9)), Nk=int(rng.integers(1, 12)), D=int(rng.integers(1, 17)))
    lens = lens_tensor(rng, lens_kind, s["B"], s["Nq"], s["Nk"])
    bf16 = [t.detach().bfloat16().requires_grad_() for t in sdpa_inputs(rng, s, torch.float32)]
    bf16[0] = bf16[0].detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    f32 = [t.detach().float().requires_grad_() for t in bf16]
    got = qkv.torch.scaled_dot_product_attention(*bf16, valid_lens=lens)
    assert got.dtype == torch.bfloat16 and got.shape == (s["B"], s["Nq"], s["Dv"])
    want = qkv.torch.scaled_dot_product_attention(*f32, valid_lens=lens)
    assert_close(want, sdpa_reference(*f32, lens), TOL[torch.float32], "float32 output")
    v_max = f32[2].detach().abs().max().item()
    assert (got.float() - want).abs().max().item() <= 4e-3 * v_max + 2 ** -8 * want.abs().max()
    d_output = randn(rng, tuple(got.shape), torch.float32)
    got_grads = torch.autograd.grad(got, bf16, d_output.bfloat16())
    want_grads = torch.autograd.grad(want, f32, d_output.bfloat16().float())
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert g.dtype == torch.bfloat16 and g.shape == bf16[i].shape
        scale = w.abs().max().item()
        err = (g.float() - w).abs().max().item()
        assert err <= 2e-2 * scale + 1e-30, f"gradient {i}: error {err:.3g}, max {scale:.3g}"


# ---- edge cases ------------------------------------------------------------------------

EMPTY_SHAPES = {  # (B, Nq, Nk, D, Dv)
    "Nq=0": (2, 0, 3, 2, 2), "Nk=0": (2, 3, 0, 2, 2), "D=0": (2, 3, 4, 0, 2),
    "Dv=0": (2, 3, 4, 2, 0),
}


def _same_results(got, want, inputs, what):
    """Equal values, and equal gradients of sum() (None counting as zeros)."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.allclose(got, want, rtol=1e-12, atol=0), what
    got_grads = torch.autograd.grad(got.sum(), inputs, allow_unused=True)
    want_grads = torch.autograd.grad(want.sum(), inputs, allow_unused=True)
    for t, g, w in zip(inputs, got_grads, want_grads):
        g = torch.zeros_like(t) if g is None else g
        w = torch.zeros_like(t) if w is None else w
        assert g.shape == t.shape and torch.allclose(g, w, rtol=1e-12, atol=0), what


def _check_empty(B, Nq, Nk, D, Dv):
    """Empty inputs give the formulas' results (zeros where Nk = 0: an empty sum)
    and gradients. Raises AssertionError (or the op's error) on a difference."""
    what = f"B={B} Nq={Nq} Nk={Nk} D={D} Dv={Dv}"
    q, k, v = (torch.ones(shape, dtype=F64, requires_grad=True)
               for shape in ((B, Nq, D), (B, Nk, D), (B, Nk, Dv)))
    _same_results(qkv.torch.scaled_dot_product_attention(q, k, v, scale=1.0),
                  sdpa_reference(q, k, v, scale=1.0), (q, k, v), "sdpa " + what)
    lens = torch.zeros(B, dtype=torch.int64)
    _same_results(qkv.torch.scaled_dot_product_attention(q, k, v, scale=1.0, valid_lens=lens),
                  sdpa_reference(q, k, v, lens, scale=1.0), (q, k, v), "sdpa, lengths 0 " + what)
    W = [torch.ones(shape, dtype=F64, requires_grad=True) for shape in ((2, D), (2, D), (1, 2))]
    _same_results(qkv.torch.additive_attention(q, k, v, *W), additive_reference(q, k, v, *W),
                  (q, k, v, *W), "additive " + what)
    X = torch.ones((B, Nq, Nk), dtype=F64, requires_grad=True)
    _same_results(qkv.torch.masked_softmax(X), exact_masked_softmax(X, None), (X,),
                  "masked_softmax " + what)


@pytest.mark.parametrize("name", list(EMPTY_SHAPES))
def test_empty_inputs_follow_the_formulas(name):
    _check_empty(*EMPTY_SHAPES[name])


def _check_empty_4d(shapes):
    q, k, v = (torch.ones(shape, dtype=F64, requires_grad=True) for shape in shapes)
    _same_results(qkv.torch.scaled_dot_product_attention(q, k, v), sdpa_reference(q, k, v),
                  (q, k, v), f"shapes {shapes}")


@pytest.mark.parametrize("shapes", [((2, 2, 3, 4), (2, 2, 0, 4), (2, 2, 0, 5)),
                                    ((2, 2, 0, 4), (2, 2, 6, 4), (2, 2, 6, 5))],
                         ids=["Nk=0", "Nq=0"])
def test_empty_4d_inputs_follow_the_formulas(shapes):
    _check_empty_4d(shapes)


@pytest.mark.parametrize("call", ["_check_empty(0, 3, 4, 2, 2)",
                                  "_check_empty_4d(((2, 0, 3, 4), (2, 0, 6, 4), (2, 0, 6, 5)))"],
                         ids=["B=0", "H=0"])
def test_empty_batch_in_a_separate_process(call):
    """No batch (B = 0, or H = 0 folded into it), run in a child process: a crash
    there fails this test instead of taking the whole session down."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_torch_autograd as t; "
            f"t.{call}")
    proc = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (f"exit status {proc.returncode} (negative: killed by that "
                                  f"signal)\n{proc.stderr[-3000:]}")


def test_backward_uses_the_forwards_valid_lens(rng):
    """valid_lens changed in place after the forward: the backward must either
    refuse (as torch does for a modified saved tensor) or use the forward's lengths."""
    s = small_shapes(rng)
    s["Nk"] = max(s["Nk"], 2)
    for fn, inputs in (
            (lambda *a: qkv.torch.scaled_dot_product_attention(*a[:3], valid_lens=a[3]),
             sdpa_inputs(rng, s)),
            (qkv.torch.additive_attention, additive_inputs(rng, s)),
            (qkv.torch.masked_softmax,
             [randn(rng, (s["B"], s["Nq"], s["Nk"]), requires_grad=True)])):
        lens = torch.from_numpy(rng.integers(1, s["Nk"], size=s["B"]))
        original = lens.clone()
        output = fn(*inputs, lens)
        d_output = randn(rng, tuple(output.shape))
        lens.fill_(0)  # the forward had lengths >= 1
        try:
            got = torch.autograd.grad(output, inputs, d_output)
        except RuntimeError:
            continue
        want = torch.autograd.grad(fn(*inputs, original), inputs, d_output)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, TOL[F64], f"gradient of input {i} after valid_lens changed")


def test_valid_lens_forms(rng):
    """int64, int32, non-contiguous tensors, NumPy arrays and lists give the same results."""
    s = small_shapes(rng)
    inputs = sdpa_inputs(rng, s)
    base = lens_tensor(rng, "BNq", s["B"], s["Nq"], s["Nk"])
    d_output = randn(rng, (s["B"], s["Nq"], s["Dv"]))
    want = sdpa_reference(*inputs, base)
    want_grads = grads_of(want, inputs, d_output)
    wide = torch.zeros(s["B"], 2 * s["Nq"], dtype=torch.int64)
    wide[:, ::2] = base
    for lens in (base.int(), wide[:, ::2], base.numpy(), base.tolist(),
                 base.T.contiguous().T):
        got = qkv.torch.scaled_dot_product_attention(*inputs, valid_lens=lens)
        assert_close(got, want, TOL[F64], f"output, valid_lens {type(lens).__name__}")
        for i, (g, w) in enumerate(zip(grads_of(got, inputs, d_output), want_grads)):
            assert_close(g, w, GRAD_TOL[F64], f"gradient {i}, valid_lens {type(lens).__name__}")
