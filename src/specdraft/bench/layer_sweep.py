"""Layer-skip sweep: acceptance and tau against the number of drafting layers L.

For each L, every prompt (the first turn of a few workloads) is generated greedily at batch 1
with the layer-skip proposer (fixed draft length k) and compared with plain decoding. What is
measured is acceptance, which does not depend on timing. The draft's cost is modelled, not
timed: a draft forward over L of the N layers costs L/N of a one-token target forward (the
"layers" model; the "head" model also charges the LM head, whose cost does not shrink with L),
and the verification of 1 + k tokens costs what the float32 cost curve of the runtime benchmark
(``results/runtime/runtime.json``) says. The estimated speedup over plain decoding is

    tau * c(1) / (c(1 + k) + k * fraction(L) * c(1)),

with c(q) the latency of a forward over q new tokens. The default L is the one that maximises
it under the layers model (as the issue asked), reported next to the head model's choice.

With ``--last M`` every L also drafts with the last M layers (a middle block skipped); the
draft then costs (L + M)/N.

Run: ``python -m specdraft.bench.layer_sweep --out results/layer-skip``
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specdraft.bench.machine import format_table, machine_info
from specdraft.bench.plots import _pyplot
from specdraft.engine import Engine
from specdraft.metrics import SpecStats
from specdraft.model.loader import LoadedModel, load
from specdraft.policy import Policy, PolicyConfig
from specdraft.proposers.layer_skip import LayerSkipProposer
from specdraft.sequence import GenerationConfig
from specdraft.workloads import fit_messages, load_workload


@dataclass(frozen=True, slots=True)
class LayerSweepConfig:
    layers: tuple[int, ...] = (4, 6, 8, 10, 12, 15, 18, 21, 24)
    workloads: tuple[str, ...] = ("chat", "code", "summarization", "math")
    per_workload: int = 3
    max_new_tokens: int = 64
    max_prompt: int = 1024
    k: int = 4
    last: int = 0  # also draft with the target's last layers (skip a middle block), see LayerSkipConfig
    model: str | None = None
    runtime: str = "results/runtime/runtime.json"  # the float32 cost curve
    out: str = "results/layer-skip"


def build_prompts(loaded: LoadedModel, cfg: LayerSweepConfig) -> list[tuple[str, list[int]]]:
    """(label, token ids) of each prompt's first turn, cut to ``max_prompt`` tokens."""
    out = []
    for name in cfg.workloads:
        for p in load_workload(name, cfg.per_workload):
            ids, _ = fit_messages(loaded.tokenizer, [{"role": "user", "content": p.turns[0]}], cfg.max_prompt, p.id)
            out.append((p.id, ids))
    return out


def measure(loaded: LoadedModel, prompts: list[list[int]], refs: list[list[int]], layers: int,
            cfg: LayerSweepConfig) -> dict[str, Any]:
    """Generate every prompt at batch 1 with L = ``layers``; acceptance, tau, identical count."""
    proposer = LayerSkipProposer(loaded.model, layers, last=cfg.last)
    engine = Engine(loaded.model, loaded.tokenizer, proposer, Policy(PolicyConfig(kind="fixed", k=cfg.k)))
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens)
    stats = SpecStats()
    identical = 0
    for ids, ref in zip(prompts, refs):
        identical += engine.generate([ids], gen, stats=stats)[0].tokens == ref
    return {"layers": layers, "last": cfg.last, "acceptance": stats.acceptance_rate, "tau": stats.tau,
            "acceptance_by_position": stats.acceptance_by_position, "steps": stats.steps,
            "emitted": stats.emitted, "identical": identical, "prompts": len(prompts)}


def cost_curve(path: str | Path, dtype: str = "float32") -> dict[int, float]:
    """q -> milliseconds of one batch-1 forward over q new tokens (the runtime benchmark's)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return {int(q): float(ms) for q, ms in data["cost_curve"][dtype].items()}


def head_fraction(loaded: LoadedModel) -> float:
    """The LM head's share of a forward's weights (memory-bound decoding: cost ~ weights read)."""
    c = loaded.config
    layer = 0
    block = loaded.model.layers[0]
    for lin in (block.wqkv, block.wo, block.w_gate_up, block.w_down):
        layer += lin.weight.numel()
    head = c.vocab_size * c.hidden_size
    return head / (c.num_layers * layer + head)


def add_estimates(rows: list[dict[str, Any]], curve: dict[int, float], total: int, head: float, k: int) -> None:
    """Add each row's draft cost fractions and estimated speedups (see the module doc)."""
    qs = sorted(curve)
    c1 = curve[1]
    verify = float(np.interp(1 + k, qs, [curve[q] for q in qs]))
    for row in rows:
        frac = (row["layers"] + row.get("last", 0)) / total
        frac_head = head + (1 - head) * frac
        row["cost_fraction"] = frac
        row["cost_fraction_with_head"] = frac_head
        row["est_speedup"] = row["tau"] * c1 / (verify + k * frac * c1)
        row["est_speedup_with_head"] = row["tau"] * c1 / (verify + k * frac_head * c1)


def run_layer_sweep(cfg: LayerSweepConfig, log: Any = print) -> dict[str, Any]:
    loaded = load(cfg.model)
    labelled = build_prompts(loaded, cfg)
    prompts = [ids for _, ids in labelled]
    plain = Engine(loaded.model, loaded.tokenizer)
    refs = [plain.generate([ids], GenerationConfig(max_new_tokens=cfg.max_new_tokens))[0].tokens for ids in prompts]
    log(f"{len(prompts)} prompts, {loaded.config.num_layers} layers, k={cfg.k}, last={cfg.last}")
    rows = []
    for layers in cfg.layers:
        rows.append(measure(loaded, prompts, refs, layers, cfg))
        log(f"L={layers}: acceptance {rows[-1]['acceptance']:.3f}, tau {rows[-1]['tau']:.2f}, "
            f"identical {rows[-1]['identical']}/{len(prompts)}")
    head = head_fraction(loaded)
    add_estimates(rows, cost_curve(cfg.runtime), loaded.config.num_layers, head, cfg.k)
    return choose({"config": asdict(cfg), "machine": machine_info("cpu"), "model": str(loaded.source),
                   "num_layers": loaded.config.num_layers, "prompt_ids": [label for label, _ in labelled],
                   "head_fraction": head, "rows": rows})


def choose(results: dict[str, Any]) -> dict[str, Any]:
    """Add the chosen L (the best estimated speedup) and whether any L is estimated to pay."""
    rows = results["rows"]
    best = max(rows, key=lambda r: r["est_speedup"])
    best_head = max(rows, key=lambda r: r["est_speedup_with_head"])
    pays = best["est_speedup"] > 1
    results.update(
        chosen_layers=best["layers"], chosen_layers_with_head=best_head["layers"], pays_off=pays,
        chosen_by="max estimated speedup tau*c(1)/(c(1+k) + k*L/N*c(1)) from measured acceptance and the float32 "
                  "cost curve; timings were not measured (the machine was shared)"
                  + ("" if pays else "; no L is estimated to beat plain decoding, so this is the least loss"))
    return results


def write_outputs(results: dict[str, Any], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "layer_sweep.json"
    path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (folder / "layer_sweep.txt").write_text(table(results) + "\n", encoding="utf-8")
    return [path, folder / "layer_sweep.txt", plot(results, folder / "layer_sweep.png")]


def table(results: dict[str, Any]) -> str:
    last = results["config"].get("last", 0)
    headers = ["L" if not last else f"L (+ last {last})", "acceptance", "tau", "draft layers / N", "est. speedup",
               "est. speedup (head)", "identical"]
    rows = [[r["layers"], f"{r['acceptance']:.3f}", f"{r['tau']:.2f}", f"{r['cost_fraction']:.2f}",
             f"{r['est_speedup']:.2f}", f"{r['est_speedup_with_head']:.2f}", f"{r['identical']}/{r['prompts']}"]
            for r in results["rows"]]
    verdict = "" if results["pays_off"] else "; no L is estimated to beat plain decoding (the least loss)"
    return (format_table(headers, rows) + f"\nchosen L = {results['chosen_layers']} "
            f"(L = {results['chosen_layers_with_head']} if the LM head's cost is charged too){verdict}")


def plot(results: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    rows = results["rows"]
    xs = [r["layers"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    top.plot(xs, [r["acceptance"] for r in rows], "o-", label="acceptance rate")
    top.set_ylabel("acceptance rate")
    twin = top.twinx()
    twin.plot(xs, [r["tau"] for r in rows], "s--", color="tab:orange", markerfacecolor="none", markersize=9,
              label="tau")
    twin.set_ylabel("tau (tokens per target pass)")
    top.legend(loc="upper left")
    twin.legend(loc="lower right")
    bottom.plot(xs, [r["est_speedup"] for r in rows], "o-", label="draft cost L/N")
    bottom.plot(xs, [r["est_speedup_with_head"] for r in rows], "s--", label="draft cost with LM head")
    bottom.axhline(1.0, color="grey", lw=0.8)
    last = results["config"].get("last", 0)
    bottom.set_xlabel(f"drafting layers L (of {results['num_layers']})" + (f", plus the last {last}" if last else ""))
    bottom.set_ylabel("estimated speedup")
    bottom.legend()
    cfg = results["config"]
    fig.suptitle(f"layer-skip on {Path(results['model']).name}: greedy, batch 1, k={cfg['k']} fixed, "
                 f"{len(results['prompt_ids'])} prompts\nspeedup estimated from acceptance and the float32 cost "
                 f"curve (not timed); chosen L = {results['chosen_layers']}"
                 + ("" if results["pays_off"] else " (no L beats plain: the least loss)"), fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    defaults = LayerSweepConfig()
    parser = argparse.ArgumentParser(prog="python -m specdraft.bench.layer_sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=defaults.out)
    parser.add_argument("--layers", default=None, help="comma-separated L values")
    parser.add_argument("--per-workload", type=int, default=defaults.per_workload)
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--last", type=int, default=0,
                        help="also draft with the target's last N layers (skip a middle block)")
    parser.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    layers = tuple(int(x) for x in args.layers.split(",")) if args.layers else defaults.layers
    cfg = LayerSweepConfig(layers=layers, per_workload=args.per_workload, max_new_tokens=args.max_new_tokens,
                           last=args.last, model=args.model, out=args.out)
    results = run_layer_sweep(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    for p in write_outputs(results, Path(cfg.out)):
        print(f"wrote {p}")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
