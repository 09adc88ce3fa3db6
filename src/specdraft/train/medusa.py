"""Training Medusa heads on the target's own answers (``specdraft train medusa``).

Each training sequence (prompt + the target's answer, from ``specdraft train data``) goes once
through the target (:mod:`.teacher`): at answer position t, head k learns the target's own
next-token distribution at t + k (its top ``soft_top_k`` tokens, renormalised over the draft
vocabulary), i.e. what the target will say k tokens later, which is what verification accepts.
The draft vocabulary is the ``draft_vocab`` most frequent tokens of the train split's answers.

Held-out measure (the validation split, never trained on): per head, how often its top guess
is the target's own greedy token; and the chain's tau, 1 + the mean number of leading heads
that are right (what greedy verification of the chain would emit per target pass).

Resumable: ``checkpoint.pt`` in the output folder holds the heads, the optimizer and the
progress, written every ``checkpoint_every`` batches and at the end of each epoch; rerunning the
same command continues from it (other settings are refused). The finished heads are saved as
``config.json`` + ``model.safetensors`` (:func:`specdraft.heads.medusa.save_medusa`).
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
from specdraft.heads.medusa import MedusaConfig, MedusaHeads, load_medusa, save_medusa
from specdraft.model.loader import LoadedModel
from specdraft.train.common import (EVAL_EVERY, checkpoint_key, Loop, TeacherCache, data_fingerprint, draft_index,
                                    draft_vocabulary, resume, soft_cross_entropy, splits, train_loop, write_curve)
from specdraft.train.teacher import TeacherBatch, TeacherConfig, length_batches


@dataclass(frozen=True, slots=True)
class MedusaTrainConfig:
    heads: int = 3
    draft_vocab: int = 4096
    epochs: int = 1
    lr: float = 1e-3
    soft_top_k: int = 8
    batch_tokens: int = 2048
    max_len: int = 768
    seed: int = 0
    checkpoint_every: int = 20  # batches
    limit: int | None = None  # train records used (None: all)
    sources: tuple[str, ...] = ()  # train and held-out records of these prompt sets only (() = all)
    time_budget_s: float | None = None  # stop (with a checkpoint) after this long
    init: str = ""  # trained heads' folder to start from (their count and vocabulary); "" = the target's LM head

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.lr <= 0 or self.soft_top_k < 1 or self.checkpoint_every < 1:
            raise SpecdraftError("epochs, soft_top_k and checkpoint_every must be >= 1 and lr > 0")
        MedusaConfig(self.heads, 1, 1, 1)  # validates heads

    def key(self) -> dict[str, Any]:
        """The settings a checkpoint must share to be resumed (not the time budget)."""
        return checkpoint_key(self)


@dataclass(slots=True)
class HeldOut:
    positions: int = 0
    head_accuracy: list[float] | None = None  # per head: top guess == the target's greedy token
    tau: float = 1.0  # 1 + mean leading heads right: greedy chain tokens per target pass

    def line(self) -> str:
        acc = ", ".join(f"{a:.1%}" for a in self.head_accuracy or [])
        return f"held-out tau {self.tau:.3f} over {self.positions} positions; per head: {acc}"

    def row(self) -> dict[str, Any]:
        """The learning curve's fields (``curve.jsonl``)."""
        return {"tau": round(self.tau, 4), "head_accuracy": [round(a, 4) for a in self.head_accuracy or []],
                "positions": self.positions}

    def bar(self) -> dict[str, str]:
        """The progress bar's fields: held-out tau and head 1's accuracy."""
        first = (self.head_accuracy or [None])[0]
        return {"held tau": f"{self.tau:.2f}", "held head1": "-" if first is None else f"{first:.0%}"}


def head_targets(batch: TeacherBatch, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """For head k (1-based): the positions it learns from and their labels.
    Returns (mask [B, T] bool, top_ids [B, T, s], top_probs [B, T, s]): at position t, the
    target's distribution at t + k, where t + k is still a prediction of an answer token."""
    assert batch.top_ids is not None and batch.top_probs is not None
    mask = torch.zeros_like(batch.answer)
    mask[:, : -k or None] = batch.answer[:, k:]  # t + k predicts an answer token
    ids = torch.zeros_like(batch.top_ids)
    probs = torch.zeros_like(batch.top_probs)
    ids[:, : -k or None] = batch.top_ids[:, k:]
    probs[:, : -k or None] = batch.top_probs[:, k:]
    return mask & batch.answer, ids, probs


def medusa_loss(heads: MedusaHeads, batch: TeacherBatch, to_draft: Tensor) -> tuple[Tensor, list[tuple[int, int]]]:
    """Soft cross-entropy of every head against the target's distribution k tokens later
    (renormalised over the draft vocabulary), averaged over heads; and per head (right, total)
    of its top guess against the target's greedy token."""
    logits = heads(batch.last_hidden.float())  # [B, T, K, N]
    losses, counts = [], []
    for k in range(1, heads.config.heads + 1):
        mask, ids, probs = head_targets(batch, k)
        if not bool(mask.any()):
            counts.append((0, 0))
            continue
        lk = logits[:, :, k - 1][mask]  # [P, N]
        losses.append(soft_cross_entropy(lk, ids[mask].long(), probs[mask], to_draft))
        guess = heads.target_ids[lk.argmax(-1)]  # [P] target ids
        counts.append((int((guess == ids[mask][:, 0]).sum()), int(mask.sum())))
    return torch.stack(losses).mean() if losses else logits.sum() * 0, counts


@torch.no_grad()
def evaluate(heads: MedusaHeads, model_batches: Seq[TeacherBatch]) -> HeldOut:
    """Per-head accuracy and the greedy chain's tau on held-out batches."""
    K = heads.config.heads
    right = [0] * K
    total = 0
    lead_sum = 0
    for batch in model_batches:
        guesses = heads.target_ids[heads(batch.last_hidden.float()).argmax(-1)]  # [B, T, K]
        greedy = batch.top_ids[..., 0].long()  # [B, T]
        ok = torch.zeros(*greedy.shape, K, dtype=torch.bool)
        for k in range(1, K + 1):
            ok[:, : -k or None, k - 1] = guesses[:, : -k or None, k - 1] == greedy[:, k:]
        positions = torch.zeros_like(batch.answer)
        positions[:, :-K] = batch.answer[:, K:]  # every head's target predicts an answer token
        total += int(positions.sum())
        for k in range(K):
            right[k] += int((ok[..., k] & positions).sum())
        lead = ok.int().cumprod(-1).sum(-1)  # [B, T] leading heads right
        lead_sum += int(lead[positions].sum())
    if not total:
        return HeldOut()
    return HeldOut(total, [r / total for r in right], 1.0 + lead_sum / total)


def _start(loaded: LoadedModel, train_records: Seq[Any], cfg: MedusaTrainConfig) -> MedusaHeads:
    """The heads training starts from: ``cfg.init``'s trained ones (float32; their count and draft
    vocabulary must be the settings'), or new ones over the answers' most frequent tokens that
    read out through the target's LM head."""
    c = loaded.config
    if cfg.init:
        heads = load_medusa(cfg.init, c.hidden_size, c.vocab_size).float()
        if (heads.config.heads, heads.config.draft_vocab) != (cfg.heads, cfg.draft_vocab):
            raise SpecdraftError(f"--init {cfg.init} has {heads.config.heads} heads over {heads.config.draft_vocab} "
                                 f"draft tokens, not --heads {cfg.heads} --draft-vocab {cfg.draft_vocab}")
        return heads
    vocab = draft_vocabulary(loaded, (r["response"] for r in train_records), cfg.draft_vocab)
    return MedusaHeads.from_target(MedusaConfig(cfg.heads, c.hidden_size, cfg.draft_vocab, c.vocab_size), vocab,
                                   loaded.model.lm_head.weight.detach().float())


def train_medusa(loaded: LoadedModel, data: str | Path, out: str | Path, cfg: MedusaTrainConfig,
                 log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
                 held_out: str | Path | None = None) -> HeldOut:
    """Train (or resume) Medusa heads for ``loaded`` on the data folder; see the module doc."""
    pairs, held, train_records = splits(data, cfg.limit, cfg.sources, loaded, held_out)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    model, c = loaded.model, loaded.config
    torch.manual_seed(cfg.seed)
    heads = _start(loaded, train_records, cfg).to(model.device)
    vocab = heads.vocab
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr)
    key = {**cfg.key(), "target": loaded.source.name, "data": data_fingerprint(pairs)}
    progress = resume(folder, key, heads, opt, {"epoch": 0, "batch": 0}, vocab=vocab.target_ids)
    teacher = TeacherConfig(top_k=cfg.soft_top_k, batch_tokens=cfg.batch_tokens, max_len=cfg.max_len)
    cache = TeacherCache(loaded, pairs, teacher, keep=cfg.epochs > 1)
    to_draft = draft_index(vocab).to(model.device)
    groups = length_batches([len(p) + len(a) for p, a in pairs], cfg.batch_tokens)

    def step(group: list[int]) -> tuple[Tensor, dict[str, str]]:
        loss, counts = medusa_loss(heads, cache.batch(group), to_draft)
        acc = sum(r for r, _ in counts[:1]) / max(sum(t for _, t in counts[:1]), 1)
        return loss, {"head1": f"{acc:.0%}"}

    held_cache = TeacherCache(loaded, held, teacher, keep=True)
    held_groups = length_batches([len(p) + len(a) for p, a in held], cfg.batch_tokens)

    def after(epoch: int, batch: int, batches: int) -> dict[str, str] | None:
        if batch % EVAL_EVERY:
            return None
        measure = evaluate(heads, list(held_cache.all(held_groups)))
        write_curve(folder, epoch, batch, batches, measure.row())
        return measure.bar()

    loop = Loop("medusa", cfg.epochs, cfg.seed, cfg.checkpoint_every, cfg.time_budget_s)
    if not train_loop(folder, key, heads, opt, groups, progress, loop, step, after, log):
        return HeldOut()
    result = evaluate(heads, list(held_cache.all(held_groups)))
    write_curve(folder, cfg.epochs - 1, len(groups), len(groups), result.row())
    log(f"medusa: {result.line()}")
    save_medusa(heads, folder, target=loaded.source.name,
                extra={"training": cfg.key(), "held_out": {"tau": result.tau, "head_accuracy": result.head_accuracy,
                                                           "positions": result.positions}}, dtype=torch.bfloat16)
    return result
