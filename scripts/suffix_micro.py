"""Micro benchmark: microseconds per propose() for a 2,000-token context, suffix vs n-gram.

The context is real text (QMSum meeting transcripts, tokenized with the default model's
tokenizer); each step proposes with a budget of 8, then the context grows by 1-3 tokens (as
decoding emits them). "suffix +global" first fills the global trie with 100 earlier outputs
of 200 tokens. Best of 3 runs (by median). No model forward is run.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/suffix_micro.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

from specdraft.model.loader import load
from specdraft.proposers.base import Proposer
from specdraft.proposers.ngram import NgramProposer
from specdraft.proposers.suffix import SuffixConfig, SuffixProposer
from specdraft.workloads import load_workload

CONTEXT, STEPS, BUDGET, OUTPUTS, OUTPUT_LEN = 2000, 250, 8, 100, 200


def run(make: Callable[[], Proposer], ids: list[int], outputs: int) -> tuple[float, list[float], list[int], int]:
    proposer = make()
    for i in range(outputs):  # finished requests: their outputs go to the global trie at end()
        start = 3 * CONTEXT + OUTPUT_LEN * i
        proposer.begin(0, SimpleNamespace(tokens=[1], output=ids[start : start + OUTPUT_LEN]))  # type: ignore[arg-type]
        proposer.end(0)
    seq = SimpleNamespace(tokens=list(ids[:CONTEXT]), output=[])
    t0 = time.perf_counter()
    proposer.begin(0, seq)  # type: ignore[arg-type]
    t_begin = time.perf_counter() - t0
    times, nodes, pos = [], [], CONTEXT
    for i in range(STEPS):
        t0 = time.perf_counter()
        draft = proposer.propose([seq], [BUDGET], None)[0]  # type: ignore[list-item, arg-type]
        times.append(time.perf_counter() - t0)
        nodes.append(len(draft))
        seq.tokens.extend(ids[pos : pos + 1 + i % 3])
        pos += 1 + i % 3
    return t_begin, times, nodes, proposer.memory_bytes()


def main() -> None:
    tokenizer = load(None).tokenizer
    ids = tokenizer.encode("\n\n".join(p.turns[0] for p in load_workload("long_summarization", 3)))
    assert len(ids) >= 3 * CONTEXT + OUTPUT_LEN * OUTPUTS, "not enough text"
    cases: list[tuple[str, Callable[[], Proposer], int]] = [
        ("ngram", NgramProposer, 0),
        ("suffix (no global)", lambda: SuffixProposer(SuffixConfig(use_global=False)), 0),
        ("suffix +global", SuffixProposer, OUTPUTS),
    ]
    print(f"{CONTEXT}-token context, budget {BUDGET}, {STEPS} steps; microseconds per propose()")
    for name, make, outputs in cases:
        runs = [run(make, ids, outputs) for _ in range(3)]
        t_begin, times, nodes, memory = min(runs, key=lambda r: statistics.median(r[1]))
        us = sorted(t * 1e6 for t in times)
        print(f"{name:20s} begin {t_begin * 1e3:6.1f} ms | median {statistics.median(us):5.0f} us, "
              f"p90 {us[int(0.9 * len(us))]:5.0f} us, mean {statistics.fmean(us):5.0f} us | "
              f"nodes/draft {statistics.fmean(nodes):.2f} | memory {memory / 1e6:5.2f} MB")


if __name__ == "__main__":
    main()
