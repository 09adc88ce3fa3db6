"""One acceptance function for chains and trees, greedy or lossless sampling.

Given the target's logits at the root (the last committed token) and at every draft node,
walk down the tree:

- greedy: descend into the child whose token is the target's argmax; stop when none is. The
  bonus token is the argmax where the walk stopped.
- sampling (temperature > 0): at each node, with ``p_target`` the target's distribution there
  (after temperature/top-k/top-p, exactly as plain decoding), try the children in order. Child
  token x drawn from ``p_draft`` is accepted with probability min(1, p_target(x) / p_draft(x));
  after a rejection ``p_target`` becomes the normalised residual max(0, p_target - p_draft) and
  the next sibling is tried against it. If no child is accepted, the bonus token is drawn from
  what is left. Deterministic drafts count as one-hot ``p_draft``. The emitted tokens then
  follow the target's distribution exactly (Leviathan et al. 2023; SpecInfer's multi-candidate
  form for trees).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdraft.draft import Draft
from specdraft.sampling import Sampling, probabilities, sample


@dataclass(frozen=True, slots=True)
class Acceptance:
    path: tuple[int, ...]  # accepted node indices, root to leaf
    tokens: tuple[int, ...]  # emitted: the accepted nodes' tokens, then the bonus token

    @property
    def accepted(self) -> int:
        return len(self.path)


def accept(
    draft: Draft,
    logits: Tensor,
    sampling: Sampling,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """logits: [1 + N', V] target logits at the root (row 0) and node i (row i + 1); N' >= N
    (extra rows, e.g. padding, are ignored)."""
    if sampling.greedy:
        return accept_greedy(draft, logits)
    return accept_sampled(draft, logits, sampling, generator)


def accept_greedy(draft: Draft, logits: Tensor) -> Acceptance:
    """Longest path whose tokens equal the target's argmax, plus the argmax after it."""
    argmax = logits[: len(draft) + 1].argmax(-1).tolist()  # [1 + N]
    kids = draft.children()
    path: list[int] = []
    node = -1
    while True:
        want = argmax[node + 1]
        nxt = next((c for c in kids[node + 1] if draft.tokens[c] == want), None)
        if nxt is None:
            tokens = [draft.tokens[i] for i in path] + [want]
            return Acceptance(tuple(path), tuple(tokens))
        path.append(nxt)
        node = nxt


def accept_sampled(
    draft: Draft, logits: Tensor, sampling: Sampling, generator: torch.Generator | None
) -> Acceptance:
    kids = draft.children()
    path: list[int] = []
    node = -1
    while True:
        p_target = probabilities(logits[node + 1], sampling)  # [V]
        chosen = None
        for child in kids[node + 1]:
            token = draft.tokens[child]
            p_draft = _draft_distribution(draft, child, p_target)
            ratio = p_target[token] / p_draft[token].clamp_min(1e-20)
            if _uniform(generator, p_target.device) < ratio:
                chosen = child
                break
            p_target = residual(p_target, p_draft)
        if chosen is None:
            bonus = int(sample(p_target[None], generator))
            tokens = [draft.tokens[i] for i in path] + [bonus]
            return Acceptance(tuple(path), tuple(tokens))
        path.append(chosen)
        node = chosen


def residual(p_target: Tensor, p_draft: Tensor) -> Tensor:
    """normalise(max(0, p_target - p_draft)); [V] -> [V]. If nothing is left (the two are
    equal, so a rejection could not have happened), p_target is returned unchanged."""
    left = (p_target - p_draft).clamp_min(0)
    total = left.sum()
    return left / total if total > 0 else p_target


def _draft_distribution(draft: Draft, node: int, like: Tensor) -> Tensor:
    if draft.p_draft is not None:
        return draft.p_draft[node].to(like.device, torch.float32)
    onehot = torch.zeros_like(like)
    onehot[draft.tokens[node]] = 1.0
    return onehot


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand((), generator=generator, device=device))
