#!/usr/bin/env bash
# Issue 17's moonshot: our best lossless method against llama.cpp's plain decoding, end to end
# at batch 1, on every built-in workload type (results/bench-moonshot/). The fastest exact mode
# (4-bit weights with --batch-invariant: byte-identical to its own plain decoding), the copying
# methods and the shipped trained heads, llama.cpp (plain and prompt lookup) on the same GGUF and
# prompts. Needs llama-cpp-python (bash scripts/setup.sh --peers). About 20 minutes on 2 cores:
# run it alone.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/bench-moonshot}
.venv/bin/specdraft bench --dtype int4 --batch-invariant --threads 2 \
  --methods "ngram,suffix,mtp,eagle" \
  --workloads summarization,rag,translation,qa,math,chat,creative,code,editing --batch-sizes 1 \
  --samples 4 --max-new-tokens 96 --peers llamacpp --out "$OUT"
