"""Self-distillation data: the target's own answers to training prompts.

A drafter must predict *this* model, not the authors of a data set, so ``generate_data`` runs
the target (plain decoding, batched) over the prompts of :mod:`specdraft.train.prompts` and
writes what it says. Prompt i is answered at ``temperatures[i % n]`` (greedy and sampled
answers mixed; a sampled row has its own seed, so a rerun writes the same tokens).

Output folder:

- ``manifest.json``: the model, dtype and generation settings; a folder made with other
  settings is refused, so shards never mix;
- ``shard-00000.jsonl``, ...: one JSON object per prompt, ``{"id", "source", "split",
  "temperature", "seed", "prompt", "response", "finish"}`` (token ids). A shard is written
  whole, under a temporary name and then renamed, once all its prompts are answered.

Resumable: prompts already in a shard are skipped, so an interrupted run (Ctrl-C, a time
budget, a machine that went away) loses at most the shard in progress. Token files are small
(a few bytes a token); hidden states are recomputed from them at training time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdraft.errors import SpecdraftError
from specdraft.model.loader import LoadedModel
from specdraft.sampling import Sampling
from specdraft.sequence import GenerationConfig
from specdraft.train.prompts import TrainPrompt

MANIFEST = "manifest.json"
FORMAT = 1


@dataclass(frozen=True, slots=True)
class DataConfig:
    """max_new_tokens: the longest answer; temperatures: answer i is generated at
    temperatures[i % n] (0 = greedy); max_prompt_tokens: longer prompts are skipped; batch_size:
    prompts decoded together; shard_size: prompts per shard (the unit of resumption);
    seed: the base of the sampled rows' seeds."""

    max_new_tokens: int = 256
    temperatures: tuple[float, ...] = (0.0, 0.7)
    max_prompt_tokens: int = 512
    batch_size: int = 16
    shard_size: int = 64
    seed: int = 0
    limit: int | None = None  # prompts to answer in all (None: every prompt); not part of the manifest
    time_budget_s: float | None = None  # stop starting new shards after this long
    splits: tuple[str, ...] = field(default=("train", "validation"))

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.max_prompt_tokens < 1 or self.batch_size < 1 or self.shard_size < 1:
            raise SpecdraftError("max_new_tokens, max_prompt_tokens, batch_size and shard_size must be >= 1")
        if not self.temperatures:
            raise SpecdraftError("give at least one temperature")
        for t in self.temperatures:
            Sampling(temperature=t)  # validates
        if self.limit is not None and self.limit < 1:
            raise SpecdraftError(f"limit must be >= 1, got {self.limit}")

    def manifest(self, loaded: LoadedModel, dtype: str) -> dict[str, Any]:
        from specdraft.datastore import tokenizer_fingerprint

        return {"format": FORMAT, "model": loaded.source.name, "tokenizer": tokenizer_fingerprint(loaded.tokenizer),
                "dtype": dtype, "max_new_tokens": self.max_new_tokens, "temperatures": list(self.temperatures),
                "max_prompt_tokens": self.max_prompt_tokens, "seed": self.seed}


@dataclass(slots=True)
class DataReport:
    answered: int = 0  # prompts answered in this call
    done: int = 0  # prompts in the folder's shards, this call's included
    skipped_long: int = 0  # prompts over max_prompt_tokens
    tokens: int = 0  # answer tokens generated in this call
    seconds: float = 0.0
    stopped: str = "complete"  # or "time budget"

    def line(self) -> str:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        return (f"{self.answered} prompts answered ({self.tokens} tokens, {rate:.0f} tok/s), {self.done} in the folder, "
                f"{self.skipped_long} skipped as too long; {self.stopped}")


def read_shards(folder: Path) -> list[dict[str, Any]]:
    """Every record of the folder's shards, in shard order."""
    records = []
    for path in sorted(folder.glob("shard-*.jsonl")):
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    raise SpecdraftError(f"{path}:{n}: corrupt shard (not JSON); delete the file to regenerate it") from None
    return records


def _check_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    path = folder / MANIFEST
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            raise SpecdraftError(f"{path} is corrupt; delete the folder to start again") from None
        diff = [k for k in manifest if old.get(k) != manifest[k]]
        if diff:
            raise SpecdraftError(f"{folder} holds data made with other settings ({', '.join(diff)}: "
                                 f"{old.get(diff[0])!r} there, {manifest[diff[0]]!r} now); use another --out")
    else:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def _write_shard(folder: Path, records: list[dict[str, Any]]) -> Path:
    index = len(list(folder.glob("shard-*.jsonl")))
    path = folder / f"shard-{index:05d}.jsonl"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records), encoding="utf-8")
    os.replace(tmp, path)
    return path


def generate_data(
    loaded: LoadedModel, prompts: Seq[TrainPrompt], out: str | Path, cfg: DataConfig, dtype: str = "float32",
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> DataReport:
    """Answer ``prompts`` (the first ``cfg.limit`` of the chosen splits) into ``out``; see the
    module doc. Returns what this call did."""
    folder = Path(out).expanduser()
    _check_manifest(folder, cfg.manifest(loaded, dtype))
    done = {r["id"] for r in read_shards(folder)}
    chosen = [p for p in prompts if p.split in cfg.splits][: cfg.limit]
    report = DataReport(done=len(done))
    todo = []
    for i, p in enumerate(chosen):
        if p.id in done:
            continue
        ids = loaded.tokenizer.encode_chat([{"role": "user", "content": p.text}])
        if len(ids) > cfg.max_prompt_tokens:
            report.skipped_long += 1
            continue
        todo.append((i, p, ids))
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), desc="train data", unit="prompt", file=sys.stderr)
    shards = [todo[i : i + cfg.shard_size] for i in range(0, len(todo), cfg.shard_size)]
    for records in _answer_shards(loaded, shards, cfg, report, t0, bar):
        _write_shard(folder, records)
        report.answered += len(records)
        report.done += len(records)
    bar.close()
    report.seconds = time.perf_counter() - t0
    return report


def _answer_shards(loaded: LoadedModel, shards: list[list[tuple[int, TrainPrompt, list[int]]]], cfg: DataConfig,
                   report: DataReport, t0: float, bar: tqdm) -> Iterator[list[dict[str, Any]]]:
    """Answer the shards' prompts through the continuous-batching scheduler (a finished row's
    slot takes the next prompt at once, so the batch stays full instead of waiting for its
    longest answer) and yield each shard's records, in order, once all of them are answered.
    No prompt of a new shard is queued once the time budget is spent."""
    from specdraft.engine import Engine
    from specdraft.scheduler import Request, Scheduler, SchedulerConfig

    capacity = cfg.max_prompt_tokens + cfg.max_new_tokens + 1
    sched = Scheduler(Engine(loaded.model, loaded.tokenizer),
                      SchedulerConfig(max_batch=cfg.batch_size, max_queue=cfg.batch_size, row_capacity=capacity,
                                      prefill_tokens=cfg.batch_size * cfg.max_prompt_tokens))
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens)
    pending: list[list[tuple[TrainPrompt, Sampling, Request]]] = []  # shards in flight, oldest first
    queue = list(shards)
    todo: list[tuple[int, TrainPrompt, list[int]]] = []  # the newest shard's prompts not yet queued
    while True:
        while len(sched.waiting) < cfg.batch_size:  # keep the queue as long as a batch
            if not todo:
                if not queue:
                    break
                if cfg.time_budget_s is not None and time.perf_counter() - t0 > cfg.time_budget_s:
                    report.stopped = "time budget"
                    break
                todo = list(queue.pop(0))
                pending.append([])
            i, p, ids = todo.pop(0)
            s = _sampling(cfg, i)
            pending[-1].append((p, s, sched.submit(ids, gen, s)))
        busy = sched.run_once()
        while pending and (not todo or len(pending) > 1) and all(r.finished_at for _, _, r in pending[0]):
            done = pending.pop(0)
            bar.update(len(done))
            report.tokens += sum(len(r.seq.output) for _, _, r in done)
            bar.set_postfix(tok_s=f"{report.tokens / (time.perf_counter() - t0):.0f}")
            yield [{"id": p.id, "source": p.source, "split": p.split, "temperature": s.temperature, "seed": s.seed,
                    "prompt": r.seq.prompt, "response": list(r.seq.output), "finish": r.seq.finish_reason or "length"}
                   for p, s, r in done]
        if not busy and not todo and not pending and (not queue or report.stopped == "time budget"):
            return


def _sampling(cfg: DataConfig, index: int) -> Sampling:
    t = cfg.temperatures[index % len(cfg.temperatures)]
    return Sampling(temperature=t, seed=cfg.seed + index if t > 0 else None)


def summary(folder: str | Path) -> dict[str, Any]:
    """Counts of a data folder: prompts and answer tokens per split and per source."""
    records = read_shards(Path(folder))
    out: dict[str, Any] = {"prompts": len(records), "tokens": sum(len(r["response"]) for r in records),
                           "by_split": {}, "by_source": {}}
    for r in records:
        for key, name in (("by_split", r["split"]), ("by_source", r["source"])):
            entry = out[key].setdefault(name, {"prompts": 0, "tokens": 0})
            entry["prompts"] += 1
            entry["tokens"] += len(r["response"])
    return out

