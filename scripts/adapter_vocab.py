"""Give a trained layer-skip adapter saved before adapters carried a draft vocabulary its own:
the --size most frequent tokens of the train answers it learned from (what `specdraft train
layer-skip` now chooses at its end), then measure it held out over that vocabulary and record
the result in its config.json. The adapter's weights are unchanged; the folder is rewritten.

The shipped adapter got its vocabulary with (session 29):

    .venv/bin/python scripts/adapter_vocab.py src/specdraft/weights/SmolLM2-135M-Instruct.Q4_1/layer-skip \
        --data train-data/smollm2-135m-bf16 --limit 3940
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdraft.heads.adapter import CONFIG_FILE, load_adapter, save_adapter
from specdraft.model.loader import load
from specdraft.train.common import draft_vocabulary, splits
from specdraft.train.evaluate import evaluate_folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--data", required=True, help="the data folder it was trained on")
    ap.add_argument("--limit", type=int, default=None, help="the train answers it was trained on (its --limit)")
    ap.add_argument("--size", type=int, default=4096, help="draft vocabulary size (default: 4096)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load(dtype=torch.bfloat16)  # the default model, as the shipped adapter's target
    adapter = load_adapter(args.folder, loaded.config)
    pairs, _, _ = splits(args.data, args.limit, model=loaded)
    adapter.vocab = draft_vocabulary(loaded, (answer for _, answer in pairs), args.size)
    old = json.loads((args.folder / CONFIG_FILE).read_text())["specdraft"]
    extra = {k: v for k, v in old.items() if k != "target"}
    extra["draft_vocab"] = {"size": args.size, "train_answers": len(pairs), "chosen_by": "scripts/adapter_vocab.py"}
    save_adapter(adapter, args.folder, old["target"], dtype=torch.bfloat16, extra=extra)
    _, measure = evaluate_folder(loaded, args.folder, args.data)
    print(f"{args.folder}: draft vocabulary {args.size} (from {len(pairs)} train answers); {measure.line()}")
    extra["held_out"] = {"tau": measure.tau, "accept": measure.accept, "positions": measure.positions,
                         "full_vocabulary": old.get("held_out")}
    save_adapter(adapter, args.folder, old["target"], dtype=torch.bfloat16, extra=extra)


if __name__ == "__main__":
    main()
