#!/usr/bin/env bash
# The one command behind docs/performance.md: configures and builds a Release
# tree in build/perf with the benchmark targets, makes (or finds) the project's
# venv with the pinned torch 2.13 (scripts/make-venv.sh: build/venv, made once)
# for torch 2's SDPA, then runs the driver, which measures everything in one
# run (the machine's roofs, qkv's ops, the book's PyTorch code on Debian's
# torch 1.13, torch 2.13's SDPA) and writes docs/performance.md and
# docs/perf-scaling.png (docs/performance-TARGET.md and its figure for a run
# on a CPU whose best target is below avx512, docs/performance-TARGET-capped.md
# for a run capped there; the raw results go to docs/perf-runs/).
# Takes about 10-15 minutes on the 2-core machine (plus the build); leave the
# machine otherwise idle while it runs: the page flags a run during which
# other processes used the cores.
#   bench/performance.sh [driver options, e.g. --repetitions 5]
#   bench/performance.sh --simd-target avx2   what an AVX2-only machine gets, measured
#                                             here (docs/performance-avx2-capped.md)
set -euo pipefail
cd "$(dirname "$0")/.."

build=build/perf
start=$(date +%s)
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DQKV_BUILD_TESTS=OFF -DQKV_BUILD_BENCH=ON \
    >/dev/null
fi
cmake --build "$build" -j "$(nproc)" --target roofline bench_perf
build_seconds=$(($(date +%s) - start))
# torch 2.13 runs in the venv's Python, never beside Debian's torch 1.13 (the
# driver and bench/perf_torch.py run under /usr/bin/python3).
torch2_python=$(pwd)/$(scripts/make-venv.sh)

exec /usr/bin/python3 bench/performance.py --build "$build" --build-seconds "$build_seconds" \
  --torch2-python "$torch2_python" "$@"
