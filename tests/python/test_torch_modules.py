"""qkv.torch's modules against the book's: d2l §11.5's MultiHeadAttention around
qkv.torch.DotProductAttention gives the outputs and parameter gradients it
gives around the book's DotProductAttention; attention_weights; state_dict
layout (a book AdditiveAttention's state_dict loads and gives its results).
The book's classes are written from the chapter's formulas in torch_formulas.py.
"""

import pytest
import torch
from torch import nn

import qkv.torch
from torch_formulas import (BookAdditiveAttention, BookDotProductAttention,
                            BookMultiHeadAttention, check_close, exact_masked_softmax,
                            key_mask, lens_tensor, randn, sdpa_reference)

# Relative to the largest entry (at least 1; inputs are O(1)): the brief's
# float32 1e-5 and float64 1e-12, rounding of sums over a few dozen terms.
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def mha_shapes(rng):
    heads = int(rng.integers(1, 5))
    return dict(B=int(rng.integers(2, 4)), Nq=int(rng.integers(1, 7)), Nk=int(rng.integers(1, 9)),
                heads=heads, num_hiddens=heads * int(rng.integers(1, 5)),
                query_size=int(rng.integers(1, 7)), key_size=int(rng.integers(1, 7)),
                value_size=int(rng.integers(1, 7)))


def pair_of_mhas(s, dtype, qkv_attention):
    """The book's MultiHeadAttention around the book's attention and around
    `qkv_attention`, with the same parameters, in eval mode."""
    sizes = (s["query_size"], s["key_size"], s["value_size"], s["num_hiddens"], s["heads"])
    book = BookMultiHeadAttention(BookDotProductAttention(0.5), *sizes).to(dtype).eval()
    ours = BookMultiHeadAttention(qkv_attention, *sizes).to(dtype).eval()
    ours.load_state_dict(book.state_dict())
    return book, ours


def compare(book, ours, inputs, lens, rng, dtype, with_input_grads=True):
    """Same outputs and gradients (parameters, and the inputs) for one random d_output."""
    inputs_book = [t.detach().clone().requires_grad_() for t in inputs]
    inputs_ours = [t.detach().clone().requires_grad_() for t in inputs]
    want = book(*inputs_book, lens)
    got = ours(*inputs_ours, lens)
    assert got.dtype == dtype and got.shape == want.shape
    check_close("output", got, want, dtype, scale=1.0, tolerance=TOL[dtype])
    d_output = randn(rng, tuple(want.shape), dtype)
    want.backward(d_output)
    got.backward(d_output)
    for (name, p_book), (_, p_ours) in zip(book.named_parameters(), ours.named_parameters()):
        check_close(f"gradient of {name}", p_ours.grad, p_book.grad, dtype, scale=1.0,
                    tolerance=TOL[dtype])
    if with_input_grads:
        for i, (a, b) in enumerate(zip(inputs_ours, inputs_book)):
            check_close(f"gradient of input {i}", a.grad, b.grad, dtype, scale=1.0,
                        tolerance=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lens_kind", [None, "B", "BNq"])
def test_multi_head_attention_matches_the_books(rng, lens_kind, dtype):
    s = mha_shapes(rng)
    book, ours = pair_of_mhas(s, dtype, qkv.torch.DotProductAttention(0.5))
    assert [n for n, _ in ours.named_parameters()] == ["W_q.weight", "W_k.weight",
                                                       "W_v.weight", "W_o.weight"]
    inputs = [randn(rng, (s["B"], s["Nq"], s["query_size"]), dtype),
              randn(rng, (s["B"], s["Nk"], s["key_size"]), dtype),
              randn(rng, (s["B"], s["Nk"], s["value_size"]), dtype)]
    # Lengths >= 1: at 0 the book's -1e6 sentinel gives uniform weights, qkv zeros.
    lens = lens_tensor(rng, lens_kind, s["B"], s["Nq"], s["Nk"], low=1)
    compare(book, ours, inputs, lens, rng, dtype)


class HeadsAsAxis(nn.Module):
    """Attention for BookMultiHeadAttention that unfolds the heads into an axis and
    calls qkv on (B, H, N, D) views (no valid_lens), then folds them back."""

    def __init__(self, num_heads):
        super().__init__()
        self.num_heads = num_heads

    def forward(self, queries, keys, values, valid_lens):
        assert valid_lens is None
        unfold = lambda X: X.reshape(-1, self.num_heads, *X.shape[1:])  # noqa: E731
        output = qkv.torch.scaled_dot_product_attention(unfold(queries), unfold(keys),
                                                        unfold(values))
        return output.reshape(-1, *output.shape[2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_multi_head_attention_with_4d_heads(rng, dtype):
    s = mha_shapes(rng)
    book, ours = pair_of_mhas(s, dtype, HeadsAsAxis(s["heads"]))
    inputs = [randn(rng, (s["B"], s["Nq"], s["query_size"]), dtype),
              randn(rng, (s["B"], s["Nk"], s["key_size"]), dtype),
              randn(rng, (s["B"], s["Nk"], s["value_size"]), dtype)]
    compare(book, ours, inputs, None, rng, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lens_kind", [None, "B", "BNq"])
def test_additive_module_loads_the_books_state_dict(rng, lens_kind, dtype):
    B, Nq, Nk = int(rng.integers(2, 4)), int(rng.integers(1, 6)), int(rng.integers(1, 8))
    key_size, query_size, num_hiddens = (int(n) for n in rng.integers(1, 7, size=3))
    book = BookAdditiveAttention(key_size, query_size, num_hiddens, 0.3).to(dtype).eval()
    ours = qkv.torch.AdditiveAttention(key_size, query_size, num_hiddens, 0.3).to(dtype).eval()
    assert list(ours.state_dict()) == list(book.state_dict()) == [
        "W_k.weight", "W_q.weight", "w_v.weight"]
    for name, tensor in book.state_dict().items():
        assert ours.state_dict()[name].shape == tensor.shape, name
    ours.load_state_dict(book.state_dict())  # strict
    inputs = [randn(rng, (B, Nq, query_size), dtype), randn(rng, (B, Nk, key_size), dtype),
              randn(rng, (B, Nk, int(rng.integers(1, 4))), dtype)]
    lens = lens_tensor(rng, lens_kind, B, Nq, Nk, low=1)
    compare(book, ours, inputs, lens, rng, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lens_kind", [None, "B", "BNq"])
def test_dot_product_module_matches_the_books(rng, lens_kind, dtype):
    B, Nq, Nk, D, Dv = (int(n) for n in rng.integers(1, 7, size=5))
    book = BookDotProductAttention(0.3).eval()
    ours = qkv.torch.DotProductAttention(0.3).eval()
    assert ours.state_dict() == book.state_dict() == {}
    assert list(ours.parameters()) == []
    inputs = [randn(rng, (B, Nq, D), dtype), randn(rng, (B, Nk, D), dtype),
              randn(rng, (B, Nk, Dv), dtype)]
    lens = lens_tensor(rng, lens_kind, B, Nq, Nk, low=1)
    compare(book, ours, inputs, lens, rng, dtype)


# ---- attention_weights --------------------------------------------------------------------

def _modules(rng, B, Nq, Nk, **kw):
    Dq, Dk, D, Dv, H = (int(n) for n in rng.integers(1, 5, size=5))
    additive = qkv.torch.AdditiveAttention(Dk, Dq, H, 0.5, **kw).double()
    dot_inputs = [randn(rng, shape) for shape in ((B, Nq, D), (B, Nk, D), (B, Nk, Dv))]
    add_inputs = [randn(rng, shape) for shape in ((B, Nq, Dq), (B, Nk, Dk), (B, Nk, Dv))]
    return [(qkv.torch.DotProductAttention(0.5, **kw), dot_inputs, None),
            (additive, add_inputs, additive)]


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("lens_kind", [None, "B", "BNq"])
def test_attention_weights(rng, lens_kind, mode):
    """(B, Nq, Nk), detached, before dropout: rows sum to 1 over the valid keys,
    0 past the length (all 0 for length 0), and equal the formulas' weights."""
    B, Nq, Nk = int(rng.integers(2, 4)), int(rng.integers(1, 6)), int(rng.integers(1, 8))
    lens = lens_tensor(rng, lens_kind, B, Nq, Nk)
    for module, (q, k, v), additive in _modules(rng, B, Nq, Nk):
        module.train(mode == "train")
        assert module.attention_weights is None
        q.requires_grad_()
        module(q, k, v, lens)
        w = module.attention_weights
        assert w.shape == (B, Nq, Nk) and w.dtype == q.dtype
        assert not w.requires_grad
        keep = key_mask(lens, (B, Nq, Nk))
        assert torch.all(w[~keep] == 0)
        sums = w.sum(-1)
        nonempty = keep.any(-1)
        assert torch.allclose(sums[nonempty], torch.ones_like(sums[nonempty]), atol=1e-12)
        assert torch.all(sums[~nonempty] == 0)
        if additive is None:
            scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
        else:
            features = torch.tanh((q @ additive.W_q.weight.T)[:, :, None]
                                  + (k @ additive.W_k.weight.T)[:, None])
            scores = (features @ additive.w_v.weight.T)[..., 0]
        check_close("weights", w, exact_masked_softmax(scores, lens), "float64", scale=1.0,
                    tolerance=1e-12)
        # A new forward replaces them.
        module(q[:, :1], k, v, None if lens is None else lens[:, :1] if lens.dim() == 2 else lens)
        assert module.attention_weights.shape == (B, 1, Nk)


def test_attention_weights_of_4d_inputs(rng):
    B, H, Nq, Nk, D = (int(n) for n in rng.integers(1, 5, size=5))
    q, k, v = (randn(rng, shape) for shape in ((B, H, Nq, D), (B, H, Nk, D), (B, H, Nk, 2)))
    module = qkv.torch.DotProductAttention(0.0)
    output = module(q, k, v)
    assert output.shape == (B, H, Nq, 2)
    w = module.attention_weights
    assert w.shape == (B, H, Nq, Nk)
    check_close("weights", w, torch.softmax(q @ k.transpose(-1, -2) / D ** 0.5, -1), "float64",
                scale=1.0, tolerance=1e-12)
    check_close("output", output, sdpa_reference(q, k, v), "float64", scale=1.0, tolerance=1e-12)


def test_keep_attention_weights_false(rng):
    B, Nq, Nk = int(rng.integers(1, 4)), int(rng.integers(1, 6)), int(rng.integers(1, 8))
    lens = lens_tensor(rng, "B", B, Nq, Nk)
    for with_weights, inputs, additive in _modules(rng, B, Nq, Nk):
        if additive is None:
            module = qkv.torch.DotProductAttention(0.5, keep_attention_weights=False)
        else:
            module = qkv.torch.AdditiveAttention(
                additive.W_k.in_features, additive.W_q.in_features, additive.W_q.out_features,
                0.5, keep_attention_weights=False).double()
            module.load_state_dict(additive.state_dict())
        module.eval()
        with_weights.eval()
        output = module(*inputs, lens)
        assert getattr(module, "attention_weights", None) is None
        # The output does not depend on the flag.
        check_close("output", output, with_weights(*inputs, lens), "float64", scale=1.0,
                    tolerance=1e-12)
        assert with_weights.attention_weights is not None


# ---- qkv.torch.MultiHeadAttention -----------------------------------------------------

def book_and_qkv_mha(s, dtype, dropout=0.5):
    """The book's MultiHeadAttention around the book's attention, and
    qkv.torch.MultiHeadAttention loaded from its state_dict."""
    sizes = (s["query_size"], s["key_size"], s["value_size"], s["num_hiddens"], s["heads"])
    book = BookMultiHeadAttention(BookDotProductAttention(dropout), *sizes).to(dtype)
    ours = qkv.torch.MultiHeadAttention(s["num_hiddens"], s["heads"], dropout).to(dtype)
    ours.load_state_dict(book.state_dict())
    return book, ours


def mha_inputs(rng, s, dtype):
    return [randn(rng, (s["B"], s["Nq"], s["query_size"]), dtype),
            randn(rng, (s["B"], s["Nk"], s["key_size"]), dtype),
            randn(rng, (s["B"], s["Nk"], s["value_size"]), dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lens_kind", [None, "B", "BNq"])
def test_multi_head_module_loads_the_books_state_dict(rng, lens_kind, dtype):
    for _ in range(10):
        s = mha_shapes(rng)
        book, ours = book_and_qkv_mha(s, dtype)
        book.eval()
        ours.eval()
        assert list(ours.state_dict()) == list(book.state_dict()) == [
            "W_q.weight", "W_k.weight", "W_v.weight", "W_o.weight"]
        lens = lens_tensor(rng, lens_kind, s["B"], s["Nq"], s["Nk"], low=1)
        compare(book, ours, mha_inputs(rng, s, dtype), lens, rng, dtype)
        # The book's attention_weights shape, (B * heads, Nq, Nk), and values.
        got = ours.attention.attention_weights
        want = book.attention.attention_weights
        assert got.shape == want.shape
        check_close("output", got, want, dtype, scale=1.0, tolerance=TOL[dtype])


def test_multi_head_module_with_dropout_is_the_folded_heads_bit_for_bit(rng):
    """In training mode with the same torch seed, qkv's module and the book's
    MultiHeadAttention around qkv.torch.DotProductAttention (heads folded into
    the batch: the same dropout mask, (seed, b H + h, i, j)) agree exactly on
    the attention's output, the heads joined, that W_o reads. W_o itself is
    torch's Linear, which reads the book's joined heads through a transposed
    view and qkv's as contiguous memory: OpenBLAS's AVX kernels (the core type
    qkv picks, or OPENBLAS_CORETYPE=Haswell) then round some outputs
    differently for the same values (seed 4085703734: inputs equal bit for
    bit, outputs 3e-8 apart), so the module outputs are held to float32
    rounding instead."""
    s = mha_shapes(rng)
    sizes = (s["query_size"], s["key_size"], s["value_size"], s["num_hiddens"], s["heads"])
    folded = BookMultiHeadAttention(qkv.torch.DotProductAttention(0.4), *sizes).train()
    ours = qkv.torch.MultiHeadAttention(s["num_hiddens"], s["heads"], 0.4).train()
    ours.load_state_dict(folded.state_dict())
    inputs = mha_inputs(rng, s, torch.float32)
    lens = lens_tensor(rng, "B", s["B"], s["Nq"], s["Nk"], low=1)
    joined = {}
    for name, module in (("folded", folded), ("ours", ours)):
        module.W_o.register_forward_hook(
            lambda _, args, __, name=name: joined.__setitem__(name, args[0].detach().clone()))
    torch.manual_seed(7)
    want = folded(*inputs, lens)
    torch.manual_seed(7)
    got = ours(*inputs, lens)
    assert torch.equal(joined["ours"], joined["folded"])
    torch.testing.assert_close(got, want, rtol=4 * 2.0**-24 * s["num_hiddens"], atol=1e-7)


def test_multi_head_module_grouped_query_heads(rng):
    """num_kv_heads < num_heads against the same model in torch's formulas:
    key and value heads repeat_interleave'd to the query heads."""
    dtype = torch.float64
    for heads, kv_heads in ((4, 2), (6, 1), (8, 4)):
        B, Nq, Nk, d = 2, 5, 7, 3
        ours = qkv.torch.MultiHeadAttention(heads * d, heads, 0.0, num_kv_heads=kv_heads,
                                            bias=True).to(dtype).eval()
        X, Y = randn(rng, (B, Nq, 6), dtype), randn(rng, (B, Nk, 5), dtype)
        got = ours(X, Y, Y, torch.tensor([3, 7]))
        assert ours.W_k.weight.shape == (kv_heads * d, 5)
        q = ours.W_q(X).reshape(B, Nq, heads, d).transpose(1, 2)
        k, v = (W(Y).reshape(B, Nk, kv_heads, d).transpose(1, 2)
                .repeat_interleave(heads // kv_heads, dim=1) for W in (ours.W_k, ours.W_v))
        scores = q @ k.transpose(-1, -2) / d ** 0.5
        keep = torch.arange(Nk)[None, None, None, :] < torch.tensor([3, 7])[:, None, None, None]
        attn = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v
        want = ours.W_o(attn.transpose(1, 2).reshape(B, Nq, -1))
        check_close("output", got, want, dtype, scale=1.0, tolerance=TOL[dtype],
                    desc=f"H {heads} Hkv {kv_heads}")
        g = randn(rng, got.shape, dtype)
        grads = torch.autograd.grad(got, list(ours.parameters()), g)
        want_grads = torch.autograd.grad(want, list(ours.parameters()), g)
        for a, b in zip(grads, want_grads):
            check_close("gradient", a, b, dtype, scale=1.0, tolerance=TOL[dtype],
                        desc=f"H {heads} Hkv {kv_heads}")


def test_heads_output_concatenates_without_a_copy(rng):
    """The 4-D output is the (B, H, Nq, Dv) view of (B, Nq, H, Dv) memory, so
    joining the heads for W_o is a view."""
    q, k, v = (randn(rng, (2, 4, n, 8), torch.float32) for n in (5, 7, 7))
    out = qkv.torch.scaled_dot_product_attention(q, k, v)
    assert out.shape == (2, 4, 5, 8)
    joined = out.transpose(1, 2).reshape(2, 5, 32)
    assert out.transpose(1, 2).is_contiguous()
    assert joined.data_ptr() == out.data_ptr()


def test_multi_head_module_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="num_hiddens = 10 is not a multiple of num_heads = 4"):
        qkv.torch.MultiHeadAttention(10, 4, 0.0)
    with pytest.raises(ValueError, match="num_heads = 4 is not a multiple of num_kv_heads = 3"):
        qkv.torch.MultiHeadAttention(12, 4, 0.0, num_kv_heads=3)
