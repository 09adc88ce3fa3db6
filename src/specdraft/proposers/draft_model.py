"""Draft-model proposer: a smaller model with the target's vocabulary drafts a chain.

The draft model keeps its own KV cache, one row per engine row. Its row ``r`` holds the keys
and values of a prefix of that row's ``seq.tokens``. At each ``propose``:

1. catch up: feed the tokens the draft has not seen (a row's prompt and first token the first
   time; afterwards the bonus token, after the last drafted token when the whole chain was
   accepted), through the engine's own chunked, ragged prefill (``batching.feed``), keeping
   each row's real tokens only. Fresh rows (nothing cached yet) whose backlogs differ in
   length are fed first, in groups of similar length in caches of their own that are then
   copied in (``batching.feed_group``), so that one long prompt does not make every row
   compute its length;
2. draft the chains, one forward per level for all rows (:mod:`.autoregressive`).

``observe`` rolls the row back to its context plus the drafted tokens that were accepted; the
next catch-up feeds the rest. The cache is allocated at the first ``propose`` of a batch
(re-allocated, and every row re-prefilled, if a later batch needs more rows or positions; a
continuous batch that runs fewer rows drafts in a view of the first ones).

A draft whose context is shorter than a request needs stops drafting for that request (the
budget is clamped; output is unchanged, only speculation stops).

Catching up on a long prompt is the expensive part (the draft's own prefill): before a step,
``setup_seconds`` tells the policy what each row's backlog would cost, from a measured time
per token, so that it drafts (or probes) only where the speculation it buys can repay that.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import time

import torch
from torch import Tensor

from specdraft.accept import Acceptance
from specdraft.draft import Draft
from specdraft.batching import PREFILL_CHUNK, PREFILL_TOKENS, feed, feed_group, prefill_groups
from specdraft.errors import SpecdraftError, VocabularyMismatchError
from specdraft.model.kv_cache import KVCache
from specdraft.model.linear import Linear
from specdraft.model.loader import LoadedModel, load
from specdraft.model.transformer import Transformer
from specdraft.proposers.autoregressive import Drafter, draft_chains, kept_on_chain
from specdraft.proposers.base import ProposerContext, Verified, move_key
from specdraft.sequence import Sequence

DRAFT_DTYPES = ("float32", "bfloat16", "float16")
CATCH_UP_CHUNK = PREFILL_CHUNK  # tokens per forward when catching up (the engine's prefill chunks)
SETUP_MIN_TOKENS = 64  # backlogs shorter than this are part of an ordinary step (ProposeCost)


@dataclass(frozen=True, slots=True)
class DraftModelConfig:
    """path: the draft model, a GGUF file or a Hugging Face folder with the target's vocabulary
    (required). dtype: the draft's weights and cache (float32, bfloat16 or float16; its
    precision does not affect the output). branches: candidates at the first draft position
    (1 = a chain; b > 1 = a tree whose first candidate continues as the chain). distinct: a
    sampled row's first-position candidates are drawn without replacement (False: independent
    draws, which may repeat)."""

    path: str = ""
    dtype: str = "float32"
    branches: int = 1
    distinct: bool = True

    def __post_init__(self) -> None:
        if not self.path:
            raise SpecdraftError("method 'draft' needs a draft model: pass --opt path=DRAFT.gguf (or a Hugging Face folder)")
        if self.dtype not in DRAFT_DTYPES:
            raise SpecdraftError(f"draft: dtype must be one of {', '.join(DRAFT_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.branches, int) or not 1 <= self.branches <= 16:
            raise SpecdraftError(f"draft: branches must be in 1..16, got {self.branches!r}")


@dataclass(frozen=True, slots=True)
class _Pending:
    """A row's draft cache between propose and observe: root_len positions of context (the
    root included), then ``fed`` chain nodes."""

    root_len: int
    fed: int


class DraftModelProposer:
    name = "draft"

    def __init__(self, draft: Transformer, vocab: int, branches: int = 1, max_draft: int = 8,
                 group_tokens: int = PREFILL_TOKENS, distinct: bool = True) -> None:
        """draft: the draft model; vocab: the target's logits width; max_draft: the longest draft
        the policy asks for (sizes the cache); group_tokens: the padded-token budget of a group
        of fresh rows caught up together (``prefill_groups``); distinct: sampled first-position
        candidates without replacement (``autoregressive``)."""
        if draft.config.vocab_size > vocab:
            raise VocabularyMismatchError(
                f"the draft model has {draft.config.vocab_size} logits, more than the target's {vocab}"
            )
        self.draft = draft
        self.vocab = vocab
        self.branches = branches
        self.distinct = distinct
        self.max_draft = max_draft
        self.group_tokens = group_tokens
        self.cache: KVCache | None = None
        self.capacity: dict[int, int] = {}  # row -> positions its request may use
        self.pending: dict[int, _Pending] = {}
        self.seconds_per_token: float | None = None  # catch-up time per token (measured)
        self.setup_spent = 0.0  # seconds the last propose spent on a catch-up (priced as setup, not drafting)

    # -- rows ---------------------------------------------------------------------------------
    def begin(self, row: int, seq: Sequence) -> None:
        self.capacity[row] = seq.capacity
        self._reset_row(row)

    def end(self, row: int) -> None:
        self.capacity.pop(row, None)
        self._reset_row(row)

    def move(self, src: int, dst: int) -> None:
        move_key(self.capacity, src, dst)
        move_key(self.pending, src, dst)
        if self.cache is not None and src < self.cache.batch_size:
            self.cache.move_row(src, dst)

    def _reset_row(self, row: int) -> None:
        self.pending.pop(row, None)
        if self.cache is not None and row < self.cache.batch_size:
            self._set_length(row, 0)

    def _set_length(self, row: int, length: int) -> None:
        assert self.cache is not None
        self.cache.truncate_row(row, length)

    # -- cost ---------------------------------------------------------------------------------
    def setup_seconds(self, seqs: Seq[Sequence | None]) -> list[float]:
        """Per row: the estimated time to catch up on its backlog before it can draft (0 for
        backlogs under ``SETUP_MIN_TOKENS``: those are part of an ordinary step; and for rows
        past the draft's context, which it will never draft for)."""
        limit = self.draft.config.max_context
        backlog = [0 if s is None or len(s.tokens) >= limit else len(s.tokens) - 1 - self._cached(r)
                   for r, s in enumerate(seqs)]
        if max(backlog, default=0) < SETUP_MIN_TOKENS:
            return [0.0] * len(seqs)
        rate = self._rate()
        return [rate * n if n >= SETUP_MIN_TOKENS else 0.0 for n in backlog]

    def _cached(self, row: int) -> int:
        c = self.cache
        return c.lengths[row] if c is not None and row < c.batch_size and row in self.capacity else 0

    @torch.inference_mode()
    def _rate(self) -> float:
        """Seconds per caught-up token: measured on real catch-ups, or, before the first one,
        on two forwards of ``SETUP_MIN_TOKENS`` tokens (the first warms up)."""
        if self.seconds_per_token is None:
            n = SETUP_MIN_TOKENS
            tokens = torch.zeros(1, n, dtype=torch.long, device=self.draft.device)
            positions = torch.arange(n, device=self.draft.device)[None]
            for _ in range(2):
                t0 = time.perf_counter()
                self.draft(tokens, positions, self.draft.new_cache(1, n), logits=False)
                self.seconds_per_token = (time.perf_counter() - t0) / n
        return self.seconds_per_token

    # -- drafting -----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache: KVCache) -> list[Draft]:
        self.setup_spent = 0.0
        if not any(s is not None and b > 0 for s, b in zip(seqs, budgets)):
            return [Draft.empty() for _ in seqs]
        cache_d = self._cache_for(seqs)
        budgets = [min(b, cache_d.capacity - len(s.tokens)) if s is not None else 0 for s, b in zip(seqs, budgets)]
        active = [s if b > 0 else None for s, b in zip(seqs, budgets)]
        root_logits, caught_up = self._catch_up(cache_d, active)  # [B, V_draft]
        active = [s if ok else None for s, ok in zip(active, caught_up)]
        room = cache_d.capacity - max(cache_d.lengths)  # positions the level forwards may append
        budgets = [min(b, room + 1) for b in budgets]
        root_len = list(cache_d.lengths)
        drafted = draft_chains(Drafter(self.draft, cache_d), root_logits, active, budgets, self.branches, self.vocab,
                               distinct=self.distinct)
        cache_d.truncate([n + fed for n, fed in zip(root_len, drafted.fed)])
        if cache_d is not self.cache:  # a view of the first rows: its lengths go back to the cache
            assert self.cache is not None
            self.cache.lengths[: len(seqs)] = cache_d.lengths
        self.pending = {r: _Pending(root_len[r], drafted.fed[r]) for r, s in enumerate(active) if s is not None}
        return drafted.drafts

    def _cache_for(self, seqs: Seq[Sequence | None]) -> KVCache:
        """The draft cache for this step's rows: (re)allocated when the batch needs more rows or
        positions (every row is then caught up again); when a continuous batch runs fewer rows
        than it has, its first ``len(seqs)`` rows as a view (``propose`` hands the lengths back)."""
        longest = max([*self.capacity.values(), *(s.capacity for s in seqs if s is not None)])
        needed = min(self.draft.config.max_context, longest + self.max_draft + 1)
        c = self.cache
        if c is None or c.batch_size < len(seqs) or c.capacity < needed:
            self.cache = self.draft.new_cache(max(len(seqs), c.batch_size if c is not None else 0), needed)
            self.pending.clear()
        assert self.cache is not None
        return self.cache if self.cache.batch_size == len(seqs) else self.cache.head(len(seqs))

    def _catch_up(self, cache: KVCache, seqs: Seq[Sequence | None]) -> tuple[Tensor, list[bool]]:
        """Feed each drafting row's unseen tokens (its root last), right-padded, in chunks.
        Returns the logits after each root [B, V_draft] and which rows got there."""
        lengths = list(cache.lengths)
        for r, s in enumerate(seqs):  # a row must feed at least its root
            if s is not None:
                lengths[r] = min(lengths[r], len(s.tokens) - 1)
        cache.truncate(lengths)
        todo = [s.tokens[n:] if s is not None else [] for s, n in zip(seqs, lengths)]
        t0, fed, longest = time.perf_counter(), sum(len(t) for t in todo), max(map(len, todo), default=0)
        hidden = torch.zeros(len(seqs), self.draft.config.hidden_size, dtype=self.draft.dtype, device=self.draft.device)
        done = [False] * len(seqs)
        fresh = [r for r, (t, n) in enumerate(zip(todo, lengths)) if t and n == 0]
        groups = [[fresh[i] for i in g] for g in prefill_groups([len(todo[r]) for r in fresh], self.group_tokens)]
        if len(groups) > 1 or (fresh and len(fresh) < sum(1 for t in todo if t)):
            for rows in groups:  # in a cache of their own, then copied in
                feed_group(self.draft, todo, rows, cache, CATCH_UP_CHUNK, hidden, done)
            todo = [[] if r in fresh else t for r, t in enumerate(todo)]
        feed(self.draft, todo, cache, CATCH_UP_CHUNK, hidden, done)
        if longest >= SETUP_MIN_TOKENS:  # a real prefill (not many rows' few tokens each)
            self.setup_spent = time.perf_counter() - t0
            self.seconds_per_token = self.setup_spent / fed
        return self.draft.lm_logits(hidden), done

    # -- feedback -----------------------------------------------------------------------------
    def observe(self, row: int, draft: Draft, acceptance: Acceptance, verified: Verified) -> None:
        """Keep the context and the accepted chain nodes; drop the rest."""
        pending = self.pending.pop(row, None)
        if pending is not None and self.cache is not None:
            self._set_length(row, pending.root_len + kept_on_chain(acceptance.path, pending.fed))

    def memory_bytes(self) -> int:
        return weight_bytes(self.draft) + (self.cache.nbytes if self.cache is not None else 0)


def weight_bytes(model: torch.nn.Module) -> int:
    """Parameters plus the packed copies of the linear layers' weights (tied weights once)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                 if isinstance(m, Linear) and m.packed is not None)
    return params + packed


def check_draft(draft: LoadedModel, context: ProposerContext) -> None:
    """Refuse a draft model that does not share the target's vocabulary."""
    if not context.tokenizer.same_vocabulary(draft.tokenizer):
        raise VocabularyMismatchError(
            f"draft model {draft.source} has a different vocabulary or special tokens than the target; "
            "a draft must use the target's tokenizer"
        )
    if draft.config.vocab_size > context.target.config.vocab_size:
        raise VocabularyMismatchError(
            f"draft model {draft.source} has {draft.config.vocab_size} logits, "
            f"more than the target's {context.target.config.vocab_size}"
        )


def make_draft_proposer(config: DraftModelConfig, context: ProposerContext | None) -> DraftModelProposer:
    """The factory: load the draft on the target's device and check its vocabulary."""
    if context is None:
        raise SpecdraftError("method 'draft' needs the target model (a ProposerContext)")
    loaded = load(config.path, dtype=config.dtype, device=context.target.device)
    check_draft(loaded, context)
    return DraftModelProposer(loaded.model, context.target.config.vocab_size, config.branches, context.max_draft,
                              distinct=config.distinct)
