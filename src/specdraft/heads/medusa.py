"""Medusa heads (Cai et al. 2024): K small heads on the target's last hidden state, head k
guessing the token k positions past the one the target's own LM head gives.

At the position t of the last committed token, the target's LM head gives token t + 1 (the
next draft's root, the bonus token) and head k (k = 1..K) guesses token t + 1 + k. Head k is a
residual block, h + SiLU(W_k h + b_k), followed by one LM head shared by all heads over a
reduced draft vocabulary (``train/vocab.py``); with W_k = 0 a head starts as the target's own
LM head restricted to that vocabulary, as Medusa initialises it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdraft.errors import ModelFileError, SpecdraftError
from specdraft.heads.vocab import DraftVocab


@dataclass(frozen=True, slots=True)
class MedusaConfig:
    """heads: K, the positions guessed past the bonus token; hidden_size: the target's;
    draft_vocab: the reduced vocabulary's size; target_vocab: the target's."""

    heads: int
    hidden_size: int
    draft_vocab: int
    target_vocab: int

    def __post_init__(self) -> None:
        if not 1 <= self.heads <= 16 or self.hidden_size < 1 or not 1 <= self.draft_vocab <= self.target_vocab:
            raise SpecdraftError(f"medusa: need 1 <= heads <= 16 and 1 <= draft_vocab <= target_vocab, got {self}")


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig, vocab: DraftVocab) -> None:
        super().__init__()
        if vocab.size != config.draft_vocab or vocab.target_size != config.target_vocab:
            raise SpecdraftError("medusa: the draft vocabulary does not match the heads' config")
        self.config = config
        h = config.hidden_size
        self.blocks = nn.ModuleList(nn.Linear(h, h) for _ in range(config.heads))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        self.lm_head = nn.Linear(h, config.draft_vocab, bias=False)
        self.register_buffer("target_ids", vocab.target_ids.clone(), persistent=False)  # [N] draft id -> target id

    @classmethod
    def from_target(cls, config: MedusaConfig, vocab: DraftVocab, target_lm_head: Tensor) -> "MedusaHeads":
        """Heads whose shared LM head starts as the target's, restricted to the draft vocabulary."""
        heads = cls(config, vocab)
        with torch.no_grad():
            heads.lm_head.weight.copy_(target_lm_head[vocab.target_ids].float())
        return heads

    @property
    def vocab(self) -> DraftVocab:
        return DraftVocab(self.target_ids.cpu(), self.config.target_vocab)

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden: [..., H] final-norm target states -> logits [..., K, N] over the draft vocabulary."""
        x = hidden.to(self.lm_head.weight.dtype)
        states = torch.stack([x + F.silu(block(x)) for block in self.blocks], dim=-2)  # [..., K, H]
        return self.lm_head(states)  # [..., K, N]


# --------------------------------------------------------------------------- checkpoints

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def save_medusa(heads: MedusaHeads, folder: str | Path, target: str, extra: dict[str, Any] | None = None,
                dtype: torch.dtype | None = None) -> Path:
    """Write ``config.json`` (the heads' shape, the target it was trained for) and
    ``model.safetensors`` (the heads, the shared LM head, EAGLE-3-style ``d2t``/``t2d``), the
    weights in ``dtype`` (default: their own)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = heads.config
    config = {"architecture": "specdraft-medusa", "medusa_num_heads": c.heads, "hidden_size": c.hidden_size,
              "draft_vocab_size": c.draft_vocab, "vocab_size": c.target_vocab, "target": target, **(extra or {})}
    vocab = heads.vocab
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)  # noqa: E731
    tensors = {f"blocks.{i}.{p}": cast(getattr(b, p)).detach().contiguous() for i, b in enumerate(heads.blocks)
               for p in ("weight", "bias")}
    tensors.update({"lm_head.weight": cast(heads.lm_head.weight).detach().contiguous(), "d2t": vocab.d2t,
                    "t2d": vocab.t2d})
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder


def load_medusa(folder: str | Path, hidden_size: int, target_vocab: int) -> MedusaHeads:
    """Heads saved by ``save_medusa``; refused in one line when missing, corrupt or made for a
    target of another hidden size or vocabulary."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise ModelFileError(f"medusa: no heads in {folder} (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
        tensors = load_file(str(folder / WEIGHTS_FILE))
        c = MedusaConfig(int(config["medusa_num_heads"]), int(config["hidden_size"]), int(config["draft_vocab_size"]),
                         int(config["vocab_size"]))
    except (json.JSONDecodeError, SafetensorError, KeyError, ValueError, TypeError, OSError) as e:
        raise ModelFileError(f"medusa: {folder} is corrupt or truncated ({type(e).__name__})") from None
    if (c.hidden_size, c.target_vocab) != (hidden_size, target_vocab):
        raise ModelFileError(f"medusa: the heads in {folder} were trained for a target with hidden size {c.hidden_size} "
                             f"and {c.target_vocab} tokens ({config.get('target', '?')}); this model has {hidden_size} "
                             f"and {target_vocab}")
    try:
        heads = MedusaHeads(c, DraftVocab.from_maps(tensors.pop("d2t"), tensors.pop("t2d")))
        heads.load_state_dict(tensors, strict=True)
    except (KeyError, RuntimeError) as e:
        raise ModelFileError(f"medusa: {folder} does not hold the tensors its config describes ({type(e).__name__})") from None
    return heads
