"""The softmax's statistics of scaled dot-product attention (issue 33, item 1):
return_softmax_stats=True returns each row's (m, l), weights exp(score - m) / l
as the forward formed them, and the backward given them (softmax_stats=)
recomputes those very weights instead of exp(score - lse). Against float64
NumPy, the forward's own weights bit for bit, and every misuse."""

import numpy as np
import pytest

import qkv


def fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print("seed", seed)
    return np.random.default_rng(seed)


def float64_stats(q, k, scale):
    """(m, l, lse) of softmax(scale q k^T) per row, in float64."""
    s = np.einsum("...qd,...kd->...qk", q.astype(np.float64), k.astype(np.float64)) * scale
    m = s.max(-1)
    l = np.exp(s - m[..., None]).sum(-1)
    return m, l, m + np.log(l)


@pytest.mark.parametrize("shape", [(2, 3, 40, 70, 16), (2, 1, 300, 257, 32), (1, 1, 1, 3000, 64)],
                         ids=["heads", "blocks", "decoding"])
def test_stats_are_the_row_max_and_sum(shape):
    batch, heads, nq, nk, d = shape
    rng = fresh_rng()
    q = rng.uniform(-1.5, 1.5, (batch, heads, nq, d)).astype(np.float32)
    k = rng.uniform(-1.5, 1.5, (batch, heads, nk, d)).astype(np.float32)
    v = rng.standard_normal((batch, heads, nk, d)).astype(np.float32)
    out, lse, stats = qkv.scaled_dot_product_attention(q, k, v, return_lse=True,
                                                       return_softmax_stats=True)
    assert stats.shape == (batch, heads, nq, 2) and stats.dtype == np.float32
    m, l, want_lse = float64_stats(q, k, d ** -0.5)
    np.testing.assert_allclose(stats[..., 0], m, atol=1e-5, rtol=0)
    np.testing.assert_allclose(stats[..., 1], l, rtol=nk * 1.2e-7 + 2e-5)
    # The lse the kernels wrote is m + log l (NumPy's float32 log may differ
    # from the C library's in the last bit; tests/test_sdpa_backward_precision.cc
    # holds it bit for bit).
    np.testing.assert_allclose(lse, stats[..., 0] + np.log(stats[..., 1]), rtol=2.5e-7, atol=0)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=0)
    # The output is unchanged by asking for the statistics.
    np.testing.assert_array_equal(out, qkv.scaled_dot_product_attention(q, k, v))


def test_rows_without_keys_and_small_heads():
    rng = fresh_rng()
    q = rng.standard_normal((2, 5, 3)).astype(np.float32)
    k = rng.standard_normal((2, 7, 3)).astype(np.float32)
    v = rng.standard_normal((2, 7, 3)).astype(np.float32)
    # D = 3 takes the small-dimension kernel, which keeps no (m, l): (lse, 1);
    # batch element 1 has length 0: (-inf, 0).
    _, lse, stats = qkv.scaled_dot_product_attention(q, k, v, [7, 0], return_lse=True,
                                                     return_softmax_stats=True)
    np.testing.assert_array_equal(stats[0, :, 0], lse[0])
    np.testing.assert_array_equal(stats[0, :, 1], np.ones(5, np.float32))
    np.testing.assert_array_equal(stats[1, :, 0], np.full(5, -np.inf, np.float32))
    np.testing.assert_array_equal(stats[1, :, 1], np.zeros(5, np.float32))
    # 2-D inputs: no batch axis; float64: its own dtype.
    _, _, stats2 = qkv.scaled_dot_product_attention(q[0].astype(np.float64), k[0].astype(
        np.float64), v[0].astype(np.float64), return_lse=True, return_softmax_stats=True)
    assert stats2.shape == (5, 2) and stats2.dtype == np.float64


def test_backward_forms_the_forwards_weights():
    """dO zero but for a 1 at (query i, column 0): dV's column 0 is P_i, which
    given the statistics is the forward's weights row bit for bit."""
    rng = fresh_rng()
    nq, nk, d = 40, 150, 32
    q = rng.uniform(-1.5, 1.5, (1, nq, d)).astype(np.float32)
    k = rng.uniform(-1.5, 1.5, (1, nk, d)).astype(np.float32)
    v = rng.standard_normal((1, nk, d)).astype(np.float32)
    out, weights, lse, stats = qkv.scaled_dot_product_attention(
        q, k, v, return_weights=True, return_lse=True, return_softmax_stats=True)
    differ = 0
    for i in (0, 17, nq - 1):
        g = np.zeros_like(out)
        g[0, i, 0] = 1
        with_stats = qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, g,
                                                                softmax_stats=stats)
        np.testing.assert_array_equal(with_stats.d_values[0, :, 0], weights[0, i])
        lse_alone = qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, g)
        differ += int((lse_alone.d_values[0, :, 0] != weights[0, i]).sum())
        # Both are gradients of the same function: equal to float32 rounding.
        np.testing.assert_allclose(lse_alone.d_values, with_stats.d_values, atol=1e-6)
    print(f"from the lse alone, {differ} of {3 * nk} weights differ from the forward's")


def test_float32_gradients_as_exact_as_a_float32_computation():
    """Against float64 NumPy: the gradients given the statistics at most 3x
    (a float32 tail; FlashAttention's rule is 2x, see docs/semantics.md) the
    error of the same computation done in float32 NumPy, plus two roundings."""
    rng = fresh_rng()
    for nq, nk, d in ((1, 113, 32), (128, 239, 64), (512, 128, 128)):
        q, k, v, g = (rng.standard_normal((1, n, d)).astype(np.float32)
                      for n in (nq, nk, nk, nq))
        out, lse, stats = qkv.scaled_dot_product_attention(q, k, v, return_lse=True,
                                                           return_softmax_stats=True)
        got = qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, g,
                                                         softmax_stats=stats)

        def grads(dtype):
            a, b, c, e = (x[0].astype(dtype) for x in (q, k, v, g))
            s = a @ b.T * dtype(d ** -0.5)
            p = np.exp(s - s.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            dp = e @ c.T
            ds = p * (dp - (p * dp).sum(1, keepdims=True)) * dtype(d ** -0.5)
            return ds @ b, ds.T @ a, p.T @ e
        exact, single = grads(np.float64), grads(np.float32)
        for name, mine, ref, f32 in zip(("dq", "dk", "dv"), got, exact, single):
            err = np.abs(mine[0] - ref).max()
            err32 = np.abs(f32 - ref).max()
            atol = 2 * np.abs((ref.astype(np.float32) + np.float32(0.3)) - np.float32(0.3)
                              - ref.astype(np.float32)).max()
            assert err <= 3 * err32 + atol, (name, nq, nk, d, err, err32)


def test_misuse_is_an_error():
    rng = fresh_rng()
    q, k, v = (rng.standard_normal((2, n, 4)).astype(np.float32) for n in (3, 5, 5))
    with pytest.raises(qkv.Error) as caught:
        qkv.scaled_dot_product_attention(q, k, v, return_softmax_stats=True)
    assert "return_softmax_stats" in str(caught.value)
    assert "return_lse" in str(caught.value)
    out, lse, stats = qkv.scaled_dot_product_attention(q, k, v, return_lse=True,
                                                       return_softmax_stats=True)
    g = np.ones_like(out)
    with pytest.raises(qkv.Error) as caught:
        qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, g, softmax_stats=stats[:, :2])
    assert "scaled_dot_product_attention_backward" in str(caught.value)
    assert "softmax_stats" in str(caught.value) and "[2, 3, 2]" in str(caught.value)
    with pytest.raises(TypeError) as caught:
        qkv.scaled_dot_product_attention_backward(q, k, v, out, lse, g,
                                                  softmax_stats=stats.astype(np.float64))
    assert "softmax_stats" in str(caught.value)
    with pytest.raises(TypeError):  # only scaled dot-product attention has them
        qkv.additive_attention(q, k, v, np.ones((6, 4), np.float32), np.ones((6, 4), np.float32),
                               np.ones(6, np.float32), return_lse=True, return_softmax_stats=True)
