#!/usr/bin/env bash
# Fuzzes the .npy reader for a bounded time, starting from valid files of every
# dtype, format version and rank. Usage: fuzz/run_npy_fuzz.sh FUZZER_BINARY SECONDS
# Exits non-zero if the fuzzer finds a crash (the reproducer is kept and named).
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 FUZZER_BINARY SECONDS" >&2
  exit 2
fi
if [ ! -x "$1" ]; then
  echo "$0: no fuzzer binary at $1 (build the npy_fuzz target first)" >&2
  exit 2
fi
fuzzer=$(realpath "$1")
seconds=$2

work=$(mktemp -d "${TMPDIR:-/tmp}/npy_fuzz.XXXXXX")
mkdir "$work/corpus" "$work/artifacts"

# Seeds: small arrays of each dtype, versions 1.0/2.0/3.0, ranks 0-4 (with a
# zero-size axis among them), written by NumPy itself.
/usr/bin/python3 - "$work/corpus" <<'PY'
import sys
import numpy as np
from numpy.lib import format as npf

out = sys.argv[1]
shapes = [(), (3,), (2, 3), (1, 0, 2), (2, 1, 2, 2)]
for dtype in ("<f4", "<f8", "<i4", "<i8"):
    for version in ((1, 0), (2, 0), (3, 0)):
        for rank, shape in enumerate(shapes):
            a = (np.arange(int(np.prod(shape))) - 2).astype(dtype).reshape(shape)
            with open(f"{out}/{dtype[1:]}_v{version[0]}_r{rank}.npy", "wb") as f:
                npf.write_array(f, a, version=version)
PY

# Header tokens, so mutations build dicts and not just noise.
cat >"$work/npy.dict" <<'DICT'
"'descr'"
"'fortran_order'"
"'shape'"
"True"
"False"
"'<f4'"
"'<f8'"
"'<i4'"
"'<i8'"
"'|O'"
"'>f8'"
"\x93NUMPY"
"9223372036854775807"
DICT

log="$work/fuzz.log"
status=0
(cd "$work" && "$fuzzer" -max_total_time="$seconds" -print_final_stats=1 -max_len=4096 \
  -dict="$work/npy.dict" -artifact_prefix="$work/artifacts/" "$work/corpus") >"$log" 2>&1 || status=$?

if [ "$status" -ne 0 ] || [ -n "$(ls -A "$work/artifacts")" ]; then
  tail -n 40 "$log" >&2
  echo "npy_fuzz: FAILED (status $status); log and reproducers kept in $work:" >&2
  ls "$work/artifacts" >&2
  exit 1
fi
grep -E '^(Done |stat::)' "$log" || tail -n 5 "$log"
echo "npy_fuzz: no crash in ${seconds}s ($(ls "$work/corpus" | wc -l) corpus files)"
rm -rf "$work"
