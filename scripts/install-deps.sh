#!/usr/bin/env bash
# Installs the Debian 12 packages qkv needs, and nothing if they are all
# there already (idempotent), and fetches apt's English package descriptions
# for `qkv search` once if they are missing. Usage: scripts/install-deps.sh [build|test]
#   build: the compiler, CMake and the libraries the qkv library, command and
#          Python package use (pybind11 and NumPy for /usr/bin/python3; the
#          key-value store's JSON and checksum headers; OpenMPI for
#          attention sharded across ranks, qkv::mpi and mpirun qkv attend)
#   test:  build's, plus GoogleTest, Google Benchmark, clang's libFuzzer, pytest,
#          venv/pip/setuptools/wheel (the package's pip install is tested) and
#          the peers the tests compare against (Debian's PyTorch 1.13 and
#          statsmodels; the registry's, pinned, in build/venv: make-venv.sh;
#          the book's code, d2l 1.0.3, on Debian's torch 1.13, torchvision
#          0.14.1, matplotlib, IPython, pandas, SciPy, PIL and requests, in
#          build/d2l-venv: make-venv.sh --d2l)
set -euo pipefail

build_packages=(g++ cmake make libopenblas-dev libhwy-dev libcli11-dev libomp-dev gnuplot-nox
                nlohmann-json3-dev libxxhash-dev libopenmpi-dev openmpi-bin
                python3 python3-dev python3-numpy pybind11-dev libapt-pkg-dev libsqlite3-dev)
test_packages=(googletest libgtest-dev libgmock-dev libbenchmark-dev clang-14 libclang-rt-14-dev
               python3-pytest python3-venv python3-pip python3-setuptools python3-wheel
               python3-torch python3-statsmodels chromium
               python3-torchvision python3-matplotlib python3-matplotlib-inline python3-ipython
               python3-pandas python3-scipy python3-pil python3-requests)

packages=("${build_packages[@]}")
if [ "${1:-build}" = test ]; then packages+=("${test_packages[@]}"); fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

sudo=()
if [ "$(id -u)" -ne 0 ]; then sudo=(sudo); fi
# `qkv search index` reads the package index's long descriptions, which
# Debian 12 keeps in the Translation-en lists; a default `apt-get update`
# here fetches none (Acquire::Languages follows the locale), so fetch them
# once (about 13 MB).
lists=$(apt-config shell d Dir::State::lists/d | sed -E "s/^d='(.*)'$/\1/")
translations=no
for f in "${lists:-/var/lib/apt/lists/}"*_i18n_Translation-en*; do
  [ -e "$f" ] && translations=yes && break
done

if [ ${#missing[@]} -gt 0 ] || [ "$translations" = no ]; then
  echo "qkv: apt-get update (with the English package descriptions)" >&2
  "${sudo[@]}" apt-get update -q -o Acquire::Languages=en
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "qkv: installing ${missing[*]}" >&2
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The tests' registry peers (PyTorch 2, the pretrained sentence encoder and
# its reference implementation, FAISS), pinned, in build/venv: made once,
# kept while scripts/peers-requirements.txt is unchanged (about 40 s).
# The book's code, d2l 1.0.3 (pinned), in build/d2l-venv beside Debian's
# torch 1.13 for qkv.d2l's tests: made once, kept while
# scripts/d2l-requirements.txt is unchanged (about 20 s).
if [ "${1:-build}" = test ]; then
  "$(dirname "$0")/make-venv.sh" >/dev/null
  "$(dirname "$0")/make-venv.sh" --d2l >/dev/null
fi
