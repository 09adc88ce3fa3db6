"""The held-out measure of a trained head folder on a data folder (`specdraft train eval`).

Training prints its head's held-out tau once, on the validation answers its data folder held
then. This measures any trained folder (EAGLE, MTP, Medusa or the layer-skip adapter, told
apart by their config.json) the same way on any data folder's validation answers, so that two
heads, e.g. the shipped one and a retrained one, are compared on the same positions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.errors import ModelFileError, SpecdraftError
from specdraft.model.loader import LoadedModel
from specdraft.train.common import TeacherCache, splits
from specdraft.train.teacher import TeacherConfig, length_batches

KINDS = {"LlamaForCausalLMEagle3": "eagle", "specdraft-mtp": "mtp", "specdraft-medusa": "medusa",
         "specdraft-exit-adapter": "layer-skip"}


@dataclass(frozen=True, slots=True)
class EvalConfig:
    steps: int = 6  # draft positions measured (EAGLE, MTP, the adapter; Medusa: its heads)
    batch_tokens: int = 1024  # padded tokens per teacher forward
    limit: int | None = None  # validation answers used (default: all)
    max_len: int = 768  # longer sequences are cut, as in training
    sources: tuple[str, ...] = ()  # validation answers of these prompt sets only (() = all)

    def __post_init__(self) -> None:
        if not 1 <= self.steps <= 16 or self.batch_tokens < 1 or (self.limit is not None and self.limit < 1):
            raise SpecdraftError("steps must be in 1..16, batch_tokens and limit >= 1")


def head_kind(folder: str | Path) -> str:
    """eagle, mtp, medusa or layer-skip, from the folder's config.json."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFileError(f"{folder}: no trained head here (config.json missing)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: not valid JSON ({e})") from None
    names = config.get("architectures") or [config.get("architecture")]
    for name in names if isinstance(names, list) else []:
        if name in KINDS:
            return KINDS[name]
    raise ModelFileError(f"{path}: not a head specdraft trains (architectures {names}; known: {', '.join(KINDS)})")


def evaluate_folder(loaded: LoadedModel, folder: str | Path, data: str | Path, cfg: EvalConfig = EvalConfig()):  # type: ignore[no-untyped-def]
    """(kind, measure) of the trained folder on ``data``'s held-out greedy answers; the measure
    is a ``ChainMeasure`` (or Medusa's ``HeldOut``) with ``line()``."""
    kind = head_kind(folder)
    _, held, _ = splits(data, None, cfg.sources, loaded)
    held = held[: cfg.limit]
    groups = length_batches([len(p) + len(a) for p, a in held], cfg.batch_tokens)
    device = loaded.model.device
    with torch.no_grad():
        if kind == "medusa":
            from specdraft.heads.medusa import load_medusa
            from specdraft.train.medusa import evaluate as evaluate_medusa

            heads = load_medusa(folder, loaded.config.hidden_size, loaded.config.vocab_size).float().to(device)
            return kind, evaluate_medusa(heads, list(_batches(loaded, held, groups, (), cfg)))
        if kind == "layer-skip":
            from specdraft.heads.adapter import load_adapter
            from specdraft.train.adapter import evaluate as evaluate_adapter

            adapter = load_adapter(folder, loaded.config).float().to(device)
            taps = (adapter.config.exit_layer,)
            return kind, evaluate_adapter(adapter, loaded, list(_batches(loaded, held, groups, taps, cfg)), cfg.steps)
        from specdraft.heads.eagle_checkpoint import load_eagle
        from specdraft.heads.mtp_checkpoint import load_mtp
        from specdraft.train.eagle import evaluate as evaluate_chain

        head = (load_eagle if kind == "eagle" else load_mtp)(folder, loaded.config).float().to(device)
        batches = list(_batches(loaded, held, groups, head.config.taps, cfg))
        return kind, evaluate_chain(head, loaded, batches, cfg.steps)


def _batches(loaded: LoadedModel, held, groups, taps: tuple[int, ...], cfg: EvalConfig):  # type: ignore[no-untyped-def]
    teacher = TeacherConfig(taps=taps, top_k=1, batch_tokens=cfg.batch_tokens, max_len=cfg.max_len)
    return TeacherCache(loaded, held, teacher, keep=False).all(groups)
