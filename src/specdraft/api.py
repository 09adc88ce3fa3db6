"""The public surface: build an engine for a method from a loaded model."""

from __future__ import annotations

from collections.abc import Mapping

from specdraft.engine import Engine
from specdraft.model.loader import LoadedModel
from specdraft.policy import CostModel, Policy, PolicyConfig
from specdraft.proposers import make_proposer
from specdraft.proposers.base import ProposerContext


def build_engine(
    loaded: LoadedModel,
    method: str = "plain",
    *,
    k: int = 8,
    policy: str = "adaptive",
    options: Mapping[str, str] | None = None,
    cost: CostModel | None = None,
) -> Engine:
    """An engine for ``method`` with draft length k (the maximum, with the adaptive policy).
    ``cost``: a shared cost model (measured once per batch size); made here if not given."""
    config = PolicyConfig(kind=policy, k=k)  # type: ignore[arg-type]
    if config.kind == "adaptive" and cost is None:
        cost = CostModel(loaded.model)
    context = ProposerContext(loaded.model, loaded.tokenizer, max_draft=k, source=str(loaded.source))
    proposer = make_proposer(method, options, context)
    return Engine(loaded.model, loaded.tokenizer, proposer, Policy(config, cost))
