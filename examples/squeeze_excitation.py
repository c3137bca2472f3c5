#!/usr/bin/python3
"""A Squeeze-and-Excitation block (Hu et al., 2018) built from qkv's attention
pooling: d2l 11.1's last exercise, "interpret SE networks through the lens of
attention" (docs/exercises.md explains the mapping).

    squeeze    z = mean of x over the H x W positions      qkv.average_pooling
               (the query: one summary of the whole input)
    scores     s = W2 relu(W1 z), one per channel           NumPy (two small products)
               (channel c's key is row c of W2)
    gate       sigmoid(s): unnormalised weights, each in (0, 1) on its own
               or softmax(s): normalised, the channels compete for a total of 1
                                                            qkv.masked_softmax
    excite     out_c = g_c x_c: attention pooling with the diagonal weights
               diag(g), each channel's output looking at its own channel only
                                                            qkv.attention_pooling

Run it with the package on the path, e.g. from a build tree:
    PYTHONPATH=build/release/python /usr/bin/python3 examples/squeeze_excitation.py
"""

import numpy as np

import qkv

GATES = ("sigmoid", "softmax")


def squeeze(x):
    """(B, C, H, W) -> (B, 1, C): each channel's mean over the positions, as
    average pooling of the positions' channel vectors for one query."""
    b, c, h, w = x.shape
    positions = np.ascontiguousarray(x.reshape(b, c, h * w).transpose(0, 2, 1))  # (B, HW, C)
    return qkv.average_pooling(positions, 1)


def gate_weights(scores, gate="sigmoid"):
    """The gate over scores (..., C): the sigmoid of each on its own, or the
    softmax over the channels."""
    if gate not in GATES:
        raise ValueError(f"gate_weights: gate={gate!r}: expected one of {GATES}")
    if gate == "sigmoid":
        return 1 / (1 + np.exp(-scores))
    return qkv.masked_softmax(scores)


def channel_scores(x, w1, w2):
    """(B, 1, C): the scores W2 relu(W1 z) of the squeezed query z, one per
    channel. w1 is (C/r, C), w2 (C, C/r), as an SE block's two layers."""
    z = squeeze(x)
    return np.maximum(z @ w1.T, 0) @ w2.T


def channel_weights(x, w1, w2, gate="sigmoid"):
    """(B, C): the channels' attention weights, the gate over their scores."""
    return gate_weights(channel_scores(x, w1, w2), gate)[:, 0, :]


def se_block(x, w1, w2, gate="sigmoid"):
    """x (B, C, H, W) with each channel scaled by its weight: attention pooling
    of the channels (values, (B, C, H*W)) with the weights diag(g) (B, C, C).
    A C x C product where an SE layer multiplies elementwise: it is here to
    show the weights as attention weights, not for speed."""
    b, c, h, w = x.shape
    g = channel_weights(x, w1, w2, gate)
    diagonal = np.zeros((b, c, c), dtype=x.dtype)
    diagonal[:, np.arange(c), np.arange(c)] = g
    pooled = qkv.attention_pooling(diagonal, np.ascontiguousarray(x.reshape(b, c, h * w)))
    return pooled.reshape(b, c, h, w)


def main():
    rng = np.random.default_rng(0)
    channels, reduction = 6, 2
    x = rng.normal(size=(1, channels, 4, 4)).astype(np.float32)
    x[0, 2] += 2.0  # a channel brighter than the rest everywhere
    w1 = rng.normal(size=(channels // reduction, channels)).astype(np.float32)
    w2 = rng.normal(size=(channels, channels // reduction)).astype(np.float32)
    np.set_printoptions(precision=3, suppress=True, floatmode="fixed")

    print("query z (the squeeze, per channel):", squeeze(x)[0, 0])
    for gate in GATES:
        g = channel_weights(x, w1, w2, gate)[0]
        out = se_block(x, w1, w2, gate)
        print(f"{gate:7s} weights: {g}  sum {g.sum():.3f}  |out| / |x| = "
              f"{np.linalg.norm(out) / np.linalg.norm(x):.3f}")

    # The same scores raised by 3: every sigmoid weight rises (an SE block can
    # turn all channels up, or down, at once); softmax weights do not move, as
    # only differences between scores count when the weights must sum to 1.
    scores = channel_scores(x, w1, w2)
    for gate in GATES:
        change = gate_weights(scores + 3, gate) - gate_weights(scores, gate)
        change = np.round(change[0, 0], 3) + 0.0  # + 0.0: no "-0.000" from rounding noise
        print(f"{gate:7s} weights after adding 3 to every score change by {change}")

if __name__ == "__main__":
    main()
