"""FlashAttention's gradient rule on qkv's float32 SDPA backward (issue 33, item 1).

For float32 inputs over a grid like FlashAttention's tests (B, H, Hkv, Nq, Nk,
D, windows including bottom-right causal (-1, 0) and (0, 0)), the gradients
dq, dk, dv of sum(out * g) from qkv.torch.scaled_dot_product_attention are
compared with the same computation done in plain torch in float32 (the test's
precision: S = q k^T * scale, masked softmax, P V, autograd) and in float64
(the reference). FlashAttention's rule: err(qkv) <= 2 err(f32) + atol with
err the max abs error against float64, and atol hopper/test_flash_attn.py's
rounding term, 2 max|ref + 0.3 - 0.3 - ref| computed in float32 (only
matters where both errors are ~0). Printed: the worst ratio
err(qkv) / (err(f32) + atol / 2) (the rule is ratio <= 2) per tensor, and
how many checks exceed 2 and 3; for qkv's backward given the forward's
softmax statistics (what qkv.torch does), and, on the same inputs, given the
lse alone (the weights recomputed as exp(score - lse)); and, as a yardstick
of the rule itself between two float32 computations, torch's own float32
with the scale applied to K instead (FlashAttention's reorder_ops).

Run with the venv's Python and the build's qkv:
  PYTHONPATH=build/release/python build/venv/bin/python bench/fa_grad_rule.py [--seed S] [--max-n N]
The whole grid (7 x 7 sizes x 3 head sizes x 3 windows, the shapes drawn per
case) takes a few minutes on 2 cores.
"""

import argparse
import itertools
import sys

import numpy as np
import torch

import qkv
import qkv.torch

SIZES = (1, 64, 113, 128, 239, 512, 1024)
HEAD_DIMS = (32, 64, 128)
# (B, H, Hkv): one head, several heads, grouped-query attention
SHAPES = ((1, 1, 1), (2, 4, 4), (2, 4, 2), (1, 4, 1))


def window_mask(nq, nk, window):
    """FlashAttention's construct_local_mask: True where the key is left out
    (bottom-right aligned; -1 leaves a side open)."""
    left, right = window
    row = torch.arange(nq).view(-1, 1) + (nk - nq)
    col = torch.arange(nk).view(1, -1)
    masked = torch.zeros(nq, nk, dtype=torch.bool)
    if right >= 0:
        masked |= col > row + right
    if left >= 0:
        masked |= col < row - left
    return masked


def plain_attention(q, k, v, window, scale, scale_keys=False):
    """softmax(q k^T * scale) v in q's dtype; rows with no key give 0. With
    scale_keys, the scale multiplies k first (FlashAttention's reorder_ops)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    if scale_keys:
        s = torch.matmul(q, (k * scale).transpose(-1, -2))
    else:
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if window is not None:
        masked = window_mask(q.shape[2], k.shape[2], window)
        s = s.masked_fill(masked, float("-inf"))
        p = torch.softmax(s, dim=-1)
        p = p.masked_fill(masked.all(dim=-1, keepdim=True), 0.0)
    else:
        p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v)


def grads(fn, q, k, v, g):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    (out * g).sum().backward()
    return q.grad, k.grad, v.grad


def qkv_grads(q, k, v, g, window, with_stats):
    """dq, dk, dv of sum(out * g) from qkv's NumPy forward and backward: the
    backward given the forward's softmax statistics, or the lse alone."""
    arrays = [t.numpy() for t in (q, k, v, g)]
    kwargs = {} if window is None else {"window": window}
    out, lse, stats = qkv.scaled_dot_product_attention(
        *arrays[:3], return_lse=True, return_softmax_stats=True, **kwargs)
    grads = qkv.scaled_dot_product_attention_backward(
        *arrays[:3], out, lse, arrays[3], softmax_stats=stats if with_stats else None, **kwargs)
    return [torch.from_numpy(np.asarray(x)) for x in grads]


def atol_of(ref):
    r = ref.float()
    return 2 * (r + 0.3 - 0.3 - r).abs().max().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-n", type=int, default=max(SIZES), help="skip sizes above this")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    torch.set_num_threads(2)
    # Cases where every query sees at most one key (Nk = 1, window (0, 0), a
    # window (0, R) for Nq = 1), whose exact dq and dk are 0, apart from the others.
    kinds = [f"{ways}, {keys}" for ways in ("softmax_stats", "lse alone", "torch, scale on K")
             for keys in ("one key", "others")]
    worst = {kind: {"dq": (0.0, None), "dk": (0.0, None), "dv": (0.0, None)} for kind in kinds}
    over2 = {kind: 0 for kind in kinds}
    over3 = dict(over2)
    checks = dict(over2)
    sizes = [n for n in SIZES if n <= args.max_n]
    for nq, nk, d in itertools.product(sizes, sizes, HEAD_DIMS):
        for window in (None, (-1, 0), "random", (0, 0)):
            if window == "random":
                window = tuple(int(x) for x in torch.randint(0, 64, (2,), generator=gen))
            b, h, hkv = SHAPES[int(torch.randint(0, len(SHAPES), (1,), generator=gen))]
            q = torch.randn(b, h, nq, d, generator=gen)
            k = torch.randn(b, hkv, nk, d, generator=gen)
            v = torch.randn(b, hkv, nk, d, generator=gen)
            g = torch.randn(b, h, nq, d, generator=gen)
            scale = d ** -0.5
            seen = (~window_mask(nq, nk, window)).sum(dim=-1) if window else torch.full((nq,), nk)
            one_key = bool((seen <= 1).all())
            got = grads(lambda q, k, v: qkv.torch.scaled_dot_product_attention(
                q, k, v, enable_gqa=True, window_size=window), q, k, v, g)
            f32 = grads(lambda q, k, v: plain_attention(q, k, v, window, scale), q, k, v, g)
            f64 = grads(lambda q, k, v: plain_attention(q, k, v, window, scale),
                        q.double(), k.double(), v.double(), g.double())
            # qkv.torch is the NumPy backward given the statistics, bit for bit.
            with_stats = qkv_grads(q, k, v, g, window, True)
            for mine, numpy_way in zip(got, with_stats):
                assert torch.equal(mine, numpy_way), "qkv.torch's gradients differ from the NumPy backward's"
            lse_alone = qkv_grads(q, k, v, g, window, False)
            torch_k = grads(lambda q, k, v: plain_attention(q, k, v, window, scale, True),
                            q, k, v, g)
            for ways, result in (("softmax_stats", got), ("lse alone", lse_alone),
                                 ("torch, scale on K", torch_k)):
                for name, a, b32, ref in zip(("dq", "dk", "dv"), result, f32, f64):
                    err = (a.double() - ref).abs().max().item()
                    err32 = (b32.double() - ref).abs().max().item()
                    atol = atol_of(ref)
                    denom = err32 + atol / 2
                    ratio = 0.0 if err == 0 else err / denom if denom > 0 else float("inf")
                    kind = f"{ways}, {'one key' if one_key else 'others'}"
                    checks[kind] += 1
                    over2[kind] += ratio > 2
                    over3[kind] += ratio > 3
                    if ratio > worst[kind][name][0]:
                        worst[kind][name] = (ratio, (b, h, hkv, nq, nk, d, window, err, err32))
    print(f"fa_grad_rule (seed {args.seed}): err(qkv) / (err(f32) + atol / 2), the rule <= 2")
    for kind in worst:
        print(f"  {kind}: {checks[kind]} checks, {over2[kind]} above 2x, {over3[kind]} above 3x")
        for name, (ratio, case) in worst[kind].items():
            print(f"    worst {name}: {ratio:.2f}x at (B, H, Hkv, Nq, Nk, D, window, err, "
                  f"err_f32) = {case}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
