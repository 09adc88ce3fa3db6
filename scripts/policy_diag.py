"""Why a feature head drafts less under the adaptive policy than another (results/trained-heads/policy-diag/):
batch 1, the first 4 prompts of each workload, 96 tokens, engines interleaved per prompt. For each engine:
speed, tau, the budgets the policy chose and the nodes it kept; for each head, a reliability table of its
first-depth confidence (the best depth-1 node's path probability) against how often that node was accepted,
from the fixed tree's drafts (every draft kept, so not selected by the policy).

    .venv/bin/python scripts/policy_diag.py chat,qa [bfloat16|float32] [bi|-] [eagle,eagle-k4,...]
"""
import sys, time
from collections import Counter

import torch

from specdraft.api import build_engine
from specdraft.bench.serve import workload_messages
from specdraft.metrics import SpecStats
from specdraft.model.loader import load
from specdraft.policy.core import Policy
from specdraft.sequence import GenerationConfig

torch.set_num_threads(2)
workloads = tuple(sys.argv[1].split(",")) if len(sys.argv) > 1 else ("chat", "qa")
dtype = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
loaded = load(dtype=dtype, batch_invariant=len(sys.argv) > 3 and sys.argv[3] == "bi")  # "-": not
gen = GenerationConfig(max_new_tokens=96)
BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.01)


class Recorder:
    """What an engine's policy chose and saw: budgets, kept nodes, (top depth-1 confidence, accepted at depth 1)."""

    def __init__(self, policy: Policy) -> None:
        self.budgets, self.kept, self.first = Counter(), Counter(), []
        budgets, trim, observe = policy.budgets, policy.trim, policy.observe

        def rec_budgets(caps, batch, remaining=None, setup=None):
            plan = budgets(caps, batch, remaining, setup)
            self.budgets[plan.budgets[0]] += 1
            return plan

        def rec_trim(drafts, plan, live=None):
            out = trim(drafts, plan, live)
            self.kept[len(out[0])] += 1
            return out

        def rec_observe(row, draft, acceptance):
            if draft.confidence is not None and len(draft):
                d1 = [i for i, p in enumerate(draft.parents) if p == -1]
                best = max(d1, key=lambda i: draft.confidence[i])
                self.first.append((draft.confidence[best], bool(acceptance.path) and acceptance.path[0] == best))
            observe(row, draft, acceptance)

        policy.budgets, policy.trim, policy.observe = rec_budgets, rec_trim, rec_observe  # a diagnostic's wiretap


def reliability(first: list[tuple[float, bool]]) -> str:
    cells = []
    for lo, hi in zip(BINS, BINS[1:]):
        xs = [(c, a) for c, a in first if lo <= c < hi]
        if xs:
            cells.append(f"[{lo:.1f},{min(hi, 1):.1f}) n={len(xs)} conf {sum(c for c, _ in xs) / len(xs):.2f} "
                         f"acc {sum(a for _, a in xs) / len(xs):.2f}")
    return "; ".join(cells)


specs = {"plain": ("plain", 8, "adaptive"), "eagle": ("eagle", 8, "adaptive"), "eagle-k4": ("eagle", 4, "fixed"),
         "eagle-k2": ("eagle", 2, "fixed"), "mtp": ("mtp", 8, "adaptive"), "mtp-k4": ("mtp", 4, "fixed")}
only = [n for n in sys.argv[4].split(",")] if len(sys.argv) > 4 else list(specs)  # a subset of the engines
specs = {n: specs[n] for n in ["plain"] + [n for n in only if n != "plain"]}
for w, msgs in workload_messages(workloads).items():
    prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": m}]) for m in msgs[:4]]
    engines = {n: build_engine(loaded, m, k=k, policy=p) for n, (m, k, p) in specs.items()}
    recs = {n: Recorder(e.policy) for n, e in engines.items() if n != "plain"}
    for e in engines.values():
        e.generate([prompts[0]], GenerationConfig(max_new_tokens=8))  # warm
    for r in recs.values():
        r.budgets.clear(), r.kept.clear(), r.first.clear()
    res = {n: [0.0, 0, SpecStats()] for n in engines}
    for p in prompts:
        for name, e in engines.items():
            t = time.perf_counter()
            out = e.generate([p], gen, stats=res[name][2])[0]
            res[name][0] += time.perf_counter() - t
            res[name][1] += len(out.tokens)
    base = res["plain"][1] / res["plain"][0]
    for name, (s, n, st) in res.items():
        print(f"{w:6s} {dtype}{'-bi' if loaded.model.batch_invariant else ''} {name:8s} {n / s:6.1f} tok/s "
              f"{n / s / base:.2f}x tau {st.tau:.2f} propose {1e3 * st.propose_s / max(st.steps, 1):.1f} ms/step "
              f"verify {1e3 * st.verify_s / max(st.steps, 1):.1f} ms/step steps {st.steps}", flush=True)
        if name in recs:
            r = recs[name]
            print(f"    budgets {sorted(r.budgets.items())}  kept {sorted(r.kept.items())}")
            print(f"    depth-1 reliability: {reliability(r.first)}", flush=True)
