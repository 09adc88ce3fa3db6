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

import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from specdraft.errors import SpecdraftError
from specdraft.heads.medusa import MedusaConfig, MedusaHeads, save_medusa
from specdraft.model.loader import LoadedModel
from specdraft.train.data import read_shards
from specdraft.train.teacher import TeacherBatch, TeacherConfig, length_batches, teacher_batches
from specdraft.train.vocab import most_frequent, token_counts

CHECKPOINT = "checkpoint.pt"


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
    time_budget_s: float | None = None  # stop (with a checkpoint) after this long

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.lr <= 0 or self.soft_top_k < 1 or self.checkpoint_every < 1:
            raise SpecdraftError("epochs, soft_top_k and checkpoint_every must be >= 1 and lr > 0")
        MedusaConfig(self.heads, 1, 1, 1)  # validates heads

    def key(self) -> dict[str, Any]:
        """The settings a checkpoint must share to be resumed (not the time budget)."""
        return {k: v for k, v in asdict(self).items() if k != "time_budget_s"}


@dataclass(slots=True)
class HeldOut:
    positions: int = 0
    head_accuracy: list[float] | None = None  # per head: top guess == the target's greedy token
    tau: float = 1.0  # 1 + mean leading heads right: greedy chain tokens per target pass

    def line(self) -> str:
        acc = ", ".join(f"{a:.1%}" for a in self.head_accuracy or [])
        return f"held-out tau {self.tau:.3f} over {self.positions} positions; per head: {acc}"


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


def medusa_loss(heads: MedusaHeads, batch: TeacherBatch) -> tuple[Tensor, list[tuple[int, int]]]:
    """Soft cross-entropy of every head against the target's distribution k tokens later
    (renormalised over the draft vocabulary), averaged over heads; and per head (right, total)
    of its top guess against the target's greedy token."""
    logits = heads(batch.last_hidden.clone())  # [B, T, K, N] (clone: the teacher's tensors are inference-mode)
    to_draft = torch.full((heads.config.target_vocab,), -1, dtype=torch.long)
    to_draft[heads.target_ids] = torch.arange(heads.config.draft_vocab)
    losses, counts = [], []
    for k in range(1, heads.config.heads + 1):
        mask, ids, probs = head_targets(batch, k)
        if not bool(mask.any()):
            counts.append((0, 0))
            continue
        lk = logits[:, :, k - 1][mask].float()  # [P, N]
        draft_ids = to_draft[ids[mask]]  # [P, s], -1 outside the draft vocabulary
        p = probs[mask] * (draft_ids >= 0)  # [P, s]
        keep = p.sum(-1) > 0
        logp = lk.log_softmax(-1).gather(-1, draft_ids.clamp_min(0))  # [P, s]
        losses.append(-((p[keep] / p[keep].sum(-1, keepdim=True)) * logp[keep]).sum(-1).mean())
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
        guesses = heads.target_ids[heads(batch.last_hidden).argmax(-1)]  # [B, T, K]
        greedy = batch.top_ids[..., 0]  # [B, T]
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


def _pairs(records: Seq[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    return [(r["prompt"], r["response"]) for r in records if r["response"]]


def train_medusa(loaded: LoadedModel, data: str | Path, out: str | Path, cfg: MedusaTrainConfig,
                 log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> HeldOut:
    """Train (or resume) Medusa heads for ``loaded`` on the data folder; see the module doc."""
    records = read_shards(Path(data))
    train = [r for r in records if r["split"] == "train"][: cfg.limit]
    held = [r for r in records if r["split"] == "validation" and r["temperature"] == 0]  # greedy: exact measure
    if not train or not held:
        raise SpecdraftError(f"{data}: need answers in both splits (train {len(train)}, validation {len(held)}); "
                             f"make more with `specdraft train data`")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    model, c = loaded.model, loaded.config
    torch.manual_seed(cfg.seed)
    vocab = most_frequent(token_counts((r["response"] for r in train), c.vocab_size), cfg.draft_vocab,
                          always=(loaded.tokenizer.eos_id,) if loaded.tokenizer.eos_id is not None else ())
    heads = MedusaHeads.from_target(MedusaConfig(cfg.heads, c.hidden_size, cfg.draft_vocab, c.vocab_size), vocab,
                                    model.lm_head.weight.detach().float())
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr)
    progress = _resume(folder, cfg, heads, opt)
    teacher = TeacherConfig(top_k=cfg.soft_top_k, batch_tokens=cfg.batch_tokens, max_len=cfg.max_len)
    pairs = _pairs(train)
    t0 = time.perf_counter()
    for epoch in range(progress["epoch"], cfg.epochs):
        groups = length_batches([len(p) + len(a) for p, a in pairs], cfg.batch_tokens)
        random.Random(cfg.seed + epoch).shuffle(groups)
        bar = tqdm(total=len(groups), initial=progress["batch"], desc=f"medusa epoch {epoch + 1}/{cfg.epochs}",
                   unit="batch", file=sys.stderr)
        for b in range(progress["batch"], len(groups)):
            if cfg.time_budget_s is not None and time.perf_counter() - t0 > cfg.time_budget_s:
                _save_checkpoint(folder, cfg, heads, opt, {"epoch": epoch, "batch": b})
                bar.close()
                log(f"medusa: time budget reached at epoch {epoch + 1}, batch {b}; rerun to resume")
                return HeldOut()
            [(_, batch)] = list(teacher_batches(model, [pairs[i] for i in groups[b]], _one_batch(teacher)))
            loss, counts = medusa_loss(heads, batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            acc = sum(r for r, _ in counts[:1]) / max(sum(t for _, t in counts[:1]), 1)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", head1=f"{acc:.0%}")
            bar.update(1)
            if (b + 1) % cfg.checkpoint_every == 0:
                _save_checkpoint(folder, cfg, heads, opt, {"epoch": epoch, "batch": b + 1})
        bar.close()
        progress = {"epoch": epoch + 1, "batch": 0}
        _save_checkpoint(folder, cfg, heads, opt, progress)
    result = evaluate(heads, [b for _, b in teacher_batches(model, _pairs(held), teacher)])
    log(f"medusa: {result.line()}")
    save_medusa(heads, folder, target=loaded.source.name,
                extra={"training": cfg.key(), "held_out": {"tau": result.tau, "head_accuracy": result.head_accuracy,
                                                           "positions": result.positions}})
    return result


def _one_batch(cfg: TeacherConfig) -> TeacherConfig:
    """The teacher config for one group that is already a batch (no further splitting)."""
    return TeacherConfig(taps=cfg.taps, top_k=cfg.top_k, batch_tokens=10**9, max_len=cfg.max_len)


def _save_checkpoint(folder: Path, cfg: MedusaTrainConfig, heads: MedusaHeads, opt: torch.optim.Optimizer,
                     progress: dict[str, int]) -> None:
    tmp = folder / (CHECKPOINT + ".tmp")
    torch.save({"config": cfg.key(), "heads": heads.state_dict(), "opt": opt.state_dict(), "progress": progress}, tmp)
    os.replace(tmp, folder / CHECKPOINT)


def _resume(folder: Path, cfg: MedusaTrainConfig, heads: MedusaHeads, opt: torch.optim.Optimizer) -> dict[str, int]:
    path = folder / CHECKPOINT
    if not path.is_file():
        return {"epoch": 0, "batch": 0}
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001  (torch raises many kinds for a damaged file)
        raise SpecdraftError(f"{path} is corrupt ({type(e).__name__}); delete it to start again") from None
    if state.get("config") != json.loads(json.dumps(cfg.key())):
        raise SpecdraftError(f"{path} was made with other settings; use another --out or the same settings")
    heads.load_state_dict(state["heads"])
    opt.load_state_dict(state["opt"])
    return dict(state["progress"])
