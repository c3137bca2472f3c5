#!/usr/bin/env bash
# The one command behind docs/performance.md: configures and builds a Release
# tree in build/perf with the benchmark targets, then runs the driver, which
# measures everything in one run and writes docs/performance.md and
# docs/perf-scaling.png (docs/performance-TARGET.md and its figure for a run
# on a CPU whose best target is below avx512, docs/performance-TARGET-capped.md
# for a run capped there; the raw results go to docs/perf-runs/).
# Takes about 6-12 minutes on the 2-core machine (plus the build); leave the
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

exec /usr/bin/python3 bench/performance.py --build "$build" --build-seconds "$build_seconds" "$@"
