"""The benchmark harness: methods x workloads x batch sizes, every method against plain
decoding in the same run, on the same prompts and limits.

For each workload and batch size, the workload's requests are split into full batches of
that size; each method generates them all, ``repeats`` times (median wall time reported),
after one warm-up generation per method that is not timed. Repeats run in rounds, each
round every method once, the order rotated from round to round, so that a slow spell of a
shared machine is spread over the methods instead of falling on one (timings here vary by
10-20% from run to run). Every repeat starts from the same learned state (``Memory``: the
policy's evidence and a proposer's memory of earlier outputs), so a repeat does not draft
from its own prompts' outputs of the round before. Multi-turn conversations are
expanded into one request per turn; the earlier turns' answers come from plain greedy
decoding (computed once), so every method sees the same contexts.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdraft.api import build_engine
from specdraft.bench.ceiling import copy_ceiling_tau, lookup_ceiling_tau
from specdraft.bench.machine import machine_info
from specdraft.engine import Engine, Memory
from specdraft.errors import SpecdraftError
from specdraft.metrics import SpecStats
from specdraft.model.loader import LoadedModel, load
from specdraft.policy import CostModel
from specdraft.proposers import get_method
from specdraft.sampling import Sampling
from specdraft.sequence import GenerationConfig
from specdraft.workloads import Prompt, fit_messages, load_workload, workload_label

WARMUP_PROMPT = 64  # prompt tokens kept for the untimed warm-up (its prefill is not what it warms)


@dataclass(frozen=True, slots=True)
class MethodSpec:
    """A method with its settings, written ``NAME`` or ``NAME:key=value,...`` (keys: k, policy,
    or the method's own options). The text is the label in reports."""

    label: str
    method: str
    k: int = 8
    policy: str = "adaptive"
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> "MethodSpec":
        name, _, rest = text.strip().partition(":")
        get_method(name)  # unknown method -> one-line error
        k, policy, options = 8, "adaptive", []
        for item in filter(None, (x.strip() for x in rest.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise SpecdraftError(f"method spec {text!r}: expected key=value, got {item!r}")
            if key == "k":
                try:
                    k = int(value)
                except ValueError:
                    raise SpecdraftError(f"method spec {text!r}: k must be an integer") from None
            elif key == "policy":
                policy = value
            else:
                options.append((key, value))
        return cls(text.strip(), name, k, policy, tuple(options))


PLAIN = MethodSpec("plain", "plain")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    methods: tuple[MethodSpec, ...] = (MethodSpec.parse("ngram"),)
    workloads: tuple[str, ...] = ("summarization", "rag", "code", "creative")
    batch_sizes: tuple[int, ...] = (1,)
    max_new_tokens: int = 128
    samples: int = 8  # requests per workload at batch 1; a batch of B runs max(1, samples // B) full batches
    repeats: int = 1
    batched_repeats: int | None = None  # timed repeats at batch sizes > 1 (None: ``repeats``)
    temperature: float = 0.0
    seed: int = 0
    model: str | None = None
    dtype: str = "float32"
    batch_invariant: bool = False  # see Transformer: exact in any dtype, slower
    device: str = "cpu"
    out: str = "runs/bench"
    peers: tuple[str, ...] = ()  # "transformers", "llamacpp": measured at batch 1, skipped with a note if missing
    isolate_peers: bool = True  # each peer in its own process: a crash there loses only that peer's rows

    def repeats_at(self, batch: int) -> int:
        """Timed repeats (rotated rounds, the median reported) at this batch size."""
        return self.repeats if batch == 1 or self.batched_repeats is None else self.batched_repeats

    def __post_init__(self) -> None:
        if self.samples < 1 or self.repeats < 1 or self.max_new_tokens < 1 or (self.batched_repeats or 1) < 1:
            raise SpecdraftError("samples, repeats and max_new_tokens must be >= 1")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise SpecdraftError("batch sizes must be positive integers")
        if not self.workloads:
            raise SpecdraftError("no workloads given")
        Sampling(temperature=self.temperature)  # validates
        from specdraft.bench.peers import PEERS

        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise SpecdraftError(f"unknown peer {unknown[0]!r}; available: {', '.join(PEERS)}")
        if self.peers and self.temperature != 0:
            raise SpecdraftError("peers are compared greedily: use --temperature 0 with --peers")


@dataclass(frozen=True, slots=True)
class Request:
    id: str
    workload: str
    tokens: tuple[int, ...]
    truncated: bool


@dataclass(slots=True)
class Row:
    method: str  # label
    base_method: str
    settings: dict[str, Any]
    workload: str
    batch: int
    requests: int
    new_tokens: int
    time_s: float  # median wall time over repeats (prefill + decode)
    times_s: list[float]
    tokens_per_s: float
    speedup: float = 0.0  # over plain, same workload and batch size (wall time: prefill + decode)
    decode_tokens_per_s: float = 0.0  # new tokens / decode time (prefill excluded)
    decode_speedup: float = 0.0  # the same ratio over plain, on decode time only
    tau: float = 0.0
    acceptance_rate: float = 0.0
    acceptance_by_position: list[float] = field(default_factory=list)
    emitted_hist: list[int] = field(default_factory=list)
    propose_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    prefill_s: float = 0.0
    proposer_bytes: int = 0
    peak_rss_bytes: int = 0
    copy_ceiling_tau: float = 0.0  # plain rows: the tau of an oracle copying context spans (bench/ceiling.py)
    lookup_ceiling_tau: float = 0.0  # plain rows: the same for an oracle that continues a match of the last token


def build_requests(loaded: LoadedModel, prompts: list[Prompt], max_prompt: int, gen: GenerationConfig,
                   limit: int) -> list[Request]:
    """Up to ``limit`` requests, one per user turn; earlier turns are answered by plain greedy
    decoding."""
    plain = build_engine(loaded, "plain")
    out: list[Request] = []
    for p in prompts:
        messages: list[dict[str, str]] = []
        for turn, user in enumerate(p.turns):
            if len(out) == limit:
                return out
            messages.append({"role": "user", "content": user})
            ids, cut = fit_messages(loaded.tokenizer, messages, max_prompt, p.id)
            out.append(Request(f"{p.id}#{turn + 1}", p.workload, tuple(ids), cut))
            if turn + 1 < len(p.turns) and len(out) < limit:
                answer = plain.generate([ids], gen)[0].text
                messages.append({"role": "assistant", "content": answer})
    return out


def batches(requests: list[Request], size: int, workload: str, samples: int) -> list[list[Request]]:
    """Full batches of ``size`` requests: max(1, samples // size) of them, so batch 1 runs
    ``samples`` requests and a larger batch at least one full batch."""
    if size > len(requests):
        raise SpecdraftError(
            f"batch size {size} is larger than the {len(requests)} requests available for workload {workload!r}"
        )
    n = min(max(1, samples // size), len(requests) // size)
    return [requests[i * size : (i + 1) * size] for i in range(n)]


@dataclass(slots=True)
class RunResult:
    seconds: float
    new_tokens: int
    stats: SpecStats
    outputs: list[tuple[tuple[int, ...], list[int]]]  # (prompt, generated tokens) per request


def run_config(engine: Engine, groups: list[list[Request]], gen: GenerationConfig, cfg: BenchConfig) -> RunResult:
    stats = SpecStats()
    outputs: list[tuple[tuple[int, ...], list[int]]] = []
    t0 = time.perf_counter()
    for gi, group in enumerate(groups):
        sampling = [Sampling(temperature=cfg.temperature, seed=cfg.seed + gi * 1000 + i) for i in range(len(group))]
        results = engine.generate([list(r.tokens) for r in group], gen, sampling, stats=stats)
        outputs += [(r.tokens, res.tokens) for r, res in zip(group, results)]
    seconds = time.perf_counter() - t0
    return RunResult(seconds, sum(len(o) for _, o in outputs), stats, outputs)


def rounds(methods: Sequence[MethodSpec], repeats: int) -> list[list[MethodSpec]]:
    """The order of the timed runs: ``repeats`` rounds of every method, round r starting at
    method r (mod the count), so that each method runs early and late alike."""
    n = len(methods)
    return [[methods[(r + i) % n] for i in range(n)] for r in range(repeats)]


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    loaded = load(cfg.model, dtype=cfg.dtype, device=cfg.device, batch_invariant=cfg.batch_invariant)
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens)
    max_k = max((m.k for m in cfg.methods), default=0)
    max_prompt = loaded.config.max_context - cfg.max_new_tokens - max_k - 2
    cost = CostModel(loaded.model)
    methods = (PLAIN, *(m for m in cfg.methods if m.method != "plain"))
    engines = {m.label: build_engine(loaded, m.method, k=m.k, policy=m.policy, options=dict(m.options), cost=cost)
               for m in methods}
    log(f"== {loaded.source.name} ({cfg.dtype}, {cfg.device}); methods: {', '.join(engines)}; "
        f"workloads: {', '.join(cfg.workloads)}; batch sizes: {', '.join(map(str, cfg.batch_sizes))}")
    requests: dict[str, list[Request]] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for spec in cfg.workloads:
            wanted = max(cfg.samples, max(cfg.batch_sizes))
            prompts = load_workload(spec, wanted)
            name = workload_label(spec)  # "NAME=FILE.jsonl" is reported as NAME
            if name in requests:
                raise SpecdraftError(f"workload {name!r} is given twice")
            requests[name] = build_requests(loaded, prompts, max_prompt, gen, wanted)
    for w in caught:
        log(f"warning: {w.message}")
    plan = [(w, b) for w in requests for b in cfg.batch_sizes]
    for w, b in plan:
        batches(requests[w], b, w, cfg.samples)  # fail early on impossible batch sizes
    rows: list[Row] = []
    warmed: set[tuple[str, int]] = set()
    bar = tqdm(total=sum(cfg.repeats_at(b) for _, b in plan) * len(methods), desc="bench", unit="run", file=sys.stderr)
    for w, b in plan:
        groups = batches(requests[w], b, w, cfg.samples)
        for m in methods:
            if (m.label, b) not in warmed:  # warm-up: a short untimed batch (measures the cost model too)
                engines[m.label].generate([list(r.tokens)[-WARMUP_PROMPT:] for r in groups[0]],
                                          GenerationConfig(max_new_tokens=8))
                warmed.add((m.label, b))
        runs: dict[str, list[RunResult]] = {m.label: [] for m in methods}
        memory = {m.label: Memory.of(engines[m.label]) for m in methods}
        for order in rounds(methods, cfg.repeats_at(b)):
            for m in order:
                memory[m.label].restore(engines[m.label])  # every round starts from the same state
                runs[m.label].append(run_config(engines[m.label], groups, gen, cfg))
                bar.update(1)
        for m in methods:
            times = [r.seconds for r in runs[m.label]]
            typical = min(runs[m.label], key=lambda r: abs(r.seconds - statistics.median(times)))
            row = make_row(m, w, b, groups, times, typical.new_tokens, typical.stats)
            if m.method == "plain":
                row.copy_ceiling_tau = copy_ceiling_tau(typical.outputs, max(max_k, 1))
                row.lookup_ceiling_tau = lookup_ceiling_tau(typical.outputs, max(max_k, 1))
            rows.append(row)
        _fill_speedups(rows, w, b)
        for r in rows[-len(methods):]:
            bar.write(f"  {w:>18} batch {b:>3} {r.method:>24}: {r.tokens_per_s:7.1f} tok/s  x{r.speedup:.2f}  "
                      f"tau {r.tau:.2f}  accept {r.acceptance_rate:.0%}")
    bar.close()
    results = {
        "config": asdict(cfg),
        "machine": machine_info(cfg.device),
        "model": {"source": str(loaded.source), "name": loaded.config.name, "layers": loaded.config.num_layers,
                  "context": loaded.config.max_context},
        "truncated": {w: sum(r.truncated for r in reqs) for w, reqs in requests.items()},
        "cost_model_s": {str(b): {str(q): t for q, t in tab.items()} for b, tab in cost.table.items()},
        "rows": [asdict(r) for r in rows],
        "peers": [],
        "peer_notes": {},
    }
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))  # saved before the peers run: a
    if cfg.peers:  # peer that crashes the process (llama.cpp can) must not take our results with it
        results["peers"], results["peer_notes"] = run_peers(cfg, loaded, requests, gen, log)
        (out / "results.json").write_text(json.dumps(results, indent=2))
    return results


def make_row(m: MethodSpec, workload: str, batch: int, groups: list[list[Request]], times: list[float],
             new_tokens: int, stats: SpecStats) -> Row:
    t = statistics.median(times)
    return Row(
        method=m.label, base_method=m.method,
        settings={"k": m.k, "policy": m.policy, **dict(m.options)} if m.method != "plain" else {},
        workload=workload, batch=batch, requests=sum(len(g) for g in groups), new_tokens=new_tokens,
        time_s=t, times_s=times, tokens_per_s=new_tokens / t if t > 0 else 0.0,
        decode_tokens_per_s=new_tokens / stats.decode_s if stats.decode_s > 0 else 0.0,
        tau=stats.tau, acceptance_rate=stats.acceptance_rate, acceptance_by_position=stats.acceptance_by_position,
        emitted_hist=stats.emitted_hist, propose_s=stats.propose_s, verify_s=stats.verify_s, other_s=stats.other_s,
        prefill_s=stats.prefill_s, proposer_bytes=stats.proposer_bytes,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


def _fill_speedups(rows: list[Row], workload: str, batch: int) -> None:
    group = [r for r in rows if r.workload == workload and r.batch == batch]
    base = next((r for r in group if r.base_method == "plain"), None)
    for r in group:
        r.speedup = r.tokens_per_s / base.tokens_per_s if base and base.tokens_per_s else 0.0
        r.decode_speedup = r.decode_tokens_per_s / base.decode_tokens_per_s if base and base.decode_tokens_per_s else 0.0


def run_peers(cfg: BenchConfig, loaded: LoadedModel, requests: dict[str, list[Request]], gen: GenerationConfig,
              log: Callable[[str], None]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Each peer's plain and prompt-lookup decoding on the batch-1 requests of every workload,
    each peer in its own process unless ``cfg.isolate_peers`` is off."""
    from specdraft.bench.peers import measure_isolated, measure_peer

    rows: list[dict[str, Any]] = []
    notes: dict[str, str] = {}
    workloads = {w: [list(group[0].tokens) for group in batches(reqs, 1, w, cfg.samples)]
                 for w, reqs in requests.items()}

    def emit(row: dict[str, Any]) -> None:
        if "note" in row:
            notes[name] = str(row["note"])
            return
        rows.append(row)
        log(f"  peer {name:>12} {row['workload']:>18}: plain {row['plain_tokens_per_s']:6.1f} tok/s, "
            f"{row['mode']} {row['speculative_tokens_per_s']:6.1f} tok/s x{row['speedup']:.2f}")

    assistant = next((dict(m.options).get("path") for m in cfg.methods if m.method == "draft"), None)
    threads = torch.get_num_threads()  # the peers get the threads our methods ran with
    for name in cfg.peers:
        log(f"peer {name}: plain and speculative decoding on {len(workloads)} workload(s)")
        if cfg.isolate_peers:
            job = {"peer": name, "source": str(loaded.source), "workloads": workloads,
                   "max_new_tokens": gen.max_new_tokens, "assistant": assistant, "threads": threads}
            notes[name] = measure_isolated(job, emit)
        else:
            measure_peer(name, loaded.source, workloads, gen.max_new_tokens, emit, assistant, threads)
            notes.setdefault(name, "ok")
        if notes[name] != "ok":
            log(f"peer {name} {notes[name]}")
    return rows, notes
