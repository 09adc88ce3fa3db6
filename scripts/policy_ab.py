"""A/B of two adaptive-policy settings in one process (results/trained-heads/policy-prior/): for each
method, plain decoding and the method under each setting, engines interleaved per prompt (the two
settings' order rotating), batch 1, the first N prompts of each workload, 96 tokens. Prints each
cell's speed against plain, tau and the share of steps that drafted, and the geometric mean.

    .venv/bin/python scripts/policy_ab.py mtp,eagle,medusa chat,qa,math,creative [bfloat16|float32] [prompts] [new,old]

Settings: "new" is the default PolicyConfig; "old" has no prior outlook and one token of trust
(outlook_prior=0, trust=1: the policy before session 22); "prior-only": the prior outlook, one
token of trust.
"""
import math
import sys
import time

import torch

from specdraft.api import build_engine
from specdraft.bench.serve import workload_messages
from specdraft.metrics import SpecStats
from specdraft.model.loader import load
from specdraft.policy import Policy, PolicyConfig
from specdraft.sequence import GenerationConfig

torch.set_num_threads(2)
methods = sys.argv[1].split(",")
workloads = tuple(sys.argv[2].split(","))
dtype = sys.argv[3] if len(sys.argv) > 3 else "bfloat16"
n_prompts = int(sys.argv[4]) if len(sys.argv) > 4 else 6
loaded = load(dtype=dtype)
gen = GenerationConfig(max_new_tokens=96)
ALL = {"new": PolicyConfig(k=8), "old": PolicyConfig(k=8, outlook_prior=0.0, trust=1.0),
       "prior-only": PolicyConfig(k=8, trust=1.0)}
SETTINGS = {n: ALL[n] for n in (sys.argv[5].split(",") if len(sys.argv) > 5 else ["new", "old"])}
speedups: dict[tuple[str, str], list[float]] = {}
for method in methods:
    for w, msgs in workload_messages(workloads).items():
        prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": m}]) for m in msgs[:n_prompts]]
        engines = {"plain": build_engine(loaded, "plain")}
        for name, config in SETTINGS.items():
            e = build_engine(loaded, method, k=8)
            e.policy = Policy(config, e.policy.cost)
            engines[name] = e
        for e in engines.values():
            e.generate([prompts[0]], GenerationConfig(max_new_tokens=8))  # warm
        res = {n: [0.0, 0, SpecStats()] for n in engines}
        for i, p in enumerate(prompts):
            names = list(SETTINGS)
            for name in ["plain"] + names[i % len(names):] + names[: i % len(names)]:  # rotated
                t = time.perf_counter()
                out = engines[name].generate([p], gen, stats=res[name][2])[0]
                res[name][0] += time.perf_counter() - t
                res[name][1] += len(out.tokens)
        base = res["plain"][1] / res["plain"][0]
        cells = []
        for name in SETTINGS:
            s, n, st = res[name]
            speedups.setdefault((method, name), []).append(n / s / base)
            cells.append(f"{name} {n / s / base:.2f}x tau {st.tau:.2f} ({st.steps} steps)")
        print(f"{method:7s} {w:9s} {dtype} plain {base:5.1f} tok/s | " + " | ".join(cells), flush=True)
for (method, name), xs in speedups.items():
    print(f"{method:7s} {name}: geomean {math.exp(sum(map(math.log, xs)) / len(xs)):.3f}x over {len(xs)} workloads")
