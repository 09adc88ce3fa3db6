"""The report of a serving benchmark: a table per workload (throughput, speedup over plain
serving at the same load, TTFT, ITL, tau) and plots. A cell's load is its concurrency (closed
loop) or its request rate (open loop: ``rate`` set)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdraft.bench.machine import format_table


def load(cell: dict[str, Any]) -> float:
    """What a cell's load is measured in: its request rate (open loop), else its concurrency."""
    return cell["rate"] if cell.get("rate") is not None else cell["concurrency"]


def _plain_of(cell: dict[str, Any], cells: list[dict[str, Any]]) -> dict[str, Any] | None:
    """specdraft's plain serving cell at the same workload and load, if it ran."""
    return next((c for c in cells if c["engine"] == "specdraft:plain" and c["workload"] == cell["workload"]
                 and load(c) == load(cell) and (c.get("rate") is None) == (cell.get("rate") is None)), None)


def _speedup(cell: dict[str, Any], cells: list[dict[str, Any]]) -> float | None:
    plain = _plain_of(cell, cells)
    if plain is None or not plain["throughput"]:
        return None
    return cell["throughput"] / plain["throughput"]


def _round_speedups(cell: dict[str, Any], cells: list[dict[str, Any]]) -> str:
    """Each round's speedup over plain serving's same round ("-" for one round): rounds are
    interleaved, so a pair ran minutes apart and their spread shows the machine's noise."""
    plain = _plain_of(cell, cells)
    ours, base = cell.get("round_throughput", []), plain.get("round_throughput", []) if plain else []
    if len(ours) < 2 or len(ours) != len(base) or not all(base):
        return "-"
    return " / ".join(f"{a / b:.2f}" for a, b in zip(ours, base))


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def write_serve_report(folder: Path, results: dict[str, Any] | None = None) -> Path:
    if results is None:
        results = json.loads((folder / "results.json").read_text())
    cells = results["cells"]
    cfg = results["config"]
    machine = results.get("machine", {})
    rates = cfg.get("rates") or []
    loads = (f"request rates {', '.join(f'{r:g}' for r in rates)} per second, Poisson arrivals (open loop; "
             f"conc.: the most requests in flight)" if rates else
             f"concurrency {', '.join(map(str, cfg['concurrency']))}, a closed loop")
    lines = ["# Serving benchmark", "",
             f"`specdraft bench-serve`: {', '.join(cfg['methods'])} (and peers: {', '.join(cfg['peers']) or 'none'}); "
             f"workloads {', '.join(cfg['workloads'])}; {loads}; "
             f"{cfg['max_tokens']} tokens per request, greedy, streamed chat requests; "
             f"{cfg['dtype']}{', batch-invariant' if cfg['batch_invariant'] else ''}.",
             f"Machine: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores; server threads: "
             f"{cfg.get('threads') or 'torch default'}.", "",
             "Throughput is output tokens per second of wall time over the cell; speedup is over specdraft's plain "
             "serving at the same load (pooled over rounds; by round: each round against plain's same "
             "round); TTFT and ITL (gap between streamed chunks) in ms; tau = tokens per "
             "target pass per row (from the server's /metrics); server s: the server's scheduler time over the cell "
             "in prompt feeding / drafting / verification / the rest of its steps (/metrics), against the cell's "
             "wall time in seconds.", ""]
    for workload in dict.fromkeys(c["workload"] for c in cells):
        rows = []
        for c in (c for c in cells if c["workload"] == workload):
            sp = _speedup(c, cells)
            rows.append([c["engine"], *([f"{c['rate']:g}"] if rates else []), c["concurrency"], c["requests"],
                         f"{c['throughput']:.1f}",
                         "-" if sp is None else f"{sp:.2f}x", _round_speedups(c, cells), _ms(c["ttft_p50"]),
                         _ms(c["ttft_p99"]), _ms(c["itl_p50"]), _ms(c["itl_p99"]), _ms(c["tpot_p50"]),
                         "-" if c["tau"] is None else f"{c['tau']:.2f}", _engine_split(c), c["errors"]])
        lines += [f"## {workload}", "", format_table(
            ["engine", *(["rate/s"] if rates else []), "conc.", "requests", "tok/s", "speedup", "by round", "TTFT p50", "TTFT p99", "ITL p50",
             "ITL p99", "TPOT p50", "tau", "server s", "errors"], rows), ""]
    if results.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in results["notes"]] + [""]
    plots = write_serve_plots(folder, cells)
    if plots:
        lines += ["Plots: " + ", ".join(f"`{p.name}`" for p in plots), ""]
    path = folder / "report.md"
    path.write_text("\n".join(lines))
    return path


def _engine_split(cell: dict[str, Any]) -> str:
    """'prefill/propose/verify/other of wall' seconds, or '-' for a server without them (a peer)."""
    split = cell.get("engine_s") or {}
    if not split:
        return "-"
    parts = "/".join(f"{split.get(p, 0.0):.1f}" for p in ("prefill", "propose", "verify", "other"))
    return f"{parts} of {cell['seconds']:.1f}"


def write_serve_plots(folder: Path, cells: list[dict[str, Any]]) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    workloads = list(dict.fromkeys(c["workload"] for c in cells))
    engines = list(dict.fromkeys(c["engine"] for c in cells))
    open_loop = any(c.get("rate") is not None for c in cells)
    out = []
    for key, ylabel, name, scale in (("throughput", "output tokens / s", "throughput_vs_concurrency.png", 1.0),
                                     ("ttft_p50", "TTFT p50 (ms)", "ttft_vs_concurrency.png", 1000.0),
                                     ("itl_p50", "ITL p50 (ms)", "itl_vs_concurrency.png", 1000.0)):
        fig, axes = plt.subplots(1, len(workloads), figsize=(5.2 * len(workloads), 3.8), squeeze=False)
        for ax, workload in zip(axes[0], workloads):
            for engine in engines:
                sel = sorted((c for c in cells if c["engine"] == engine and c["workload"] == workload
                              and c[key] is not None), key=load)
                if sel:
                    ax.plot([load(c) for c in sel], [scale * c[key] for c in sel], marker="o", label=engine)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("requests per second (open loop)" if open_loop else "concurrent requests")
            ax.set_ylabel(ylabel)
            ax.set_title(workload)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        path = folder / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out
