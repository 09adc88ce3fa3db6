"""The reduced draft vocabulary of a trained head: the target tokens it can propose.

A head's own LM head over the full vocabulary costs about a fifth of a target step on the
default model (49,152 x 576), so EAGLE-3 heads predict over the N most frequent tokens of the
target's own answers instead (chosen by ``train/vocab.py``). The maps follow EAGLE-3's
checkpoint layout (SpecForge, SGLang, vLLM):

- ``d2t``: [N] int64 offsets, draft id i -> target id i + d2t[i] (target ids ascending);
- ``t2d``: [V] bool, whether a target id is in the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdraft.errors import SpecdraftError


@dataclass(frozen=True, slots=True)
class DraftVocab:
    target_ids: Tensor  # [N] int64, strictly ascending: draft id i -> target_ids[i]
    target_size: int  # V, the target's vocabulary

    def __post_init__(self) -> None:
        ids = self.target_ids
        if ids.ndim != 1 or ids.numel() == 0 or ids.dtype != torch.int64:
            raise SpecdraftError("a draft vocabulary needs a non-empty 1-D int64 list of target ids")
        if bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < 0 or int(ids[-1]) >= self.target_size:
            raise SpecdraftError(f"draft vocabulary ids must be strictly ascending in 0..{self.target_size - 1}")

    @property
    def size(self) -> int:
        return int(self.target_ids.numel())

    @property
    def d2t(self) -> Tensor:  # [N] int64 offsets
        return self.target_ids - torch.arange(self.size)

    @property
    def t2d(self) -> Tensor:  # [V] bool
        mask = torch.zeros(self.target_size, dtype=torch.bool)
        mask[self.target_ids] = True
        return mask

    @classmethod
    def from_maps(cls, d2t: Tensor, t2d: Tensor) -> "DraftVocab":
        """From EAGLE-3's maps; refused when they disagree."""
        ids = d2t.to(torch.int64) + torch.arange(d2t.numel())
        vocab = cls(ids, int(t2d.numel()))
        if not torch.equal(vocab.t2d, t2d.to(torch.bool)):
            raise SpecdraftError("d2t and t2d describe different draft vocabularies")
        return vocab

    def to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft ids -> target ids, any shape."""
        return self.target_ids.to(draft_ids.device)[draft_ids]

    def to_draft(self, target_ids: Tensor) -> Tensor:
        """Target ids -> draft ids (-1 where a token is outside the draft vocabulary)."""
        table = torch.full((self.target_size,), -1, dtype=torch.int64)
        table[self.target_ids] = torch.arange(self.size)
        return table.to(target_ids.device)[target_ids]


class ReducedHead:
    """The target's own LM head restricted to a draft vocabulary, for drafters that reuse it
    (the layer-skip adapter): a product with N rows instead of V, scattered back to target ids."""

    def __init__(self, weight: Tensor, vocab: DraftVocab) -> None:
        if weight.shape[0] != vocab.target_size:
            raise SpecdraftError(f"a draft vocabulary over {vocab.target_size} tokens does not fit an LM head "
                                 f"with {weight.shape[0]}")
        self.ids = vocab.target_ids.to(weight.device)  # [N] target ids
        self.weight = weight.detach()[self.ids].contiguous()  # [N, H]
        self.size = vocab.target_size

    def __call__(self, x: Tensor) -> Tensor:
        """x [..., H] -> float32 logits [..., V], -inf outside the draft vocabulary."""
        small = torch.nn.functional.linear(x.to(self.weight.dtype), self.weight).float()  # [..., N]
        out = small.new_full((*small.shape[:-1], self.size), float("-inf"))  # [..., V]
        out[..., self.ids] = small
        return out
