"""A depth-bounded suffix trie with occurrence counts, for suffix decoding.

The trie holds every substring of at most ``depth`` tokens of the sequences added to it; a
node is one substring and its ``count`` is the number of places it occurs (start positions).
So ``count(s + t) / sum_u count(s + u)`` is the empirical probability that ``t`` follows
``s``, among the occurrences of ``s`` that have a next token.

It grows one token at a time: the *ends* of a sequence are the nodes of its suffixes of
length 0 (the root) .. depth - 1; appending a token moves each of them one edge down
(creating the child or counting one more occurrence) in O(depth) dictionary operations,
never a rebuild. Adding a whole sequence is the same walk from ``[ROOT]``; removing one
subtracts the same counts and frees the nodes that reach zero.

Storage is flat, to keep a node small in Python: one dictionary of edges keyed by
``(node << TOKEN_BITS) | token``, and per node a count, its token, its first child and its
next sibling (children form a linked list, newest first, for enumeration). Freed node ids
are reused; ``version`` changes whenever nodes are removed, so a reader holding node ids
(the ends of a sequence matched against a shared trie) knows to look them up again.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ROOT = 0
TOKEN_BITS = 24  # token ids must be below 2**24 (every vocabulary in use is far smaller)
MAX_TOKEN = (1 << TOKEN_BITS) - 1
INT_BYTES = 32  # a Python int object that is not a cached small int


@dataclass(frozen=True, slots=True)
class Growth:
    """A draft tree grown from one trie node: tokens and parents in topological order
    (-1 = the matched context), and its score: the sum of the nodes' path probabilities,
    i.e. the expected number of accepted tokens if the counts are right."""

    tokens: list[int]  # [N]
    parents: list[int]  # [N]
    score: float


class SuffixTrie:
    __slots__ = ("depth", "edges", "counts", "token", "first", "sibling", "free", "version")

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"trie depth must be >= 1, got {depth}")
        self.depth = depth
        self.edges: dict[int, int] = {}  # (parent << TOKEN_BITS) | token -> child
        self.counts: list[int] = [0]  # occurrences; the root's = tokens added
        self.token: list[int] = [-1]  # the token on the edge into the node
        self.first: list[int] = [-1]  # first child (-1 = a leaf)
        self.sibling: list[int] = [-1]  # next child of the same parent
        self.free: list[int] = []  # ids of removed nodes, reused first
        self.version = 0

    # -- size --------------------------------------------------------------------------------
    @property
    def nodes(self) -> int:
        """Live nodes, the root excluded."""
        return len(self.counts) - 1 - len(self.free)

    def nbytes(self) -> int:
        """The trie's memory: the edge dictionary and its key/value int objects, the per-node
        lists (slots for freed ids included) and the count int objects beyond the cached ones."""
        big_counts = sum(1 for c in self.counts if c > 256)
        return (sys.getsizeof(self.edges) + 2 * INT_BYTES * len(self.edges)
                + sum(sys.getsizeof(x) for x in (self.counts, self.token, self.first, self.sibling, self.free))
                + INT_BYTES * big_counts)

    # -- growing -----------------------------------------------------------------------------
    def advance(self, ends: list[int], token: int) -> list[int]:
        """Append ``token`` to a sequence whose suffixes end at ``ends`` (lengths 0, 1, ...):
        count one more occurrence of each suffix + token, and return the new ends."""
        edges, counts = self.edges, self.counts
        out = [ROOT]
        counts[ROOT] += 1
        for node in ends:
            key = (node << TOKEN_BITS) | token
            child = edges.get(key)
            if child is None:
                child = edges[key] = self._new_child(node, token)
            counts[child] += 1
            out.append(child)
        if len(out) > self.depth:  # a suffix of full depth cannot be extended
            out.pop()
        return out

    def follow(self, ends: list[int], token: int) -> list[int]:
        """Like ``advance`` but read-only: the ends of the suffixes (+ token) that exist."""
        edges = self.edges
        out = [ROOT]
        for node in ends:
            child = edges.get((node << TOKEN_BITS) | token)
            if child is None:  # the trie is suffix-closed: longer suffixes are missing too
                break
            out.append(child)
        if len(out) > self.depth:
            out.pop()
        return out

    def ends_of(self, tokens: Sequence[int]) -> list[int]:
        """Read-only ends of a whole sequence: the nodes of its suffixes that exist."""
        ends = [ROOT]
        for t in tokens[max(0, len(tokens) - self.depth + 1) :]:
            ends = self.follow(ends, t)
        return ends

    def add(self, tokens: Iterable[int]) -> None:
        """Count every substring (of at most ``depth`` tokens) of a sequence."""
        ends = [ROOT]
        for t in tokens:
            ends = self.advance(ends, t)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo ``add(tokens)``: subtract its counts and free the nodes that reach zero."""
        counts = self.counts
        for i in range(len(tokens)):
            counts[ROOT] -= 1
            node = ROOT
            for t in tokens[i : i + self.depth]:
                child = self.edges[(node << TOKEN_BITS) | t]
                counts[child] -= 1
                if counts[child] == 0:  # only this occurrence passed here: its subtree is this path
                    self._detach(node, child)
                    break
                node = child
        self.version += 1

    def _new_child(self, parent: int, token: int) -> int:
        if self.free:
            node = self.free.pop()
            self.counts[node], self.token[node], self.first[node] = 0, token, -1
        else:
            node = len(self.counts)
            self.counts.append(0)
            self.token.append(token)
            self.first.append(-1)
            self.sibling.append(-1)
        self.sibling[node] = self.first[parent]
        self.first[parent] = node
        return node

    def _detach(self, parent: int, node: int) -> None:
        """Unlink ``node`` from its parent and free it with its whole subtree."""
        del self.edges[(parent << TOKEN_BITS) | self.token[node]]
        prev, c = -1, self.first[parent]
        while c != node:
            prev, c = c, self.sibling[c]
        if prev < 0:
            self.first[parent] = self.sibling[node]
        else:
            self.sibling[prev] = self.sibling[node]
        stack = [node]
        while stack:
            n = stack.pop()
            c = self.first[n]
            while c >= 0:
                del self.edges[(n << TOKEN_BITS) | self.token[c]]
                stack.append(c)
                c = self.sibling[c]
            self.counts[n], self.first[n], self.sibling[n], self.token[n] = 0, -1, -1, -1
            self.free.append(n)

    # -- reading -----------------------------------------------------------------------------
    def find(self, tokens: Sequence[int]) -> int:
        """The node of a substring, or -1 if it does not occur (or is longer than depth)."""
        node = ROOT
        for t in tokens:
            node = self.edges.get((node << TOKEN_BITS) | t, -1)
            if node < 0:
                return -1
        return node

    def count(self, tokens: Sequence[int]) -> int:
        node = self.find(tokens)
        return self.counts[node] if node >= 0 else 0

    def children(self, node: int) -> list[int]:
        out = []
        c = self.first[node]
        while c >= 0:
            out.append(c)
            c = self.sibling[c]
        return out

    def has_children(self, node: int) -> bool:
        return self.first[node] >= 0

    def grow(self, start: int, max_nodes: int, min_prob: float) -> Growth:
        """The most probable continuations of ``start`` as a tree of at most ``max_nodes``
        nodes: best-first by path probability (the product of count(child) / count of the
        parent's continued occurrences along the path), none below ``min_prob``. Path
        probabilities only shrink going down, so parents come before their children."""
        if max_nodes <= 0:
            return Growth([], [], 0.0)
        counts, token, first, sibling = self.counts, self.token, self.first, self.sibling
        heap: list[tuple[float, int, int, int]] = []  # (-path probability, tie-break, node, parent index)
        tick = 0
        tokens: list[int] = []
        parents: list[int] = []
        score = 0.0
        node, prob, index = start, 1.0, -1
        while True:
            c = first[node]
            total = 0
            while c >= 0:
                total += counts[c]
                c = sibling[c]
            c = first[node]
            while c >= 0:
                p = prob * counts[c] / total
                if p >= min_prob:
                    heapq.heappush(heap, (-p, tick, c, index))
                    tick += 1
                c = sibling[c]
            if not heap:
                return Growth(tokens, parents, score)
            negp, _, node, parent = heapq.heappop(heap)
            prob, index = -negp, len(tokens)
            tokens.append(token[node])
            parents.append(parent)
            score += prob
            if len(tokens) >= max_nodes:
                return Growth(tokens, parents, score)
