#!/usr/bin/env bash
# Installs the Debian 12 packages qkv needs, and nothing if they are all
# there already (idempotent). Usage: scripts/install-deps.sh [build|test]
#   build: the compiler, CMake and the libraries the qkv library and command use
#   test:  build's, plus GoogleTest, Google Benchmark, clang's libFuzzer and
#          the peers the tests compare against (PyTorch, NumPy)
set -euo pipefail

build_packages=(g++ cmake make libopenblas-dev libhwy-dev libcli11-dev libomp-dev gnuplot-nox)
test_packages=(googletest libgtest-dev libgmock-dev libbenchmark-dev clang-14 libclang-rt-14-dev
               python3 python3-numpy python3-torch python3-statsmodels chromium)

packages=("${build_packages[@]}")
if [ "${1:-build}" = test ]; then packages+=("${test_packages[@]}"); fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "qkv: installing ${missing[*]}" >&2
sudo=()
if [ "$(id -u)" -ne 0 ]; then sudo=(sudo); fi
"${sudo[@]}" apt-get update -q
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
