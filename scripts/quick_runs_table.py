"""Batch-1 speedups of several `specdraft bench --quick` runs side by side, with each cell's
lowest value: the table in results/quick-runs (see its README).

    .venv/bin/python scripts/quick_runs_table.py results/quick-runs/run*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def short(method: str) -> str:
    return method.split(":")[0]


def table(paths: list[Path]) -> str:
    runs = [json.loads(p.read_text())["rows"] for p in paths]
    cells: dict[tuple[str, str], list[float]] = {}
    taus: dict[tuple[str, str], list[float]] = {}
    for rows in runs:
        for r in rows:
            if r["batch"] == 1 and r["method"] != "plain":
                key = (r["workload"], short(r["method"]))
                cells.setdefault(key, []).append(r["speedup"])
                taus.setdefault(key, []).append(r["tau"])
    head = "| workload | method | " + " | ".join(p.stem for p in paths) + " | lowest | tau |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (w, m), values in cells.items():
        tau = "/".join(f"{t:.2f}" for t in taus[(w, m)])
        lines.append(f"| {w} | {m} | " + " | ".join(f"{v:.2f}x" for v in values) + f" | {min(values):.2f}x | {tau} |")
    lowest = min(min(v) for v in cells.values())
    lines.append(f"\nLowest batch-1 cell over {len(paths)} runs: {lowest:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table([Path(p) for p in sys.argv[1:]]))
