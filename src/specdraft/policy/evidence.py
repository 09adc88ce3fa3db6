"""What drafting gains: expected tokens per pass from a per-token acceptance alpha, a batch's
progress, and the decayed accept/reject counts the policy keeps per row, label and in total."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

PROBE_GAP_MAX = 64  # the longest wait between probes (steps), after probes that found nothing
LABEL_DECAY = 0.98  # per-label evidence is pooled over many requests: it may remember longer

def progress(expected: Seq[float], remaining: Seq[int] | None) -> float:
    """How fast a batch moves in one step where live row i emits expected[i] tokens: the sum
    (throughput) without ``remaining``; with it (a static batch, r[i] tokens left per row), the
    share of its remaining work the slowest row does, min_i expected[i] / r[i], so that
    progress / cost is the inverse of the time to the batch's end."""
    if not expected:
        return 0.0
    if remaining is None:
        return float(sum(expected))
    return min(e / max(r, 1) for e, r in zip(expected, remaining))


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per pass with a k-token chain and per-token acceptance alpha."""
    if alpha >= 1:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass(slots=True)
class Evidence:
    accepted: float = 0.0
    rejected: float = 0.0
    prior: float | None = None  # the alpha before any evidence (None: the config's)

    @property
    def outcomes(self) -> float:
        return self.accepted + self.rejected

    def alpha(self, prior: float) -> float:
        p = prior if self.prior is None else self.prior
        return (self.accepted + p) / (self.accepted + self.rejected + 1.0)


@dataclass(slots=True)
class Hold:
    """A request's own brake: ``streak`` drafts in a row that had no token accepted; once it
    reaches ``stop_after`` the row stops drafting for ``wait`` steps (``gap``, doubled after
    each failed retry up to ``PROBE_GAP_MAX``, back to ``probe_every`` once a draft pays)."""

    gap: int
    streak: int = 0
    wait: int = 0

    def observe(self, accepted: int, stop_after: int, base_gap: int) -> None:
        if accepted > 0:
            self.streak, self.gap, self.wait = 0, base_gap, 0
            return
        self.streak += 1
        if self.streak >= stop_after:
            self.wait, self.gap = self.gap, min(2 * self.gap, PROBE_GAP_MAX)



def decay_add(e: Evidence, decay: float, accepted: float, rejected: float) -> None:
    e.accepted = decay * e.accepted + accepted
    e.rejected = decay * e.rejected + rejected
