"""qkv.KeyValueStore and qkv.Index against float64 NumPy loops, the qkv command, every error.

- Round trips: create (float32 or float64, any strides) then keys()/values()
  give the input back, rounded as NumPy rounds to float32 and to bfloat16;
  row ranges across chunk boundaries; append; an empty store.
- Attention over a store equals softmax attention over every row computed
  here in float64 (dot and distance scoring, scale or bandwidth, valid_lens,
  top_k against NumPy's argsort), after appends too.
- Through an index: the output within certificate * 2 max|v| of the exact
  result, the certificate an upper bound of the weight missed, epsilon=0
  exact, probe visiting its lists, top-k rows the exact ones where certified,
  compact kernels equal to the Nadaraya-Watson product kernel over every row.
- The same bits as `qkv attend --store S [--index I]`.
- Every error: its type and its message (the call, the argument, the value).
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

import qkv

F4, F8 = np.float32, np.float64


# ---- references ------------------------------------------------------------------------------

def bf16_round(x):
    """float32 values rounded to bfloat16 (to nearest, ties to even), as float32."""
    u = np.asarray(x, F4).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return (rounded & 0xFFFFFFFF).astype(np.uint32).view(F4)


class Reference:
    """Softmax attention of queries (Nq, D) over keys (N, D) and values (N, Dv) in
    float64: scores (Nq, N) (scale q . k, or -scale/2 |q - k|^2), output, lse,
    weights; query i sees rows [0, valid_lens[i]) (None: all). `rounding` (Nq)
    bounds how far qkv's float32 scores may be from these, as qkv's C++ tests
    model it (tests/test_index.cc): 2 ((D + 2) 2^-23 max_j sum_c |term_jc| +
    2^-24 |lse|) + 1e-6, the terms being scale q_c k_c or scale/2 (q_c - k_c)^2."""

    def __init__(self, queries, keys, values, scoring, scale, valid_lens=None):
        q, k, v = (np.asarray(a, F8) for a in (queries, keys, values))
        if scoring == "dot":
            scale = 1 / np.sqrt(k.shape[1]) if scale is None else scale
            terms = np.abs(scale) * np.abs(q[:, None, :] * k[None, :, :]).sum(-1)
            s = scale * (q @ k.T)
        else:
            scale = 1.0 if scale is None else scale
            squared = ((q[:, None, :] - k[None, :, :]) ** 2).sum(-1)
            terms = scale / 2 * squared
            s = -scale / 2 * squared
        if valid_lens is not None:
            for i, n in enumerate(np.broadcast_to(valid_lens, (s.shape[0],))):
                s[i, n:] = -np.inf
        m = s.max(axis=1, initial=-np.inf)
        safe = np.where(np.isfinite(m), m, 0)
        w = np.exp(s - safe[:, None])
        total = w.sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            self.weights = np.where(total[:, None] > 0, w / total[:, None], 0)
            self.lse = np.where(total > 0, safe + np.log(total), -np.inf)
        self.scores, self.output = s, self.weights @ v
        self.max_v = np.linalg.norm(v, axis=1).max(initial=0)
        magnitude = terms.max(axis=1, initial=0)
        finite_lse = np.where(np.isfinite(self.lse), np.abs(self.lse), 0)
        self.rounding = 2 * ((k.shape[1] + 2) * 2.0 ** -23 * magnitude +
                             2.0 ** -24 * finite_lse) + 1e-6

    def check(self, output, lse, certificate=None, exact=True):
        """output and lse are attention over every row (exact), or over the rows an
        index visited, within `certificate` of it: the weight missed over the weight
        visited at most the certificate, the output within certificate * 2 max|v|,
        give or take the float scores' rounding."""
        cert = np.zeros(len(self.lse)) if certificate is None else certificate
        slack = np.expm1(self.rounding)
        none = self.lse == -np.inf  # queries with no row
        assert (lse[none] == -np.inf).all() and not output[none].any()
        some = ~none
        missed = np.expm1(self.lse[some] - lse[some].astype(F8))
        assert (missed <= cert[some] + (1 + cert[some]) * slack[some]).all(), \
            f"the certificate failed: missed {missed}, certificate {cert[some]}"
        if exact:
            assert (np.abs(lse[some] - self.lse[some]) <= self.rounding[some]).all(), \
                (lse, self.lse)
        error = np.linalg.norm(output.astype(F8) - self.output, axis=1)
        bound = 2 * (cert + slack) * self.max_v + 1e-5 * (1 + self.max_v)
        assert (error <= bound).all(), f"output off by {error}, bound {bound}"

    def check_top(self, ids, weights, k, lse=None, certificate=None, queries=None):
        """ids (Nq, k) are the rows of largest score (for `queries`, default all): each
        gives the score of NumPy's argsort's row of its rank (up to the rounding), and
        is that row where no other row scores within the rounding of it; the weights
        are exp(score - lse) (lse: the exact one unless given)."""
        queries = np.arange(len(self.lse)) if queries is None else np.flatnonzero(queries)
        want = np.argsort(-self.scores, axis=1, kind="stable")[:, :k]
        cert = np.zeros(len(self.lse)) if certificate is None else certificate
        for i in queries:
            tolerance = self.rounding[i]
            got_scores = self.scores[i, ids[i]]
            np.testing.assert_allclose(got_scores, self.scores[i, want[i]], rtol=0,
                                       atol=tolerance,
                                       err_msg=f"query {i}: ids {ids[i]}, NumPy's {want[i]}")
            ordered = np.sort(self.scores[i])[::-1]
            for p in range(k):
                nearest = np.abs(np.delete(ordered, p) - ordered[p]).min(initial=np.inf)
                if nearest > tolerance:
                    assert ids[i, p] == want[i, p], f"query {i} place {p}: {ids[i]} vs {want[i]}"
            weight = np.exp(got_scores - self.lse[i])
            np.testing.assert_allclose(weights[i], weight, rtol=0,
                                       atol=((cert[i] + 2 * np.expm1(tolerance)) * weight +
                                             1e-6).max())


def product_kernel(kernel, queries, keys, h):
    """(Nq, N) Nadaraya-Watson product kernel weights K((q - k) / h), unnormalised,
    in float64 (the difference of float32 values is exact there)."""
    u = (np.asarray(queries, F8)[:, None, :] - np.asarray(keys, F8)[None, :, :]) / h
    inside = np.abs(u) <= 1
    one = {"boxcar": np.ones_like(u), "epanechnikov": 1 - u ** 2,
           "triangular": 1 - np.abs(u)}[kernel]
    return np.where(inside, one, 0).prod(axis=2)


def top_rows(weights, k):
    """Each row's k largest weights' columns, largest first, ties to the smaller column."""
    return np.argsort(-weights, axis=1, kind="stable")[:, :k]


def clustered(rng, n, d, clusters=12, spread=0.15):
    """n keys around `clusters` centres far apart (an index skips most lists)."""
    centres = rng.normal(0, 3, (clusters, d))
    return (centres[rng.integers(0, clusters, n)] + rng.normal(0, spread, (n, d))).astype(F4)


def new_store(tmp_path, rng, n=700, d=6, dv=5, dtype="float32", chunk_rows=128, keys=None):
    keys = rng.standard_normal((n, d)).astype(F4) if keys is None else keys
    values = rng.standard_normal((n, dv)).astype(F4)
    store = qkv.KeyValueStore.create(tmp_path / "store.qkv", keys, values, dtype=dtype,
                                     chunk_rows=chunk_rows)
    return store, keys, values


# ---- round trips -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_create_then_read_back_gives_the_rows(tmp_path, rng, dtype):
    n, d, dv = int(rng.integers(1, 600)), int(rng.integers(1, 9)), int(rng.integers(1, 9))
    chunk_rows = int(rng.integers(1, 200))
    keys = (rng.standard_normal((n, d)) * 10).astype(F4)
    values = rng.standard_normal((n, dv)).astype(F4)
    store = qkv.KeyValueStore.create(tmp_path / "s", keys, values, dtype=dtype,
                                     chunk_rows=chunk_rows)
    assert (store.rows, store.key_dim, store.value_dim, store.dtype, store.chunk_rows) == \
        (n, d, dv, dtype, chunk_rows)
    assert store.num_chunks == -(-n // chunk_rows)
    assert store.dir == str(tmp_path / "s")
    rounded = (lambda x: x) if dtype == "float32" else bf16_round
    for got, want in ((store.keys(), rounded(keys)), (store.values(), rounded(values))):
        assert got.dtype == F4 and got.flags.c_contiguous
        np.testing.assert_array_equal(got, want)
    # Ranges that start and end inside chunks, cross them, or are empty.
    for _ in range(10):
        start = int(rng.integers(0, n + 1))
        stop = int(rng.integers(start, n + 1))
        np.testing.assert_array_equal(store.keys(start, stop), rounded(keys)[start:stop])
        np.testing.assert_array_equal(store.values(start, stop=stop), rounded(values)[start:stop])
    np.testing.assert_array_equal(store.values(start=n), np.zeros((0, dv), F4))
    # What is on disk is what opening it again reads.
    again = qkv.KeyValueStore.open(str(tmp_path / "s"))
    np.testing.assert_array_equal(again.keys(), rounded(keys))
    assert repr(again).startswith(f"qkv.KeyValueStore('{tmp_path / 's'}', rows={n}")


def test_the_reference_rounds_to_bfloat16_to_nearest_even():
    # Values whose rounding is known: ties (1 + 2^-8 between 1 and 1 + 2^-7) go to the
    # even mantissa, anything past a tie goes up.
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -2.5, 2 ** -130], F4)
    want = np.array([1.0, 1.0, 1 + 2 ** -6, 1 + 2 ** -7, -2.5, 2 ** -130], F4)
    np.testing.assert_array_equal(bf16_round(x), want)


def test_float64_and_strided_inputs_are_stored_as_float32(tmp_path, rng):
    keys64 = rng.standard_normal((90, 7)) * 1e3
    values64 = rng.standard_normal((7, 90)).T  # Fortran order
    strided = np.asfortranarray(rng.standard_normal((180, 14)).astype(F4))[::-2, ::2]
    store = qkv.KeyValueStore.create(tmp_path / "a", keys64, values64, chunk_rows=16)
    np.testing.assert_array_equal(store.keys(), keys64.astype(F4))
    np.testing.assert_array_equal(store.values(), values64.astype(F4))
    other = qkv.KeyValueStore.create(tmp_path / "b", strided, strided[:, :3])
    np.testing.assert_array_equal(other.keys(), strided)
    np.testing.assert_array_equal(other.values(), strided[:, :3])
    assert not strided.flags.c_contiguous and not strided.flags.f_contiguous


def test_append_adds_chunks_and_rows(tmp_path, rng):
    store, keys, values = new_store(tmp_path, rng, n=100, chunk_rows=64)
    more_k = rng.standard_normal((150, 6))  # float64: rounded
    more_v = rng.standard_normal((150, 5)).astype(F4)
    store.append(more_k, more_v)
    assert (store.rows, store.num_chunks) == (250, 2 + 3)
    all_k = np.concatenate([keys, more_k.astype(F4)])
    all_v = np.concatenate([values, more_v])
    np.testing.assert_array_equal(store.keys(), all_k)
    np.testing.assert_array_equal(store.values(90, 110), all_v[90:110])
    again = qkv.KeyValueStore.open(store.dir, check="structure")
    assert again.rows == 250
    again.verify()
    # Attention after the append covers the new rows.
    queries = rng.standard_normal((4, 6)).astype(F4)
    r = store.attend(queries, top_k=3)
    ref = Reference(queries, all_k, all_v, "dot", None)
    ref.check(r.output, r.lse)
    ref.check_top(r.top_ids, r.top_weights, 3)
    # Another object of the same store sees the rows once it appends itself
    # (the manifest is read again under the lock).
    stale = qkv.KeyValueStore.open(tmp_path / "store.qkv")
    store.append(more_k[:10], more_v[:10])
    stale.append(more_k[:5], more_v[:5])
    assert stale.rows == 265 and qkv.KeyValueStore.open(store.dir).rows == 265


def test_an_empty_store(tmp_path, rng):
    store = qkv.KeyValueStore.create(tmp_path / "e", np.zeros((0, 3), F4), np.zeros((0, 2), F4))
    assert (store.rows, store.num_chunks) == (0, 0)
    assert store.keys().shape == (0, 3) and store.values().shape == (0, 2)
    r = store.attend(rng.standard_normal((2, 3)))
    np.testing.assert_array_equal(r.output, np.zeros((2, 2), F4))
    np.testing.assert_array_equal(r.lse, np.full(2, -np.inf, F4))
    assert r.top_ids.shape == (2, 0) and r.top_weights.shape == (2, 0)
    store.verify()


# ---- attention over a store ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scoring", ["dot", "distance"])
def test_store_attention_is_softmax_over_every_row(tmp_path, rng, dtype, scoring):
    store, keys, values = new_store(tmp_path, rng, n=int(rng.integers(300, 900)), d=8, dv=4,
                                    dtype=dtype, chunk_rows=int(rng.integers(40, 300)))
    k, v = store.keys(), store.values()  # as stored (bfloat16 rounded)
    queries = rng.standard_normal((7, 8))  # float64: rounded to float32
    q = queries.astype(F4)
    if dtype == "bfloat16" and scoring == "dot":
        q = bf16_round(q)  # a bfloat16 store takes dot queries rounded to bfloat16
    scale = float(rng.uniform(0.2, 2.0))
    top_k = int(rng.integers(1, 6))
    r = store.attend(queries, scoring=scoring, scale=scale, top_k=top_k)
    ref = Reference(q, k, v, scoring, scale)
    ref.check(r.output, r.lse)
    assert r.output.dtype == F4 and r.lse.dtype == F4
    assert r.top_ids.dtype == np.int64 and r.top_weights.dtype == F4
    ref.check_top(r.top_ids, r.top_weights, top_k)
    # The default scale: 1/sqrt(D) for dot, 1 for distance; bandwidth h is scale 1/h^2.
    default = store.attend(queries, scoring=scoring)
    Reference(q, k, v, scoring, None).check(default.output, default.lse)
    if scoring == "distance":
        h = float(rng.uniform(0.5, 2))
        by_width = store.attend(queries, scoring="distance", bandwidth=h)
        np.testing.assert_array_equal(by_width.output,
                                      store.attend(queries, scoring="distance",
                                                   scale=1 / (h * h)).output)


def test_valid_lens_limit_each_query_to_the_first_rows(tmp_path, rng):
    store, keys, values = new_store(tmp_path, rng, n=300, chunk_rows=50)
    queries = rng.standard_normal((5, 6)).astype(F4)
    lens = np.array([0, 1, 49, 50, 300], np.int32)
    r = store.attend(queries, lens, top_k=2)
    Reference(queries, keys, values, "dot", None, lens).check(r.output, r.lse)
    assert r.lse[0] == -np.inf and not r.output[0].any()
    np.testing.assert_array_equal(r.top_ids[:2], [[-1, -1], [0, -1]])
    np.testing.assert_allclose(r.top_weights[:2], [[0, 0], [1, 0]], rtol=0, atol=1e-6)
    one = store.attend(queries, 120)  # one count for every query
    Reference(queries, keys, values, "dot", None, 120).check(one.output, one.lse)
    np.testing.assert_array_equal(store.attend(queries, valid_lens=lens[None]).output, r.output)


# ---- the index -------------------------------------------------------------------------------

@pytest.fixture
def indexed(tmp_path, rng):
    """A store of clustered keys (float32 or bfloat16 at random) and its index."""
    dtype = str(rng.choice(["float32", "bfloat16"]))
    store, keys, values = new_store(tmp_path, rng, n=1500, d=5, dv=3, dtype=dtype,
                                    chunk_rows=400, keys=clustered(rng, 1500, 5))
    index = qkv.Index.build(store, tmp_path / "index", lists=24, seed=int(rng.integers(0, 2**63)))
    return store, index


def test_build_gives_lists_over_every_row(indexed):
    store, index = indexed
    assert (index.rows, index.key_dim, index.value_dim, index.dtype, index.num_lists) == \
        (store.rows, store.key_dim, store.value_dim, store.dtype, 24)
    assert index.dir == str(store.dir).replace("store.qkv", "index")
    rows, radii, norms, centroids = index.list_rows, index.radii, index.max_norms, index.centroids
    assert rows.dtype == np.int64 and rows.sum() == store.rows and (rows >= 0).all()
    assert radii.dtype == F8 and norms.dtype == F8 and centroids.dtype == F4
    assert centroids.shape == (24, 5) and radii.shape == norms.shape == (24,)
    # Every store row in one list (the index's ids.npy, in list order), within that
    # list's radius of its centroid, its norm within the list's largest, and that
    # centroid its nearest (up to the float32 rounding of the assignment's scores).
    ids = np.load(f"{index.dir}/ids.npy")
    np.testing.assert_array_equal(np.sort(ids), np.arange(store.rows))
    list_of = np.empty(store.rows, np.int64)
    list_of[ids] = np.repeat(np.arange(24), rows)
    keys = store.keys().astype(F8)
    distance = np.linalg.norm(keys[:, None, :] - centroids[None].astype(F8), axis=2)
    own = distance[np.arange(store.rows), list_of]
    assert (own <= radii[list_of] * (1 + 1e-6)).all()
    assert (np.linalg.norm(keys, axis=1) <= norms[list_of] * (1 + 1e-6)).all()
    assert (own ** 2 - distance.min(axis=1) ** 2 <= 1e-4 * (1 + (keys ** 2).sum(axis=1))).all()
    assert (radii[rows == 0] == 0).all() and (norms[rows == 0] == 0).all()
    # Each list's box: its keys' least and greatest value per coordinate.
    low, high = index.box_low, index.box_high
    assert low.dtype == F4 and low.shape == (24, 5) and high.shape == (24, 5)
    for j in range(24):
        mine = keys[list_of == j]
        if len(mine):
            np.testing.assert_array_equal(low[j], mine.min(axis=0))
            np.testing.assert_array_equal(high[j], mine.max(axis=0))
        else:
            assert (low[j] == np.inf).all() and (high[j] == -np.inf).all()
    # Each block's box: its 64 keys' (a list's last block: the rest), in list order.
    in_order = keys[ids]
    block_low, block_high = index.block_low, index.block_high
    starts = [s for j in range(24) for s in range(int(rows[:j].sum()), int(rows[:j + 1].sum()), 64)]
    assert block_low.dtype == F4 and block_low.shape == (len(starts), 5) == block_high.shape
    for b, start in enumerate(starts):
        end = min(start + 64, next(e for e in np.cumsum(rows) if e > start))
        np.testing.assert_array_equal(block_low[b], in_order[start:end].min(axis=0))
        np.testing.assert_array_equal(block_high[b], in_order[start:end].max(axis=0))
    index.verify()
    index.check_built_over(store)
    again = qkv.Index.open(index.dir, check="checksums")
    np.testing.assert_array_equal(again.centroids, centroids)
    assert repr(again).endswith(f"dtype='{store.dtype}', lists=24)")


def test_the_same_seed_builds_the_same_index(tmp_path, rng):
    store, _, _ = new_store(tmp_path, rng, n=400)
    seed = int(rng.integers(0, 2**64, dtype=np.uint64))
    a = qkv.Index.build(store, tmp_path / "a", lists=9, seed=seed, iterations=4)
    b = qkv.Index.build(store, tmp_path / "b", lists=9, seed=seed, iterations=4)
    np.testing.assert_array_equal(a.centroids, b.centroids)
    np.testing.assert_array_equal(a.list_rows, b.list_rows)
    default = qkv.Index.build(store, tmp_path / "c")
    assert default.num_lists == int(4 * np.sqrt(400))


def exact_reference(store, queries, scoring, scale):
    """Attention over every row of the store as stored (Reference)."""
    q = np.asarray(queries, F4)
    if store.dtype == "bfloat16" and scoring == "dot":
        q = bf16_round(q)  # a bfloat16 index takes dot queries rounded to bfloat16
    return Reference(q, store.keys(), store.values(), scoring, scale)


@pytest.mark.parametrize("scoring,scale,epsilon", [("distance", 4.0, 1e-3), ("distance", 1.0, 0.1),
                                                   ("dot", 2.0, 1e-3), ("dot", None, 0.05)])
def test_certified_attention_is_within_its_bound(indexed, rng, scoring, scale, epsilon):
    store, index = indexed
    keys = store.keys()
    # Queries near keys, and a few far out.
    queries = (keys[rng.integers(0, len(keys), 12)] + rng.normal(0, 0.3, (12, 5))).astype(F4)
    queries[-2:] *= 5
    top_k = 3
    r = index.attend(queries, scoring=scoring, scale=scale, epsilon=epsilon, top_k=top_k)
    ref = exact_reference(store, queries, scoring, scale)
    assert r.certificate.dtype == F8 and (r.certificate >= 0).all()
    assert (r.certificate <= epsilon).all()
    # The certificate bounds the weight left out, (exact total - visited) / visited,
    # and the output is within certificate * 2 max|v|.
    ref.check(r.output, r.lse, r.certificate, exact=False)
    assert (r.lists_visited >= 1).all() and (r.lists_visited <= 24).all()
    assert (r.rows_visited <= store.rows).all()
    if scoring == "distance":  # clustered keys: the bounds leave lists out
        assert (r.rows_visited < store.rows).any(), r.rows_visited
    # Top rows: the exact ones where certified, their weights over the visited rows.
    certified = r.top_certified
    assert certified.dtype == np.bool_ and certified.shape == (12,)
    ref.check_top(r.top_ids, r.top_weights, top_k, certificate=r.certificate, queries=certified)


@pytest.mark.parametrize("scoring", ["dot", "distance"])
def test_epsilon_zero_is_exact_attention(indexed, rng, scoring):
    store, index = indexed
    queries = rng.normal(0, 2, (9, 5))
    r = index.attend(queries, scoring=scoring, epsilon=0, top_k=4)
    ref = exact_reference(store, queries, scoring, None)
    ref.check(r.output, r.lse)
    np.testing.assert_array_equal(r.certificate, np.zeros(9))
    np.testing.assert_array_equal(r.lists_visited, np.full(9, 24))
    np.testing.assert_array_equal(r.rows_visited, np.full(9, store.rows))
    assert r.top_certified.all()
    ref.check_top(r.top_ids, r.top_weights, 4)
    # The same as attention over the store, to float rounding.
    over_store = store.attend(queries, scoring=scoring)
    ref.check(over_store.output, over_store.lse)


def test_probe_visits_that_many_lists_and_still_bounds_what_it_left_out(indexed, rng):
    store, index = indexed
    queries = rng.normal(0, 2, (6, 5)).astype(F4)
    probe = int(rng.integers(1, 6))
    r = index.attend(queries, scoring="distance", probe=probe)
    np.testing.assert_array_equal(r.lists_visited, np.full(6, probe))
    exact_reference(store, queries, "distance", None).check(r.output, r.lse, r.certificate,
                                                            exact=False)


@pytest.mark.parametrize("kernel", ["boxcar", "epanechnikov", "triangular"])
def test_compact_kernels_weigh_every_row_by_the_product_kernel(indexed, rng, kernel):
    store, index = indexed
    keys, values = store.keys(), store.values()
    queries = (keys[rng.integers(0, len(keys), 8)] + rng.normal(0, 0.2, (8, 5))).astype(F4)
    queries[-1] = 100  # no row in reach
    h = float(rng.uniform(0.2, 0.8))
    top_k = 5
    r = index.attend(queries, kernel=kernel, bandwidth=h, top_k=top_k)
    K = product_kernel(kernel, queries, keys, h)
    total = K.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(total[:, None] > 0, K @ values.astype(F8) / total[:, None], 0)
        lse = np.log(total)
    np.testing.assert_allclose(r.output, out, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(r.lse, lse, rtol=1e-5, atol=2e-5)
    assert r.lse[-1] == -np.inf and not r.output[-1].any() and r.rows_visited[-1] == 0
    np.testing.assert_array_equal(r.certificate, np.zeros(8))
    assert r.top_certified.all()
    # Top rows: NumPy's argsort of the weights (ties: the smaller row), -1 past the rows in reach.
    want = top_rows(K, top_k)
    in_reach = np.take_along_axis(K, want, 1) > 0
    np.testing.assert_array_equal(r.top_ids, np.where(in_reach, want, -1))
    with np.errstate(divide="ignore", invalid="ignore"):
        weights = np.where(in_reach, np.take_along_axis(K, want, 1) / total[:, None], 0)
    np.testing.assert_allclose(r.top_weights, weights, rtol=1e-5, atol=1e-7)
    assert (r.rows_visited < store.rows).any()  # a range query reads a part of the rows


# ---- the same bits as the qkv command -----------------------------------------------------------

def run_cli(cli, *args):
    proc = subprocess.run([cli, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"qkv {' '.join(map(str, args))}: {proc.stderr}"


def test_store_attention_bits_equal_the_cli(qkv_cli, tmp_path, rng):
    store, keys, values = new_store(tmp_path, rng, n=500, dtype=str(rng.choice(["float32",
                                                                                   "bfloat16"])))
    queries = rng.standard_normal((6, 6))
    lens = rng.integers(0, 501, 6)
    np.save(tmp_path / "q.npy", queries)
    np.save(tmp_path / "lens.npy", lens)
    for options, kwargs in ((["--top-k", 4], {"top_k": 4}),
                            (["--scoring", "distance", "--bandwidth", 1.5, "--top-k", 2],
                             {"scoring": "distance", "bandwidth": 1.5, "top_k": 2})):
        run_cli(qkv_cli, "attend", "--store", store.dir, "--queries", tmp_path / "q.npy",
                "--valid-lens", tmp_path / "lens.npy", "--out", tmp_path / "o.npy", "--lse",
                tmp_path / "lse.npy", "--top-ids", tmp_path / "ids.npy", "--top-weights",
                tmp_path / "w.npy", "--quiet", *options)
        r = store.attend(queries, lens, **kwargs)
        for name, got in (("o", r.output), ("lse", r.lse), ("ids", r.top_ids),
                          ("w", r.top_weights)):
            want = np.load(tmp_path / f"{name}.npy")
            assert want.dtype == got.dtype and want.shape == got.shape, name
            np.testing.assert_array_equal(got, want, err_msg=f"{name} with {options}")


def test_index_attention_bits_equal_the_cli(qkv_cli, tmp_path, indexed, rng):
    store, index = indexed
    queries = rng.normal(0, 2, (10, 5)).astype(F4)
    np.save(tmp_path / "q.npy", queries)
    cases = [
        (["--epsilon", 0.01, "--top-k", 3], {"epsilon": 0.01, "top_k": 3}),
        (["--scoring", "distance", "--scale", 2.0, "--probe", 3],
         {"scoring": "distance", "scale": 2.0, "probe": 3}),
        (["--kernel", "triangular", "--bandwidth", 0.7, "--top-k", 2],
         {"kernel": "triangular", "bandwidth": 0.7, "top_k": 2}),
    ]
    for options, kwargs in cases:
        run_cli(qkv_cli, "attend", "--store", store.dir, "--index", index.dir, "--queries",
                tmp_path / "q.npy", "--out", tmp_path / "o.npy", "--lse", tmp_path / "lse.npy",
                "--certificate", tmp_path / "c.npy", "--quiet", *options,
                *(["--top-ids", tmp_path / "ids.npy", "--top-weights", tmp_path / "w.npy"]
                  if "top_k" in kwargs else []))
        r = index.attend(queries, **kwargs)
        outputs = [("o", r.output), ("lse", r.lse), ("c", r.certificate)]
        if "top_k" in kwargs:
            outputs += [("ids", r.top_ids), ("w", r.top_weights)]
        for name, got in outputs:
            want = np.load(tmp_path / f"{name}.npy")
            assert want.dtype == got.dtype and want.shape == got.shape, name
            np.testing.assert_array_equal(got, want, err_msg=f"{name} with {options}")


# ---- threads --------------------------------------------------------------------------------

def other_thread_ran_during(call):
    """Whether another Python thread ran in the middle half of call() (time stamps
    at most every 0.5 ms): with the GIL held by the call it could not."""
    stamps, state = [], {"stop": False}

    def counter():
        last = 0.0
        while not state["stop"]:
            now = time.perf_counter()
            if now - last >= 0.0005:
                stamps.append(now)
                last = now

    thread = threading.Thread(target=counter)
    thread.start()
    try:
        time.sleep(0.02)
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
    finally:
        state["stop"] = True
        thread.join()
    assert t1 - t0 > 0.03, f"the call took {1e3 * (t1 - t0):.0f} ms: too short to tell"
    lo, hi = t0 + 0.25 * (t1 - t0), t1 - 0.25 * (t1 - t0)
    return any(lo <= t <= hi for t in stamps)


def test_attention_releases_the_gil(tmp_path, rng):
    before = qkv.get_num_threads()
    qkv.set_num_threads(1)
    try:
        keys = rng.standard_normal((100_000, 32)).astype(F4)
        store = qkv.KeyValueStore.create(tmp_path / "s", keys, keys, chunk_rows=30_000)
        index = qkv.Index.build(store, tmp_path / "i", lists=50, iterations=2)
        queries = rng.standard_normal((256, 32)).astype(F4)
        built = iter(range(10))
        calls = {"KeyValueStore.attend": lambda: store.attend(queries, top_k=4),
                 "Index.attend": lambda: index.attend(queries[:96], epsilon=0),
                 "Index.build": lambda: qkv.Index.build(store, tmp_path / f"b{next(built)}",
                                                        lists=200, iterations=40)}
        for name, call in calls.items():
            # Up to 3 tries, in case the machine's other work kept the counting
            # thread off the CPUs for a whole call.
            assert any(other_thread_ran_during(call) for _ in range(3)), name
    finally:
        qkv.set_num_threads(before)


def test_a_store_shared_by_threads_reads_whole_appends(tmp_path, rng):
    """Reads in one thread while another appends to the same object: each read
    sees the store before or after an append, never between."""
    batch, batches = 50, 12
    keys = rng.standard_normal((batch * (batches + 1), 4)).astype(F4)
    values = rng.standard_normal((len(keys), 3)).astype(F4)
    store = qkv.KeyValueStore.create(tmp_path / "s", keys[:batch], values[:batch],
                                     chunk_rows=32)
    seen, errors = [], []

    def reader():
        try:
            while len(seen) < 2000 and store.rows < len(keys):
                got = store.keys()
                seen.append(len(got))
                np.testing.assert_array_equal(got, keys[:len(got)])
                r = store.attend(keys[:2], top_k=1)
                assert r.top_ids.max() < len(keys)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    for b in range(1, batches + 1):
        store.append(keys[b * batch:(b + 1) * batch], values[b * batch:(b + 1) * batch])
    thread.join()
    assert not errors, errors
    assert seen and all(n % batch == 0 for n in seen), sorted(set(seen))
    assert store.rows == len(keys)
    np.testing.assert_array_equal(store.values(), values)


# ---- docs/python.md's example -------------------------------------------------------------------

SOURCE = os.environ.get("QKV_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_docs_example_runs_as_written(tmp_path, monkeypatch):
    with open(os.path.join(SOURCE, "docs", "python.md")) as f:
        page = f.read()
    section = page[page.index("## The store and its index"):]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its mkdtemp() lands here
    names = {}
    exec(compile(example, "docs/python.md", "exec"), names)
    store, index, r = names["store"], names["index"], names["r"]
    # Two appends of 100 rows; the index updated after the second.
    assert store.rows == 10_200 and index.rows == 10_200 and r.output.shape == (4, 8)
    index.check_built_over(store)
    assert names["d_q"].shape == (4, 16) and np.isfinite(names["d_q"]).all()
    # The range query read a part of the rows, exactly (certificate 0).
    assert (r.rows_visited < store.rows // 4).all() and not r.certificate.any()
    np.testing.assert_array_equal(names["first_rows"], names["keys"][:10])


# ---- errors ----------------------------------------------------------------------------------

def check_raises(call, kind, fn, parts):
    """call() raises `kind` (TypeError, ValueError or qkv.Error, exactly) whose one-line
    message starts with 'fn: ' and holds every string of `parts`."""
    with pytest.raises(Exception) as info:
        call()
    e = info.value
    if kind is qkv.Error:
        assert type(e) is qkv.Error, f"{type(e).__name__}: {e}"
    elif kind is TypeError:
        assert isinstance(e, TypeError) and not isinstance(e, ValueError), repr(e)
    else:
        assert isinstance(e, kind), repr(e)
    message = str(e)
    assert message.startswith(f"{fn}: "), f"message does not name {fn}: {message}"
    for part in parts:
        assert part in message, f"{part!r} not in the message: {message}"
    assert "\n" not in message, message


def test_store_errors(tmp_path, rng):
    store, keys, values = new_store(tmp_path, rng, n=50, chunk_rows=20)
    create = qkv.KeyValueStore.create
    q = rng.standard_normal((3, 6)).astype(F4)
    cases = [
        (lambda: create(tmp_path / "x", keys, values, dtype="float16"), qkv.Error,
         "KeyValueStore.create", ["dtype = 'float16' is not a store dtype; expected 'float32' or "
                                  "'bfloat16'"]),
        (lambda: create(tmp_path / "x", keys[0], values), qkv.Error, "KeyValueStore.create",
         ["keys has shape [6]; expected rank 2 (N, D)"]),
        (lambda: create(tmp_path / "x", keys, values[None]), qkv.Error, "KeyValueStore.create",
         ["values has shape [1, 50, 5]; expected rank 2 (N, Dv)"]),
        (lambda: create(tmp_path / "x", keys, values[:40]), qkv.Error, "KeyValueStore.create",
         ["keys has shape [50, 6] but values has shape [40, 5]; expected one value row per key "
          "row"]),
        (lambda: create(tmp_path / "x", keys[:, :0], values), qkv.Error, "KeyValueStore.create",
         ["expected D >= 1 and Dv >= 1"]),
        (lambda: create(tmp_path / "x", keys, values, chunk_rows=0), qkv.Error,
         "KeyValueStore.create", ["chunk_rows = 0; expected >= 1"]),
        (lambda: create(store.dir, keys, values), qkv.Error, "KeyValueStore.create",
         [f"{store.dir}: already exists; a new store needs a new path"]),
        (lambda: create(tmp_path / "x", np.full((2, 2), 1e39), np.ones((2, 2))), qkv.Error,
         "KeyValueStore.create", ["keys[0, 0] is 1e+39, beyond float32's range"]),
        (lambda: create(tmp_path / "x", keys.astype(np.int32), values), TypeError,
         "KeyValueStore.create", ["keys has dtype int32; expected float32 or float64"]),
        (lambda: create(3, keys, values), TypeError, "KeyValueStore.create",
         ["dir is a int; expected a path"]),
        (lambda: qkv.KeyValueStore.open(tmp_path / "missing"), qkv.Error, "KeyValueStore.open",
         [f"{tmp_path / 'missing'}: cannot open the store"]),
        (lambda: qkv.KeyValueStore.open(tmp_path), qkv.Error, "KeyValueStore.open",
         [f"{tmp_path}: not a store: no manifest.json"]),
        (lambda: qkv.KeyValueStore.open(store.dir, check="all"), qkv.Error, "KeyValueStore.open",
         ["check = 'all' is not a check; expected 'checksums'", "or 'structure'"]),
        (lambda: store.append(keys[:, :4], values), qkv.Error, "KeyValueStore.append",
         [f"keys has shape [50, 4] and values has shape [50, 5] but store {store.dir} holds "
          "D = 6, Dv = 5"]),
        (lambda: store.append(keys, values[:, :2]), qkv.Error, "KeyValueStore.append",
         ["keys has shape [50, 6] and values has shape [50, 2]", "holds D = 6, Dv = 5"]),
        (lambda: store.keys(10, 5), qkv.Error, "KeyValueStore.keys",
         ["start = 10, stop = 5; expected 0 <= start <= stop <= 50 (the store's rows)"]),
        (lambda: store.values(0, 51), qkv.Error, "KeyValueStore.values",
         ["start = 0, stop = 51; expected 0 <= start <= stop <= 50"]),
        (lambda: store.keys(-1), qkv.Error, "KeyValueStore.keys", ["start = -1, stop = None"]),
        (lambda: store.attend(q[:, :4]), qkv.Error, "KeyValueStore.attend",
         [f"queries has shape [3, 4] but store {store.dir} has keys of D = 6"]),
        (lambda: store.attend(q[0]), qkv.Error, "KeyValueStore.attend",
         ["queries has shape [6]; expected rank 2 (Nq, D)"]),
        (lambda: store.attend(q, scoring="additive"), qkv.Error, "KeyValueStore.attend",
         ["scoring = 'additive' is not a scoring function over a store; expected 'dot' or "
          "'distance'"]),
        (lambda: store.attend(q, scoring="distance", scale=-1.0), qkv.Error,
         "KeyValueStore.attend", ["scale = -1.000000; expected a finite number > 0"]),
        (lambda: store.attend(q, scoring="distance", scale=1e50), qkv.Error,
         "KeyValueStore.attend", ["scale = 1e+50 is too large: beyond float32's range"]),
        (lambda: store.attend(q, scoring="distance", bandwidth=1e-25), qkv.Error,
         "KeyValueStore.attend", ["bandwidth = 1e-25 is too small: the scale 1/bandwidth^2 = "
                                  "1e+50 is beyond float32's range"]),
        (lambda: store.attend(q, scoring="distance", bandwidth=0.0), qkv.Error,
         "KeyValueStore.attend", ["bandwidth = 0; expected a finite number > 0"]),
        (lambda: store.attend(q, bandwidth=1.0), qkv.Error, "KeyValueStore.attend",
         ["bandwidth = 1 is for scoring='distance' (its scale is 1/bandwidth^2); scoring='dot' "
          "takes scale"]),
        (lambda: store.attend(q, scoring="distance", bandwidth=1.0, scale=1.0), qkv.Error,
         "KeyValueStore.attend", ["bandwidth = 1 and scale = 1 are one setting"]),
        (lambda: store.attend(q, top_k=51), qkv.Error, "KeyValueStore.attend",
         ["top_k = 51; expected 0 to the store's 50 rows"]),
        (lambda: store.attend(q, top_k=-1), qkv.Error, "KeyValueStore.attend",
         ["top_k = -1; expected 0 to the store's 50 rows"]),
        (lambda: store.attend(q, [1, 2]), qkv.Error, "KeyValueStore.attend",
         ["valid_lens has shape [2] but queries has shape [3, 6]"]),
        (lambda: store.attend(q, [1, 2, 51]), qkv.Error, "KeyValueStore.attend",
         ["valid_lens[0, 2] = 51 is outside [0, 50]"]),
        (lambda: store.attend(q, [1.0, 2.0, 3.0]), TypeError, "KeyValueStore.attend",
         ["valid_lens has dtype float64; expected integers"]),
        (lambda: store.attend(q.astype(np.float16)), TypeError, "KeyValueStore.attend",
         ["queries has dtype float16; expected float32 or float64"]),
    ]
    for call, kind, fn, parts in cases:
        check_raises(call, kind, fn, parts)
    assert not (tmp_path / "x").exists()  # no failed create left anything
    assert store.rows == 50 and qkv.KeyValueStore.open(store.dir).rows == 50


def damage(path, offset_from_end=3):
    """Flips one byte of the file near its end (inside the data, past the .npy header)."""
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_damaged_store_is_named_by_its_file(tmp_path, rng):
    store, keys, values = new_store(tmp_path, rng, n=100, chunk_rows=30)
    chunk = tmp_path / "store.qkv" / "values-000002.npy"
    assert chunk.exists()
    damage(chunk)
    check_raises(store.verify, qkv.Error, "KeyValueStore.verify",
                 [f"{chunk}: checksum", "does not match the manifest's"])
    check_raises(lambda: qkv.KeyValueStore.open(store.dir), qkv.Error, "KeyValueStore.open",
                 [f"{chunk}: checksum"])
    qkv.KeyValueStore.open(store.dir, check="structure")  # sizes and headers are intact
    truncated = tmp_path / "store.qkv" / "keys-000001.npy"
    truncated.write_bytes(truncated.read_bytes()[:-8])
    check_raises(lambda: qkv.KeyValueStore.open(store.dir, check="structure"), qkv.Error,
                 "KeyValueStore.open", [str(truncated)])
    check_raises(lambda: store.attend(rng.standard_normal((2, 6))), qkv.Error,
                 "KeyValueStore.attend", [str(truncated)])
    check_raises(lambda: store.keys(), qkv.Error, "KeyValueStore.keys", [str(truncated)])


def test_index_errors(tmp_path, rng):
    store, keys, values = new_store(tmp_path, rng, n=60, chunk_rows=25)
    index = qkv.Index.build(store, tmp_path / "index", lists=4)
    build, q = qkv.Index.build, rng.standard_normal((2, 6)).astype(F4)
    cases = [
        (lambda: build(store.dir, tmp_path / "i2"), TypeError, "Index.build",
         ["store is a str; expected a qkv.KeyValueStore"]),
        (lambda: build(store, index.dir), qkv.Error, "Index.build", [index.dir, "already exists"]),
        (lambda: build(store, tmp_path / "i2", lists=61), qkv.Error, "Index.build",
         ["lists = 61; expected 1 to the store's 60 rows"]),
        (lambda: build(store, tmp_path / "i2", iterations=1001), qkv.Error, "Index.build",
         ["iterations = 1001; expected 0 to 1000"]),
        (lambda: build(store, tmp_path / "i2", sample_per_list=0), qkv.Error, "Index.build",
         ["sample_per_list = 0; expected 1 to 2^20"]),
        (lambda: build(store, tmp_path / "i2", seed=-1), ValueError, "Index.build",
         ["seed = -1 is outside [0, 2**64)"]),
        (lambda: qkv.Index.open(tmp_path / "missing"), qkv.Error, "Index.open",
         [f"no index at {tmp_path / 'missing'}"]),
        (lambda: qkv.Index.open(index.dir, check="none"), qkv.Error, "Index.open",
         ["check = 'none' is not a check"]),
        (lambda: index.check_built_over(keys), TypeError, "Index.check_built_over",
         ["store is a ndarray; expected a qkv.KeyValueStore"]),
        (lambda: index.attend(q, epsilon=-0.5), qkv.Error, "Index.attend",
         ["epsilon = -0.5; expected a finite number >= 0 (0 visits every list: exact attention)"]),
        (lambda: index.attend(q, epsilon=float("nan")), qkv.Error, "Index.attend",
         ["epsilon = nan; expected a finite number >= 0"]),
        (lambda: index.attend(q, probe=-1), qkv.Error, "Index.attend",
         ["probe = -1; expected 0 (certified, by epsilon) or a number of lists >= 1"]),
        (lambda: index.attend(q, probe=2, epsilon=0.1), qkv.Error, "Index.attend",
         ["epsilon = 0.1 and probe = 2 are two ways to stop; give one"]),
        (lambda: index.attend(q, kernel="boxcar"), qkv.Error, "Index.attend",
         ["kernel = 'boxcar' needs bandwidth, its width h > 0"]),
        (lambda: index.attend(q, kernel="boxcar", bandwidth=-1.0), qkv.Error, "Index.attend",
         ["bandwidth = -1; expected a finite number > 0"]),
        (lambda: index.attend(q, kernel="triangular", bandwidth=1.0, scoring="distance"),
         qkv.Error, "Index.attend",
         ["scoring = 'distance' does not go with kernel = 'triangular': its weights are "
          "K((q - k) / bandwidth), exact"]),
        (lambda: index.attend(q, kernel="boxcar", bandwidth=1.0, epsilon=0.1), qkv.Error,
         "Index.attend", ["epsilon = 0.1 does not go with kernel = 'boxcar'"]),
        (lambda: index.attend(q, kernel="boxcar", bandwidth=1.0, probe=2), qkv.Error,
         "Index.attend", ["probe = 2 does not go with kernel = 'boxcar'"]),
        (lambda: index.attend(q, kernel="boxcar", bandwidth=1.0, scale=2.0), qkv.Error,
         "Index.attend", ["scale = 2 does not go with kernel = 'boxcar'"]),
        (lambda: index.attend(q, kernel="cosine"), qkv.Error, "Index.attend",
         ["kernel = 'cosine' is not a kernel; expected 'gaussian' (softmax of the scores), "
          "'boxcar' (or 'uniform'), 'epanechnikov' or 'triangular'"]),
        (lambda: index.attend(q, bandwidth=1.0), qkv.Error, "Index.attend",
         ["bandwidth = 1 is for scoring='distance' (its scale is 1/bandwidth^2) or a compact "
          "kernel"]),
        (lambda: index.attend(q, scoring="bilinear"), qkv.Error, "Index.attend",
         ["scoring = 'bilinear' is not a scoring function over a store"]),
        (lambda: index.attend(q, top_k=61), qkv.Error, "Index.attend",
         ["top_k = 61; expected 0 to the index's 60 rows"]),
        (lambda: index.attend(q[:, :3]), qkv.Error, "Index.attend",
         [f"queries has shape [2, 3] but index {index.dir} has keys of D = 6"]),
        (lambda: index.attend(np.full((1, 6), np.inf, F4)), qkv.Error, "Index.attend",
         ["queries[0, 0] is inf", "expected finite numbers"]),
        (lambda: index.attend(q[None]), qkv.Error, "Index.attend",
         ["queries has shape [1, 2, 6]; expected rank 2 (Nq, D)"]),
    ]
    for call, kind, fn, parts in cases:
        check_raises(call, kind, fn, parts)
    assert not (tmp_path / "i2").exists()


def test_a_stale_or_foreign_index_is_refused(tmp_path, rng):
    store, keys, values = new_store(tmp_path, rng, n=80)
    index = qkv.Index.build(store, tmp_path / "index", lists=5)
    other = qkv.KeyValueStore.create(tmp_path / "other", keys[::-1], values)
    check_raises(lambda: index.check_built_over(other), qkv.Error, "Index.check_built_over",
                 [f"index {index.dir} was built over another store than store {other.dir}",
                  "build it again over this one"])
    narrow = qkv.KeyValueStore.create(tmp_path / "narrow", keys[:, :2], values)
    check_raises(lambda: index.check_built_over(narrow), qkv.Error, "Index.check_built_over",
                 ["was built over float32 rows of D = 6, Dv = 5, not store"])
    store.append(keys[:3], values[:3])
    check_raises(lambda: index.check_built_over(store), qkv.Error, "Index.check_built_over",
                 [f"was built over 80 rows of store {store.dir}, which now has 83",
                  "the index is stale; update it (qkv index update) or build it again"])
    qkv.Index.build(store, tmp_path / "fresh", lists=5).check_built_over(store)


def test_a_damaged_index_is_named_by_its_file(tmp_path, rng):
    store, _, _ = new_store(tmp_path, rng, n=90)
    index = qkv.Index.build(store, tmp_path / "index", lists=6)
    values_file = tmp_path / "index" / "values.npy"
    damage(values_file)
    check_raises(index.verify, qkv.Error, "Index.verify", [f"{values_file}: checksum"])
    check_raises(lambda: qkv.Index.open(index.dir, check="checksums"), qkv.Error, "Index.open",
                 [f"{values_file}: checksum"])
    qkv.Index.open(index.dir)  # the structure is intact


METHOD_CALLS = [  # (name, call with an unknown keyword, the arguments it lists)
    ("qkv.KeyValueStore.create", lambda s, i: qkv.KeyValueStore.create("x", 1, 1, chunk=2),
     "dir, keys, values, dtype, chunk_rows"),
    ("qkv.KeyValueStore.open", lambda s, i: qkv.KeyValueStore.open(s.dir, checks="structure"),
     "dir, check"),
    ("qkv.KeyValueStore.append", lambda s, i: s.append(1, 1, dtype="float32"), "keys, values"),
    ("qkv.KeyValueStore.verify", lambda s, i: s.verify(check=1), "no arguments"),
    ("qkv.KeyValueStore.keys", lambda s, i: s.keys(end=3), "start, stop"),
    ("qkv.KeyValueStore.values", lambda s, i: s.values(end=3), "start, stop"),
    ("qkv.KeyValueStore.attend", lambda s, i: s.attend(1, epsilon=0.1),
     "queries, valid_lens, scoring, scale, bandwidth, top_k"),
    ("qkv.Index.build", lambda s, i: qkv.Index.build(s, "x", nlist=3),
     "store, dir, lists, iterations, seed, sample_per_list"),
    ("qkv.Index.open", lambda s, i: qkv.Index.open(i.dir, checks="x"), "dir, check"),
    ("qkv.Index.verify", lambda s, i: i.verify(quiet=True), "no arguments"),
    ("qkv.Index.check_built_over", lambda s, i: i.check_built_over(store=s, strict=1), "store"),
    ("qkv.Index.attend", lambda s, i: i.attend(1, nprobe=3),
     "queries, scoring, scale, epsilon, probe, top_k, kernel, bandwidth"),
]


@pytest.mark.parametrize("name,call,listed", METHOD_CALLS, ids=[c[0] for c in METHOD_CALLS])
def test_an_unknown_keyword_is_named(tmp_path, rng, name, call, listed):
    store, _, _ = new_store(tmp_path, rng, n=20)
    index = qkv.Index.build(store, tmp_path / "index", lists=2)
    with pytest.raises(TypeError) as info:
        call(store, index)
    message = str(info.value)
    assert message.startswith(f"{name}: unknown argument ") and f"(it takes {listed})" in message, \
        message


def test_arguments_of_the_wrong_kind_are_named(tmp_path, rng):
    store, _, _ = new_store(tmp_path, rng, n=20)
    index = qkv.Index.build(store, tmp_path / "index", lists=2)
    q = np.ones((1, 6), F4)
    cases = [
        (lambda: store.attend(q, scoring=1), "qkv.KeyValueStore.attend",
         "scoring takes a string, not an int: scoring=1"),
        (lambda: store.attend(q, top_k="3"), "qkv.KeyValueStore.attend",
         "top_k takes an integer, not a str: top_k='3'"),
        (lambda: index.attend(q, epsilon="small"), "qkv.Index.attend",
         "epsilon takes a number or None, not a str: epsilon='small'"),
        (lambda: index.attend(q, kern="boxcar"), "qkv.Index.attend",
         "unknown argument kern='boxcar'; did you mean kernel?"),
        (lambda: qkv.KeyValueStore.create(tmp_path / "x", q, q, dtype=np.float32),
         "qkv.KeyValueStore.create", "dtype takes a string, not a type"),
        (lambda: qkv.Index.build(store), "qkv.Index.build", "missing argument dir"),
        (lambda: store.attend(q, None, "dot"), "qkv.KeyValueStore.attend",
         "takes 2 positional arguments (queries, valid_lens) but was given 3"),
    ]
    for call, fn, part in cases:
        check_raises(call, TypeError, fn, [part])


# ---- garbage never crashes (in a child process, as test_errors.py's sweep) ------------------

GARBAGE = {"None": None, "str": "abc", "bytes": b"xy", "dict": {}, "object": object(),
           "ragged": [[1.0], [1.0, 2.0]], "complex": 1j, "negative": -3, "nan": float("nan")}


def legal(name, label):
    """Garbage that is a legal value: None for optional arguments, strings as paths,
    numbers where numbers go."""
    if label == "None" and name in ("valid_lens", "scale", "bandwidth", "epsilon", "stop"):
        return True
    return ((name == "dir" and label in ("str", "bytes"))
            or (name == "scale" and label == "negative"))


def run_sweep(seed, root):
    os.chdir(root)  # a garbage path that is a path lands here
    rng = np.random.default_rng(seed)
    keys, values = rng.standard_normal((40, 3)).astype(F4), rng.standard_normal((40, 2))
    store = qkv.KeyValueStore.create(os.path.join(root, "s"), keys, values, chunk_rows=16)
    index = qkv.Index.build(store, os.path.join(root, "i"), lists=3)
    q = keys[:2]
    made = iter(range(10 ** 6))
    calls = [
        ("KeyValueStore.create", qkv.KeyValueStore.create,
         lambda: {"dir": os.path.join(root, f"n{next(made)}"), "keys": keys, "values": values,
                  "dtype": "bfloat16", "chunk_rows": 7}),
        ("KeyValueStore.open", qkv.KeyValueStore.open,
         lambda: {"dir": store.dir, "check": "structure"}),
        ("KeyValueStore.append", store.append, lambda: {"keys": keys[:2], "values": values[:2]}),
        ("KeyValueStore.keys", store.keys, lambda: {"start": 1, "stop": 3}),
        ("KeyValueStore.attend", store.attend,
         lambda: {"queries": q, "valid_lens": [1, 2], "scoring": "distance", "scale": None,
                  "bandwidth": 0.5, "top_k": 2}),
        ("Index.build", qkv.Index.build,
         lambda: {"store": store, "dir": os.path.join(root, f"n{next(made)}"), "lists": 2,
                  "iterations": 2, "seed": 3, "sample_per_list": 5}),
        ("Index.open", qkv.Index.open, lambda: {"dir": index.dir, "check": "checksums"}),
        ("Index.check_built_over", index.check_built_over, lambda: {"store": index_store}),
        ("Index.attend", index.attend,
         lambda: {"queries": q, "scoring": "dot", "scale": 0.5, "epsilon": 0.01, "top_k": 1,
                  "kernel": "gaussian", "bandwidth": None}),
    ]
    index_store = qkv.KeyValueStore.open(store.dir)  # before the sweep's appends
    for fn, target, make in calls:
        target(**make())  # the valid call works
        for name in make():
            for label, value in GARBAGE.items():
                if legal(name, label):
                    continue
                try:
                    target(**dict(make(), **{name: value}))
                    outcome = "returned"
                except (TypeError, ValueError) as e:
                    outcome = "TypeError" if isinstance(e, TypeError) else "ValueError"
                except Exception as e:  # noqa: BLE001 (reported, and fails the test)
                    outcome = f"{type(e).__module__}.{type(e).__name__}: {e}"
                print(json.dumps([fn, name, label, outcome]), flush=True)
    print("done", flush=True)


def test_garbage_gives_type_or_value_errors_never_a_crash(tmp_path, seed):
    proc = subprocess.run([sys.executable, __file__, "--sweep", str(seed), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, (f"the sweep died (status {proc.returncode}) after "
                                  f"{lines[-1] if lines else 'nothing'}: {proc.stderr[-2000:]}")
    assert lines and lines[-1] == "done", proc.stderr[-2000:]
    results = [json.loads(line) for line in lines[:-1]]
    assert len(results) > 150
    wrong = [r for r in results if r[3] not in ("TypeError", "ValueError")]
    assert not wrong, "\n".join(f"{fn}({name}={label}): {outcome}"
                                for fn, name, label, outcome in wrong)


if __name__ == "__main__" and sys.argv[1:2] == ["--sweep"]:
    run_sweep(int(sys.argv[2]), sys.argv[3])


# ---- updates and the backward -------------------------------------------------------------

def test_update_adds_the_appended_rows_to_their_nearest_lists(tmp_path, rng):
    keys = clustered(rng, 1200, 5)
    values = rng.standard_normal((1200, 3)).astype(F4)
    store = qkv.KeyValueStore.create(tmp_path / "s", keys[:800], values[:800], chunk_rows=300)
    built = qkv.Index.build(store, tmp_path / "i", lists=16)
    assert qkv.Index.update(built.dir, store).rows == 800  # current: as it is
    store.append(keys[800:], values[800:])
    index = qkv.Index.update(tmp_path / "i", store)
    index.check_built_over(store)
    assert (index.rows, index.num_lists) == (1200, 16)
    np.testing.assert_array_equal(index.centroids, built.centroids)
    assert (index.list_rows >= built.list_rows).all() and index.list_rows.sum() == 1200
    assert (index.radii >= built.radii).all()
    queries = keys[rng.integers(0, 1200, 8)] + rng.normal(0, 0.1, (8, 5)).astype(F4)
    ref = Reference(queries, keys, values, "distance", 2.0)
    ref.check(*index.attend(queries, scoring="distance", scale=2.0, epsilon=0)[:2])
    r = index.attend(queries, scoring="distance", scale=2.0, epsilon=1e-3)
    ref.check(r.output, r.lse, r.certificate, exact=False)
    other = qkv.KeyValueStore.create(tmp_path / "o", keys[::-1].copy(), values)
    check_raises(lambda: qkv.Index.update(index.dir, other), qkv.Error, "Index.update",
                 ["another store than store"])
    check_raises(lambda: qkv.Index.update(index.dir, keys), TypeError, "Index.update",
                 ["store is a ndarray", "qkv.KeyValueStore"])
    check_raises(lambda: qkv.Index.update(tmp_path / "none", store), qkv.Error, "Index.update",
                 ["none"])


def numpy_d_queries(ref, queries, keys, values, d_output, scoring, scale):
    """dLoss/d(queries) of softmax attention over every row, in float64."""
    q, k, v, d_o = (np.asarray(a, F8) for a in (queries, keys, values, d_output))
    g = d_o @ v.T - (d_o * ref.output).sum(axis=1, keepdims=True)  # (Nq, N)
    ds = ref.weights * g * scale
    return ds @ k - (ds.sum(axis=1, keepdims=True) * q if scoring == "distance" else 0)


@pytest.mark.parametrize("scoring,scale", [("dot", 2.0), ("distance", 4.0)])
def test_the_backward_is_the_gradient_of_the_rows_visited(indexed, rng, scoring, scale):
    store, index = indexed
    keys, values = store.keys(), store.values()
    queries = (keys[rng.integers(0, len(keys), 6)] + rng.normal(0, 0.05, (6, 5))).astype(F4)
    d_output = rng.standard_normal((6, 3)).astype(F4)
    # epsilon 0: the gradient of attention over every row.
    r = index.attend(queries, scoring=scoring, scale=scale, epsilon=0)
    d_q = index.attend_backward(queries, r, d_output, scoring=scoring, scale=scale, epsilon=0)
    assert d_q.dtype == F4 and d_q.shape == (6, 5)
    q = bf16_round(queries) if store.dtype == "bfloat16" and scoring == "dot" else queries
    ref = Reference(q, keys, values, scoring, scale)
    want = numpy_d_queries(ref, q, keys, values, d_output, scoring, scale)
    np.testing.assert_allclose(d_q, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    if store.dtype == "bfloat16" and scoring == "dot":
        return  # queries rounded to bfloat16 have steps, not differences
    # The forward's own rounding (float32 scores) against float64, seen through
    # d_output: a difference of two outputs below carries up to about twice it,
    # whatever the step, so the check allows 4 times it (seeds 2929855509 and
    # 480735829 failed by 1.3e-5 and 1.6e-5 without it; there it was 3e-7 to
    # 7e-6).
    forward_error = (np.abs(r.output.astype(F8) - ref.output) *
                     np.abs(d_output.astype(F8))).sum(axis=1)
    # epsilon 1e-3: central differences of the index's own output, along
    # directions that keep each query's lists visited.
    r = index.attend(queries, scoring=scoring, scale=scale, epsilon=1e-3)
    d_q = index.attend_backward(queries, r, d_output, scoring=scoring, scale=scale, epsilon=1e-3)
    checked = 0
    for i in range(6):
        for _ in range(20):
            u = rng.uniform(-1, 1, 5)
            plus, minus = (np.asarray(queries[i] + sign * 2.5e-4 * u, F4)[None] for sign in (1, -1))
            a, b = (index.attend(x, scoring=scoring, scale=scale, epsilon=1e-3)
                    for x in (plus, minus))
            if {int(a.rows_visited[0]), int(b.rows_visited[0])} != {int(r.rows_visited[i])} or \
                    {int(a.lists_visited[0]), int(b.lists_visited[0])} != \
                    {int(r.lists_visited[i])}:
                continue
            step = plus[0].astype(F8) - minus[0].astype(F8)
            numeric = float(d_output[i].astype(F8) @ (a.output[0].astype(F8) -
                                                      b.output[0].astype(F8)))
            analytic = float(d_q[i].astype(F8) @ step)
            assert abs(numeric - analytic) <= \
                2e-3 * np.abs(d_q[i] * step).sum() + 1e-5 + 4 * forward_error[i], i
            checked += 1
            break
    assert checked >= 3


def test_backward_errors(indexed, rng):
    store, index = indexed
    queries = rng.standard_normal((4, 5)).astype(F4)
    r = index.attend(queries)
    check_raises(lambda: index.attend_backward(queries, r.output, np.ones((4, 3), F4)), TypeError,
                 "Index.attend_backward", ["forward is a ndarray", "IndexAttentionResult"])
    check_raises(lambda: index.attend_backward(queries, r, np.ones((4, 2), F4)), qkv.Error,
                 "Index.attend_backward", ["d_output", "[4, 2]", "[4, 3]"])
    check_raises(lambda: index.attend_backward(queries[:3], r, np.ones((3, 3), F4)), qkv.Error,
                 "Index.attend_backward", ["forward.lists_visited", "[4]", "[3]"])
    check_raises(lambda: index.attend_backward(queries, r, np.ones((4, 3), F4), epsilon=-1),
                 qkv.Error, "Index.attend_backward", ["epsilon = -1"])
