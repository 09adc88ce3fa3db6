"""Suffix decoding: propose the most frequent continuations of the current suffix as a tree.

In the spirit of SuffixDecoding (Oliaro et al., 2024). Two suffix tries with occurrence
counts (see ``suffix_tree.py``):

- a per-request trie over the prompt and the tokens generated so far, extended by each new
  token (O(depth) work per token);
- a global trie over the outputs of finished requests, shared by every row of this proposer
  and bounded by ``max_nodes``: after an output is added, the oldest outputs are removed
  (their counts subtracted, nodes that reach zero freed) until the trie fits again.

Each step, in each trie, the suffixes of the context that occurred before with a
continuation are *matches* (this request's trie: ``min_match`` .. ``max_depth`` tokens; the
global one: from ``global_min_match``). From the longest match, and from up to ``matches - 1``
shorter ones that occur more often (in a loop the longest match's only earlier occurrence may
stop at the end of the context; a shorter one a period earlier continues further), a draft
tree is grown best-first by path probability (the product of the empirical probabilities
count(child) / count(continued occurrences of the parent)), stopping at the step's budget,
at ``factor`` x the match length nodes (a short match proposes little, a long one more) and
at path probability ``min_prob``. Each tree's score is the sum of its path probabilities
(the expected number of accepted tokens, were the counts right). The trees of both tries are
ranked by score (ties: this request's trie, then the longer match) and merged best first
into one draft of at most the budget (shared prefixes count once); with ``merge`` off only
the best tree is proposed. Drafts are deterministic (no p_draft).

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
from specdraft.proposers.base import ProposerContext, Verified, move_key
from specdraft.proposers.suffix_tree import INT_BYTES, MAX_TOKEN, Growth, SuffixTrie
from specdraft.sequence import Sequence


@dataclass(frozen=True, slots=True)
class SuffixConfig:
    """max_depth / min_match: longest and shortest context suffix matched in this request's
    trie (global_min_match: shortest in the trie of earlier outputs, whose short matches are
    weak evidence). factor: a draft grown from a match of m tokens has at most factor x m
    nodes. min_prob: no node whose path probability (the product of empirical next-token
    frequencies) is lower. matches: how many match lengths per trie (longest first) grow a
    draft; merge: their union (best first, up to the budget) is proposed, else only the
    best-scoring one. use_global: also draft from earlier outputs; max_nodes: that trie's
    node cap (oldest outputs are evicted to fit). label_cap: label drafts by trie and match
    length (capped) so the adaptive policy learns what each kind pays; 0 = no labels."""

    max_depth: int = 16
    min_match: int = 1
    factor: float = 4.0
    min_prob: float = 0.25
    matches: int = 3
    merge: bool = True
    use_global: bool = True
    global_min_match: int = 3
    max_nodes: int = 100_000
    label_cap: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.max_depth <= 256:
            raise SpecdraftError(
                f"suffix: need 1 <= min_match <= max_depth <= 256, got min_match={self.min_match}, "
                f"max_depth={self.max_depth}"
            )
        if not 1 <= self.global_min_match <= self.max_depth:
            raise SpecdraftError(f"suffix: need 1 <= global_min_match <= max_depth, got {self.global_min_match}")
        if not 0 < self.factor <= 64:
            raise SpecdraftError(f"suffix: factor must be in (0, 64], got {self.factor}")
        if not 0 <= self.min_prob <= 1:
            raise SpecdraftError(f"suffix: min_prob must be in [0, 1], got {self.min_prob}")
        if not 1 <= self.matches <= 64:
            raise SpecdraftError(f"suffix: matches must be in 1..64, got {self.matches}")
        if not 0 <= self.max_nodes <= 100_000_000:
            raise SpecdraftError(f"suffix: max_nodes must be in 0..100000000, got {self.max_nodes}")
        if not 0 <= self.label_cap <= 256:
            raise SpecdraftError(f"suffix: label_cap must be in 0..256, got {self.label_cap}")


_LIST_BYTES = 56  # an empty list; each kept output also holds its token int objects


@dataclass(frozen=True, slots=True)
class _Candidate:
    growth: Growth
    label: str


def merge(growths: list[Growth], budget: int) -> tuple[list[int], list[int]]:
    """One draft tree from several, best first: each tree's nodes are added in its own order
    (parents first) unless the same path is already there, until ``budget`` nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent in the merged tree, token) -> node
    for g in growths:
        ids: list[int] = []  # g's node -> merged node
        for tok, par in zip(g.tokens, g.parents):
            key = (ids[par] if par >= 0 else -1, tok)
            node = index.get(key)
            if node is None:
                if len(tokens) == budget:
                    return tokens, parents
                node = index[key] = len(tokens)
                tokens.append(tok)
                parents.append(key[0])
            ids.append(node)
    return tokens, parents


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

    def move(self, src: int, dst: int) -> None:
        move_key(self.rows, src, dst)

    def _remember(self, output: list[int]) -> None:
        """Add a finished output to the global trie, then evict the oldest until it fits."""
        self.global_trie.add(output)
        self.global_trie.version += 1  # readers look their suffixes up again
        self.outputs.append(output)
        while self.outputs and self.global_trie.nodes > self.config.max_nodes:
            self.global_trie.remove(self.outputs.popleft())

    def snapshot(self) -> tuple[tuple[int, ...], ...]:
        """The earlier outputs the global trie holds, for ``restore`` (what this proposer
        learns across requests)."""
        return tuple(tuple(o) for o in self.outputs)

    def restore(self, snapshot: tuple[tuple[int, ...], ...]) -> None:
        """Forget every output remembered since ``snapshot``: the global trie is rebuilt from
        the snapshot's outputs (between requests: no row may be active)."""
        if self.rows:
            raise SpecdraftError("suffix: restore() while requests are active")
        version = self.global_trie.version
        self.global_trie, self.outputs = SuffixTrie(self.depth), deque()
        self.global_trie.version = version + 1  # node ids held anywhere are stale
        for output in snapshot:
            self._remember(list(output))

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
        found = self._candidates(state.trie, state.ends, budget, "s", self.config.min_match)
        if self.config.use_global and self.outputs:
            found += self._candidates(self.global_trie, self._global_ends(state), budget, "g",
                                      self.config.global_min_match)
        if not found:
            return Draft.empty()
        found.sort(key=lambda c: -c.growth.score)  # stable: ties keep this request's trie, longer matches
        best = found[0]
        if self.config.merge:
            tokens, parents = merge([c.growth for c in found], budget)
        else:
            tokens, parents = best.growth.tokens, best.growth.parents
        return Draft(tuple(tokens), tuple(parents), label=best.label)

    def _candidates(self, trie: SuffixTrie, ends: list[int], budget: int, source: str,
                    min_match: int) -> list[_Candidate]:
        """Drafts grown from the longest ``matches`` suffixes (min_match .. max_depth tokens)
        that have continuations. A shorter suffix is only tried where it occurs more often
        than the longer one (otherwise its continuations are the same): in a loop, the
        longest match's only earlier occurrence may end at the context's end, while a shorter
        one also matches a period earlier, with a longer continuation."""
        c = self.config
        counts, first = trie.counts, trie.first
        out: list[_Candidate] = []
        deeper = 0
        for length in range(min(c.max_depth, len(ends) - 1), min_match - 1, -1):
            node = ends[length]
            if first[node] < 0 or counts[node] == deeper:
                continue
            deeper = counts[node]
            growth = trie.grow(node, min(budget, max(1, int(c.factor * length))), c.min_prob)
            if growth.tokens:
                out.append(_Candidate(growth, self._label(source, length)))
            if len(out) == c.matches or growth.score >= budget - 1e-9:  # nothing beats a sure full draft
                break
        return out

    def _label(self, source: str, length: int) -> str:
        """What evidence a draft rests on, for the adaptive policy (it learns how often each
        kind pays): the trie ("s" this request, "g" earlier outputs) and the match length,
        long matches pooled. "" (no label, no trimming) when label_cap is 0."""
        return f"{source}{min(length, self.config.label_cap)}" if self.config.label_cap else ""

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
                + sum(_LIST_BYTES + (8 + INT_BYTES) * len(o) for o in self.outputs))
