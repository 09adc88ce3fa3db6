#!/usr/bin/env bash
# Session 30's experiment: is a second, sampled answer per prompt worth more to a trained drafter
# than another pass over the answers it has seen? (results/trained-heads/second-answers/)
#
# 1. a second answer (temperature 0.7, other seeds) to the non-code sets' train prompts, in a folder of
#    its own, for a time budget (resumable: rerun to go on);
# 2. one epoch of the shipped EAGLE head, then of the shipped MTP module, on those answers alone
#    (--init, lr 3e-4, as session 28's non-code pass over the first answers), measured on the first
#    folder's non-code validation answers (--held-out), the positions session 28 used;
# 3. `specdraft train eval` of every head on the same positions.
# Each step resumes when rerun; run one step at a time (2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=${PROMPTS:-../shared/datasets/train}
FIRST=train-data/smollm2-135m-bf16
SECOND=train-data/smollm2-135m-bf16-t07
WEIGHTS=src/specdraft/weights/SmolLM2-135M-Instruct.Q4_1
NONCODE=alpaca-libre,gpteacher-roleplay,oasst-samples,oasst1,self-instruct-seed
OUT=results/trained-heads/second-answers
mkdir -p "$OUT"
step=${1:-all}

if [ "$step" = data ] || [ "$step" = all ]; then
  .venv/bin/specdraft train data --prompts "$PROMPTS" --out "$SECOND" --dtype bfloat16 --batch-size 32 --threads 2 \
    --time-budget "${BUDGET:-2400}" --split train --temperatures 0.7 --seed 1000003 --sources "$NONCODE"
  .venv/bin/specdraft train summary "$SECOND" > "$OUT/summary.json"
fi
for kind in eagle mtp; do
  if [ "$step" = "$kind" ] || [ "$step" = all ]; then
    .venv/bin/specdraft train "$kind" --data "$SECOND" --held-out "$FIRST" --sources "$NONCODE" \
      --out "runs/$kind-second" --init "$WEIGHTS/$kind" --dtype bfloat16 --threads 2 \
      --epochs 1 --lr 3e-4 --batch-tokens 1024 --steps 3 2>&1 | tr '\r' '\n' | awk '!/batch/ || ++n % 100 == 0' > "$OUT/train-$kind.log"
    cp "runs/$kind-second/curve.jsonl" "$OUT/curve-$kind.jsonl"
  fi
done
if [ "$step" = eval ] || [ "$step" = all ]; then
  for head in "$WEIGHTS/eagle" runs/eagle-second "$WEIGHTS/mtp" runs/mtp-second; do
    [ -f "$head/model.safetensors" ] || continue
    .venv/bin/specdraft train eval "$head" --data "$FIRST" --sources "$NONCODE" --dtype bfloat16 --threads 2
  done | tee "$OUT/eval-noncode.log"
fi
