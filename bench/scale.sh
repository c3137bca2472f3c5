#!/usr/bin/env bash
# The one command behind docs/scale.md's benchmark: builds the benchmark
# targets in build/perf (Release), then runs bench/scale.py, which builds the
# stores it needs once in build/scale-stores (10^7-row stores of 5 and 2.5 GB,
# and a 32 GiB store: 40 GB of disk; kept between runs, never committed),
# measures everything in one run and writes docs/scale.md's benchmark
# section, docs/scale-mpi.png and docs/perf-runs/scale.json. Leave the
# machine otherwise idle while it runs.
#   bench/scale.sh [--repetitions N] [--stores DIR] [--build DIR]   (DIR: a Release tree
#                  with the benchmarks, e.g. build/test-release after scripts/build.sh test)
#   bench/scale.sh --replay        re-render the page from docs/perf-runs/scale.json
set -euo pipefail
cd "$(dirname "$0")/.."

build=build/perf
stores=build/scale-stores
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --stores) stores=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DQKV_BUILD_TESTS=OFF -DQKV_BUILD_BENCH=ON \
    >/dev/null
fi
cmake --build "$build" -j "$(nproc)" --target roofline bench_scale bench_scale_mpi qkv_cli
exec /usr/bin/python3 bench/scale.py --build "$build" --stores "$stores" "${args[@]}"
