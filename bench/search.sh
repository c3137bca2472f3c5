#!/usr/bin/env bash
# The one command behind docs/search.md's measurements: builds the qkv
# command (Release, build/perf unless --build DIR), builds a search index of
# this machine's package lists with the default options (its times are the
# manifest's), runs the encoder's peer test (tests/search/test_encoder_peer.py,
# against sentence-transformers in the venv), `qkv search eval` and example
# queries, and writes docs/search.md's generated section, its figure and
# docs/perf-runs/search.json. Leave the machine otherwise idle while it runs.
#   bench/search.sh [--build DIR] [--index DIR [--reuse]]   (--build: a Release tree, e.g.
#                   build/test-release; --reuse: measure the index at DIR as it is)
#   bench/search.sh --replay                      re-render the page from docs/perf-runs/search.json
set -euo pipefail
cd "$(dirname "$0")/.."

build=build/perf
index=build/search-index
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --index) index=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
encoder_check=()
if [ "${args[*]:-}" != --replay ]; then
  if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DQKV_BUILD_TESTS=OFF -DQKV_BUILD_BENCH=ON \
      >/dev/null
  fi
  cmake --build "$build" -j "$(nproc)" --target qkv_cli qkv_python
  # The encoder against its reference implementation (sentence-transformers
  # in the venv): the peer test's figures on its whole lists (--full), for the page.
  python=$(scripts/make-venv.sh)
  check=$(mktemp)
  PYTHONPATH=$(pwd)/$build/python HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    "$python" tests/search/test_encoder_peer.py --full 2>"$check" >/dev/null ||
    { cat "$check" >&2; exit 1; }
  encoder_check=(--encoder-check "$check")
fi
exec /usr/bin/python3 bench/search.py --qkv "$build/qkv" --index "$index" "${encoder_check[@]}" \
  "${args[@]}"
