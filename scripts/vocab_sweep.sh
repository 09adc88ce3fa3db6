#!/usr/bin/env bash
# Held-out tau against the draft vocabulary size (issue 15's table; results/trained-heads/vocab-sweep/):
# the MTP module trained from scratch on the same first LIMIT train answers, 1 epoch, once per
# draft vocabulary size, everything else as the shipped module's command; then each one's
# held-out tau (training's end measure, the same validation answers for all) beside the cost of
# its read-out. Resumable: a finished size is skipped, an interrupted one resumes from its
# checkpoint. About 6 minutes a size on 2 cores with LIMIT=600: run it alone.
#   SIZES="1024 2048 4096 8192" LIMIT=600 bash scripts/vocab_sweep.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-train-data/smollm2-135m-bf16}
SIZES=${SIZES:-"1024 2048 4096 8192"}
LIMIT=${LIMIT:-600}
OUT=${OUT:-runs/vocab-sweep}
for n in $SIZES; do
  dir=$OUT/mtp-$n
  if [ -f "$dir/config.json" ]; then echo "== draft vocabulary $n: done"; continue; fi
  echo "== draft vocabulary $n"
  .venv/bin/specdraft train mtp --data "$DATA" --out "$dir" --limit "$LIMIT" --epochs 1 --draft-vocab "$n" \
    --dtype bfloat16 --threads 2 --batch-tokens 1024 --steps 3 --lr 1e-3
done
.venv/bin/python scripts/vocab_table.py "$OUT"
