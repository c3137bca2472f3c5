#!/usr/bin/env bash
# Fuzzes one of qkv's file readers for a bounded time, starting from valid
# files and with a dictionary of the format's tokens:
#   npy       the .npy reader (fuzz/npy_fuzz.cc), from arrays of every dtype,
#             format version and rank written by NumPy
#   manifest  the manifest readers of the key-value store and its index
#             (fuzz/manifest_fuzz.cc), from manifests as qkv writes them
#   index     the search index's readers (fuzz/index_fuzz.cc): its manifest,
#             packages.json and BM25 postings, from files as qkv writes them
#   tokenizer the search engine's WordPiece tokenizer (fuzz/tokenizer_fuzz.cc):
#             texts in many scripts with invalid UTF-8, and a vocabulary
# Usage: fuzz/run_fuzz.sh npy|manifest|index|tokenizer FUZZER_BINARY SECONDS
# Exits non-zero if the fuzzer finds a crash (the reproducer is kept and named).
set -euo pipefail

if [ $# -ne 3 ] || { [ "$1" != npy ] && [ "$1" != manifest ] && [ "$1" != index ] &&
                     [ "$1" != tokenizer ]; }; then
  echo "usage: $0 npy|manifest|index|tokenizer FUZZER_BINARY SECONDS" >&2
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

# An index's manifest body, as StoreIndex::build writes it but for "xxh3",
# which the harness adds.
cat >"$work/corpus/index.json" <<'JSON'
{
 "format": "qkv store index",
 "version": 3,
 "dtype": "float32",
 "key_dim": 4,
 "value_dim": 2,
 "rows": 10,
 "lists": 3,
 "store": {
  "chunks": 2,
  "fingerprint": "0123456789abcdef"
 },
 "build": {
  "iterations": 10,
  "sample_per_list": 64,
  "seed": "0000000000000000"
 },
 "files": {
  "centroids.npy": "0000000000000001",
  "list_rows.npy": "0000000000000002",
  "radii.npy": "0000000000000003",
  "norms.npy": "0000000000000004",
  "ids.npy": "0000000000000005",
  "keys.npy": "0000000000000006",
  "values.npy": "0000000000000007",
  "box_low.npy": "0000000000000008",
  "box_high.npy": "0000000000000009",
  "block_low.npy": "000000000000000a",
  "block_high.npy": "000000000000000b"
 }
}
JSON

cat >"$work/fuzz.dict" <<'DICT'
"\"qkv store index\""
"\"lists\""
"\"fingerprint\""
"\"iterations\""
"\"sample_per_list\""
"\"seed\""
"\"files\""
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

seed_index() {
# Seeds: the first byte picks the reader (index_fuzz.cc). A manifest as
# qkv writes it, its checksum formed by Debian's libxxhash; packages.json;
# postings blobs of 3 and 1 documents; a model's safetensors.
/usr/bin/python3 - "$work/corpus" <<'PY'
import ctypes, json, sys
xxh = ctypes.CDLL("libxxhash.so.0")
xxh.XXH3_64bits.restype = ctypes.c_uint64
xxh.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
out = sys.argv[1]
manifest = {"format": "qkv search index", "version": 2, "packages": 3, "dim": 4,
            "document_tokens": 128, "score_scale": 20.0,
            "hybrid_fusion": "linear", "hybrid_weight": 5.0, "sections": ["admin", "math"],
            "files": {"packages.json": "a06fb0e9c2347f54", "query_head.npy": "c9943ff12eb70f30",
                      "bm25.sqlite": "efd56195dbf783d7",
                      "model/config.json": "30c353f3389fca62",
                      "model/1_Pooling/config.json": "0123456789abcdef",
                      "model/sentence_bert_config.json": "1123456789abcdef",
                      "model/vocab.txt": "2123456789abcdef",
                      "model/model.safetensors": "3123456789abcdef"}}
body = json.dumps(manifest, separators=(",", ":")).encode()
manifest["xxh3"] = f"{xxh.XXH3_64bits(body, len(body)):016x}"
with open(f"{out}/manifest.bin", "wb") as f:
    f.write(b"\0" + json.dumps(manifest, indent=2).encode())
packages = [{"name": "gnuplot", "short_description": "plotting", "section": "math",
             "held_out": False},
            {"name": "zsh", "short_description": "shell", "section": "shells", "held_out": True}]
with open(f"{out}/packages.bin", "wb") as f:
    f.write(b"\1" + json.dumps(packages).encode())
with open(f"{out}/postings.bin", "wb") as f:  # 3 documents, 2 hits: rowids 1 and 3
    f.write(bytes([2, 3, 0, 2, 0, 1, 2, 2, 1]))
with open(f"{out}/postings_long.bin", "wb") as f:  # a multi-byte varint count
    f.write(bytes([2, 1, 0, 1, 0, 1, 0x81, 0x01]))
# A safetensors file as Hugging Face's writer lays it out: the header
# padded with spaces to 8 bytes, F32 and I64 tensors, metadata.
import struct
header = {"__metadata__": {"format": "pt"},
          "a.weight": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
          "a.bias": {"dtype": "F32", "shape": [3], "data_offsets": [24, 36]},
          "ids": {"dtype": "I64", "shape": [1, 2], "data_offsets": [40, 56]}}
text = json.dumps(header, separators=(",", ":")).encode()
text += b" " * (-len(text) % 8)
with open(f"{out}/model.bin", "wb") as f:
    f.write(b"\3" + struct.pack("<Q", len(text)) + text + bytes(56))
PY

cat >"$work/fuzz.dict" <<'DICT'
"\"format\""
"\"qkv search index\""
"\"version\""
"\"dim\""
"\"query_head.npy\""
"\"model/vocab.txt\""
"\"score_scale\""
"\"hybrid_fusion\""
"\"hybrid_weight\""
"\"sections\""
"\"files\""
"\"xxh3\""
"\"linear\""
"\"ranks\""
"\"name\""
"\"short_description\""
"\"section\""
"\"held_out\""
"\"dtype\""
"\"shape\""
"\"data_offsets\""
"\"F32\""
"\"__metadata__\""
"true"
"18446744073709551615"
"-1"
"1e308"
"\x80\x80\x80\x80\x80"
DICT
}

seed_tokenizer() {
# Seeds: the first byte picks the input's kind (tokenizer_fuzz.cc): texts
# (byte 1-255, also picking max_length) and a vocabulary (byte 0).
/usr/bin/python3 - "$work/corpus" <<'PY'
import sys
out = sys.argv[1]
texts = [
    "The Playing field, [SEP] un-affable caf\u00e9s!",
    "Cr\u00e8me br\u00fbl\u00e9e \u00c5ngstr\u00f6m \u0130stanbul \u03a3\u039f\u03a6\u0399\u0391",
    "\u4e2d\u6587\u5b57 \ud55c\uad6d\uc5b4 \u3042\u3044 \U0001F600\u200d\U0001F469 \ufb01",
    "a\u0301\u0327 x\u302e\U0001d165\u0900\U0001d165 \u0b48 \U0001d15e\u1b44",
    "tab\tnew\nline\r\x0b\x0c\x85\u00a0\u3000\u2028 \x00\ufffd\ue000 [MASK][CLS]",
    "a" * 101 + " " + "\u00e9" * 100,
]
for i, t in enumerate(texts):
    with open(f"{out}/text{i}.bin", "wb") as f:
        f.write(bytes([1 + 37 * i % 255]) + t.encode())
with open(f"{out}/invalid.bin", "wb") as f:
    f.write(b"\x05ca\xff\xfefe \xe2\x82 \xed\xa0\x80 \xf4\x90\x80\x80 \xc0\xaf \xf0\x9f\x98")
with open(f"{out}/vocab.bin", "wb") as f:
    f.write(b"\0[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\nplay\n##ing\n!\ncr\xc3\xa8me\n")
PY

cat >"$work/fuzz.dict" <<'DICT'
"[SEP]"
"[CLS]"
"[MASK]"
"[UNK]"
"[PAD]"
"##"
"\x0a"
"\xcc\x81"
"\xe3\x80\xae"
"\xf0\x9d\x85\xa5"
"\xe0\xa4\x80"
"\xe4\xb8\xad"
"\xed\x95\x9c"
"\xc4\xb0"
"\xe2\x80\x8d"
"\xef\xbf\xbd"
"\xed\xa0\x80"
"\xf4\x90\x80\x80"
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
