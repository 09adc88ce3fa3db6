"""Medusa: trained heads on the target's last hidden state draft the next K tokens at once
(:mod:`specdraft.heads.medusa`).

Each row keeps one vector: the target's final hidden state at its last committed token (from
the prefill's last prompt position, then from the verification slot of the last accepted
node, or the root when nothing was accepted). The target's LM head there gave the bonus token,
the next draft's root; head k guesses the token k past it. The draft is a dynamic tree over
the heads' ``topk`` likeliest tokens: a node at depth d is one of head d's candidates under a
node at depth d - 1, its confidence the product of the heads' probabilities along its path
(the heads do not see the candidates, so this treats them as independent; the adaptive policy
calibrates it per depth against what is accepted, which is Medusa's tree search from measured
acceptance done online). The ``budget`` most confident nodes are kept, found best-first.
``topk=1`` is a chain. Drafts are deterministic (``p_draft`` None), so sampled rows stay
exact. Drafting costs one small forward of the heads for all rows together.
"""

from __future__ import annotations

import heapq
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
from specdraft.proposers.base import FeatureRequest, Features, ProposerContext, Verified, move_key
from specdraft.sequence import Sequence


@dataclass(frozen=True, slots=True)
class MedusaOptions:
    """path: a folder of trained heads (``config.json`` + ``model.safetensors``, from
    ``specdraft train medusa``; empty: the heads shipped for the model). topk: each head's
    candidates in the tree (1 = a chain)."""

    path: str = ""
    topk: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.topk, int) or not 1 <= self.topk <= 16:
            raise SpecdraftError(f"medusa: topk must be in 1..16, got {self.topk!r}")


class MedusaProposer:
    name = "medusa"
    features = FeatureRequest(prompt=True)  # the last prompt position's state starts each row

    def __init__(self, heads: MedusaHeads, topk: int = 4) -> None:
        self.heads = heads.eval()
        self.vocab = heads.vocab
        self.topk = min(topk, heads.config.draft_vocab)
        self.trees = self.topk > 1  # a budget of nodes, not of depth (engine: caps by the room)
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
        return cls(heads, options.topk)

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
        probs = self.heads(torch.stack([self.state[r] for r in rows])).float().softmax(-1)  # [R, K, N]
        top = probs.topk(self.topk, dim=-1)  # [R, K, k]
        ids = self.vocab.to_target(top.indices.cpu())  # [R, K, k] target ids
        for i, r in enumerate(rows):
            reach = seqs[r].room - 1  # the deepest node the row can emit
            drafts[r] = best_first(ids[i, :reach].tolist(), top.values[i, :reach].tolist(), budgets[r], "medusa")
        return drafts

    def observe(self, row: int, draft: Draft, acceptance: Acceptance, verified: Verified) -> None:
        slot = acceptance.path[-1] + 1 if acceptance.path else 0
        self.state[row] = verified.hidden[slot]

    def end(self, row: int) -> None:
        self.state.pop(row, None)

    def move(self, src: int, dst: int) -> None:
        move_key(self.state, src, dst)

    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.heads.parameters())


def best_first(ids: list[list[int]], probs: list[list[float]], budget: int, label: str) -> Draft:
    """The ``budget`` most confident nodes of the tree in which every node at depth d has the
    children ids[d] (probabilities probs[d], [K][k] each), a node's confidence being the product
    of the probabilities on its path. Nodes come out best first, so parents precede children
    (a child is never more confident; ties keep the earlier-queued node, the parent)."""
    heap: list[tuple[float, int, int, int, float]] = []  # (-confidence, order, parent, depth, token)
    order = 0

    def children(parent: int, depth: int, conf: float) -> None:
        nonlocal order
        if depth < len(ids):
            for tok, p in zip(ids[depth], probs[depth]):
                heapq.heappush(heap, (-conf * p, order, parent, depth, tok))
                order += 1

    children(-1, 0, 1.0)
    tokens: list[int] = []
    parents: list[int] = []
    conf: list[float] = []
    while heap and len(tokens) < budget:
        neg, _, parent, depth, tok = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        conf.append(-neg)
        children(len(tokens) - 1, depth + 1, -neg)
    return Draft(tuple(tokens), tuple(parents), label=label, confidence=tuple(conf))
