"""Batched generation: ragged prompts, per-request sampling and stop conditions, streaming.

This module holds what every decoding method shares (prefill, the sequences, streaming and
timing). Plain decoding is the one-token-per-step loop below.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence as Seq
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdraft.errors import ContextOverflowError, SpecdraftError
from specdraft.model.kv_cache import KVCache
from specdraft.model.tokenizer import Tokenizer
from specdraft.model.transformer import Transformer
from specdraft.sampling import GREEDY, Sampling, make_generator, next_tokens
from specdraft.sequence import GenerationConfig, Sequence

PREFILL_CHUNK = 512  # prompt tokens per forward during prefill (bounds the attention scores' memory)


@dataclass(frozen=True, slots=True)
class StreamEvent:
    row: int
    text: str  # newly final text of that row (may be "")
    finished: bool


@dataclass(slots=True)
class RunStats:
    """Wall-clock split of one generate() call."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    forward_passes: int = 0  # target forward passes after prefill
    new_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass(slots=True)
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str
    stats: RunStats = field(default_factory=RunStats)


class Engine:
    """Owns a target model and its tokenizer; each generate() call gets its own KV cache."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, draft_headroom: int = 0) -> None:
        if tokenizer.vocab_size > model.config.vocab_size:
            raise SpecdraftError(
                f"tokenizer has {tokenizer.vocab_size} tokens but the model only {model.config.vocab_size}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.draft_headroom = draft_headroom  # cache positions kept free for draft tokens

    # -- set-up -----------------------------------------------------------------------------
    def start(
        self,
        prompts: Seq[Seq[int]],
        config: GenerationConfig,
        sampling: Sampling | Seq[Sampling] = GREEDY,
    ) -> tuple[list[Sequence], KVCache]:
        """Validate prompts and build the sequences and a cache sized for them."""
        if not prompts:
            raise SpecdraftError("no prompts given")
        samplings = [sampling] * len(prompts) if isinstance(sampling, Sampling) else list(sampling)
        if len(samplings) != len(prompts):
            raise SpecdraftError(f"{len(samplings)} sampling settings for {len(prompts)} prompts")
        limit = self.model.config.max_context
        for i, p in enumerate(prompts):
            if not p:
                raise SpecdraftError(f"prompt {i} is empty")
            if len(p) >= limit:
                raise ContextOverflowError(
                    f"prompt {i} has {len(p)} tokens; the model's context is {limit} "
                    f"(at least one position must remain for generation)"
                )
            if max(p) >= self.model.config.vocab_size or min(p) < 0:
                raise SpecdraftError(f"prompt {i} has a token id outside the vocabulary")
        longest = max(len(p) for p in prompts)
        capacity = min(limit, longest + config.max_new_tokens + self.draft_headroom + 1)
        seqs = [
            Sequence(
                prompt=list(p),
                config=config,
                tokenizer=self.tokenizer,
                sampling=s,
                generator=None if s.greedy else make_generator(s, self.model.device),
                capacity=min(limit, len(p) + config.max_new_tokens + 1),
            )
            for p, s in zip(prompts, samplings)
        ]
        return seqs, self.model.new_cache(len(prompts), capacity)

    # -- shared steps -----------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], cache: KVCache, chunk: int = PREFILL_CHUNK) -> Tensor:
        """Feed whole prompts (right-padded, in chunks; padding is rolled back) and return the
        logits after each prompt's last token: [B, V]."""
        device = self.model.device
        lengths = [len(s.prompt) for s in seqs]
        width = max(lengths)
        padded = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            padded[i, : len(s.prompt)] = torch.tensor(s.prompt)
        last_hidden = torch.zeros(len(seqs), self.model.config.hidden_size, dtype=self.model.dtype, device=device)
        for start in range(0, width, chunk):
            t = min(chunk, width - start)
            tokens = padded[:, start : start + t].to(device)  # [B, t]
            positions = torch.tensor(cache.lengths, device=device)[:, None] + torch.arange(t, device=device)
            out = self.model(tokens, positions, cache, logits=False)
            for i, n in enumerate(lengths):
                if start <= n - 1 < start + t:
                    last_hidden[i] = out.last_hidden[i, n - 1 - start]
            cache.truncate([min(n, start + t) for n in lengths])
        return self.model.lm_logits(last_hidden)

    def choose(self, logits: Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row from its last logits: [B, V] -> B ids."""
        if all(s.sampling.greedy for s in seqs):
            return logits.argmax(-1).tolist()
        return [int(next_tokens(logits[i : i + 1], s.sampling, s.generator)) for i, s in enumerate(seqs)]

    # -- plain decoding ---------------------------------------------------------------------
    def stream(
        self,
        prompts: Seq[Seq[int]],
        config: GenerationConfig = GenerationConfig(),
        sampling: Sampling | Seq[Sampling] = GREEDY,
        stats: RunStats | None = None,
    ) -> Iterator[StreamEvent]:
        """Plain decoding, one token per row per forward pass, yielding text as it becomes final."""
        seqs, cache = self.start(prompts, config, sampling)
        yield from self._run(seqs, cache, stats if stats is not None else RunStats())

    @torch.inference_mode()
    def _run(self, seqs: list[Sequence], cache: KVCache, stats: RunStats) -> Iterator[StreamEvent]:
        t0 = time.perf_counter()
        logits = self.prefill(seqs, cache)
        stats.prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        while True:
            chosen = self.choose(logits, seqs)
            for row, (s, tok) in enumerate(zip(seqs, chosen)):
                if s.finished:
                    continue
                stats.new_tokens += s.append([tok])
                delta = s.take_stream()
                if delta or s.finished:
                    yield StreamEvent(row, delta, s.finished)
            if all(s.finished for s in seqs):
                break
            logits = self._decode_step(seqs, cache, chosen)
            stats.forward_passes += 1
        stats.decode_s = time.perf_counter() - t0

    def _decode_step(self, seqs: list[Sequence], cache: KVCache, last: list[int]) -> Tensor:
        device = self.model.device
        before = list(cache.lengths)
        tokens = torch.tensor(last, device=device)[:, None]  # [B, 1]
        positions = torch.tensor(before, device=device)[:, None]  # [B, 1]
        logits = self.model(tokens, positions, cache).logits[:, -1]  # [B, V]
        cache.truncate([n if s.finished else n + 1 for n, s in zip(before, seqs)])
        return logits

    def generate(
        self,
        prompts: Seq[Seq[int]],
        config: GenerationConfig = GenerationConfig(),
        sampling: Sampling | Seq[Sampling] = GREEDY,
        on_text: Callable[[StreamEvent], None] | None = None,
    ) -> list[GenerationResult]:
        stats = RunStats()
        seqs, cache = self.start(prompts, config, sampling)
        for event in self._run(seqs, cache, stats):
            if on_text is not None:
                on_text(event)
        return [
            GenerationResult(s.text, list(s.output), len(s.prompt), s.finish_reason or "length", stats)
            for s in seqs
        ]
