"""qkv.torch.MultiheadAttention against torch's own torch.nn.MultiheadAttention.

Run twice by CTest: under Debian's /usr/bin/python3 by pytest (torch 1.13,
python.test_torch_mha) and under the venv's Python as a script (torch
2.13.0, peer_torch2_mha: `build/venv/bin/python tests/python/test_torch_mha.py
--torch 2.13.0`); each run fails when its torch is not the one it names.

Each case draws a module configuration (embed_dim, num_heads, bias,
add_bias_kv, add_zero_attn, kdim/vdim, batch_first), inputs (batched or
not), masks (attn_mask bool or float, 2-D or 3-D; key_padding_mask bool or
float; is_causal) and need_weights/average_attn_weights at random, loads
torch's module's state_dict into qkv's, and holds qkv's output, weights and
gradients (of sum(output * G) for query, key, value, every parameter and a
float mask) to torch's module run in float64 on the same values (float32
cases: inputs and parameters rounded to float32 first). The bound is the
a-priori one for sums of n terms, n * u * max(max|ref|, 1) (u the dtype's unit
roundoff, n the longest sum behind a result: the projections' E, kdim or
vdim, and the keys S), times 4 for the differing summation orders. The
worst share of the bound and torch's own float32 error beside qkv's are
printed. QKV_TEST_SEED=<seed> replays a run.

Masks keep the first key for every query, so that no row is fully masked
(where torch gives NaN and qkv 0, docs/python.md).
"""

import atexit
import os
import secrets
import sys
import unittest
import zlib

import numpy as np
import torch
from torch import nn

import qkv.torch

EXPECTED_TORCH = "1.13"  # the script's --torch VERSION replaces it (the venv run)
SEED = int(os.environ.get("QKV_TEST_SEED") or secrets.randbits(32))
TORCH_1 = torch.__version__.startswith("1.")
ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}
ORDER_FACTOR = 4  # summation orders differ (qkv's online softmax, blocked products)
CASES = 60
WORST = {}  # (dtype, result) -> (share of the bound, qkv error, torch float32 error, case)


def _report():
    if WORST:
        print(f"\nqkv.torch.MultiheadAttention vs torch {torch.__version__} (seed {SEED}): "
              "worst share of the bound per result")
        for (dtype, name), (share, err, torch_err, case) in sorted(WORST.items()):
            extra = "" if torch_err is None else f", torch float32's own {torch_err:.2e}"
            print(f"  {dtype:8} {name:18} {share:.3f}  (error {err:.2e}{extra}; {case})")


atexit.register(_report)


def rng_for(test, index=0):
    return np.random.default_rng([SEED, zlib.crc32(test.id().encode()), index])


def tensor(rng, shape, dtype, scale=1.0):
    return torch.from_numpy(rng.standard_normal(shape) * scale).to(dtype)


def draw_case(rng, dtype):
    """A configuration and its inputs: (constructor kwargs, forward kwargs, description)."""
    heads = int(rng.choice([1, 2, 3, 4]))
    head_dim = int(rng.choice([1, 2, 4, 8, 16]))
    embed = heads * head_dim
    separate = rng.random() < 0.3
    kdim, vdim = None, None
    if separate:
        kdim, vdim = int(rng.choice([3, 5, 12])), int(rng.choice([2, 7, 12]))
    config = dict(embed_dim=embed, num_heads=heads, bias=bool(rng.random() < 0.7),
                  add_bias_kv=bool(rng.random() < 0.25), add_zero_attn=bool(rng.random() < 0.25),
                  kdim=kdim, vdim=vdim, batch_first=bool(rng.random() < 0.5))
    batched = rng.random() < 0.8
    batch = int(rng.choice([1, 2, 3])) if batched else 1
    nq, nk = int(rng.choice([1, 2, 5, 9, 17])), int(rng.choice([1, 3, 8, 16, 33]))

    def sequence(n, features):
        if not batched:
            return tensor(rng, (n, features), dtype)
        shape = (batch, n, features) if config["batch_first"] else (n, batch, features)
        return tensor(rng, shape, dtype)

    query = sequence(nq, embed)
    key, value = sequence(nk, kdim or embed), sequence(nk, vdim or embed)
    attn_kind = rng.choice(["none", "bool", "float"])
    attn_mask = None
    if attn_kind != "none":
        shape = (nq, nk) if rng.random() < 0.5 else (batch * heads, nq, nk)
        if attn_kind == "bool":  # True = masked out
            attn_mask = torch.from_numpy(rng.random(shape) < 0.3)
        else:
            attn_mask = tensor(rng, shape, dtype)
            attn_mask[torch.from_numpy(rng.random(shape) < 0.1)] = float("-inf")
        attn_mask[..., 0] = False if attn_kind == "bool" else 0.0
    kpm_kind = rng.choice(["none", "bool", "float"])
    kpm = None
    if kpm_kind != "none":
        shape = (batch, nk) if batched else (nk,)
        kpm = (torch.from_numpy(rng.random(shape) < 0.3) if kpm_kind == "bool"
               else tensor(rng, shape, dtype, 0.5))
        kpm[..., 0] = False if kpm_kind == "bool" else 0.0
    is_causal = bool(rng.random() < 0.2)
    if kpm_kind == "float" and TORCH_1 and (attn_mask is not None or is_causal):
        # torch 1.13 adds a float key_padding_mask only alone; beside an
        # attn_mask it reads it as bools (nonzero = masked out). qkv adds it
        # always, as torch 2 does.
        attn_kind, attn_mask, is_causal = "none", None, False
    forward = dict(query=query, key=key, value=value, key_padding_mask=kpm,
                   need_weights=bool(rng.random() < 0.6), attn_mask=attn_mask,
                   average_attn_weights=bool(rng.random() < 0.5), is_causal=is_causal)
    description = (f"{str(dtype)[6:]} E={embed} H={heads} kdim={kdim} vdim={vdim} "
                   f"bias={config['bias']} bias_kv={config['add_bias_kv']} "
                   f"zero_attn={config['add_zero_attn']} batch_first={config['batch_first']} "
                   f"{'N=' + str(batch) if batched else 'unbatched'} L={nq} S={nk} "
                   f"attn_mask={attn_kind}{'' if attn_mask is None else list(attn_mask.shape)} "
                   f"key_padding_mask={kpm_kind} causal={forward['is_causal']} "
                   f"need_weights={forward['need_weights']} "
                   f"average={forward['average_attn_weights']}")
    return config, forward, description


def for_torch(forward):
    """The forward's arguments as torch's module takes them: is_causal as the
    causal mask (torch 1.13 has no is_causal; torch 2.13 wants attn_mask with
    it), combined with attn_mask."""
    forward = dict(forward)
    if forward.pop("is_causal"):
        future = torch.ones(*forward["_shape"], dtype=torch.bool).triu(1)
        mask = forward["attn_mask"]
        if mask is None or mask.dtype == torch.bool:
            forward["attn_mask"] = future if mask is None else mask | future
        else:
            forward["attn_mask"] = mask.masked_fill(future, float("-inf"))
    return forward


def run(module, forward, grad_tensors):
    """Output, weights and the gradients of sum(output * G) (G = grad_tensors["G"])."""
    output, weights = module(**{k: v for k, v in forward.items() if not k.startswith("_")})
    loss = (output * grad_tensors["G"]).sum()
    named = dict(module.named_parameters())
    named.update({k: forward[k] for k in ("query", "key", "value", "attn_mask",
                                          "key_padding_mask")
                  if forward.get(k) is not None and forward[k].requires_grad})
    grads = torch.autograd.grad(loss, list(named.values()))
    results = {"output": output.detach()}
    if weights is not None:
        results["weights"] = weights.detach()
    results.update({f"d_{name}": g for name, g in zip(named, grads)})
    return results


def with_dtype(forward, dtype):
    """The forward's tensors in `dtype` (float ones; bool masks as they are), as new leaves."""
    out = {}
    for name, value in forward.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.detach().to(dtype).requires_grad_()
        out[name] = value
    return out


class TorchVersion(unittest.TestCase):
    def test_the_named_torch(self):
        self.assertTrue(torch.__version__.startswith(EXPECTED_TORCH),
                        f"this run holds qkv to torch {EXPECTED_TORCH}; found torch "
                        f"{torch.__version__} at {torch.__file__}")


class MatchesTorch(unittest.TestCase):
    """Outputs, weights and gradients equal torch's module's, loaded with the same state."""

    def check_case(self, rng, dtype, index):
        config, forward, description = draw_case(rng, dtype)
        query, key = forward["query"], forward["key"]
        batched = query.dim() == 3
        seq_axis = 1 if (batched and config["batch_first"]) else 0
        forward["_shape"] = (query.shape[seq_axis], key.shape[seq_axis])
        torch.manual_seed(int(rng.integers(2**31)))
        reference = nn.MultiheadAttention(**config, dtype=torch.float64)
        ours = qkv.torch.MultiheadAttention(**config, dtype=dtype)
        ours.load_state_dict(reference.state_dict())  # float64 values rounded to dtype
        reference.load_state_dict(ours.state_dict())  # ... and back: both hold the same values
        G_shape = (query.shape[:-1]) + (config["embed_dim"],)
        G = tensor(rng, G_shape, torch.float64)
        ours_forward = with_dtype(forward, dtype)
        ours_results = run(ours, ours_forward, {"G": G.to(dtype)})
        torch_forward = for_torch(with_dtype(forward, torch.float64))
        ref_results = run(reference, torch_forward, {"G": G})
        torch32 = None
        if dtype == torch.float32:
            peer = nn.MultiheadAttention(**config, dtype=torch.float32)
            peer.load_state_dict(ours.state_dict())
            torch32 = run(peer, for_torch(with_dtype(forward, torch.float32)),
                          {"G": G.to(torch.float32)})
        self.assertEqual(set(ours_results), set(ref_results), description)
        n = 2 + max(config["embed_dim"], config["kdim"] or 0, config["vdim"] or 0) + \
            forward["_shape"][1]
        for name, ref in ref_results.items():
            got = ours_results[name]
            self.assertEqual(got.dtype, dtype, f"{name}: {description}")
            self.assertEqual(got.shape, ref.shape, f"{name}: {description}")
            err = (got.double() - ref).abs().max().item() if ref.numel() else 0.0
            # At least 1: the inputs, G and the parameters are O(1), and a
            # gradient that is 0 exactly (d_query with one key) is a sum of
            # such terms that cancel.
            bound = ORDER_FACTOR * n * ROUNDOFF[dtype] * max(ref.abs().max().item()
                                                             if ref.numel() else 0.0, 1.0)
            torch_err = None
            if torch32 is not None and ref.numel():
                torch_err = (torch32[name].double() - ref).abs().max().item()
            key_ = (str(dtype)[6:], name)
            share = err / bound
            if share >= WORST.get(key_, (-1,))[0]:
                WORST[key_] = (share, err, torch_err, f"case {index}: {description}")
            self.assertLessEqual(err, bound, f"{name}: error {err:.3e} > bound {bound:.3e} "
                                 f"(torch float32's own: {torch_err}); {description}; seed "
                                 f"{SEED}")

    def test_float64(self):
        rng = rng_for(self)
        for index in range(CASES):
            with self.subTest(case=index):
                self.check_case(rng, torch.float64, index)

    def test_float32(self):
        rng = rng_for(self)
        for index in range(CASES):
            with self.subTest(case=index):
                self.check_case(rng, torch.float32, index)


class Module(unittest.TestCase):
    def test_state_dict_loads_both_ways(self):
        for kdim in (None, 6):
            theirs = nn.MultiheadAttention(8, 2, kdim=kdim, vdim=kdim, add_bias_kv=True)
            ours = qkv.torch.MultiheadAttention(8, 2, kdim=kdim, vdim=kdim, add_bias_kv=True)
            self.assertEqual(list(theirs.state_dict()), list(ours.state_dict()))
            ours.load_state_dict(theirs.state_dict())
            for name, value in theirs.state_dict().items():
                self.assertTrue(torch.equal(ours.state_dict()[name], value), name)
            with torch.no_grad():
                for p in ours.parameters():
                    p.add_(1.0)
            theirs.load_state_dict(ours.state_dict())
            for name, value in ours.state_dict().items():
                self.assertTrue(torch.equal(theirs.state_dict()[name], value), name)
        self.assertIsInstance(ours, nn.MultiheadAttention)

    def test_dropout_follows_training_mode(self):
        """Eval mode ignores dropout (torch's output); training mode drops weights, a
        fresh mask per call drawn from torch's generator (torch.manual_seed repeats it)."""
        rng = rng_for(self)
        theirs = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
        ours = qkv.torch.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
        ours.load_state_dict(theirs.state_dict())
        x = tensor(rng, (2, 7, 8), torch.float32)
        theirs.eval()
        ours.eval()
        expected = theirs(x, x, x)[0]
        torch.testing.assert_close(ours(x, x, x)[0], expected, rtol=1e-5, atol=1e-6)
        ours.train()
        first, second = ours(x, x, x)[0], ours(x, x, x)[0]
        self.assertFalse(torch.allclose(first, second), "two training calls drew one mask")
        self.assertFalse(torch.allclose(first, expected), "training mode dropped nothing")
        torch.manual_seed(5)
        again = ours(x, x, x)[0]
        torch.manual_seed(5)
        self.assertTrue(torch.equal(again, ours(x, x, x)[0]))

    def test_dropout_is_unbiased(self):
        """The output is linear in the dropped weights, so its mean over many
        training calls is the eval output: within 5 standard errors of the
        sample mean, per element (drawn fresh each run; a mask that kept
        too much or too little, or scaled kept weights wrongly, moves the mean
        by far more)."""
        rng = rng_for(self)
        ours = qkv.torch.MultiheadAttention(4, 2, dropout=0.3, batch_first=True,
                                            dtype=torch.float64)
        x = tensor(rng, (1, 3, 4), torch.float64)
        with torch.no_grad():
            expected = ours.eval()(x, x, x)[0]
            ours.train()
            draws = torch.stack([ours(x, x, x)[0] for _ in range(2000)])
        error = (draws.mean(0) - expected).abs()
        standard_error = draws.std(0) / len(draws) ** 0.5
        self.assertTrue(bool((error <= 5 * standard_error + 1e-12).all()),
                        f"mean over draws off by {error.max().item():.3e}; seed {SEED}")

    def test_fully_masked_query_gives_zero(self):
        """Where torch gives NaN (every key masked), qkv's attention gives 0: the
        output is out_proj's bias."""
        ours = qkv.torch.MultiheadAttention(4, 2, batch_first=True)
        x = torch.randn(1, 3, 4)
        mask = torch.zeros(3, 3, dtype=torch.bool)
        mask[1] = True
        output, weights = ours(x, x, x, attn_mask=mask)
        torch.testing.assert_close(output[0, 1], ours.out_proj.bias.detach())
        self.assertTrue(torch.equal(weights[0, 1], torch.zeros(3)))

    def test_script_is_refused(self):
        with self.assertRaisesRegex(RuntimeError, "MultiheadAttention: torch.jit.script is "
                                                  "not supported"):
            torch.jit.script(qkv.torch.MultiheadAttention(4, 2))


class Errors(unittest.TestCase):
    """Each bad argument: the function, the argument and its value or shape."""

    def test_bad_arguments(self):
        mha = qkv.torch.MultiheadAttention(8, 2, batch_first=True)
        x = torch.randn(2, 3, 8)
        fn = r"^MultiheadAttention.forward: "
        cases = [
            (dict(query=torch.randn(2, 3, 6)), ValueError,
             fn + r"query has E = 6 \(shape \[2, 3, 6\]\) but embed_dim = 8$"),
            (dict(key=torch.randn(2, 3, 5), value=torch.randn(2, 3, 5)), ValueError,
             fn + r"key has 5 features \(shape \[2, 3, 5\]\) but the module's kdim = 8$"),
            (dict(value=torch.randn(2, 4, 8)), ValueError,
             fn + r"key and value must share their batch and sequence axes"),
            (dict(query=torch.randn(1, 2, 3, 8)), ValueError,
             fn + r"query, key and value must be all 3-D .* got shapes \[1, 2, 3, 8\]"),
            (dict(key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)), ValueError,
             fn + r"key_padding_mask has shape \[2, 4\]; expected \(N, S\) = \[2, 3\]$"),
            (dict(attn_mask=torch.zeros(3, 4, dtype=torch.bool)), ValueError,
             fn + r"attn_mask has shape \[3, 4\]; expected \(L, S\) = \[3, 3\] or "
                  r"\(N \* num_heads, L, S\) = \[4, 3, 3\]$"),
            (dict(attn_mask=torch.zeros(3, 3, dtype=torch.int64)), TypeError,
             fn + r"attn_mask has dtype int64; expected bool"),
            (dict(key_padding_mask=[[0, 0, 0]]), TypeError,
             fn + r"key_padding_mask is a list; expected a torch.Tensor$"),
            (dict(query="x"), TypeError, fn + r"query is a str; expected a torch.Tensor$"),
            (dict(query=x.int(), key=x.int(), value=x.int()), TypeError,
             fn + r"query has dtype int32 but the module's parameters have float32; "),
            (dict(key=x.double()), TypeError,
             fn + r"key has dtype float64 but the module's parameters have float32; "),
        ]
        for change, error, message in cases:
            arguments = dict(query=x, key=x, value=x)
            arguments.update(change)
            with self.subTest(change=list(change)):
                with self.assertRaisesRegex(error, message):
                    mha(**arguments)

    def test_constructor_is_torchs(self):
        with self.assertRaisesRegex(AssertionError, "divisible"):
            qkv.torch.MultiheadAttention(10, 3)


if __name__ == "__main__":
    import torch_versions
    torch_versions.main(sys.modules[__name__])
