#!/usr/bin/env bash
# The exact commands that made the trained heads shipped for the default model
# (src/specdraft/weights/SmolLM2-135M-Instruct.Q4_1/<method>/). Each step resumes when rerun.
# On 2 CPU cores: the data takes ~10 hours (in sessions of ~1 hour), each head ~1 hour.
# Run one step at a time: two torch processes on 2 cores slow each other 10-20x.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=${PROMPTS:-../shared/datasets/train}   # the training prompt sets (see train-data/README.md)
DATA=train-data/smollm2-135m-bf16
WEIGHTS=src/specdraft/weights/SmolLM2-135M-Instruct.Q4_1

NONCODE=alpaca-libre,gpteacher-roleplay,oasst-samples,oasst1,self-instruct-seed

# 1. the target's own answers (greedy and sampled at 0.7), resumable shards; rerun until done
.venv/bin/specdraft train data --prompts "$PROMPTS" --out "$DATA" --dtype bfloat16 --batch-size 32 --threads 2 \
  --time-budget 5400
# 1b. sessions 18 and 20: the rest of every set but GPTeacher codegen (prompt indices then count
# these sets only, so these answers come from this command, not the one above); rerun until done
.venv/bin/specdraft train data --prompts "$PROMPTS" --out "$DATA" --dtype bfloat16 --batch-size 32 --threads 2 \
  --time-budget 2100 --sources "$NONCODE"

# 2. the EAGLE-3 head: the first 3,940 train answers (what the data held when it was trained), 2 epochs
.venv/bin/specdraft train eagle --data "$DATA" --out runs/eagle-main --limit 3940 --dtype bfloat16 --threads 2 \
  --epochs 2 --lr 1e-3 --batch-tokens 1024 --steps 3
mkdir -p "$WEIGHTS/eagle"
cp runs/eagle-main/config.json runs/eagle-main/model.safetensors "$WEIGHTS/eagle/"

# 2b. session 21: one more epoch for the EAGLE head on all 7,727 train answers (the head above saw the
# first 3,940 only), from the shipped head, lr 5e-4 (74 minutes)
.venv/bin/specdraft train eagle --data "$DATA" --out runs/eagle-more --init "$WEIGHTS/eagle" --dtype bfloat16 --threads 2 \
  --epochs 1 --lr 5e-4 --batch-tokens 1024 --steps 3
cp runs/eagle-more/config.json runs/eagle-more/model.safetensors "$WEIGHTS/eagle/"
# 3. the MTP module (DeepSeek-V3 layout), the same data and settings as the EAGLE head
.venv/bin/specdraft train mtp --data "$DATA" --out runs/mtp-main --limit 3940 --dtype bfloat16 --threads 2 \
  --epochs 2 --lr 1e-3 --batch-tokens 1024 --steps 3
mkdir -p "$WEIGHTS/mtp"
cp runs/mtp-main/config.json runs/mtp-main/model.safetensors "$WEIGHTS/mtp/"
# 3b. one more epoch on all 5,098 train answers, from that module (held-out tau 2.45 -> 2.65; ~55 minutes)
.venv/bin/specdraft train mtp --data "$DATA" --out runs/mtp-more --init "$WEIGHTS/mtp" --dtype bfloat16 --threads 2 \
  --epochs 1 --lr 5e-4 --batch-tokens 1024 --steps 3
cp runs/mtp-more/config.json runs/mtp-more/model.safetensors "$WEIGHTS/mtp/"
# 3c. session 18: one epoch on the non-code sets' answers (after step 1b), so the module drafts chat-like text better (code slightly worse)
.venv/bin/specdraft train mtp --data "$DATA" --out runs/mtp-noncode --init "$WEIGHTS/mtp" --dtype bfloat16 --threads 2 \
  --epochs 1 --lr 5e-4 --batch-tokens 1024 --steps 3 \
  --sources "$NONCODE"
cp runs/mtp-noncode/config.json runs/mtp-noncode/model.safetensors "$WEIGHTS/mtp/"
# 3d. session 20: a second epoch on the non-code answers, after the last 516 non-code prompts were
# answered (step 1b once more), at lr 3e-4
.venv/bin/specdraft train mtp --data "$DATA" --out runs/mtp-noncode2 --init "$WEIGHTS/mtp" --dtype bfloat16 --threads 2 \
  --epochs 1 --lr 3e-4 --batch-tokens 1024 --steps 3 \
  --sources "$NONCODE"
cp runs/mtp-noncode2/config.json runs/mtp-noncode2/model.safetensors "$WEIGHTS/mtp/"

# 4. Medusa heads (4 heads), the same data
.venv/bin/specdraft train medusa --data "$DATA" --out runs/medusa-main --limit 3940 --dtype bfloat16 --threads 2 \
  --epochs 2 --lr 1e-3 --heads 4
mkdir -p "$WEIGHTS/medusa"
cp runs/medusa-main/config.json runs/medusa-main/model.safetensors "$WEIGHTS/medusa/"
# 4b. session 23: one more epoch on all train answers (7,727; the heads above saw the first 3,940),
# from the shipped heads, lr 5e-4 (33 minutes; held-out tau 1.653 -> 1.730 on the grown split)
.venv/bin/specdraft train medusa --data "$DATA" --out runs/medusa-more --init "$WEIGHTS/medusa" --dtype bfloat16 \
  --threads 2 --epochs 1 --lr 5e-4 --heads 4
cp runs/medusa-more/config.json runs/medusa-more/model.safetensors "$WEIGHTS/medusa/"

# 5. the layer-skip early-exit adapter (Kangaroo: one attention layer after layer 4), the same data
.venv/bin/specdraft train layer-skip --data "$DATA" --out runs/layer-skip-main --exit-layer 4 --limit 3940 \
  --dtype bfloat16 --threads 2 --epochs 2 --lr 1e-3
mkdir -p "$WEIGHTS/layer-skip"
cp runs/layer-skip-main/config.json runs/layer-skip-main/model.safetensors "$WEIGHTS/layer-skip/"
# 5b. session 29: the adapter's own draft vocabulary (the 4,096 most frequent tokens of the answers
# it learned from; `train layer-skip` now picks it at its end, this adapter predates that)
.venv/bin/python scripts/adapter_vocab.py "$WEIGHTS/layer-skip" --data "$DATA" --limit 3940
