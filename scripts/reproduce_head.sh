#!/usr/bin/env bash
# Does a training run from scratch reproduce a shipped head? Retrains it with the exact command
# of scripts/train_default_heads.sh into runs/<method>-repro (resumable: rerun to go on), then
# measures it and the head that command shipped on the same held-out answers with `specdraft
# train eval` and prints the ratio (the issue's bar: within 5%).
#   bash scripts/reproduce_head.sh medusa      # ~35-65 minutes on 2 cores; eagle, mtp ~55-80
set -euo pipefail
cd "$(dirname "$0")/.."
METHOD=${1:?usage: reproduce_head.sh medusa|eagle|mtp|layer-skip}
DATA=train-data/smollm2-135m-bf16
WEIGHTS=src/specdraft/weights/SmolLM2-135M-Instruct.Q4_1
OUT=runs/$METHOD-repro
common=(--data "$DATA" --out "$OUT" --limit 3940 --dtype bfloat16 --threads 2 --epochs 2 --lr 1e-3)
# The commit that shipped each method's first training run (the command below). Eagle, medusa
# and mtp later had more epochs from there (train_default_heads.sh steps 2b, 3b-3c, 4b); those
# runs start from the shipped weights, so the first run is the one to reproduce.
case $METHOD in
  medusa) REF=c425d1a ;;       # the 2-epoch heads, saved in bfloat16
  eagle) REF=58e0bce ;;        # the 2-epoch head
  mtp) REF=c06d7de ;;          # the 2-epoch module
  layer-skip) REF=c7ea851 ;;   # the adapter as shipped (never trained further), with the draft vocabulary
                               # that `train layer-skip` now picks at its end (train_default_heads.sh 5b)
  *) echo "unknown method $METHOD" >&2; exit 2 ;;
esac
case $METHOD in
  medusa) .venv/bin/specdraft train medusa "${common[@]}" --heads 4 ;;
  eagle|mtp) .venv/bin/specdraft train "$METHOD" "${common[@]}" --batch-tokens 1024 --steps 3 ;;
  layer-skip) .venv/bin/specdraft train layer-skip "${common[@]}" --exit-layer 4 ;;
esac
ref=runs/$METHOD-ref-$REF
mkdir -p "$ref"
for f in config.json model.safetensors; do git show "$REF:$WEIGHTS/$METHOD/$f" > "$ref/$f"; done
cmp -s "$ref/model.safetensors" "$OUT/model.safetensors" && echo "the repro's weights are bit-identical to $REF's"
# (each result captured, then echoed: `tee /dev/stderr` would reopen a redirected log at offset 0)
shipped=$(.venv/bin/specdraft train eval "$ref" --data "$DATA" --dtype bfloat16 --threads 2)
echo "shipped ($REF): $shipped"
repro=$(.venv/bin/specdraft train eval "$OUT" --data "$DATA" --dtype bfloat16 --threads 2)
echo "repro: $repro"
tau() { sed -E 's/.*held-out tau ([0-9.]+).*/\1/' <<<"$1"; }
python3 -c "s, r = float('$(tau "$shipped")'), float('$(tau "$repro")'); print(f'repro / shipped held-out tau: {r:.3f} / {s:.3f} = {r / s:.3f}')"
