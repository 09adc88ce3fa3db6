"""The decode loop shared by every method: propose -> verify -> accept -> commit -> observe.

Plain decoding is the same loop with a proposer that never drafts. Rows of a batch are
ragged: each has its own committed length, draft, sampling settings and stop conditions, and
finishes on its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor

from specdraft.accept import Acceptance, accept
from specdraft.draft import Draft, verify_inputs
from specdraft.errors import ContextOverflowError, SpecdraftError
from specdraft.metrics import SpecStats
from specdraft.model.kv_cache import KVCache
from specdraft.model.tokenizer import Tokenizer
from specdraft.model.transformer import ModelOutput, Transformer
from specdraft.policy import Plan, Policy, PolicyConfig
from specdraft.proposers.base import Features, NoDraft, Proposer, Verified, feature_request
from specdraft.sampling import GREEDY, Sampling, next_tokens
from specdraft.sequence import GenerationConfig, Sequence


@dataclass(frozen=True, slots=True)
class StreamEvent:
    row: int
    text: str  # newly final text of that row (may be "")
    finished: bool


@dataclass(slots=True)
class Batch:
    """The rows one step runs: row r of ``cache`` holds request ``rows[r]`` (None: an idle slot,
    which the step feeds a dummy token and leaves empty). ``static``: a batch that ends with its
    last row (``Engine.generate``; the policy weighs how much sooner it ends) rather than one that
    is refilled as rows finish (the scheduler; the policy weighs throughput). ``priced``: the batch
    size the policy prices the step at (0: the rows'): a static batch that shrinks as its rows
    finish keeps its first size, the one the cost model measured before it started, rather than
    stop to measure each smaller one mid-run (its forwards only get cheaper)."""

    rows: list[Sequence | None]
    cache: KVCache  # one row per entry of `rows`
    last: list[int]  # per row: its last emitted token, the root of its next draft (idle rows: 0)
    static: bool = True
    priced: int = 0

    def live(self, row: int) -> bool:
        s = self.rows[row]
        return s is not None and not s.finished

    @property
    def done(self) -> bool:
        return not any(self.live(r) for r in range(len(self.rows)))


@dataclass(frozen=True, slots=True)
class Memory:
    """What an engine has learned across requests (its policy's evidence, and the proposer's
    memory where it has one: ``snapshot``/``restore``), so that a benchmark's repeats each start
    from the same state: a repeat must not draft from the outputs of the round before it."""

    policy: dict[str, object]
    proposer: object | None

    @classmethod
    def of(cls, engine: "Engine") -> "Memory":
        snap = getattr(engine.proposer, "snapshot", None)
        return cls(engine.policy.snapshot(), snap() if snap is not None else None)

    def restore(self, engine: "Engine") -> None:
        engine.policy.restore(self.policy)
        if self.proposer is not None:
            engine.proposer.restore(self.proposer)  # type: ignore[attr-defined]


@dataclass(slots=True)
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str
    stats: SpecStats  # this request's counts (timings are in the call's aggregate stats)


class Engine:
    """A target model, its tokenizer, a proposer and a policy. Each call gets its own cache."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        proposer: Proposer | None = None,
        policy: Policy | None = None,
    ) -> None:
        if tokenizer.vocab_size > model.config.vocab_size:
            raise SpecdraftError(
                f"tokenizer has {tokenizer.vocab_size} tokens but the model only {model.config.vocab_size}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.proposer: Proposer = proposer if proposer is not None else NoDraft()
        self.policy = policy if policy is not None else Policy(PolicyConfig(kind="fixed", k=8))
        self.speculative = not isinstance(self.proposer, NoDraft)
        self.wants = feature_request(self.proposer)  # hidden states the proposer drafts from
        self.trees = bool(getattr(self.proposer, "trees", False))  # drafts may hold more nodes than depth

    @property
    def draft_headroom(self) -> int:
        return self.policy.config.k + 1 if self.speculative else 0

    # -- set-up -----------------------------------------------------------------------------
    def check(self, prompts: Seq[Seq[int]], config: GenerationConfig,
              sampling: Sampling | Seq[Sampling] = GREEDY) -> tuple[list[Sampling], int]:
        """Validate a static batch's prompts (one-line errors); return each prompt's sampling
        settings and the positions a row needs (the longest prompt, its new tokens and the
        drafts' headroom, within the model's context)."""
        if not prompts:
            raise SpecdraftError("no prompts given")
        samplings = [sampling] * len(prompts) if isinstance(sampling, Sampling) else list(sampling)
        if len(samplings) != len(prompts):
            raise SpecdraftError(f"{len(samplings)} sampling settings for {len(prompts)} prompts")
        limit = self.model.config.max_context
        for i, p in enumerate(prompts):
            check_prompt(p, self.model.config.vocab_size, f"prompt {i}")
            if len(p) >= limit:
                raise ContextOverflowError(
                    f"prompt {i} has {len(p)} tokens; the model's context is {limit} "
                    f"(at least one position must remain for generation)"
                )
        longest = max(len(p) for p in prompts)
        return samplings, min(limit, longest + config.max_new_tokens + self.draft_headroom + 1)

    def first_tokens(self, logits: Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row from the prefill logits: [B, V] -> B ids."""
        if all(s.sampling.greedy for s in seqs):
            return logits.argmax(-1).tolist()
        return [int(next_tokens(logits[i : i + 1], s.sampling, s.generator)) for i, s in enumerate(seqs)]

    # -- the loop ---------------------------------------------------------------------------
    def stream(
        self,
        prompts: Seq[Seq[int]],
        config: GenerationConfig = GenerationConfig(),
        sampling: Sampling | Seq[Sampling] = GREEDY,
        stats: SpecStats | None = None,
    ) -> Iterator[StreamEvent]:
        """Generate, yielding text as it becomes final (``StreamEvent.row``: the prompt's index).
        ``stats`` (if given) receives the aggregate counts and timings."""
        yield from self._run(prompts, config, sampling, stats if stats is not None else SpecStats(), [])

    def generate(
        self,
        prompts: Seq[Seq[int]],
        config: GenerationConfig = GenerationConfig(),
        sampling: Sampling | Seq[Sampling] = GREEDY,
        on_text: Callable[[StreamEvent], None] | None = None,
        stats: SpecStats | None = None,
    ) -> list[GenerationResult]:
        seqs: list[Sequence] = []
        for event in self._run(prompts, config, sampling, stats if stats is not None else SpecStats(), seqs):
            if on_text is not None:
                on_text(event)
        return [
            GenerationResult(s.text, s.output, len(s.prompt), s.finish_reason or "length", s.stats) for s in seqs
        ]

    def _run(self, prompts: Seq[Seq[int]], config: GenerationConfig, sampling: Sampling | Seq[Sampling],
             stats: SpecStats, seqs: list[Sequence]) -> Iterator[StreamEvent]:
        """The prompts as one static batch on the scheduler (every prompt fed in its first
        iteration, then steps until the last row ends; ``scheduler`` module doc). ``seqs`` is
        filled with the requests' sequences, in prompt order."""
        from specdraft.scheduler import Scheduler, SchedulerConfig  # (the scheduler is built on this module)

        samplings, capacity = self.check(prompts, config, sampling)
        if self.speculative:
            self.policy.prepare(len(prompts))  # measure the cost model for this batch size, untimed
        scheduler = Scheduler(self, SchedulerConfig(max_batch=len(prompts), max_queue=len(prompts),
                                                    row_capacity=capacity,
                                                    prefill_tokens=len(prompts) * max(map(len, prompts)),
                                                    static=True), stats)
        events: list[StreamEvent] = []
        for i, (p, s) in enumerate(zip(prompts, samplings)):
            request = scheduler.submit(p, config, s, lambda e, i=i: events.append(StreamEvent(i, e.text, e.finished)))
            seqs.append(request.seq)
        try:
            while scheduler.run_once():
                yield from events
                events.clear()
            yield from events
        finally:
            stats.proposer_bytes = max(stats.proposer_bytes, self.proposer.memory_bytes())
            scheduler.close()

    def step(self, batch: Batch, stats: SpecStats) -> list[StreamEvent]:
        """One target pass for every live row: propose, verify, accept, commit, observe. The
        one step every method and both ways of running a batch share. Returns the text each
        row made final."""
        with torch.inference_mode():
            return self._step(batch, stats)

    def _step(self, batch: Batch, stats: SpecStats) -> list[StreamEvent]:
        cache, seqs = batch.cache, batch.rows
        live = [batch.live(r) for r in range(len(seqs))]
        t0 = time.perf_counter()
        plan = self._plan(batch, live)
        tp = time.perf_counter()
        drafts = self._propose(batch, live, plan)
        t1 = time.perf_counter()
        before = list(cache.lengths)
        out = self._verify(drafts, batch.last, cache, live)
        logits = out.logits  # [B, 1 + width, V]
        if self.speculative and logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)  # the forward's real time, for the cost model
        t2 = time.perf_counter()
        if self.speculative:  # priced by the tokens it ran per row (the forward is packed)
            sizes = [len(d) for d in drafts]
            self.policy.observe_verify_time(len(seqs), 1 + sum(sizes) / len(seqs), t2 - t1, max(sizes),
                                            sum(n > 0 for n in sizes))
        results: list[Acceptance | None] = []
        events: list[StreamEvent] = []
        for row, (s, draft) in enumerate(zip(seqs, drafts)):
            if s is None or not live[row]:
                results.append(None)
                continue
            acc = accept(draft, logits[row], s.sampling, s.generator)
            kept = s.append(list(acc.tokens))
            s.stats.record(draft, acc, kept)
            stats.record(draft, acc, kept)
            taps = {layer: states[row] for layer, states in out.hidden.items()}  # [1 + W, H] each
            self.proposer.observe(row, draft, acc, Verified(logits[row], out.last_hidden[row], taps))
            self.policy.observe(row, draft, acc)
            batch.last[row] = acc.tokens[-1]
            results.append(acc)
            events.extend(_events(row, s))
        # a row that finished in this step is emptied now, not at the next commit: the next
        # forward appends 1 + width positions to every row, which a full row has no room for
        commit(cache, before, drafts, [r if batch.live(row) else None for row, r in enumerate(results)])
        t3 = time.perf_counter()
        stats.propose_s += t1 - tp
        stats.verify_s += t2 - t1
        stats.other_s += (tp - t0) + (t3 - t2)
        return events

    def _plan(self, batch: Batch, live: list[bool]) -> Plan:
        """The policy's plan for this step: how many draft tokens each row may have (capped by
        the cache's room and, for chains, by the row's remaining tokens; a tree proposer's
        nodes are capped by the room alone, its depth by the remaining tokens in ``_propose``),
        and what trimming the drafts means."""
        seqs, cache = batch.rows, batch.cache
        if not self.speculative:
            return Plan.none(len(seqs))
        running = [n for n, on in zip(cache.lengths, live) if on]
        free = cache.capacity - 1 - max(running, default=0)  # positions left after the root token
        caps = [self._node_cap(s, free) if on and s is not None else 0 for s, on in zip(seqs, live)]
        setup = getattr(self.proposer, "setup_seconds", None)  # optional (proposers/base.py)
        adaptive = self.policy.config.kind == "adaptive"  # the fixed policy does not weigh costs
        pending = setup([s if on else None for s, on in zip(seqs, live)]) if setup is not None and adaptive else None
        return self.policy.budgets(caps, batch.priced or len(seqs), remaining(batch, live), pending)

    def _propose(self, batch: Batch, live: list[bool], plan: Plan) -> list[Draft]:
        seqs, cache = batch.rows, batch.cache
        if not self.speculative:
            return [Draft.empty() for _ in seqs]
        budgets = plan.budgets
        active = [s if b > 0 and on else None for s, b, on in zip(seqs, budgets, live)]
        lengths = list(cache.lengths)
        t0 = time.perf_counter()
        drafts = self.proposer.propose(active, budgets, cache)
        asked = max((b for b, s in zip(budgets, active) if s is not None), default=0)
        if asked:  # what a budget costs, whatever was found; a catch-up is priced as setup, not here
            spent = time.perf_counter() - t0 - getattr(self.proposer, "setup_spent", 0.0)
            self.policy.observe_propose_time(asked, max(spent, 0.0), len(seqs))
        if cache.lengths != lengths:
            raise RuntimeError(f"proposer {self.proposer.name} changed the target cache's lengths")
        drafts = self.policy.trim(drafts, plan, live)
        if self.trees:  # a path deeper than the row's remaining tokens could never be emitted
            drafts = [d.up_to_depth(s.room - 1) if s is not None and len(d) else d for d, s in zip(drafts, seqs)]
        for d, b in zip(drafts, budgets):
            if len(d) > max(b, 0):
                raise RuntimeError(f"proposer {self.proposer.name} drafted {len(d)} tokens over a budget of {b}")
        return drafts

    def _node_cap(self, seq: Sequence, free: int) -> int:
        """The most draft nodes a row may use: the cache's ``free`` positions, and the row's
        remaining tokens but the bonus one (a chain deeper than that is never emitted). A tree
        proposer's nodes are not bounded by the remaining tokens, only its depth (``_propose``);
        a row's last token has no draft either way."""
        if seq.room <= 1:
            return 0
        return max(0, free if self.trees else min(seq.room - 1, free))

    def _verify(self, drafts: list[Draft], last: list[int], cache: KVCache, live: list[bool]) -> ModelOutput:
        """One target forward over each live row's last token and its draft: logits [B, 1 + width, V]
        and final hidden states [B, 1 + width, H]. Packed: a row's padding past its own draft,
        and idle rows, cost no per-token work (``Transformer.forward``'s ``real``), so rows that
        drafted fewer tokens than the widest do not pay for its width."""
        device = self.model.device
        width = max(len(d) for d in drafts)
        lengths = torch.tensor(cache.lengths, device=device)[:, None]  # [B, 1]
        taps = self.wants.taps
        real = [1 + len(d) if on else 0 for d, on in zip(drafts, live)]
        if width == 0:
            tokens = torch.tensor(last, device=device)[:, None]  # [B, 1]
            return self.model(tokens, lengths, cache, return_hidden=taps, real=real)
        tokens, relative, mask = verify_inputs(drafts, last, width, device)  # [B, 1 + W] x2, [B, 1 + W, 1 + W]
        return self.model(tokens, lengths + relative, cache, mask=mask, return_hidden=taps, real=real)


def check_prompt(prompt: Seq[int], vocab_size: int, name: str = "the prompt") -> None:
    """A one-line error for an empty prompt or a token id outside the vocabulary."""
    if not prompt:
        raise SpecdraftError(f"{name} is empty")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise SpecdraftError(f"{name} has a token id outside the vocabulary (0..{vocab_size - 1})")


def joined_features(parts: dict[int, list[Tensor]]) -> Features:
    """One row's prefill chunks joined: final-norm states (key -1) and taps, [T, H] each."""
    joined = {key: torch.cat(chunks) for key, chunks in parts.items()}
    return Features(joined.pop(-1), joined)


def remaining(batch: Batch, live: list[bool]) -> list[int] | None:
    """Tokens each row may still emit (0 once finished), for a static batch (it ends with its
    last row, so the policy weighs drafts by how much sooner the batch ends; policy doc). None
    for a refilled batch: the policy then weighs throughput."""
    if not batch.static:
        return None
    return [s.room if on and s is not None else 0 for s, on in zip(batch.rows, live)]


def commit(cache: KVCache, before: list[int], drafts: list[Draft], results: list[Acceptance | None]) -> None:
    """Keep the root and the accepted path of each row; drop everything else. Chains (and
    any accepted path that is a prefix of the appended block) are a length change; other
    tree paths are compacted with one gather."""
    keeps = [[0] + [1 + i for i in acc.path] if acc is not None else [] for acc in results]
    # a finished row (None) is emptied: nobody reads it again, and an empty row costs
    # nothing in attention and leaves the cache's room to the rows still running
    start = [b if acc is not None else 0 for b, acc in zip(before, results)]
    if all(k == list(range(len(k))) for k in keeps):
        cache.truncate([b + len(k) for b, k in zip(start, keeps)])
        return
    width = max(len(k) for k in keeps)
    keep = torch.tensor([k + [0] * (width - len(k)) for k in keeps], dtype=torch.long)  # [B, K]
    cache.commit(start, keep, [len(k) for k in keeps])


def _events(row: int, s: Sequence) -> Iterator[StreamEvent]:
    delta = s.take_stream()
    if delta or s.finished:
        yield StreamEvent(row, delta, s.finished)
