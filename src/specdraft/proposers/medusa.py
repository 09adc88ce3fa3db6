"""Medusa: trained heads on the target's last hidden state draft the next K tokens at once
(:mod:`specdraft.heads.medusa`).

Each row keeps one vector: the target's final hidden state at its last committed token (from
the prefill's last prompt position, then from the verification slot of the last accepted
node, or the root when nothing was accepted). The target's LM head there gave the bonus token,
the next draft's root; head k guesses the token k past it. The draft is a chain of each head's
most likely token, or, with ``branches`` b > 1, a tree whose first level holds head 1's b most
likely tokens, each followed by the chain of heads 2..K (the heads do not see the candidate,
as in Medusa's trees). Drafts are deterministic (``p_draft`` None), so sampled rows stay
exact. Drafting costs one small forward of the heads for all rows together.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor

from specdraft.accept import Acceptance
from specdraft.draft import Draft
from specdraft.errors import SpecdraftError
from specdraft.heads.medusa import MedusaHeads, load_medusa
from specdraft.heads.shipped import shipped_heads
from specdraft.model.kv_cache import KVCache
from specdraft.proposers.base import FeatureRequest, Features, ProposerContext, Verified
from specdraft.sequence import Sequence


@dataclass(frozen=True, slots=True)
class MedusaOptions:
    """path: a folder of trained heads (``config.json`` + ``model.safetensors``, from
    ``specdraft train medusa``; empty: the heads shipped for the model). branches: head 1's candidates at the first draft position
    (1 = a chain)."""

    path: str = ""
    branches: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.branches, int) or not 1 <= self.branches <= 16:
            raise SpecdraftError(f"medusa: branches must be in 1..16, got {self.branches!r}")


class MedusaProposer:
    name = "medusa"
    features = FeatureRequest(prompt=True)  # the last prompt position's state starts each row

    def __init__(self, heads: MedusaHeads, branches: int = 1) -> None:
        self.heads = heads.eval()
        self.vocab = heads.vocab
        self.branches = branches
        self.state: dict[int, Tensor] = {}  # row -> [H] final state at its last committed token

    @classmethod
    def from_context(cls, options: MedusaOptions, context: ProposerContext | None) -> "MedusaProposer":
        if context is None:
            raise SpecdraftError("method 'medusa' needs the target model")
        path = options.path or (shipped_heads("medusa", context.source) if context.source else None)
        if not path:
            raise SpecdraftError("method 'medusa' needs trained heads for this model: pass --opt path=DIR "
                                 "(made by `specdraft train medusa`)")
        c = context.target.config
        heads = load_medusa(path, c.hidden_size, c.vocab_size).to(context.target.device)
        return cls(heads, options.branches)

    def begin(self, row: int, seq: Sequence) -> None:
        self.state.pop(row, None)

    def prefilled(self, row: int, features: Features) -> None:
        self.state[row] = features.last_hidden[-1]

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache: KVCache) -> list[Draft]:
        rows = [r for r, (s, b) in enumerate(zip(seqs, budgets)) if s is not None and b > 0 and r in self.state]
        drafts = [Draft.empty() for _ in seqs]
        if not rows:
            return drafts
        logits = self.heads(torch.stack([self.state[r] for r in rows]))  # [R, K, N]
        top = self.vocab.to_target(logits.topk(self.branches, dim=-1).indices.cpu())  # [R, K, b] target ids
        for i, r in enumerate(rows):
            chain = top[i, :, 0].tolist()  # [K]
            paths = [chain] + [[int(c), *chain[1:]] for c in top[i, 0, 1:]]
            drafts[r] = Draft.from_paths(paths, max_nodes=budgets[r], label="medusa")
        return drafts

    def observe(self, row: int, draft: Draft, acceptance: Acceptance, verified: Verified) -> None:
        slot = acceptance.path[-1] + 1 if acceptance.path else 0
        self.state[row] = verified.hidden[slot]

    def end(self, row: int) -> None:
        self.state.pop(row, None)

    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.heads.parameters())
