"""How far do bigger dynamic trees take a trained head at batch 1? For each tree shape (topk,
depth) and node budget N, the head drafts with the fixed policy (always N nodes), and the run
records tau (tokens per target pass), the drafting and verification time per pass, and the
speedup over plain decoding in the same process, engines interleaved per prompt.

It answers the issue's question "tau >= 3.5 with dynamic trees": how tau grows with N, and
what verifying N + 1 tokens and drafting them cost, so the best N is visible and the bound on
the speedup is measured rather than guessed.

    .venv/bin/python scripts/tree_sweep.py --method eagle --workloads chat,qa,math,creative \
        --prompts 6 --tokens 96 --dtype float32 --out results/trained-heads/tree-sweep
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from specdraft.api import build_engine
from specdraft.bench.serve import workload_messages
from specdraft.engine import Engine
from specdraft.metrics import SpecStats
from specdraft.model.loader import load
from specdraft.sequence import GenerationConfig

# (label, options, N, policy): a chain of 6, EAGLE-2 trees of growing budget and breadth with
# the fixed policy (always N nodes), then the adaptive policy (0..N nodes, priced per step)
SHAPES: tuple[tuple[str, dict[str, str], int, str], ...] = (
    ("chain 6", {"topk": "1", "depth": "6"}, 6, "fixed"),
    ("k4 d6 N4", {"topk": "4", "depth": "6"}, 4, "fixed"),
    ("k4 d6 N8", {"topk": "4", "depth": "6"}, 8, "fixed"),
    ("k4 d6 N16", {"topk": "4", "depth": "6"}, 16, "fixed"),
    ("k4 d6 N32", {"topk": "4", "depth": "6"}, 32, "fixed"),
    ("k4 d6 N64", {"topk": "4", "depth": "6"}, 64, "fixed"),
    ("k8 d8 N32", {"topk": "8", "depth": "8"}, 32, "fixed"),
    ("k8 d8 N64", {"topk": "8", "depth": "8"}, 64, "fixed"),
    ("k8 d8 N128", {"topk": "8", "depth": "8"}, 128, "fixed"),
    ("adaptive 4", {"topk": "4", "depth": "6"}, 4, "adaptive"),
    ("adaptive 8", {"topk": "4", "depth": "6"}, 8, "adaptive"),
    ("adaptive 16", {"topk": "4", "depth": "6"}, 16, "adaptive"),
    ("adaptive 32", {"topk": "4", "depth": "6"}, 32, "adaptive"),
)


def run_interleaved(engines: dict[str, Engine], prompts: list[list[int]], gen: GenerationConfig
                    ) -> tuple[dict[str, float], dict[str, int], dict[str, SpecStats]]:
    """Each prompt through every engine, batch 1, in an order rotated per prompt (a slow spell
    of the machine falls on all alike), after one short warm-up each: seconds, tokens emitted
    and the stats per engine."""
    for e in engines.values():
        e.generate([prompts[0]], GenerationConfig(max_new_tokens=8))  # warm
    seconds = {name: 0.0 for name in engines}
    tokens = {name: 0 for name in engines}
    stats = {name: SpecStats() for name in engines}
    names = list(engines)
    for i, p in enumerate(prompts):
        for name in names[i % len(names):] + names[: i % len(names)]:
            t = time.perf_counter()
            out = engines[name].generate([p], gen, stats=stats[name])[0]
            seconds[name] += time.perf_counter() - t
            tokens[name] += len(out.tokens)
    return seconds, tokens, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="eagle")
    ap.add_argument("--workloads", default="chat,qa,math,creative")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="", help="comma-separated labels of SHAPES to run (default: all)")
    ap.add_argument("--out", type=Path, default=Path("runs/tree-sweep"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    wanted = set(args.shapes.split(",")) if args.shapes else None
    shapes = [s for s in SHAPES if wanted is None or s[0] in wanted]
    loaded = load(dtype=args.dtype)
    gen = GenerationConfig(max_new_tokens=args.tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for workload, msgs in workload_messages(tuple(args.workloads.split(","))).items():
        prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": m}]) for m in msgs[: args.prompts]]
        engines = {"plain": build_engine(loaded, "plain")}
        for label, options, n, policy in shapes:
            engines[label] = build_engine(loaded, args.method, k=n, policy=policy, options=options)  # (its own cost curve, to N)
        seconds, tokens, stats = run_interleaved(engines, prompts, gen)
        names = list(engines)
        plain_rate = tokens["plain"] / seconds["plain"]
        plain_pass = stats["plain"].decode_s / stats["plain"].steps  # s per plain target pass
        for name in names:
            s = stats[name]
            row = {"workload": workload, "shape": name, "tau": s.emitted / s.steps, "steps": s.steps,
                   "nodes_per_pass": s.proposed / s.steps, "accepted_at": list(s.accepted_at),
                   "propose_ms": 1e3 * s.propose_s / s.steps, "verify_ms": 1e3 * s.verify_s / s.steps,
                   "other_ms": 1e3 * s.other_s / s.steps, "plain_pass_ms": 1e3 * plain_pass,
                   "speedup": tokens[name] / seconds[name] / plain_rate}
            rows.append(row)
            print(f"{workload:9s} {name:11s} tau {row['tau']:.2f} nodes {row['nodes_per_pass']:5.1f} "
                  f"propose {row['propose_ms']:5.1f} ms verify {row['verify_ms']:6.1f} ms "
                  f"(plain pass {row['plain_pass_ms']:.1f} ms) speedup {row['speedup']:.2f}x", flush=True)
        (args.out / "rows.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\ngeometric means over the workloads:")
    for name in ["plain"] + [s[0] for s in shapes]:
        mine = [r for r in rows if r["shape"] == name]
        g = lambda key: math.exp(sum(math.log(r[key]) for r in mine) / len(mine))  # noqa: E731
        print(f"{name:11s} tau {g('tau'):.2f} speedup {g('speedup'):.2f}x "
              f"verify {g('verify_ms'):.1f} ms propose {g('propose_ms') if all(r['propose_ms'] > 0 for r in mine) else 0:.1f} ms")


if __name__ == "__main__":
    main()
