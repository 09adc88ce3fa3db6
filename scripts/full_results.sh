#!/usr/bin/env bash
# Reproduce the committed results in results/ (about 45 minutes on 2 CPU cores; run it alone:
# other load on the machine distorts the timings). Needs `bash scripts/setup.sh --peers` for
# the llama.cpp peer (skipped with a note otherwise).
set -uo pipefail
cd "$(dirname "$0")/.."
SD=.venv/bin/specdraft
mkdir -p results/verify
# 1. byte-identical equivalence, float32, 200 prompts from every workload
$SD verify --method ngram --limit 200 --max-new-tokens 64 --out results/verify/ngram-float32.json \
  > results/verify/ngram-float32.txt 2>/dev/null
# 2. runtime: plain decode vs transformers, verification cost curve
$SD bench-runtime --out results/runtime > results/runtime/log.txt 2>/dev/null || true
# 3. every workload at batch 1: n-gram adaptive, fixed k=8, tree (3 branches), and the peers
$SD bench --methods "ngram,ngram:policy=fixed+k=8,ngram:branches=3" \
  --workloads summarization,rag,translation,qa,math,chat,creative,code,editing,repeat,long_summarization \
  --batch-sizes 1 --samples 2 --max-new-tokens 96 --peers transformers,llamacpp --out results/bench-workloads \
  > /dev/null 2> results/bench-workloads.log
# 4. batch sweep on the mixed workload (batch 1 is in step 3)
$SD bench --methods "ngram,ngram:policy=fixed+k=8" --workloads mixed --batch-sizes 8,32,128 --samples 8 \
  --max-new-tokens 64 --out results/bench-batch > /dev/null 2> results/bench-batch.log
# 5. bfloat16 mismatch rate
$SD verify --method ngram --limit 30 --max-new-tokens 64 --dtype bfloat16 --out results/verify/ngram-bfloat16.json \
  > results/verify/ngram-bfloat16.txt 2>/dev/null
echo done
