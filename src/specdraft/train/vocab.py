"""Choosing a head's reduced draft vocabulary (:class:`specdraft.heads.vocab.DraftVocab`): the
most frequent tokens of the target's own answers, and how much of held-out answers they cover.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence as Seq
from typing import Any

import torch
from torch import Tensor

from specdraft.errors import SpecdraftError
from specdraft.heads.vocab import DraftVocab


def token_counts(sequences: Iterable[Seq[int]], vocab_size: int) -> Tensor:
    """How often each target id occurs in ``sequences``: [V] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in sequences:
        if seq:
            counts += torch.bincount(torch.as_tensor(seq, dtype=torch.int64), minlength=vocab_size)[:vocab_size]
    return counts


def most_frequent(counts: Tensor, size: int, always: Seq[int] = ()) -> DraftVocab:
    """The ``size`` most frequent ids (ties: lower id first), ``always`` included (e.g. EOS)."""
    vocab = counts.numel()
    if not 1 <= size <= vocab:
        raise SpecdraftError(f"draft vocabulary size must be in 1..{vocab}, got {size}")
    score = counts.to(torch.float64).clone()
    score[list(always)] = float("inf")
    order = torch.sort(-score, stable=True).indices[:size]  # stable: ties keep the lower id first
    return DraftVocab(torch.sort(order).values.to(torch.int64), vocab)


def coverage(counts: Tensor, vocab: DraftVocab) -> float:
    """The share of the tokens counted in ``counts`` that the draft vocabulary can propose:
    an upper bound on any head's acceptance with that vocabulary."""
    total = int(counts.sum())
    return float(counts[vocab.target_ids].sum()) / total if total else 0.0


def coverage_table(train: Tensor, held_out: Tensor, sizes: Seq[int], always: Seq[int] = ()) -> list[dict[str, Any]]:
    """Per size: the vocabulary chosen on ``train`` counts and its coverage of ``held_out``."""
    return [{"size": n, "train_coverage": coverage(train, v := most_frequent(train, n, always)),
             "held_out_coverage": coverage(held_out, v)} for n in sizes]
