"""N-gram / prompt-lookup proposer.

Looks up the current suffix (the last n tokens, longest n first) in an index of every n-gram
seen so far in the prompt and the generated text, and proposes the tokens that followed its
most recent earlier occurrence. With ``branches > 1`` it proposes the continuations of up to
that many distinct earlier occurrences as a tree.

The index is updated incrementally: each step adds only the n-grams that end at the newly
emitted tokens, so the cost of a step does not grow with the context length.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from specdraft.accept import Acceptance
from specdraft.draft import Draft
from specdraft.errors import SpecdraftError
from specdraft.model.kv_cache import KVCache
from specdraft.proposers.base import Verified, move_key
from specdraft.sequence import Sequence


@dataclass(frozen=True, slots=True)
class NgramConfig:
    """max_n / min_n: longest and shortest suffix to look up. branches: how many distinct
    earlier occurrences to propose (1 = a chain). max_occurrences: positions remembered per
    n-gram (the most recent ones)."""

    max_n: int = 4
    min_n: int = 2
    branches: int = 1
    max_occurrences: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n <= 64:
            raise SpecdraftError(f"ngram: need 1 <= min_n <= max_n <= 64, got min_n={self.min_n}, max_n={self.max_n}")
        if not 1 <= self.branches <= 16:
            raise SpecdraftError(f"ngram: branches must be in 1..16, got {self.branches}")
        if not 1 <= self.max_occurrences <= 64 or self.max_occurrences < self.branches:
            raise SpecdraftError("ngram: max_occurrences must be in 1..64 and >= branches")


@dataclass(slots=True)
class NgramIndex:
    """n-gram -> end positions (exclusive) of its most recent occurrences, oldest first."""

    config: NgramConfig
    table: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    indexed_to: int = 0  # every n-gram ending at or before this position is in the table

    def extend(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams ending at positions indexed_to+1 .. upto."""
        c = self.config
        for end in range(self.indexed_to + 1, upto + 1):
            for n in range(c.min_n, min(c.max_n, end) + 1):
                ends = self.table.setdefault(tuple(tokens[end - n : end]), [])
                ends.append(end)
                if len(ends) > c.max_occurrences:
                    del ends[0]
        self.indexed_to = max(self.indexed_to, upto)

    def lookup(self, tokens: list[int]) -> tuple[list[int], int]:
        """End positions of earlier occurrences of the longest matching suffix, newest first,
        and that suffix's length (0 = no match)."""
        c = self.config
        size = len(tokens)
        for n in range(min(c.max_n, size), c.min_n - 1, -1):
            ends = self.table.get(tuple(tokens[size - n :]))
            if ends:
                return ends[::-1], n
        return [], 0

    def nbytes(self) -> int:
        # rough: key tuple + list + ints, ~ 64 bytes per n-gram plus 8 per position
        return sum(64 + 8 * (len(k) + len(v)) for k, v in self.table.items())


def continuation(tokens: list[int], end: int, k: int) -> list[int]:
    """k tokens that followed an occurrence ending at ``end``; where that runs past the context
    it continues with its own output (so a repeating pattern keeps repeating)."""
    out: list[int] = []
    size = len(tokens)
    for i in range(k):
        j = end + i
        out.append(tokens[j] if j < size else out[j - size])
    return out


def _share_budget(paths: list[list[int]], budget: int) -> list[list[int]]:
    """The newest occurrence keeps half the budget (all of it if alone); the others share the
    rest. Shared prefixes cost nothing extra once merged into a trie."""
    if len(paths) == 1:
        return paths
    main = (budget + 1) // 2
    side = max(1, (budget - main) // (len(paths) - 1))
    return [paths[0][:main], *(p[:side] for p in paths[1:])]


class NgramProposer:
    name = "ngram"

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()
        self.index: dict[int, NgramIndex] = {}

    def begin(self, row: int, seq: Sequence) -> None:
        self.index[row] = NgramIndex(self.config)

    def end(self, row: int) -> None:
        self.index.pop(row, None)

    def move(self, src: int, dst: int) -> None:
        move_key(self.index, src, dst)

    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache: KVCache) -> list[Draft]:
        drafts = []
        for row, (seq, budget) in enumerate(zip(seqs, budgets)):
            if seq is None or budget <= 0:
                drafts.append(Draft.empty())
                continue
            drafts.append(self._propose_row(self.index[row], seq.tokens, budget))
        return drafts

    def _propose_row(self, index: NgramIndex, tokens: list[int], budget: int) -> Draft:
        index.extend(tokens, len(tokens) - 1)  # everything but the current suffix itself
        ends, n = index.lookup(tokens)
        if not ends:
            return Draft.empty()
        label = f"n{n}"  # the policy learns how often each match length is right
        if self.config.branches == 1:
            return Draft.chain(continuation(tokens, ends[0], budget), label=label)
        paths: list[list[int]] = []
        for end in ends:
            path = continuation(tokens, end, budget)
            if path not in paths:
                paths.append(path)
            if len(paths) == self.config.branches:
                break
        return Draft.from_paths(_share_budget(paths, budget), max_nodes=budget, label=label)

    def observe(self, row: int, draft: Draft, acceptance: Acceptance, verified: Verified) -> None:
        pass  # the index catches up with the new tokens at the next propose()

    def memory_bytes(self) -> int:
        return sum(ix.nbytes() for ix in self.index.values())
