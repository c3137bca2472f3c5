#!/usr/bin/env bash
# Installs the built qkv into a temporary prefix and builds against it with
# find_package(qkv), as a user's project would:
#   - the README's example (qkv::qkv) and a lookup example (qkv::chapter),
#     with the CMake files of OpenBLAS, Highway, OpenMP and MPI made
#     unfindable (CMAKE_DISABLE_FIND_PACKAGE_*): the package needs no
#     dependency's dev package for them, and names its libraries' files as
#     the runtime packages ship them (no dev symlink such as libhwy.so);
#   - when qkv was built with MPI, attention over a store shared by two MPI
#     ranks (qkv::mpi) with find_package(qkv COMPONENTS mpi), and that
#     component failing, with a message, when MPI cannot be found;
#     without MPI, COMPONENTS mpi fails saying qkv was built without it;
# runs them and checks their answers, and checks that the core library holds
# none of the chapter's figure code (nothing spawns gnuplot).
# Usage: check_install.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1 source=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
no_deps=(-DCMAKE_DISABLE_FIND_PACKAGE_OpenBLAS=ON -DCMAKE_DISABLE_FIND_PACKAGE_hwy=ON
         -DCMAKE_DISABLE_FIND_PACKAGE_OpenMP=ON)
consumer() {  # build folder, then cmake arguments
  local dir=$1
  shift
  cmake -S "$source/tests/package" -B "$work/$dir" -DCMAKE_PREFIX_PATH="$work/prefix" \
    -DQKV_EXAMPLE_SOURCE="$source/examples/attend.cc" "$@" >"$work/$dir.log" 2>&1
}
consumer consumer "${no_deps[@]}" -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON ||
  { cat "$work/consumer.log" >&2
    echo "check_install: find_package(qkv) needs another package's CMake files (above)" >&2; exit 1; }
cmake --build "$work/consumer" >/dev/null
# The library files the package names: each the runtime package's file, not a symlink.
targets=$(find "$work/prefix" -name 'qkvTargets.cmake')
files=$(grep -o 'LINK_ONLY:/[^>]*' "$targets" | cut -d: -f2- | sort -u)
if [ -n "$(find "$work/prefix" -name 'libqkv.a')" ] && [ -z "$files" ]; then
  echo "check_install: $targets names no library file for a static libqkv" >&2
  exit 1
fi
for file in $files; do
  if [ ! -f "$file" ] || [ -L "$file" ]; then
    echo "check_install: $targets names $file, which is missing or a symlink (a dev package's)" >&2
    exit 1
  fi
done
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
  consumer consumer-mpi "${no_deps[@]}" -DQKV_CONSUMER_MPI=ON ||
    { cat "$work/consumer-mpi.log" >&2
      echo "check_install: find_package(qkv COMPONENTS mpi) failed (above)" >&2; exit 1; }
  cmake --build "$work/consumer-mpi" --target mpi_example >/dev/null
  out=$(mpirun --oversubscribe --allow-run-as-root -np 2 "$work/consumer-mpi/mpi_example" "$work")
  echo "$out"
  if [ "$out" != "4.5" ]; then
    echo "check_install: mpi_example printed \"$out\", expected \"4.5\"" >&2
    exit 1
  fi
  missing="dependency MPI could not be found"
  want_fail=(-DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON)
else
  missing="qkv was built without MPI"
  want_fail=()
fi
# COMPONENTS mpi where it cannot be had: configuring fails and says why.
if consumer consumer-no-mpi -DQKV_CONSUMER_MPI=ON "${want_fail[@]}"; then
  echo "check_install: find_package(qkv COMPONENTS mpi) succeeded without MPI" >&2
  exit 1
fi
grep -q "$missing" "$work/consumer-no-mpi.log" ||
  { cat "$work/consumer-no-mpi.log" >&2
    echo "check_install: COMPONENTS mpi without MPI did not say \"$missing\" (above)" >&2; exit 1; }
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
echo "check_install: find_package(qkv) consumers of qkv::qkv and qkv::chapter (no other package's" \
  "CMake files) and of COMPONENTS mpi built and printed the chapter's answers; COMPONENTS mpi" \
  "without MPI failed saying \"$missing\"; $(basename "$core") holds no plot, lookup or spawn symbol"
