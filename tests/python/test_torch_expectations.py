"""What a PyTorch user expects of qkv.torch's functions, beside torch's own:
float16 inputs (computed in float32, returned in float16), key and value of
batch 1 broadcast against the query's batch (torch's rule), and
torch.func.vmap (or functorch.vmap in torch 1.13) refused by name.

Run twice by CTest, as tests/python/test_torch_mha.py is: by pytest under
/usr/bin/python3 (torch 1.13) and as a script in the venv (torch 2.13.0,
peer_torch2_expectations, `--torch 2.13.0`), where the broadcast results
are also held to torch's own F.scaled_dot_product_attention.

Results are held to float64 formulas on the same input values: float16's
bound is one rounding to float16 of each element (2^-11 |ref|) plus the
float32 computation's a-priori bound, 4 n u32 max(max|ref|, 1) (n the
longest sum, D + Nk); float32 and float64's the latter with their own u.
QKV_TEST_SEED=<seed> replays a run.
"""

import os
import secrets
import sys
import unittest
import zlib

import numpy as np
import torch

import qkv.torch

EXPECTED_TORCH = "1.13"  # the script's --torch VERSION replaces it (the venv run)
SEED = int(os.environ.get("QKV_TEST_SEED") or secrets.randbits(32))
ROUNDOFF = {torch.float16: 2.0**-11, torch.float32: 2.0**-24, torch.float64: 2.0**-53}

if torch.__version__.startswith("1."):
    from functorch import vmap
else:
    from torch.func import vmap


def rng_for(test):
    return np.random.default_rng([SEED, zlib.crc32(test.id().encode())])


def randn(rng, *shape, dtype=torch.float64):
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype)


def sdpa_formula(q, k, v, bias=None, keep=None, causal=False, lens=None):
    """softmax(q k^T / sqrt(D) + bias, masked) v in float64, broadcasting as torch does."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if bias is not None:
        scores = scores + bias
    hidden = torch.zeros(scores.shape, dtype=torch.bool)
    if keep is not None:
        hidden = hidden | ~keep
    if causal:
        hidden = hidden | torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
    if lens is not None:
        hidden = hidden | (torch.arange(scores.shape[-1]) >= lens.reshape(-1, *[1] * (
            scores.dim() - 1)))
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ v


def grads_of(fn, inputs, G):
    """fn(*inputs) and the gradients of sum(fn(*inputs) * G) for the float inputs."""
    inputs = [t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs]
    out = fn(*inputs)
    grads = torch.autograd.grad((out.to(G.dtype) * G).sum(),
                                [t for t in inputs if t.requires_grad])
    return [out.detach()] + [g.detach() for g in grads]


class Held:
    """One rule for every comparison: float64 reference, a bound from the dtype."""

    def check(self, got, want, dtype, n, what):
        self.assertEqual(got.dtype, dtype, what)
        self.assertEqual(got.shape, want.shape, what)
        compute = torch.float32 if dtype == torch.float16 else dtype
        bound = 4 * n * ROUNDOFF[compute] * max(want.abs().max().item(), 1.0)
        if dtype == torch.float16:  # the result's own rounding to float16
            bound = bound + ROUNDOFF[torch.float16] * want.abs()
        err = (got.double() - want).abs()
        bound = torch.as_tensor(bound).expand_as(err)
        self.assertTrue(bool((err <= bound).all()),
                        f"{what}: worst error {err.max().item():.3e}, bound at it "
                        f"{bound.flatten()[err.argmax()].item():.3e}; seed {SEED}")


class TorchVersion(unittest.TestCase):
    def test_the_named_torch(self):
        self.assertTrue(torch.__version__.startswith(EXPECTED_TORCH),
                        f"this run expects torch {EXPECTED_TORCH}; found {torch.__version__}")


class Float16(Held, unittest.TestCase):
    """float16 in, float16 out (outputs and gradients), computed in float32."""

    def run_op(self, name, op, formula, inputs, n):
        rng = rng_for(self)
        values = [t.half().double() if t.is_floating_point() else t for t in inputs]
        out_shape = formula(*values).shape
        G = randn(rng, *out_shape).half().double()
        want = grads_of(formula, values, G)
        got = grads_of(op, [t.half() if t.is_floating_point() else t for t in values], G.half())
        for index, (g, w) in enumerate(zip(got, want)):
            self.check(g, w, torch.float16, n, f"{name} result {index}")

    def test_scaled_dot_product_attention(self):
        rng = rng_for(self)
        for shape_q, shape_k in (((2, 5, 8), (2, 7, 8)), ((2, 3, 4, 16), (2, 3, 9, 16))):
            q, k = randn(rng, *shape_q), randn(rng, *shape_k)
            v = randn(rng, *shape_k[:-1], 6)
            bias = randn(rng, shape_q[-2], shape_k[-2])
            self.run_op("sdpa", lambda q, k, v, b: qkv.torch.scaled_dot_product_attention(
                q, k, v, attn_mask=b, is_causal=True),
                lambda q, k, v, b: sdpa_formula(q, k, v, bias=b, causal=True),
                [q, k, v, bias], shape_q[-1] + shape_k[-2])

    def test_masked_softmax(self):
        rng = rng_for(self)
        X, lens = randn(rng, 3, 4, 9), torch.tensor([9, 4, 1])
        hidden = torch.arange(9) >= lens.reshape(3, 1, 1)
        self.run_op("masked_softmax", lambda x: qkv.torch.masked_softmax(x, lens),
                    lambda x: torch.softmax(x.masked_fill(hidden, float("-inf")), dim=-1),
                    [X], 9)

    def test_additive_bilinear_distance(self):
        rng = rng_for(self)
        q, k, v = randn(rng, 2, 3, 5), randn(rng, 2, 6, 4), randn(rng, 2, 6, 3)
        W_q, W_k, w_v = randn(rng, 7, 5), randn(rng, 7, 4), randn(rng, 1, 7)
        self.run_op("additive", qkv.torch.additive_attention,
                    lambda q, k, v, W_q, W_k, w_v: torch.softmax(
                        (torch.tanh((q @ W_q.T).unsqueeze(2) + (k @ W_k.T).unsqueeze(1))
                         @ w_v.T).squeeze(-1), dim=-1) @ v,
                    [q, k, v, W_q, W_k, w_v], 7 + 6 + 5)
        W = randn(rng, 5, 4)
        self.run_op("bilinear", qkv.torch.bilinear_attention,
                    lambda q, k, v, W: torch.softmax(q @ W @ k.transpose(1, 2), dim=-1) @ v,
                    [q, k, v, W], 5 + 4 + 6)
        k5 = randn(rng, 2, 6, 5)
        self.run_op("distance", qkv.torch.distance_attention,
                    lambda q, k, v: torch.softmax(-0.5 * torch.cdist(q, k) ** 2, dim=-1) @ v,
                    [q, k5, v], 5 + 6)

    def test_modules(self):
        rng = rng_for(self)
        q, k, v = randn(rng, 2, 3, 4).half(), randn(rng, 2, 6, 4).half(), randn(rng, 2, 6, 3).half()
        attention = qkv.torch.DotProductAttention(0.0)
        out = attention(q, k, v, torch.tensor([6, 2]))
        self.assertEqual(out.dtype, torch.float16)
        self.assertEqual(attention.attention_weights.dtype, torch.float16)
        want = sdpa_formula(q.double(), k.double(), v.double(), lens=torch.tensor([6, 2]))
        self.check(out, want, torch.float16, 4 + 6, "DotProductAttention")

    def test_multihead_attention(self):
        """A float16 module: torch 2's float16 projections, qkv's attention in
        float32. torch 1.13 has no float16 matrix product on the CPU, for its
        own module as for this one."""
        rng = rng_for(self)
        theirs = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
        ours = qkv.torch.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float16)
        ours.load_state_dict(theirs.state_dict())
        theirs.load_state_dict(ours.state_dict())  # the float16 values, in float64
        x = randn(rng, 2, 5, 8).half()
        if EXPECTED_TORCH.startswith("1."):
            for module in (ours, torch.nn.MultiheadAttention(8, 2, dtype=torch.float16)):
                with self.assertRaisesRegex(RuntimeError, "not implemented for 'Half'"):
                    module(x, x, x)
            return
        output, weights = ours(x, x, x)
        want, want_weights = theirs(x.double(), x.double(), x.double())
        self.assertEqual((output.dtype, weights.dtype), (torch.float16, torch.float16))
        # Each float16 product of E = 8 terms rounds: n u16 for three of them in a row.
        bound = 4 * 3 * (8 + 5) * ROUNDOFF[torch.float16] * max(want.abs().max().item(), 1.0)
        self.assertLessEqual((output.double() - want).abs().max().item(), bound)
        self.assertLessEqual((weights.double() - want_weights).abs().max().item(), bound)

    def test_mixed_with_float16_is_a_type_error(self):
        q = torch.randn(2, 3, 4)
        with self.assertRaisesRegex(TypeError, "key has dtype float16 but query has float32"):
            qkv.torch.scaled_dot_product_attention(q, q.half(), q)


class BatchBroadcast(Held, unittest.TestCase):
    """key and value (or query) of batch 1 against a batch of B: torch's broadcast."""

    CASES = [  # query, key, value shapes, enable_gqa
        ((3, 5, 8), (1, 7, 8), (1, 7, 4), False),
        ((1, 5, 8), (3, 7, 8), (3, 7, 4), False),
        ((2, 4, 5, 8), (1, 4, 7, 8), (1, 4, 7, 4), False),
        ((2, 4, 5, 8), (2, 1, 7, 8), (2, 1, 7, 4), False),  # one head for all: broadcast
        ((2, 4, 5, 8), (1, 2, 7, 8), (1, 2, 7, 4), True),  # batch broadcast and GQA
        ((2, 3, 4, 5, 8), (2, 1, 4, 7, 8), (2, 1, 4, 7, 4), False),
    ]

    def test_forward_and_gradients_against_the_formula(self):
        rng = rng_for(self)
        for dtype in (torch.float32, torch.float64):
            for shape_q, shape_k, shape_v, gqa in self.CASES:
                q, k, v = (randn(rng, *s).to(dtype).double() for s in (shape_q, shape_k, shape_v))

                def formula(q, k, v):
                    if gqa:
                        groups = q.shape[-3] // k.shape[-3]
                        k, v = (t.repeat_interleave(groups, dim=-3) for t in (k, v))
                    return sdpa_formula(q, k, v)

                G = randn(rng, *formula(q, k, v).shape)
                want = grads_of(formula, [q, k, v], G)
                got = grads_of(lambda q, k, v: qkv.torch.scaled_dot_product_attention(
                    q, k, v, enable_gqa=gqa), [t.to(dtype) for t in (q, k, v)], G.to(dtype))
                for name, g, w in zip(("output", "d_query", "d_key", "d_value"), got, want):
                    self.check(g, w, dtype, shape_q[-1] + shape_k[-2],
                               f"{name} {shape_q} {shape_k} {shape_v} gqa={gqa}")
                if not EXPECTED_TORCH.startswith("1."):  # torch 2's own function
                    theirs = grads_of(lambda q, k, v: torch.nn.functional.
                                      scaled_dot_product_attention(q, k, v, enable_gqa=gqa),
                                      [q, k, v], G)
                    for name, g, w in zip(("output", "d_query", "d_key", "d_value"), theirs,
                                          want):
                        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=name)

    def test_shapes_that_do_not_broadcast(self):
        q, k = torch.randn(2, 3, 4), torch.randn(3, 5, 4)
        with self.assertRaisesRegex(ValueError, r"keys has B = 3 but queries has B = 2"):
            qkv.torch.scaled_dot_product_attention(q, k, k)


class Vmap(unittest.TestCase):
    """torch.func.vmap (functorch.vmap in torch 1.13) over qkv.torch: a
    RuntimeError naming the op, never "Cannot access data pointer of Tensor
    that doesn't have storage"."""

    def test_every_op_refuses_by_name(self):
        q, k, v = torch.randn(3, 2, 4, 5), torch.randn(3, 2, 6, 5), torch.randn(3, 2, 6, 3)
        W_q, W_k, w_v = torch.randn(7, 5), torch.randn(7, 5), torch.randn(1, 7)
        W = torch.randn(5, 5)
        mha = qkv.torch.MultiheadAttention(5, 1, batch_first=True)
        calls = {
            "scaled_dot_product_attention": lambda q, k, v:
                qkv.torch.scaled_dot_product_attention(q, k, v),
            "masked_softmax": lambda q, k, v: qkv.torch.masked_softmax(q),
            "additive_attention": lambda q, k, v:
                qkv.torch.additive_attention(q, k, v, W_q, W_k, w_v),
            "bilinear_attention": lambda q, k, v: qkv.torch.bilinear_attention(q, k, v, W),
            "distance_attention": lambda q, k, v: qkv.torch.distance_attention(q, k, v),
            "DotProductAttention": lambda q, k, v: qkv.torch.DotProductAttention(0.0)(q, k, v),
            "MultiheadAttention": lambda q, k, v: mha(q, k, k)[0],
        }
        for name, call in calls.items():
            with self.subTest(op=name):
                with self.assertRaisesRegex(RuntimeError, rf"^{name}: \w+ is a tensor of a "
                                                          r"torch.func transform \(vmap"):
                    vmap(call)(q, k, v)


if __name__ == "__main__":
    import torch_versions
    torch_versions.main(sys.modules[__name__])
