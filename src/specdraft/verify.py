"""Equivalence check: speculative output must equal plain output, byte for byte, at
temperature 0. Conversations run turn by turn; a turn is compared only while every earlier
turn matched (otherwise the contexts differ).

Plain outputs are the reference for every method, so they are cached on disk
(``$SPECDRAFT_CACHE``, default ``~/.cache/specdraft``, under ``verify/``) keyed by the model
file, dtype, device, thread count, torch version, the model code's numerics version
(``numerics_version``), token limit and the prompt's token ids:
checking a second method costs only its own generations. ``SPECDRAFT_CACHE=off`` disables it.

With ``out``, each finished prompt is also appended to a journal beside the report
(``<out stem>.progress.jsonl``), after a header line with the digest of the run's conditions
(the reference cache's, the method, its options and trained weights): a rerun of the same
command skips the prompts the journal holds, so a 200-prompt check that a session's end cut
off goes on where it stopped, on another machine too if the journal was committed. Each line
records a digest of the package's code; the report says how many resumed prompts were checked
by other code.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdraft.api import build_engine
from specdraft.bench.machine import machine_info
from specdraft.engine import Engine
from specdraft.metrics import SpecStats
from specdraft.model.loader import load
from specdraft.model import fastpath
from specdraft.model.transformer import numerics_version
from specdraft.sequence import GenerationConfig
from specdraft.workloads import WORKLOADS, Prompt, fit_messages, load_workload, mixed


@dataclass(frozen=True, slots=True)
class VerifyConfig:
    method: str = "ngram"
    prompts: tuple[str, ...] = ()  # workload names or JSONL files; () = every built-in workload, mixed
    limit: int = 200
    max_new_tokens: int = 64
    k: int = 8
    policy: str = "fixed"
    options: tuple[tuple[str, str], ...] = ()
    model: str | None = None
    dtype: str = "float32"
    batch_invariant: bool = False  # see Transformer: exact in any dtype, slower
    device: str = "cpu"
    out: str | None = None


@dataclass(slots=True)
class Mismatch:
    prompt_id: str
    workload: str
    turn: int
    token_index: int  # first differing generated token
    char_index: int  # first differing character of the text
    plain: str
    speculative: str


@dataclass(slots=True)
class VerifyReport:
    prompts: int = 0
    turns: int = 0
    matched_turns: int = 0
    truncated_prompts: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    planned: int = 0  # prompts selected; more than ``prompts`` when the run was interrupted
    interrupted: bool = False
    resumed: int = 0  # prompts taken from the journal of an earlier run
    resumed_other_code: int = 0  # ... of them checked by a different version of the code

    @property
    def mismatch_rate(self) -> float:
        return len(self.mismatches) / self.prompts if self.prompts else 0.0

    def add(self, part: "VerifyReport") -> None:
        """Fold in one prompt's (or any other run's) counts."""
        self.prompts += part.prompts
        self.turns += part.turns
        self.matched_turns += part.matched_turns
        self.truncated_prompts += part.truncated_prompts
        self.mismatches.extend(part.mismatches)
        self.stats.merge(part.stats)


class Journal:
    """The finished prompts of a run with ``out``: a header line with the digest of the run's
    conditions, then one JSON line per prompt (module doc). Lines under another header are
    dropped: that run checked something else."""

    def __init__(self, path: Path | None, conditions: dict[str, Any], code: str) -> None:
        self.path, self.code = path, code
        self.key = _digest(conditions)[:24]
        self.done: dict[str, dict[str, Any]] = {}
        self.dropped = 0  # prompts of another run's conditions
        rows = _json_lines(path) if path is not None and path.exists() else []
        if rows and rows[0].get("conditions") == self.key:
            self.done = {row["key"]: row for row in rows[1:] if "key" in row}
        elif rows and path is not None:
            self.dropped = len(rows) - 1
            path.unlink()

    @staticmethod
    def prompt_key(prompt: Prompt) -> str:
        return _digest([prompt.id, list(prompt.turns)])[:24]

    def get(self, prompt: Prompt) -> tuple[VerifyReport, bool] | None:
        """The prompt's recorded counts and whether the same code checked them, or None."""
        row = self.done.get(self.prompt_key(prompt))
        if row is None:
            return None
        part = VerifyReport(prompts=row["prompts"], turns=row["turns"], matched_turns=row["matched_turns"],
                            truncated_prompts=row["truncated_prompts"],
                            mismatches=[Mismatch(**m) for m in row["mismatches"]], stats=SpecStats(**row["stats"]))
        return part, row.get("code") == self.code

    def record(self, prompt: Prompt, part: VerifyReport) -> None:
        if self.path is None:
            return
        row = {"key": self.prompt_key(prompt), "prompt": prompt.id, "code": self.code, "prompts": part.prompts,
               "turns": part.turns, "matched_turns": part.matched_turns, "truncated_prompts": part.truncated_prompts,
               "mismatches": [asdict(m) for m in part.mismatches], "stats": asdict(part.stats)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        with self.path.open("ab") as f:
            if fresh:
                f.write(json.dumps({"conditions": self.key}).encode() + b"\n")
            elif _torn(self.path):  # a line torn by an interrupt
                f.write(b"\n")
            f.write(json.dumps(row).encode() + b"\n")
        self.done[row["key"]] = row


def _torn(path: Path) -> bool:
    """Whether a non-empty file's last line lacks its newline (reads the last byte only)."""
    with path.open("rb") as f:
        if f.seek(0, 2) == 0:
            return False
        f.seek(-1, 2)
        return f.read(1) != b"\n"


def _json_lines(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn line from an interrupted run: that prompt is checked again
        if isinstance(row, dict):
            rows.append(row)
    return rows


class ReferenceCache:
    """Plain greedy outputs on disk, one JSON line per (conditions, prompt ids)."""

    def __init__(self, folder: Path | None, conditions: dict[str, Any]) -> None:
        self.conditions = conditions
        self.path = None if folder is None else folder / "verify" / f"{_digest(conditions)[:24]}.jsonl"
        self.entries: dict[str, dict[str, Any]] = {}
        self.read_to = 0  # bytes of the file already read (other runs may append meanwhile)
        self._read_new()

    def _read_new(self) -> None:
        if self.path is None or not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self.read_to)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self.read_to += end
        for line in data[:end].decode(errors="replace").splitlines():
            try:
                row = json.loads(line)
                self.entries[row["key"]] = row
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a torn line from an interrupted run: recomputed

    @classmethod
    def for_run(cls, cfg: "VerifyConfig", source: Path, device: str) -> "ReferenceCache":
        setting = os.environ.get("SPECDRAFT_CACHE", "")
        if setting.lower() in ("off", "0", "no", "false"):
            return cls(None, {})
        folder = Path(setting) if setting else Path.home() / ".cache" / "specdraft"
        return cls(folder, plain_conditions(cfg, source, device))

    def get(self, ids: list[int]) -> tuple[str, list[int]] | None:
        key = _digest(ids)
        if key not in self.entries:
            self._read_new()  # another run may have computed it since
        row = self.entries.get(key)
        return None if row is None else (row["text"], row["tokens"])

    def put(self, ids: list[int], text: str, tokens: list[int]) -> None:
        key = _digest(ids)
        self.entries[key] = {"key": key, "text": text, "tokens": tokens}
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("ab") as f:
                torn = f.tell() > 0 and _torn(self.path)  # an interrupted line
                f.write((b"\n" if torn else b"") + json.dumps(self.entries[key]).encode() + b"\n")


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def plain_conditions(cfg: VerifyConfig, source: Path, device: str) -> dict[str, Any]:
    """What plain greedy outputs depend on (the reference cache's key)."""
    st = source.stat() if source.is_file() else None
    conditions = {"model": str(source.resolve()), "size": st.st_size if st else None,
                  "mtime": st.st_mtime_ns if st else None, "dtype": cfg.dtype, "device": device,
                  "batch_invariant": cfg.batch_invariant,
                  "threads": torch.get_num_threads(), "torch": torch.__version__,
                  "max_new_tokens": cfg.max_new_tokens}
    version = numerics_version(cfg.batch_invariant, int4=cfg.dtype == "int4")
    if version > 1:  # (absent for version 1, so that earlier caches stay valid)
        conditions["numerics"] = version
    if cfg.dtype == "int4":  # the quantized products' instructions (quantmm.h's dot or fma pass, or torch's)
        conditions["int4_kernel"] = fastpath.quant_path()
    return conditions


def run_conditions(cfg: VerifyConfig, source: Path, device: str) -> dict[str, Any]:
    """What a journal's results depend on: the plain conditions (the model file by size, not
    by path or time: a fresh clone's copy is the same run), the method, its settings and the
    content of its trained weights. Not the prompt limit: a longer run reuses the prompts done."""
    plain = {k: v for k, v in plain_conditions(cfg, source, device).items() if k not in ("model", "mtime")}
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("out", "limit", "model", "device")}
    return {**plain, **settings, "model_name": source.name, "weights": _weights_digest(cfg, source)}


def _weights_digest(cfg: VerifyConfig, source: Path) -> str | None:
    """A digest of the method's trained files (``path=`` or the package's shipped ones)."""
    from specdraft.heads.shipped import shipped_heads

    given = dict(cfg.options).get("path")
    path = Path(given).expanduser() if given else shipped_heads(cfg.method.split(":")[0], source)
    if path is None or not path.exists():
        return None
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes() if f.stat().st_size <= 1 << 26 else str(f.stat().st_size).encode())
    return h.hexdigest()[:24]


def code_digest() -> str:
    """A digest of the package's source files: which code checked a prompt."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h") and p.is_file()):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def first_difference(a: list[Any] | str, b: list[Any] | str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n if len(a) != len(b) else -1)


def select_prompts(cfg: VerifyConfig) -> list[Prompt]:
    if not cfg.prompts:
        return mixed(WORKLOADS, cfg.limit)
    if len(cfg.prompts) == 1:
        return load_workload(cfg.prompts[0], cfg.limit)
    return mixed(cfg.prompts, cfg.limit)


def compare_prompt(prompt: Prompt, plain: Engine, spec: Engine, gen: GenerationConfig, max_prompt: int,
                   report: VerifyReport, cache: ReferenceCache | None = None) -> None:
    messages: list[dict[str, str]] = []
    report.prompts += 1
    for turn, user in enumerate(prompt.turns):
        messages.append({"role": "user", "content": user})
        ids, cut = fit_messages(plain.tokenizer, messages, max_prompt, prompt.id)
        report.truncated_prompts += int(cut and turn == 0)
        text, tokens = _plain_output(plain, ids, gen, cache)
        got = spec.generate([ids], gen, stats=report.stats)[0]
        report.turns += 1
        if text.encode() != got.text.encode() or tokens != got.tokens:
            report.mismatches.append(Mismatch(prompt.id, prompt.workload, turn, first_difference(tokens, got.tokens),
                                              first_difference(text, got.text), text, got.text))
            return
        report.matched_turns += 1
        messages.append({"role": "assistant", "content": text})


def _plain_output(plain: Engine, ids: list[int], gen: GenerationConfig,
                  cache: ReferenceCache | None) -> tuple[str, list[int]]:
    hit = cache.get(ids) if cache is not None else None
    if hit is not None:
        return hit
    ref = plain.generate([ids], gen)[0]
    if cache is not None:
        cache.put(ids, ref.text, ref.tokens)
    return ref.text, ref.tokens


def run_verify(cfg: VerifyConfig) -> VerifyReport:
    loaded = load(cfg.model, dtype=cfg.dtype, device=cfg.device, batch_invariant=cfg.batch_invariant)
    plain = build_engine(loaded, "plain")
    spec = build_engine(loaded, cfg.method, k=cfg.k, policy=cfg.policy, options=dict(cfg.options))
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens)
    max_prompt = loaded.config.max_context - cfg.max_new_tokens - cfg.k - 2
    prompts = select_prompts(cfg)
    report = VerifyReport(planned=len(prompts))
    cache = ReferenceCache.for_run(cfg, loaded.source, cfg.device)
    journal = Journal(journal_path(cfg.out) if cfg.out else None, run_conditions(cfg, loaded.source, cfg.device),
                      code_digest())
    todo = _resume(journal, prompts, report)
    with warnings.catch_warnings(), _sigterm_interrupts():
        warnings.simplefilter("ignore")  # truncation is counted and reported below
        for prompt in tqdm(todo, desc=f"verify {cfg.method}", unit="prompt", file=sys.stderr):
            part = VerifyReport()
            try:
                compare_prompt(prompt, plain, spec, gen, max_prompt, part, cache)
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM: report the prompts finished so far
                report.interrupted = True
                break
            report.add(part)
            journal.record(prompt, part)
    print(format_report(cfg, report))
    if cfg.out:
        path = Path(cfg.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"config": asdict(cfg), "machine": machine_info(cfg.device),
                                    "prompts": report.prompts, "turns": report.turns,
                                    "matched_turns": report.matched_turns,
                                    "truncated_prompts": report.truncated_prompts,
                                    "mismatch_rate": report.mismatch_rate,
                                    "planned_prompts": report.planned, "interrupted": report.interrupted,
                                    "resumed_prompts": report.resumed,
                                    "resumed_by_other_code": report.resumed_other_code, "code": code_digest(),
                                    "mismatches": [asdict(m) for m in report.mismatches],
                                    "stats": report.stats.to_dict()}, indent=2))
        print(f"wrote {path}")
    return report


def _resume(journal: Journal, prompts: list[Prompt], report: VerifyReport) -> list[Prompt]:
    """Fold the journal's finished prompts into ``report``; return the prompts still to check."""
    if journal.dropped:
        print(f"verify: {journal.path} held {journal.dropped} prompts of a run under other conditions; starting over",
              file=sys.stderr)
    todo = []
    for prompt in prompts:
        found = journal.get(prompt)
        if found is None:
            todo.append(prompt)
            continue
        report.add(found[0])
        report.resumed += 1
        report.resumed_other_code += int(not found[1])
    if report.resumed:
        print(f"verify: resuming, {report.resumed} of {len(prompts)} prompts already checked ({journal.path})",
              file=sys.stderr)
    return todo


def journal_path(out: str) -> Path:
    """The journal beside a report: results/x.json -> results/x.progress.jsonl."""
    path = Path(out)
    return path.with_name(path.stem + ".progress.jsonl")


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt while verifying (main thread only), so that a
    stopped run still reports what it checked."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def format_report(cfg: VerifyConfig, r: VerifyReport) -> str:
    lines = [
        f"method {cfg.method} ({cfg.dtype}{', batch-invariant' if cfg.batch_invariant else ''}, k={cfg.k}, policy {cfg.policy}), greedy, {cfg.max_new_tokens} new tokens per turn",
        f"prompts: {r.prompts} ({r.truncated_prompts} cut to fit the context), turns compared: {r.turns}",
        f"identical: {r.prompts - len(r.mismatches)}/{r.prompts} prompts; mismatch rate {r.mismatch_rate:.1%}"
        + (f" (INTERRUPTED: {r.prompts} of {r.planned} prompts checked)" if r.interrupted else ""),
        f"speculation: tau {r.stats.tau:.2f}, acceptance {r.stats.acceptance_rate:.1%}",
    ]
    if r.resumed:
        lines.append(f"resumed: {r.resumed} prompts from an earlier run's journal"
                     + (f", {r.resumed_other_code} of them checked by other code" if r.resumed_other_code else ""))
    for m in r.mismatches[:20]:
        lines.append(f"  MISMATCH {m.prompt_id} ({m.workload}) turn {m.turn + 1}: first difference at token "
                     f"{m.token_index}, char {m.char_index}: plain {m.plain[m.char_index:m.char_index + 30]!r} "
                     f"vs speculative {m.speculative[m.char_index:m.char_index + 30]!r}")
    return "\n".join(lines)
