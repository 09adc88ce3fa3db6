"""Lookahead decoding (after Fu et al. 2024): Jacobi iteration and n-gram verification in
the target's own verification pass, with no draft model.

Each row keeps a *window* of guessed future tokens and an *n-gram pool*. Every step the
draft tree under the root (the last committed token) holds two kinds of branches:

- *verification branches*: up to G n-grams from the pool whose first token is the root,
  their N - 1 following tokens merged as a trie. The pool remembers the few tokens seen
  before each n-gram; those whose remembered context matches more of the current one come
  first, then the most recently seen;
- the *lookahead branch*: the window. The window has W columns of N - 1 levels; column i
  holds the trajectory of guesses for one diagonal of future positions (level 0 the oldest
  guess, level N - 2 the newest). Its tree shape is a *spine* (the level-0 guesses of
  columns 0, 1, ..., a chain under the root) with, below spine node i, a chain of column i's
  levels 1 .. N - 2. So (the tree mask lets a node see only its ancestors) the newest guess
  of column i sees the committed text, the spine up to column i and its own column: the
  conditioning of the paper's 2-D window.

The target's logits at the top of column i give its next guess (greedy argmax: a Jacobi
update). ``observe`` then harvests the n-gram ``column i + [new guess]`` into the pool
(keyed by its first token), moves each column up one level (the oldest guess drops out, the
new one enters on top) and shifts the columns past the tokens the step committed, filling
new columns at the end with random tokens of the context (a per-row generator seeded with
0, never the target's). Columns a small budget left out of the draft keep their guesses.
The pool is also fed with the n-grams of the generated text and, with ``use_prompt``, of
the prompt.

All nodes are deterministic drafts (``p_draft`` None): a window guess the target happens to
agree with is simply accepted. The drafts depend only on the context and on earlier steps
(the window's logits are the target's, computed before the step's acceptance draws), so
sampled rows stay exact.

Budget (``budgets[row]`` bounds the node count): half of it, in whole columns of N - 1
nodes (at most W), is reserved for the window; the candidates fill the rest in pool order
(a trie shares their common prefixes), and whatever they leave goes to more window columns.
A budget below 2 (N - 1) reserves no column (a column still fits into what the candidates
leave); budget 0 drafts nothing (the window then only shifts with the committed token).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from specdraft.accept import Acceptance
from specdraft.draft import Draft
from specdraft.errors import SpecdraftError
from specdraft.model.kv_cache import KVCache
from specdraft.proposers.base import Verified, move_key
from specdraft.sequence import Sequence


@dataclass(frozen=True, slots=True)
class LookaheadConfig:
    """window: W, Jacobi window columns (guessed future positions). ngram: N, the n-gram size
    (the window has N - 1 levels; a verified candidate is N - 1 tokens). candidates: G, the
    most pool n-grams verified per step (the pool keeps 4 G per first token). pool_size: the most
    n-grams a request's pool holds (least recently seen dropped first). use_prompt: also fill
    the pool with the prompt's n-grams. The budget (k) bounds the nodes: half for the window."""

    window: int = 3
    ngram: int = 4
    candidates: int = 4
    pool_size: int = 8192
    use_prompt: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or not 1 <= self.window <= 64:
            raise SpecdraftError(f"lookahead: window must be an integer in 1..64, got {self.window!r}")
        if not isinstance(self.ngram, int) or not 2 <= self.ngram <= 16:
            raise SpecdraftError(f"lookahead: ngram must be an integer in 2..16, got {self.ngram!r}")
        if not isinstance(self.candidates, int) or not 0 <= self.candidates <= 64:
            raise SpecdraftError(f"lookahead: candidates must be an integer in 0..64, got {self.candidates!r}")
        if not isinstance(self.pool_size, int) or not max(1, self.candidates) <= self.pool_size <= 10**7:
            raise SpecdraftError(
                f"lookahead: pool_size must be an integer in max(1, candidates)..10^7, got {self.pool_size!r}"
            )

    @property
    def levels(self) -> int:
        """Nodes per window column, and tokens per verified candidate: N - 1."""
        return self.ngram - 1


# --------------------------------------------------------------------------- the n-gram pool


CONTEXT = 3  # tokens before an n-gram remembered with it, to rank the candidates
PER_KEY = 4  # n-grams kept per first token, in multiples of the candidates verified


@dataclass(slots=True)
class NgramPool:
    """n-grams by first token, each with the (up to CONTEXT) tokens seen before it. Each first
    token keeps its ``per_key`` most recently seen n-grams; the whole pool keeps ``size`` (the
    least recently seen are dropped first)."""

    size: int
    per_key: int
    by_key: dict[int, OrderedDict[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)  # oldest first
    order: OrderedDict[tuple[int, ...], None] = field(default_factory=OrderedDict)  # every n-gram, oldest first

    def __len__(self) -> int:
        return len(self.order)

    def add(self, ngram: tuple[int, ...], before: Seq[int] = ()) -> None:
        """Add (or refresh) an n-gram of at least two tokens, seen after ``before``."""
        entries = self.by_key.setdefault(ngram[0], OrderedDict())
        entries[ngram] = tuple(before[max(0, len(before) - CONTEXT) :])
        entries.move_to_end(ngram)
        self.order[ngram] = None
        self.order.move_to_end(ngram)
        if len(entries) > self.per_key:
            self._drop(next(iter(entries)))
        while len(self.order) > self.size:
            self._drop(next(iter(self.order)))

    def _drop(self, ngram: tuple[int, ...]) -> None:
        del self.order[ngram]
        entries = self.by_key[ngram[0]]
        del entries[ngram]
        if not entries:
            del self.by_key[ngram[0]]

    def continuations(self, first: int, limit: int, before: Seq[int] = ()) -> list[tuple[int, ...]]:
        """The tokens after ``first`` of up to ``limit`` n-grams that start with it: those whose
        remembered context matches more of ``before`` (the tokens before ``first`` now) first,
        then the most recently seen."""
        entries = self.by_key.get(first)
        if not entries or limit <= 0:
            return []
        ranked = sorted(enumerate(entries.items()), key=lambda e: (_common_tail(e[1][1], before), e[0]), reverse=True)
        return [ngram[1:] for _, (ngram, _) in ranked[:limit]]

    def nbytes(self) -> int:
        # rough: two tuples (2 x 56 + 8 per token) and two dict slots (~100 bytes) per n-gram
        return sum(212 + 8 * (len(g) + CONTEXT) for g in self.order)


def _common_tail(a: Seq[int], b: Seq[int]) -> int:
    """How many trailing tokens a and b share."""
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return n


# --------------------------------------------------------------------------- the draft tree


@dataclass(slots=True)
class TreeBuilder:
    """A trie of token paths under the root that reports the node index of every path
    position, so the caller can find the window's nodes among the merged ones."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    index: dict[tuple[int, int], int] = field(default_factory=dict)  # (parent, token) -> node

    def missing(self, path: Seq[int]) -> int:
        """How many new nodes adding ``path`` would take."""
        parent = -1
        for depth, tok in enumerate(path):
            node = self.index.get((parent, tok))
            if node is None:
                return len(path) - depth
            parent = node
        return 0

    def add(self, path: Seq[int], max_nodes: int) -> list[int]:
        """Add ``path`` (stopping at max_nodes nodes in all); the node of each position added."""
        nodes: list[int] = []
        parent = -1
        for tok in path:
            node = self.index.get((parent, tok))
            if node is None:
                if len(self.tokens) >= max_nodes:
                    break
                node = self.index[(parent, tok)] = len(self.tokens)
                self.tokens.append(tok)
                self.parents.append(parent)
            nodes.append(node)
            parent = node
        return nodes

    def draft(self) -> Draft:
        return Draft(tuple(self.tokens), tuple(self.parents))


# --------------------------------------------------------------------------- per-row state


@dataclass(slots=True)
class RowState:
    seq: Sequence
    pool: NgramPool
    window: list[list[int]]  # [W][N - 1]: column i, levels 0 (oldest guess) .. N - 2 (newest)
    rng: random.Random  # fills new window columns with context tokens (never the target's generator)
    harvested_to: int  # every text n-gram ending at or before this position is in the pool
    fed: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # per window column in the
    # last draft: the node of its top, and the tokens before its oldest guess (for the pool)
    draft: Draft | None = None  # the last draft proposed (fed's node indices refer to it)


def split_budget(budget: int, config: LookaheadConfig) -> int:
    """Nodes reserved for the window: half the budget in whole columns, at most W columns."""
    columns = min(config.window, (budget // 2) // config.levels)
    return columns * config.levels


class LookaheadProposer:
    name = "lookahead"

    def __init__(self, config: LookaheadConfig | None = None) -> None:
        self.config = config or LookaheadConfig()
        self.rows: dict[int, RowState] = {}

    # -- request life cycle ---------------------------------------------------------------
    def begin(self, row: int, seq: Sequence) -> None:
        c = self.config
        rng = random.Random(0)
        window = [[rng.choice(seq.tokens) for _ in range(c.levels)] for _ in range(c.window)]
        start = 0 if c.use_prompt else len(seq.prompt)
        self.rows[row] = RowState(seq, NgramPool(c.pool_size, PER_KEY * max(1, c.candidates)), window, rng, start)

    def end(self, row: int) -> None:
        self.rows.pop(row, None)

    def move(self, src: int, dst: int) -> None:
        move_key(self.rows, src, dst)

    def memory_bytes(self) -> int:
        window = self.config.window * self.config.levels * 8
        return sum(s.pool.nbytes() + window for s in self.rows.values())

    # -- drafting ---------------------------------------------------------------------------
    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache: KVCache) -> list[Draft]:
        drafts = []
        for row, (seq, budget) in enumerate(zip(seqs, budgets)):
            state = self.rows.get(row)
            if state is not None:
                state.fed, state.draft = [], None
            if seq is None or budget <= 0 or state is None:
                drafts.append(Draft.empty())
                continue
            self._harvest_text(state, seq.tokens)
            state.draft = self._draft(state, seq.tokens, budget)
            drafts.append(state.draft)
        return drafts

    def _harvest_text(self, state: RowState, tokens: list[int]) -> None:
        """Add the text's n-grams that end at positions harvested_to + 1 .. len(tokens)."""
        n = self.config.ngram
        for end in range(max(state.harvested_to + 1, n), len(tokens) + 1):
            state.pool.add(tuple(tokens[end - n : end]), tokens[max(0, end - n - CONTEXT) : end - n])
        state.harvested_to = max(state.harvested_to, len(tokens))

    def _draft(self, state: RowState, tokens: list[int], budget: int) -> Draft:
        tree = TreeBuilder()
        candidate_nodes = budget - split_budget(budget, self.config)
        before = tokens[-1 - CONTEXT : -1]
        for cont in state.pool.continuations(tokens[-1], self.config.candidates, before):
            tree.add(cont, candidate_nodes)
        spine: list[int] = []
        for column in state.window:
            path = [*spine, *column]  # level 0 of every column so far, then this column's levels
            if tree.missing(path) > budget - len(tree.tokens):
                break
            nodes = tree.add(path, budget)
            state.fed.append((nodes[-1], (*tokens[-CONTEXT:], *spine)[-CONTEXT:]))
            spine.append(column[0])
        return tree.draft()

    # -- learning ----------------------------------------------------------------------------
    def observe(self, row: int, draft: Draft, acceptance: Acceptance, verified: Verified) -> None:
        state = self.rows.get(row)
        if state is None:
            return
        fed = len(state.fed) if draft is state.draft else 0  # a draft cut by the engine: no update
        if fed:
            rows = torch.tensor([node + 1 for node, _ in state.fed], device=verified.logits.device)
            guesses = verified.logits[rows].argmax(-1).tolist()  # [fed] the target's next guess per column
            for column, (_, before), guess in zip(state.window, state.fed, guesses):
                state.pool.add((*column, guess), before)
                column[:] = [*column[1:], guess]
        # fed columns moved up one level (one position); the rest of the shift drops columns
        self._shift(state, len(acceptance.tokens) - (1 if fed else 0))
        state.fed, state.draft = [], None

    def _shift(self, state: RowState, drop: int) -> None:
        """Drop the first ``drop`` columns (their positions are committed now) and append as
        many new ones of random context tokens."""
        drop = min(drop, len(state.window))
        if drop <= 0:
            return
        tokens = state.seq.tokens
        fresh = [[state.rng.choice(tokens) for _ in range(self.config.levels)] for _ in range(drop)]
        state.window[:] = [*state.window[drop:], *fresh]
