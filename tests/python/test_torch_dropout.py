"""qkv.torch's dropout: torch.manual_seed makes runs repeatable, different seeds
differ, the backward replays the forward's mask, eval() turns dropout off.

The mask is read back from qkv itself: with values = I (Nk x Nk) the output
is the dropped-and-rescaled weights, which must be 0 or exactly w / (1 - p)
for the formulas' pre-dropout weights w. Outputs and gradients at any values
must then be torch's autograd of (w * mask) V with that mask: a backward that
drew another mask, or a forward whose mask depended on the values, fails.
"""

import pytest
import torch

import qkv
import qkv.torch
from torch_formulas import (BookAdditiveAttention, BookDotProductAttention, additive_reference,
                            additive_scores, check_close, exact_masked_softmax, lens_tensor,
                            randn, sdpa_reference, seed_from)

F64 = torch.float64


def shapes(rng):
    """Shapes with enough weights (>= 64) that two masks never agree by chance."""
    return dict(B=int(rng.integers(2, 4)), Nq=int(rng.integers(4, 9)),
                Nk=int(rng.integers(8, 17)), D=int(rng.integers(1, 6)),
                Dv=int(rng.integers(1, 4)), H=int(rng.integers(1, 6)),
                Dq=int(rng.integers(1, 5)), Dk=int(rng.integers(1, 5)))


def make_inputs(rng, op, s, dtype=F64):
    """(inputs, fn(inputs, values, **dropout), weights(inputs)): fn runs qkv with
    `values` in place of the inputs' own; weights are the formulas' pre-dropout weights."""
    B, Nq, Nk = s["B"], s["Nq"], s["Nk"]
    if op == "sdpa":
        inputs = [randn(rng, shape, dtype, True)
                  for shape in ((B, Nq, s["D"]), (B, Nk, s["D"]), (B, Nk, s["Dv"]))]

        def fn(inputs, values, lens, **kw):
            return qkv.torch.scaled_dot_product_attention(inputs[0], inputs[1], values,
                                                          valid_lens=lens, **kw)

        def weights(inputs, lens):
            q, k = inputs[:2]
            return exact_masked_softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, lens)
    else:
        inputs = [randn(rng, shape, dtype, True)
                  for shape in ((B, Nq, s["Dq"]), (B, Nk, s["Dk"]), (B, Nk, s["Dv"]),
                                (s["H"], s["Dq"]), (s["H"], s["Dk"]), (1, s["H"]))]

        def fn(inputs, values, lens, **kw):
            return qkv.torch.additive_attention(inputs[0], inputs[1], values, *inputs[3:], lens,
                                                **kw)

        def weights(inputs, lens):
            return exact_masked_softmax(additive_scores(inputs[0], inputs[1], *inputs[3:]), lens)
    return inputs, fn, weights


def mask_from_qkv(fn, inputs, lens, dropout_p, seed, weights):
    """qkv's dropped weights (values = I) and the multipliers they imply (0 or 1/(1-p));
    asserts that they are the weights dropped or rescaled, nothing else."""
    B, Nk = inputs[1].shape[0], inputs[1].shape[1]
    eye = torch.eye(Nk, dtype=inputs[0].dtype).expand(B, Nk, Nk)
    with torch.no_grad():
        dropped = fn(inputs, eye, lens, dropout_p=dropout_p, seed=seed)
        w = weights(inputs, lens)
    kept = dropped != 0
    assert torch.all(w[kept] > 0), "a masked key has a nonzero weight after dropout"
    rescaled = w / (1 - dropout_p)
    err = ((dropped - rescaled).abs() * kept).max().item()
    assert err <= 1e-12 * rescaled.abs().max().item(), \
        f"kept weights are not w / (1 - p): error {err:.3g}"
    return dropped, kept.to(w.dtype) / (1 - dropout_p), (w > 0)


@pytest.mark.parametrize("lens_kind", [None, "BNq"])
@pytest.mark.parametrize("op", ["sdpa", "additive"])
def test_backward_replays_the_forwards_mask(rng, op, lens_kind):
    s = shapes(rng)
    p = float(rng.uniform(0.2, 0.8))
    seed = seed_from(rng)
    inputs, fn, weights = make_inputs(rng, op, s)
    lens = lens_tensor(rng, lens_kind, s["B"], s["Nq"], s["Nk"])
    dropped, keep, valid = mask_from_qkv(fn, inputs, lens, p, seed, weights)
    # The mask keeps about 1 - p of the valid weights (5 sigma of a binomial).
    n = int(valid.sum())
    fraction = float((dropped != 0).sum()) / n
    assert abs(fraction - (1 - p)) <= 5 * (p * (1 - p) / n) ** 0.5 + 1e-9, (fraction, p, n)
    # The same mask at the real values, forward and backward.
    output = fn(inputs, inputs[2], lens, dropout_p=p, seed=seed)
    if op == "sdpa":
        want = sdpa_reference(*inputs, lens, keep=keep)
    else:
        want = additive_reference(*inputs, lens, keep=keep)
    check_close("output", output, want, "float64", scale=1.0, tolerance=1e-12)
    d_output = randn(rng, tuple(output.shape))
    got_grads = torch.autograd.grad(output, inputs, d_output)
    want_grads = torch.autograd.grad(want, inputs, d_output)
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        check_close(f"gradient of input {i}", g, w, "float64", scale=1.0, tolerance=1e-10)
    # d(sum output)/d values = the dropped weights summed over the queries.
    (d_values,) = torch.autograd.grad(fn(inputs, inputs[2], lens, dropout_p=p, seed=seed).sum(),
                                      inputs[2])
    expected = dropped.sum(dim=1)[:, :, None].expand_as(d_values)
    check_close("d_values", d_values, expected, "float64", scale=1.0, tolerance=1e-12)


@pytest.mark.parametrize("op", ["sdpa", "additive"])
def test_manual_seed_repeats_and_different_seeds_differ(rng, op):
    s = shapes(rng)
    inputs, fn, _ = make_inputs(rng, op, s)
    values = inputs[2]
    seed_a = seed_from(rng)

    def two_runs(torch_seed):
        torch.manual_seed(torch_seed)
        first = fn(inputs, values, None, dropout_p=0.5)
        return first, fn(inputs, values, None, dropout_p=0.5)  # the generator moved on

    a1, a2 = two_runs(seed_a)
    b1, _ = two_runs(seed_a ^ 1)
    again1, again2 = two_runs(seed_a)
    assert torch.equal(a1, again1) and torch.equal(a2, again2)
    assert not torch.equal(a1, a2)
    assert not torch.equal(a1, b1)
    # Explicit seeds: the same seed repeats, another differs.
    seed = seed_from(rng)
    one = fn(inputs, values, None, dropout_p=0.5, seed=seed)
    assert torch.equal(one, fn(inputs, values, None, dropout_p=0.5, seed=seed))
    assert not torch.equal(one, fn(inputs, values, None, dropout_p=0.5, seed=seed ^ 1))


@pytest.mark.parametrize("op", ["sdpa", "additive"])
def test_no_and_full_dropout(rng, op):
    s = shapes(rng)
    inputs, fn, _ = make_inputs(rng, op, s)
    lens = lens_tensor(rng, "B", s["B"], s["Nq"], s["Nk"])
    d_output = randn(rng, (s["B"], s["Nq"], s["Dv"]))
    plain = fn(inputs, inputs[2], lens)
    plain_grads = torch.autograd.grad(plain, inputs, d_output)
    zero = fn(inputs, inputs[2], lens, dropout_p=0.0, seed=seed_from(rng))
    assert torch.equal(zero, plain)
    for g, w in zip(torch.autograd.grad(zero, inputs, d_output), plain_grads):
        assert torch.equal(g, w)
    full = fn(inputs, inputs[2], lens, dropout_p=1.0, seed=seed_from(rng))
    assert torch.all(full == 0)
    for g in torch.autograd.grad(full, inputs, d_output):
        assert torch.all(g == 0)


def test_modules_eval_turns_dropout_off(rng):
    s = shapes(rng)
    lens = lens_tensor(rng, "BNq", s["B"], s["Nq"], s["Nk"], low=1)
    dot_inputs, dot_fn, _ = make_inputs(rng, "sdpa", s)
    add_inputs, _, _ = make_inputs(rng, "additive", s)
    dot = qkv.torch.DotProductAttention(0.5)
    book_dot = BookDotProductAttention(0.5)
    additive = qkv.torch.AdditiveAttention(s["Dk"], s["Dq"], s["H"], 0.5).double()
    book_additive = BookAdditiveAttention(s["Dk"], s["Dq"], s["H"], 0.5).double()
    additive.load_state_dict(book_additive.state_dict())
    q, k, v = add_inputs[:3]
    for module, book, inputs in ((dot, book_dot, dot_inputs[:3]), (additive, book_additive,
                                                                    (q, k, v))):
        assert module.training
        torch.manual_seed(seed_from(rng))
        trained = module(*inputs, lens)
        module.eval()
        book.eval()
        evaluated = module(*inputs, lens)
        assert not torch.equal(trained, evaluated)
        check_close("output (eval)", evaluated, book(*inputs, lens), "float64", scale=1.0,
                    tolerance=1e-12)
        assert torch.equal(evaluated, module(*inputs, lens))  # nothing random left
        module.train()
        assert not torch.equal(module(*inputs, lens), evaluated)
    check_close("output (eval)", dot.eval()(*dot_inputs[:3], lens),
                dot_fn(dot_inputs, dot_inputs[2], lens), "float64", scale=1.0, tolerance=1e-12)


@pytest.mark.parametrize("module_kind", ["dot", "additive"])
def test_module_backward_replays_its_mask(rng, module_kind):
    """A training forward draws its mask from torch's generator; the backward
    replays it: re-seeding and running with values = I reads the mask back."""
    s = shapes(rng)
    p = 0.4
    lens = lens_tensor(rng, "BNq", s["B"], s["Nq"], s["Nk"])
    if module_kind == "dot":
        module = qkv.torch.DotProductAttention(p)
        inputs, _, weights = make_inputs(rng, "sdpa", s)
        params = []
    else:
        module = qkv.torch.AdditiveAttention(s["Dk"], s["Dq"], s["H"], p).double()
        inputs, _, weights = make_inputs(rng, "additive", s)
        params = [module.W_q.weight, module.W_k.weight, module.w_v.weight]
        inputs = inputs[:3] + params
    q, k, v = inputs[:3]
    torch_seed = seed_from(rng)

    def run(values):
        torch.manual_seed(torch_seed)
        return module(q, k, values, lens)

    eye = torch.eye(s["Nk"], dtype=F64).expand(s["B"], s["Nk"], s["Nk"])
    with torch.no_grad():
        dropped = run(eye)
        w = weights(inputs, lens)
    # attention_weights are the weights before dropout.
    check_close("weights", module.attention_weights, w, "float64", scale=1.0, tolerance=1e-12)
    kept = dropped != 0
    keep = kept.to(F64) / (1 - p)
    check_close("dropped weights", dropped, w * keep, "float64", scale=1.0, tolerance=1e-12)
    output = run(v)
    if module_kind == "dot":
        want = sdpa_reference(q, k, v, lens, keep=keep)
    else:
        want = additive_reference(*inputs, lens, keep=keep)
    check_close("output", output, want, "float64", scale=1.0, tolerance=1e-12)
    d_output = randn(rng, tuple(output.shape))
    for i, (g, r) in enumerate(zip(torch.autograd.grad(output, inputs, d_output),
                                   torch.autograd.grad(want, inputs, d_output))):
        check_close(f"gradient of input {i}", g, r, "float64", scale=1.0, tolerance=1e-10)


def test_mask_does_not_depend_on_threads_or_dtype(rng):
    """The mask is a function of (seed, b, i, j): 1 thread or many, float64,
    float32 or bf16, the same elements are dropped."""
    s = shapes(rng)
    seed = seed_from(rng)
    inputs, fn, _ = make_inputs(rng, "sdpa", s)
    lens = lens_tensor(rng, "B", s["B"], s["Nq"], s["Nk"])
    d_output = randn(rng, (s["B"], s["Nq"], s["Dv"]))
    threads = qkv.get_num_threads()
    results = []
    try:
        for n in (1, max(threads, 2)):
            qkv.set_num_threads(n)
            output = fn(inputs, inputs[2], lens, dropout_p=0.5, seed=seed)
            results.append((output, torch.autograd.grad(output, inputs, d_output)))
    finally:
        qkv.set_num_threads(threads)
    (out1, grads1), (out2, grads2) = results
    assert torch.equal(out1, out2)
    for g1, g2 in zip(grads1, grads2):
        assert torch.equal(g1, g2)
    # float32 and bf16 against float32 on the same (rounded) inputs: a different
    # mask changes outputs by O(max|v|), rounding by far less (docs/semantics.md:
    # bf16 within 4e-3 max|v| before dropout's 1/(1 - p) = 2, plus the output's rounding).
    widened = [t.detach().float() for t in inputs]
    reference = fn(widened, widened[2], lens, dropout_p=0.5, seed=seed)
    assert (reference.double() - out1).abs().max().item() <= 1e-5 * reference.abs().max().item()
    rounded = [t.detach().bfloat16() for t in inputs]
    widened = [t.float() for t in rounded]
    reference = fn(widened, widened[2], lens, dropout_p=0.5, seed=seed)
    got = fn(rounded, rounded[2], lens, dropout_p=0.5, seed=seed)
    assert got.dtype == torch.bfloat16
    v_max = widened[2].abs().max().item()
    err = (got.float() - reference).abs().max().item()
    bound = 2 * 4e-3 * v_max + 2 ** -8 * reference.abs().max().item()
    assert err <= bound, f"bf16: error {err:.3g}, bound {bound:.3g}"
