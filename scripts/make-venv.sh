#!/usr/bin/env bash
# Makes the venv of the benchmarks' Python peers (scripts/peers-requirements.txt,
# every version pinned) at build/venv, from Debian's /usr/bin/python3 (the
# interpreter qkv's Python package is built for) without its site-packages:
# the registry's NumPy never meets Debian's in one process. Idempotent: a venv
# made from the same requirements is kept (build/venv/requirements.txt is
# the copy it was made from). Prints the venv's python.
#   scripts/make-venv.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-build/venv}
requirements=scripts/peers-requirements.txt
if [ -x "$venv/bin/python" ] && cmp -s "$requirements" "$venv/requirements.txt"; then
  echo "$venv/bin/python"
  exit 0
fi
echo "qkv: making the peers' venv at $venv ($requirements)" >&2
rm -rf "$venv"
/usr/bin/python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check -r "$requirements" >&2
"$venv/bin/pip" check >&2
cp "$requirements" "$venv/requirements.txt"
echo "$venv/bin/python"
