#!/usr/bin/env bash
# The benchmark of the trained drafters shipped for the default model (EAGLE, MTP, Medusa and the
# layer-skip adapter), beside plain, ngram and suffix (results/trained-heads/). bfloat16, batch 1
# and 8, the workloads of issue 15's goals (chat, qa, math, creative) and code. About 40 minutes on
# 2 CPU cores: run it alone.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/trained-heads}
.venv/bin/specdraft bench --dtype bfloat16 --threads 2 \
  --methods "ngram,suffix,eagle,mtp,medusa,layer-skip" \
  --workloads chat,qa,math,creative,code --batch-sizes 1,8 \
  --samples 4 --max-new-tokens 96 --out "$OUT"
