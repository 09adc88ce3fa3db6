"""The target's view of training sequences (teacher forcing): what every drafter learns from.

A record of ``specdraft train data`` is a prompt and the target's answer. One forward of the
target over ``prompt + answer`` gives, at every position, its final hidden state, the layer
taps a head reads (EAGLE-3: a low, a middle and a high layer), and its next-token
distribution, the soft label a head is trained to match. A data set's own answers (teacher
forcing on text the target did not write, EAGLE-1's recipe) go through the same function.

Sequences are batched by length (right-padded; padding is causal-invisible to real tokens
and masked out of the loss). Nothing is cached on disk: a forward costs about a prefill, and
hidden states would take ~1 KB a token and tap.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdraft.errors import SpecdraftError
from specdraft.model.transformer import Transformer


@dataclass(frozen=True, slots=True)
class TeacherConfig:
    """taps: layer outputs to return (0 = embeddings, i = layer i's output); top_k: the
    target's k most likely next tokens and their probabilities per position (0: none);
    batch_tokens: padded tokens per forward; max_len: longer sequences are cut."""

    taps: tuple[int, ...] = ()
    top_k: int = 0
    batch_tokens: int = 2048
    max_len: int = 768

    def __post_init__(self) -> None:
        if self.top_k < 0 or self.batch_tokens < 1 or self.max_len < 2:
            raise SpecdraftError("top_k must be >= 0, batch_tokens >= 1 and max_len >= 2")


@dataclass(slots=True)
class TeacherBatch:
    tokens: Tensor  # [B, T] int64, right-padded with 0
    lengths: list[int]  # real tokens per row
    answer: Tensor  # [B, T] bool: position t predicts an answer token (t + 1 is in the answer)
    last_hidden: Tensor  # [B, T, H] final-norm states
    taps: dict[int, Tensor] = field(default_factory=dict)  # layer -> [B, T, H]
    top_ids: Tensor | None = None  # [B, T, k] int64: the target's most likely next tokens
    top_probs: Tensor | None = None  # [B, T, k] float32: their probabilities (temperature 1)


def length_batches(lengths: Seq[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by similar length so that each group's padded size (rows x longest)
    stays within ``batch_tokens`` (a longer sequence goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[i] <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@torch.inference_mode()
def teacher_batches(model: Transformer, sequences: Seq[tuple[Seq[int], Seq[int]]], cfg: TeacherConfig,
                    ) -> Iterator[tuple[list[int], TeacherBatch]]:
    """For (prompt, answer) pairs, yield (indices into ``sequences``, batch) in length order."""
    joined = [(list(p) + list(a))[: cfg.max_len] for p, a in sequences]
    starts = [min(len(p), cfg.max_len) for p, _ in sequences]
    for group in length_batches([len(j) for j in joined], cfg.batch_tokens):
        yield group, _forward(model, [joined[i] for i in group], [starts[i] for i in group], cfg)


def _forward(model: Transformer, rows: list[list[int]], starts: list[int], cfg: TeacherConfig) -> TeacherBatch:
    device = model.device
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)  # [B, T]
    answer = torch.zeros(len(rows), width, dtype=torch.bool)  # [B, T]
    for b, (r, s) in enumerate(zip(rows, starts)):
        tokens[b, : len(r)] = torch.tensor(r)
        answer[b, max(s - 1, 0) : len(r) - 1] = True  # from the prompt's last token to the answer's last but one
    cache = model.new_cache(len(rows), width)
    positions = torch.arange(width, device=device).expand(len(rows), width)  # [B, T]
    out = model(tokens.to(device), positions, cache, logits=cfg.top_k > 0, return_hidden=cfg.taps)
    batch = TeacherBatch(tokens, [len(r) for r in rows], answer, out.last_hidden, dict(out.hidden))
    if cfg.top_k and out.logits is not None:
        probs = out.logits.float().softmax(-1)  # [B, T, V]
        top = probs.topk(cfg.top_k, dim=-1)
        batch.top_ids, batch.top_probs = top.indices, top.values
    return batch
