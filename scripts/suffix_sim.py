"""Offline greedy simulation of speculative decoding, used to tune the suffix proposer.

Greedy speculative output equals plain output, and the verifier accepts exactly the draft
path that spells the plain output. So, given plain outputs, each step can be replayed
without the model: the policy picks a budget, the proposer drafts, the accepted path is the
longest draft path along the plain output, one bonus token follows. tau and acceptance are
exact for a given policy history; the adaptive policy runs with a float32 batch-1 cost
curve (results/runtime/runtime.json, or ``--cost`` a bench's results.json) and a fixed
propose time, so runs are deterministic (the live engine measures both, so its policy
choices, and tau, differ a little). The estimated speedup is plain cost / simulated cost on
that curve.

    # plain outputs of the bench's batch-1 requests (slow: runs the model)
    .venv/bin/python scripts/suffix_sim.py refs summarization,rag,editing,code,repeat --samples 8
    # then any number of configurations (fast), in `specdraft bench --methods` syntax
    .venv/bin/python scripts/suffix_sim.py run summarization,rag,editing,code,repeat ngram suffix suffix:factor=2
    # the copy and lookup ceilings (bench/ceiling.py) of the bench's requests, beside what it measured
    .venv/bin/python scripts/suffix_sim.py ceilings summarization,rag,editing,code,repeat --samples 3 \
        --tokens 64 --bench results/bench-methods/results.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from specdraft.accept import Acceptance
from specdraft.api import build_engine
from specdraft.bench.ceiling import copy_oracle_spans, lookup_oracle_spans
from specdraft.bench.harness import MethodSpec, build_requests
from specdraft.draft import Draft
from specdraft.model.loader import load
from specdraft.policy import CostModel, Policy, PolicyConfig
from specdraft.proposers import make_proposer
from specdraft.sequence import GenerationConfig
from specdraft.workloads import load_workload

PROPOSE_S = 50e-6  # the propose time the simulated policy sees (measured times are noisy)
RUNTIME = Path(__file__).resolve().parent.parent / "results" / "runtime" / "runtime.json"


def write_refs(workloads: list[str], samples: int, new_tokens: int, folder: Path) -> None:
    loaded = load(None)
    gen = GenerationConfig(max_new_tokens=new_tokens)
    plain = build_engine(loaded, "plain")
    max_prompt = loaded.config.max_context - new_tokens - 8 - 2  # as the bench (k = 8)
    folder.mkdir(parents=True, exist_ok=True)
    for w in workloads:
        requests = build_requests(loaded, load_workload(w, samples), max_prompt, gen, samples)
        rows = [{"id": r.id, "prompt": list(r.tokens), "output": plain.generate([list(r.tokens)], gen)[0].tokens}
                for r in requests]
        (folder / f"{w}.json").write_text(json.dumps({"new_tokens": new_tokens, "rows": rows}))
        print(f"{w}: {len(rows)} plain outputs")


class _Seq:
    """What a proposer reads of a sequence: tokens (prompt + output so far) and output."""

    def __init__(self, prompt: list[int]) -> None:
        self.prompt, self.tokens = list(prompt), list(prompt)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt) :]


def accepted_path(draft: Draft, target: list[int]) -> list[int]:
    """Greedy acceptance against the known target tokens: the longest matching path."""
    kids = draft.children()
    path, node = [], -1
    for token in target:
        nxt = next((c for c in kids[node + 1] if draft.tokens[c] == token), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return path


def load_curve(path: Path) -> dict[int, float]:
    """Batch-1 seconds per forward over q tokens: from ``specdraft bench-runtime``'s
    runtime.json (cost_curve, ms) or a ``specdraft bench`` results.json (cost_model_s)."""
    data = json.loads(path.read_text())
    if "cost_model_s" in data:
        return {int(q): s for q, s in data["cost_model_s"]["1"].items()}
    return {int(q): ms / 1000 for q, ms in data["cost_curve"]["float32"].items()}


def simulate(spec: MethodSpec, workloads: list[str], folder: Path, samples: int,
             curve: dict[int, float]) -> dict[str, dict[str, float]]:
    cost = CostModel(table={1: curve})
    proposer = make_proposer(spec.method, dict(spec.options))
    policy = Policy(PolicyConfig(kind=spec.policy, k=spec.k), cost)  # one per engine across workloads, as the bench
    out = {}
    for w in workloads:
        data = json.loads((folder / f"{w}.json").read_text())
        totals = dict(steps=0, emitted=0, proposed=0, accepted=0, cost=0.0, plain=0.0)
        for row in data["rows"][:samples]:
            _replay(row, data["new_tokens"], proposer, policy, cost, totals)
        out[w] = dict(tau=totals["emitted"] / totals["steps"], acceptance=totals["accepted"] / max(1, totals["proposed"]),
                      nodes=totals["proposed"] / totals["steps"], speedup=totals["plain"] / totals["cost"])
    return out


def _replay(row: dict[str, Any], new_tokens: int, proposer: Any, policy: Policy, cost: CostModel,
            totals: dict[str, float]) -> None:
    target = row["output"]
    eos = len(target) < new_tokens  # the request ended with EOS: one more token to emit
    end = len(target) + eos
    seq = _Seq(row["prompt"] + target[:1])  # the first token comes from the prefill
    proposer.begin(0, seq)
    policy.begin(0)
    pos = 1
    while pos < end:
        plan = policy.budgets([max(0, new_tokens - pos - 1)], 1)
        budget = plan.budgets[0]
        raw = proposer.propose([seq], [budget], None)[0] if budget > 0 else Draft.empty()
        if len(raw):
            policy.observe_propose_time(max(raw.depths()), PROPOSE_S)
        draft = policy.trim([raw], plan)[0]
        path = accepted_path(draft, target[pos:])
        emitted = min(len(path) + 1, end - pos)
        policy.observe(0, draft, Acceptance(tuple(path), tuple(target[pos : pos + len(path) + 1])))
        seq.tokens.extend(target[pos : pos + emitted])
        pos += emitted
        totals["steps"] += 1
        totals["emitted"] += emitted
        totals["proposed"] += len(draft)
        totals["accepted"] += len(path)
        totals["cost"] += cost.latency(1, 1 + len(draft), 1 + policy.config.k) + (PROPOSE_S if budget > 0 else 0.0)
    totals["plain"] += (end - 1) * cost.latency(1, 1, 1 + policy.config.k)
    seq.tokens = seq.tokens[: len(row["prompt"]) + len(target)]  # the EOS is not part of the output
    proposer.end(0)
    policy.end(0)


def ceilings(workloads: list[str], folder: Path, samples: int, curve: dict[int, float], tokens: int,
             bench: Path | None) -> None:
    """Print the copy and lookup ceilings (bench/ceiling.py, k = 8) of the stored plain
    outputs (the first ``samples`` requests, outputs cut to ``tokens``), with the decode
    speedup each oracle would get on the cost curve if it drafted exactly what is accepted (no
    wasted draft tokens, no propose time). Given a bench's results.json on the same requests,
    also the end-to-end bound (its plain prefill share counted) and the best tau it measured."""
    cost = CostModel(table={1: curve})
    rows = json.loads(bench.read_text())["rows"] if bench else []
    plain = {r["workload"]: r for r in rows if r["batch"] == 1 and r["method"] == "plain"}
    head = "| workload | copy ceiling tau | decode bound | lookup ceiling tau | decode bound |"
    if bench:
        head += " prefill share | end-to-end bound, lookup / copy | best live tau (speedup, method) |"
    print(head + "\n|" + "---|" * (head.count("|") - 1))
    for w in workloads:
        stored = json.loads((folder / f"{w}.json").read_text())["rows"][:samples]
        cells, bounds = [], []
        for oracle in (copy_oracle_spans, lookup_oracle_spans):
            spans = [a for r in stored for a in oracle(r["prompt"], r["output"][:tokens], 8)]
            emitted = sum(a + 1 for a in spans)
            x = emitted * cost.latency(1, 1, 1) / sum(cost.latency(1, 1 + a, 1) for a in spans)
            cells += [f"{emitted / max(1, len(spans)):.2f}", f"{x:.2f}x"]
            bounds.append(x)
        if w in plain:
            f = plain[w]["prefill_s"] / plain[w]["time_s"]
            e2e = [1 / (f + (1 - f) / x) for x in bounds]
            live = max((r for r in rows if r["batch"] == 1 and r["workload"] == w and r["method"] != "plain"),
                       key=lambda r: r["tau"], default=None)
            cells += [f"{f:.0%}", f"{e2e[1]:.2f}x / {e2e[0]:.2f}x",
                      f"{live['tau']:.2f} ({live['speedup']:.2f}x, {live['method']})" if live else "-"]
        print(f"| {w} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["refs", "run", "ceilings"])
    parser.add_argument("workloads", help="comma-separated workloads (their order is the requests' order)")
    parser.add_argument("methods", nargs="*", help="method specs, as specdraft bench --methods (run)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--refs", default="results/plain-outputs", help="folder of the plain outputs")
    parser.add_argument("--tokens", type=int, default=10**9, help="ceilings: cut the stored outputs to this many tokens")
    parser.add_argument("--bench", help="ceilings: a bench results.json on the same requests (prefill share, live tau)")
    parser.add_argument("--cost", default=str(RUNTIME),
                        help="the cost curve: a runtime.json or a bench results.json (its batch-1 cost model)")
    args = parser.parse_intermixed_args()
    workloads, folder = args.workloads.split(","), Path(args.refs)
    if args.command == "refs":
        write_refs(workloads, args.samples, args.max_new_tokens, folder)
        return
    curve = load_curve(Path(args.cost))
    if args.command == "ceilings":
        ceilings(workloads, folder, args.samples, curve, args.tokens, Path(args.bench) if args.bench else None)
        return
    for text in args.methods:
        res = simulate(MethodSpec.parse(text), workloads, folder, args.samples, curve)
        cells = "  ".join(f"{w} {r['tau']:.2f}/{r['acceptance']:.0%}/{r['nodes']:.1f}/x{r['speedup']:.2f}"
                          for w, r in res.items())
        mean = sum(r["speedup"] for r in res.values()) / len(res)
        print(f"{text:28s} {cells}  mean x{mean:.3f}   (tau/acceptance/nodes per step/est. speedup)", flush=True)


if __name__ == "__main__":
    main()
