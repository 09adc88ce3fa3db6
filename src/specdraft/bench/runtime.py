"""Runtime benchmark: plain decoding speed next to transformers, and the verification cost
curve (forward latency against the number of new tokens)."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specdraft.bench.machine import format_table, machine_info
from specdraft.engine import Engine
from specdraft.metrics import SpecStats
from specdraft.model.loader import LoadedModel, load
from specdraft.sequence import GenerationConfig

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works and when to use one.",
    "List five tips for learning a new programming language.",
    "What causes the seasons on Earth?",
    "Describe the water cycle in simple terms.",
    "Give me a recipe for a simple tomato soup.",
    "Summarize the plot of Romeo and Juliet in a paragraph.",
    "Why is the sky blue?",
]


@dataclass(frozen=True, slots=True)
class RuntimeBenchConfig:
    model: str | None = None
    out: str = "runs/runtime"
    new_tokens: int = 64
    repeats: int = 3
    batch_sizes: tuple[int, ...] = (1, 8)
    q_values: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    transformers_baseline: bool = True
    device: str = "cpu"
    prefix_tokens: int = 128  # cached tokens before the timed forward in the cost curve


def _median_time(fn: Any, repeats: int) -> float:
    fn()  # warm-up, excluded
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def chat_prompts(loaded: LoadedModel, n: int) -> list[list[int]]:
    tok = loaded.tokenizer
    return [tok.encode_chat([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]) for i in range(n)]


def ours_decode(loaded: LoadedModel, batch: int, cfg: RuntimeBenchConfig) -> dict[str, Any]:
    engine = Engine(loaded.model, loaded.tokenizer)
    prompts = chat_prompts(loaded, batch)
    gen = GenerationConfig(max_new_tokens=cfg.new_tokens, ignore_eos=True)
    last: dict[str, float] = {}

    def run() -> None:
        stats = SpecStats()
        engine.generate(prompts, gen, stats=stats)
        last.update(decode_s=stats.decode_s, prefill_s=stats.prefill_s)

    total = _median_time(run, cfg.repeats)
    tokens = batch * cfg.new_tokens
    return {"total_s": total, "tokens": tokens, "tok_per_s": tokens / total,
            "decode_tok_per_s": tokens / last["decode_s"]}


def transformers_decode(source: Path, prompts: list[list[int]], batch: int, cfg: RuntimeBenchConfig,
                        dtype: torch.dtype) -> dict[str, Any] | None:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    if source.is_dir():
        hf = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=dtype)
    hf = hf.to(cfg.device).eval()
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=cfg.device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=cfg.device)

    def run() -> None:
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=cfg.new_tokens,
                        min_new_tokens=cfg.new_tokens, do_sample=False, pad_token_id=pad)

    total = _median_time(run, cfg.repeats)
    tokens = batch * cfg.new_tokens
    return {"total_s": total, "tokens": tokens, "tok_per_s": tokens / total}


@torch.inference_mode()
def cost_curve(loaded: LoadedModel, cfg: RuntimeBenchConfig) -> dict[int, float]:
    """Median ms of one batch-1 forward over q new tokens after a cached prefix."""
    model = loaded.model
    cache = model.new_cache(1, cfg.prefix_tokens + max(cfg.q_values) + 1)
    prefix = torch.randint(3, model.config.vocab_size, (1, cfg.prefix_tokens), device=model.device)
    model(prefix, torch.arange(cfg.prefix_tokens, device=model.device)[None], cache, logits=False)
    out: dict[int, float] = {}
    for q in cfg.q_values:
        tokens = torch.randint(3, model.config.vocab_size, (1, q), device=model.device)
        positions = cfg.prefix_tokens + torch.arange(q, device=model.device)[None]

        def step() -> None:
            model(tokens, positions, cache)
            cache.truncate(cfg.prefix_tokens)

        out[q] = 1000 * _median_time(step, max(cfg.repeats, 5))
    return out


def run_runtime_bench(cfg: RuntimeBenchConfig) -> dict[str, Any]:
    results: dict[str, Any] = {"config": asdict(cfg), "machine": machine_info(cfg.device),
                               "decode": [], "cost_curve": {}}
    for dtype in cfg.dtypes:
        loaded = load(cfg.model, dtype=dtype, device=cfg.device)
        print(f"== {loaded.source.name} in {dtype} on {cfg.device} ({torch.get_num_threads()} threads)", flush=True)
        results["model"] = str(loaded.source)
        curve = cost_curve(loaded, cfg)
        results["cost_curve"][dtype] = curve
        print(format_table(["new tokens per forward", *map(str, curve)], [["ms", *curve.values()]]), flush=True)
        for batch in cfg.batch_sizes:
            row: dict[str, Any] = {"dtype": dtype, "batch": batch, "specdraft": ours_decode(loaded, batch, cfg)}
            if cfg.transformers_baseline:
                ref = transformers_decode(loaded.source, chat_prompts(loaded, batch), batch, cfg, loaded.model.dtype)
                row["transformers"] = ref if ref is not None else "not installed"
            results["decode"].append(row)
            print(_decode_line(row), flush=True)
        del loaded
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runtime.json").write_text(json.dumps(results, indent=2))
    print()
    print(decode_table(results))
    print(f"\nwrote {out / 'runtime.json'}")
    return results


def _decode_line(row: dict[str, Any]) -> str:
    ours = row["specdraft"]
    ref = row.get("transformers")
    ref_txt = f", transformers {ref['tok_per_s']:.1f} tok/s" if isinstance(ref, dict) else ""
    return f"  batch {row['batch']}: specdraft {ours['tok_per_s']:.1f} tok/s{ref_txt}"


def decode_table(results: dict[str, Any]) -> str:
    rows = []
    for r in results["decode"]:
        ref = r.get("transformers")
        ref_tps = ref["tok_per_s"] if isinstance(ref, dict) else None
        ours = r["specdraft"]["tok_per_s"]
        rows.append([r["dtype"], r["batch"], ours, r["specdraft"]["decode_tok_per_s"],
                     ref_tps if ref_tps is not None else "-", ours / ref_tps if ref_tps else "-"])
    return format_table(["dtype", "batch", "specdraft tok/s (end to end)", "specdraft decode-only tok/s",
                         "transformers tok/s (end to end)", "ratio"], rows)
