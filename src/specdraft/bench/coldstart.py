"""Cold start: how acceptance builds up over a generation.

A proposer that learns from the text it sees (an n-gram pool, a Jacobi window) starts with
little to offer; this bench shows how fast that changes. Each method generates the first user
turn of ``prompts`` prompts per workload alone (batch 1, greedy), and a thin proposer wrapper
records, for every target pass, the step index within the request, the draft's node count
and the tokens accepted. Curves are averaged over the prompts (a step index counts the
requests that reached it). Besides tau and the acceptance rate it reports an *estimated*
speedup from a measured verification cost curve (``results/runtime/runtime.json``: the
latency of one forward over q new tokens):

    speedup ~ emitted tokens x cost(1) / sum over passes of cost(1 + draft nodes)

which counts the extra width every pass pays but not the proposer's own time. Timings of
this run are not used (they are unreliable on a shared machine).

    python -m specdraft.bench.coldstart --out results/lookahead [--workload math --workload code]
        [--method lookahead:policy=fixed,k=16 --method ngram:policy=fixed,k=8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence as Seq
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdraft.accept import Acceptance
from specdraft.api import build_engine
from specdraft.bench.harness import MethodSpec
from specdraft.bench.machine import machine_info
from specdraft.draft import Draft
from specdraft.engine import Engine
from specdraft.errors import SpecdraftError
from specdraft.metrics import SpecStats
from specdraft.model.kv_cache import KVCache
from specdraft.model.loader import LoadedModel, load
from specdraft.proposers.base import Proposer, Verified, move_key
from specdraft.sequence import GenerationConfig, Sequence
from specdraft.workloads import fit_messages, load_workload

DEFAULT_METHODS = ("lookahead:policy=fixed,k=16", "ngram:policy=fixed,k=8")


# --------------------------------------------------------------------------- recording


@dataclass(slots=True)
class StepRecord:
    proposed: int  # draft nodes this pass
    accepted: int  # of them kept
    emitted: int  # tokens the pass emitted (accepted + bonus)


class StepRecorder:
    """Wraps a proposer and records every step of every request (per row while it runs, then
    in ``finished`` in the order the requests ended). Changes nothing it passes on: the
    optional parts of the proposer protocol (``features``, ``prefilled``, ``setup_seconds``,
    ``setup_spent``, ``move``; proposers/base.py) are the wrapped proposer's, present exactly
    when it has them."""

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner
        self.name = inner.name
        self.rows: dict[int, list[StepRecord]] = {}
        self.finished: list[list[StepRecord]] = []

    def __getattr__(self, name: str) -> Any:  # only for what the class does not define
        if name == "inner":  # (before __init__ set it)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def begin(self, row: int, seq: Sequence) -> None:
        self.rows[row] = []
        self.inner.begin(row, seq)

    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache: KVCache) -> list[Draft]:
        return self.inner.propose(seqs, budgets, cache)

    def observe(self, row: int, draft: Draft, acceptance: Acceptance, verified: Verified) -> None:
        self.rows[row].append(StepRecord(len(draft), acceptance.accepted, len(acceptance.tokens)))
        self.inner.observe(row, draft, acceptance, verified)

    def end(self, row: int) -> None:
        self.finished.append(self.rows.pop(row, []))
        self.inner.end(row)

    @property
    def move(self) -> Callable[[int, int], None]:
        """Present when the wrapped proposer can move a row (the scheduler packs only then)."""
        inner_move = getattr(self.inner, "move")  # AttributeError: the recorder cannot move either

        def move(src: int, dst: int) -> None:
            move_key(self.rows, src, dst)
            inner_move(src, dst)

        return move

    def memory_bytes(self) -> int:
        return self.inner.memory_bytes()


# --------------------------------------------------------------------------- running


@dataclass(frozen=True, slots=True)
class ColdStartConfig:
    methods: tuple[MethodSpec, ...] = tuple(MethodSpec.parse(m) for m in DEFAULT_METHODS)
    workloads: tuple[str, ...] = ("math", "code")
    prompts: int = 8
    max_new_tokens: int = 128
    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    cost_curve: str | None = "results/runtime/runtime.json"

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.max_new_tokens < 1:
            raise SpecdraftError("coldstart: prompts and max_new_tokens must be >= 1")
        if not self.methods or not self.workloads:
            raise SpecdraftError("coldstart: give at least one method and one workload")


@dataclass(slots=True)
class MethodResult:
    method: str
    workload: str
    requests: int
    tau: float
    acceptance_rate: float
    nodes_per_pass: float
    est_speedup: float | None
    accepted_by_step: list[float]  # mean accepted tokens at step i (over requests reaching it)
    emitted_by_step: list[float]
    requests_by_step: list[int]
    per_request: list[dict[str, float]] = field(default_factory=list)


def first_turns(loaded: LoadedModel, workload: str, count: int, max_prompt: int) -> list[list[int]]:
    """The chat-encoded first user turn of the workload's first ``count`` prompts."""
    prompts = load_workload(workload, count)
    return [fit_messages(loaded.tokenizer, [{"role": "user", "content": p.turns[0]}], max_prompt, p.id)[0]
            for p in prompts]


def run_method(loaded: LoadedModel, spec: MethodSpec, requests: list[list[int]],
               gen: GenerationConfig) -> tuple[list[list[StepRecord]], SpecStats]:
    """Each request alone (batch 1, greedy) through ``spec``'s engine, every step recorded."""
    built = build_engine(loaded, spec.method, k=spec.k, policy=spec.policy, options=dict(spec.options))
    recorder = StepRecorder(built.proposer)
    engine = Engine(built.model, built.tokenizer, recorder, built.policy)
    stats = SpecStats()
    for ids in requests:
        engine.generate([ids], gen, stats=stats)
    return recorder.finished, stats


def summarize(spec: MethodSpec, workload: str, records: list[list[StepRecord]], stats: SpecStats,
              cost: dict[int, float] | None) -> MethodResult:
    steps = max(len(r) for r in records)
    reach = [sum(len(r) > i for r in records) for i in range(steps)]
    accepted = [statistics.fmean(r[i].accepted for r in records if len(r) > i) for i in range(steps)]
    emitted = [statistics.fmean(r[i].emitted for r in records if len(r) > i) for i in range(steps)]
    flat = [s for r in records for s in r]
    return MethodResult(
        spec.label, workload, len(records), stats.tau, stats.acceptance_rate,
        statistics.fmean(s.proposed for s in flat), estimated_speedup(flat, cost),
        accepted, emitted, reach,
        [{"steps": len(r), "tau": sum(s.emitted for s in r) / max(1, len(r)),
          "est_speedup": estimated_speedup(r, cost) or 0.0} for r in records],
    )


def estimated_speedup(steps: list[StepRecord], cost: dict[int, float] | None) -> float | None:
    """Emitted tokens x cost(1) / sum of cost(1 + nodes): the speedup over plain decoding if
    a pass cost only its verification width (see the module doc)."""
    if cost is None or not steps:
        return None
    spent = sum(cost_at(cost, 1 + s.proposed) for s in steps)
    return sum(s.emitted for s in steps) * cost[1] / spent


def cost_at(cost: dict[int, float], q: int) -> float:
    """The cost curve at q new tokens: linear between measured points, the last segment
    extended past the end."""
    if q in cost:
        return cost[q]
    xs = sorted(cost)
    lo = max((x for x in xs if x < q), default=xs[0])
    hi = min((x for x in xs if x > q), default=xs[-1])
    if hi == lo:  # past the end
        lo, hi = xs[-2], xs[-1]
    return cost[lo] + (cost[hi] - cost[lo]) * (q - lo) / (hi - lo)


def read_cost_curve(path: str | None, dtype: str) -> dict[int, float] | None:
    """The float32 (or the run's dtype) verification cost curve {q: ms} of a runtime result."""
    if path is None or not Path(path).is_file():
        return None
    curve = json.loads(Path(path).read_text()).get("cost_curve", {}).get(dtype)
    return {int(q): float(ms) for q, ms in curve.items()} if curve else None


def run_coldstart(cfg: ColdStartConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    loaded = load(cfg.model, dtype=cfg.dtype, device=cfg.device)
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens)
    max_prompt = loaded.config.max_context - cfg.max_new_tokens - max(m.k for m in cfg.methods) - 2
    cost = read_cost_curve(cfg.cost_curve, cfg.dtype)
    results = []
    for workload in cfg.workloads:
        requests = first_turns(loaded, workload, cfg.prompts, max_prompt)
        for spec in cfg.methods:
            records, stats = run_method(loaded, spec, requests, gen)
            res = summarize(spec, workload, records, stats, cost)
            log(format_row(res))
            results.append(res)
    return {"config": {**asdict(cfg), "methods": [m.label for m in cfg.methods]},
            "model": loaded.source.name, "machine": machine_info(),
            "cost_curve_ms": cost, "results": [asdict(r) for r in results]}


def format_row(r: MethodResult) -> str:
    est = f"{r.est_speedup:.2f}x" if r.est_speedup is not None else "-"
    return (f"{r.workload:>10} | {r.method:<36} | tau {r.tau:.2f} | accept {100 * r.acceptance_rate:4.1f}% | "
            f"nodes/pass {r.nodes_per_pass:5.1f} | est. speedup {est}")


# --------------------------------------------------------------------------- plotting


def smooth(values: list[float], width: int) -> list[float]:
    """Centred moving average (shorter at the ends)."""
    half = width // 2
    return [statistics.fmean(values[max(0, i - half) : i + half + 1]) for i in range(len(values))]


def write_plot(data: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    workloads = list(dict.fromkeys(r["workload"] for r in data["results"]))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for r in (r for r in data["results"] if r["workload"] == workload):
            # steps that at least a quarter of the requests reached (the tail averages one or two)
            steps = sum(n >= max(2, r["requests"] / 4) for n in r["requests_by_step"])
            accepted = r["accepted_by_step"][:steps]
            xs = range(1, steps + 1)
            line, = ax.plot(xs, smooth(accepted, 9), label=f"{r['method']} (tau {r['tau']:.2f})")
            ax.plot(xs, accepted, color=line.get_color(), alpha=0.2, linewidth=0.8)
        ax.set_title(f"{workload}: accepted tokens per target pass")
        ax.set_xlabel("step (target pass) within the request")
        ax.set_ylabel("accepted tokens, mean over requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{data['model']}, {data['config']['prompts']} prompts per workload, batch 1, greedy; "
                 "faint: per step, bold: 9-step average; steps that >= 1/4 of the requests reached", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> tuple[str, ColdStartConfig]:
    ap = argparse.ArgumentParser(prog="python -m specdraft.bench.coldstart", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder (coldstart.json, coldstart.png)")
    ap.add_argument("--method", action="append",
                    help=f"NAME[:k=..,policy=..,option=..] (default: {', '.join(DEFAULT_METHODS)})")
    ap.add_argument("--workload", action="append", help="workload name (default: math, code)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cost-curve", default="results/runtime/runtime.json", help="runtime.json with a cost_curve")
    args = ap.parse_args(argv)
    return args.out, ColdStartConfig(
        methods=tuple(MethodSpec.parse(m) for m in (args.method or DEFAULT_METHODS)),
        workloads=tuple(args.workload or ("math", "code")), prompts=args.prompts,
        max_new_tokens=args.max_new_tokens, model=args.model, dtype=args.dtype, device=args.device,
        cost_curve=args.cost_curve,
    )


def main(argv: list[str] | None = None) -> int:
    try:
        out, cfg = parse_args(argv)
        data = run_coldstart(cfg)
    except SpecdraftError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "coldstart.json").write_text(json.dumps(data, indent=1) + "\n")
    plot = write_plot(data, folder / "coldstart.png")
    print(f"wrote {folder / 'coldstart.json'}" + (f" and {plot}" if plot else " (no matplotlib: no plot)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
