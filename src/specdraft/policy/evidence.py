"""What drafting gains: expected tokens per pass from a per-token acceptance alpha, a batch's
progress, and the decayed accept/reject counts the policy keeps per row, label and in total."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

PROBE_GAP_MAX = 64  # the longest wait between probes (steps), after probes that found nothing
LABEL_DECAY = 0.98  # per-label evidence is pooled over many requests: it may remember longer
REALISM_MAX = 1.5  # drafts that beat the chain model's expectation raise it by at most this factor

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


@dataclass(slots=True)
class Realism:
    """Decayed sums of the extra tokens the policy expected from the drafts it kept (each step's
    chosen depth, per ``expected_tokens``) and of those the target accepted. Their ratio scales
    what later drafts are expected to add: the chain model (every position accepted with the
    same alpha, the evidence of whichever labels happen to draft) is optimistic where drafts are
    selected for looking good, and a step that is priced as a gain must be one."""

    expected: float = 0.0
    accepted: float = 0.0
    prior: float = 2.0  # tokens of evidence that the model is right (before any)

    def decay(self, decay: float) -> None:
        """One step older."""
        self.expected *= decay
        self.accepted *= decay

    def observe(self, expected: float, accepted: int) -> None:
        """A kept draft was expected to add ``expected`` tokens; ``accepted`` were."""
        self.expected += expected
        self.accepted += accepted

    @property
    def factor(self) -> float:
        """Accepted per expected extra token (1 before any evidence; at most ``REALISM_MAX``)."""
        return min((self.accepted + self.prior) / (self.expected + self.prior), REALISM_MAX)

    def scale(self, expected: float) -> float:
        """Tokens per pass ``expected`` by the model, corrected: 1 + factor x the extra ones."""
        return 1.0 + self.factor * (expected - 1.0)
