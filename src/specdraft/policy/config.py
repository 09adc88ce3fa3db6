"""The policy's settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specdraft.errors import SpecdraftError


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """kind: "fixed" always drafts k tokens; "adaptive" chooses 0..k per step (see module doc).
    decay: weight kept by older draft outcomes at each new one. prior: alpha before any
    evidence (worth one draft position). probe_every / probe_cost / look_cost: see the module doc.
    objective: "batch-end" weighs a step by how much sooner a static batch ends (when the
    caller passes remaining tokens; ``Engine.generate`` does), "throughput" by the tokens it
    emits (for a batch that is refilled as rows finish)."""

    kind: Literal["fixed", "adaptive"] = "adaptive"
    k: int = 8
    objective: Literal["batch-end", "throughput"] = "batch-end"
    decay: float = 0.9
    prior: float = 0.5
    probe_every: int = 8
    probe_cost: float = 1.6
    look_cost: float = 0.05  # a proposer this cheap (share of a plain step) drafts before the gate; 0 = never
    label_min: float = 8.0  # outcomes a draft label needs before its own alpha trims its drafts (and
    # all requests pooled before their alpha replaces `prior` for new requests)
    stop_after: int = 4  # a request whose last this many drafts all failed stops drafting for a while
    margin: float = 0.05  # speculation must be expected to beat plain decoding by this share (the
    # estimates' error: a step priced as a 2% gain can be a 5% loss, which a busy server must not take)
    outlook_prior: float = 4.0  # scored drafts: drafts' worth of weight of the prior outlook (a chain at
    # `prior`) in the pooled means and in a new request's (0: no prior; a request starts from the pooled
    # means weighted as one draft)
    trust: float = 3.0  # scored drafts: tokens of evidence, before a request's own record, that its drafts
    # yield what their calibrated confidences expect

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "adaptive"):
            raise SpecdraftError(f"policy must be 'fixed' or 'adaptive', got {self.kind!r}")
        if not isinstance(self.k, int) or not 1 <= self.k <= 256:
            raise SpecdraftError(f"draft length k must be an integer in 1..256, got {self.k!r}")
        if not 0 < self.decay < 1 or not 0 < self.prior < 1:
            raise SpecdraftError("policy decay and prior must be in (0, 1)")
        if self.objective not in ("batch-end", "throughput"):
            raise SpecdraftError(f"policy objective must be 'batch-end' or 'throughput', got {self.objective!r}")
        if not 0 <= self.look_cost <= 1:
            raise SpecdraftError(f"policy look_cost must be in [0, 1], got {self.look_cost!r}")
        if self.probe_every < 1 or self.probe_cost < 1:
            raise SpecdraftError("probe_every must be >= 1 and probe_cost >= 1")
        if not 0 <= self.margin < 1:
            raise SpecdraftError(f"policy margin must be in [0, 1), got {self.margin!r}")
        if self.outlook_prior < 0 or self.trust <= 0:
            raise SpecdraftError(f"policy outlook_prior must be >= 0 and trust > 0, got {self.outlook_prior!r}, {self.trust!r}")
        if self.stop_after < 1:
            raise SpecdraftError(f"policy stop_after must be >= 1, got {self.stop_after!r}")

    @property
    def probe_k(self) -> int:
        return max(1, self.k // 2)
