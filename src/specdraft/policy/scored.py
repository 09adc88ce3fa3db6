"""Drafts whose nodes carry the proposer's confidence (``Draft.confidence``: EAGLE's and MTP's
path probabilities).

A node is accepted when its whole path is, so a draft's expected accepted tokens are the sum,
over its nodes, of the probability that each is accepted. The proposer's confidence estimates
that probability; ``Calibration`` corrects it per draft depth with what was accepted (the
decayed accepted count at depth d over the decayed confidence offered there). Keeping the n
most confident nodes of a draft then yields ``gains(draft)[n]`` accepted tokens in expectation
(plus the bonus token), which is what the policy weighs against the verification of n nodes.
``Outlook`` remembers a row's recent gains per n, so that the budget can be chosen before
the proposer runs. It starts from a prior (a chain's yield at the policy's prior alpha, worth a
few drafts) and a row's record starts with a few tokens of trust: judged on its first unlucky
draft or two, a proposer stopped drafting and never saw the drafts that would have shown it pays
(MTP on qa at batch 1: no draft in 284 steps, 0.99x; with the priors 1.39x, tau 1.98).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdraft.accept import Acceptance
from specdraft.draft import Draft

PRIOR_MASS = 2.0  # confidence mass at scale 1 each depth starts with: trust the proposer at first


@dataclass(slots=True)
class Calibration:
    """Per draft depth d (index d - 1): the confidence put on offered nodes and the nodes
    accepted, both decayed once per observed draft."""

    offered: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def observe(self, draft: Draft, acceptance: Acceptance, decay: float) -> None:
        if draft.confidence is None or not len(draft):
            return
        depths = draft.depths()
        missing = max(depths) - len(self.offered)
        if missing > 0:
            self.offered += [0.0] * missing
            self.accepted += [0.0] * missing
        self.offered = [decay * x for x in self.offered]
        self.accepted = [decay * x for x in self.accepted]
        for c, d in zip(draft.confidence, depths):
            self.offered[d - 1] += c
        for node in acceptance.path:
            self.accepted[depths[node] - 1] += 1.0

    def scale(self, depth: int) -> float:
        """Accepted nodes per unit of confidence at this depth (1 before any evidence)."""
        if depth > len(self.offered):
            return 1.0
        return (self.accepted[depth - 1] + PRIOR_MASS) / (self.offered[depth - 1] + PRIOR_MASS)

    def gains(self, draft: Draft) -> list[float]:
        """[N + 1]: expected accepted tokens when the n most confident nodes are kept, n = 0..N."""
        assert draft.confidence is not None
        depths = draft.depths()
        out = [0.0]
        for i in draft.by_confidence():
            out.append(out[-1] + min(1.0, self.scale(depths[i]) * draft.confidence[i]))
        return out


@dataclass(slots=True)
class Outlook:
    """Decayed mean, over recent drafts, of ``gains[n]`` (n = 0..the longest draft seen); each
    n is averaged over the drafts that had n nodes to keep. ``accepted`` / ``expected``: the
    row's own record, decayed sums of what its verified drafts yielded against what they were
    expected to; their ratio scales the gains (a request the proposer is too sure about
    drafts less, one it is too shy about more)."""

    gains: list[float] = field(default_factory=lambda: [0.0])
    weight: list[float] = field(default_factory=lambda: [0.0])
    accepted: float = 0.0
    expected: float = 0.0
    trust: float = 1.0  # tokens of evidence, before the row's own record, that its drafts yield what was expected

    @property
    def known(self) -> bool:
        return len(self.gains) > 1

    @classmethod
    def prior(cls, alpha: float, k: int, weight: float, trust: float) -> "Outlook":
        """Before any scored draft: a chain's yield with per-node acceptance ``alpha`` for n = 0..k
        nodes, worth ``weight`` drafts. Estimated from a few drafts alone, an outlook can
        start so low that the policy stops drafting and never sees the evidence that would lift it
        (drafts' yields vary several-fold from one to the next)."""
        gains = [alpha * (1.0 - alpha**n) / (1.0 - alpha) for n in range(k + 1)]
        return cls(gains, [weight] * (k + 1), trust=trust)

    def add(self, gains: list[float], decay: float) -> None:
        missing = len(gains) - len(self.gains)
        if missing > 0:
            self.gains += [0.0] * missing
            self.weight += [0.0] * missing
        for n, g in enumerate(gains):
            w = decay * self.weight[n]
            self.gains[n] = (w * self.gains[n] + g) / (w + 1.0)
            self.weight[n] = w + 1.0

    def observe(self, expected: float, accepted: int, decay: float) -> None:
        """A verified draft was expected to yield ``expected`` tokens and yielded ``accepted``."""
        self.expected = decay * self.expected + expected
        self.accepted = decay * self.accepted + accepted

    @property
    def realism(self) -> float:
        """The row's accepted tokens per expected one (1 before any evidence)."""
        return (self.accepted + self.trust) / (self.expected + self.trust)

    def at(self, n: int) -> float:
        """Expected accepted tokens keeping n nodes: the best of the means up to n (a draft
        with more nodes to keep never yields less), scaled by the row's realism."""
        return min(float(n), max(self.gains[: max(n, 0) + 1]) * self.realism)

    def restart(self, weight: float = 1.0) -> "Outlook":
        """A new row's outlook: these means, weighted as at most ``weight`` drafts (its own drafts
        soon lead), and no record of its own yet."""
        return Outlook(list(self.gains), [min(w, weight) for w in self.weight], trust=self.trust)
