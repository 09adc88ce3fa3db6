"""Where a plain decode step's time goes: the engine's own decode loop under torch's profiler,
each operator's exclusive CPU time put in a category, and what no operator accounts for
called Python and dispatch (the interpreter, module calls, tensor bookkeeping between ops).

    python -m specdraft.bench.profile --dtype bfloat16 --batch-invariant --tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from specdraft.engine import Engine
from specdraft.metrics import SpecStats
from specdraft.model.loader import LoadedModel, load, set_threads
from specdraft.sequence import GenerationConfig

# operator name fragments -> category (first match wins; checked in this order)
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("matrix products", ("linear", "addmm", "mm", "matmul", "bmm", "mkldnn", "onednn", "weight_int", "quant_mm")),
    ("attention", ("scaled_dot_product", "flash_attention", "softmax", "_efficient_attention", "attend")),
    ("norms and activations", ("rms_norm", "silu", "gelu", "norm", "rsqrt", "pow", "mean")),
    ("cache writes and gathers", ("index_put", "index", "gather", "scatter", "embedding")),
    ("sampling", ("argmax", "multinomial", "topk", "sort", "cumsum")),
    ("host copies and conversions", ("copy_", "_to_copy", "to", "item", "_local_scalar_dense", "tensor",
                                     "contiguous", "clone")),
    ("elementwise and views", ("add", "mul", "sub", "neg", "cat", "stack", "chunk", "split", "view", "reshape",
                               "transpose", "slice", "select", "expand", "unsqueeze", "empty", "zeros", "ones",
                               "arange", "fill", "lift", "detach", "as_strided", "resolve", "alias")),
)


def category(name: str) -> str:
    op = name.split("::")[-1].lower()
    for label, fragments in CATEGORIES:
        if any(op == f or op.startswith(f) or f in op for f in fragments):
            return label
    return "other operators"


def profile_decode(loaded: LoadedModel, batch: int = 1, tokens: int = 32, prompt: str = "Explain how a hash "
                   "table works and when to use one.") -> dict[str, Any]:
    """ms per decode step by category, for ``tokens`` greedy steps of plain decoding."""
    from torch.profiler import ProfilerActivity, profile

    engine = Engine(loaded.model, loaded.tokenizer)
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    gen = GenerationConfig(max_new_tokens=tokens, ignore_eos=True)
    engine.generate([ids] * batch, gen)  # warm-up (packing, allocator, first-call paths)
    stats = SpecStats()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        engine.generate([ids] * batch, gen, stats=stats)
        wall = time.perf_counter() - t0
    steps = max(stats.steps // batch, 1)
    by_cat: dict[str, float] = defaultdict(float)
    top: list[tuple[str, float, int]] = []
    for e in prof.key_averages():
        us = e.self_cpu_time_total
        by_cat[category(e.key)] += us
        top.append((e.key, us, e.count))
    total_ops = sum(by_cat.values())
    decode_us = stats.decode_s * 1e6
    prefill_share = stats.prefill_s / wall if wall > 0 else 0.0
    ops_decode = total_ops * (1 - prefill_share)  # operators' time in decoding (prefill's share removed)
    per_step = {k: v * (1 - prefill_share) / steps / 1000 for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])}
    per_step["Python and dispatch (outside operators)"] = max(decode_us - ops_decode, 0.0) / steps / 1000
    top.sort(key=lambda x: -x[1])
    return {"batch": batch, "steps": steps, "ms_per_step": stats.decode_s / steps * 1000, "breakdown_ms": per_step,
            "top_ops": [{"op": k, "ms_per_step": us * (1 - prefill_share) / steps / 1000, "calls_per_step": n / steps}
                        for k, us, n in top[:15]]}


def _print(result: dict[str, Any], label: str) -> None:
    print(f"== {label}: {result['ms_per_step']:.1f} ms per decode step (batch {result['batch']}, "
          f"{result['steps']} steps)")
    for k, v in result["breakdown_ms"].items():
        print(f"  {k:<42} {v:7.2f} ms")
    print("  top operators (exclusive time):")
    for t in result["top_ops"][:10]:
        print(f"    {t['op']:<48} {t['ms_per_step']:6.2f} ms  {t['calls_per_step']:6.0f} calls/step")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdraft.bench.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-invariant", action="store_true")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="also write the result as JSON")
    args = p.parse_args(argv)
    set_threads(args.threads)
    loaded = load(args.model, dtype=args.dtype, batch_invariant=args.batch_invariant)
    result = profile_decode(loaded, args.batch, args.tokens)
    _print(result, f"{args.dtype}{' batch-invariant' if args.batch_invariant else ''}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
