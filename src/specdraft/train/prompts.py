"""Training prompts for drafters, read from a folder the user gives (never from the package).

The folder holds public instruction and chat sets in their upstream layouts, one folder per
set (sources and licences are the folder's own business; the project's development copy lists
them). Only these files are read, by name, so an evaluation set can never be picked up by
accident:

| source | file(s) | prompt | reference (the set's own answer) |
|---|---|---|---|
| ``gpteacher-codegen`` | ``gpteacher/codegen-instruct.json`` | instruction + input | response |
| ``gpteacher-roleplay`` | ``gpteacher/roleplay-simple-deduped-roleplay-instruct.json`` | instruction + input | response |
| ``alpaca-libre`` | ``alpaca_libre/alpaca_libre_tasks_v{1,2,3}.jsonl`` (``status == "ok"``) | instruction + input | output |
| ``oasst1`` | ``oasst1_en_validation/en-validation.jsonl`` (root user messages) | text | best-ranked reply |
| ``oasst-samples`` | ``oasst_prompt_samples/*.jsonl`` (one JSON string a line) | the string | none |
| ``self-instruct-seed`` | ``self_instruct_seed/seed_tasks.jsonl`` | instruction + first input | first output |

Every prompt gets a stable id (``source/index``) and a split: ``validation`` for a fixed
share chosen by a hash of the id, ``train`` for the rest, so that held-out measurements never
see a training prompt, however many prompts a run takes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError

VALIDATION_SHARE = 0.05  # of every source, by a hash of the prompt id


@dataclass(frozen=True, slots=True)
class TrainPrompt:
    id: str  # "source/index", stable across runs
    source: str
    text: str  # the user message
    reference: str | None  # the set's own answer, for teacher forcing (None: the set has none)

    @property
    def split(self) -> str:
        digest = hashlib.sha256(self.id.encode()).digest()
        return "validation" if int.from_bytes(digest[:4], "big") < VALIDATION_SHARE * 2**32 else "train"


def _join(instruction: Any, extra: Any) -> str:
    text = str(instruction or "").strip()
    extra = str(extra or "").strip()
    return f"{text}\n\n{extra}" if extra else text


def _json_lines(path: Path) -> Iterator[Any]:
    """The records of a JSON-lines file; a line that is not JSON only because of the empty
    string written as ``""""`` (14 lines of Alpaca-Libre v2) is repaired, any other is skipped."""
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                try:
                    yield json.loads(line.replace('""""', '""'))
                except json.JSONDecodeError:
                    continue


def _gpteacher(name: str) -> Callable[[Path], list[tuple[str, str | None]]]:
    def read(path: Path) -> list[tuple[str, str | None]]:
        records = json.loads(path.read_text(encoding="utf-8"))
        return [(_join(r.get("instruction"), r.get("input")), r.get("response")) for r in records]
    return read


def _alpaca(path: Path) -> list[tuple[str, str | None]]:
    return [(_join(r.get("instruction"), r.get("input")), r.get("output")) for r in _json_lines(path)
            if isinstance(r, dict) and r.get("status") == "ok"]


def _oasst1(path: Path) -> list[tuple[str, str | None]]:
    messages = [m for m in _json_lines(path) if isinstance(m, dict) and not m.get("deleted")]
    best: dict[str, tuple[float, str]] = {}  # parent id -> (rank, text) of its best-ranked reply
    for m in messages:
        if m.get("role") == "assistant" and m.get("parent_id"):
            rank = m.get("rank") if isinstance(m.get("rank"), (int, float)) else 1e9
            if m["parent_id"] not in best or rank < best[m["parent_id"]][0]:
                best[m["parent_id"]] = (rank, m.get("text", ""))
    return [(m.get("text", ""), best.get(m.get("message_id"), (0, None))[1]) for m in messages
            if m.get("role") == "prompter" and m.get("parent_id") is None]


def _strings(path: Path) -> list[tuple[str, str | None]]:
    return [(s, None) for s in _json_lines(path) if isinstance(s, str)]


def _self_instruct(path: Path) -> list[tuple[str, str | None]]:
    out = []
    for r in _json_lines(path):
        first = (r.get("instances") or [{}])[0] if isinstance(r, dict) else {}
        out.append((_join(r.get("instruction"), first.get("input")), first.get("output")))
    return out


SOURCES: dict[str, tuple[tuple[str, ...], Callable[[Path], list[tuple[str, str | None]]]]] = {
    "gpteacher-codegen": (("gpteacher/codegen-instruct.json",), _gpteacher("codegen")),
    "gpteacher-roleplay": (("gpteacher/roleplay-simple-deduped-roleplay-instruct.json",), _gpteacher("roleplay")),
    "alpaca-libre": (tuple(f"alpaca_libre/alpaca_libre_tasks_v{v}.jsonl" for v in (1, 2, 3)), _alpaca),
    "oasst1": (("oasst1_en_validation/en-validation.jsonl",), _oasst1),
    "oasst-samples": (("oasst_prompt_samples/prompt_lottery_en_250_text.jsonl",
                       "oasst_prompt_samples/en_100_text.jsonl"), _strings),
    "self-instruct-seed": (("self_instruct_seed/seed_tasks.jsonl",), _self_instruct),
}


def load_training_prompts(root: str | Path, sources: tuple[str, ...] | None = None) -> list[TrainPrompt]:
    """Every distinct prompt of the known sets found under ``root``, interleaved across sources
    (so that any first N prompts mix them), each once (a prompt text seen in an earlier source
    is dropped)."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise SpecdraftError(f"training prompts folder not found: {root}")
    unknown = [s for s in sources or () if s not in SOURCES]
    if unknown:
        raise SpecdraftError(f"unknown training source {unknown[0]!r}; known: {', '.join(SOURCES)}")
    per_source: list[list[TrainPrompt]] = []
    seen: set[str] = set()
    for name in sources or tuple(SOURCES):
        files, read = SOURCES[name]
        prompts = []
        for rel in files:
            path = root / rel
            if not path.is_file():
                continue
            try:
                pairs = read(path)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError, TypeError) as e:
                raise SpecdraftError(f"{path}: cannot read it as {name} ({type(e).__name__})") from None
            for text, reference in pairs:
                text = text.strip()
                if text and text not in seen:
                    seen.add(text)
                    prompts.append(TrainPrompt(f"{name}/{len(prompts)}", name, text,
                                               reference if isinstance(reference, str) and reference.strip() else None))
        per_source.append(prompts)
    if not any(per_source):
        raise SpecdraftError(f"no training prompts found under {root} (expected any of: "
                             f"{', '.join(f for files, _ in SOURCES.values() for f in files)})")
    return _interleave(per_source)


def _interleave(groups: list[list[TrainPrompt]]) -> list[TrainPrompt]:
    """Round-robin by each source's share: source s with n_s prompts is taken at the rate
    n_s / total, so a prefix of the list has the same mix as the whole."""
    total = sum(len(g) for g in groups)
    keyed = [((i + 0.5) / len(g), s, p) for s, g in enumerate(groups) for i, p in enumerate(g)]
    return [p for _, _, p in sorted(keyed, key=lambda x: (x[0], x[1]))][:total]
