"""Equivalence check: speculative output must equal plain output, byte for byte, at
temperature 0. Conversations run turn by turn; a turn is compared only while every earlier
turn matched (otherwise the contexts differ)."""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdraft.api import build_engine
from specdraft.bench.machine import machine_info
from specdraft.engine import Engine
from specdraft.metrics import SpecStats
from specdraft.model.loader import load
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

    @property
    def mismatch_rate(self) -> float:
        return len(self.mismatches) / self.prompts if self.prompts else 0.0


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
                   report: VerifyReport) -> None:
    messages: list[dict[str, str]] = []
    report.prompts += 1
    for turn, user in enumerate(prompt.turns):
        messages.append({"role": "user", "content": user})
        ids, cut = fit_messages(plain.tokenizer, messages, max_prompt, prompt.id)
        report.truncated_prompts += int(cut and turn == 0)
        ref = plain.generate([ids], gen)[0]
        got = spec.generate([ids], gen, stats=report.stats)[0]
        report.turns += 1
        if ref.text.encode() != got.text.encode() or ref.tokens != got.tokens:
            report.mismatches.append(Mismatch(prompt.id, prompt.workload, turn, first_difference(ref.tokens, got.tokens),
                                              first_difference(ref.text, got.text), ref.text, got.text))
            return
        report.matched_turns += 1
        messages.append({"role": "assistant", "content": ref.text})


def run_verify(cfg: VerifyConfig) -> VerifyReport:
    loaded = load(cfg.model, dtype=cfg.dtype, device=cfg.device)
    plain = build_engine(loaded, "plain")
    spec = build_engine(loaded, cfg.method, k=cfg.k, policy=cfg.policy, options=dict(cfg.options))
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens)
    max_prompt = loaded.config.max_context - cfg.max_new_tokens - cfg.k - 2
    prompts = select_prompts(cfg)
    report = VerifyReport()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # truncation is counted and reported below
        for prompt in tqdm(prompts, desc=f"verify {cfg.method}", unit="prompt", file=sys.stderr):
            compare_prompt(prompt, plain, spec, gen, max_prompt, report)
    print(format_report(cfg, report))
    if cfg.out:
        path = Path(cfg.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"config": asdict(cfg), "machine": machine_info(cfg.device),
                                    "prompts": report.prompts, "turns": report.turns,
                                    "matched_turns": report.matched_turns,
                                    "truncated_prompts": report.truncated_prompts,
                                    "mismatch_rate": report.mismatch_rate,
                                    "mismatches": [asdict(m) for m in report.mismatches],
                                    "stats": report.stats.to_dict()}, indent=2))
        print(f"wrote {path}")
    return report


def format_report(cfg: VerifyConfig, r: VerifyReport) -> str:
    lines = [
        f"method {cfg.method} ({cfg.dtype}, k={cfg.k}, policy {cfg.policy}), greedy, {cfg.max_new_tokens} new tokens per turn",
        f"prompts: {r.prompts} ({r.truncated_prompts} cut to fit the context), turns compared: {r.turns}",
        f"identical: {r.prompts - len(r.mismatches)}/{r.prompts} prompts; mismatch rate {r.mismatch_rate:.1%}",
        f"speculation: tau {r.stats.tau:.2f}, acceptance {r.stats.acceptance_rate:.1%}",
    ]
    for m in r.mismatches[:20]:
        lines.append(f"  MISMATCH {m.prompt_id} ({m.workload}) turn {m.turn + 1}: first difference at token "
                     f"{m.token_index}, char {m.char_index}: plain {m.plain[m.char_index:m.char_index + 30]!r} "
                     f"vs speculative {m.speculative[m.char_index:m.char_index + 30]!r}")
    return "\n".join(lines)
