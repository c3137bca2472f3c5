"""qkv.torch's errors (no CUDA needed): tensors off the CPU ('meta' device),
dtypes qkv does not compute in, mixed dtypes, unsupported torch arguments,
dropout_p outside [0, 1], shapes that do not fit (the message holds them) and
non-integer valid_lens; each with its exception type and a message that says
what is wrong.
"""

import re

import pytest
import torch

import qkv
import qkv.torch


def sdpa(q, k, v, **kw):
    return qkv.torch.scaled_dot_product_attention(q, k, v, **kw)


def additive(q, k, v, W_q, W_k, w_v, lens=None, **kw):
    return qkv.torch.additive_attention(q, k, v, W_q, W_k, w_v, lens, **kw)


def good_args(op, dtype=torch.float32, device="cpu"):
    """Arguments that work, as (name, tensor) pairs (names as the messages use them)."""
    make = lambda *shape: torch.ones(shape, dtype=dtype, device=device)  # noqa: E731
    if op == "masked_softmax":
        return [("X", make(2, 3, 4))]
    if op == "sdpa":
        return [("query", make(2, 3, 4)), ("key", make(2, 5, 4)), ("value", make(2, 5, 6))]
    return [("queries", make(2, 3, 4)), ("keys", make(2, 5, 2)), ("values", make(2, 5, 6)),
            ("W_q", make(7, 4)), ("W_k", make(7, 2)), ("w_v", make(1, 7))]


CALLS = {
    "masked_softmax": lambda X, lens=None: qkv.torch.masked_softmax(X, lens),
    "sdpa": lambda q, k, v, lens=None: sdpa(q, k, v, valid_lens=lens),
    "additive": lambda *a, lens=None: additive(*a, lens),
    "DotProductAttention": lambda q, k, v, lens=None: qkv.torch.DotProductAttention(0.1)(
        q, k, v, lens),
}
OPS = ["masked_softmax", "sdpa", "additive"]


def replace(args, index, tensor):
    return [tensor if i == index else t for i, (_, t) in enumerate(args)]


@pytest.mark.parametrize("op", OPS)
def test_a_tensor_on_another_device_is_a_value_error_naming_the_cpu(op):
    args = good_args(op)
    CALLS[op](*[t for _, t in args])  # these arguments work on the CPU
    for index, (name, t) in enumerate(args):
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        with pytest.raises(ValueError, match="CPU") as info:
            CALLS[op](*replace(args, index, meta))
        assert name in str(info.value) and "meta" in str(info.value)
    with pytest.raises(ValueError, match="CPU") as info:
        CALLS[op](*[t for _, t in args], lens=torch.ones(2, dtype=torch.int64, device="meta"))
    assert "valid_lens" in str(info.value)


def test_modules_on_another_device():
    args = [t for _, t in good_args("sdpa", device="meta")]
    with pytest.raises(ValueError, match="CPU"):
        qkv.torch.DotProductAttention(0.1)(*args)
    module = qkv.torch.AdditiveAttention(2, 4, 7, 0.1)
    q, k, v = (t for _, t in good_args("additive", device="meta")[:3])
    with pytest.raises(ValueError, match="CPU"):
        module(q, k, v, None)
    with pytest.raises(ValueError, match="CPU"):
        module.to("meta")(q, k, v, None)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
@pytest.mark.parametrize("op", OPS)
def test_dtypes_qkv_does_not_compute_in_are_type_errors(op, dtype):
    args = good_args(op, dtype)
    with pytest.raises(TypeError) as info:
        CALLS[op](*[t for _, t in args])
    message = str(info.value)
    assert args[0][0] in message and str(dtype).removeprefix("torch.") in message
    assert "float32" in message  # says what it takes


@pytest.mark.parametrize("op", ["masked_softmax", "additive"])
def test_bf16_only_for_scaled_dot_product_attention(op):
    with pytest.raises(TypeError, match="bfloat16"):
        CALLS[op](*[t for _, t in good_args(op, torch.bfloat16)])
    sdpa(*[t for _, t in good_args("sdpa", torch.bfloat16)])


@pytest.mark.parametrize("op", ["sdpa", "additive"])
def test_mixed_dtypes_are_type_errors(op):
    args = good_args(op)
    for index, (name, t) in enumerate(args[1:], start=1):
        for other in (torch.float64, torch.bfloat16):
            with pytest.raises(TypeError) as info:
                CALLS[op](*replace(args, index, t.to(other)))
            assert name in str(info.value)


def test_attn_mask_errors():
    q, k, v = (t for _, t in good_args("sdpa"))
    with pytest.raises(qkv.Error, match=re.escape("attn_mask has shape [4, 5], which does "
                                                  "not broadcast to the scores")):
        sdpa(q, k, v, attn_mask=torch.zeros(4, 5))
    with pytest.raises(TypeError, match="attn_mask has dtype int64; expected bool or a float"):
        sdpa(q, k, v, attn_mask=torch.ones(3, 5, dtype=torch.int64))
    with pytest.raises(TypeError, match="attn_mask is a list"):
        sdpa(q, k, v, attn_mask=[[True]])
    with pytest.raises(qkv.Error, match=re.escape("attn_mask has shape [4, 5], which does not "
                                                  "broadcast to the scores")):
        sdpa(q, k, v, attn_mask=torch.ones(4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask takes inputs of rank 2 to 4"):
        sdpa(*(t[None, None] for t in (q, k, v)), attn_mask=torch.ones(3, 5, dtype=torch.bool))


@pytest.mark.parametrize("p", [1.5, -0.1, float("nan"), float("inf")])
@pytest.mark.parametrize("op", ["sdpa", "additive"])
def test_dropout_outside_0_1_is_a_value_error(op, p):
    args = [t for _, t in good_args(op)]
    call = sdpa if op == "sdpa" else additive
    with pytest.raises(ValueError, match="dropout"):
        call(*args, dropout_p=p)


def _shapes_in(message, *tensors):
    for t in tensors:
        assert str(list(t.shape)) in message, f"{list(t.shape)} not in {message!r}"


def test_bad_shapes_are_value_errors_holding_the_shapes():
    q, k, v = (t for _, t in good_args("sdpa"))
    bad = [
        (q, torch.ones(2, 5, 3), v),          # D differs
        (q, k, torch.ones(2, 4, 6)),          # Nk differs
        (q, k, torch.ones(3, 5, 6)),          # batch differs
        (q, torch.ones(5, 4), torch.ones(5, 6)),  # ranks differ
        (torch.ones(4), torch.ones(4), torch.ones(4)),  # rank 1
    ]
    for args in bad:
        with pytest.raises(ValueError) as info:
            sdpa(*args)
        message = str(info.value)
        assert "scaled_dot_product_attention" in message
        # The message names the shapes of the arguments that disagree.
        shapes = [list(t.shape) for t in args]
        assert sum(str(s) in message for s in shapes) >= 2, message
    # From the kernels: qkv.Error, a ValueError.
    with pytest.raises(qkv.Error) as info:
        sdpa(q, torch.ones(2, 5, 3), v)
    _shapes_in(str(info.value), q, torch.ones(2, 5, 3))
    A = [t for _, t in good_args("additive")]
    for index, shape in ((3, (7, 5)), (4, (7, 3)), (5, (1, 6)), (2, (2, 4, 6))):
        args = list(A)
        args[index] = torch.ones(shape)
        with pytest.raises(qkv.Error) as info:
            additive(*args)
        assert isinstance(info.value, ValueError)
        assert str(list(shape)) in str(info.value), str(info.value)
    with pytest.raises(ValueError) as info:
        qkv.torch.masked_softmax(torch.ones(2, 2, 3, 4))
    _shapes_in(str(info.value), torch.ones(2, 2, 3, 4))


@pytest.mark.parametrize("op", OPS + ["DotProductAttention"])
def test_valid_lens_that_do_not_fit(op):
    args = [t for _, t in good_args(op if op != "DotProductAttention" else "sdpa")]
    call = CALLS[op]
    scores_shape = "[2, 3, 5]" if op != "masked_softmax" else "[2, 3, 4]"
    nk = 5 if op != "masked_softmax" else 4
    with pytest.raises(qkv.Error) as info:
        call(*args, lens=torch.tensor([1, 2, 3]))
    assert "[3]" in str(info.value) and scores_shape in str(info.value)
    with pytest.raises(qkv.Error) as info:
        call(*args, lens=torch.tensor([1, nk + 1]))
    assert re.search(rf"\b{nk + 1}\b", str(info.value)) and "valid_lens" in str(info.value)
    with pytest.raises(qkv.Error):
        call(*args, lens=torch.tensor([1, -1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
@pytest.mark.parametrize("op", OPS + ["DotProductAttention"])
def test_valid_lens_not_integers_are_type_errors(op, dtype):
    args = [t for _, t in good_args(op if op != "DotProductAttention" else "sdpa")]
    with pytest.raises(TypeError, match="valid_lens") as info:
        CALLS[op](*args, lens=torch.tensor([1, 2]).to(dtype))
    assert str(dtype).removeprefix("torch.") in str(info.value)


def test_5d_inputs_with_valid_lens_are_a_value_error():
    q, k, v = (torch.ones(2, 1, 3, 4, 5) for _ in range(3))
    with pytest.raises(ValueError, match=re.escape("valid_lens takes inputs of rank 2 to 4")):
        sdpa(q, k, v, valid_lens=torch.tensor([1, 2]))


def test_different_heads_need_enable_gqa():
    q, k = torch.ones(2, 4, 3, 5), torch.ones(2, 2, 6, 5)
    with pytest.raises(ValueError, match=re.escape("query has 4 heads but key has 2 (shapes "
                                                   "[2, 4, 3, 5], [2, 2, 6, 5]); pass "
                                                   "enable_gqa=True")):
        sdpa(q, k, k)
    with pytest.raises(qkv.Error, match=re.escape("queries has H = 4 heads, not a multiple of "
                                                  "the Hkv = 3 heads")):
        sdpa(q, torch.ones(2, 3, 6, 5), torch.ones(2, 3, 6, 5), enable_gqa=True)


def test_not_a_tensor_is_a_type_error():
    q, k, v = (t for _, t in good_args("sdpa"))
    with pytest.raises(TypeError, match="query"):
        sdpa(q.numpy(), k, v)
    with pytest.raises(TypeError, match="X"):
        qkv.torch.masked_softmax([[1.0, 2.0]])


@pytest.mark.parametrize("op", ["masked_softmax", "sdpa", "additive"])
def test_a_double_backward_is_refused_not_wrong(op):
    """A gradient penalty (grad with create_graph=True, then backward through
    it) dropped the penalty's term: q.grad 1.77 off, no error. It is a
    RuntimeError now; a first-order backward still works."""
    torch.manual_seed(0)
    args = [(name, torch.randn(t.shape, dtype=torch.float64, requires_grad=True))
            for name, t in good_args(op)]
    tensors = [t for _, t in args]
    out = CALLS[op](*tensors)
    loss = (out * out).sum()
    with pytest.raises(RuntimeError, match=re.escape(
            "qkv.torch: a double backward (create_graph=True, e.g. a gradient penalty) "
            "is not supported")):
        torch.autograd.grad(loss, tensors[0], create_graph=True)
    (grad,) = torch.autograd.grad(CALLS[op](*tensors).square().sum(), tensors[0])
    assert grad.shape == tensors[0].shape and torch.isfinite(grad).all()


def test_torch_jit_trace_and_script_of_the_modules_are_refused_by_name():
    """torch.jit.trace recorded qkv's result as a constant: a traced
    scaled_dot_product_attention returned uninitialised memory for new inputs
    (errors near 3e32), a traced DotProductAttention the example's output,
    with only torch's generic TracerWarning; torch.jit.script of the modules
    failed with the compiler's message about qkv's internals. Both are
    refused by name, also for a model that holds qkv's module."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    W_q, W_k, w_v = torch.randn(7, 4), torch.randn(7, 4), torch.randn(1, 7)
    for name, f, args in (
            ("scaled_dot_product_attention", qkv.torch.scaled_dot_product_attention, (q, k, v)),
            ("masked_softmax", qkv.torch.masked_softmax, (q,)),
            ("additive_attention", lambda *a: qkv.torch.additive_attention(*a, W_q, W_k, w_v),
             (q, k, v)),
            ("scaled_dot_product_attention", qkv.torch.DotProductAttention(0.0).eval(),
             (q, k, v))):
        for requires_grad in (False, True):
            inputs = tuple(t.clone().requires_grad_(requires_grad) for t in args)
            with pytest.raises(RuntimeError, match=re.escape(
                    f"qkv.torch.{name}: torch.jit.trace is not supported")):
                torch.jit.trace(f, inputs, check_trace=False)
    for module in (qkv.torch.DotProductAttention(0.1),
                   qkv.torch.AdditiveAttention(4, 4, 7, 0.1),
                   qkv.torch.MultiHeadAttention(8, 2, 0.1),
                   torch.nn.Sequential(torch.nn.Identity(), qkv.torch.DotProductAttention(0.1))):
        inner = module[1] if isinstance(module, torch.nn.Sequential) else module
        with pytest.raises(RuntimeError, match=re.escape(
                f"qkv.torch.{type(inner).__name__}: torch.jit.script is not supported")):
            torch.jit.script(module)
    # Eager calls are untouched.
    assert qkv.torch.DotProductAttention(0.0).eval()(q, k, v).shape == (2, 3, 6)


def test_torch_jit_script_of_code_calling_the_functions_is_refused_by_name():
    """torch.jit.script of a user's function or module that calls one of
    qkv.torch's functions failed with TorchScript's compiler message about
    qkv's own code ("Compiled functions can't take variable number of
    arguments or use keyword-only arguments with defaults", pointing into
    qkv/torch.py). Refused by name instead; eager calls still work."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    W_q, W_k, w_v, W = torch.randn(7, 4), torch.randn(7, 4), torch.randn(1, 7), torch.randn(4, 4)

    def softmax_user(x):
        return qkv.torch.masked_softmax(x) * 2

    def sdpa_user(a, b, c):
        return qkv.torch.scaled_dot_product_attention(a, b, c) + 1

    def additive_user(a, b, c):
        return qkv.torch.additive_attention(a, b, c, W_q, W_k, w_v)

    def bilinear_user(a, b, c):
        return qkv.torch.bilinear_attention(a, b, c, W)

    def distance_user(a, b, c):
        return qkv.torch.distance_attention(a, b, c)

    class Model(torch.nn.Module):
        def forward(self, a, b, c):
            return qkv.torch.scaled_dot_product_attention(a, b, c, is_causal=True)

    for name, user, args in (("masked_softmax", softmax_user, (q,)),
                             ("scaled_dot_product_attention", sdpa_user, (q, k, v)),
                             ("additive_attention", additive_user, (q, k, v)),
                             ("bilinear_attention", bilinear_user, (q, k, v)),
                             ("distance_attention", distance_user, (q, k, v)),
                             ("scaled_dot_product_attention", Model(), (q, k, v))):
        with pytest.raises(RuntimeError, match=re.escape(
                f"qkv.torch.{name}: torch.jit.script is not supported: qkv's kernels run "
                "outside TorchScript; call it eagerly")):
            torch.jit.script(user)
        assert torch.isfinite(user(*args)).all()
