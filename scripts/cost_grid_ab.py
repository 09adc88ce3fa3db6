"""A/B of the cost model's measured token counts at batch 1 (results/trained-heads/tree-sweep/):
the adaptive policy with its cost curve measured at q = 1, 2, 9 (interpolated between: the
default grid, ``policy/cost.py``) against every q up to 9 (tried in session 33: no gain, not
kept), beside plain decoding and a fixed 4-node tree; engines interleaved per prompt in one
process, rotated order. Both curves learn from the observed forwards as usual.

    .venv/bin/python scripts/cost_grid_ab.py [eagle] [chat,qa,math,creative] [float32] [prompts]
"""
import math
import sys

import torch

from specdraft.api import build_engine
from specdraft.bench.serve import workload_messages
from specdraft.model.loader import load
from specdraft.policy import CostModel
from specdraft.policy.cost import measure_latency, monotone
from specdraft.sequence import GenerationConfig
from tree_sweep import run_interleaved  # (scripts/, run from the repository root)

torch.set_num_threads(2)
method = sys.argv[1] if len(sys.argv) > 1 else "eagle"
workloads = tuple((sys.argv[2] if len(sys.argv) > 2 else "chat,qa,math,creative").split(","))
dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
n_prompts = int(sys.argv[4]) if len(sys.argv) > 4 else 6
loaded = load(dtype=dtype)
gen = GenerationConfig(max_new_tokens=96)
speedups: dict[str, list[float]] = {}
for w, msgs in workload_messages(workloads).items():
    prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": m}]) for m in msgs[:n_prompts]]
    sparse, dense = CostModel(loaded.model), CostModel(loaded.model)
    sparse.table[1] = monotone(measure_latency(loaded.model, 1, [1, 2, 9]))
    dense.table[1] = monotone(measure_latency(loaded.model, 1, list(range(1, 10))))
    engines = {"plain": build_engine(loaded, "plain"),
               "fixed 4": build_engine(loaded, method, k=4, policy="fixed"),
               "adaptive, q 1,2,9": build_engine(loaded, method, k=8, cost=sparse),
               "adaptive, q 1..9": build_engine(loaded, method, k=8, cost=dense)}
    seconds, tokens, stats = run_interleaved(engines, prompts, gen)
    names = list(engines)
    base = tokens["plain"] / seconds["plain"]
    cells = []
    for name in names[1:]:
        s, n, st = seconds[name], tokens[name], stats[name]
        speedups.setdefault(name, []).append(n / s / base)
        cells.append(f"{name} {n / s / base:.2f}x (tau {st.tau:.2f}, {st.proposed / max(st.steps, 1):.1f} nodes)")
    curve = engines["adaptive, q 1..9"].policy.cost.table.get(1, {})
    print(f"{w:9s} plain {base:5.1f} tok/s | " + " | ".join(cells), flush=True)
    print(f"          measured ms at q=1..9: " + " ".join(f"{1e3 * curve[q]:.1f}" for q in sorted(curve)), flush=True)
for name, xs in speedups.items():
    print(f"{name}: geomean {math.exp(sum(map(math.log, xs)) / len(xs)):.3f}x over {len(xs)} workloads")
