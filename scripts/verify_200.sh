#!/usr/bin/env bash
# The 200-prompt equivalence checks behind the README's table: every method against plain
# greedy decoding (specdraft verify, k = 8 fixed, 64 new tokens per turn), in float32 and in
# bfloat16 with --batch-invariant (int4-invariant: int4 with --batch-invariant, on request). Each run keeps a journal beside its report
# (results/verify/<method>-<mode>.progress.jsonl) and a rerun resumes there, so the whole set
# (hours on 2 cores) can span sessions: commit the journals as they grow.
#   METHODS="mtp eagle" MODES=float32 bash scripts/verify_200.sh
# OPTS: method options for every run (--opt each), TAG: a name part for their reports, e.g. the
# trained heads' chains instead of their dynamic trees:
#   OPTS="topk=1" TAG=chain METHODS="eagle mtp medusa" bash scripts/verify_200.sh
set -euo pipefail
cd "$(dirname "$0")/.."
METHODS=${METHODS:-"mtp eagle medusa layer-skip ngram suffix lookahead rest draft"}
MODES=${MODES:-"float32 bfloat16-invariant"}
LIMIT=${LIMIT:-200}
OPTS=${OPTS:-}
TAG=${TAG:+-$TAG}
opts=()
for o in $OPTS; do opts+=(--opt "$o"); done
for mode in $MODES; do
  case $mode in
    float32) flags=(--dtype float32) ;;
    bfloat16-invariant) flags=(--dtype bfloat16 --batch-invariant) ;;
    int4-invariant) flags=(--dtype int4 --batch-invariant) ;;
    *) echo "unknown mode $mode (float32, bfloat16-invariant, int4-invariant)" >&2; exit 2 ;;
  esac
  for method in $METHODS; do
    k=8
    [ "$method" = draft ] && k=4  # a separate draft model: k = 4 keeps the run near 3 hours
    echo "== $method$TAG $mode"
    .venv/bin/specdraft verify --method "$method" --k "$k" --limit "$LIMIT" "${flags[@]}" ${opts[@]+"${opts[@]}"} \
      --out "results/verify/$method$TAG-$mode.json" | tail -n 6 || echo "!! $method$TAG $mode: not all identical (or stopped)"
  done
done
