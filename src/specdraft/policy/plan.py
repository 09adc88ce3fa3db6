"""One step's decision, handed from ``Policy.budgets`` (before the proposer runs) to
``Policy.trim`` (after it), and the evidence a probe gathers until the next step settles it."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Literal

Mode = Literal["fixed", "draft", "probe", "look"]


@dataclass(frozen=True, slots=True)
class Plan:
    """budgets[row]: draft tokens the row may have (0: none). batch: rows in the step's forward
    (its cost depends on it). remaining[row]: tokens the row may still emit, for a static batch
    (None: a refilled batch, weighed by throughput). mode says what ``trim`` does with the drafts:

    - "fixed": the fixed policy; drafts are kept as they come;
    - "draft": the budgets are the gated choice; trim cuts every draft to what pays for the batch;
    - "probe": drafts for evidence after idle steps; trim keeps them (labels and brakes aside) and
      records what they must gain to repay the probe;
    - "look": a cheap proposer drafts the full k before any gating; trim gates on the drafts seen
      (and may turn the step into a probe)."""

    budgets: list[int]
    batch: int
    mode: Mode = "draft"
    remaining: Seq[int] | None = None

    @classmethod
    def none(cls, rows: int) -> "Plan":
        """No drafts for any row (plain decoding)."""
        return cls([0] * rows, rows, "fixed")


@dataclass(slots=True)
class Probe:
    """A probe in flight: the accepted tokens its drafts needed to run at plain decoding's rate
    (``needs``) and those they got (``gain``), until the next ``budgets`` settles it."""

    needs: float = 0.0
    gain: float = 0.0

    @property
    def paid(self) -> bool:
        return self.gain > 0 and self.gain >= self.needs
