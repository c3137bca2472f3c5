#!/usr/bin/env bash
# The two set-up commands of the README:
#   scripts/build.sh demo [qkv demo options]  install what is missing, build (Release), run `qkv demo`
#                                             and show the Python package working
#   scripts/build.sh test                     install what is missing, build and run every test:
#                                             Release, Debug + ASan/UBSan, and a 40-second fuzz
#                                             run of each file reader; a table of the stages'
#                                             times at the end
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
    build/release/qkv demo "$@"
    # The Python package was built too: show it working, and how to use it.
    python_dir=$(pwd)/build/release/python
    echo
    echo "Python: the package qkv is built in $python_dir:"
    PYTHONPATH=$python_dir /usr/bin/python3 -c 'import numpy as np, qkv
q, k = np.ones((2, 1, 2), np.float32), np.ones((2, 10, 2), np.float32)
v = np.tile(np.arange(40, dtype=np.float32).reshape(1, 10, 4), (2, 1, 1))
print("  qkv", qkv.__version__, "on", qkv.simd_target() + ": scaled_dot_product_attention(q, k, v, [2, 6]) =",
      qkv.scaled_dot_product_attention(q, k, v, [2, 6]).tolist())'
    echo "  use it:     PYTHONPATH=$python_dir /usr/bin/python3 -c 'import qkv; help(qkv)'"
    echo "  PyTorch:    PYTHONPATH=$python_dir /usr/bin/python3 examples/book_examples.py   (needs python3-torch)"
    echo "  install it: cmake --install build/release   (then import qkv from /usr/bin/python3; docs/python.md)"
    ;;
  test)
    # Each stage timed; the table of their times is printed at the end, and
    # also when a stage fails (then its row says so).
    stage_names=()
    stage_times=()
    stage() {  # name, then the command
      local name=$1 start=$SECONDS
      shift
      stage_names+=("$name")
      stage_times+=("running")
      "$@"
      stage_times[-1]=$((SECONDS - start))
    }
    print_stages() {
      local status=$? total=0 i
      echo
      echo "scripts/build.sh test: stage times (s)"
      printf '  %-34s %8s\n' stage seconds
      for i in "${!stage_names[@]}"; do
        if [ "${stage_times[$i]}" = running ]; then
          printf '  %-34s %8s\n' "${stage_names[$i]}" failed
        else
          printf '  %-34s %8d\n' "${stage_names[$i]}" "${stage_times[$i]}"
          total=$((total + stage_times[$i]))
        fi
      done
      printf '  %-34s %8d\n' total "$total"
      return $status
    }
    trap print_stages EXIT
    # 40 s each, not 60: CI run 46 took 1,808 s against the 30-minute budget.
    fuzz_readers() {  # readers: each fuzzed for 40 s, all at once (sharing the cores)
      local reader pid pids=() status=0
      for reader in "$@"; do
        fuzz/run_fuzz.sh "$reader" "build/fuzz/${reader}_fuzz" 40 &
        pids+=($!)
      done
      for pid in "${pids[@]}"; do wait "$pid" || status=1; done
      return $status
    }
    stage "install dependencies" scripts/install-deps.sh test
    # Fuzz the file readers first (clang's libFuzzer with ASan, bounded to 40
    # s each, side by side): the .npy reader, the key-value store's
    # manifest reader, the search index's readers and the sentence encoder's
    # tokenizer and vocabulary reader.
    if [ ! -f build/fuzz/CMakeCache.txt ]; then
      cmake -S . -B build/fuzz -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER=clang++-14 \
        -DQKV_FUZZ=ON -DQKV_BUILD_TESTS=OFF -DQKV_BUILD_BENCH=OFF >/dev/null
    fi
    stage "fuzz: build" cmake --build build/fuzz -j "$jobs" --target npy_fuzz manifest_fuzz \
      index_fuzz tokenizer_fuzz
    stage "fuzz: the file readers" fuzz_readers npy manifest index tokenizer
    # Debug with AddressSanitizer + UndefinedBehaviorSanitizer: the kernels at
    # this CPU's best SIMD target and scalar (CMakeLists.txt); the Python
    # package, the docs' examples and --help's run in Release only
    # (tests/CMakeLists.txt).
    stage "ASan+UBSan: build" configure_and_build build/asan -DCMAKE_BUILD_TYPE=Debug \
      -DQKV_SANITIZE=ON -DQKV_BUILD_BENCH=OFF
    stage "ASan+UBSan: tests" ctest --test-dir build/asan --output-on-failure -j "$jobs"
    # Release, every SIMD target, with the benchmarks built (not run: they
    # are not tests).
    stage "Release: build" configure_and_build build/test-release -DCMAKE_BUILD_TYPE=Release
    stage "Release: tests" ctest --test-dir build/test-release --output-on-failure -j "$jobs"
    ;;
  *)
    echo "usage: scripts/build.sh demo [options] | scripts/build.sh test" >&2
    exit 2
    ;;
esac
