"""The three ways in to the Python package, each ending in `import qkv` from
outside the source tree:

  1. the build tree (what the other tests import; PYTHONPATH=<build>/python);
  2. `cmake --install <build> --prefix P` puts it in P/<QKV_PYTHON_INSTALL_DIR>,
     which for the default prefix /usr/local is on /usr/bin/python3's path;
  3. `pip install -v --no-build-isolation --no-index .` in a fresh venv made with
     `/usr/bin/python3 -m venv --system-site-packages` (so it sees Debian's
     numpy and torch): builds the extension with the project's CMake from a
     copy of the sources, fetches nothing (--no-index would fail a download).
     With QKV_CMAKE_ARGS=-DQKV_NATIVE_SIMD_ONLY=ON, which the package must
     show it was built with (this CPU's best target and scalar): the build
     of every target is the Release build's, and this one took 174 s of the
     Release tests' 422 with all four (two compiles at once beside the tests).
     And -DCMAKE_CXX_FLAGS_RELEASE=-O0: this test checks the route (setup.py
     driving CMake, the package's files, stubs and metadata), and the Release
     build compiles the same sources optimised and runs the package's tests
     on them; unoptimised, the test took 87 s instead of 186 s on 2 busy cores
     (150 s of CI's Release tests, its longest).
     With -v (docs/python.md's command) pip shows the build as it goes:
     CMake's lines and setup.py's own with the percentage and the time left.

Each installed copy must compute (a masked softmax and qkv.torch's SDPA), have
the C++ library's version, and ship its type stubs.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

SOURCE = os.environ.get("QKV_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("QKV_BUILD_DIR")

# Imports the package from wherever the interpreter finds it and prints where
# that was; fails (non-zero exit) unless it computes what it should.
CHECK = r"""
import numpy as np, qkv, qkv.torch, torch, os
w = qkv.masked_softmax(np.zeros((1, 2, 4), np.float32), [3])
assert np.allclose(w[0, :, :3], 1 / 3) and (w[0, :, 3] == 0).all(), w
q = torch.ones(2, 1, 2); k = torch.ones(2, 10, 2)
v = torch.arange(40.0).reshape(1, 10, 4).repeat(2, 1, 1)
out = qkv.torch.scaled_dot_product_attention(q, k, v, valid_lens=torch.tensor([2, 6]))
assert torch.allclose(out.flatten(), torch.tensor([2., 3, 4, 5, 10, 11, 12, 13])), out
here = os.path.dirname(qkv.__file__)
assert os.path.exists(os.path.join(here, "_qkv.pyi")) and os.path.exists(os.path.join(here, "py.typed"))
print(qkv.__file__)
print(qkv.__version__)
"""


def cmake_version():
    with open(os.path.join(SOURCE, "CMakeLists.txt")) as f:
        return re.search(r"project\(qkv VERSION ([0-9.]+)", f.read()).group(1)


def run_check(python, env=None):
    """Runs CHECK with `python` from / (not the source tree); returns (path, version)."""
    proc = subprocess.run([python, "-c", CHECK], capture_output=True, text=True, cwd="/",
                          env=env, timeout=300)
    assert proc.returncode == 0, f"import failed:\n{proc.stderr}"
    path, version = proc.stdout.split()
    return path, version


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(extra)
    return env


def cache_value(name):
    with open(os.path.join(BUILD, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.split("=", 1)[1].strip()
    pytest.fail(f"{name} is not in {BUILD}/CMakeCache.txt")


@pytest.fixture(scope="module")
def build_dir():
    if not BUILD or not os.path.exists(os.path.join(BUILD, "CMakeCache.txt")):
        pytest.fail(f"QKV_BUILD_DIR={BUILD!r} is not a configured build tree; CTest sets it")
    return BUILD


def test_license(tmp_path):
    """MIT, said the same way by LICENSE, qkv.__license__ and the package metadata that
    pip would install (setup.py's egg_info writes it without building anything)."""
    import qkv
    assert qkv.__license__ == "MIT"
    with open(os.path.join(SOURCE, "LICENSE")) as f:
        text = f.read()
    assert text.startswith("MIT License\n") and "the qkv authors" in text
    proc = subprocess.run(["/usr/bin/python3", "setup.py", "-q", "egg_info", "--egg-base",
                           str(tmp_path)], capture_output=True, text=True, cwd=SOURCE, timeout=300)
    assert proc.returncode == 0, proc.stderr
    metadata = (tmp_path / "qkv.egg-info" / "PKG-INFO").read_text().splitlines()
    for line in ("License: MIT", "Classifier: License :: OSI Approved :: MIT License",
                 "License-File: LICENSE"):
        assert line in metadata, f"{line!r} not in PKG-INFO:\n" + "\n".join(metadata[:20])


def test_build_tree(build_dir):
    path, version = run_check(sys.executable,
                              clean_env(PYTHONPATH=os.path.join(build_dir, "python")))
    assert path.startswith(os.path.join(build_dir, "python", "qkv"))
    assert version == cmake_version()


def test_cmake_install(build_dir, tmp_path):
    prefix = tmp_path / "prefix"
    proc = subprocess.run(["cmake", "--install", build_dir, "--prefix", str(prefix)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    relative = cache_value("QKV_PYTHON_INSTALL_DIR")
    site = prefix / relative
    assert (site / "qkv" / "__init__.py").exists() and list((site / "qkv").glob("_qkv*.so"))
    path, version = run_check("/usr/bin/python3", clean_env(PYTHONPATH=str(site)))
    assert path.startswith(str(site))
    assert version == cmake_version()
    # With the default prefix the same relative folder is on Debian's path.
    assert os.path.join("/usr/local", relative) in subprocess.run(
        ["/usr/bin/python3", "-c", "import sys; print('\\n'.join(sys.path))"],
        capture_output=True, text=True, cwd="/", env=clean_env()).stdout.splitlines()


def source_copy(into):
    """The project's files as a clean checkout has them (no build trees)."""
    if os.path.isdir(os.path.join(SOURCE, ".git")):
        files = subprocess.run(["git", "-C", SOURCE, "ls-files", "--cached", "--others",
                                "--exclude-standard", "-z"], capture_output=True, check=True
                               ).stdout.decode().split("\0")
        for name in filter(None, files):
            if os.path.isfile(os.path.join(SOURCE, name)):
                os.makedirs(os.path.dirname(os.path.join(into, name)), exist_ok=True)
                shutil.copy2(os.path.join(SOURCE, name), os.path.join(into, name))
    else:
        shutil.copytree(SOURCE, into, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("build", ".git", "__pycache__"))


@pytest.mark.slow
def test_pip_install_in_a_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, timeout=300)
    source = tmp_path / "qkv-source"
    source_copy(str(source))
    python = str(venv / "bin" / "python")
    proc = subprocess.run([python, "-m", "pip", "install", "-v", "--no-build-isolation",
                           "--no-index", "--no-cache-dir", str(source)],
                          capture_output=True, text=True, timeout=1800, cwd=str(tmp_path),
                          env=clean_env(CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1),
                                        QKV_CMAKE_ARGS="-DQKV_NATIVE_SIMD_ONLY=ON "
                                                       "-DCMAKE_CXX_FLAGS_RELEASE=-O0"))
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    # The build's progress came through pip (on its stderr, where pip -v logs
    # a backend's lines): CMake's lines, setup.py's with the time left (the
    # build takes minutes: one at least every 10 s), the end.
    shown = proc.stderr
    assert re.search(r"^\s*\[\s*\d+%\] Building CXX object", shown, re.M), shown[-4000:]
    assert re.search(r"^\s*qkv setup\.py: build: \d+ % after .+, about .+ left$", shown,
                     re.M), shown[-4000:]
    assert re.search(r"^\s*qkv setup\.py: build: done in ", shown, re.M), shown[-4000:]
    path, version = run_check(python, clean_env())
    info = subprocess.run([python, "-c", "import qkv; i = qkv.simd_info(); "
                           "print(*i['simd_targets_compiled']); print(*i['simd_targets_supported'])"],
                          capture_output=True, text=True, check=True, cwd="/",
                          env=clean_env()).stdout.splitlines()
    supported = info[1].split()
    assert info[0].split() == [supported[0]] + (["scalar"] if supported[0] != "scalar" else []), info
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('platlib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert path.startswith(site) and site.startswith(str(venv)), (path, site)
    assert version == cmake_version()
    # The installed distribution's metadata and files carry the license.
    license = subprocess.run([python, "-c", "import importlib.metadata as m; d = m.distribution('qkv'); "
                              "print(d.metadata['License']); "
                              "print(any(f.name == 'LICENSE' for f in d.files))"],
                             capture_output=True, text=True, check=True, cwd="/",
                             env=clean_env()).stdout.split()
    assert license == ["MIT", "True"], license
    # Debian's numpy and torch, not copies: the venv sees the system's site packages.
    where = subprocess.run([python, "-c", "import numpy, torch; print(numpy.__file__, torch.__file__)"],
                           capture_output=True, text=True, check=True, cwd="/").stdout.split()
    assert all(p.startswith("/usr/lib/python3/dist-packages") for p in where), where
