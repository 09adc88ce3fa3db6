"""Chain drafting with a small causal model, shared by the draft-model and layer-skip proposers.

A *drafter* is a model run on a KV cache of its own kind: a separate draft model on its own
cache, or the target's first layers on the target's cache. Each proposer first brings its
drafter to the same point: the drafter's logits after every drafting row's root token (the
last committed token), with the cache holding the row's context up to and including the root.
:func:`draft_chains` takes it from there, one forward per draft level for all rows at once:

- a row with budget n and ``branches`` b drafts min(b, n) candidates at the first position
  and continues the first of them as a chain, n nodes in all (b = 1: a plain chain);
- greedy rows take the drafter's top tokens (deterministic: ``p_draft`` None);
- sampled rows draw every token from ``probabilities(drafter logits, row sampling)`` with the
  row's generator and record the distribution each was drawn from as the node's ``p_draft``
  row, padded to the target's vocabulary width. First-position candidates are distinct by
  default (``distinct``: drawn without replacement, the i-th from the distribution with the
  earlier ones removed and renormalised, which is its ``p_draft``), else independent draws (so
  the same token may come twice). The acceptance's residual update is exact for both: after a
  rejected sibling the target's residual is zero where that token was, so removing it from the
  next sibling's distribution loses nothing.

The chain's nodes come first in the draft (node i at depth i + 1), the other first-position
candidates after them, so the KV the drafter wrote for the chain (all but its last node) sits
right after the root in the cache, in node order: ``Drafted.fed`` says how many nodes that is.
Rows that do not draft, or stop earlier, are fed a dummy token: their extra positions are
scratch for the caller to roll back.

``stop_below`` (Kangaroo's confidence stop): a chain row stops where the drafter's top
probability for the next node falls below it, before taking that node (at the first position
the row then drafts nothing). The rule reads the drafter alone, so sampled output stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from specdraft.draft import Draft
from specdraft.model.kv_cache import KVCache
from specdraft.model.transformer import Transformer
from specdraft.sampling import probabilities
from specdraft.sequence import Sequence


class StepDrafter(Protocol):
    """What ``draft_chains`` drives: one token per row in, the drafter's logits after it out."""

    def step(self, tokens: list[int]) -> Tensor: ...


@dataclass(frozen=True, slots=True)
class Drafter:
    """A model and the cache it drafts on; ``layers``: the layers it runs (None = all; see
    ``Transformer.forward``)."""

    model: Transformer
    cache: KVCache
    layers: tuple[int, ...] | None = None

    def step(self, tokens: list[int]) -> Tensor:
        """Feed one token per row at that row's cache length; the logits after it: [B, V]."""
        device = self.model.device
        fed = torch.tensor(tokens, dtype=torch.long, device=device)[:, None]  # [B, 1]
        positions = self.cache.lengths_tensor()[:, None]  # [B, 1]
        out = self.model(fed, positions, self.cache, layers=self.layers)
        return out.logits[:, -1]  # [B, V]


@dataclass(frozen=True, slots=True)
class Drafted:
    drafts: list[Draft]  # one per row (empty for rows that do not draft)
    fed: list[int]  # per row: draft nodes 0..fed-1 (the chain) were fed after the root, in order


@dataclass(slots=True)
class _Row:
    """One row's draft while it grows: the chain, then the other first-position candidates."""

    greedy: bool
    depth: int  # chain length
    branches: int  # candidates at the first position (the chain's first node included)
    chain: list[int]
    extra: list[int]
    p_chain: list[Tensor]  # [V_draft] each (sampled rows)
    p_extra: list[Tensor]

    def draft(self, vocab: int) -> Draft:
        tokens = (*self.chain, *self.extra)
        parents = (*range(-1, self.depth - 1), *(-1,) * len(self.extra))
        if self.greedy:
            return Draft(tokens, parents)
        p_draft = torch.stack([*self.p_chain, *self.p_extra])  # [N, V_draft]
        return Draft(tokens, parents, F.pad(p_draft, (0, vocab - p_draft.shape[-1])))  # [N, V]


def plan_rows(seqs: Seq[Sequence | None], budgets: Seq[int], branches: int) -> list[_Row | None]:
    """What each row drafts: None for rows that do not draft."""
    rows: list[_Row | None] = []
    for seq, budget in zip(seqs, budgets):
        if seq is None or budget <= 0:
            rows.append(None)
            continue
        b = min(branches, budget)
        rows.append(_Row(seq.sampling.greedy, budget - b + 1, b, [], [], [], []))
    return rows


def draft_chains(
    drafter: StepDrafter, root_logits: Tensor, seqs: Seq[Sequence | None], budgets: Seq[int], branches: int, vocab: int,
    stop_below: float = 0.0, distinct: bool = True,
) -> Drafted:
    """Draft every row's chain (see the module doc). root_logits: [B, V_draft], the drafter's
    logits after each row's root. ``vocab``: the target's logits width (for ``p_draft``).
    ``stop_below``: the confidence stop (module doc; 0 = none). ``distinct``: sampled
    first-position candidates without replacement (module doc)."""
    rows = plan_rows(seqs, budgets, branches)
    depth = max((r.depth for r in rows if r is not None), default=0)
    if depth:
        _stop_unsure(rows, root_logits, 0, stop_below)
        _first_level(rows, seqs, root_logits, distinct)
    for level in range(1, depth):
        if not any(r is not None and r.depth > level for r in rows):
            break  # every row stopped
        fed = [r.chain[-1] if r is not None and r.depth > level else 0 for r in rows]
        logits = drafter.step(fed)  # [B, V_draft]
        _stop_unsure(rows, logits, level, stop_below)
        _next_level(rows, seqs, logits, level)
    drafts = [r.draft(vocab) if r is not None and r.depth else Draft.empty() for r in rows]
    return Drafted(drafts, [max(r.depth - 1, 0) if r is not None else 0 for r in rows])


def _stop_unsure(rows: list[_Row | None], logits: Tensor, level: int, stop_below: float) -> None:
    """End the chain rows still drafting at ``level`` whose drafter puts less than
    ``stop_below`` on its top token there (logits: [B, V_draft]); trees are left whole."""
    if stop_below <= 0:
        return
    top = logits.float().softmax(-1).amax(-1).tolist()  # [B]
    for i, row in enumerate(rows):
        if row is not None and row.branches == 1 and row.depth > level and top[i] < stop_below:
            row.depth = level


def _first_level(rows: list[_Row | None], seqs: Seq[Sequence | None], logits: Tensor, distinct: bool = True) -> None:
    """The first position: top candidates (greedy) or draws (sampled: distinct, or independent)."""
    widest = max(r.branches for r in rows if r is not None)
    top = logits.topk(widest, dim=-1).indices.tolist()  # [B, widest]
    for i, (row, seq) in enumerate(zip(rows, seqs)):
        if row is None or seq is None or row.depth == 0:  # (stopped before its first node)
            continue
        if row.greedy:
            tokens = top[i][: row.branches]
        else:
            p = probabilities(logits[i], seq.sampling)  # [V_draft]
            if distinct:
                tokens, dists = _without_replacement(p, row.branches, seq.generator)
            else:
                tokens = torch.multinomial(p, row.branches, replacement=True, generator=seq.generator).tolist()
                dists = [p] * row.branches
            row.p_chain.append(dists[0])
            row.p_extra.extend(dists[1:])
        row.chain.append(tokens[0])
        row.extra.extend(tokens[1:])


def _without_replacement(p: Tensor, n: int, generator: torch.Generator | None) -> tuple[list[int], list[Tensor]]:
    """Up to n distinct tokens drawn one after another from p ([V]), each from p with the
    earlier ones removed and renormalised; returns the tokens and those distributions ([V]
    each). Fewer than n where p has fewer tokens with mass."""
    tokens: list[int] = []
    dists: list[Tensor] = []
    q = p.float()
    for _ in range(min(n, int((p > 0).sum()))):
        q = q / q.sum()
        token = int(torch.multinomial(q, 1, generator=generator))
        tokens.append(token)
        dists.append(q)
        q = q.clone()
        q[token] = 0.0
    return tokens, dists


def _next_level(rows: list[_Row | None], seqs: Seq[Sequence | None], logits: Tensor, level: int) -> None:
    """Chain node ``level`` (0-based) from the logits after node ``level - 1``: [B, V_draft]."""
    argmax = logits.argmax(-1).tolist()  # [B]
    for i, (row, seq) in enumerate(zip(rows, seqs)):
        if row is None or seq is None or row.depth <= level:
            continue
        if row.greedy:
            row.chain.append(argmax[i])
            continue
        p = probabilities(logits[i], seq.sampling)  # [V_draft]
        row.chain.append(int(torch.multinomial(p, 1, generator=seq.generator)))
        row.p_chain.append(p)


def kept_on_chain(path: tuple[int, ...], fed: int) -> int:
    """How many of the fed chain nodes (0..fed-1) an accepted path keeps."""
    if not path or path[0] != 0:
        return 0
    return min(len(path), fed)
