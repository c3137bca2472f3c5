"""qkv.torch: qkv's fused attention kernels for PyTorch.

Autograd functions whose forward and backward run qkv's kernels (no (B, Nq,
Nk) buffer in either, dropout replayed in the backward from its seed), and
d2l's attention modules on them:

    masked_softmax(X, valid_lens=None)
    scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 valid_lens=None, seed=None, window_size=None, softcap=0.0,
                                 alibi_slopes=None, causal=None, key_mask=None,
                                 return_lse=False)
    additive_attention(queries, keys, values, W_q, W_k, w_v, valid_lens=None, *,
                       dropout_p=0.0, seed=None)
    bilinear_attention(queries, keys, values, W, valid_lens=None, *, dropout_p=0.0, seed=None,
                       causal=None, return_weights=False)
    distance_attention(queries, keys, values, valid_lens=None, *, scale=None, dropout_p=0.0,
                       seed=None, causal=None, return_weights=False)
    DotProductAttention(dropout), AdditiveAttention(key_size, query_size, num_hiddens, dropout)
    MultiHeadAttention(num_hiddens, num_heads, dropout, bias=False, num_kv_heads=None)
    MultiheadAttention(embed_dim, num_heads, ...): torch.nn.MultiheadAttention's

CPU tensors, float32 and float64 (and torch.bfloat16 for scaled dot-product
attention); float16 computes in float32 and returns float16. Tensors reach
the kernels as views of their memory; results are new tensors. Not under
torch.func transforms (vmap, grad): a clear RuntimeError. docs/python.md
maps this module to the book's code.
"""

import functools
import math
import numbers
import warnings

import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable

from . import _qkv


def _first_order_only(backward):
    """once_differentiable, and a RuntimeError for a double backward.

    With create_graph=True (a gradient penalty: grad of the loss, then
    backward through it) torch runs backward in grad mode, and
    once_differentiable hands back gradients without a graph: the penalty's
    own term was dropped and q.grad came out 1.77 off, silently. qkv's
    backward kernels have no backward of their own, so it is refused.
    """
    first_order = once_differentiable(backward)

    @functools.wraps(backward)
    def checked(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "qkv.torch: a double backward (create_graph=True, e.g. a gradient penalty) "
                "is not supported: qkv's backward has no backward of its own; compute such "
                "terms with torch's own attention, or differentiate once")
        return first_order(ctx, *grads)

    return checked

__all__ = [
    "AdditiveAttention",
    "DotProductAttention",
    "MultiHeadAttention",
    "MultiheadAttention",
    "additive_attention",
    "bilinear_attention",
    "distance_attention",
    "masked_softmax",
    "scaled_dot_product_attention",
]

# float16 is taken and computed in float32 (_half_as_float): qkv has no
# float16 kernels, and float32 then one rounding to float16 stays within
# 2^-11 |ref| of float64 (tests/python/test_torch_expectations.py).
_FLOATS = (torch.float32, torch.float64, torch.float16)


def _not_traced(name):
    """torch.jit.trace records only torch's own operators: qkv's kernels run
    outside them, so a trace held the example's result as a constant (new
    inputs gave the example's output, or uninitialised memory) with only
    torch's generic TracerWarning. Refused instead."""
    if torch.jit.is_tracing():
        raise RuntimeError(
            f"qkv.torch.{name}: torch.jit.trace is not supported: qkv's kernels run outside "
            "torch's operators, so a trace would replay this call's result for any input; "
            "run it eagerly")


def _not_scripted(module):
    """nn.Module.__prepare_scriptable__ for qkv's modules: torch.jit.script
    of one (or of a model holding one) is refused by name, not with the
    TorchScript compiler's message about qkv's internals."""
    raise RuntimeError(
        f"qkv.torch.{type(module).__name__}: torch.jit.script is not supported for qkv's "
        "modules (their kernels run outside TorchScript); run the module eagerly")


def _not_scripted_function(function):
    """Marks one of qkv.torch's functions so that torch.jit.script of a
    function or model that calls it is refused by name: TorchScript compiles
    the Python it calls, and stopped at qkv's own code with its compiler's
    message (for scaled_dot_product_attention: "Compiled functions can't take
    variable number of arguments or use keyword-only arguments with
    defaults"). torch.jit.script raises "TorchScript error: " and this
    text for a function carrying `__script_unsupported` (torch marks its
    autocast decorator so).

    Registering the functions as torch operators (torch.library) instead
    made script and trace work, with eager's numbers and gradients, but
    Debian's torch 1.13 drops the message of any Python exception raised in
    an operator run from TorchScript: bad input gave "RuntimeError: " and no
    more. A clear refusal beats an unreadable error."""
    setattr(function, "__script_unsupported",
            f"qkv.torch.{function.__name__}: torch.jit.script is not supported: qkv's kernels "
            "run outside TorchScript; call it eagerly")
    return function


def _check(fn, name, tensor, dtypes=_FLOATS):
    """A CPU tensor of one of `dtypes`, or a clear error naming it."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{fn}: {name} is a {type(tensor).__name__}; expected a torch.Tensor")
    # A tensor of torch.func.vmap (or grad, jacrev, ...) has no memory of its
    # own: reading it failed with "Cannot access data pointer of Tensor that
    # doesn't have storage", naming neither qkv nor the op.
    if torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        raise RuntimeError(
            f"{fn}: {name} is a tensor of a torch.func transform (vmap, grad, jacrev, ...), "
            f"which qkv.torch does not support: its kernels read a tensor's memory, and such "
            f"tensors have none; fold the mapped axis into the batch axis, or loop over it")
    if not tensor.is_cpu:
        raise ValueError(f"{fn}: {name} is on {tensor.device}; qkv computes on the CPU "
                         f"(move the tensors there with .cpu())")
    if tensor.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{fn}: {name} has dtype {str(tensor.dtype).removeprefix('torch.')}; "
                        f"expected {names}")
    return tensor


def _flag(fn, name, value, hint=""):
    """A bool argument, or a TypeError naming it: truthiness would take a
    string ('bottom-right', 'no') as True and go on silently."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{fn}: {name} is {value!r}; expected True or False{hint}")
    return bool(value)


def _real(fn, name, value):
    """A real number (a float or an int, not a bool), or a TypeError naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{fn}: {name} is {value!r}; expected a number")
    return float(value)


def _probability(fn, name, p):
    """A dropout probability in [0, 1] (TypeError for a non-number, ValueError
    outside, NaN included)."""
    p = _real(fn, name, p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{fn}: {name} = {p} is outside [0, 1]")
    return p


def _seed(fn, seed):
    """None or a whole number (the kernels check its range): a float seed was
    taken as 0 by `seed or 0` when it was 0.0, and refused otherwise."""
    if seed is not None and (isinstance(seed, (bool, np.bool_))
                             or not isinstance(seed, numbers.Integral)):
        raise TypeError(f"{fn}: seed is {seed!r}; expected None or a whole number in "
                        f"[0, 2**64)")
    return seed


def _count(fn, name, value):
    """A size of a module (features, heads): a whole number >= 1."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{fn}: {name} is {value!r}; expected a whole number >= 1")
    if value < 1:
        raise ValueError(f"{fn}: {name} = {value}; expected a whole number >= 1")
    return int(value)


def _half_as_float(tensors):
    """float16 tensors as float32 (a differentiable .float(), so gradients come
    back in float16), and whether they were float16: the result is then
    rounded back with .half()."""
    half = tensors[0].dtype == torch.float16
    return (tuple(t.float() for t in tensors) if half else tuple(tensors)), half


def _broadcast_batch(query, key, value, enable_gqa):
    """torch's rule for the batch axes of query, key and value (all but the
    last two; with enable_gqa and heads, all but the last three): broadcast,
    as expand views (stride 0, no copy; autograd sums the gradients back).
    Shapes that do not broadcast are left for the checks and their messages."""
    lead = -3 if enable_gqa and query.dim() >= 4 else -2
    try:
        shape = torch.broadcast_shapes(query.shape[:lead], key.shape[:lead], value.shape[:lead])
    except RuntimeError:
        return query, key, value
    return tuple(t if t.shape[:lead] == shape else t.expand(*shape, *t.shape[lead:])
                 for t in (query, key, value))


def _same_dtype(fn, first, tensors):
    for name, t in tensors:
        if t.dtype != first[1].dtype:
            raise TypeError(f"{fn}: {name} has dtype {str(t.dtype).removeprefix('torch.')} but "
                            f"{first[0]} has {str(first[1].dtype).removeprefix('torch.')}; "
                            f"pass all of them in one dtype")


def _array(tensor):
    """The tensor's memory as a NumPy array (no copy); bf16 as its int16 bits."""
    if tensor.requires_grad:  # detach() costs ~1 us a call: only where numpy() needs it
        tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


def _lens(fn, valid_lens):
    """valid_lens for the kernels: None, or an integer array (no copy of a CPU tensor)."""
    if valid_lens is None:
        return None
    if isinstance(valid_lens, torch.Tensor):
        if not valid_lens.is_cpu:
            raise ValueError(f"{fn}: valid_lens is on {valid_lens.device}; qkv computes on the CPU")
        if valid_lens.is_floating_point() or valid_lens.dtype == torch.bool:
            raise TypeError(f"{fn}: valid_lens has dtype "
                            f"{str(valid_lens.dtype).removeprefix('torch.')}; expected integers")
        return _array(valid_lens)
    return valid_lens


def _kept(lens):
    """The lengths (or mask) a backward will use: a copy, so that changing the
    caller's tensor between forward and backward cannot change the gradients."""
    return None if lens is None else np.array(lens)


def _attn_mask(fn, attn_mask, query):
    """attn_mask for the kernels: (mask, bias), each None or: mask a bool
    array (no copy of a CPU tensor; True = takes part), bias a float tensor
    in the type the kernels compute in (float64 for float64 queries, else
    float32; converted by a differentiable .to, so its gradient reaches the
    caller's tensor in its own dtype)."""
    if attn_mask is None:
        return None, None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"{fn}: attn_mask is a {type(attn_mask).__name__}; expected a "
                        f"torch.Tensor")
    if not attn_mask.is_cpu:
        raise ValueError(f"{fn}: attn_mask is on {attn_mask.device}; qkv computes on the CPU")
    if attn_mask.is_floating_point():
        compute = torch.float64 if query.dtype == torch.float64 else torch.float32
        return None, attn_mask.to(compute)
    if attn_mask.dtype != torch.bool:
        raise TypeError(f"{fn}: attn_mask has dtype "
                        f"{str(attn_mask.dtype).removeprefix('torch.')}; expected bool or "
                        f"a float dtype (an additive bias)")
    return attn_mask.numpy(), None


def _check_attn_mask_shape(fn, attn_mask, query, key):
    """torch's broadcasting rule for attn_mask, checked here so that the
    message names attn_mask (the kernels' own check names options.mask or
    options.bias, the C++ names): against the scores (..., Nq, Nk), aligned
    from the right, each axis 1 or the scores' size."""
    scores = [*query.shape[:-1], key.shape[-2]]
    shape = list(attn_mask.shape)
    if len(shape) > len(scores) or any(m not in (1, s) for m, s in zip(shape[::-1], scores[::-1])):
        raise _qkv.Error(f"{fn}: attn_mask has shape {shape}, which does not broadcast to the "
                         f"scores {scores} (..., Nq, Nk): aligned from the right, each axis 1 "
                         f"or the scores' size")


def _key_mask(fn, key_mask, query, key):
    """key_mask for the kernels: None, or a bool array (no copy of a CPU bool
    tensor; uint8/int8: nonzero = takes part, as the NumPy API's), (B, Nk)
    for inputs of rank 3 and 4 (shared by the heads), (Nk) for 2-D ones;
    its shape is checked here, to name it as the caller spelled it."""
    if key_mask is None:
        return None
    if not isinstance(key_mask, torch.Tensor):
        raise TypeError(f"{fn}: key_mask is a {type(key_mask).__name__}; expected a bool "
                        f"torch.Tensor")
    if not key_mask.is_cpu:
        raise ValueError(f"{fn}: key_mask is on {key_mask.device}; qkv computes on the CPU")
    if key_mask.dtype not in (torch.bool, torch.uint8, torch.int8):
        raise TypeError(f"{fn}: key_mask has dtype {str(key_mask.dtype).removeprefix('torch.')}"
                        f"; expected bool (or uint8/int8: nonzero = takes part)")
    if query.dim() > 4:
        raise ValueError(f"{fn}: key_mask takes inputs of rank 2 to 4; got query "
                         f"{list(query.shape)}")
    expected = [key.shape[-2]] if query.dim() == 2 else [query.shape[0], key.shape[-2]]
    if list(key_mask.shape) != expected:
        axes = "(Nk)" if query.dim() == 2 else "(B, Nk)"
        raise _qkv.Error(f"{fn}: key_mask has shape {list(key_mask.shape)}; expected "
                         f"{expected} {axes}: key j of batch element b takes part")
    return _array(key_mask)


def _draw_seed():
    """A dropout seed from torch's default generator: torch.manual_seed makes runs repeatable."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ---- masked softmax -------------------------------------------------------------

class _MaskedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, lens):
        _not_traced("masked_softmax")
        weights = torch.from_numpy(_qkv.masked_softmax(_array(X), lens))
        ctx.lens = _kept(lens)
        ctx.save_for_backward(weights)
        return weights

    @staticmethod
    @_first_order_only
    def backward(ctx, d_weights):
        (weights,) = ctx.saved_tensors
        d_scores = _qkv.masked_softmax_backward(_array(weights), _array(d_weights), ctx.lens)
        return torch.from_numpy(d_scores), None


@_not_scripted_function
def masked_softmax(X, valid_lens=None):
    """Softmax over the last axis with the keys past each row's valid length masked
    exactly (d2l's masked_softmax, without its -1e6 sentinel: a row with length 0
    is all zeros). Differentiable in X.

    Arguments:
        X: the scores, (B, Nq, Nk) or (Nq, Nk), float32, float64 or float16
            (computed in float32), CPU.
        valid_lens: None, (B) or (B, Nq) integers (tensor, array or list).

    Returns:
        The weights, a new tensor of X's shape and dtype.

    Raises:
        TypeError: X not a float32/float64 tensor, valid_lens not integers.
        ValueError: a tensor not on the CPU; qkv.Error (a ValueError) for
            shapes that do not fit or lengths outside [0, Nk].

    >>> import torch, qkv.torch
    >>> qkv.torch.masked_softmax(torch.zeros(1, 2, 4), torch.tensor([3]))
    tensor([[[0.3333, 0.3333, 0.3333, 0.0000],
             [0.3333, 0.3333, 0.3333, 0.0000]]])
    """
    _check("masked_softmax", "X", X)
    (X,), half = _half_as_float((X,))
    weights = _MaskedSoftmax.apply(X, _lens("masked_softmax", valid_lens))
    return weights.half() if half else weights


# ---- scaled dot-product attention ------------------------------------------------

def _sdpa_forward(query, key, value, lens, scale, dropout_p, seed, want_weights, causal, mask,
                  bias, need_lse, scores=None, key_mask=None, need_stats=False):
    """One forward through the kernels: (result, weights or None, output, lse or
    None, softmax statistics or None (need_stats, with need_lse)); output is
    float32 for bf16 inputs (the backward takes it so), result has query's
    dtype."""
    _not_traced("scaled_dot_product_attention")
    scores = _score_options(scores)
    if query.dtype == torch.bfloat16:
        out, weights, lse, stats = _qkv._scaled_dot_product_attention_bf16(
            _array(query), _array(key), _array(value), lens, scale, dropout_p, seed,
            want_weights, need_lse, causal, mask, key_mask, scores["window"],
            None if bias is None else _array(bias), softcap=scores["softcap"],
            alibi_slopes=scores["alibi_slopes"], return_softmax_stats=need_stats)
        output = torch.from_numpy(out)
        weights = torch.from_numpy(weights).to(torch.bfloat16) if want_weights else None
        return output.to(torch.bfloat16), weights, output, lse, stats
    # Heads: the output is written as (B, Nq, H, Dv) memory and returned as its
    # (B, H, Nq, Dv) view (as torch's CPU flash attention does), so
    # output.transpose(1, 2).reshape(B, Nq, H * Dv) -- the heads concatenated
    # for an output projection -- is a view, not a copy.
    out = None
    if query.dim() == 4:
        batch, heads, nq = query.shape[:3]
        out = torch.empty((batch, nq, heads, value.shape[-1]), dtype=query.dtype).transpose(1, 2)
    parts = _qkv.scaled_dot_product_attention(
        _array(query), _array(key), _array(value), lens, scale=scale, dropout_p=dropout_p,
        seed=seed, return_weights=want_weights, return_lse=need_lse, causal=causal,
        out=None if out is None else _array(out), mask=mask, key_mask=key_mask,
        bias=None if bias is None else _array(bias), return_softmax_stats=need_stats, **scores)
    if not (want_weights or need_lse):
        output = torch.from_numpy(parts) if out is None else out
        return output, None, output, None, None
    parts = list(parts)
    first = parts.pop(0)
    output = torch.from_numpy(first) if out is None else out
    weights = torch.from_numpy(parts.pop(0)) if want_weights else None
    lse = parts.pop(0) if need_lse else None
    return output, weights, output, lse, parts.pop(0) if need_stats else None


class _Sdpa(torch.autograd.Function):
    """query (B, Nq, D), key (B, Nk, D), value (B, Nk, Dv) (or all 2-D; or heads (B, H, Nq, D),
    (B, Hkv, Nk, D), (B, Hkv, Nk, Dv)) -> (output, weights, lse); differentiable in
    query, key, value and the float bias, through the output and the lse."""

    @staticmethod
    def forward(ctx, query, key, value, lens, scale, dropout_p, seed, want_weights, causal, mask,
                bias, scores=None, key_mask=None):
        ctx.config = (_kept(lens), scale, dropout_p, seed, causal, _kept(mask),
                      _score_options(scores), _kept(key_mask))
        # The softmax's statistics too: the backward then forms the forward's
        # very weights, not exp(score - lse) (float32 gradients within 2x
        # float32 torch's error on FlashAttention's tests, 2.6x without).
        result, weights, output, lse, stats = _sdpa_forward(
            query, key, value, lens, scale, dropout_p, seed, want_weights, causal, mask, bias,
            True, scores, key_mask, need_stats=True)
        lse = torch.from_numpy(lse)
        ctx.save_for_backward(query, key, value, output, lse, torch.from_numpy(stats), bias)
        if weights is None:
            weights = query.new_empty(0)
        ctx.mark_non_differentiable(weights)
        # An output the loss does not read gets None, not a tensor of zeros:
        # the lse's gradient is only formed when something reads the lse.
        ctx.set_materialize_grads(False)
        return result, weights, lse

    @staticmethod
    @_first_order_only
    def backward(ctx, d_output, _d_weights, d_lse):
        query, key, value, output, lse, stats, bias = ctx.saved_tensors
        lens, scale, dropout_p, seed, causal, mask, scores, key_mask = ctx.config
        if d_output is None:  # only the lse is read
            d_output = torch.zeros(output.shape, dtype=output.dtype)
        d_lse = None if d_lse is None else _array(d_lse)
        bias_array = None if bias is None else _array(bias)
        bias_grad = bias is not None and ctx.needs_input_grad[10]
        if query.dtype == torch.bfloat16:
            *grads, d_bias = _qkv._scaled_dot_product_attention_bf16_backward(
                _array(query), _array(key), _array(value), _array(output), _array(lse),
                _array(d_output.float()), lens, scale, dropout_p, seed, causal, mask, key_mask,
                scores["window"], bias_array, bias_grad, softcap=scores["softcap"],
                alibi_slopes=scores["alibi_slopes"], d_lse=d_lse, softmax_stats=_array(stats))
            grads = [torch.from_numpy(g).to(torch.bfloat16) for g in grads]
        else:
            grads = _qkv.scaled_dot_product_attention_backward(
                _array(query), _array(key), _array(value), _array(output), _array(lse),
                _array(d_output), lens, scale=scale, dropout_p=dropout_p, seed=seed, causal=causal,
                mask=mask, key_mask=key_mask, bias=bias_array, bias_grad=bias_grad, d_lse=d_lse,
                softmax_stats=_array(stats), **scores)
            d_bias = grads[3] if bias_grad else None
            grads = [torch.from_numpy(g) for g in grads[:3]]
        d_bias = None if d_bias is None else torch.from_numpy(d_bias)
        return (*grads, None, None, None, None, None, None, None, d_bias, None, None)


def _score_options(scores):
    """The kernels' keyword arguments for window, softcap and ALiBi (FlashAttention's
    window_size, softcap, alibi_slopes), from _scores' dict or None."""
    return scores or {"window": None, "softcap": 0.0, "alibi_slopes": None}


def _scores(fn, window_size, softcap, alibi_slopes):
    """window_size, softcap and alibi_slopes as the kernels take them (None when
    all are unset): the window a pair of ints (-1: that side open), the slopes
    a float64 array (no gradient: FlashAttention gives none either)."""
    window = None
    if window_size is not None:
        pair = tuple(window_size) if isinstance(window_size, (tuple, list)) else ()
        if len(pair) != 2 or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool)
                                     for w in pair):
            raise TypeError(f"{fn}: window_size is {window_size!r}; expected (left, right), "
                            f"two integers (-1: no limit on that side)")
        if min(pair) < -1:
            raise ValueError(f"{fn}: window_size = {window_size!r} has a side below -1 "
                             f"(-1: no limit on that side)")
        if pair != (-1, -1):
            window = tuple(int(w) for w in pair)
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"{fn}: softcap is {softcap!r}; expected a number (0: no capping)")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"{fn}: softcap = {softcap!r}; expected a finite number >= 0 "
                         f"(0: no capping)")
    slopes = None
    if alibi_slopes is not None:
        if not (isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.is_floating_point()):
            raise TypeError(f"{fn}: alibi_slopes must be a float tensor, (H) or (B, H); got "
                            f"{type(alibi_slopes).__name__}"
                            + (f" of dtype {alibi_slopes.dtype}"
                               if isinstance(alibi_slopes, torch.Tensor) else ""))
        if alibi_slopes.device.type != "cpu":
            raise ValueError(f"{fn}: alibi_slopes is on {alibi_slopes.device}; qkv computes "
                             f"on the CPU")
        slopes = alibi_slopes.detach().to(torch.float64).contiguous().numpy()
    if window is None and softcap == 0 and slopes is None:
        return None
    return {"window": window, "softcap": float(softcap), "alibi_slopes": slopes}


def _sdpa(fn, query, key, value, valid_lens, scale, dropout_p, seed, want_weights, causal=None,
          enable_gqa=False, attn_mask=None, scores=None, key_mask=None, want_lse=False):
    """Checks, runs the kernels (through _Sdpa when a gradient is wanted);
    (output, weights or None, lse or None). 2-D and 3-D inputs go as they are (2-D is a
    batch of one); 4-D (B, H, N, D) as heads, read in place whatever their
    strides along B, H and N; more leading axes are folded into B (a copy
    where their strides do not fold)."""
    dtypes = _FLOATS + (torch.bfloat16,)
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check(fn, name, t, dtypes)
    _same_dtype(fn, ("query", query), (("key", key), ("value", value)))
    rank = query.dim()
    if rank < 2 or not rank == key.dim() == value.dim():
        raise ValueError(f"{fn}: query, key and value must have the same rank, at least 2 "
                         f"((..., Nq, D), (..., Nk, D), (..., Nk, Dv)); got shapes "
                         f"{list(query.shape)}, {list(key.shape)}, {list(value.shape)}")
    (query, key, value), half = _half_as_float((query, key, value))
    if rank >= 3:
        query, key, value = _broadcast_batch(query, key, value, enable_gqa)
    dropout_p = _probability(fn, "dropout_p", dropout_p)
    if scale is not None:
        scale = _real(fn, "scale", scale)
    seed = _seed(fn, seed)
    if rank >= 4 and query.shape[-3] != key.shape[-3] and not enable_gqa:
        raise ValueError(f"{fn}: query has {query.shape[-3]} heads but key has "
                         f"{key.shape[-3]} (shapes {list(query.shape)}, {list(key.shape)}); "
                         f"pass enable_gqa=True for grouped-query attention")
    lens = _lens(fn, valid_lens)
    mask, bias = _attn_mask(fn, attn_mask, query)
    key_mask = _key_mask(fn, key_mask, query, key)
    if dropout_p > 0 and seed is None:
        seed = _draw_seed()
    lead = None
    if rank > 4 and attn_mask is not None:
        raise ValueError(f"{fn}: attn_mask takes inputs of rank 2 to 4; got query "
                         f"{list(query.shape)}")
    if attn_mask is not None:
        _check_attn_mask_shape(fn, attn_mask, query, key)
    if rank > 4:
        lead = query.shape[:-3]
        if key.shape[:-3] != lead or value.shape[:-3] != lead:
            raise ValueError(f"{fn}: query, key and value must share their leading axes; got "
                             f"shapes {list(query.shape)}, {list(key.shape)}, "
                             f"{list(value.shape)}")
        if lens is not None:
            raise ValueError(f"{fn}: valid_lens takes inputs of rank 2 to 4, (B) or (B, Nq) "
                             f"lengths; got query {list(query.shape)}")
        batch = math.prod(lead)  # not -1: a tensor with no elements has no inferable axis
        query, key, value = (t.reshape(batch, *t.shape[-3:]) for t in (query, key, value))
    args = (query, key, value, lens, scale, dropout_p, seed or 0, want_weights, causal, mask,
            bias, scores, key_mask)
    if _needs_grad(query, key, value, *(() if bias is None else (bias,))):
        output, weights, lse = _Sdpa.apply(*args)
    else:
        output, weights, _, lse, _ = _sdpa_forward(*args[:-2], want_lse, scores, key_mask)
        lse = None if lse is None else torch.from_numpy(lse)
    if lead is not None:
        output = output.reshape(*lead, *output.shape[-3:])
        if want_weights:
            weights = weights.reshape(*lead, *weights.shape[-3:])
        if lse is not None:
            lse = lse.reshape(*lead, *lse.shape[-2:])
    if half:
        output = output.half()
        weights = weights.half() if want_weights else None
    return output, weights if want_weights else None, lse if want_lse else None


@_not_scripted_function
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 valid_lens=None, seed=None, window_size=None, softcap=0.0,
                                 alibi_slopes=None, causal=None, key_mask=None, return_lse=False):
    """softmax(Q K^T * scale) V on qkv's fused kernels, differentiable in query, key, value.

    torch 2.x's torch.nn.functional.scaled_dot_product_attention signature (a
    drop-in where Debian's torch 1.13 has none), plus d2l's valid_lens and
    the NumPy API's causal, key_mask and return_lse. Every argument is
    checked: a value of the wrong type (a string for a bool, is_causal=
    'bottom-right' included) or outside its set is refused, never taken as
    true.

    Arguments:
        query: (..., Nq, D), key: (..., Nk, D), value: (..., Nk, Dv), CPU
            tensors of one dtype: float32, float64, bfloat16 or float16
            (bf16 and float16 compute in float32 and round the result). Any strides: 4-D heads
            (B, H, N, D) are read in place, so q.view(B, N, H, D).transpose(1, 2)
            costs no copy.
        attn_mask: None, or a tensor broadcast against the scores
            (..., Nq, Nk), as torch's: bool (True = the key takes part; read
            in place, blocks it masks entirely are skipped) or float, a
            bias added to the scaled scores (ALiBi, relative positions; -inf
            leaves a key out), differentiable (its gradient is summed over
            the axes it broadcasts along). Combined with is_causal and
            valid_lens (a key takes part where all let it; torch 2 refuses
            attn_mask with is_causal); a query left with no key gives 0 and
            zero gradients, as torch 2.13 does.
        is_causal: True or False; True: query i sees keys j <= i (torch's
            top-left alignment; with Nq > Nk the later queries see every
            key), the same as causal='top-left'. Combined with valid_lens by
            taking the smaller length; key blocks no query may see are
            skipped. A query left with no key gives 0 (where the formula in
            torch's documentation gives NaN).
        dropout_p: drop probability on the weights, applied whenever > 0 (as
            in torch); kept weights scaled by 1/(1 - p).
        scale: multiplies Q K^T; default 1/sqrt(D).
        enable_gqa: grouped-query attention: key and value may have fewer
            heads Hkv (dim -3) than query's H, H a multiple of Hkv; query
            head h reads key head h // (H // Hkv), as torch's enable_gqa.
        valid_lens: d2l's lengths, (B) or (B, Nq) integers, for inputs of
            rank 2 to 4 (4-D: shared by the heads): keys j >= the length get
            weight 0 (a query with length 0 gives 0).
        seed: the dropout mask's seed; None draws one from torch's default
            generator (torch.manual_seed makes the run repeatable).
        window_size: FlashAttention's (left, right): query i sees keys j with
            i + Nk - Nq - left <= j <= i + Nk - Nq + right (aligned
            bottom-right); -1 leaves a side open, so (-1, -1) is no window.
            Combined with the other masks; inputs of rank 2 to 4.
        softcap: FlashAttention's logit capping (Gemma 2): each scaled
            score x becomes softcap * tanh(x / softcap) before attn_mask's
            bias, ALiBi and the masks; finite, >= 0; 0 caps nothing.
            Differentiable (the gradient through the tanh).
        alibi_slopes: FlashAttention's ALiBi, a float tensor (H) or (B, H)
            (H = 1 for 3-D inputs): adds -slope * |i + Nk - Nq - j| to query
            i's score of key j, fused (no (B, H, Nq, Nk) bias is formed). No
            gradient, as in FlashAttention. (With is_causal, FlashAttention
            adds slope * (j - Nk + 1) instead: the same weights and output.)
        causal: None, 'top-left' (is_causal=True) or 'bottom-right': query i
            sees keys j <= i + Nk - Nq (queries that continue a key cache:
            the last query sees every key; with Nq > Nk the first Nq - Nk
            see none and give 0), torch 2's
            torch.nn.attention.bias.causal_lower_right and the NumPy API's
            causal='bottom-right'. Not with is_causal=True.
        key_mask: None, or a bool tensor (B, Nk) ((Nk) for 2-D inputs; uint8
            or int8: nonzero) saying which keys take part (key padding),
            shared by the heads; inputs of rank 2 to 4. The NumPy API's
            key_mask. Combined with everything else.
        return_lse: also return lse (..., Nq) (query's shape without D), the
            log-sum-exp of each query's valid scaled scores (-inf for a query
            with no key), float64 for float64 inputs and float32 otherwise
            (FlashAttention's softmax_lse). Differentiable: its gradient
            (d lse / d score = the weight) flows into query, key and the
            float attn_mask, e.g. for a cross-entropy over the keys.

    Returns:
        The output (..., Nq, Dv), query's dtype; with return_lse, the pair
        (output, lse).

    Raises:
        TypeError: a dtype qkv does not compute in, or mixed dtypes; an
            argument of the wrong type (is_causal, enable_gqa, return_lse not
            a bool; causal not a string; dropout_p, scale, softcap not a
            number; seed not a whole number).
        ValueError: tensors not on the CPU, shapes that do not fit,
            dropout_p outside [0, 1], causal not one of its values, causal
            with is_causal=True (qkv.Error, a ValueError, from the kernels).

    >>> q = torch.ones(2, 1, 2); k = torch.ones(2, 10, 2)
    >>> v = torch.arange(40.0).reshape(1, 10, 4).repeat(2, 1, 1)
    >>> qkv.torch.scaled_dot_product_attention(q, k, v, valid_lens=torch.tensor([2, 6]))
    tensor([[[ 2.,  3.,  4.,  5.]],
    <BLANKLINE>
            [[10., 11., 12., 13.]]])
    """
    fn = "scaled_dot_product_attention"
    is_causal = _flag(fn, "is_causal", is_causal, " (torch's top-left causal mask; bottom-right "
                      "is causal='bottom-right')")
    enable_gqa = _flag(fn, "enable_gqa", enable_gqa)
    return_lse = _flag(fn, "return_lse", return_lse)
    if causal is not None and not isinstance(causal, str):
        raise TypeError(f"{fn}: causal is {causal!r}; expected None, 'top-left' (is_causal=True) "
                        f"or 'bottom-right'")
    if causal not in (None, "top-left", "bottom-right"):
        raise _qkv.Error(f"{fn}: causal = {causal!r} is not one of None, 'top-left', "
                         f"'bottom-right'")
    if is_causal and causal is not None:
        raise ValueError(f"{fn}: is_causal=True and causal={causal!r} both given; "
                         f"is_causal=True is causal='top-left': give one")
    scores = _scores(fn, window_size, softcap, alibi_slopes)
    output, _, lse = _sdpa(fn, query, key, value, valid_lens, scale, dropout_p, seed, False,
                           "top-left" if is_causal else causal, enable_gqa, attn_mask, scores,
                           key_mask, return_lse)
    return (output, lse) if return_lse else output


# ---- additive, bilinear and distance attention -------------------------------------

def _scored_forward(forward, tensors, lens, options, want_weights, need_lse):
    """One forward of a NumPy-level scoring function (forward(*arrays, lens,
    **options)): (output, weights or None, lse or None)."""
    _not_traced(forward.__name__)
    parts = forward(*(_array(t) for t in tensors), lens, return_weights=want_weights,
                    return_lse=need_lse, **options)
    if not (want_weights or need_lse):
        return torch.from_numpy(parts), None, None
    parts = list(parts)
    output = torch.from_numpy(parts.pop(0))
    weights = torch.from_numpy(parts.pop(0)) if want_weights else None
    return output, weights, parts.pop(0) if need_lse else None


class _Scored(torch.autograd.Function):
    """Attention by one of qkv's NumPy-level scoring functions: ops = (forward,
    backward), tensors = queries, keys, values and the parameters; the backward
    gets the tensors, output, lse and d_output, and returns one gradient per tensor."""

    @staticmethod
    def forward(ctx, ops, lens, options, want_weights, *tensors):
        ctx.config = (ops[1], _kept(lens), options)
        output, weights, lse = _scored_forward(ops[0], tensors, lens, options, want_weights, True)
        ctx.save_for_backward(*tensors, output, torch.from_numpy(lse))
        if weights is None:
            weights = tensors[0].new_empty(0)
        ctx.mark_non_differentiable(weights)
        return output, weights

    @staticmethod
    @_first_order_only
    def backward(ctx, d_output, _d_weights):
        backward, lens, options = ctx.config
        grads = backward(*(_array(t) for t in ctx.saved_tensors), _array(d_output), lens,
                         **options)
        return (None, None, None, None, *(torch.from_numpy(g) for g in grads))


def _scored(fn, ops, named, valid_lens, dropout_p, seed, options, want_weights):
    for name, t in named:
        _check(fn, name, t)
    _same_dtype(fn, named[0], named[1:])
    tensors, half = _half_as_float([t for _, t in named])
    dropout_p = _probability(fn, "dropout_p", dropout_p)
    if _seed(fn, seed) is None and dropout_p > 0:
        seed = _draw_seed()
    options = dict(options, dropout_p=dropout_p, seed=seed or 0)
    lens = _lens(fn, valid_lens)
    if _needs_grad(*tensors):
        output, weights = _Scored.apply(ops, lens, options, want_weights, *tensors)
    else:
        output, weights = _scored_forward(ops[0], tensors, lens, options, want_weights, False)[:2]
    if half:
        output = output.half()
        weights = weights.half() if want_weights else None
    return output, weights if want_weights else None


def _additive(fn, queries, keys, values, W_q, W_k, w_v, valid_lens, dropout_p, seed,
              want_weights, causal=None):
    return _scored(fn, (_qkv.additive_attention, _qkv.additive_attention_backward),
                   (("queries", queries), ("keys", keys), ("values", values), ("W_q", W_q),
                    ("W_k", W_k), ("w_v", w_v)), valid_lens, dropout_p, seed, {"causal": causal},
                   want_weights)


@_not_scripted_function
def additive_attention(queries, keys, values, W_q, W_k, w_v, valid_lens=None, *, dropout_p=0.0,
                       seed=None, causal=None, return_weights=False):
    """Additive attention, score = w_v^T tanh(W_q q + W_k k), on qkv's fused kernels;
    differentiable in the inputs and the three parameters.

    Arguments:
        queries: (B, Nq, Dq), keys: (B, Nk, Dk), values: (B, Nk, Dv) (or all
            2-D, a batch of one); W_q (H, Dq), W_k (H, Dk), w_v (1, H) or (H):
            nn.Linear weights. float32, float64 or float16 (computed in
            float32) CPU tensors, one dtype.
        valid_lens: None, (B) or (B, Nq) integers.
        dropout_p: drop probability on the weights, applied whenever > 0.
        seed: the dropout mask's seed; None draws one from torch's generator.
        causal: None, "top-left" or "bottom-right" (with valid_lens: both caps).
        return_weights: also return the weights (B, Nq, Nk) (not differentiable).

    Returns:
        The output (B, Nq, Dv), or (output, weights).

    >>> W_q, W_k, w_v = torch.randn(8, 20), torch.randn(8, 2), torch.randn(1, 8)
    >>> qkv.torch.additive_attention(torch.randn(2, 1, 20), k, v, W_q, W_k, w_v,
    ...                              torch.tensor([2, 6])).shape
    torch.Size([2, 1, 4])
    """
    return_weights = _flag("additive_attention", "return_weights", return_weights)
    output, weights = _additive("additive_attention", queries, keys, values, W_q, W_k, w_v,
                                valid_lens, dropout_p, seed, return_weights, causal)
    return (output, weights) if return_weights else output


@_not_scripted_function
def bilinear_attention(queries, keys, values, W, valid_lens=None, *, dropout_p=0.0, seed=None,
                       causal=None, return_weights=False):
    """Bilinear attention, score = q^T W k, on qkv's kernels (q W, then the fused
    dot-product kernel); differentiable in the inputs and W.

    Arguments:
        queries: (B, Nq, Dq), keys: (B, Nk, Dk), values: (B, Nk, Dv) (or all
            2-D, a batch of one); W (Dq, Dk). float32, float64 or float16
            (computed in float32) CPU tensors, one dtype.
        valid_lens: None, (B) or (B, Nq) integers.
        dropout_p: drop probability on the weights, applied whenever > 0.
        seed: the dropout mask's seed; None draws one from torch's generator.
        causal: None, "top-left" or "bottom-right".
        return_weights: also return the weights (B, Nq, Nk) (not differentiable).

    Returns:
        The output (B, Nq, Dv), or (output, weights).

    >>> W = torch.randn(20, 2)
    >>> qkv.torch.bilinear_attention(torch.randn(2, 1, 20), k, v, W, torch.tensor([2, 6])).shape
    torch.Size([2, 1, 4])
    """
    fn = "bilinear_attention"
    return_weights = _flag(fn, "return_weights", return_weights)
    output, weights = _scored(
        fn, (_qkv.bilinear_attention, _qkv.bilinear_attention_backward),
        (("queries", queries), ("keys", keys), ("values", values), ("W", W)), valid_lens,
        dropout_p, seed, {"causal": causal}, return_weights)
    return (output, weights) if return_weights else output


@_not_scripted_function
def distance_attention(queries, keys, values, valid_lens=None, *, scale=None, dropout_p=0.0,
                       seed=None, causal=None, return_weights=False):
    """Distance attention, score = -scale/2 |q - k|^2 (the Gaussian kernel), on
    qkv's fused kernels (centred, so keys far from the origin lose no
    accuracy); differentiable in the inputs.

    Arguments:
        queries: (B, Nq, D), keys: (B, Nk, D), values: (B, Nk, Dv) (or all
            2-D, a batch of one). float32, float64 or float16 (computed in
            float32) CPU tensors, one dtype.
        valid_lens: None, (B) or (B, Nq) integers.
        scale: > 0; None means 1.
        dropout_p, seed, causal, return_weights: as in bilinear_attention.

    Returns:
        The output (B, Nq, Dv), or (output, weights).

    >>> qkv.torch.distance_attention(torch.randn(2, 1, 2), k, v, torch.tensor([2, 6])).shape
    torch.Size([2, 1, 4])
    """
    fn = "distance_attention"
    return_weights = _flag(fn, "return_weights", return_weights)
    output, weights = _scored(
        fn, (_qkv.distance_attention, _qkv.distance_attention_backward),
        (("queries", queries), ("keys", keys), ("values", values)), valid_lens, dropout_p, seed,
        {"causal": causal, "scale": None if scale is None else _real(fn, "scale", scale)},
        return_weights)
    return (output, weights) if return_weights else output


# ---- d2l's modules ---------------------------------------------------------------------

class DotProductAttention(nn.Module):
    """d2l's DotProductAttention on qkv's fused kernels: same constructor, forward,
    attention_weights and (empty) state_dict.

    Dropout follows the module's training mode, with a fresh mask per forward
    drawn from torch's default generator. attention_weights (the weights
    before dropout, detached) is set by each forward; keep_attention_weights=False
    skips computing it, for speed.

    >>> attention = qkv.torch.DotProductAttention(dropout=0.5)
    >>> attention.eval()
    DotProductAttention(
      (dropout): Dropout(p=0.5, inplace=False)
    )
    >>> attention(q, k, v, torch.tensor([2, 6]))
    tensor([[[ 2.,  3.,  4.,  5.]],
    <BLANKLINE>
            [[10., 11., 12., 13.]]])
    """

    def __init__(self, dropout, keep_attention_weights=True, **kwargs):
        super().__init__(**kwargs)
        fn = "DotProductAttention"
        # The probability lives where d2l keeps it (module.dropout.p); qkv's
        # kernel applies it.
        self.dropout = nn.Dropout(_probability(fn, "dropout", dropout))
        self.keep_attention_weights = _flag(fn, "keep_attention_weights", keep_attention_weights)
        self.attention_weights = None

    __prepare_scriptable__ = _not_scripted

    def forward(self, queries, keys, values, valid_lens=None):
        """queries (B, Nq, D), keys (B, Nk, D), values (B, Nk, Dv), valid_lens None,
        (B) or (B, Nq) -> (B, Nq, Dv); sets attention_weights (B, Nq, Nk)."""
        p = self.dropout.p if self.training else 0.0
        output, weights, _ = _sdpa("DotProductAttention", queries, keys, values, valid_lens,
                                   None, p, None, self.keep_attention_weights)
        self.attention_weights = weights
        return output


class AdditiveAttention(nn.Module):
    """d2l's AdditiveAttention on qkv's fused kernels: the same constructor and
    parameters (W_k, W_q, w_v as nn.Linear without bias), so a state_dict of the
    book's module loads into this one and gives the same outputs and gradients.

    >>> attention = qkv.torch.AdditiveAttention(key_size=2, query_size=20, num_hiddens=8,
    ...                                         dropout=0.1)
    >>> attention.eval()(torch.randn(2, 1, 20), k, v, torch.tensor([2, 6])).shape
    torch.Size([2, 1, 4])
    """

    def __init__(self, key_size, query_size, num_hiddens, dropout, keep_attention_weights=True,
                 **kwargs):
        super().__init__(**kwargs)
        fn = "AdditiveAttention"
        key_size, query_size, num_hiddens = (_count(fn, name, value) for name, value in (
            ("key_size", key_size), ("query_size", query_size), ("num_hiddens", num_hiddens)))
        self.W_k = nn.Linear(key_size, num_hiddens, bias=False)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=False)
        self.w_v = nn.Linear(num_hiddens, 1, bias=False)
        self.dropout = nn.Dropout(_probability(fn, "dropout", dropout))
        self.keep_attention_weights = _flag(fn, "keep_attention_weights", keep_attention_weights)
        self.attention_weights = None

    __prepare_scriptable__ = _not_scripted

    def forward(self, queries, keys, values, valid_lens=None):
        """queries (B, Nq, query_size), keys (B, Nk, key_size), values (B, Nk, Dv),
        valid_lens None, (B) or (B, Nq) -> (B, Nq, Dv); sets attention_weights."""
        p = self.dropout.p if self.training else 0.0
        output, weights = _additive("AdditiveAttention", queries, keys, values, self.W_q.weight,
                                    self.W_k.weight, self.w_v.weight, valid_lens, p, None,
                                    self.keep_attention_weights)
        self.attention_weights = weights
        return output


class MultiHeadAttention(nn.Module):
    """d2l's MultiHeadAttention (section 11.5) on qkv's fused kernels, with the
    heads read in place: no transpose_qkv copies of Q, K and V, no
    transpose_output copy of the output.

    The same constructor (num_hiddens, num_heads, dropout, bias=False) and
    parameters (W_q, W_k, W_v, W_o: nn.LazyLinear, as the book's), so a
    state_dict of the book's module loads into this one and gives the same
    outputs and gradients. num_kv_heads (default num_heads) gives W_k and W_v
    num_kv_heads heads of num_hiddens / num_heads features each: grouped-query
    attention, num_heads a multiple of num_kv_heads (1: multi-query attention).
    valid_lens (B) or (B, Nq) apply to every head, as the book's
    repeat_interleave does; is_causal=True in forward masks keys past each
    query's position. attention.attention_weights is (B * num_heads, Nq, Nk),
    the book's shape.

    >>> mha = qkv.torch.MultiHeadAttention(num_hiddens=100, num_heads=5, dropout=0.5)
    >>> mha.eval()(torch.ones(2, 4, 100), torch.ones(2, 6, 100), torch.ones(2, 6, 100),
    ...            torch.tensor([3, 2])).shape
    torch.Size([2, 4, 100])
    """

    def __init__(self, num_hiddens, num_heads, dropout, bias=False, num_kv_heads=None,
                 keep_attention_weights=True, **kwargs):
        super().__init__(**kwargs)
        fn = "MultiHeadAttention"
        num_hiddens, num_heads = _count(fn, "num_hiddens", num_hiddens), _count(fn, "num_heads",
                                                                               num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else _count(fn, "num_kv_heads",
                                                                     num_kv_heads)
        bias = _flag(fn, "bias", bias)
        dropout = _probability(fn, "dropout", dropout)
        keep_attention_weights = _flag(fn, "keep_attention_weights", keep_attention_weights)
        if num_hiddens % num_heads != 0:
            raise ValueError(f"{fn}: num_hiddens = {num_hiddens} is not a multiple of "
                             f"num_heads = {num_heads}")
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"{fn}: num_heads = {num_heads} is not a multiple of "
                             f"num_kv_heads = {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.attention = DotProductAttention(dropout, keep_attention_weights)
        kv_hiddens = num_hiddens // num_heads * num_kv_heads
        with warnings.catch_warnings():  # torch 1.13 warns that lazy modules are new
            warnings.filterwarnings("ignore", message="Lazy modules are a new feature")
            self.W_q = nn.LazyLinear(num_hiddens, bias=bias)
            self.W_k = nn.LazyLinear(kv_hiddens, bias=bias)
            self.W_v = nn.LazyLinear(kv_hiddens, bias=bias)
            self.W_o = nn.LazyLinear(num_hiddens, bias=bias)

    __prepare_scriptable__ = _not_scripted

    def forward(self, queries, keys, values, valid_lens=None, is_causal=False):
        """queries (B, Nq, query_size), keys (B, Nk, key_size), values (B, Nk,
        value_size), valid_lens None, (B) or (B, Nq) -> (B, Nq, num_hiddens)."""
        batch, nq = queries.shape[0], queries.shape[1]
        nk = keys.shape[1]

        def heads(X, n, count):  # (B, N, count * d) -> its (B, count, N, d) view
            return X.reshape(batch, n, count, -1).transpose(1, 2)

        q = heads(self.W_q(queries), nq, self.num_heads)
        k = heads(self.W_k(keys), nk, self.num_kv_heads)
        v = heads(self.W_v(values), nk, self.num_kv_heads)
        p = self.attention.dropout.p if self.training else 0.0
        causal = "top-left" if _flag("MultiHeadAttention.forward", "is_causal", is_causal) else None
        output, weights, _ = _sdpa("MultiHeadAttention", q, k, v, valid_lens, None, p, None,
                                   self.attention.keep_attention_weights, causal,
                                   enable_gqa=True)
        self.attention.attention_weights = (
            None if weights is None else weights.reshape(-1, nq, nk))
        # (B, H, Nq, d) over (B, Nq, H, d) memory: the concatenation is a view.
        return self.W_o(output.transpose(1, 2).reshape(batch, nq, -1))


from ._mha import MultiheadAttention  # noqa: E402  (torch.nn.MultiheadAttention's; needs the above)
