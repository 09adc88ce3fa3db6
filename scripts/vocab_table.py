"""The table of ``scripts/vocab_sweep.sh``: per trained folder under DIR, its draft vocabulary,
held-out tau and acceptance per draft position (training's end measure), and the read-out's
cost (final norm + LM head + log-softmax over 4 draft states, bfloat16, packed, hot median of
300; the part of a head step that grows with the vocabulary). Writes DIR/table.json.

    .venv/bin/python scripts/vocab_table.py runs/vocab-sweep
"""
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specdraft.heads.mtp_checkpoint import load_mtp
from specdraft.model.loader import load

torch.set_num_threads(2)
root = Path(sys.argv[1])
target = load(dtype="bfloat16").model.config
rows = []
for folder in sorted(root.iterdir(), key=lambda p: p.name):
    cfg = folder / "config.json"
    if not cfg.is_file():
        continue
    meta = json.loads(cfg.read_text())
    head = load_mtp(folder, target).to(torch.bfloat16).eval()
    for m in head.modules():
        if hasattr(m, "pack"):
            m.pack()
    x = torch.randn(4, target.hidden_size, dtype=torch.bfloat16)
    times = []
    with torch.inference_mode():
        for i in range(320):
            t = time.perf_counter()
            head.logits(x).log_softmax(-1)
            if i >= 20:
                times.append(time.perf_counter() - t)
    held = meta["specdraft"]["held_out"]
    rows.append({"draft_vocab": meta["draft_vocab_size"], "tau": held["tau"], "accept": held["accept"],
                 "positions": held["positions"], "answers": meta["specdraft"]["training"]["limit"],
                 "readout_ms": 1e3 * statistics.median(times)})
rows.sort(key=lambda r: r["draft_vocab"])
(root / "table.json").write_text(json.dumps(rows, indent=1))
print("| draft vocabulary | held-out tau | " + " | ".join(f"accept@{i + 1}" for i in range(len(rows[0]["accept"])))
      + " | read-out ms (4 states) |")
print("|---" * (3 + len(rows[0]["accept"])) + "|")
for r in rows:
    print(f"| {r['draft_vocab']:,} | {r['tau']:.3f} | " + " | ".join(f"{a:.0%}" for a in r["accept"])
          + f" | {r['readout_ms']:.3f} |")
