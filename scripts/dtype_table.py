"""Tokens/s of plain and speculative decoding across numeric modes, against float32 plain
decoding: the table and plot in results/bench-dtypes (three `specdraft bench` runs on the same
prompts, one per mode; see that folder's README).

    .venv/bin/python scripts/dtype_table.py results/bench-dtypes
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

MODES = (("float32", "float32"), ("bfloat16-invariant", "bfloat16, batch-invariant"), ("bfloat16", "bfloat16 (not exact)"))
CELLS = (("float32", "plain"), ("float32", "ngram"), ("float32", "suffix"), ("bfloat16-invariant", "plain"),
         ("bfloat16-invariant", "ngram"), ("bfloat16-invariant", "suffix"), ("bfloat16", "plain"))


def load(folder: Path) -> dict[tuple[str, str, str], dict]:
    rows = {}
    for mode, _ in MODES:
        for r in json.loads((folder / mode / "results.json").read_text())["rows"]:
            if r["batch"] == 1:
                rows[(mode, r["workload"], r["method"])] = r
    return rows


def table(rows: dict[tuple[str, str, str], dict]) -> str:
    label = dict(MODES)
    workloads = sorted({w for (m, w, _) in rows if m == "float32"}, key=lambda w: [k[1] for k in rows].index(w))
    head = "| workload | " + " | ".join(f"{label[m]} {meth}" for m, meth in CELLS) + " |"
    out = [head, "|---" * (len(CELLS) + 1) + "|"]
    ratios: dict[tuple[str, str], list[float]] = {c: [] for c in CELLS}
    for w in workloads:
        base = rows[("float32", w, "plain")]["tokens_per_s"]
        cells = []
        for m, meth in CELLS:
            r = rows.get((m, w, meth))
            if r is None:
                cells.append("-")
                continue
            ratios[(m, meth)].append(r["tokens_per_s"] / base)
            tau = f", tau {r['tau']:.2f}" if meth != "plain" else ""
            cells.append(f"{r['tokens_per_s']:.1f} ({r['tokens_per_s'] / base:.2f}x{tau})")
        out.append(f"| {w} | " + " | ".join(cells) + " |")
    geo = [f"{math.exp(sum(map(math.log, v)) / len(v)):.2f}x" if v else "-" for v in ratios.values()]
    out.append("| geometric mean vs float32 plain | " + " | ".join(geo) + " |")
    return "\n".join(out)


def plot(rows: dict[tuple[str, str, str], dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label = dict(MODES)
    workloads = [w for (m, w, meth) in rows if m == "float32" and meth == "plain"]
    shown = [c for c in CELLS if c[0] != "bfloat16" or c[1] == "plain"]
    width = 0.8 / len(shown)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, (m, meth) in enumerate(shown):
        ys = [rows[(m, w, meth)]["tokens_per_s"] if (m, w, meth) in rows else 0 for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], ys, width, label=f"{label[m]}: {meth}")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))], workloads)
    ax.set_ylabel("tokens / s (batch 1, prefill included)")
    ax.set_title("Default model on 2 CPU cores: plain and speculative decoding by numeric mode")
    ax.legend(fontsize=8, ncol=2)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "results/bench-dtypes")
    rows = load(folder)
    print(table(rows))
    plot(rows, folder / "tokens_per_s.png")
    print(f"wrote {folder / 'tokens_per_s.png'}")


if __name__ == "__main__":
    main()
