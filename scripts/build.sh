#!/usr/bin/env bash
# The two set-up commands of the README:
#   scripts/build.sh demo [qkv demo options]  install what is missing, build (Release), run `qkv demo`
#   scripts/build.sh test                     install what is missing, build and run every test:
#                                             Release, Debug + ASan/UBSan, and a one-minute fuzz
#                                             run of the .npy reader
# Both are idempotent; with nothing changed they only re-run the demo or the tests.
set -euo pipefail
cd "$(dirname "$0")/.."

jobs=$(nproc)
what=${1:-}
shift || true

configure_and_build() {  # dir, then extra cmake arguments
  local dir=$1
  shift
  if [ ! -f "$dir/CMakeCache.txt" ]; then cmake -S . -B "$dir" "$@" >/dev/null; fi
  cmake --build "$dir" -j "$jobs"
}

case "$what" in
  demo)
    scripts/install-deps.sh build
    configure_and_build build/release -DCMAKE_BUILD_TYPE=Release -DQKV_BUILD_TESTS=OFF \
      -DQKV_BUILD_BENCH=OFF
    exec build/release/qkv demo "$@"
    ;;
  test)
    scripts/install-deps.sh test
    # Fuzz the .npy reader first (clang's libFuzzer with ASan, bounded to a minute).
    if [ ! -f build/fuzz/CMakeCache.txt ]; then
      cmake -S . -B build/fuzz -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER=clang++-14 \
        -DQKV_FUZZ=ON -DQKV_BUILD_TESTS=OFF -DQKV_BUILD_BENCH=OFF >/dev/null
    fi
    cmake --build build/fuzz -j "$jobs" --target npy_fuzz
    fuzz/run_npy_fuzz.sh build/fuzz/npy_fuzz 60
    # Debug with AddressSanitizer + UndefinedBehaviorSanitizer.
    configure_and_build build/asan -DCMAKE_BUILD_TYPE=Debug -DQKV_SANITIZE=ON -DQKV_BUILD_BENCH=OFF
    ctest --test-dir build/asan --output-on-failure -j "$jobs"
    # Release, with the benchmarks built (not run: they are not tests).
    configure_and_build build/test-release -DCMAKE_BUILD_TYPE=Release
    ctest --test-dir build/test-release --output-on-failure -j "$jobs"
    ;;
  *)
    echo "usage: scripts/build.sh demo [options] | scripts/build.sh test" >&2
    exit 2
    ;;
esac
