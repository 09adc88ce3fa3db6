"""A closed loop through the Scheduler in one process, without HTTP or a client: what the
engine and the policy do under a server's load, apart from the server (bench-serve measures
the whole). Prints throughput, where the time went and the steps that speculated per batch size.

    .venv/bin/python scripts/sched_loop.py --method mtp --concurrency 64 --requests 128 --workload code
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from specdraft.api import build_engine
from specdraft.bench.serve import workload_messages
from specdraft.model.loader import load
from specdraft.scheduler import Request, Scheduler, SchedulerConfig
from specdraft.sequence import GenerationConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="plain")
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
    engine = build_engine(loaded, args.method)
    sched = Scheduler(engine, SchedulerConfig(max_batch=64, max_queue=256, row_capacity=1024, pack=not args.no_pack))
    if engine.speculative and engine.policy.config.kind == "adaptive":
        for b in sched.config.batch_grid:
            engine.policy.prepare(b)
    [messages] = workload_messages((args.workload,)).values()
    gen = GenerationConfig(max_new_tokens=args.max_tokens)
    running: list[Request] = []
    steps: collections.Counter[int] = collections.Counter()  # batch bucket -> steps
    spec: collections.Counter[int] = collections.Counter()  # ... that drafted
    drafted = [0]
    occupancy = {"steady": [0, 0, 0, 0], "tail": [0, 0, 0, 0]}  # steps, rows computed, generating, joining

    def on_step(rows: int, running_now: list[Request]) -> None:
        phase = occupancy["steady" if sent < args.requests else "tail"]
        phase[0] += 1
        phase[1] += rows
        phase[2] += len(running_now)
        phase[3] += len(sched.joining)
        bucket = rows // 8 * 8
        steps[bucket] += 1
        spec[bucket] += sched.stats.proposed > drafted[0]
        drafted[0] = sched.stats.proposed

    sched.on_step = on_step
    sent = done = tokens = 0

    def send() -> None:
        nonlocal sent
        prompt = loaded.tokenizer.encode_chat([{"role": "user", "content": messages[sent % len(messages)]}])
        running.append(sched.submit(prompt, gen))
        sent += 1

    for _ in range(min(args.concurrency, args.requests)):
        send()
    t0 = time.perf_counter()
    while done < args.requests:
        sched.run_once()
        for r in [r for r in running if r.seq.finished]:
            running.remove(r)
            done += 1
            tokens += r.completion_tokens
            if sent < args.requests:
                send()
    elapsed = time.perf_counter() - t0
    s = sched.stats
    print(f"{args.method} {args.workload} c={args.concurrency}: {done} requests, {tokens / elapsed:.1f} tok/s "
          f"({elapsed:.1f} s: prefill {s.prefill_s:.1f}, propose {s.propose_s:.1f}, verify {s.verify_s:.1f}, "
          f"other {s.other_s:.1f})")
    print(f"tau {s.emitted / max(1, s.steps):.2f}, drafted {s.proposed}, accepted {s.accepted}, "
          f"rows moved {sched.counters.moved}")
    for name, (n, computed, generating, joining) in occupancy.items():
        print(f"  {name} ({'requests still to send' if name == 'steady' else 'the last ones draining'}): {n} steps, "
              f"per step {computed / max(1, n):.1f} rows computed, {generating / max(1, n):.1f} generating, "
              f"{joining / max(1, n):.1f} joining")
    print("steps by batch size (speculative / all):",
          ", ".join(f"{b}-{b + 7}: {spec[b]}/{n}" for b, n in sorted(steps.items())))
    policy = engine.policy
    if engine.speculative and policy.cost is not None:
        q_max = 1 + policy.config.k
        for b in (16, 64):
            curve = ", ".join(f"q={q}: {1000 * policy.cost.latency(b, q, q_max):.0f}" for q in range(1, q_max + 1))
            print(f"the policy's cost curve at batch {b} (ms): {curve}")
        print(f"realism factor {policy.realism.factor:.2f}")


if __name__ == "__main__":
    main()
