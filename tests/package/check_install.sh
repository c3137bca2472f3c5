#!/usr/bin/env bash
# Installs the built qkv into a temporary prefix, builds the README's example
# (qkv::qkv), a lookup example (qkv::chapter) and, when qkv was built with
# MPI, attention over a store shared by two MPI ranks (qkv::mpi) against it
# with find_package(qkv), runs them and checks their answers, and checks that the
# core library holds none of the chapter's figure code (nothing spawns gnuplot).
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
out=$("$work/consumer/chapter_example")
echo "$out"
if [ "$out" != "Aston" ]; then
  echo "check_install: chapter_example printed \"$out\", expected \"Aston\"" >&2
  exit 1
fi
if [ -n "$(find "$work/prefix" -name 'libqkv_mpi.a' -o -name 'libqkv_mpi.so*')" ]; then
  [ -x "$work/consumer/mpi_example" ] ||
    { echo "check_install: qkv::mpi is installed but find_package(qkv) gave no qkv::mpi" >&2; exit 1; }
  out=$(mpirun --oversubscribe --allow-run-as-root -np 2 "$work/consumer/mpi_example" "$work")
  echo "$out"
  if [ "$out" != "4.5" ]; then
    echo "check_install: mpi_example printed \"$out\", expected \"4.5\"" >&2
    exit 1
  fi
fi
[ -x "$work/prefix/bin/qkv" ] || { echo "check_install: qkv was not installed" >&2; exit 1; }
grep -qx 'MIT License' "$work/prefix/share/doc/qkv/LICENSE" ||
  { echo "check_install: share/doc/qkv/LICENSE (the MIT license) was not installed" >&2; exit 1; }
# The core library (static or shared) defines no plot or lookup function and
# refers to no process spawning; the chapter's library does.
core=$(find "$work/prefix" -name 'libqkv.a' -o -name 'libqkv.so*' | head -1)
chapter=$(find "$work/prefix" -name 'libqkv_chapter.a' -o -name 'libqkv_chapter.so*' | head -1)
[ -n "$core" ] && [ -n "$chapter" ] || { echo "check_install: libqkv or libqkv_chapter missing" >&2; exit 1; }
pattern='qkv::heatmaps|qkv::plot_|qkv::KeyValueDatabase|posix_spawn'
# (Symbols to files first: grep -q would stop reading early, and nm's SIGPIPE
# fail the pipeline under pipefail.)
nm -C "$core" >"$work/core.syms"
nm -C "$chapter" >"$work/chapter.syms"
if grep -E "$pattern" "$work/core.syms" >&2; then
  echo "check_install: $core holds the chapter's code (above)" >&2
  exit 1
fi
grep -qE 'qkv::heatmaps' "$work/chapter.syms" ||
  { echo "check_install: $chapter lacks qkv::heatmaps" >&2; exit 1; }
echo "check_install: find_package(qkv) consumers of qkv::qkv, qkv::chapter (and qkv::mpi) built and printed" \
  "the chapter's answers; $(basename "$core") holds no plot, lookup or spawn symbol"
