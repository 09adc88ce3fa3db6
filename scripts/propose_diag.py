"""What a speculative method's drafting steps cost under a server's load
(results/sched-lockstep/, session 23): one method's closed loop through the Scheduler, as in
sched_loop.py, with a wiretap on the engine's budget, propose and verify calls. For every step
that drafted: live rows, rows with a budget and their sum, the proposer's backlog and its
catch-up (estimated and spent), the drafting time without it, the kept width and tokens, and
the verification time; then the plain steps' verification time by batch size.

    .venv/bin/python scripts/propose_diag.py --method mtp --workload code --concurrency 64 --requests 128
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sched_loop import make_loop  # noqa: E402

from specdraft.bench.serve import workload_messages  # noqa: E402
from specdraft.model.loader import load  # noqa: E402


def wiretap(engine: Any, log: list[dict[str, float]]) -> None:
    """Record each step's budgets, drafting and verification (the engine's calls, unchanged)."""
    proposer, cur = engine.proposer, {}
    plan_of, propose, verify = engine._plan, engine._propose, engine._verify

    def rec_budgets(batch, live):
        cur.clear()
        setup = getattr(proposer, "setup_seconds", None)
        seqs = [s if on else None for s, on in zip(batch.rows, live)]
        pending = setup(seqs) if setup else [0.0] * len(seqs)
        plan = plan_of(batch, live)
        out = plan.budgets
        rows = getattr(proposer, "rows", None)
        cur.update(live=sum(live), rows=sum(b > 0 for b in out), sumb=sum(out),
                   setup_est=sum(p for p, b in zip(pending, out) if b > 0),
                   backlog=sum(rows.backlog(r) for r, b in enumerate(out) if b > 0) if hasattr(rows, "backlog") else 0)
        return plan

    def rec_propose(batch, live, b):
        t0 = time.perf_counter()
        drafts = propose(batch, live, b)
        cur.update(prop_s=time.perf_counter() - t0, setup_s=getattr(proposer, "setup_spent", 0.0),
                   width=max(len(d) for d in drafts), kept=sum(len(d) for d in drafts))
        return drafts

    def rec_verify(drafts, last, cache):
        t0 = time.perf_counter()
        out = verify(drafts, last, cache)
        cur["ver_s"] = time.perf_counter() - t0
        if cur.get("live"):
            log.append(dict(cur))
        return out

    engine._plan, engine._propose, engine._verify = rec_budgets, rec_propose, rec_verify


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="mtp")
    ap.add_argument("--workload", default="code")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-pack", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load(dtype=args.dtype)
    [messages] = workload_messages((args.workload,)).values()
    prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": m}]) for m in messages]
    loop = make_loop(loaded, args.method, args, prompts)
    log: list[dict[str, float]] = []
    wiretap(loop.sched.engine, log)
    while not loop.finished:
        loop.iterate()
    print(f"{args.method} {args.workload} c={args.concurrency}: {loop.tokens / loop.seconds:.1f} tok/s "
          f"in {loop.seconds:.1f} s")
    spec = [e for e in log if e["rows"] > 0]
    total = {k: round(sum(e[k] for e in spec), 3) for k in ("prop_s", "setup_s", "setup_est", "ver_s")}
    print(f"steps {len(log)}, drafting steps {len(spec)}; their seconds: {total}")
    for e in spec:
        print(f"live {e['live']:3d} rows {e['rows']:3d} budgets {e['sumb']:4d} backlog {e['backlog']:6d} "
              f"setup est {1000 * e['setup_est']:6.1f} ms spent {1000 * e['setup_s']:6.1f} ms "
              f"propose {1000 * (e['prop_s'] - e['setup_s']):5.1f} ms width {e['width']} kept {e['kept']:3d} "
              f"verify {1000 * e['ver_s']:6.1f} ms")
    by = collections.defaultdict(list)
    for e in log:
        if e["rows"] == 0:
            by[e["live"] // 8 * 8].append(e["ver_s"])
    print("plain steps' verification ms by live rows:",
          {f"{k}-{k + 7}": round(1000 * sum(v) / len(v), 1) for k, v in sorted(by.items())})


if __name__ == "__main__":
    main()
