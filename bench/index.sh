#!/usr/bin/env bash
# The one command behind docs/index.md's benchmark: builds the qkv command
# and Python package (Release, build/perf unless --build DIR), makes the
# peers' venv (scripts/make-venv.sh: FAISS, hnswlib, NumPy, pinned), builds a
# search index of this machine's package lists with the default options if
# there is none (build/search-index, about 14 minutes; its document encodings,
# d = 384, are data set (b)), then runs bench/index.py in the venv: qkv's index, qkv's
# exact streaming, FAISS and hnswlib on three data sets, in one process. It
# writes docs/index.md's benchmark section, docs/index-recall.png and
# docs/perf-runs/index.json. About an hour at the default 10^7 rows, most
# of it the HNSW builds; the stores it makes (5 GB each) live in
# build/index-bench while it runs. Leave the machine otherwise idle.
#   bench/index.sh [--build DIR] [--search-index DIR] [index.py options: --rows N, --queries Q,
#                  --datasets clustered,search,isotropic, --hnsw-rows N, ...]
#   bench/index.sh --replay        re-render the page from docs/perf-runs/index.json
set -euo pipefail
cd "$(dirname "$0")/.."

build=build/perf
search_index=build/search-index
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --search-index) search_index=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
python=$(scripts/make-venv.sh)
if [ "${args[*]:-}" != --replay ]; then
  if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DQKV_BUILD_TESTS=OFF -DQKV_BUILD_BENCH=ON \
      >/dev/null
  fi
  cmake --build "$build" -j "$(nproc)" --target qkv_cli qkv_python
  if [ ! -d "$search_index" ]; then
    "$build/qkv" search index --out "$search_index" --model "$(scripts/model-dir.sh)" \
      --quiet >/dev/null
  fi
fi
command="bench/index.sh${args[*]:+ ${args[*]}}"
PYTHONPATH=$(pwd)/$build/python exec "$python" bench/index.py --qkv "$build/qkv" \
  --search-index "$search_index" --command "$command" "${args[@]}"
