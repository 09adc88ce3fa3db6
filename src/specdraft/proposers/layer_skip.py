"""Self-speculation by early exit: the target's first L layers (then its final norm and LM
head) draft the tokens; optionally its last few layers too, skipping only a middle block
(``last``). No extra weights and no extra cache.

The target's cache, lent to ``propose``, already holds every row's committed prefix for all
layers, so the first L of them are exactly the draft's context. Each level feeds one token per
row (the root first, at position ``cache.lengths[row]``, then each drafted token) through the
first L layers, writing only scratch positions past the committed lengths, which are restored
before returning (the verifier overwrites the scratch). With ``last`` > 0 the last layers
attend to the target's own keys and values of the committed prefix, as skip-the-middle
self-speculation does (Draft & Verify, SWIFT): only the drafted positions see the skip. Chain
drafting, greedy and sampled, is shared with the draft-model proposer (:mod:`.autoregressive`).

The default L comes from a measurement on SmolLM2-135M (30 layers): see
``results/layer-skip`` and ``docs/methods/layer-skip.md``.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from specdraft.accept import Acceptance
from specdraft.draft import Draft
from specdraft.errors import SpecdraftError
from specdraft.model.kv_cache import KVCache
from specdraft.model.transformer import Transformer
from specdraft.proposers.autoregressive import Drafter, draft_chains
from specdraft.proposers.base import ProposerContext, Verified
from specdraft.sequence import Sequence

DEFAULT_LAYERS = 4  # chosen by the sweep in results/layer-skip (see the module doc)


@dataclass(frozen=True, slots=True)
class LayerSkipConfig:
    """layers: how many of the target's first layers draft (1..num_layers-1; fewer = cheaper
    drafts that are accepted less often). last: also run the target's last ``last`` layers,
    skipping the block in between (0 = early exit; layers + last <= num_layers - 1).
    branches: candidates at the first draft position (1 = a chain; b > 1 = a tree whose first
    candidate continues as the chain)."""

    layers: int = DEFAULT_LAYERS
    branches: int = 1
    last: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.layers, int) or self.layers < 1:
            raise SpecdraftError(f"layer-skip: layers must be an integer >= 1, got {self.layers!r}")
        if not isinstance(self.last, int) or self.last < 0:
            raise SpecdraftError(f"layer-skip: last must be an integer >= 0, got {self.last!r}")
        if not isinstance(self.branches, int) or not 1 <= self.branches <= 16:
            raise SpecdraftError(f"layer-skip: branches must be in 1..16, got {self.branches!r}")


class LayerSkipProposer:
    name = "layer-skip"

    def __init__(self, target: Transformer, layers: int, branches: int = 1, last: int = 0) -> None:
        total = target.config.num_layers
        if not 1 <= layers < total:
            raise SpecdraftError(f"layer-skip: layers must be in 1..{total - 1} for this {total}-layer model, got {layers}")
        if layers + last >= total:
            raise SpecdraftError(f"layer-skip: layers + last must be at most {total - 1} for this {total}-layer model "
                                 f"(at least one layer skipped), got {layers} + {last}")
        self.target = target
        self.layers = layers
        self.branches = branches
        self.layer_ids = (*range(layers), *range(total - last, total))  # the layers that draft

    def begin(self, row: int, seq: Sequence) -> None:
        pass

    def end(self, row: int) -> None:
        pass

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache: KVCache) -> list[Draft]:
        if not any(s is not None and b > 0 for s, b in zip(seqs, budgets)):
            return [Draft.empty() for _ in seqs]
        committed = list(cache.lengths)
        drafter = Drafter(self.target, cache, layers=self.layer_ids)
        try:
            root_logits = drafter.step([s.tokens[-1] if s is not None else 0 for s in seqs])  # [B, V]
            vocab = self.target.config.vocab_size
            return draft_chains(drafter, root_logits, seqs, budgets, self.branches, vocab).drafts
        finally:
            cache.truncate(committed)

    def observe(self, row: int, draft: Draft, acceptance: Acceptance, verified: Verified) -> None:
        pass  # nothing to roll back: the target's cache is the engine's

    def memory_bytes(self) -> int:
        return 0


def make_layer_skip_proposer(config: LayerSkipConfig, context: ProposerContext | None) -> LayerSkipProposer:
    if context is None:
        raise SpecdraftError("method 'layer-skip' needs the target model (a ProposerContext)")
    return LayerSkipProposer(context.target, config.layers, config.branches, config.last)
