#!/usr/bin/env bash
# Reproduce the committed benchmark results in results/ (about two hours on 2 CPU cores; run it
# alone: other load on the machine distorts the timings). Needs `bash scripts/setup.sh --peers`
# for the llama.cpp peer (skipped with a note otherwise). Equivalence checks (results/verify)
# are separate: `specdraft verify --method NAME --limit 200 --out results/verify/NAME-float32.json`.
set -uo pipefail
cd "$(dirname "$0")/.."
SD=.venv/bin/specdraft
DRAFT=runs/drafts/SmolLM2-135M-Instruct.Q4_1-l8
ALL=summarization,rag,translation,qa,math,chat,creative,code,editing,repeat
METHODS="ngram,suffix,rest,lookahead,layer-skip,draft:path=$DRAFT"
# the draft model (the target's first 8 layers as a separate model) and the stdlib datastore
.venv/bin/python -c "from specdraft.bench.quick import ensure_truncated_draft, ensure_default_datastore as d
ensure_truncated_draft(None, 8, print); d(None, print)"
# 1. every method on every workload at batch 1 and 8 (issue 5); long_summarization (QMSum, ~7k-token
#    prompts) at batch 1 only: one batch of 8 would spend ~5 minutes per method in prefill
$SD bench --methods "$METHODS" --workloads $ALL --batch-sizes 1,8 --samples 3 --repeats 2 --max-new-tokens 64 \
  --out results/bench-methods > /dev/null 2> results/bench-methods.log
$SD bench --methods "$METHODS" --workloads long_summarization --batch-sizes 1 --samples 2 --max-new-tokens 64 \
  --out results/bench-long > /dev/null 2> results/bench-long.log
# 1b. the peers beside ngram and the draft model, batch 1 (issue 4)
$SD bench --methods "ngram,draft:path=$DRAFT" --workloads summarization,rag,code,editing,repeat,chat \
  --batch-sizes 1 --samples 2 --max-new-tokens 64 --peers transformers,transformers-draft,llamacpp \
  --out results/bench-peers > /dev/null 2> results/bench-peers.log
# 2. batch sweep on the mixed workload: n-gram with and without the policy (issue 4)
$SD bench --methods "ngram,ngram:policy=fixed+k=8" --workloads mixed \
  --batch-sizes 1,8,32,128 --samples 16 --repeats 2 --max-new-tokens 64 --out results/bench-batch \
  > /dev/null 2> results/bench-batch.log
# 3. runtime: plain decoding in every numeric mode beside llama.cpp and transformers, cost curves,
#    profile, memory (issue 17; each mode in its own process)
$SD bench-runtime --out results/runtime > results/runtime/log.txt 2>/dev/null || true
# 3b. the moonshot (issue 17): the exact int4 mode's methods against llama.cpp's plain decoding,
#     end to end, batch 1, in the same run
$SD bench --methods ngram,suffix,mtp --workloads summarization,rag,code,editing,math,chat,creative,translation \
  --batch-sizes 1 --samples 2 --max-new-tokens 64 --dtype int4 --batch-invariant --peers llamacpp \
  --out results/bench-int4 > /dev/null 2> results/bench-int4.log
# 4. numeric modes: float32, bfloat16 with --batch-invariant (exact), bfloat16 (not exact)
SIX=summarization,rag,code,editing,math,chat
$SD bench --methods plain,ngram,suffix --workloads $SIX --batch-sizes 1 --samples 3 --repeats 2 --dtype float32 \
  --out results/bench-dtypes/float32 > /dev/null 2>&1
$SD bench --methods plain,ngram,suffix --workloads $SIX --batch-sizes 1 --samples 3 --repeats 2 --dtype bfloat16 \
  --batch-invariant --out results/bench-dtypes/bfloat16-invariant > /dev/null 2>&1
$SD bench --methods plain,suffix --workloads $SIX --batch-sizes 1 --samples 3 --repeats 2 --dtype bfloat16 \
  --out results/bench-dtypes/bfloat16 > /dev/null 2>&1
.venv/bin/python scripts/dtype_table.py results/bench-dtypes > /dev/null
# 5. the draft model under the setup-priced policy, short and long prompts
$SD bench --methods "plain,draft:path=$DRAFT" --workloads $ALL --batch-sizes 1 --samples 3 --repeats 2 \
  --max-new-tokens 64 --out results/bench-draft-policy > /dev/null 2>&1
$SD bench --methods "plain,draft:path=$DRAFT" --workloads long_summarization --batch-sizes 1 --samples 2 \
  --repeats 2 --max-new-tokens 64 --out results/bench-long-draft > /dev/null 2>&1
# 6. copy and lookup ceilings of the bench's requests (from the committed plain outputs; seconds)
.venv/bin/python scripts/suffix_sim.py ceilings $ALL --samples 3 --tokens 64 --bench results/bench-methods/results.json
echo done
