"""How far to speculate: fixed draft length, or adaptive with batch-size gating (see
:mod:`specdraft.policy.core`). ``config``: the settings; ``cost``: measured target and proposer
costs; ``evidence``: what drafts gain and the acceptance counts kept; ``plan``: one step's
decision, from ``budgets`` to ``trim``; ``scored``: drafts whose
nodes carry the proposer's own confidence (EAGLE's dynamic trees)."""

from specdraft.policy.config import PolicyConfig
from specdraft.policy.core import HORIZON_TOKENS, PROBE_SETUP_SHARE, Policy
from specdraft.policy.cost import CostModel, ProposeCost, measure_latency
from specdraft.policy.evidence import LABEL_DECAY, PROBE_GAP_MAX, expected_tokens, progress
from specdraft.policy.plan import Plan, Probe

__all__ = ["CostModel", "HORIZON_TOKENS", "LABEL_DECAY", "PROBE_GAP_MAX", "PROBE_SETUP_SHARE", "Plan", "Policy",
           "PolicyConfig", "Probe", "ProposeCost", "expected_tokens", "measure_latency", "progress"]
