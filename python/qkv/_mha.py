"""qkv.torch.MultiheadAttention: torch.nn.MultiheadAttention with its attention
on qkv's fused kernels (re-exported by qkv.torch).

A subclass of torch's module: the constructor, the parameters (in_proj_weight,
or q/k/v_proj_weight when kdim or vdim differ from embed_dim; in_proj_bias,
bias_k, bias_v, out_proj), their initialisation and so the state_dict are
torch's own, so a state_dict loads either way. Only forward is qkv's: the
projections stay torch's F.linear, the heads are read in place as (N, H, L,
head_dim) views of the projections, and the masks are folded into one
boolean mask or one float bias for the kernel.
"""

import torch
import torch.nn.functional as F
from torch import nn

from . import torch as _qkv_torch

_FN = "MultiheadAttention.forward"


def _dtype_name(t):
    return str(t.dtype).removeprefix("torch.")


def _check_mask_dtype(name, mask):
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{_FN}: {name} is a {type(mask).__name__}; expected a torch.Tensor")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{_FN}: {name} has dtype {_dtype_name(mask)}; expected bool (True = "
                        f"masked out, torch's nn.MultiheadAttention convention) or a float "
                        f"dtype (added to the scores)")


def _as_bias(mask, dtype):
    """A mask in the kernel's float form: bool True (masked out) -> -inf, float as is."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype).masked_fill(mask, float("-inf"))
    return mask


def _kernel_mask(attn_mask, key_padding_mask, batch, heads, dtype, extra_keys):
    """nn.MultiheadAttention's attn_mask (L, S) or (N * H, L, S) and
    key_padding_mask (N, S), both True = masked out or a float added to the
    scores, as one mask for qkv's kernel over (N, H, L, S + extra_keys): a
    bool mask with True = takes part when both are bool (or one is None),
    else one float bias (their sum: differentiable in each). The extra keys
    (bias_k, add_zero_attn) are seen by every query, as torch pads its masks
    with zeros for them."""
    parts = []
    if attn_mask is not None:
        if attn_mask.dim() == 3:  # (N * H, L, S), batch-major as torch lays it out
            attn_mask = attn_mask.view(batch, heads, *attn_mask.shape[1:])
        parts.append(attn_mask)
    if key_padding_mask is not None:
        parts.append(key_padding_mask.view(batch, 1, 1, key_padding_mask.shape[-1]))
    if not parts:
        return None
    if all(p.dtype == torch.bool for p in parts):
        keep = ~parts[0] if len(parts) == 1 else ~(parts[0] | parts[1])
        return F.pad(keep, (0, extra_keys), value=True) if extra_keys else keep
    bias = _as_bias(parts[0], dtype)
    if len(parts) == 2:
        bias = bias + _as_bias(parts[1], dtype)
    return F.pad(bias, (0, extra_keys), value=0.0) if extra_keys else bias


class MultiheadAttention(nn.MultiheadAttention):
    """torch.nn.MultiheadAttention with its attention on qkv's fused kernels.

    The same constructor (embed_dim, num_heads, dropout=0.0, bias=True,
    add_bias_kv=False, add_zero_attn=False, kdim=None, vdim=None,
    batch_first=False, device=None, dtype=None), parameters and state_dict
    as torch's (it is a subclass), and the same forward(query, key, value,
    key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False) -> (output, weights or
    None): batched (L, N, E) or (N, L, E) with batch_first, or unbatched
    (L, E); masks in torch's convention (bool True = masked out, or a float
    added to the scores): attn_mask (L, S) or (N * num_heads, L, S),
    key_padding_mask (N, S) (unbatched: (S)). Outputs and gradients equal
    torch's within rounding (tests/python/test_torch_mha.py, against torch
    1.13 and 2.13).

    Where it differs from torch's, on purpose:
      - is_causal=True masks the keys after each query (top-left) by
        itself; torch wants attn_mask as well and takes is_causal as a hint
        that it is causal.
      - A query whose every key is masked gets output 0 (torch 1.13's gives
        NaN; torch 2.13's, 0 when need_weights=False, NaN otherwise).
      - The weights returned are before dropout (torch's, after) and not
        differentiable (computed by the forward kernel, not part of the
        graph).
      - float16 computes in float32 (qkv.torch's rule).

    >>> mha = qkv.torch.MultiheadAttention(embed_dim=8, num_heads=2, batch_first=True)
    >>> x = torch.randn(3, 5, 8)
    >>> output, weights = mha(x, x, x)
    >>> output.shape, weights.shape
    (torch.Size([3, 5, 8]), torch.Size([3, 5, 5]))
    """

    __prepare_scriptable__ = _qkv_torch._not_scripted

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{_FN}: {name} is a {type(t).__name__}; expected a "
                                f"torch.Tensor")
            if t.dtype != self.out_proj.weight.dtype:
                raise TypeError(f"{_FN}: {name} has dtype {_dtype_name(t)} but the module's "
                                f"parameters have {_dtype_name(self.out_proj.weight)}; convert "
                                f"one (module.to(dtype) or {name}.to(dtype))")
        _check_mask_dtype("attn_mask", attn_mask)
        _check_mask_dtype("key_padding_mask", key_padding_mask)
        # Truthiness would take is_causal="bottom-right" as torch's top-left.
        need_weights, average_attn_weights, is_causal = (
            _qkv_torch._flag(_FN, name, value) for name, value in (
                ("need_weights", need_weights), ("average_attn_weights", average_attn_weights),
                ("is_causal", is_causal)))
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"{_FN}: query, key and value must be all 3-D (batched) or all "
                             f"2-D (unbatched); got shapes {list(query.shape)}, "
                             f"{list(key.shape)}, {list(value.shape)}")
        batched = query.dim() == 3
        if not batched:
            query, key, value = (t.unsqueeze(0) for t in (query, key, value))
            if key_padding_mask is not None:
                if key_padding_mask.dim() != 1:
                    raise ValueError(f"{_FN}: key_padding_mask has shape "
                                     f"{list(key_padding_mask.shape)}; unbatched inputs take "
                                     f"(S) = [{key.shape[1]}]")
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (L, N, E) -> its (N, L, E) view
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        batch, nq, embed = query.shape
        nk = key.shape[1]
        heads, head_dim = self.num_heads, self.head_dim
        self._check_shapes(query, key, value, key_padding_mask, attn_mask, batched)

        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)
        extra_keys = 0
        if self.bias_k is not None:  # one more key and value, learned, seen by every query
            k = torch.cat([k, self.bias_k.expand(batch, 1, embed)], dim=1)
            v = torch.cat([v, self.bias_v.expand(batch, 1, embed)], dim=1)
            extra_keys += 1

        def split_heads(x):  # (N, n, E) -> its (N, H, n, head_dim) view
            return x.reshape(x.shape[0], x.shape[1], heads, head_dim).transpose(1, 2)

        q, k, v = split_heads(q), split_heads(k), split_heads(v)
        if self.add_zero_attn:  # a key and value of zeros per head, seen by every query
            zeros = k.new_zeros(batch, heads, 1, head_dim)
            k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
            extra_keys += 1
        causal = "top-left" if is_causal else None
        if is_causal and extra_keys:
            # The kernel's causal rule would hide the extra keys (the last)
            # from the first queries; torch's masks let every query see them.
            future = torch.ones(nq, nk, dtype=torch.bool).triu(1)
            if attn_mask is None or attn_mask.dtype == torch.bool:
                attn_mask = future if attn_mask is None else attn_mask | future
            else:
                attn_mask = attn_mask.masked_fill(future, float("-inf"))
            causal = None
        mask = _kernel_mask(attn_mask, key_padding_mask, batch, heads, q.dtype, extra_keys)
        p = self.dropout if self.training else 0.0
        output, weights, _ = _qkv_torch._sdpa("MultiheadAttention", q, k, v, None, None, p, None,
                                              need_weights, causal=causal, attn_mask=mask)
        # (N, H, L, head_dim) over (N, L, H, head_dim) memory: the heads'
        # concatenation is a view.
        output = F.linear(output.transpose(1, 2).reshape(batch, nq, embed),
                          self.out_proj.weight, self.out_proj.bias)
        if batched and not self.batch_first:
            output = output.transpose(0, 1)
        if not batched:
            output = output.squeeze(0)
        if not need_weights:
            return output, None
        if average_attn_weights:
            weights = weights.mean(dim=1)
        return output, weights if batched else weights.squeeze(0)

    def _check_shapes(self, query, key, value, key_padding_mask, attn_mask, batched):
        """torch's shape rules, with messages that name the argument and its shape
        (torch's own are bare asserts). Shapes here are batch-first."""
        batch, nq, embed = query.shape
        nk = key.shape[1]
        if embed != self.embed_dim:
            raise ValueError(f"{_FN}: query has E = {embed} (shape {list(query.shape)}) but "
                             f"embed_dim = {self.embed_dim}")
        for name, t, dim in (("key", key, self.kdim), ("value", value, self.vdim)):
            if t.shape[2] != dim:
                raise ValueError(f"{_FN}: {name} has {t.shape[2]} features (shape "
                                 f"{list(t.shape)}) but the module's "
                                 f"{'kdim' if name == 'key' else 'vdim'} = {dim}")
        if key.shape[:2] != value.shape[:2] or key.shape[0] != batch:
            raise ValueError(f"{_FN}: key and value must share their batch and sequence "
                             f"axes, and the batch with query; got query "
                             f"{list(query.shape)}, key {list(key.shape)}, value "
                             f"{list(value.shape)} (batch first)")
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (batch, nk):
            raise ValueError(f"{_FN}: key_padding_mask has shape "
                             f"{list(key_padding_mask.shape)}; expected (N, S) = "
                             f"[{batch}, {nk}]")
        if attn_mask is not None:
            shapes = [(nq, nk), (batch * self.num_heads, nq, nk)]
            if tuple(attn_mask.shape) not in shapes:
                raise ValueError(f"{_FN}: attn_mask has shape {list(attn_mask.shape)}; "
                                 f"expected (L, S) = {list(shapes[0])} or (N * num_heads, L, "
                                 f"S) = {list(shapes[1])}")
