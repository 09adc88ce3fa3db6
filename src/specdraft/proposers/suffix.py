"""Suffix decoding: propose the most frequent continuations of the current suffix as a tree.

In the spirit of SuffixDecoding (Oliaro et al., 2024). Two suffix tries with occurrence
counts (see ``suffix_tree.py``):

- a per-request trie over the prompt and the tokens generated so far, extended by each new
  token (O(depth) work per token);
- a global trie over the outputs of finished requests, shared by every row of this proposer
  and bounded by ``max_nodes``: after an output is added, the oldest outputs are removed
  (their counts subtracted, nodes that reach zero freed) until the trie fits again.

Each step, in each trie, the longest suffix of the context (``min_match`` .. ``max_depth``
tokens) that occurred before with a continuation is the *match*; from its node a draft tree
is grown best-first by path probability (the product of the empirical probabilities
count(child) / count(continued occurrences of the parent)), stopping at the step's budget,
at ``factor`` x the match length nodes (a short, weak match proposes little) and at path
probability ``min_prob``. Of the two trees, the one with the higher score (the sum of its
path probabilities: the expected number of accepted tokens) is proposed; a tie goes to the
request's own trie. Drafts are deterministic (no p_draft).

Unlike the n-gram proposer, which copies what followed the most recent occurrence of the
last few tokens, this uses every occurrence (counts), matches up to ``max_depth`` tokens,
sizes the tree by the match's length and confidence, and also learns from earlier outputs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from specdraft.accept import Acceptance
from specdraft.draft import Draft
from specdraft.errors import SpecdraftError
from specdraft.model.kv_cache import KVCache
from specdraft.proposers.base import ProposerContext, Verified
from specdraft.proposers.suffix_tree import MAX_TOKEN, Growth, SuffixTrie
from specdraft.sequence import Sequence


@dataclass(frozen=True, slots=True)
class SuffixConfig:
    """max_depth / min_match: longest and shortest context suffix matched. factor: a draft
    has at most factor x match length nodes. min_prob: no draft node whose path probability
    (product of empirical next-token frequencies) is lower. matches: how many match lengths
    (longest first) to grow a draft from; the best-scoring draft wins. use_global: also match the
    outputs of earlier requests; max_nodes: that global trie's node cap (the oldest outputs
    are evicted to fit)."""

    max_depth: int = 24
    min_match: int = 2
    factor: float = 1.0
    min_prob: float = 0.1
    matches: int = 3
    label_cap: int = 6
    use_global: bool = True
    max_nodes: int = 200_000

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.max_depth <= 256:
            raise SpecdraftError(
                f"suffix: need 1 <= min_match <= max_depth <= 256, got min_match={self.min_match}, "
                f"max_depth={self.max_depth}"
            )
        if not 0 < self.factor <= 64:
            raise SpecdraftError(f"suffix: factor must be in (0, 64], got {self.factor}")
        if not 0 <= self.min_prob <= 1:
            raise SpecdraftError(f"suffix: min_prob must be in [0, 1], got {self.min_prob}")
        if not 1 <= self.matches <= 64:
            raise SpecdraftError(f"suffix: matches must be in 1..64, got {self.matches}")
        if not 0 <= self.label_cap <= 256:
            raise SpecdraftError(f"suffix: label_cap must be in 0..256, got {self.label_cap}")
        if not 0 <= self.max_nodes <= 100_000_000:
            raise SpecdraftError(f"suffix: max_nodes must be in 0..100000000, got {self.max_nodes}")


_EMPTY = Growth([], [], 0.0)


@dataclass(slots=True)
class _Row:
    """One request's state: its own trie and where its context's suffixes end in both tries."""

    seq: Sequence
    trie: SuffixTrie
    ends: list[int]  # nodes of the context's suffixes in ``trie`` (lengths 0, 1, ...)
    fed: int = 0  # tokens of seq.tokens already in ``trie``
    global_ends: list[int] | None = None  # the same in the global trie (None = look up again)
    global_fed: int = 0
    global_version: int = -1


class SuffixProposer:
    name = "suffix"

    def __init__(self, config: SuffixConfig | None = None, max_draft: int = 8) -> None:
        self.config = config or SuffixConfig()
        # a match of max_depth tokens still has room below it for a draft of max_draft levels
        self.depth = self.config.max_depth + max(1, max_draft)
        self.rows: dict[int, _Row] = {}
        self.global_trie = SuffixTrie(self.depth)
        self.outputs: deque[list[int]] = deque()  # what the global trie holds, oldest first

    @classmethod
    def from_context(cls, config: SuffixConfig | None, context: ProposerContext | None) -> "SuffixProposer":
        return cls(config, context.max_draft if context is not None else 8)

    # -- request life cycle --------------------------------------------------------------------
    def begin(self, row: int, seq: Sequence) -> None:
        if seq.tokens and (max(seq.tokens) > MAX_TOKEN or min(seq.tokens) < 0):
            raise SpecdraftError(f"suffix: token ids must be in 0..{MAX_TOKEN}")
        self.rows[row] = _Row(seq, SuffixTrie(self.depth), [0])
        self._feed(self.rows[row])

    def end(self, row: int) -> None:
        state = self.rows.pop(row, None)
        if state is None or not self.config.use_global:
            return
        output = state.seq.output
        if output:
            self._remember(list(output))

    def _remember(self, output: list[int]) -> None:
        """Add a finished output to the global trie, then evict the oldest until it fits."""
        self.global_trie.add(output)
        self.global_trie.version += 1  # readers look their suffixes up again
        self.outputs.append(output)
        while self.outputs and self.global_trie.nodes > self.config.max_nodes:
            self.global_trie.remove(self.outputs.popleft())

    # -- proposing -----------------------------------------------------------------------------
    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache: KVCache) -> list[Draft]:
        drafts = []
        for row, (seq, budget) in enumerate(zip(seqs, budgets)):
            if seq is None or budget <= 0:
                drafts.append(Draft.empty())
                continue
            drafts.append(self._propose_row(self.rows[row], budget))
        return drafts

    def _propose_row(self, state: _Row, budget: int) -> Draft:
        self._feed(state)
        best, length = self._grow(state.trie, state.ends, budget)
        source = "s"
        if self.config.use_global and self.outputs:
            other, other_length = self._grow(self.global_trie, self._global_ends(state), budget)
            if other.score > best.score:
                best, length, source = other, other_length, "g"
        if not best.tokens:
            return Draft.empty()
        # the label tells the adaptive policy what evidence the draft rests on (it learns how
        # often each kind pays): the trie and the match length, long matches pooled
        label = f"{source}{min(length, self.config.label_cap)}" if self.config.label_cap else ""
        return Draft(tuple(best.tokens), tuple(best.parents), label=label)

    def _grow(self, trie: SuffixTrie, ends: list[int], budget: int) -> tuple[Growth, int]:
        """The best-scoring draft among the longest ``matches`` suffixes (min_match ..
        max_depth tokens) that have continuations. A shorter suffix is only tried where it
        occurs more often than the longer one (otherwise its continuations are the same): in
        a loop, the longest match's only earlier occurrence may end at the context's end,
        while a shorter one also matches a period earlier, with a longer continuation."""
        c = self.config
        counts, first = trie.counts, trie.first
        best, best_length, tried, deeper = _EMPTY, 0, 0, 0
        for length in range(min(c.max_depth, len(ends) - 1), c.min_match - 1, -1):
            node = ends[length]
            if first[node] < 0 or counts[node] == deeper:
                continue
            deeper = counts[node]
            growth = trie.grow(node, min(budget, max(1, int(c.factor * length))), c.min_prob)
            if growth.score > best.score:
                best, best_length = growth, length
            tried += 1
            if tried == c.matches or best.score >= budget - 1e-9:  # nothing can beat a sure full draft
                break
        return best, best_length

    def _feed(self, state: _Row) -> None:
        """Extend the request's trie with the tokens emitted since the last call."""
        tokens = state.seq.tokens
        for i in range(state.fed, len(tokens)):
            state.ends = state.trie.advance(state.ends, tokens[i])
        state.fed = len(tokens)

    def _global_ends(self, state: _Row) -> list[int]:
        """Where the context's suffixes end in the global trie: followed token by token, and
        looked up again from the last tokens whenever the global trie changed."""
        trie, tokens = self.global_trie, state.seq.tokens
        if state.global_ends is None or state.global_version != trie.version:
            state.global_ends = trie.ends_of(tokens)
        else:
            for i in range(state.global_fed, len(tokens)):
                state.global_ends = trie.follow(state.global_ends, tokens[i])
        state.global_fed, state.global_version = len(tokens), trie.version
        return state.global_ends

    def observe(self, row: int, draft: Draft, acceptance: Acceptance, verified: Verified) -> None:
        pass  # the trie catches up with the new tokens at the next propose()

    def memory_bytes(self) -> int:
        return (self.global_trie.nbytes() + sum(r.trie.nbytes() for r in self.rows.values())
                + sum(8 * len(o) + 56 for o in self.outputs))
