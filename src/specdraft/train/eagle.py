"""Training a feature head on the target's own answers: an EAGLE-3 head (``specdraft train
eagle``) or an MTP module (``specdraft train mtp``); both run the same training-time test.

Each training sequence (prompt + the target's answer, from ``specdraft train data``) goes
through the target once (:mod:`.teacher`, kept in memory for later epochs): its taps at the
head's layers and its next-token distribution (top ``soft_top_k``) at every position. The
head then runs the training-time test (``EagleHead.ttt``): ``steps`` draft steps from every
position at once, each fed its own state of the step before; step k from anchor p learns the
target's distribution at p + k (renormalised over the draft vocabulary), weighted
``step_decay ** (k - 1)``.

Held-out measure (the validation split's greedy answers, never trained on): the chain a
greedy head drafts from each answer position, ``eval_steps`` long; per position, how often
step k is right given steps 1..k-1 were (the acceptance per draft position), and tau, 1 + the
mean number of leading right steps (greedy chain tokens per target pass).

Resumable like every head's training (:mod:`.common`); the finished head is saved in the
EAGLE-3 layout (:mod:`specdraft.heads.eagle_checkpoint`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specdraft.errors import SpecdraftError
from specdraft.heads.eagle import EagleHead
from specdraft.heads.feature_head import FeatureHead, ttt_inputs
from specdraft.heads.mtp import MtpHead
from specdraft.heads.mtp_checkpoint import load_mtp, save_mtp
from specdraft.heads.eagle_checkpoint import load_eagle, save_eagle
from specdraft.model.loader import LoadedModel
from specdraft.train.common import (checkpoint_key, Loop, Pair, TeacherCache, data_fingerprint, draft_index, draft_vocabulary,
                                    reference_pairs, resume, soft_cross_entropy, splits, train_loop, write_curve)
from specdraft.train.teacher import TeacherBatch, TeacherConfig, length_batches


@dataclass(frozen=True, slots=True)
class EagleTrainConfig:
    draft_vocab: int = 4096
    steps: int = 3  # training-time test length
    step_decay: float = 0.8
    epochs: int = 1
    lr: float = 1e-3
    soft_top_k: int = 8
    batch_tokens: int = 1024
    max_len: int = 768
    seed: int = 0
    taps: tuple[int, ...] = ()  # () = EAGLE-3's choice for the target
    eval_steps: int = 6
    checkpoint_every: int = 20  # batches
    eval_every: int = 100  # batches between held-out measures (the learning curve, ``curve.jsonl``)
    limit: int | None = None  # train records used (None: all)
    sources: tuple[str, ...] = ()  # train and held-out records of these prompt sets only (() = all)
    references: int = 0  # train prompts added with the data set's own answers (teacher forcing)
    time_budget_s: float | None = None  # stop (with a checkpoint) after this long
    init: str = ""  # a trained head's folder to start from (its vocabulary and taps); "" = the logit lens

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.lr <= 0 or self.soft_top_k < 1 or self.checkpoint_every < 1:
            raise SpecdraftError("epochs, soft_top_k and checkpoint_every must be >= 1 and lr > 0")
        if not 1 <= self.steps <= 16 or not 1 <= self.eval_steps <= 16 or not 0 < self.step_decay <= 1:
            raise SpecdraftError("steps and eval_steps must be in 1..16 and step_decay in (0, 1]")

    def key(self) -> dict[str, Any]:
        """The settings a checkpoint must share to be resumed (not the time budget)."""
        return checkpoint_key(self)


@dataclass(slots=True)
class ChainMeasure:
    positions: int = 0
    accept: list[float] = field(default_factory=list)  # per draft position: right given the earlier ones were
    tau: float = 1.0

    def line(self) -> str:
        acc = ", ".join(f"{a:.0%}" for a in self.accept)
        return f"held-out tau {self.tau:.3f} over {self.positions} positions; acceptance per draft position: {acc}"

    def row(self) -> dict[str, Any]:
        """The learning curve's fields (``curve.jsonl``)."""
        return {"tau": round(self.tau, 4), "accept": [round(a, 4) for a in self.accept], "positions": self.positions}

    def bar(self) -> dict[str, str]:
        """The progress bar's fields: held-out tau and first-position acceptance."""
        return {"held tau": f"{self.tau:.2f}", "held acc1": f"{self.accept[0]:.0%}" if self.accept else "-"}


def step_targets(batch: TeacherBatch, k: int, t: int) -> tuple[Tensor, Tensor, Tensor]:
    """Step k's labels at every anchor p < t: (mask [B, t], ids [B, t, s], probs [B, t, s]),
    the target's distribution at p + k, where p + k predicts an answer token."""
    assert batch.top_ids is not None and batch.top_probs is not None
    b, width = batch.answer.shape
    dev = batch.top_ids.device
    mask = torch.zeros(b, t, dtype=torch.bool, device=dev)
    ids = torch.zeros(b, t, batch.top_ids.shape[-1], dtype=torch.long, device=dev)
    probs = torch.zeros(b, t, batch.top_ids.shape[-1], device=dev)
    n = max(0, min(t, width - k))
    mask[:, :n] = batch.answer[:, k : k + n]
    ids[:, :n] = batch.top_ids[:, k : k + n]
    probs[:, :n] = batch.top_probs[:, k : k + n].float()
    return mask, ids, probs


def _ttt(head: FeatureHead, loaded: LoadedModel, batch: TeacherBatch, steps: int) -> list[Tensor]:
    m = loaded.model
    taps = torch.cat([batch.taps[i] for i in head.config.taps], -1).float()  # [B, T, taps*H]
    emb, cos, sin = ttt_inputs(m.embed, batch.tokens, m.rope_cos, m.rope_sin, steps, torch.float32)
    return head.ttt(taps, emb, cos, sin, steps)


def ttt_loss(head: FeatureHead, loaded: LoadedModel, batch: TeacherBatch, cfg: EagleTrainConfig,
               to_draft: Tensor) -> tuple[Tensor, float]:
    """The weighted soft cross-entropy over the training-time test's steps, and step 1's accuracy."""
    states = _ttt(head, loaded, batch, cfg.steps)
    t = batch.tokens.shape[1]
    losses, weights, acc = [], [], 0.0
    for k, state in enumerate(states, start=1):
        mask, ids, probs = step_targets(batch, k, t)
        if not bool(mask.any()):
            continue
        logits = head.logits(state[mask])  # [P, N]
        losses.append(soft_cross_entropy(logits, ids[mask], probs[mask], to_draft) * cfg.step_decay ** (k - 1))
        weights.append(cfg.step_decay ** (k - 1))
        if k == 1:
            acc = float((head.target_ids[logits.argmax(-1)] == ids[mask][:, 0]).float().mean())
    if not losses:
        return states[0].sum() * 0, acc
    return torch.stack(losses).sum() / sum(weights), acc


@torch.no_grad()
def evaluate(head: FeatureHead, loaded: LoadedModel, batches: Seq[TeacherBatch], steps: int) -> ChainMeasure:
    """The greedy chain's acceptance per draft position and tau on held-out batches."""
    reached = [0] * (steps + 1)  # reached[j]: anchors whose first j steps were all right
    total = 0
    for batch in batches:
        states = _ttt(head, loaded, batch, steps)
        t = batch.tokens.shape[1]
        valid, _, _ = step_targets(batch, steps, t)
        valid &= step_targets(batch, 1, t)[0]  # every step's label predicts an answer token
        lead = torch.ones_like(valid)
        total += int(valid.sum())
        reached[0] += int(valid.sum())
        for k, state in enumerate(states, start=1):
            _, ids, _ = step_targets(batch, k, t)
            guess = head.target_ids[head.logits(state).argmax(-1)]  # [B, t]
            lead &= guess == ids[..., 0]
            reached[k] += int((lead & valid).sum())
    if not total:
        return ChainMeasure()
    accept = [reached[k] / max(reached[k - 1], 1) for k in range(1, steps + 1)]
    return ChainMeasure(total, accept, 1.0 + sum(reached[1:]) / total)


def _curve(folder: Path, epoch: int, batch: int, batches: int, m: ChainMeasure) -> dict[str, str]:
    """Append one held-out measure to ``curve.jsonl``; the progress bar's field for it."""
    write_curve(folder, epoch, batch, batches, m.row())
    return m.bar()


@torch.no_grad()
def start_from_target(head: FeatureHead, loaded: LoadedModel) -> None:
    """The head's starting point: its output is its highest tap (EAGLE: ``fc`` selects it; MTP:
    ``eh_proj`` passes the hidden half), the block's residual branches start at zero, and the
    target's own final norm and LM head, restricted to the draft vocabulary, read it out; a
    logit lens that training then moves one token on."""
    h = head.config.hidden_size
    if isinstance(head, EagleHead):
        head.fc.weight.zero_()
        high = max(range(len(head.config.taps)), key=lambda i: head.config.taps[i])
        head.fc.weight[:, high * h : (high + 1) * h] = torch.eye(h)
        block = head.midlayer
    else:
        assert isinstance(head, MtpHead)
        head.eh_proj.weight.zero_()
        head.eh_proj.weight[:, h:] = torch.eye(h)
        block = head
    block.self_attn.o_proj.weight.zero_()
    block.mlp.down_proj.weight.zero_()
    head.norm.weight.copy_(loaded.model.norm.weight.float())
    head.lm_head.weight.copy_(loaded.model.lm_head.weight[head.target_ids].float())


def _start(loaded: LoadedModel, pairs: Seq[Pair], cfg: EagleTrainConfig, kind: str) -> FeatureHead:
    """The head training starts from: ``cfg.init``'s trained one (float32), or a new one over
    the training answers' most frequent tokens (the target's own and any references) that
    reads out like the target (``start_from_target``)."""
    if cfg.init:
        head: FeatureHead = (load_eagle(cfg.init, loaded.config) if kind == "eagle"
                             else load_mtp(cfg.init, loaded.config)).float()
        if cfg.taps and tuple(cfg.taps) != head.config.taps:
            raise SpecdraftError(f"--init {cfg.init} reads taps {head.config.taps}, not {tuple(cfg.taps)}")
        return head
    vocab = draft_vocabulary(loaded, (answer for _, answer in pairs), cfg.draft_vocab)
    head = (EagleHead.for_target(loaded.config, vocab, cfg.taps or None) if kind == "eagle"
            else MtpHead.for_target(loaded.config, vocab))
    start_from_target(head, loaded)
    return head


def train_eagle(loaded: LoadedModel, data: str | Path, out: str | Path, cfg: EagleTrainConfig,
                log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
                prompts_root: str | Path | None = None, kind: str = "eagle",
                held_out: str | Path | None = None) -> ChainMeasure:
    """Train (or resume) an EAGLE-3 head (``kind`` "eagle") or an MTP module ("mtp"; ``cfg.taps``
    is then the target's last layer) for ``loaded`` on the data folder (plus ``cfg.references``
    teacher-forced answers from ``prompts_root``); see the module doc."""
    if kind not in ("eagle", "mtp"):
        raise SpecdraftError(f"unknown head kind {kind!r}")
    pairs, held, _ = splits(data, cfg.limit, cfg.sources, loaded, held_out)
    if cfg.references:
        if prompts_root is None:
            raise SpecdraftError("references need the training prompts folder (--prompts)")
        pairs = pairs + reference_pairs(loaded, prompts_root, cfg.references, cfg.max_len, cfg.sources)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    head = _start(loaded, pairs, cfg, kind)
    vocab = head.vocab
    head.to(loaded.model.device)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr)
    key = {**cfg.key(), "kind": kind, "target": loaded.source.name, "data": data_fingerprint(pairs)}
    progress = resume(folder, key, head, opt, {"epoch": 0, "batch": 0}, vocab=vocab.target_ids)
    teacher = TeacherConfig(taps=head.config.taps, top_k=cfg.soft_top_k, batch_tokens=cfg.batch_tokens,
                            max_len=cfg.max_len)
    cache = TeacherCache(loaded, pairs, teacher, keep=cfg.epochs > 1)
    held_cache = TeacherCache(loaded, held, teacher, keep=True)
    held_groups = length_batches([len(p) + len(a) for p, a in held], cfg.batch_tokens)
    to_draft = draft_index(vocab).to(loaded.model.device)
    groups = length_batches([len(p) + len(a) for p, a in pairs], cfg.batch_tokens)
    t0, teacher_s = time.perf_counter(), [0.0]

    def step(group: list[int]) -> tuple[Tensor, dict[str, str]]:
        tb = time.perf_counter()
        batch = cache.batch(group)
        teacher_s[0] += time.perf_counter() - tb
        loss, acc = ttt_loss(head, loaded, batch, cfg, to_draft)
        share = teacher_s[0] / max(time.perf_counter() - t0, 1e-9)
        return loss, {"step1": f"{acc:.0%}", "teacher": f"{share:.0%}"}

    def after(epoch: int, batch: int, batches: int) -> dict[str, str] | None:
        if batch % cfg.eval_every:
            return None
        return _curve(folder, epoch, batch, batches, evaluate(head, loaded, list(held_cache.all(held_groups)), cfg.eval_steps))

    loop = Loop(kind, cfg.epochs, cfg.seed, cfg.checkpoint_every, cfg.time_budget_s, cfg.lr)
    if not train_loop(folder, key, head, opt, groups, progress, loop, step, after, log):
        return ChainMeasure()
    result = evaluate(head, loaded, list(held_cache.all(held_groups)), cfg.eval_steps)
    _curve(folder, cfg.epochs - 1, len(groups), len(groups), result)
    log(f"{kind}: {result.line()}")
    extra = {"training": cfg.key(), "held_out": {"tau": result.tau, "accept": result.accept,
                                                 "positions": result.positions}}
    save = save_eagle if kind == "eagle" else save_mtp
    save(head, folder, loaded.config, loaded.source.name, extra=extra, dtype=torch.bfloat16)  # type: ignore[arg-type]
    return result
