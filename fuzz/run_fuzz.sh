#!/usr/bin/env bash
# Fuzzes one of qkv's file readers for a bounded time, starting from valid
# files and with a dictionary of the format's tokens:
#   npy       the .npy reader (fuzz/npy_fuzz.cc), from arrays of every dtype,
#             format version and rank written by NumPy
#   manifest  the key-value store's manifest reader (fuzz/manifest_fuzz.cc),
#             from manifests as qkv writes them
# Usage: fuzz/run_fuzz.sh npy|manifest FUZZER_BINARY SECONDS
# Exits non-zero if the fuzzer finds a crash (the reproducer is kept and named).
set -euo pipefail

if [ $# -ne 3 ] || { [ "$1" != npy ] && [ "$1" != manifest ]; }; then
  echo "usage: $0 npy|manifest FUZZER_BINARY SECONDS" >&2
  exit 2
fi
reader=$1
if [ ! -x "$2" ]; then
  echo "$0: no fuzzer binary at $2 (build the ${reader}_fuzz target first)" >&2
  exit 2
fi
fuzzer=$(realpath "$2")
seconds=$3

work=$(mktemp -d "${TMPDIR:-/tmp}/${reader}_fuzz.XXXXXX")
mkdir "$work/corpus" "$work/artifacts"

seed_npy() {
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
cat >"$work/fuzz.dict" <<'DICT'
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
}

seed_manifest() {
# Seeds: manifests as KeyValueStore writes them.
cat >"$work/corpus/empty.json" <<'JSON'
{"format": "qkv key-value store", "version": 1, "dtype": "float32", "key_dim": 64,
 "value_dim": 64, "chunk_rows": 262144, "rows": 0, "chunks": []}
JSON
cat >"$work/corpus/two.json" <<'JSON'
{
 "format": "qkv key-value store",
 "version": 1,
 "dtype": "bfloat16",
 "key_dim": 4,
 "value_dim": 2,
 "chunk_rows": 8,
 "rows": 10,
 "chunks": [
  {"rows": 8, "keys": "keys-000000.npy", "keys_xxh3": "0123456789abcdef",
   "values": "values-000000.npy", "values_xxh3": "fedcba9876543210"},
  {"rows": 2, "keys": "keys-000001.npy", "keys_xxh3": "0000000000000000",
   "values": "values-000001.npy", "values_xxh3": "ffffffffffffffff"}
 ]
}
JSON

cat >"$work/fuzz.dict" <<'DICT'
"\"format\""
"\"qkv key-value store\""
"\"version\""
"\"dtype\""
"\"float32\""
"\"bfloat16\""
"\"key_dim\""
"\"value_dim\""
"\"chunk_rows\""
"\"rows\""
"\"chunks\""
"\"keys\""
"\"values\""
"\"keys_xxh3\""
"\"values_xxh3\""
"18446744073709551615"
"-9223372036854775808"
"1e400"
DICT
}

"seed_$reader"

log="$work/fuzz.log"
status=0
(cd "$work" && "$fuzzer" -max_total_time="$seconds" -print_final_stats=1 -max_len=4096 \
  -dict="$work/fuzz.dict" -artifact_prefix="$work/artifacts/" "$work/corpus") >"$log" 2>&1 || status=$?

if [ "$status" -ne 0 ] || [ -n "$(ls -A "$work/artifacts")" ]; then
  tail -n 40 "$log" >&2
  echo "${reader}_fuzz: FAILED (status $status); log and reproducers kept in $work:" >&2
  ls "$work/artifacts" >&2
  exit 1
fi
grep -E '^(Done |stat::)' "$log" || tail -n 5 "$log"
echo "${reader}_fuzz: no crash in ${seconds}s ($(ls "$work/corpus" | wc -l) corpus files)"
rm -rf "$work"
