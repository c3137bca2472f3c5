"""Nadaraya-Watson regression and pooling with given weights, against references.

- qkv.nadaraya_watson and qkv.KernelRegression (predict, weights, loo_error)
  against float64 NumPy evaluations of the formula, f(q) = sum_i K((q - x_i)/h)
  y_i / sum_j K((q - x_j)/h), for the four kernels, 1-D and 2-D x, 1-D and 2-D y,
  one bandwidth or one per feature (a list, a tuple or a NumPy array); compact
  kernels give NaN where no point is in reach, the Gaussian a far query's
  nearest point's value; the 1-D Gaussian fast path within its documented
  bound (1e-7 * sum_j w_j |y_j|), exact=True within rounding;
- the Gaussian with a fixed bandwidth against statsmodels' KernelReg
  (reg_type='lc', var_type 'c' * p): relative error < 1e-10;
- bandwidth='cv' gives a leave-one-out error no worse than Scott's rule's, and
  loo_error() is the NumPy leave-one-out error at the fitted bandwidth;
  bandwidth='cv-fast' (1-D, Gaussian) finds a bandwidth whose NumPy
  leave-one-out error is within 1e-7 of cv's, its cv_loo_error_ within 1e-9
  max|y| of the NumPy error at its own bandwidth;
- silverman_bandwidth and scott_bandwidth against their formulas (NumPy's
  std with ddof=1 and percentiles); train_parametric against a NumPy replay
  of its SGD (the loss and its analytic gradient);
- the estimator's attributes (bandwidth_, cv_loo_error_, cv_iterations_,
  n_features_in_, kernel, bandwidth), fit returning self, float32 inputs
  converted to float64;
- attention_pooling, average_pooling, one_hot_lookup, one_hot_weights and
  uniform_weights against NumPy, 3-D and 2-D forms.
"""

import copy as copy_module
import pickle

import numpy as np
import pytest
from statsmodels.nonparametric.kernel_regression import KernelReg

import qkv

KERNELS = ["gaussian", "boxcar", "epanechnikov", "triangular"]
PROFILES = {
    "boxcar": lambda u: (np.abs(u) <= 1).astype(np.float64),
    "epanechnikov": lambda u: np.where(np.abs(u) <= 1, 1 - u * u, 0.0),
    "triangular": lambda u: np.where(np.abs(u) <= 1, 1 - np.abs(u), 0.0),
}


def as_2d(a):
    a = np.asarray(a, np.float64)
    return a[:, None] if a.ndim == 1 else a


def ref_weights(x, xq, h, kernel):
    """(t, n) weights K((q - x_i)/h) / sum_j K((q - x_j)/h) in float64; NaN rows where
    no point is in reach. The Gaussian's exp(-|u|^2/2) is taken relative to the
    largest (exactly the same ratio), so nothing underflows."""
    x, xq = as_2d(x), as_2d(xq)
    u = (xq[:, None, :] - x[None, :, :]) / np.broadcast_to(np.asarray(h, np.float64),
                                                            (x.shape[1],))
    if kernel == "gaussian":
        s = -0.5 * (u * u).sum(-1)
        k = np.exp(s - s.max(1, keepdims=True))
    else:
        k = PROFILES[kernel](u).prod(-1)
    total = k.sum(1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return k / total


def ref_predict(x, y, xq, h, kernel):
    w = ref_weights(x, xq, h, kernel)
    y = np.asarray(y, np.float64)
    return w @ y


def check_close(got, ref, rtol, what, atol=0.0):
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, ref {ref.shape}"
    assert got.dtype == np.float64, f"{what}: dtype {got.dtype}"
    nan_got, nan_ref = np.isnan(got), np.isnan(ref)
    assert (nan_got == nan_ref).all(), \
        f"{what}: NaN at {np.argwhere(nan_got != nan_ref)[:5].tolist()} differs from the ref"
    err = np.abs(np.where(nan_ref, 0, got - ref))
    bound = atol + rtol * np.abs(np.where(nan_ref, 0, ref))
    if (err > bound).any():
        i = tuple(int(j) for j in np.argwhere(err > bound)[0])
        raise AssertionError(f"{what}: at {i} got {got[i]!r}, ref {ref[i]!r} "
                             f"(max error {err.max():.3g})")


def data(rng, n, p, m):
    """Training points (n) or (n, p) in [0, 5], values (n) or (n, m) (p, m None: 1-D)."""
    x = rng.uniform(0, 5, n if p is None else (n, p))
    xs = as_2d(x)
    f = 2 * np.sin(xs).sum(1) + xs.sum(1) ** 0.8
    y = f + rng.normal(0, 0.5, n)
    if m is not None:
        y = np.stack([y * (j + 1) - j for j in range(m)], 1)
    return x, y


# ---- the estimator against the formula ----------------------------------------------------

SHAPES = [  # (p, m): None is the 1-D form
    (None, None), (None, 3), (1, None), (2, None), (3, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"x{s[0] or '1d'}-y{s[1] or '1d'}")
@pytest.mark.parametrize("kernel", KERNELS)
def test_nadaraya_watson_is_the_formula(kernel, shape, rng):
    p, m = shape
    x, y = data(rng, 60, p, m)
    features = 1 if p is None else p
    xq = rng.uniform(-1, 6, 25 if p is None else (25, p))   # some out of every compact reach
    h_one = float(rng.uniform(0.3, 1.2))
    h_each = rng.uniform(0.3, 1.5, features)
    for h in (h_one, h_each.tolist(), tuple(h_each.tolist())):
        for exact in (False, True):
            got = qkv.nadaraya_watson(x, y, xq, kernel=kernel, bandwidth=h, exact=exact)
            ref = ref_predict(x, y, xq, h, kernel)
            assert got.shape == ((25,) if m is None else (25, m))
            check_close(got, ref, 1e-11, f"{kernel} h={h} exact={exact}",
                        atol=1e-12 * np.abs(y).max())
        model = qkv.KernelRegression(kernel, h).fit(x, y)
        check_close(model.predict(xq), ref_predict(x, y, xq, h, kernel), 1e-11,
                    f"KernelRegression({kernel!r}, {h}).predict", atol=1e-12 * np.abs(y).max())
        check_close(model.weights(xq), ref_weights(x, xq, h, kernel), 1e-11,
                    f"KernelRegression({kernel!r}, {h}).weights", atol=1e-15)


def test_bandwidth_as_a_numpy_array(rng):
    # A NumPy array of one bandwidth per feature is "one per feature" as a list
    # is (the docstrings, and _qkv.pyi's Bandwidth type, take an ndarray).
    x, y = data(rng, 40, 2, None)
    xq = rng.uniform(0, 5, (9, 2))
    h = rng.uniform(0.5, 1.5, 2)
    for kernel in KERNELS:
        want = ref_predict(x, y, xq, h, kernel)
        check_close(qkv.nadaraya_watson(x, y, xq, kernel=kernel, bandwidth=h), want, 1e-11,
                    f"nadaraya_watson({kernel!r}), bandwidth an ndarray",
                    atol=1e-12 * np.abs(y).max())
        model = qkv.KernelRegression(kernel, h).fit(x, y)
        check_close(model.predict(xq), want, 1e-11,
                    f"KernelRegression({kernel!r}), bandwidth an ndarray",
                    atol=1e-12 * np.abs(y).max())
        assert np.array_equal(model.bandwidth_, h)
        assert np.array_equal(model.loo_error(h), model.loo_error())


def test_scalar_bandwidths_of_numpy_types(rng):
    x, y = data(rng, 30, 2, None)
    want = qkv.nadaraya_watson(x, y, x, bandwidth=0.75)
    for h in (np.float64(0.75), np.float32(0.75), np.array(0.75), [0.75, 0.75]):
        assert qkv.nadaraya_watson(x, y, x, bandwidth=h).tobytes() == want.tobytes(), repr(h)
    assert (qkv.nadaraya_watson(x, y, x, bandwidth=2).tobytes()
            == qkv.nadaraya_watson(x, y, x, bandwidth=2.0).tobytes())


def test_compact_kernels_leave_far_queries_undefined_and_the_gaussian_does_not(rng):
    x, y = data(rng, 30, None, None)
    far = np.array([-50.0, 2.5, 1e3, 1e150])
    for kernel in ("boxcar", "epanechnikov", "triangular"):
        got = qkv.nadaraya_watson(x, y, far, kernel=kernel, bandwidth=0.5)
        assert np.isnan(got[[0, 2, 3]]).all() and np.isfinite(got[1]), (kernel, got)
    # The Gaussian: never 0/0; far away, the nearest point's value -- up to the
    # weights of points close to it: the weights relative to the nearest point,
    # formed without cancelling the squares. The library forms each score
    # s = (q - x)^2 / 2h^2 itself, so each carries a rounding of a few ulps of s
    # (1.3e5 at q = -50, h = 0.1: 3e-11), which moves the result by
    # sum_i p_i |y_i - want| * that: 2.7e-12 when two points 2.8e-4 apart share
    # the weight 1 : 0.24 (seed 2822213507). The bound adds that term.
    got = qkv.nadaraya_watson(x, y, far, bandwidth=0.1)
    eps = np.finfo(float).eps
    for i in (0, 2, 3):
        a = x.min() if far[i] < x.min() else x.max()  # (|q - x| rounds alike at 1e150)
        w = np.exp(-(a - x) * (2 * far[i] - x - a) / (2 * 0.1 * 0.1))
        want = (w * y).sum() / w.sum()
        scores = (far[i] - x) ** 2 / (2 * 0.1 * 0.1)
        bound = 4 * eps * (abs(want) + (w / w.sum() * np.abs(y - want) * scores).sum())
        assert abs(got[i] - want) <= bound, (i, got[i], want, bound)
    assert got[3] == y[np.argmax(x)]
    check_close(got[1:2], ref_predict(x, y, far[1:2], 0.1, "gaussian"), 1e-11, "near query")


def test_fast_1d_path_meets_its_bound(rng):
    # n * t > 1e6 with 1-D Gaussian: the fast algorithm unless exact=True.
    x, y = data(rng, 3000, None, None)
    xq = np.linspace(-0.5, 5.5, 1000)
    for h in (0.02, 0.3, 3.0):
        w = ref_weights(x, xq, h, "gaussian")
        ref = w @ y
        bound = 1e-7 * (w @ np.abs(y))
        fast = qkv.nadaraya_watson(x, y, xq, bandwidth=h)
        err = np.abs(fast - ref)
        assert (err <= bound + 1e-15).all(), \
            f"h={h}: worst error {err.max():.3g} against bound {bound[np.argmax(err)]:.3g}"
        exact = qkv.nadaraya_watson(x, y, xq, bandwidth=h, exact=True)
        check_close(exact, ref, 1e-11, f"exact h={h}", atol=1e-12 * np.abs(y).max())


# ---- statsmodels ---------------------------------------------------------------------------

@pytest.mark.parametrize("p", [1, 2, 3])
def test_gaussian_equals_statsmodels_kernelreg(p, rng):
    x, y = data(rng, 80, p, None)
    xq = rng.uniform(0, 5, (30, p))
    h = rng.uniform(0.4, 1.5, p)
    model = KernelReg(endog=y, exog=x, var_type="c" * p, reg_type="lc", bw=h)
    want, _ = model.fit(xq)
    got = qkv.nadaraya_watson(x, y, xq, bandwidth=h.tolist())
    rel = np.abs(got - want) / np.abs(want)
    assert rel.max() < 1e-10, f"relative error {rel.max():.3g} against statsmodels"
    got1 = qkv.KernelRegression(bandwidth=h.tolist()).fit(x, y).predict(xq, exact=True)
    assert (np.abs(got1 - want) / np.abs(want)).max() < 1e-10


# ---- bandwidth selection -------------------------------------------------------------------

def ref_loo(x, y, h, kernel):
    """(1/n') sum over the n' points with another point in reach of |f_{-i}(x_i) - y_i|^2."""
    xs = as_2d(x)
    u = (xs[:, None, :] - xs[None, :, :]) / np.broadcast_to(np.asarray(h, np.float64),
                                                             (xs.shape[1],))
    if kernel == "gaussian":
        s = -0.5 * (u * u).sum(-1)
        np.fill_diagonal(s, -np.inf)
        k = np.exp(s - s.max(1, keepdims=True))
    else:
        k = PROFILES[kernel](u).prod(-1)
        np.fill_diagonal(k, 0)
    total = k.sum(1)
    defined = total > 0
    f = (k[defined] / total[defined, None]) @ y
    r = (f - y[defined]).reshape(defined.sum(), -1)
    return float(np.mean((r * r).sum(1)))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("p", [None, 2])
def test_loo_error_is_the_formula(kernel, p, rng):
    x, y = data(rng, 50, p, None)
    h = [0.8] if p is None else [0.8, 1.1]
    model = qkv.KernelRegression(kernel, h).fit(x, y)
    check_close(model.loo_error(), ref_loo(x, y, h, kernel), 1e-11, "loo_error()")
    check_close(model.loo_error(1.3), ref_loo(x, y, 1.3, kernel), 1e-11, "loo_error(1.3)")
    y2 = np.stack([y, -2 * y], 1)
    model2 = qkv.KernelRegression(kernel, h).fit(x, y2)
    check_close(model2.loo_error(), ref_loo(x, y2, h, kernel), 1e-11, "loo_error of 2-D y")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("p", [None, 2])
def test_cv_is_no_worse_than_scott(kernel, p, rng):
    x, y = data(rng, 80, p, None)
    cv = qkv.KernelRegression(kernel, "cv").fit(x, y)
    scott = qkv.KernelRegression(kernel, "scott").fit(x, y)
    silverman = qkv.KernelRegression(kernel, "silverman").fit(x, y)
    assert cv.cv_loo_error_ == cv.loo_error()
    check_close(cv.loo_error(), ref_loo(x, y, cv.bandwidth_, kernel), 1e-10, "cv loo_error")
    assert cv.loo_error() <= scott.loo_error() * (1 + 1e-12), (cv.bandwidth_, scott.bandwidth_)
    assert np.array_equal(scott.bandwidth_, qkv.scott_bandwidth(x))
    assert np.array_equal(silverman.bandwidth_, qkv.silverman_bandwidth(x))
    assert scott.cv_loo_error_ is None and scott.cv_iterations_ is None
    assert isinstance(cv.cv_iterations_, int) and cv.cv_iterations_ >= 1
    # The rules through nadaraya_watson: the estimator's predictions.
    xq = x[:7]
    for rule, model in (("cv", cv), ("scott", scott), ("silverman", silverman)):
        assert (qkv.nadaraya_watson(x, y, xq, kernel=kernel, bandwidth=rule).tobytes()
                == model.predict(xq).tobytes()), rule


@pytest.mark.parametrize("p", [None, 1])
def test_cv_fast_finds_cvs_bandwidth(p, rng):
    n = int(rng.integers(60, 300))
    x, y = data(rng, n, p, None)
    cv = qkv.KernelRegression("gaussian", "cv").fit(x, y)
    fast = qkv.KernelRegression("gaussian", "cv-fast").fit(x, y)
    assert fast.bandwidth == "cv-fast" and fast.bandwidth_.shape == (1,)
    assert fast.cv_iterations_ == 1
    exact_at_fast = ref_loo(x, y, fast.bandwidth_, "gaussian")
    exact_at_cv = ref_loo(x, y, cv.bandwidth_, "gaussian")
    # The documented promise: the exact error at cv-fast's bandwidth within
    # 1e-7 (relative) of cv's; cv's is a local minimum, so only above it.
    assert exact_at_fast <= exact_at_cv * (1 + 1e-7), (fast.bandwidth_, cv.bandwidth_)
    # Each estimate within 1e-9 max|y|, each residual at most 2 max|y|: the
    # mean of squares within 2 * 2 max|y| * 1e-9 max|y|.
    assert abs(fast.cv_loo_error_ - exact_at_fast) <= 4e-9 * np.abs(y).max() ** 2, (
        fast.cv_loo_error_, exact_at_fast)
    xq = as_2d(x)[:9] if p else x[:9]
    assert (qkv.nadaraya_watson(x, y, xq, bandwidth="cv-fast").tobytes()
            == fast.predict(xq).tobytes())


@pytest.mark.parametrize("p", [None, 1, 3])
def test_rules_of_thumb_are_their_formulas(p, rng):
    n = int(rng.integers(5, 200))
    x = rng.standard_normal(n if p is None else (n, p)) * rng.uniform(0.1, 10)
    xs = as_2d(x)
    s = xs.std(0, ddof=1)
    iqr = np.percentile(xs, 75, axis=0) - np.percentile(xs, 25, axis=0)
    silverman = 0.9 * np.minimum(s, iqr / 1.349) * n ** (-1 / 5)
    scott = 1.059 * s * n ** (-1 / (xs.shape[1] + 4))
    got_silverman, got_scott = qkv.silverman_bandwidth(x), qkv.scott_bandwidth(x)
    assert got_silverman.shape == got_scott.shape == (xs.shape[1],)
    check_close(got_silverman, silverman, 1e-13, "silverman_bandwidth")
    check_close(got_scott, scott, 1e-13, "scott_bandwidth")


# ---- the chapter's parametric model -------------------------------------------------------

def ref_loss_and_gradient(x, y, w):
    """The leave-one-out loss sum_i |f_{-i}(x_i) - y_i|^2 of scores -(|x_i - x_j| w)^2 / 2,
    and its derivative in w."""
    xs, ys = as_2d(x), np.asarray(y, np.float64).reshape(len(x), -1)
    d2 = ((xs[:, None, :] - xs[None, :, :]) ** 2).sum(-1)
    s = -0.5 * d2 * w * w
    np.fill_diagonal(s, -np.inf)
    a = np.exp(s - s.max(1, keepdims=True))
    a /= a.sum(1, keepdims=True)
    r = a @ ys - ys
    ds = -d2 * w
    np.fill_diagonal(ds, 0)
    df = (a * (ds - (a * ds).sum(1, keepdims=True))) @ ys
    return float((r * r).sum()), float(2 * (r * df).sum())


@pytest.mark.parametrize("shape", [(None, None), (None, 2), (2, None)],
                         ids=["x1d-y1d", "x1d-y2d", "x2d-y1d"])
def test_train_parametric_replays_its_sgd(shape, rng):
    p, m = shape
    x, y = data(rng, 40, p, m)
    w0, lr, epochs = float(rng.uniform(0.2, 1.0)), 0.002, 6
    w, losses, ws = qkv.train_parametric(x, y, epochs=epochs, lr=lr, initial_w=w0)
    assert losses.shape == ws.shape == (epochs,)
    ref_w, ref_losses, ref_ws = w0, [], []
    for _ in range(epochs):
        loss, grad = ref_loss_and_gradient(x, y, ref_w)
        ref_losses.append(loss)
        ref_ws.append(ref_w)
        ref_w -= lr * grad
    check_close(losses, np.array(ref_losses), 1e-10, "losses")
    check_close(ws, np.array(ref_ws), 1e-10, "ws")
    check_close(np.array([w]), np.array([ref_w]), 1e-10, "w")


def test_train_parametric_initial_w_from_the_seed(rng):
    x, y = data(rng, 30, None, None)
    seed = int(rng.integers(0, 2**63))
    first = qkv.train_parametric(x, y, seed=seed)
    again = qkv.train_parametric(x, y, seed=seed)
    other = qkv.train_parametric(x, y, seed=seed + 1)
    assert 0 <= first[2][0] < 1 and 0 <= other[2][0] < 1  # U(0, 1), as torch.rand(1)
    assert first[0] == again[0] and first[1].tobytes() == again[1].tobytes()
    assert first[2][0] != other[2][0]
    # The book's defaults: 5 epochs.
    assert first[1].shape == (5,)


# ---- the estimator's interface ------------------------------------------------------------

def test_kernel_regression_attributes(rng):
    x, y = data(rng, 40, 3, 2)
    model = qkv.KernelRegression("epanechnikov", [1.0, 2.0, 3.0])
    assert model.fit(x, y) is model
    assert model.kernel == "epanechnikov"
    assert np.array_equal(model.bandwidth, [1.0, 2.0, 3.0])
    assert np.array_equal(model.bandwidth_, [1.0, 2.0, 3.0])
    assert model.bandwidth_.dtype == np.float64
    assert model.n_features_in_ == 3
    assert model.cv_loo_error_ is None and model.cv_iterations_ is None
    assert model.predict(x[:4]).shape == (4, 2)
    assert model.weights(x[:4]).shape == (4, 40)

    one = qkv.KernelRegression(bandwidth=0.7).fit(x[:, 0], y[:, 0])
    assert one.kernel == "gaussian" and one.bandwidth == 0.7
    assert np.array_equal(one.bandwidth_, [0.7]) and one.n_features_in_ == 1
    assert one.predict(x[:4, 0]).shape == (4,)

    spread = qkv.KernelRegression(bandwidth=0.5).fit(x, y)
    assert np.array_equal(spread.bandwidth_, [0.5, 0.5, 0.5])

    for rule in ("cv", "scott", "silverman"):
        model = qkv.KernelRegression("triangular", rule)
        assert model.bandwidth == rule and model.fit(x, y) is model
        assert model.bandwidth_.shape == (3,) and (model.bandwidth_ > 0).all()
        assert (model.cv_loo_error_ is not None) == (rule == "cv")

    assert qkv.KernelRegression("uniform").kernel == "boxcar"
    assert qkv.KernelRegression().kernel == "gaussian" and qkv.KernelRegression().bandwidth == 1.0

    # A second fit replaces the first.
    model = qkv.KernelRegression(bandwidth=0.7).fit(x, y)
    model.fit(x[:, :1], y[:, 0])
    assert model.n_features_in_ == 1 and model.predict(x[:3, 0]).shape == (3,)


def test_weights_rows_sum_to_one(rng):
    x, y = data(rng, 50, 2, None)
    for kernel in KERNELS:
        w = qkv.KernelRegression(kernel, 2.0).fit(x, y).weights(x[:10])
        check_close(w.sum(1), np.ones(10), 1e-13, f"{kernel} weights' row sums")
        assert (w >= 0).all()


def test_float32_inputs_are_converted(rng):
    x, y = data(rng, 40, 2, None)
    xq = rng.uniform(0, 5, (8, 2))
    x32, y32, q32 = (a.astype(np.float32) for a in (x, y, xq))
    x64, y64, q64 = (a.astype(np.float64) for a in (x32, y32, q32))
    for kernel in KERNELS:
        got = qkv.nadaraya_watson(x32, y32, q32, kernel=kernel, bandwidth=1.5)
        want = qkv.nadaraya_watson(x64, y64, q64, kernel=kernel, bandwidth=1.5)
        assert got.dtype == np.float64 and got.tobytes() == want.tobytes()
    model = qkv.KernelRegression(bandwidth="scott").fit(x32, y32)
    assert np.array_equal(model.bandwidth_, qkv.scott_bandwidth(x64))
    assert model.predict(q32).tobytes() == model.predict(q64).tobytes()
    assert np.array_equal(qkv.silverman_bandwidth(x32), qkv.silverman_bandwidth(x64))
    a = qkv.train_parametric(x32[:, 0], y32, initial_w=0.5)
    b = qkv.train_parametric(x64[:, 0], y64, initial_w=0.5)
    assert a[0] == b[0] and a[1].tobytes() == b[1].tobytes()


# ---- pooling with given weights ------------------------------------------------------------

DTYPES = [np.float32, np.float64]
TOL = {np.float32: 2e-6, np.float64: 1e-14}  # relative to sum_j |w_j| |v_j|


def check_pooled(got, w, v, dtype, what):
    ref = np.einsum("...qk,...kd->...qd", w.astype(np.float64), v.astype(np.float64))
    scale = np.einsum("...qk,...kd->...qd", np.abs(w.astype(np.float64)),
                      np.abs(v.astype(np.float64)))
    assert got.dtype == dtype and got.shape == ref.shape, (got.dtype, got.shape, ref.shape)
    err = np.abs(got - ref)
    assert (err <= TOL[dtype] * scale + 1e-300).all(), \
        f"{what}: max error {err.max():.3g} (scale {scale.max():.3g})"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
def test_attention_pooling(dtype, rng):
    for B, Nq, Nk, Dv in ((2, 3, 5, 4), (3, 17, 33, 9), (1, 1, 1, 1), (2, 8, 100, 16)):
        w = rng.standard_normal((B, Nq, Nk)).astype(dtype)  # any weights, convex or not
        v = rng.standard_normal((B, Nk, Dv)).astype(dtype)
        check_pooled(qkv.attention_pooling(w, v), w, v, dtype, "3-D")
        check_pooled(qkv.attention_pooling(w[0], v[0]), w[0], v[0], dtype, "2-D")


def ref_average(v, nq, lens):
    v = v.astype(np.float64)
    B, Nk, Dv = v.shape
    L = np.full((B, nq), Nk) if lens is None else np.broadcast_to(
        np.asarray(lens).reshape(B, -1), (B, nq))
    out = np.zeros((B, nq, Dv))
    for b in range(B):
        for i in range(nq):
            if L[b, i] > 0:
                out[b, i] = v[b, : L[b, i]].mean(0)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
def test_average_pooling(dtype, rng):
    B, Nq, Nk, Dv = 3, 4, 21, 5
    v = rng.standard_normal((B, Nk, Dv)).astype(dtype)
    per_query = rng.integers(0, Nk + 1, size=(B, Nq))
    per_query[0, 0] = 0
    for lens in (None, rng.integers(0, Nk + 1, size=B), per_query):
        got = qkv.average_pooling(v, Nq, lens)
        ref = ref_average(v, Nq, lens)
        assert got.dtype == dtype and got.shape == ref.shape
        assert np.allclose(got, ref, rtol=TOL[dtype] * 10, atol=TOL[dtype] * 10)
        assert (got[ref == 0] == 0).all()  # L = 0 pools to zero
    got2 = qkv.average_pooling(v[0], Nq, per_query[0])
    assert np.allclose(got2, ref_average(v[:1], Nq, per_query[:1])[0], rtol=TOL[dtype] * 10,
                       atol=TOL[dtype] * 10)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
def test_one_hot_lookup_is_exact(dtype, rng):
    B, Nq, Nk, Dv = 3, 6, 11, 4
    v = rng.standard_normal((B, Nk, Dv)).astype(dtype)
    index = rng.integers(0, Nk, size=(B, Nq))
    got = qkv.one_hot_lookup(index, v)
    want = np.take_along_axis(v, index[..., None], axis=1)
    assert got.dtype == dtype and got.tobytes() == want.tobytes()
    got2 = qkv.one_hot_lookup(index[0].astype(np.int32), v[0])
    assert got2.tobytes() == v[0][index[0]].tobytes()


def test_one_hot_weights(rng):
    Nk = 9
    index = rng.integers(0, Nk, size=(3, 5))
    got = qkv.one_hot_weights(index, Nk)
    assert got.dtype == np.float32
    assert np.array_equal(got, np.eye(Nk, dtype=np.float32)[index])
    assert np.array_equal(qkv.one_hot_weights(index[0], Nk), np.eye(Nk, dtype=np.float32)[index[0]])
    # One-hot weights pool to a lookup.
    v = rng.standard_normal((3, Nk, 2)).astype(np.float32)
    assert (qkv.attention_pooling(got, v).tobytes() == qkv.one_hot_lookup(index, v).tobytes())


def test_uniform_weights(rng):
    B, Nq, Nk = 3, 4, 10
    per_query = rng.integers(0, Nk + 1, size=(B, Nq))
    per_query[1, 2] = 0
    for lens in (None, rng.integers(0, Nk + 1, size=B), per_query):
        got = qkv.uniform_weights(B, Nq, Nk, lens)
        L = np.full((B, Nq), Nk) if lens is None else np.broadcast_to(
            np.asarray(lens).reshape(B, -1), (B, Nq))
        ref = np.where(np.arange(Nk) < L[..., None], 1.0 / np.maximum(L[..., None], 1), 0.0)
        assert got.dtype == np.float32 and got.shape == (B, Nq, Nk)
        assert np.allclose(got, ref, rtol=2e-7, atol=0)
    # Uniform weights pool to the average.
    v = rng.standard_normal((B, Nk, 3)).astype(np.float32)
    assert np.allclose(qkv.attention_pooling(qkv.uniform_weights(B, Nq, Nk, per_query), v),
                       qkv.average_pooling(v, Nq, per_query), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bandwidth", [0.4, [0.3, 0.7], "scott", "cv", "cv-fast"])
def test_kernel_regression_pickles(bandwidth, rng):
    """KernelRegression could not be pickled (nor copied, nor sent to a
    process pool). Unpickled, a fitted model gives the same bits, bandwidth
    and cv figures; an unfitted one is still unfitted."""
    p = 2 if isinstance(bandwidth, list) else 1
    x = rng.uniform(0, 5, size=(40, p) if p > 1 else 40)
    y = np.sin(x).sum(-1) if p > 1 else np.sin(x)
    queries = rng.uniform(0, 5, size=(7, p) if p > 1 else 7)
    fresh = qkv.KernelRegression("gaussian", bandwidth)
    again = pickle.loads(pickle.dumps(fresh))
    assert again.kernel == "gaussian"
    with pytest.raises(ValueError, match="not fitted"):
        again.predict(queries)
    model = qkv.KernelRegression("gaussian", bandwidth).fit(x, y)
    x[:] = 0  # the model keeps its own copy
    for copy in (pickle.loads(pickle.dumps(model)), copy_module.deepcopy(model)):
        assert np.array_equal(copy.predict(queries), model.predict(queries))
        assert np.array_equal(copy.bandwidth_, model.bandwidth_)
        assert copy.cv_loo_error_ == model.cv_loo_error_
        assert copy.cv_iterations_ == model.cv_iterations_
        assert copy.loo_error() == model.loo_error()
    with pytest.raises(qkv.Error, match="a state of 3 items"):
        qkv.KernelRegression.__new__(qkv.KernelRegression).__setstate__(("gaussian", 1.0, 2))
