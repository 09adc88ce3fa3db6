"""PNG plots of benchmark results (matplotlib, optional: skipped with a note if missing)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

# The survey's expected n-gram acceptance ranges per workload type (seed table).
EXPECTED_ACCEPTANCE = {
    "summarization": (0.5, 0.9), "long_summarization": (0.5, 0.9), "code": (0.4, 0.8), "editing": (0.6, 0.9),
    "rag": (0.3, 0.6), "creative": (0.05, 0.15), "chat": (0.1, 0.3),
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(results: dict[str, Any], folder: Path) -> list[Path]:
    """Write every plot the results support; returns the files written ([] without matplotlib)."""
    try:
        plt = _pyplot()
    except ImportError:
        return []
    rows = results["rows"]
    out = []
    for name, fn in (("speedup_vs_batch.png", _speedup_vs_batch), ("acceptance_by_workload.png", _acceptance),
                     ("tau_histogram.png", _tau_hist), ("speedup_by_workload.png", _speedup_by_workload),
                     ("tree_vs_chain.png", _tree_vs_chain), ("adaptive_vs_fixed.png", _adaptive_vs_fixed)):
        fig = fn(plt, rows)
        if fig is not None:
            out.append(save_figure(plt, fig, folder / name))
    return out


def save_figure(plt: Any, fig: Any, path: Path) -> Path:
    """Write a figure as every benchmark plot is written, and free it."""
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _speculative(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["method"] for r in rows if r["base_method"] != "plain"))


def _speedup_vs_batch(plt: Any, rows: list[dict[str, Any]]) -> Any:
    batches = sorted({r["batch"] for r in rows})
    if len(batches) < 2:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for m in _speculative(rows):
        xs, ys, ys_decode = [], [], []
        for b in batches:
            sel = [r for r in rows if r["method"] == m and r["batch"] == b]
            plain = [r for r in rows if r["base_method"] == "plain" and r["batch"] == b]
            if sel and plain:  # overall speedup: all workloads' tokens over all their time
                xs.append(b)
                ys.append(_rate(sel, "time_s") / _rate(plain, "time_s"))
                ys_decode.append(_rate(sel, "decode") / _rate(plain, "decode"))
        line = ax.plot(xs, ys, marker="o", label=f"{m} (wall time)")[0]
        ax.plot(xs, ys_decode, marker="x", linestyle=":", color=line.get_color(), label=f"{m} (decode only)")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("Speedup vs batch size (all workloads)")
    ax.legend(fontsize=8)
    return fig


def _metric_by_workload(rows: list[dict[str, Any]], key: str) -> tuple[int, list[str], dict[str, list[float]]]:
    """Per speculative method, ``key`` of each workload at the smallest batch size."""
    b, workloads = _batch1(rows)
    series = {m: [next((r[key] for r in rows if r["method"] == m and r["workload"] == w and r["batch"] == b), 0.0)
                  for w in workloads] for m in _speculative(rows)}
    return b, workloads, series


def _rate(rows: list[dict[str, Any]], time_key: str) -> float:
    """Tokens per second over several rows: total tokens / total time (wall, or decode only)."""
    tokens = sum(r["new_tokens"] for r in rows)
    if time_key == "decode":
        seconds = sum(r["new_tokens"] / r["decode_tokens_per_s"] for r in rows if r.get("decode_tokens_per_s"))
    else:
        seconds = sum(r[time_key] for r in rows)
    return tokens / seconds if seconds > 0 else float("nan")


def _acceptance(plt: Any, rows: list[dict[str, Any]]) -> Any:
    if not _speculative(rows):
        return None
    b, workloads, series = _metric_by_workload(rows, "acceptance_rate")
    fig = _grouped_bars(plt, workloads, series, f"acceptance rate, batch {b}",
                        "Acceptance by workload (dotted boxes: the survey's n-gram ranges)")
    ax = fig.axes[0]
    width = 0.8 / len(series)
    for x, w in enumerate(workloads):
        if w in EXPECTED_ACCEPTANCE:
            lo, hi = EXPECTED_ACCEPTANCE[w]
            ax.add_patch(plt.Rectangle((x - width / 2, lo), 0.8, hi - lo, fill=False, edgecolor="black",
                                       linestyle=":", linewidth=1.2))
    ax.set_ylim(0, 1)
    return fig


def _tau_hist(plt: Any, rows: list[dict[str, Any]]) -> Any:
    methods = _speculative(rows)
    if not methods:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for m in methods:
        hist: dict[int, int] = defaultdict(int)
        for r in rows:
            if r["method"] == m:
                for n, c in enumerate(r["emitted_hist"]):
                    hist[n] += c
        total = sum(hist.values()) or 1
        xs = sorted(hist)
        ax.plot(xs, [hist[x] / total for x in xs], marker="o", label=m)
    ax.set_xlabel("tokens emitted in one target pass")
    ax.set_ylabel("fraction of passes")
    ax.set_title("Tokens per target pass (all workloads and batch sizes)")
    ax.legend(fontsize=8)
    return fig


def _speedup_by_workload(plt: Any, rows: list[dict[str, Any]]) -> Any:
    if not _speculative(rows):
        return None
    b, workloads, series = _metric_by_workload(rows, "speedup")
    return _grouped_bars(plt, workloads, series, f"speedup over plain (batch {b})", f"Speedup by workload at batch {b}",
                         baseline=1.0)


def _is_tree(row: dict[str, Any]) -> bool:
    return int(row["settings"].get("branches", 1)) > 1


def _batch1(rows: list[dict[str, Any]]) -> tuple[int, list[str]]:
    b = min(r["batch"] for r in rows)
    return b, list(dict.fromkeys(r["workload"] for r in rows if r["batch"] == b))


def _grouped_bars(plt: Any, workloads: list[str], series: dict[str, list[float]], ylabel: str, title: str,
                  baseline: float | None = None) -> Any:
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(workloads)), 4))
    width = 0.8 / max(1, len(series))
    for i, (label, vals) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(workloads))], vals, width, label=label)
    if baseline is not None:
        ax.axhline(baseline, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))], workloads, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def _tree_vs_chain(plt: Any, rows: list[dict[str, Any]]) -> Any:
    """Tokens per target pass (tau) of tree-shaped against chain-shaped drafts."""
    spec = [r for r in rows if r["base_method"] != "plain"]
    if not any(_is_tree(r) for r in spec) or all(_is_tree(r) for r in spec):
        return None
    b, workloads = _batch1(rows)
    series: dict[str, list[float]] = {}
    for m in _speculative(rows):
        sel = {r["workload"]: r for r in spec if r["method"] == m and r["batch"] == b}
        if sel:
            kind = "tree" if _is_tree(next(iter(sel.values()))) else "chain"
            series[f"{m} ({kind})"] = [sel[w]["tau"] if w in sel else 0.0 for w in workloads]
    return _grouped_bars(plt, workloads, series, f"tokens per target pass (tau), batch {b}",
                         "Tree vs chain drafts", baseline=1.0)


def _adaptive_vs_fixed(plt: Any, rows: list[dict[str, Any]]) -> Any:
    """Speedup of each adaptive method against the best fixed draft length, per workload."""
    spec = [r for r in rows if r["base_method"] != "plain"]
    adaptive = [r for r in spec if r["settings"].get("policy") == "adaptive" and not _is_tree(r)]
    fixed = [r for r in spec if r["settings"].get("policy") == "fixed" and not _is_tree(r)]
    if not adaptive or not fixed:
        return None
    b, workloads = _batch1(rows)
    series: dict[str, list[float]] = {}
    for m in dict.fromkeys(r["method"] for r in adaptive):
        series[m] = [next((r["speedup"] for r in adaptive if r["method"] == m and r["workload"] == w and r["batch"] == b),
                          0.0) for w in workloads]
    best = []
    for w in workloads:
        cands = [r for r in fixed if r["workload"] == w and r["batch"] == b]
        best.append(max((r["speedup"] for r in cands), default=0.0))
    series["best fixed k (per workload)"] = best
    return _grouped_bars(plt, workloads, series, f"speedup over plain, batch {b}",
                         "Adaptive draft length vs the best fixed length", baseline=1.0)
