"""Builds the Python package qkv with the project's own CMake (see pyproject.toml).

The extension qkv._qkv is the CMake target qkv_python; this file configures a
Release tree for the interpreter that runs it (a venv's python, say), builds
that one target into setuptools' build folder, and lets setuptools add the
pure-Python files of python/qkv. The version is the CMake project's.
QKV_CMAKE_ARGS, if set, adds its words (split as a shell would) to the
configure command: -DQKV_NATIVE_SIMD_ONLY=ON, say, for a quicker build of a
package that only this machine runs.
"""

import os
import re
import shlex
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def cmake_version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        match = re.search(r"project\(qkv VERSION ([0-9.]+)", f.read())
    if not match:
        raise RuntimeError("setup.py: no `project(qkv VERSION x.y.z` in CMakeLists.txt")
    return match.group(1)


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
        for command in (configure, build):
            print("qkv setup.py:", " ".join(command), file=sys.stderr, flush=True)
            subprocess.run(command, check=True)


setup(
    version=cmake_version(),
    packages=["qkv"],
    package_dir={"": "python"},
    package_data={"qkv": ["*.pyi", "py.typed"]},
    ext_modules=[CMakeExtension("qkv._qkv", target="qkv_python")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
