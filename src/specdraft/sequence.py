"""Per-request state: the tokens so far, stop conditions and the streamed text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from specdraft.errors import SpecdraftError
from specdraft.metrics import SpecStats
from specdraft.model.tokenizer import IncrementalDetokenizer, Tokenizer
from specdraft.sampling import GREEDY, Sampling

FinishReason = Literal["eos", "stop", "length", "context"]


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    """Limits that end a request. A request ends at the first of: an end-of-sequence token
    (unless ``ignore_eos``), a stop string (the text is cut before it), ``max_new_tokens``,
    or the end of the context/cache."""

    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SpecdraftError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SpecdraftError("stop strings must be non-empty strings")


@dataclass(slots=True)
class Sequence:
    """One request in flight. ``tokens`` is the prompt followed by the generated ids (EOS
    excluded); it only grows, so proposers can index it incrementally."""

    prompt: list[int]
    config: GenerationConfig
    tokenizer: Tokenizer
    sampling: Sampling = GREEDY
    generator: torch.Generator | None = None
    capacity: int = 0  # positions this row may use in the KV cache
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # decoded output text (cut at a stop string)
    streamed: int = 0  # characters of `text` already handed to the caller
    finish_reason: FinishReason | None = None
    stats: SpecStats = field(default_factory=SpecStats)  # this request's share (no timings)
    _detok: IncrementalDetokenizer | None = None

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)
        self._detok = IncrementalDetokenizer(self.tokenizer, prompt=self.prompt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def room(self) -> int:
        """How many more tokens may still be emitted."""
        return min(self.config.max_new_tokens - self.generated, self.capacity - len(self.tokens))

    def append(self, new: list[int]) -> int:
        """Add emitted tokens, stopping at the first end condition. Returns how many of
        ``new`` were used, an ending EOS token included (it is not added to ``tokens``); the
        rest, after an end condition, are dropped."""
        kept = 0
        for token in new:
            if not self.config.ignore_eos and token in self.tokenizer.eos_ids:
                self.finish_reason = "eos"
                kept += 1
                break
            self.tokens.append(token)
            kept += 1
            before = len(self.text)
            self.text += self._detok.push([token])
            if self._hit_stop_string(before):
                break
            if self.generated >= self.config.max_new_tokens:
                self.finish_reason = "length"
                break
            if len(self.tokens) >= self.capacity:
                self.finish_reason = "context"
                break
        if self.finished and self.finish_reason != "stop":
            self.text += self._detok.flush()
        return kept

    def _hit_stop_string(self, before: int) -> bool:
        """Look for a stop string ending in the text added after position ``before``."""
        if not self.config.stop:
            return False
        longest = max(map(len, self.config.stop))
        window_start = max(0, before - longest + 1)
        hits = [i for s in self.config.stop if (i := self.text.find(s, window_start)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.finish_reason = "stop"
        return True

    def take_stream(self) -> str:
        """Text that is final and not yet streamed. Text that could still be the start of a
        stop string is held back until the request ends or it can no longer match."""
        end = len(self.text)
        if not self.finished and self.config.stop:
            end = max(self.streamed, end - max(map(len, self.config.stop)) + 1)
        delta = self.text[self.streamed : end]
        self.streamed = end
        return delta
