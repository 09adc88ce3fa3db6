"""Markdown tables of a trained head's learning curve (``curve.jsonl`` written by ``specdraft
train eagle|mtp``): held-out tau and acceptance per draft position against epochs and training
tokens. Usage: python scripts/head_tables.py RUN_FOLDER [TRAIN_TOKENS_PER_EPOCH]"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(folder: str, tokens_per_epoch: int | None = None) -> None:
    rows = [json.loads(line) for line in (Path(folder) / "curve.jsonl").read_text().splitlines() if line.strip()]
    steps = max(len(r["accept"]) for r in rows)
    head = ["epochs", *(["train tokens"] if tokens_per_epoch else []), "held-out tau",
            *(f"accept@{i + 1}" for i in range(steps))]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [f"{r['epochs']:.2f}"]
        if tokens_per_epoch:
            cells.append(f"{int(r['epochs'] * tokens_per_epoch):,}")
        cells += [f"{r['tau']:.3f}", *(f"{a:.0%}" for a in r["accept"])]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
