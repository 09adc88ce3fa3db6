"""Training a Kangaroo early-exit adapter for self-speculation (``specdraft train layer-skip``).

Each training sequence goes through the target once (:mod:`.teacher`): its layer-L states
(tap L) and its next-token distribution (top ``soft_top_k``) at every position. The adapter
(:mod:`specdraft.heads.adapter`) runs causally over the layer-L states and, through the
target's own LM head, learns the target's distribution at the same position. No
training-time test is needed: when drafting, the early layers run on the drafted tokens, so a
drafted position's input is exactly what training sees whenever the draft so far is right.

The adapter learns over the whole vocabulary (the target's head); its draft vocabulary, the
``draft_vocab`` most frequent tokens of the train answers, is chosen at the end and saved with it:
drafting then reads only those rows of the head.

Held-out measure (the validation split's greedy answers, over the draft vocabulary): how often the adapter's top token is
the target's greedy token (the acceptance of each draft position given the earlier ones were
right), and the greedy chain's tau up to ``eval_steps`` tokens.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specdraft.errors import SpecdraftError
from specdraft.heads.adapter import AdapterConfig, ExitAdapter, save_adapter
from specdraft.heads.feature_head import causal_mask
from specdraft.model.loader import LoadedModel
from specdraft.model.transformer import grouped_attention
from specdraft.train.common import (EVAL_EVERY, checkpoint_key, Loop, TeacherCache, data_fingerprint, draft_vocabulary,
                                    resume, soft_cross_entropy, splits, train_loop, write_curve)
from specdraft.train.eagle import ChainMeasure
from specdraft.train.teacher import TeacherBatch, TeacherConfig, length_batches


@dataclass(frozen=True, slots=True)
class AdapterTrainConfig:
    exit_layer: int = 4
    epochs: int = 1
    lr: float = 1e-3
    soft_top_k: int = 8
    batch_tokens: int = 1024
    max_len: int = 768
    seed: int = 0
    eval_steps: int = 6
    draft_vocab: int = 4096  # the tokens it drafts (>= the target's vocabulary: all of them)
    checkpoint_every: int = 20
    limit: int | None = None
    sources: tuple[str, ...] = ()  # train and held-out records of these prompt sets only (() = all)
    time_budget_s: float | None = None

    def __post_init__(self) -> None:
        if min(self.epochs, self.soft_top_k, self.checkpoint_every, self.eval_steps, self.draft_vocab) < 1 or self.lr <= 0:
            raise SpecdraftError("epochs, soft_top_k, eval_steps, draft_vocab and checkpoint_every must be >= 1 and lr > 0")

    def key(self) -> dict[str, Any]:
        return checkpoint_key(self)


def adapter_logits(adapter: ExitAdapter, loaded: LoadedModel, batch: TeacherBatch) -> Tensor:
    """The adapter's logits [B, T, V] over a teacher batch (causal over each row)."""
    m = loaded.model
    h = batch.taps[adapter.config.exit_layer].float()  # [B, T, H]
    t = h.shape[1]
    cos = m.rope_cos[:t][None, :, None].float()  # [1, T, 1, D]
    sin = m.rope_sin[:t][None, :, None].float()
    group = adapter.config.group_size

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return grouped_attention(q, k, v, None if t == 1 else causal_mask(t, group, q.device), group)

    prenorm = adapter.layer(h, cos, sin, attend)
    return torch.nn.functional.linear(adapter.norm(prenorm), m.lm_head.weight.float())  # [B, T, V]


@torch.no_grad()
def evaluate(adapter: ExitAdapter, loaded: LoadedModel, batches: Seq[TeacherBatch], steps: int) -> ChainMeasure:
    reached = [0] * (steps + 1)
    for batch in batches:
        assert batch.top_ids is not None
        logits = adapter_logits(adapter, loaded, batch)  # [B, T, V]
        if adapter.vocab is not None:
            logits[..., ~adapter.vocab.t2d.to(logits.device)] = float("-inf")  # what drafting can propose
        right = logits.argmax(-1) == batch.top_ids[..., 0].long()  # [B, T]
        b, t = right.shape
        valid = torch.zeros_like(right)
        n = max(0, t - steps + 1)
        valid[:, :n] = batch.answer[:, steps - 1 : steps - 1 + n]  # every step's label predicts an answer token
        valid &= batch.answer
        lead = torch.ones_like(valid)
        reached[0] += int(valid.sum())
        for k in range(steps):
            ok = torch.zeros_like(valid)
            ok[:, : max(0, t - k)] = right[:, k:]
            lead &= ok
            reached[k + 1] += int((lead & valid).sum())
    if not reached[0]:
        return ChainMeasure()
    accept = [reached[k] / max(reached[k - 1], 1) for k in range(1, steps + 1)]
    return ChainMeasure(reached[0], accept, 1.0 + sum(reached[1:]) / reached[0])


def train_adapter(loaded: LoadedModel, data: str | Path, out: str | Path, cfg: AdapterTrainConfig,
                  log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
                  held_out: str | Path | None = None) -> ChainMeasure:
    """Train (or resume) an early-exit adapter for ``loaded``; see the module doc."""
    pairs, held, _ = splits(data, cfg.limit, cfg.sources, loaded, held_out)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    adapter = ExitAdapter(AdapterConfig.for_target(loaded.config, cfg.exit_layer)).start_from(loaded.model.norm.weight)
    adapter.to(loaded.model.device)
    opt = torch.optim.AdamW(adapter.parameters(), lr=cfg.lr)
    key = {**cfg.key(), "target": loaded.source.name, "data": data_fingerprint(pairs)}
    progress = resume(folder, key, adapter, opt, {"epoch": 0, "batch": 0})
    teacher = TeacherConfig(taps=(cfg.exit_layer,), top_k=cfg.soft_top_k, batch_tokens=cfg.batch_tokens,
                            max_len=cfg.max_len)
    cache = TeacherCache(loaded, pairs, teacher, keep=cfg.epochs > 1)
    everything = torch.arange(loaded.config.vocab_size, device=loaded.model.device)
    groups = length_batches([len(p) + len(a) for p, a in pairs], cfg.batch_tokens)

    def step(group: list[int]) -> tuple[Tensor, dict[str, str]]:
        batch = cache.batch(group)
        assert batch.top_ids is not None and batch.top_probs is not None
        mask = batch.answer.clone()  # (the teacher's tensors are inference tensors: not saved for backward)
        logits = adapter_logits(adapter, loaded, batch)[mask]  # [P, V]
        return soft_cross_entropy(logits, batch.top_ids[mask].long(), batch.top_probs[mask], everything), {}

    held_cache = TeacherCache(loaded, held, teacher, keep=True)
    held_groups = length_batches([len(p) + len(a) for p, a in held], cfg.batch_tokens)

    def after(epoch: int, batch: int, batches: int) -> dict[str, str] | None:
        if batch % EVAL_EVERY:  # (over the full vocabulary: the draft one is chosen at the end)
            return None
        measure = evaluate(adapter, loaded, list(held_cache.all(held_groups)), cfg.eval_steps)
        write_curve(folder, epoch, batch, batches, measure.row())
        return measure.bar()

    loop = Loop("layer-skip adapter", cfg.epochs, cfg.seed, cfg.checkpoint_every, cfg.time_budget_s, cfg.lr)
    if not train_loop(folder, key, adapter, opt, groups, progress, loop, step, after, log):
        return ChainMeasure()
    if cfg.draft_vocab < loaded.config.vocab_size:
        adapter.vocab = draft_vocabulary(loaded, (answer for _, answer in pairs), cfg.draft_vocab)
    result = evaluate(adapter, loaded, list(held_cache.all(held_groups)), cfg.eval_steps)
    write_curve(folder, cfg.epochs - 1, len(groups), len(groups), {**result.row(), "draft_vocab": cfg.draft_vocab})
    log(f"layer-skip: {result.line()}")
    save_adapter(adapter, folder, loaded.source.name, dtype=torch.bfloat16,
                 extra={"training": cfg.key(), "held_out": {"tau": result.tau, "accept": result.accept,
                                                            "positions": result.positions}})
    return result
