#!/usr/bin/env bash
# Makes a venv of pinned Python peers from Debian's /usr/bin/python3 (the
# interpreter qkv's Python package is built for). Idempotent: a venv made
# from the same requirements is kept (DIR/requirements.txt is the copy it
# was made from). Prints the venv's python.
#   scripts/make-venv.sh [DIR]        the benchmarks' and tests' registry peers
#       (scripts/peers-requirements.txt) at build/venv, without Debian's
#       site-packages: the registry's NumPy never meets Debian's in one process.
#   scripts/make-venv.sh --d2l [DIR]  the book's code, d2l 1.0.3
#       (scripts/d2l-requirements.txt, pinned by version and hash) at
#       build/d2l-venv, with Debian's site-packages (torch 1.13, torchvision
#       0.14.1, matplotlib, ...: scripts/install-deps.sh test) and d2l
#       installed without its dependencies' pins; qkv's package imports
#       there too. Checked by importing d2l.torch, not by `pip check`, which
#       reports the pins (numpy 1.23.5, pandas 2.0.3, ...) --no-deps leaves
#       to Debian's versions on purpose; d2l.torch imports every package it
#       uses at the top.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --d2l ]; then
  shift
  venv=${1:-build/d2l-venv}
  requirements=scripts/d2l-requirements.txt
  venv_options=(--system-site-packages)
  pip_options=(--no-deps --require-hashes)
  check='from d2l import torch as d2l'
else
  venv=${1:-build/venv}
  requirements=scripts/peers-requirements.txt
  venv_options=()
  pip_options=()
  check=
fi
if [ -x "$venv/bin/python" ] && cmp -s "$requirements" "$venv/requirements.txt"; then
  echo "$venv/bin/python"
  exit 0
fi
echo "qkv: making a venv at $venv ($requirements)" >&2
rm -rf "$venv"
/usr/bin/python3 -m venv "${venv_options[@]}" "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check "${pip_options[@]}" \
  -r "$requirements" >&2
if [ -n "$check" ]; then
  "$venv/bin/python" -c "$check" >&2
else
  "$venv/bin/pip" check >&2
fi
cp "$requirements" "$venv/requirements.txt"
echo "$venv/bin/python"
