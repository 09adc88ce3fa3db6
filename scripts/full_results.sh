#!/usr/bin/env bash
# Reproduce the committed benchmark results in results/ (about an hour on 2 CPU cores; run it
# alone: other load on the machine distorts the timings). Needs `bash scripts/setup.sh --peers`
# for the llama.cpp peer (skipped with a note otherwise). Equivalence checks (results/verify)
# are separate: `specdraft verify --method NAME --limit 200 --out results/verify/NAME-float32.json`.
set -uo pipefail
cd "$(dirname "$0")/.."
SD=.venv/bin/specdraft
DRAFT=runs/drafts/SmolLM2-135M-Instruct.Q4_1-l8
ALL=summarization,rag,translation,qa,math,chat,creative,code,editing,repeat,long_summarization
# the draft model (the target's first 8 layers as a separate model) and the stdlib datastore
.venv/bin/python -c "from specdraft.bench.quick import ensure_truncated_draft, ensure_default_datastore as d
ensure_truncated_draft(None, 8, print); d(None, print)"
# 1. every method on every workload at batch 1, with the peers (issues 5 and 4)
$SD bench --methods "ngram,suffix,rest,lookahead,layer-skip,draft:path=$DRAFT" \
  --workloads $ALL --batch-sizes 1 --samples 2 --max-new-tokens 64 --peers transformers,transformers-draft,llamacpp \
  --out results/bench-methods > /dev/null 2> results/bench-methods.log
# 2. batch sweep on the mixed workload: n-gram with and without the policy (issue 4)
$SD bench --methods "ngram,ngram:policy=fixed+k=8" --workloads mixed \
  --batch-sizes 8,32,128 --samples 32 --max-new-tokens 64 --out results/bench-batch \
  > /dev/null 2> results/bench-batch.log
# 3. runtime: plain decode vs transformers, verification cost curve (float32 and bfloat16)
$SD bench-runtime --out results/runtime > results/runtime/log.txt 2>/dev/null || true
echo done
