"""What every head's training shares: the splits, the draft vocabulary, the soft label loss,
a cache of the teacher's outputs across epochs, and resumable checkpoints."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence as Seq
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from specdraft.errors import SpecdraftError
from specdraft.heads.vocab import DraftVocab
from specdraft.model.loader import LoadedModel
from specdraft.train.data import MANIFEST, read_shards
from specdraft.train.teacher import TeacherBatch, TeacherConfig, teacher_batches
from specdraft.train.vocab import most_frequent, token_counts

CHECKPOINT = "checkpoint.pt"
Pair = tuple[list[int], list[int]]


def checkpoint_key(cfg: Any) -> dict[str, Any]:
    """The settings of a training config that a checkpoint must share to be resumed: all but
    the time budget, and ``sources`` only when set (checkpoints made before it resume)."""
    skip = {"time_budget_s"} | ({"sources"} if not cfg.sources else set())
    return {k: v for k, v in asdict(cfg).items() if k not in skip}


def data_folders(data: str | Path | Seq[str | Path]) -> list[Path]:
    """The folders of a ``--data`` value: one path, a comma-separated list, or a sequence."""
    items = data.split(",") if isinstance(data, str) else [data] if isinstance(data, Path) else list(data)
    folders = [Path(str(d).strip()) for d in items if str(d).strip()]
    if not folders:
        raise SpecdraftError("no data folder given")
    return folders


def read_data(data: str | Path | Seq[str | Path], model: LoadedModel | None = None) -> list[dict[str, Any]]:
    """Every record of one or several ``specdraft train data`` folders, in order. The folders
    must hold answers of one tokenizer (their manifests), ``model``'s when given, so token ids
    mean one thing."""
    from specdraft.datastore import tokenizer_fingerprint

    records: list[dict[str, Any]] = []
    seen: dict[str, Path] = {}
    if model is not None:
        seen[tokenizer_fingerprint(model.tokenizer)] = Path(model.source.name)
    for folder in data_folders(data):
        if not folder.is_dir():
            raise SpecdraftError(f"{folder}: no such data folder")
        try:
            tok = json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("tokenizer")
        except (OSError, json.JSONDecodeError):
            tok = None
        if tok is not None:
            seen.setdefault(tok, folder)
        records += read_shards(folder)
    if len(seen) > 1:
        a, b = list(seen.values())[:2]
        if model is not None:
            raise SpecdraftError(f"{b} holds answers of a model with another tokenizer than {a}; "
                                 f"make the data with this model (`specdraft train data`)")
        raise SpecdraftError(f"{a} and {b} hold answers of different tokenizers; train on one model's data")
    return records


def splits(data: str | Path | Seq[str | Path], limit: int | None, sources: Seq[str] = (),
           model: LoadedModel | None = None,
           held_out: str | Path | Seq[str | Path] | None = None) -> tuple[list[Pair], list[Pair], list[dict[str, Any]]]:
    """(train pairs, held-out greedy pairs, train records) of ``specdraft train data`` folders
    (one, or several: e.g. a second sampled answer per prompt in a folder of its own).
    Held-out answers are the greedy ones of the validation split (of the ``held_out`` folders
    when given, else of ``data``'s): the exact measure. ``sources``: only the records of these
    prompt sets, in both splits (() = all); ``model``: the target the answers must come from
    (its tokenizer)."""
    records = _of_sources(read_data(data, model), sources, data)
    held_records = records if held_out is None else _of_sources(read_data(held_out, model), sources, held_out)
    held_prompts = {tuple(r["prompt"]) for r in held_records if r["split"] == "validation"}
    train = [r for r in records if r["split"] == "train" and r["response"]]
    clean = [r for r in train if tuple(r["prompt"]) not in held_prompts]
    if len(clean) < len(train):  # the same prompt text under another id: keep the held-out measure clean
        print(f"{data}: {len(train) - len(clean)} train answers dropped: their prompt is a validation prompt",
              file=sys.stderr)
    train = clean[:limit]
    held = [r for r in held_records if r["split"] == "validation" and r["temperature"] == 0 and r["response"]]
    if not train or not held:
        raise SpecdraftError(f"{data if held_out is None else f'{data} / {held_out}'}: need answers in both splits "
                             f"(train {len(train)}, validation {len(held)}); make more with `specdraft train data`")
    return [(r["prompt"], r["response"]) for r in train], [(r["prompt"], r["response"]) for r in held], train


def _of_sources(records: list[dict[str, Any]], sources: Seq[str], data: object) -> list[dict[str, Any]]:
    if not sources:
        return records
    known = {r["source"] for r in records}
    missing = [s for s in sources if s not in known]
    if missing:
        raise SpecdraftError(f"{data}: no answers from {', '.join(missing)} (its sources: {', '.join(sorted(known))})")
    return [r for r in records if r["source"] in sources]


def reference_pairs(loaded: LoadedModel, prompts_root: str | Path, count: int, max_len: int = 768,
                    sources: Seq[str] = ()) -> list[Pair]:
    """Up to ``count`` train-split prompts with the data set's own answer (teacher forcing,
    EAGLE-1's recipe: the target's soft labels on text it did not write cost only a prefill),
    as (chat prompt ids, answer ids + EOS), from the ``sources`` sets only (() = all), taken
    in the folder's interleaved order. Validation prompts are never used."""
    from specdraft.train.prompts import load_training_prompts

    tok = loaded.tokenizer
    eos = [tok.eos_id] if tok.eos_id is not None else []
    pairs: list[Pair] = []
    for p in load_training_prompts(prompts_root, tuple(sources) or None):
        if len(pairs) >= count:
            break
        if p.split != "train" or not p.reference:
            continue
        prompt = tok.encode_chat([{"role": "user", "content": p.text}])
        answer = tok.encode(p.reference, add_bos=False, add_eos=False, parse_special=False) + eos
        if len(prompt) + 2 <= max_len:
            pairs.append((prompt, answer))
    return pairs


def draft_vocabulary(loaded: LoadedModel, answers: Iterable[Seq[int]], size: int) -> DraftVocab:
    """The ``size`` most frequent tokens of the train answers (the target's own, and any
    references; and the EOS token)."""
    eos = loaded.tokenizer.eos_id
    counts = token_counts(answers, loaded.config.vocab_size)
    return most_frequent(counts, size, always=(eos,) if eos is not None else ())


def draft_index(vocab: DraftVocab) -> Tensor:
    """[V] int64: target id -> draft id, -1 outside the draft vocabulary."""
    return vocab.to_draft(torch.arange(vocab.target_size))


def soft_cross_entropy(logits: Tensor, ids: Tensor, probs: Tensor, to_draft: Tensor) -> Tensor:
    """Cross-entropy of draft logits [P, N] against the target's top-s distribution (ids,
    probs [P, s], target ids), renormalised over the draft vocabulary; positions whose top s
    lie wholly outside it are left out. Returns a scalar (0 when none remain)."""
    draft_ids = to_draft[ids]  # [P, s], -1 outside
    p = probs.float() * (draft_ids >= 0)
    keep = p.sum(-1) > 0
    if not bool(keep.any()):
        return logits.sum() * 0
    logp = logits.float().log_softmax(-1).gather(-1, draft_ids.clamp_min(0))  # [P, s]
    target = p[keep] / p[keep].sum(-1, keepdim=True)
    return -(target * logp[keep]).sum(-1).mean()


class TeacherCache:
    """The teacher's batches for fixed groups of sequences, computed on first use and kept in
    memory (compactly) for later epochs when ``keep``."""

    def __init__(self, loaded: LoadedModel, pairs: Seq[Pair], cfg: TeacherConfig, keep: bool = True) -> None:
        self.loaded, self.pairs, self.cfg, self.keep = loaded, pairs, cfg, keep
        self.cfg_one = TeacherConfig(taps=cfg.taps, top_k=cfg.top_k, batch_tokens=10**9, max_len=cfg.max_len)
        self.store: dict[tuple[int, ...], TeacherBatch] = {}

    def batch(self, group: Seq[int]) -> TeacherBatch:
        key = tuple(group)
        if key in self.store:
            return self.store[key]
        [(_, b)] = list(teacher_batches(self.loaded.model, [self.pairs[i] for i in group], self.cfg_one))
        b = _compact(b)
        if self.keep:
            self.store[key] = b
        return b

    def all(self, groups: Seq[Seq[int]]) -> Iterator[TeacherBatch]:
        for g in groups:
            yield self.batch(g)


def _compact(b: TeacherBatch) -> TeacherBatch:
    """bfloat16 states, float16 probabilities, int32 ids (about half the memory), every tensor
    on the model's device."""
    half = torch.bfloat16
    dev = b.last_hidden.device
    return TeacherBatch(b.tokens.to(dev), b.lengths, b.answer.to(dev), b.last_hidden.to(half),
                        {i: t.to(half) for i, t in b.taps.items()},
                        None if b.top_ids is None else b.top_ids.to(torch.int32),
                        None if b.top_probs is None else b.top_probs.to(torch.float16))


def data_fingerprint(pairs: Seq[Pair]) -> dict[str, Any]:
    """What a resumed run must train on again: how many sequences, and a digest of them."""
    digest = hashlib.sha256()
    for prompt, answer in pairs:
        digest.update(json.dumps([list(prompt), list(answer)], separators=(",", ":")).encode())
    return {"sequences": len(pairs), "sha256": digest.hexdigest()[:16]}


def save_checkpoint(folder: Path, key: dict[str, Any], module: nn.Module, opt: torch.optim.Optimizer,
                    progress: dict[str, Any]) -> None:
    """Write the module, optimizer and progress atomically (a crash leaves the last one); with
    the module's draft vocabulary when it has one."""
    tmp = folder / (CHECKPOINT + ".tmp")
    state = {"config": json.loads(json.dumps(key)), "module": module.state_dict(), "opt": opt.state_dict(),
             "progress": progress}
    if isinstance(getattr(module, "target_ids", None), Tensor):
        state["vocab"] = module.target_ids.cpu()
    torch.save(state, tmp)
    os.replace(tmp, folder / CHECKPOINT)


def resume(folder: Path, key: dict[str, Any], module: nn.Module, opt: torch.optim.Optimizer,
           start: dict[str, Any], vocab: Tensor | None = None) -> dict[str, Any]:
    """Load ``folder``'s checkpoint into module and optimizer and return its progress (``start``
    when there is none); refused in one line when corrupt, made with other settings, data or
    target, or over another draft vocabulary (``vocab``)."""
    path = folder / CHECKPOINT
    if not path.is_file():
        return dict(start)
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001  (torch raises many kinds for a damaged file)
        raise SpecdraftError(f"{path} is corrupt ({type(e).__name__}); delete it to start again") from None
    if state.get("config") != json.loads(json.dumps(key)):
        raise SpecdraftError(f"{path} was made with other settings, data or target; use another --out or the same ones")
    if vocab is not None and not torch.equal(state.get("vocab", torch.empty(0, dtype=torch.long)).cpu(), vocab.cpu()):
        raise SpecdraftError(f"{path} was made over another draft vocabulary; use another --out")
    try:
        module.load_state_dict(state["module"])
        opt.load_state_dict(state["opt"])
    except (KeyError, RuntimeError, ValueError) as e:
        raise SpecdraftError(f"{path} does not fit this module ({type(e).__name__}); use another --out") from None
    return dict(state["progress"])


def learning_rate(peak: float, step: int, total: int, warmup: int = 20, floor: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine down to ``floor * peak`` at ``total``
    (a function of the step alone, so a resumed run continues the same schedule)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    done = min(1.0, (step - warmup) / max(total - warmup, 1))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done)))


@dataclass(frozen=True, slots=True)
class Loop:
    """The epoch/batch loop's settings: ``name`` for the progress bar and messages;
    ``schedule_lr``: the peak of ``learning_rate``'s schedule (None: the optimizer's constant lr)."""

    name: str
    epochs: int
    seed: int
    checkpoint_every: int
    time_budget_s: float | None
    schedule_lr: float | None = None


Step = Callable[[list[int]], tuple[Tensor, dict[str, str]]]  # a batch's group -> (loss, progress-bar fields)
After = Callable[[int, int, int], "dict[str, str] | None"]  # (epoch, batch, batches) -> progress-bar fields to keep
EVAL_EVERY = 100  # batches between held-out measures (the learning curve, ``curve.jsonl``), where not set


def write_curve(folder: Path, epoch: int, batch: int, batches: int, measure: dict[str, Any]) -> None:
    """Append one held-out measure to ``folder/curve.jsonl``, with the epochs done (a fraction)."""
    row = {"epochs": round(epoch + batch / batches, 4), **measure}
    with open(folder / "curve.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def train_loop(folder: Path, key: dict[str, Any], module: nn.Module, opt: torch.optim.Optimizer,
               groups: Seq[list[int]], progress: dict[str, Any], loop: Loop, step: Step,
               after: After | None = None,
               log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> bool:
    """Every head's training loop: epochs over ``groups`` shuffled per epoch (by seed), one
    optimizer step per group, checkpoints every ``checkpoint_every`` batches and at each epoch's
    end, resuming at ``progress``. ``after(epoch, batch, batches)`` runs after each batch (a
    held-out measure); the fields it returns stay on the progress bar until it returns others.
    Returns False when the time budget stopped it (with a checkpoint)."""
    t0 = time.perf_counter()
    kept: dict[str, str] = {}  # the last held-out measure, shown beside the training batch's
    for epoch in range(progress["epoch"], loop.epochs):
        order = list(groups)
        random.Random(loop.seed + epoch).shuffle(order)
        bar = tqdm(total=len(order), initial=progress["batch"], desc=f"{loop.name} epoch {epoch + 1}/{loop.epochs}",
                   unit="batch", file=sys.stderr)
        for b in range(progress["batch"], len(order)):
            if loop.time_budget_s is not None and time.perf_counter() - t0 > loop.time_budget_s:
                save_checkpoint(folder, key, module, opt, {"epoch": epoch, "batch": b})
                bar.close()
                log(f"{loop.name}: time budget reached at epoch {epoch + 1}, batch {b}; rerun to resume")
                return False
            if loop.schedule_lr is not None:
                for g in opt.param_groups:
                    g["lr"] = learning_rate(loop.schedule_lr, epoch * len(order) + b, loop.epochs * len(order))
            loss, fields = step(order[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if (b + 1) % loop.checkpoint_every == 0:
                save_checkpoint(folder, key, module, opt, {"epoch": epoch, "batch": b + 1})
            if after is not None:
                kept.update(after(epoch, b + 1, len(order)) or {})
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", **fields, **kept)
            bar.update(1)
        bar.close()
        progress = {"epoch": epoch + 1, "batch": 0}
        save_checkpoint(folder, key, module, opt, progress)
    return True
