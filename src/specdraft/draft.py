"""Drafts as token trees.

A draft is what a proposer offers the target in one step: ``N`` nodes, each a token and the
index of its parent (-1 = the root, which is the last committed token). A chain is a tree in
which every node's parent is the node before it. Nodes are in topological order (a parent
comes before its children), so masks, positions and paths are pure functions of ``parents``.

Vocabulary: *proposed* tokens are a draft's nodes; *accepted* tokens are the nodes on the path
the verifier keeps; the *bonus* token is the target's own token after the last accepted one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class Draft:
    tokens: tuple[int, ...]  # [N] token of each node
    parents: tuple[int, ...]  # [N] parent node index, -1 = the root (last committed token)
    p_draft: Tensor | None = None  # [N, V] float32: the distribution node i's token was drawn
    # from (the proposer's distribution at its parent). None = a deterministic proposer, whose
    # tokens count as one-hot draws. Siblings must be either independent draws from their common
    # distribution or deterministic, for lossless sampling.
    label: str = ""  # the kind of evidence behind the draft (e.g. "n3": a 3-token match); the
    # adaptive policy learns acceptance per label and trims drafts whose label rarely pays
    confidence: tuple[float, ...] | None = None  # [N] the proposer's estimate that node i is
    # accepted (EAGLE: its path's cumulative draft probability), never above its parent's; the
    # adaptive policy calibrates it and keeps the ``top`` nodes that pay (None: no estimate)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"draft has {len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"draft node {i} has parent {p}; parents must come first (-1 = root)")
        if self.p_draft is not None and self.p_draft.shape[0] != len(self.tokens):
            raise ValueError(f"p_draft has {self.p_draft.shape[0]} rows for {len(self.tokens)} nodes")
        if self.confidence is not None:
            if len(self.confidence) != len(self.tokens):
                raise ValueError(f"draft has {len(self.confidence)} confidences for {len(self.tokens)} nodes")
            if any(c > self.confidence[p] for c, p in zip(self.confidence, self.parents) if p >= 0):
                raise ValueError("a draft node's confidence is above its parent's")

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def empty(cls) -> "Draft":
        return cls((), ())

    @classmethod
    def chain(cls, tokens: Sequence[int], p_draft: Tensor | None = None, label: str = "") -> "Draft":
        return cls(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)), p_draft, label)

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], max_nodes: int | None = None, label: str = "") -> "Draft":
        """Merge token sequences into a trie (shared prefixes become one node), in the order
        given: earlier paths' nodes come first among siblings. Stops adding nodes at max_nodes."""
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for path in paths:
            parent = -1
            for tok in path:
                key = (parent, int(tok))
                if key not in index:
                    if max_nodes is not None and len(tokens) >= max_nodes:
                        break
                    index[key] = len(tokens)
                    tokens.append(int(tok))
                    parents.append(parent)
                parent = index[key]
        return cls(tuple(tokens), tuple(parents), label=label)

    # -- derived structure ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of each node: a child of the root has depth 1."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def children(self) -> list[list[int]]:
        """children[0] lists the root's children; children[i + 1] those of node i."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i)
        return out

    def paths(self) -> list[list[int]]:
        """Root-to-leaf paths as lists of node indices."""
        kids = self.children()
        leaves = [i for i in range(len(self)) if not kids[i + 1]]
        out = []
        for leaf in leaves:
            path = [leaf]
            while self.parents[path[-1]] >= 0:
                path.append(self.parents[path[-1]])
            out.append(path[::-1])
        return out

    def up_to_depth(self, depth: int) -> "Draft":
        """The nodes at most ``depth`` deep (parents re-indexed, p_draft rows kept with them)."""
        return self.subset([i for i, d in enumerate(self.depths()) if d <= depth])

    def by_confidence(self) -> list[int]:
        """Node indices from the most to the least confident (ties: earlier first), so that
        every prefix of the order holds its nodes' parents. Requires ``confidence``."""
        if self.confidence is None:
            raise ValueError("the draft has no confidences")
        conf = self.confidence
        return sorted(range(len(self)), key=lambda i: (-conf[i], i))

    def top(self, n: int) -> "Draft":
        """The ``n`` most confident nodes (a tree: a child is never more confident than its
        parent, and ties keep the earlier node, which is the parent)."""
        return self.subset(sorted(self.by_confidence()[: max(n, 0)]))

    def subset(self, keep: list[int]) -> "Draft":
        """The nodes ``keep`` (ascending; each one's parent kept too), re-indexed, with their
        p_draft rows and confidences."""
        if len(keep) == len(self):
            return self
        new = {old: j for j, old in enumerate(keep)}
        if any(self.parents[i] >= 0 and self.parents[i] not in new for i in keep):
            raise ValueError("a draft subset must keep each node's parent")
        p_draft = self.p_draft[keep] if self.p_draft is not None else None
        conf = tuple(self.confidence[i] for i in keep) if self.confidence is not None else None
        return Draft(tuple(self.tokens[i] for i in keep), tuple(new.get(self.parents[i], -1) for i in keep),
                     p_draft, self.label, conf)

    def path_to(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def verify_inputs(drafts: Sequence[Draft], last: Sequence[int], width: int,
                  device: torch.device | str = "cpu") -> tuple[Tensor, Tensor, Tensor]:
    """What the verifier feeds, built on ``device`` from one host-to-device copy: per row the
    root (slot 0: ``last``, the row's last committed token) and its draft's nodes (slot i + 1),
    padded to ``width`` nodes.

    Returns tokens [B, 1 + W] int64 (padding 0), relative positions [B, 1 + W] int64 (the root
    0, a node its depth, padding 1) and the ancestor mask [B, 1 + W, 1 + W] bool: slot a may
    attend to slot b iff b is a or one of a's ancestors (the root is everyone's). Padding slots
    see the root and themselves; nobody sees them. The mask is filled by walking up the
    parent slots, one ancestor distance per round, so its cost is the deepest draft's depth in
    a few batched kernels whatever the batch size.
    """
    size = 1 + width
    pad = [0] * width
    host = [[t, *d.tokens, *pad[len(d):], 0, *(p + 1 for p in d.parents), *pad[len(d):], len(d)]
            for d, t in zip(drafts, last)]
    packed = torch.tensor(host, dtype=torch.long, device=device)  # [B, 2 (1 + W) + 1]
    tokens, parent = packed[:, :size], packed[:, size:-1]  # [B, 1 + W] each; root's and padding's parent: slot 0
    batch = len(host)
    if all(d.is_chain for d in drafts):
        return tokens, *_chain_inputs(packed[:, -1], size)
    mask = torch.eye(size, dtype=torch.bool, device=device).repeat(batch, 1, 1)  # [B, 1 + W, 1 + W]
    mask[:, :, 0] = True
    rows = torch.arange(batch, device=device)[:, None]  # [B, 1]
    slots = torch.arange(size, device=device)[None, :]  # [1, 1 + W]
    ancestor = parent  # [B, 1 + W]: each slot's ancestor at distance 1, then 2, ... (the root stays the root)
    for _ in range(max((max(d.depths(), default=0) for d in drafts), default=0) - 1):  # (distance = depth: the root, set)
        mask[rows, slots, ancestor] = True
        ancestor = parent.gather(1, ancestor)  # one more step up
    positions = mask.sum(-1) - 1  # [B, 1 + W]: the ancestors a slot sees are its depth
    return tokens, positions, mask


def _chain_inputs(lengths: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """``verify_inputs``' positions [B, S] and mask [B, S, S] when every draft is a chain (row r
    has ``lengths[r]`` nodes, [B] on the device): a slot up to its row's length sees every slot
    up to itself; a padding slot sees the root and itself."""
    n = lengths[:, None, None]  # [B, 1, 1]
    a = torch.arange(size, device=lengths.device)[:, None]  # [S, 1] the attending slot
    b = torch.arange(size, device=lengths.device)[None, :]  # [1, S] the attended one
    mask = (b <= a) & ((a <= n) | (b == 0) | (b == a))  # [B, S, S]
    positions = torch.where(a.T <= n[:, 0], a.T, 1)  # [B, S]
    return positions, mask
