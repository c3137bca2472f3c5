"""Shared fixtures of the Python test suite (pytest, run by CTest under /usr/bin/python3).

- `seed` / `rng`: fresh random inputs in every test, from a seed drawn anew
  each run unless QKV_TEST_SEED is set; a failing test's report names the seed
  and the command that replays it.
- `qkv_cli`: the path of the qkv command of the same build (QKV_CLI; run by
  hand without it, the command of the build tree the package is imported
  from: <build>/python/qkv -> <build>/qkv), for checks that the bindings
  give the library's bits.

The package under test is the one on PYTHONPATH (CTest points it at the
build tree's python/ folder); a missing numpy or torch fails, never skips.
"""

import os
import secrets

import numpy as np
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


@pytest.fixture
def seed(request):
    value = int(os.environ.get("QKV_TEST_SEED") or secrets.randbits(32))
    request.node.qkv_seed = value
    return value


@pytest.fixture
def rng(seed):
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    # A skipped test proves nothing: this suite allows none (a peer that is
    # missing fails the test that needs it).
    if report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped, which this suite does not allow: {report.longrepr}"
    value = getattr(item, "qkv_seed", None)
    if value is not None and report.failed:
        report.sections.append(
            ("qkv seed", f"seed {value}; replay: QKV_TEST_SEED={value} /usr/bin/python3 -m "
                         f"pytest '{item.nodeid}'"))


@pytest.fixture(scope="session")
def qkv_cli():
    path = os.environ.get("QKV_CLI")
    if not path:
        import qkv
        build = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(qkv.__file__))))
        path = os.path.join(build, "qkv")
    if not os.access(path, os.X_OK):
        pytest.fail(f"QKV_CLI={path!r} does not name the qkv command; CTest sets it to the "
                    f"build's binary (by hand: QKV_CLI=<build>/qkv)")
    return path
