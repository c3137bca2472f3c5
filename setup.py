"""Builds the Python package qkv with the project's own CMake (see pyproject.toml).

The extension qkv._qkv is the CMake target qkv_python; this file configures a
Release tree for the interpreter that runs it (a venv's python, say), builds
that one target into setuptools' build folder, and lets setuptools add the
pure-Python files of python/qkv. The version is the CMake project's.
QKV_CMAKE_ARGS, if set, adds its words (split as a shell would) to the
configure command: -DQKV_NATIVE_SIMD_ONLY=ON, say, for a quicker build of a
package that only this machine runs.

The build takes minutes. pip 23 shows a build backend's output only with -v
(without it, its spinner, or "still running..." every 60 s when stdout is not
a terminal), so docs/python.md's command is `pip install -v`: then CMake's own
lines come through as they are printed, and every 10 s at most this file adds
one of its own with the percentage built, the time so far and the time left.
"""

import os
import re
import shlex
import subprocess
import sys
import time

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def cmake_version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        match = re.search(r"project\(qkv VERSION ([0-9.]+)", f.read())
    if not match:
        raise RuntimeError("setup.py: no `project(qkv VERSION x.y.z` in CMakeLists.txt")
    return match.group(1)


def duration(seconds):
    """'42 s', '3 min 05 s': the qkv command's way of saying a duration."""
    seconds = int(round(seconds))
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60:02d} s"


def run_with_progress(command, what, interval=10.0):
    """Runs `command`, passing its output through line by line (flushed, so a
    pipe sees each line as it comes), and after a line with CMake's progress
    ("[ 42%] Building ...") at most every `interval` seconds one line of its
    own: the percentage, the time so far and, from the rate so far, the time
    left. Raises CalledProcessError as subprocess.run(check=True) does."""
    start = last = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1)
    for line in proc.stdout:
        sys.stdout.write(line)
        match = re.match(r"\[\s*(\d+)%\]", line)
        now = time.monotonic()
        if match and now - last >= interval:
            last = now
            percent = int(match.group(1))
            status = f"qkv setup.py: {what}: {percent} % after {duration(now - start)}"
            if 0 < percent < 100:
                status += f", about {duration((now - start) * (100 - percent) / percent)} left"
            print(status, flush=True)
        sys.stdout.flush()
    if proc.wait() != 0:
        raise subprocess.CalledProcessError(proc.returncode, command)
    print(f"qkv setup.py: {what}: done in {duration(time.monotonic() - start)}", flush=True)


class CMakeExtension(Extension):
    def __init__(self, name, target):
        super().__init__(name, sources=[])
        self.target = target


class CMakeBuild(build_ext):
    """Runs cmake's configure and build for each CMakeExtension's target."""

    def build_extension(self, ext):
        # The folder setuptools packs: <build_lib>/qkv/_qkv*.so lands in it.
        package_root = os.path.abspath(os.path.dirname(os.path.dirname(
            self.get_ext_fullpath(ext.name))))
        build_dir = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        configure = [
            "cmake", "-S", ROOT, "-B", build_dir,
            "-DCMAKE_BUILD_TYPE=Release",
            "-DQKV_BUILD_TESTS=OFF", "-DQKV_BUILD_BENCH=OFF", "-DQKV_BUILD_CLI=OFF",
            "-DQKV_BUILD_PYTHON=ON",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DQKV_PYTHON_BUILD_DIR={package_root}",
        ] + shlex.split(os.environ.get("QKV_CMAKE_ARGS", ""))
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        build = ["cmake", "--build", build_dir, "--target", ext.target, "-j", jobs]
        print("qkv setup.py: building the extension with CMake, a few minutes on 2 cores "
              "(pip shows the progress with -v)", flush=True)
        for command, what in ((configure, "configure"), (build, "build")):
            print("qkv setup.py:", " ".join(command), flush=True)
            run_with_progress(command, what)


setup(
    version=cmake_version(),
    packages=["qkv"],
    package_dir={"": "python"},
    package_data={"qkv": ["*.pyi", "py.typed"]},
    ext_modules=[CMakeExtension("qkv._qkv", target="qkv_python")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
