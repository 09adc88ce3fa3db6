#!/usr/bin/env bash
# The serving benchmark (results/bench-serve/): `specdraft serve` plain, suffix and the shipped
# MTP module under closed-loop load at concurrency 1, 4, 16 and 64, beside llama.cpp's own server
# on the same GGUF where it is installed (`bash scripts/setup.sh --peers`). bfloat16 like
# scripts/bench_trained.sh, so concurrency 1 can be set beside `specdraft bench` at batch 1.
# About 30 minutes on 2 CPU cores: run it alone.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/bench-serve}
.venv/bin/specdraft bench-serve --dtype bfloat16 --threads 2 \
  --methods plain,suffix,mtp --workloads chat,code,summarization --concurrency 1,4,16,64 \
  --max-tokens 96 --context 1024 --peers llamacpp --out "$OUT"
