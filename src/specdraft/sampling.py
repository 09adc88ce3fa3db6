"""Sampling settings and the one function that turns logits into the distribution we sample.

Plain decoding and the speculative verifier both call :func:`probabilities`, so a verified
token is drawn from exactly the distribution plain decoding would have used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from specdraft.errors import SamplingError


@dataclass(frozen=True, slots=True)
class Sampling:
    """temperature 0 = greedy (argmax; top_k/top_p ignored). top_k 0 = off. top_p 1 = off.
    seed None = a random seed, drawn once per request."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise SamplingError(f"seed must be a non-negative integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


def probabilities(logits: Tensor, sampling: Sampling) -> Tensor:
    """The distribution a token is drawn from: temperature, then top-k, then top-p.

    logits: [..., V] (any float dtype). Returns [..., V] float32 summing to 1. Greedy returns
    the one-hot distribution of the argmax (the first index among ties).
    """
    logits = logits.float()
    if sampling.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    scaled = logits / sampling.temperature
    if 0 < sampling.top_k < scaled.shape[-1]:
        kth = scaled.topk(sampling.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1:
        probs = _top_p(probs, sampling.top_p)
    return probs


def _top_p(probs: Tensor, top_p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [..., V]
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [..., V]
    keep_sorted = mass_before < top_p
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """Draw one token per row. probs: [N, V] -> [N] int64."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def next_tokens(logits: Tensor, sampling: Sampling, generator: torch.Generator | None) -> Tensor:
    """logits: [N, V] -> tokens [N]; greedy never touches the generator."""
    if sampling.greedy:
        return logits.argmax(-1)
    return sample(probabilities(logits, sampling), generator)


def make_generator(sampling: Sampling, device: torch.device | str) -> torch.Generator:
    """A per-request generator: the same seed gives the same tokens on the same device."""
    g = torch.Generator(device=device)
    g.manual_seed(sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return g
