#!/usr/bin/env bash
# Installs the built qkv into a temporary prefix, builds the README's example
# against it with find_package(qkv), runs it and checks the chapter's answer.
# Usage: check_install.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1 source=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$source/tests/package" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DQKV_EXAMPLE_SOURCE="$source/examples/attend.cc" >/dev/null
cmake --build "$work/consumer" >/dev/null
out=$("$work/consumer/attend_example")
echo "$out"
expected=$'[2 3 4 5]\n[10 11 12 13]'
if [ "$out" != "$expected" ]; then
  echo "check_install: expected:" >&2
  echo "$expected" >&2
  exit 1
fi
[ -x "$work/prefix/bin/qkv" ] || { echo "check_install: qkv was not installed" >&2; exit 1; }
echo "check_install: find_package(qkv) consumer built and printed the chapter's answer"
