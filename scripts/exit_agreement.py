"""Teacher-forced agreement of layer subsets with the full model: for the committed plain
outputs (results/plain-outputs), how often the argmax of a subset of the target's layers (then
its final norm and LM head) equals the full model's at each output position. An upper bound
of sorts for self-speculation with that subset: a drafted chain is accepted only while its
tokens agree.

    .venv/bin/python scripts/exit_agreement.py [--dtype bfloat16] [--per-workload 3]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdraft.model.loader import load
from specdraft.model.transformer import Transformer

WORKLOADS = ("summarization", "code", "qa", "creative", "math")


def subsets(n: int) -> dict[str, tuple[int, ...]]:
    out = {}
    for keep in (k for k in (24, 20, 16, 12) if k < n):
        out[f"first {keep}"] = tuple(range(keep))
        for first in (keep // 2, keep * 2 // 3):
            out[f"first {first} + last {keep - first}"] = (*range(first), *range(n - keep + first, n))
    return out


@torch.inference_mode()
def argmaxes(model: Transformer, prompt: list[int], output: list[int], layers: tuple[int, ...] | None) -> torch.Tensor:
    tokens = torch.tensor([prompt + output])  # [1, T]
    out = model(tokens, torch.arange(tokens.shape[1])[None], model.new_cache(1, tokens.shape[1]), layers=layers)
    return out.logits[0, len(prompt) - 1 : len(prompt) + len(output) - 1].argmax(-1)  # [len(output)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--refs", default="results/plain-outputs")
    parser.add_argument("--per-workload", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    model = load(None, dtype=args.dtype).model
    pairs = []
    for w in WORKLOADS:
        rows = json.loads((Path(args.refs) / f"{w}.json").read_text())["rows"][: args.per_workload]
        pairs += [(r["prompt"], r["output"]) for r in rows]
    full = [argmaxes(model, p, o, None) for p, o in pairs]
    print(f"{len(pairs)} outputs, {sum(len(o) for _, o in pairs)} tokens; {model.config.num_layers} layers")
    print("| layers | count | agreement with the full model |\n|---|---|---|")
    for name, ids in subsets(model.config.num_layers).items():
        same = sum(int((argmaxes(model, p, o, ids) == f).sum()) for (p, o), f in zip(pairs, full))
        print(f"| {name} | {len(ids)} | {same / sum(len(f) for f in full):.1%} |", flush=True)


if __name__ == "__main__":
    main()
