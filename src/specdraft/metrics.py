"""Speculation statistics, defined once.

- *steps*: target forward passes after the prefill (one verification each; plain decoding
  makes one step per token).
- *emitted*: tokens those steps added to the output (accepted draft tokens + the bonus token,
  fewer when a request ends inside an accepted run).
- *tau* (mean accepted length): emitted / steps, bonus included; plain decoding scores 1.00.
- *proposed* / *accepted*: draft nodes offered / draft nodes kept; *acceptance rate* =
  accepted / proposed.
- per draft position d (depth d in a tree, d = 1 first): ``drafts_at[d]`` = steps whose draft
  reached depth d, ``accepted_at[d]`` = steps that accepted a token at depth d; the rate at d
  is their ratio (as vLLM reports it).
- time: prefill, propose (proposer), verify (target forward), other (acceptance, cache
  commit, detokenizing, bookkeeping); decode = propose + verify + other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from specdraft.accept import Acceptance
from specdraft.draft import Draft


@dataclass(slots=True)
class SpecStats:
    steps: int = 0
    emitted: int = 0
    proposed: int = 0
    accepted: int = 0
    drafts_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    emitted_hist: list[int] = field(default_factory=list)  # [n] = steps of one request that emitted n tokens
    proposer_bytes: int = 0  # the proposer's own memory (pools, indexes, draft caches), peak
    prefill_s: float = 0.0
    propose_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0

    def record(self, draft: Draft, acceptance: Acceptance, emitted: int) -> None:
        """One step of one request: its draft, what was accepted, how many tokens it kept."""
        self.steps += 1
        self.emitted += emitted
        self.proposed += len(draft)
        self.accepted += acceptance.accepted
        depth = max(draft.depths(), default=0)
        _bump(self.drafts_at, depth)
        _bump(self.accepted_at, acceptance.accepted)
        if emitted >= len(self.emitted_hist):
            self.emitted_hist.extend([0] * (emitted + 1 - len(self.emitted_hist)))
        self.emitted_hist[emitted] += 1

    def merge(self, other: "SpecStats") -> None:
        for name in ("steps", "emitted", "proposed", "accepted", "prefill_s", "propose_s", "verify_s", "other_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.proposer_bytes = max(self.proposer_bytes, other.proposer_bytes)
        pairs = ((self.drafts_at, other.drafts_at), (self.accepted_at, other.accepted_at),
                 (self.emitted_hist, other.emitted_hist))
        for mine, theirs in pairs:
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n

    @property
    def decode_s(self) -> float:
        return self.propose_s + self.verify_s + self.other_s

    @property
    def tau(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Per draft position (1, 2, ...): the share of drafts reaching it that had it accepted
        (positions nothing was ever accepted at count 0.0; they are not dropped)."""
        accepted = self.accepted_at + [0] * (len(self.drafts_at) - len(self.accepted_at))
        return [a / d if d else 0.0 for a, d in zip(accepted, self.drafts_at)]

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(tau=self.tau, acceptance_rate=self.acceptance_rate, decode_s=self.decode_s,
                 acceptance_by_position=self.acceptance_by_position, tokens_per_s=self.tokens_per_s)
        return d

    def summary(self) -> str:
        pos = ", ".join(f"{r:.2f}" for r in self.acceptance_by_position[:8])
        return (
            f"{self.emitted} tokens in {self.steps} target passes (tau {self.tau:.2f}); "
            f"accepted {self.accepted}/{self.proposed} proposed ({self.acceptance_rate:.1%}); "
            f"by position [{pos}]; time: propose {self.propose_s:.2f} s, verify {self.verify_s:.2f} s, "
            f"other {self.other_s:.2f} s, prefill {self.prefill_s:.2f} s"
        )


def _bump(counts: list[int], depth: int) -> None:
    """Count one at every position 1..depth (stored at index position - 1)."""
    if depth > len(counts):
        counts.extend([0] * (depth - len(counts)))
    for i in range(depth):
        counts[i] += 1
