"""examples/squeeze_excitation.py, an SE block built from qkv's pooling, against
a plain NumPy SE block in float64 (Hu et al., 2018: the channel means, two
layers with a ReLU between, a sigmoid gate scaling each channel), and its
softmax-normalised variant against the same block with a softmax over the
channels. Fresh random inputs each run; the seed is in every failure message.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

SOURCE = os.environ.get("QKV_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(SOURCE, "examples"))
import squeeze_excitation as se  # noqa: E402


def numpy_se_block(x, w1, w2, gate):
    """The SE block in float64 loops' terms: (output, weights (B, C))."""
    x, w1, w2 = (np.asarray(a, np.float64) for a in (x, w1, w2))
    z = x.mean(axis=(2, 3))  # squeeze: (B, C)
    scores = np.maximum(z @ w1.T, 0) @ w2.T  # excitation: (B, C)
    if gate == "sigmoid":
        weights = 1 / (1 + np.exp(-scores))
    else:
        e = np.exp(scores - scores.max(axis=1, keepdims=True))
        weights = e / e.sum(axis=1, keepdims=True)
    return x * weights[:, :, None, None], weights


def random_problem(seed, dtype):
    rng = np.random.default_rng(seed)
    b, c, r = rng.integers(1, 4), rng.choice([4, 8, 12]), rng.choice([2, 4])
    h, w = rng.integers(1, 6, size=2)
    x = (rng.normal(size=(b, c, h, w)) * rng.uniform(0.5, 3)).astype(dtype)
    w1 = rng.normal(size=(c // r, c)).astype(dtype)
    w2 = rng.normal(size=(c, c // r)).astype(dtype)
    return x, w1, w2


@pytest.mark.parametrize("gate", se.GATES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_against_numpy_se_block(gate, dtype):
    # float32: the pooling's sums of at most 25 positions and 12 channels, and
    # the float32 exp, stay within 1e-5 of the largest output; float64 1e-12.
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for _ in range(10):
        seed = int.from_bytes(os.urandom(4), "little")
        x, w1, w2 = random_problem(seed, dtype)
        want, want_weights = numpy_se_block(x, w1, w2, gate)
        got = se.se_block(x, w1, w2, gate)
        weights = se.channel_weights(x, w1, w2, gate)
        assert got.dtype == dtype and got.shape == x.shape, (seed, got.dtype, got.shape)
        scale = max(np.abs(want).max(), 1.0)
        assert np.abs(got - want).max() <= tol * scale, (seed, np.abs(got - want).max())
        assert np.abs(weights - want_weights).max() <= tol, (seed, weights, want_weights)


def test_sigmoid_gates_are_unnormalised_and_softmax_weights_sum_to_one():
    seed = int.from_bytes(os.urandom(4), "little")
    x, w1, w2 = random_problem(seed, np.float64)
    sigmoid = se.channel_weights(x, w1, w2, "sigmoid")
    softmax = se.channel_weights(x, w1, w2, "softmax")
    assert np.all((sigmoid > 0) & (sigmoid < 1)), (seed, sigmoid)
    np.testing.assert_allclose(softmax.sum(axis=1), 1.0, rtol=1e-12, err_msg=str(seed))
    # Raising every score by the same amount: every sigmoid gate rises, the
    # softmax weights stay (only differences between scores count).
    scores = se.channel_scores(x, w1, w2)
    assert np.all(se.gate_weights(scores + 3, "sigmoid") > se.gate_weights(scores, "sigmoid"))
    np.testing.assert_allclose(se.gate_weights(scores + 3, "softmax"),
                               se.gate_weights(scores, "softmax"), atol=1e-12,
                               err_msg=str(seed))


def test_squeeze_is_the_channel_means():
    seed = int.from_bytes(os.urandom(4), "little")
    x, _, _ = random_problem(seed, np.float64)
    np.testing.assert_allclose(se.squeeze(x)[:, 0, :], x.mean(axis=(2, 3)), rtol=1e-12,
                               atol=1e-15, err_msg=str(seed))


def test_unknown_gate_is_an_error_naming_it():
    x, w1, w2 = random_problem(1, np.float32)
    with pytest.raises(ValueError, match=r"gate_weights: gate='tanh'"):
        se.channel_weights(x, w1, w2, "tanh")


def test_the_example_runs():
    proc = subprocess.run([sys.executable, os.path.join(SOURCE, "examples",
                                                        "squeeze_excitation.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("query z (the squeeze, per channel):"), proc.stdout
    assert "softmax weights:" in proc.stdout and "sum 1.000" in proc.stdout, proc.stdout
    assert lines[-1].endswith("change by [0.000 0.000 0.000 0.000 0.000 0.000]"), proc.stdout
