"""Runtime benchmark: plain decoding in every numeric mode beside llama.cpp and transformers on
the same prompts and token counts, each mode's verification cost curve (ms per forward
against the number of new tokens), where a decode step's time goes, and peak memory.

Each mode and each peer runs in a process of its own (``python -m specdraft.bench.runtime``,
a JSON job on stdin, one JSON result on stdout): peak resident memory is then the mode's own,
one mode's allocations do not slow the next, and a peer that crashes costs only its row.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specdraft.bench.machine import machine_info
from specdraft.errors import SpecdraftError

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
MODES = ("float32", "bfloat16", "bfloat16-bi", "int4", "int4-bi")
EXACT = {"float32": "exact (200/200 verified)", "bfloat16-bi": "exact (batch-invariant)",
         "int4-bi": "exact (batch-invariant)", "bfloat16": "not exact for speculation or batching",
         "int4": "not exact for speculation or batching"}


@dataclass(frozen=True, slots=True)
class RuntimeBenchConfig:
    model: str | None = None
    out: str = "runs/runtime"
    new_tokens: int = 128
    prompts: int = 3  # chat prompts decoded one after another at batch 1 (and batched at batch > 1)
    repeats: int = 3
    batch_sizes: tuple[int, ...] = (1, 8)
    q_values: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    modes: tuple[str, ...] = MODES
    peers: tuple[str, ...] = ("llamacpp", "transformers")
    profile: bool = True
    device: str = "cpu"
    threads: int | None = None
    prefix_tokens: int = 128  # cached tokens before the timed forward in the cost curve

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad:
            raise SpecdraftError(f"unknown mode(s) {', '.join(bad)}; choose from {', '.join(MODES)}")
        bad = [p for p in self.peers if p not in ("llamacpp", "transformers")]
        if bad:
            raise SpecdraftError(f"unknown peer(s) {', '.join(bad)}; choose from llamacpp, transformers")


def split_mode(mode: str) -> tuple[str, bool]:
    """'int4-bi' -> ('int4', True): the dtype and whether the model is batch-invariant."""
    return mode.removesuffix("-bi"), mode.endswith("-bi")


def _median_time(fn: Any, repeats: int) -> float:
    fn()  # warm-up, excluded
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _rss_mb() -> float | None:
    """Resident memory now (Linux), after a garbage collection; None elsewhere."""
    import gc
    import os

    gc.collect()
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


# --------------------------------------------------------------------------- our modes (child side)


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    return [tokenizer.encode_chat([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]) for i in range(n)]


def weight_bytes(model: torch.nn.Module) -> dict[str, float]:
    """MB of parameters, oneDNN packed copies and quantized packs (4-bit layers, an 8-bit LM
    head) held by the model."""
    from specdraft.model.linear import Linear

    params = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    packed = int4 = 0
    for m in model.modules():
        if isinstance(m, Linear):
            packed += m.weight.numel() * m.weight.element_size() if m.packed is not None else 0
            int4 += m.int4.nbytes if m.int4 is not None else 0
    return {"parameters_mb": params / 2**20, "packed_copies_mb": packed / 2**20, "int4_mb": int4 / 2**20}


@torch.inference_mode()
def cost_curve(model: Any, q_values: tuple[int, ...], prefix_tokens: int, repeats: int) -> dict[int, float]:
    """Median ms of one batch-1 forward over q new tokens after a cached prefix."""
    cache = model.new_cache(1, prefix_tokens + max(q_values) + 1)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, model.config.vocab_size, (1, prefix_tokens), generator=gen).to(model.device)
    model(prefix, torch.arange(prefix_tokens, device=model.device)[None], cache, logits=False, prompt=[prefix_tokens])
    out: dict[int, float] = {}
    for q in q_values:
        tokens = torch.randint(3, model.config.vocab_size, (1, q), generator=gen).to(model.device)
        positions = prefix_tokens + torch.arange(q, device=model.device)[None]

        def step() -> None:
            model(tokens, positions, cache)
            cache.truncate(prefix_tokens)

        out[q] = 1000 * _median_time(step, max(5 * repeats, 15))
    return out


def ours_decode(loaded: Any, batch: int, cfg: RuntimeBenchConfig) -> dict[str, Any]:
    """Plain greedy decoding of ``cfg.new_tokens`` per row (EOS ignored). Batch 1: the prompts one
    after another; batch b: b rows of the prompts at once. Median of ``repeats``."""
    from specdraft.engine import Engine
    from specdraft.metrics import SpecStats
    from specdraft.sequence import GenerationConfig

    engine = Engine(loaded.model, loaded.tokenizer)
    prompts = chat_prompts(loaded.tokenizer, max(cfg.prompts, batch))
    groups = [[p] for p in prompts[: cfg.prompts]] if batch == 1 else [prompts[:batch]]
    gen = GenerationConfig(max_new_tokens=cfg.new_tokens, ignore_eos=True)
    totals, decodes = [], []
    for i in range(cfg.repeats + 1):
        total = decode = 0.0
        for g in groups:
            stats = SpecStats()
            t0 = time.perf_counter()
            engine.generate(g, gen, stats=stats)
            total += time.perf_counter() - t0
            decode += stats.decode_s
        if i:  # the first round warms up
            totals.append(total)
            decodes.append(decode)
    tokens = sum(len(g) for g in groups) * cfg.new_tokens
    return {"batch": batch, "tokens": tokens, "tok_per_s": tokens / statistics.median(totals),
            "decode_tok_per_s": tokens / statistics.median(decodes)}


def measure_mode(mode: str, cfg: RuntimeBenchConfig) -> dict[str, Any]:
    from specdraft.bench.profile import profile_decode
    from specdraft.model import fastpath
    from specdraft.model.loader import load, set_threads

    set_threads(cfg.threads)
    dtype, invariant = split_mode(mode)
    t0 = time.perf_counter()
    loaded = load(cfg.model, dtype=dtype, device=cfg.device, batch_invariant=invariant)
    row: dict[str, Any] = {"mode": mode, "guarantee": EXACT[mode], "load_s": time.perf_counter() - t0,
                           "rss_after_load_mb": _rss_mb(), "peak_rss_at_load_mb": _peak_rss_mb(),
                           **weight_bytes(loaded.model),
                           "source": str(loaded.source), "threads": torch.get_num_threads()}
    row["cpp_loop"] = fastpath.status()
    row["cost_curve"] = cost_curve(loaded.model, cfg.q_values, cfg.prefix_tokens, cfg.repeats)
    row["decode"] = [ours_decode(loaded, b, cfg) for b in cfg.batch_sizes]
    if cfg.profile and cfg.device == "cpu":
        prof = profile_decode(loaded, 1, 32)
        row["profile"] = {"ms_per_step": prof["ms_per_step"], "breakdown_ms": prof["breakdown_ms"]}
    row["peak_rss_mb"] = _peak_rss_mb()
    return row


# --------------------------------------------------------------------------- peers (child side)


def llamacpp_decode(cfg: RuntimeBenchConfig) -> dict[str, Any]:
    """llama.cpp's plain greedy decoding of the same prompt tokens at batch 1: the prompt
    evaluated (untimed), then ``new_tokens`` of sample + eval (EOS ignored), median of repeats."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return {"peer": "llama.cpp", "note": "skipped: llama-cpp-python is not installed "
                                             "(bash scripts/setup.sh --peers builds it, ~4 minutes)"}
    from llama_cpp import Llama

    from specdraft.model.loader import default_model_path, load_tokenizer

    source = Path(cfg.model) if cfg.model else default_model_path()
    if source.suffix != ".gguf":
        return {"peer": "llama.cpp", "note": "skipped: llama.cpp needs a GGUF file"}
    prompts = chat_prompts(load_tokenizer(source), cfg.prompts)
    threads = cfg.threads or torch.get_num_threads()
    llm = Llama(model_path=str(source), n_ctx=max(len(p) for p in prompts) + cfg.new_tokens + 8, n_threads=threads,
                n_threads_batch=threads, verbose=False)

    def one(p: list[int]) -> float:
        llm.reset()
        llm.eval(p)
        t0 = time.perf_counter()
        for _ in range(cfg.new_tokens):
            llm.eval([llm.sample(top_k=1, temp=0.0)])
        return time.perf_counter() - t0

    one(prompts[0])  # warm-up
    rounds = [sum(one(p) for p in prompts) for _ in range(cfg.repeats)]
    tokens = len(prompts) * cfg.new_tokens
    import llama_cpp

    return {"peer": "llama.cpp", "version": llama_cpp.__version__, "threads": threads,
            "decode": [{"batch": 1, "tokens": tokens, "decode_tok_per_s": tokens / statistics.median(rounds)}],
            "peak_rss_mb": _peak_rss_mb()}


def transformers_decode(cfg: RuntimeBenchConfig, dtype: str) -> dict[str, Any]:
    """transformers' ``generate`` on the same prompts (left-padded batches): end to end, and
    decode-only as (time for n tokens - time for 1 token) per n - 1 tokens."""
    import importlib.util

    name = f"transformers {dtype}"
    for pkg in ("transformers", "accelerate"):
        if importlib.util.find_spec(pkg) is None:
            return {"peer": name, "note": f"skipped: {pkg} is not installed (pip install 'specdraft[test]')"}
    from transformers import AutoModelForCausalLM

    from specdraft.model.loader import default_model_path, load_tokenizer, set_threads

    set_threads(cfg.threads)
    source = Path(cfg.model) if cfg.model else default_model_path()
    tokenizer = load_tokenizer(source)
    torch_dtype = getattr(torch, dtype)
    if source.is_dir():
        hf = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch_dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch_dtype)
    hf = hf.eval()
    rows = []
    for batch in cfg.batch_sizes:
        prompts = chat_prompts(tokenizer, max(cfg.prompts, batch))
        groups = [[p] for p in prompts[: cfg.prompts]] if batch == 1 else [prompts[:batch]]

        def run(n: int) -> None:
            with torch.inference_mode():
                for g in groups:
                    width = max(len(p) for p in g)
                    ids = torch.tensor([[0] * (width - len(p)) + p for p in g])
                    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in g])
                    hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=0)

        full = _median_time(lambda: run(cfg.new_tokens), cfg.repeats)
        first = _median_time(lambda: run(1), cfg.repeats)
        tokens = sum(len(g) for g in groups) * cfg.new_tokens
        decoded = sum(len(g) for g in groups) * (cfg.new_tokens - 1)
        rows.append({"batch": batch, "tokens": tokens, "tok_per_s": tokens / full,
                     "decode_tok_per_s": decoded / max(full - first, 1e-9)})
    import transformers

    return {"peer": name, "version": transformers.__version__, "decode": rows, "peak_rss_mb": _peak_rss_mb()}


def cpp_build(folder: str) -> dict[str, Any]:
    """Build (or load, when ``folder`` already holds it) the C++ layer loop; its timing."""
    import os

    os.environ["TORCH_EXTENSIONS_DIR"] = folder
    from specdraft.model import fastpath

    fastpath.extension()
    return fastpath.status()


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    if job["kind"] == "build":
        return cpp_build(job["folder"])
    cfg = RuntimeBenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in job["config"].items()})
    if job["kind"] == "mode":
        return measure_mode(job["mode"], cfg)
    if job["kind"] == "llamacpp":
        return llamacpp_decode(cfg)
    return transformers_decode(cfg, job["dtype"])


# --------------------------------------------------------------------------- the run (parent side)


def in_child(job: dict[str, Any], label: str) -> dict[str, Any]:
    """Run one job in a fresh interpreter; a crash becomes a note."""
    proc = subprocess.run([sys.executable, "-m", "specdraft.bench.runtime"], input=json.dumps(job),
                          capture_output=True, text=True)
    for line in reversed(proc.stdout.splitlines()):
        try:
            result = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(result, dict):
            return result
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit code {proc.returncode}"
    return {"note": f"failed: {last}"}


def run_runtime_bench(cfg: RuntimeBenchConfig) -> dict[str, Any]:
    from specdraft.bench.runtime_report import console_summary, write_report
    from specdraft.model.loader import set_threads

    set_threads(cfg.threads)
    results: dict[str, Any] = {"config": asdict(cfg), "machine": machine_info(cfg.device), "modes": [],
                               "peers": [], "cost_curve": {}}
    if cfg.device == "cpu":
        results["cpp_loop_build"] = build_times()
    jobs: list[tuple[str, dict[str, Any]]] = [(m, {"kind": "mode", "mode": m}) for m in cfg.modes]
    if "llamacpp" in cfg.peers:
        jobs.append(("llama.cpp", {"kind": "llamacpp"}))
    if "transformers" in cfg.peers:
        jobs += [(f"transformers {d}", {"kind": "transformers", "dtype": d}) for d in ("float32", "bfloat16")]
    for i, (label, job) in enumerate(jobs):
        print(f"[{i + 1}/{len(jobs)}] {label} ...", flush=True)
        row = in_child({**job, "config": asdict(cfg)}, label)
        if job["kind"] == "mode":
            row.setdefault("mode", label)
            results["modes"].append(row)
            if "cost_curve" in row:
                results["cost_curve"][label] = row["cost_curve"]
        else:
            row.setdefault("peer", label)
            results["peers"].append(row)
        print("   " + (row.get("note") or _one_line(row)), flush=True)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runtime.json").write_text(json.dumps(results, indent=2))
    write_report(results, out)
    print()
    print(console_summary(results))
    print(f"\nwrote {out / 'runtime.json'} and {out / 'report.md'}")
    return results


def build_times() -> dict[str, Any]:
    """The C++ layer loop's first build (in an empty folder) and a later load from that cache."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="specdraft-build-") as folder:
        print("C++ layer loop: building in an empty folder, then loading it again ...", flush=True)
        first = in_child({"kind": "build", "folder": folder}, "build")
        cached = in_child({"kind": "build", "folder": folder}, "build")
    print(f"   first build {first.get('seconds', float('nan')):.1f} s, cached load "
          f"{cached.get('seconds', float('nan')):.2f} s", flush=True)
    return {"first": first, "cached": cached}


def _one_line(row: dict[str, Any]) -> str:
    parts = [f"batch {d['batch']}: {d['decode_tok_per_s']:.1f} tok/s decode-only" for d in row.get("decode", [])]
    if "cost_curve" in row:
        curve = row["cost_curve"]
        parts.append(f"forward q=1 {curve[min(curve)]:.1f} ms")
    return "; ".join(parts)


def _main() -> int:
    print(json.dumps(run_job(json.load(sys.stdin))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
