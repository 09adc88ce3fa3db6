"""The runtime benchmark's report: tables (decoding, cost curves, time breakdown, memory), the
issue's goals as ratios, and two plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdraft.bench.machine import format_table
from specdraft.bench.plots import _pyplot, save_figure

GOAL_VS_LLAMACPP = 0.67  # fastest exact plain decoding against llama.cpp's, batch 1
GOAL_VS_TRANSFORMERS = 1.5  # float32 plain against transformers float32
GOAL_BATCH8 = 3.0  # batch 8 against batch 1, tokens per second


def _decode(row: dict[str, Any], batch: int, key: str = "decode_tok_per_s") -> float | None:
    for d in row.get("decode", []):
        if d["batch"] == batch and key in d:
            return float(d[key])
    return None


def _llamacpp(results: dict[str, Any]) -> float | None:
    return next((_decode(p, 1) for p in results["peers"] if p.get("peer") == "llama.cpp" and "decode" in p), None)


def _peer(results: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((p for p in results["peers"] if p.get("peer") == name and "decode" in p), None)


def _curve(row: dict[str, Any]) -> dict[int, float]:
    return {int(q): float(ms) for q, ms in row.get("cost_curve", {}).items()}


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's three ratio goals, each with its measured value (None: not measured)."""
    out = []
    llama = _llamacpp(results)
    exact = [m for m in results["modes"] if m.get("guarantee", "").startswith("exact") and "decode" in m]
    best = max(exact, key=lambda m: _decode(m, 1) or 0.0, default=None)
    ratio = (_decode(best, 1) or 0) / llama if best is not None and llama else None
    out.append({"goal": f"fastest exact plain decoding >= {GOAL_VS_LLAMACPP}x llama.cpp (batch 1, decode-only)",
                "value": ratio, "met": ratio is not None and ratio >= GOAL_VS_LLAMACPP,
                "detail": f"{best['mode']}" if best else "-"})
    f32 = next((m for m in results["modes"] if m["mode"] == "float32" and "decode" in m), None)
    hf = _peer(results, "transformers float32")
    ratio = (_decode(f32, 1) or 0) / _decode(hf, 1) if f32 and hf and _decode(hf, 1) else None
    out.append({"goal": f"float32 plain >= {GOAL_VS_TRANSFORMERS}x transformers float32 (batch 1, decode-only)",
                "value": ratio, "met": ratio is not None and ratio >= GOAL_VS_TRANSFORMERS, "detail": "float32"})
    for m in results["modes"]:
        one, eight = _decode(m, 1), _decode(m, 8)
        ratio = eight / one if one and eight else None
        out.append({"goal": f"batch 8 >= {GOAL_BATCH8}x batch 1 tokens/s", "value": ratio,
                    "met": ratio is not None and ratio >= GOAL_BATCH8, "detail": m["mode"]})
    return out


def decode_table(results: dict[str, Any]) -> str:
    llama = _llamacpp(results)
    batches = results["config"]["batch_sizes"]
    rows = []
    for r in [*results["modes"], *results["peers"]]:
        name = r.get("mode") or r.get("peer")
        if "decode" not in r:
            rows.append([name, r.get("note", "-")] + ["-"] * (len(batches) + 4))
            continue
        one = _decode(r, 1)
        rows.append([name, r.get("guarantee", r.get("version", "-")),
                     *[_decode(r, b) if _decode(r, b) is not None else "-" for b in batches],
                     one / llama if one and llama else "-",
                     _decode(r, 1, "tok_per_s") or "-", r.get("peak_rss_mb", "-"),
                     r["profile"]["ms_per_step"] if "profile" in r else "-"])
    head = ["mode / peer", "guarantee / version", *[f"batch {b} tok/s" for b in batches], "batch 1 vs llama.cpp",
            "batch 1 end to end tok/s", "peak RSS MB", "profiled ms/step"]
    return format_table(head, rows)


def curve_table(results: dict[str, Any]) -> str:
    qs = [int(q) for q in results["config"]["q_values"]]
    rows = []
    for m in results["modes"]:
        c = _curve(m)
        if c:
            ratio = c[8] / c[1] if 8 in c and 1 in c else "-"
            rows.append([m["mode"], *[c.get(q, "-") for q in qs], ratio])
    return format_table(["mode", *[f"q={q} ms" for q in qs], "q=8 / q=1"], rows)


def breakdown_table(results: dict[str, Any]) -> str:
    modes = [m for m in results["modes"] if "profile" in m]
    cats = list(dict.fromkeys(k for m in modes for k in m["profile"]["breakdown_ms"]))
    rows = [[c, *[m["profile"]["breakdown_ms"].get(c, 0.0) for m in modes]] for c in cats]
    rows.append(["total (profiled step)", *[m["profile"]["ms_per_step"] for m in modes]])
    return format_table(["ms per batch-1 decode step", *[m["mode"] for m in modes]], rows)


def memory_table(results: dict[str, Any]) -> str:
    rows = [[m["mode"], m.get("parameters_mb", "-"), m.get("packed_copies_mb", "-"), m.get("int4_mb", "-"),
             m.get("rss_after_load_mb") or "-", m.get("peak_rss_at_load_mb", "-"), m.get("peak_rss_mb", "-"),
             m.get("load_s", "-")]
            for m in results["modes"] if "parameters_mb" in m]
    return format_table(["mode", "parameters MB", "oneDNN packed copies MB", "quantized packs MB", "RSS after load MB",
                         "peak RSS while loading MB", "peak RSS MB (run end)", "load s"], rows)


def build_line(results: dict[str, Any]) -> str:
    b = results.get("cpp_loop_build")
    if not b:
        return "Not measured."
    first, cached = b.get("first", {}), b.get("cached", {})
    if not first.get("available"):
        return f"Unavailable on this machine ({first.get('failed') or first.get('note')}): every mode ran the Python loop."
    used = [m["mode"] for m in results["modes"] if m.get("cpp_loop", {}).get("available")]
    return (f"`model/csrc/decode.cpp` (the layers' ATen calls without the interpreter, bit-identical to the Python "
            f"loop): first build {first['seconds']:.1f} s (torch's tool chain, cached under ~/.cache/torch_extensions), "
            f"later loads {cached['seconds']:.2f} s. Used by: {', '.join(used) or 'none'}. `SPECDRAFT_FASTPATH=0` "
            "runs the Python loop.")


def goals_table(results: dict[str, Any]) -> str:
    rows = [[g["goal"], g["detail"], g["value"] if g["value"] is not None else "-",
             "met" if g["met"] else "not met"] for g in goals(results)]
    return format_table(["goal", "mode", "measured", ""], rows)


def console_summary(results: dict[str, Any]) -> str:
    return "\n\n".join([decode_table(results), curve_table(results), goals_table(results)])


def write_report(results: dict[str, Any], folder: Path) -> Path:
    cfg, mach = results["config"], results["machine"]
    plots = write_plots(results, folder)
    lines = [
        "# Runtime: plain decoding per numeric mode, beside llama.cpp and transformers",
        "",
        f"Machine: {mach['cpu']}, {mach['cores']} cores, torch {mach['torch']} ({mach['torch_threads']} threads). "
        f"Model: `{Path(str(results['modes'][0].get('source', 'default'))).name if results['modes'] else '-'}`. "
        f"Greedy, {cfg['new_tokens']} new tokens per row (EOS ignored), {cfg['prompts']} chat prompts one after "
        "another at batch 1, the same prompts batched above it. Decode-only: prompt processing excluded "
        "(llama.cpp: the prompt evaluated untimed, then sample + eval per token; transformers: generate(n) - "
        "generate(1)). Every mode and peer ran in a process of its own, one after another.",
        "",
        "## Decoding (tokens per second, decode-only unless said)",
        "",
        decode_table(results),
        "",
        "## Goals",
        "",
        goals_table(results),
        "",
        "## Verification cost curve (ms per batch-1 forward over q new tokens after "
        f"{cfg['prefix_tokens']} cached)",
        "",
        curve_table(results),
        "",
        "## Where a decode step's time goes (torch profiler, batch 1, 32 steps)",
        "",
        breakdown_table(results),
        "",
        "## Memory",
        "",
        memory_table(results),
        "",
        "## The C++ layer loop",
        "",
        build_line(results),
        "",
        "Modes: `float32`, `bfloat16` (dequantized weights), `int4` (the GGUF's Q4_0/Q4_1 layer matrices at 4 "
        "bits, torch's CPU int4 kernel, bfloat16 activations; the Q8_0 embedding / LM head dequantized to "
        "bfloat16); `-bi` = `--batch-invariant` (speculative and batched output byte-identical to plain "
        "decoding).",
    ]
    lines += ["", *[f"![{p.stem}]({p.name})" for p in plots]]
    path = folder / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_plots(results: dict[str, Any], folder: Path) -> list[Path]:
    try:
        plt = _pyplot()
    except ImportError:
        return []
    out = []
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for m in results["modes"]:
        c = _curve(m)
        if c:
            ax.plot(list(c), list(c.values()), marker="o", label=m["mode"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("new tokens per forward (q)")
    ax.set_ylabel("ms per forward (batch 1)")
    ax.set_title("Verification cost curve per numeric mode")
    ax.legend()
    ax.grid(alpha=0.3)
    out.append(save_figure(plt, fig, folder / "cost_curve.png"))
    names, values = [], []
    for r in [*results["modes"], *results["peers"]]:
        v = _decode(r, 1)
        if v:
            names.append(r.get("mode") or r.get("peer"))
            values.append(v)
    if names:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        colors = ["tab:orange" if n == "llama.cpp" else "tab:gray" if n.startswith("transformers") else "tab:blue"
                  for n in names]
        ax.barh(names, values, color=colors)
        ax.set_xlabel("plain greedy decoding, batch 1, decode-only tok/s")
        ax.invert_yaxis()
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.0f}", va="center")
        ax.set_title("Plain decoding speed")
        out.append(save_figure(plt, fig, folder / "decode_speed.png"))
    return out
