"""Held-out tau of the shipped heads on the benchmark's own prompts, per workload.

Training measures a head on its data folder's validation answers (prompts from the training
sources). The benchmark asks the same heads about spec_bench prompts and gets a far lower tau.
This script separates the two causes: it writes plain greedy answers to each workload's
prompts into a data folder and runs the training's own held-out measure on it
(`specdraft train eval`'s code), so a gap that remains there is the prompts', and one that
does not is the engine's.

    python scripts/bench_heldout.py [--workloads chat,qa,math,creative] [--heads mtp,new=runs/x] [--prompts 16]
        [--tokens 128] [--dtype bfloat16] [--out runs/bench-heldout]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdraft.api import build_engine
from specdraft.model.loader import load
from specdraft.sequence import GenerationConfig
from specdraft.train.evaluate import EvalConfig, evaluate_folder
from specdraft.heads.shipped import shipped_heads
from specdraft.workloads import fit_messages, load_workload


def answers(loaded, workload: str, prompts: int, tokens: int) -> list[dict]:  # type: ignore[no-untyped-def]
    """Plain greedy answers to the workload's first ``prompts`` prompts (first turn only)."""
    engine = build_engine(loaded, "plain")
    ids = [fit_messages(loaded.tokenizer, [{"role": "user", "content": p.turns[0]}], 1024)[0]
           for p in load_workload(workload, limit=prompts)]
    records = []
    for start in range(0, len(ids), 8):
        batch = ids[start:start + 8]
        for p, r in zip(batch, engine.generate(batch, GenerationConfig(max_new_tokens=tokens))):
            records.append({"id": f"{workload}/{len(records)}", "split": "validation", "temperature": 0.0,
                            "prompt": list(p), "response": list(r.tokens)})
    return records


def folder_for(out: Path, workload: str, records: list[dict]) -> Path:
    folder = out / workload
    folder.mkdir(parents=True, exist_ok=True)
    dummy = {"id": "dummy", "split": "train", "temperature": 0.0, "prompt": [1], "response": [2]}
    with (folder / "shard-00000.jsonl").open("w") as f:
        for r in [dummy, *records]:
            f.write(json.dumps(r) + "\n")
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="chat,qa,math,creative")
    ap.add_argument("--heads", default="mtp,eagle,medusa",
                    help="shipped heads by method, or label=folder for any trained folder")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-heldout"))
    args = ap.parse_args()
    loaded = load(None, dtype=args.dtype)
    for workload in args.workloads.split(","):
        shard = args.out / workload / "shard-00000.jsonl"
        if shard.exists():
            folder = shard.parent
        else:
            folder = folder_for(args.out, workload, answers(loaded, workload, args.prompts, args.tokens))
        for head in args.heads.split(","):
            label, _, path = head.partition("=")
            kind, result = evaluate_folder(loaded, path or shipped_heads(label, None), folder, EvalConfig())
            print(f"{workload:9s} {label:7s} {result.line()}", flush=True)


if __name__ == "__main__":
    main()
