"""Workloads: prompt sets by type, from the evaluation sets shipped with the package or a
user's own JSONL.

Every prompt is a conversation of one or more user turns, run turn by turn with the model's
chat template (as Spec-Bench does). Built-in workloads (see ``WORKLOADS``) read the public
sets in ``specdraft/data`` (sources and licences in its README), or in $SPECDRAFT_DATASETS.

A user's JSONL has one object per line with ``turns`` (a list of user messages) or
``prompt`` / ``text`` / ``question`` / ``instruction`` (+ optional ``input``); an optional
``id``. Give it as ``NAME=PATH`` (or just PATH: the workload is named after the file).
"""

from __future__ import annotations

import gzip
import json
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str
    workload: str
    turns: tuple[str, ...]  # user messages, sent one after another in one conversation


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str
    description: str
    loader: Callable[[Path], list[Prompt]]


def datasets_dir() -> Path:
    """The folder of the evaluation sets: $SPECDRAFT_DATASETS if set, else the copies shipped
    inside the package (``specdraft/data``, see its README for sources and licences)."""
    env = os.environ.get("SPECDRAFT_DATASETS")
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise SpecdraftError(f"SPECDRAFT_DATASETS={env} is not a folder")
        return path
    shipped = resources.files("specdraft") / "data"
    if not shipped.is_dir():
        raise SpecdraftError("the evaluation sets are missing from this specdraft install (specdraft/data); "
                             "reinstall specdraft or set SPECDRAFT_DATASETS=/path/to/datasets")
    return Path(str(shipped))


def data_file(root: Path, name: str) -> Path:
    """``root/name``, or its gzipped copy ``root/name.gz`` (the package ships large sets gzipped)."""
    path = root / name
    gz = path.with_name(path.name + ".gz")
    return gz if not path.is_file() and gz.is_file() else path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (gzipped when its name ends in .gz)."""
    if not path.is_file():
        raise SpecdraftError(f"prompt file not found: {path}")
    records = []
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                rec = _record(raw, path, n)
                if rec is not None:
                    records.append(rec)
    except (OSError, EOFError) as e:  # a corrupt or truncated gzip file
        raise SpecdraftError(f"{path}: cannot read ({e})") from None
    if not records:
        raise SpecdraftError(f"{path} has no records")
    return records


def _record(raw: bytes, path: Path, n: int) -> Any:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecdraftError(f"{path}:{n}: not UTF-8 text") from None
    if not line.strip():
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise SpecdraftError(f"{path}:{n}: not valid JSON ({e.msg})") from None


def _questions(source: str, categories: tuple[str, ...], workload: str) -> Callable[[Path], list[Prompt]]:
    """Spec-Bench / MT-bench style ``question.jsonl`` (source = its folder), by category."""

    def load(root: Path) -> list[Prompt]:
        return [
            Prompt(f"{source}/{r['question_id']}", workload, tuple(r["turns"]))
            for r in read_jsonl(data_file(root / source, "question.jsonl"))
            if r["category"] in categories
        ]

    return load


def _spec_bench(categories: tuple[str, ...], workload: str) -> Callable[[Path], list[Prompt]]:
    return _questions("spec_bench", categories, workload)


def _mt_bench(categories: tuple[str, ...], workload: str) -> Callable[[Path], list[Prompt]]:
    return _questions("mt_bench", categories, workload)


def _humaneval(root: Path) -> list[Prompt]:
    return [
        Prompt(r["task_id"], "code",
               (f"Complete the following Python function. Reply with the whole function.\n\n```python\n{r['prompt']}```",))
        for r in read_jsonl(data_file(root / "humaneval", "HumanEval.jsonl"))
    ]


def _edit_eval(root: Path) -> list[Prompt]:
    return [
        Prompt(r["task_id"], "editing",
               (f"{r['instruction'].strip()}\n\n```python\n{r['input']}```\n\nReply with the whole edited code.",))
        for r in read_jsonl(data_file(root / "edit_eval", "edit_eval.jsonl"))
    ]


def _qmsum(root: Path) -> list[Prompt]:
    prompts = []
    for i, r in enumerate(read_jsonl(data_file(root / "qmsum", "test.jsonl"))):
        transcript = "\n".join(f"{t['speaker']}: {t['content']}" for t in r["meeting_transcripts"])
        query = r["general_query_list"][0]["query"] if r["general_query_list"] else "Summarize the whole meeting."
        prompts.append(Prompt(f"qmsum/{i}", "long_summarization", (f"{query}\n\nMeeting transcript:\n{transcript}",)))
    return prompts


def _repeat(root: Path) -> list[Prompt]:
    """A copy-heavy control set: repeat a news passage (the opening of each Spec-Bench
    summarization article, cut at a sentence end near 600 characters) word for word."""
    prompts = []
    for r in read_jsonl(data_file(root / "spec_bench", "question.jsonl")):
        if r["category"] != "summarization":
            continue
        article = r["turns"][0].removeprefix("Summarize:").strip()
        end = article.find(". ", 500)
        passage = article[: end + 1 if 0 < end < 800 else 600]
        prompts.append(Prompt(f"repeat/{r['question_id']}", "repeat",
                              (f"Repeat the following text exactly, word for word:\n\n{passage}",)))
    return prompts


MT_CHAT = ("reasoning", "math", "coding", "extraction", "stem", "humanities")
MT_CREATIVE = ("writing", "roleplay")

WORKLOADS: dict[str, WorkloadSpec] = {
    w.name: w
    for w in (
        WorkloadSpec("summarization", "Spec-Bench summarization (CNN/DailyMail articles)", _spec_bench(("summarization",), "summarization")),
        WorkloadSpec("rag", "Spec-Bench retrieval-augmented QA (passages + question)", _spec_bench(("rag",), "rag")),
        WorkloadSpec("translation", "Spec-Bench German to English", _spec_bench(("translation",), "translation")),
        WorkloadSpec("qa", "Spec-Bench open-domain questions", _spec_bench(("qa",), "qa")),
        WorkloadSpec("math", "Spec-Bench GSM8K-style word problems", _spec_bench(("math_reasoning",), "math")),
        WorkloadSpec("chat", "MT-bench multi-turn chat (reasoning, math, coding, extraction, STEM, humanities)", _mt_bench(MT_CHAT, "chat")),
        WorkloadSpec("creative", "MT-bench writing and roleplay (creative writing), multi-turn", _mt_bench(MT_CREATIVE, "creative")),
        WorkloadSpec("code", "HumanEval function completion (code with context)", _humaneval),
        WorkloadSpec("editing", "EditEval instruction-driven code editing", _edit_eval),
        WorkloadSpec("repeat", "repeat a news passage word for word (copy-heavy control)", _repeat),
        WorkloadSpec("long_summarization", "QMSum meeting summarization (cut to the context)", _qmsum),
    )
}


MIXED = "mixed"  # every built-in workload but long_summarization, taken in turn (a server's mix)


def load_workload(name: str, limit: int | None = None) -> list[Prompt]:
    """A built-in workload by name, ``mixed``, or ``NAME=PATH`` / ``PATH`` for a user's JSONL."""
    if name == MIXED:
        parts = [w for w in WORKLOADS if w != "long_summarization"]
        return mixed(parts, limit if limit is not None else 10**9)
    if name in WORKLOADS:
        prompts = WORKLOADS[name].loader(datasets_dir())
    elif _is_user_file(name):
        label, path = _user_file(name)
        prompts = load_user_jsonl(path, label)
    else:
        raise SpecdraftError(f"unknown workload {name!r}; built-in: {', '.join(WORKLOADS)}, {MIXED} (or NAME=FILE.jsonl)")
    return prompts[:limit] if limit is not None else prompts


def workload_label(name: str) -> str:
    """The name a workload given as ``name`` is reported under: a built-in's name, or the NAME of
    ``NAME=PATH`` (the file's stem for a bare PATH)."""
    return _user_file(name)[0] if name != MIXED and name not in WORKLOADS and _is_user_file(name) else name


def _is_user_file(name: str) -> bool:
    return "=" in name or name.endswith((".jsonl", ".json")) or Path(name).is_file()


def _user_file(name: str) -> tuple[str, Path]:
    """(label, path) of ``NAME=PATH`` (split at the first "=": a path may hold one) or of a bare
    PATH (an existing file, or a name without "=")."""
    if Path(name).is_file() or "=" not in name:
        return Path(name).stem, Path(name)
    label, _, path = name.partition("=")
    return label or Path(path).stem, Path(path)


def load_user_jsonl(path: Path, workload: str) -> list[Prompt]:
    prompts = []
    for n, rec in enumerate(read_jsonl(path), 1):
        if not isinstance(rec, dict):
            raise SpecdraftError(f"{path}:{n}: each line must be a JSON object")
        prompts.append(Prompt(str(rec.get("id", rec.get("question_id", rec.get("task_id", n)))), workload,
                              _turns(rec, path, n)))
    return prompts


def _turns(rec: dict[str, Any], path: Path, n: int) -> tuple[str, ...]:
    if "turns" in rec:
        turns = rec["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise SpecdraftError(f"{path}:{n}: 'turns' must be a non-empty list of strings")
        return tuple(turns)
    for key in ("prompt", "text", "question", "instruction"):
        if isinstance(rec.get(key), str) and rec[key].strip():
            extra = rec.get("input") if key == "instruction" else None
            return (rec[key] + (f"\n\n{extra}" if isinstance(extra, str) and extra else ""),)
    raise SpecdraftError(f"{path}:{n}: no prompt found (expected 'turns', 'prompt', 'text', 'question' or 'instruction')")


def mixed(names: Iterable[str], limit: int) -> list[Prompt]:
    """Up to ``limit`` prompts taken round-robin from several workloads."""
    pools = [load_workload(n) for n in names]
    out: list[Prompt] = []
    i = 0
    while len(out) < limit and any(i < len(p) for p in pools):
        out.extend(p[i] for p in pools if i < len(p))
        i += 1
    return out[:limit]


def fit_messages(tokenizer: Any, messages: list[dict[str, str]], max_tokens: int, label: str = "") -> tuple[list[int], bool]:
    """Encode a conversation; if longer than ``max_tokens``, cut the end of the last user
    message until it fits, with a warning (never silently). Returns (ids, truncated)."""
    ids = tokenizer.encode_chat(messages)
    if len(ids) <= max_tokens:
        return ids, False
    content = messages[-1]["content"]
    lo, hi = 0, len(content)
    while lo < hi:  # longest prefix of the content that fits
        mid = (lo + hi + 1) // 2
        trial = [*messages[:-1], {"role": "user", "content": content[:mid]}]
        if len(tokenizer.encode_chat(trial)) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        raise SpecdraftError(f"{label or 'prompt'}: the conversation does not fit {max_tokens} tokens even without its last message")
    warnings.warn(f"{label or 'prompt'}: cut from {len(ids)} tokens to fit {max_tokens} (kept {lo}/{len(content)} characters)",
                  stacklevel=2)
    trial = [*messages[:-1], {"role": "user", "content": content[:lo]}]
    return tokenizer.encode_chat(trial), True
