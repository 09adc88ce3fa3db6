"""Closed loops through the Scheduler in one process, without HTTP or a client: what the engine
and the policy do under a server's load, apart from the server (bench-serve measures the whole).

Several methods run in lockstep: one scheduler per method over the same loaded model, each fed
the same requests by its own closed loop, their iterations taking turns (who goes first
alternates). Each method's throughput counts only its own iterations' time, so a slow spell of
a shared machine lands on all of them alike instead of on whichever ran at the time: the
ratios are much steadier than those of separate runs. Prints throughput, where the time went,
how full the steps were, and the steps that speculated per batch size.

    .venv/bin/python scripts/sched_loop.py --methods plain,suffix,mtp --concurrency 64 --requests 128 --workload code
"""

from __future__ import annotations

import argparse
import collections
import time
from dataclasses import dataclass, field

import torch

from specdraft.api import build_engine
from specdraft.bench.serve import workload_messages
from specdraft.model.loader import LoadedModel, load
from specdraft.scheduler import Request, Scheduler, SchedulerConfig
from specdraft.sequence import GenerationConfig


@dataclass
class Loop:
    """One method's scheduler and its closed-loop client: ``concurrency`` requests in flight
    until ``total`` are done."""

    method: str
    sched: Scheduler
    prompts: list[list[int]]
    gen: GenerationConfig
    concurrency: int
    total: int
    seconds: float = 0.0  # this loop's own iterations
    sent: int = 0
    done: int = 0
    tokens: int = 0
    running: list[Request] = field(default_factory=list)
    steps: collections.Counter = field(default_factory=collections.Counter)  # batch bucket -> steps
    spec: collections.Counter = field(default_factory=collections.Counter)  # ... that drafted
    phases: dict = field(default_factory=lambda: {"steady": [0, 0, 0, 0], "tail": [0, 0, 0, 0]})
    verify: dict = field(default_factory=lambda: collections.defaultdict(list))  # (bucket, drafted) -> verify seconds
    _drafted: int = 0
    _verified: float = 0.0

    def __post_init__(self) -> None:
        self.sched.on_step = self._on_step
        for _ in range(min(self.concurrency, self.total)):
            self._send()

    @property
    def finished(self) -> bool:
        return self.done >= self.total

    def iterate(self) -> None:
        t0 = time.perf_counter()
        self.sched.run_once()
        for r in [r for r in self.running if r.seq.finished]:
            self.running.remove(r)
            self.done += 1
            self.tokens += r.completion_tokens
            if self.sent < self.total:
                self._send()
        self.seconds += time.perf_counter() - t0

    def _send(self) -> None:
        self.running.append(self.sched.submit(self.prompts[self.sent % len(self.prompts)], self.gen))
        self.sent += 1

    def _on_step(self, rows: int, running_now: list[Request]) -> None:
        phase = self.phases["steady" if self.sent < self.total else "tail"]  # steps, computed, generating, joining
        for i, n in enumerate((1, rows, len(running_now), len(self.sched.joining))):
            phase[i] += n
        bucket = rows // 8 * 8
        self.steps[bucket] += 1
        drafted = self.sched.stats.proposed > self._drafted
        self.spec[bucket] += drafted
        self.verify[(bucket, drafted)].append(self.sched.stats.verify_s - self._verified)
        self._drafted, self._verified = self.sched.stats.proposed, self.sched.stats.verify_s


def make_loop(loaded: LoadedModel, method: str, args: argparse.Namespace, prompts: list[list[int]]) -> Loop:
    engine = build_engine(loaded, method)
    sched = Scheduler(engine, SchedulerConfig(max_batch=args.concurrency, max_queue=256, row_capacity=1024,
                                              pack=not args.no_pack))
    if engine.speculative and engine.policy.config.kind == "adaptive":
        for b in sched.config.batch_grid:
            engine.policy.prepare(b)
    return Loop(method, sched, prompts, GenerationConfig(max_new_tokens=args.max_tokens), args.concurrency,
                args.requests)


def report(loop: Loop, base: Loop) -> None:
    s, c = loop.sched.stats, loop.sched.counters
    rate = loop.tokens / loop.seconds
    print(f"{loop.method}: {loop.done} requests, {rate:.1f} tok/s, {rate / (base.tokens / base.seconds):.3f}x "
          f"{base.method} ({loop.seconds:.1f} s: prefill {s.prefill_s:.1f}, propose {s.propose_s:.1f}, "
          f"verify {s.verify_s:.1f}, other {s.other_s:.1f}); tau {s.emitted / max(1, s.steps):.2f}, "
          f"drafted {s.proposed}, accepted {s.accepted}, rows moved {c.moved}")
    for name, (n, computed, generating, joining) in loop.phases.items():
        print(f"  {name} ({'requests still to send' if name == 'steady' else 'the last ones draining'}): "
              f"{n} steps, per step {computed / max(1, n):.1f} rows computed, {generating / max(1, n):.1f} "
              f"generating, {joining / max(1, n):.1f} joining")
    print("  steps by batch size (speculative / all):",
          ", ".join(f"{b}-{b + 7}: {loop.spec[b]}/{n}" for b, n in sorted(loop.steps.items())))
    policy = loop.sched.engine.policy
    if loop.sched.engine.speculative and policy.cost is not None:
        q_max = 1 + policy.config.k
        for b in sorted({min(16, loop.concurrency), loop.concurrency}):
            curve = ", ".join(f"q={q}: {1000 * policy.cost.latency(b, q, q_max):.0f}" for q in range(1, q_max + 1))
            print(f"  the policy's cost curve at batch {b} (ms): {curve}")
        print(f"  realism factor {policy.realism.factor:.2f}")
        ragged = {b: {w: f"{o[0]:.2f} ({o[1]:.0f})" for w, o in sorted(ws.items())} for b, ws in sorted(policy.cost.ragged.items())}
        print(f"  ragged forwards' observed / priced, batch -> width -> ratio (count): {ragged}")
    for b in sorted({b for b, _ in loop.verify}):
        parts = [f"{'drafting' if d else 'plain'} {1000 * sum(v) / len(v):.0f} ms x {len(v)}"
                 for d in (False, True) if (v := loop.verify.get((b, d)))]
        print(f"  verify per step at {b}-{b + 7} rows: " + ", ".join(parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="plain,suffix", help="comma-separated; the first is the baseline")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-pack", action="store_true", help="leave finished requests' slots as holes")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load(dtype=args.dtype)
    [messages] = workload_messages((args.workload,)).values()
    prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": m}]) for m in messages]
    loops = [make_loop(loaded, m, args, prompts) for m in args.methods.split(",")]
    turn = 0
    while not all(loop.finished for loop in loops):
        order = loops[turn % len(loops):] + loops[:turn % len(loops)]
        for loop in order:
            if not loop.finished:
                loop.iterate()
        turn += 1
    print(f"{args.workload}, concurrency {args.concurrency}, {args.requests} requests of {args.max_tokens} tokens, "
          f"{args.dtype}, in lockstep")
    for loop in loops:
        report(loop, loops[0])


if __name__ == "__main__":
    main()
