#!/usr/bin/env bash
# Which training data gives the best held-out tau per CPU hour (issue 15, point 1): MTP modules
# trained from the logit-lens start for one epoch on the same number of tokens (~150k, prompts
# included: the teacher's forward and the head's step cost per token) from the non-code prompt
# sets, on (own) the target's own answers, (refs) the data sets' own answers (teacher forcing,
# EAGLE-1's recipe: no generation needed), (mix) half of each; then (shipped+refs) the shipped
# module trained on ~300k tokens of references, and (refs-all) every non-code reference (669k
# tokens) from the start. Every run is measured on the same held-out
# positions (the non-code validation split's greedy answers). Resumable (each run resumes from
# its checkpoints); run it alone: about 45 minutes on 2 cores. Results: results/trained-heads/mix/.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=train-data/smollm2-135m-bf16
PROMPTS=${PROMPTS:-../shared/datasets/train}
SRC=alpaca-libre,gpteacher-roleplay,oasst-samples,oasst1,self-instruct-seed
OUT=${OUT:-runs/mix}
mkdir -p "$OUT"
run() {  # name, then train options
  local name=$1; shift
  [ -f "$OUT/$name/model.safetensors" ] && return 0
  /usr/bin/time -f "%e s wall" .venv/bin/specdraft train mtp --data "$DATA" --out "$OUT/$name" --sources "$SRC" \
    --prompts "$PROMPTS" --dtype bfloat16 --threads 2 "$@" 2>&1 | tr '\r' '\n' | grep -v '^\s*$' | tail -n 40 > "$OUT/$name.log"
}
run own --limit 675
run refs --limit 1 --references 1130
run mix --limit 350 --references 540
run shipped+refs --init src/specdraft/weights/SmolLM2-135M-Instruct.Q4_1/mtp --limit 1 --references 2306 --lr 3e-4
run refs-all --limit 1 --references 5129
