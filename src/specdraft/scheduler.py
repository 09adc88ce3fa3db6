"""Continuous batching: requests join the running batch between steps and leave it when they
finish or are cancelled.

The scheduler owns a cache of ``max_batch`` slots of ``row_capacity`` positions each. Each
iteration (``run_once``) it

1. frees the slots of finished and cancelled requests (the next step no longer runs them);
2. gives free slots to waiting requests, oldest first, while the positions they claim (prompt
   and ``max_new_tokens``, at most a slot) fit ``max_tokens_in_flight`` (``max_queue`` may
   wait; past that, ``submit`` refuses with ``Overloaded``);
3. feeds up to ``prefill_tokens`` prompt tokens of the requests that joined, in chunks of
   ``prefill_chunk`` in a small cache of their own (so one long prompt is spread over several
   iterations instead of stalling the running rows), then copies each finished prompt into its
   slot, draws its first token and adds the row to the running batch. Requests admitted in the
   same iteration are fed together, as the rows of one ragged forward per chunk
   (``batching.prefill_groups``: similar lengths, a chunk's rows x width within the budget), so
   a burst of short prompts costs a few forwards rather than one each. Requests with the same
   prompt (several samples of one question) share one row of that forward, and each copies it;
4. packs the running rows: while a free slot lies below the last running request (nobody
   waits for it), that request moves into it (its keys/values are copied, and the proposer's
   and the policy's state for the row follow it: ``move``). Without this, a request that
   finished early leaves a hole that every later step computes as an idle row; speculation,
   which lets rows finish at different rates, leaves more of them;
5. runs one ``Engine.step`` (propose, verify, accept, commit, observe) over the slots up to
   the last running one. Free slots below it (holding joining requests) are idle rows of that
   step (a dummy token each); new requests take the lowest free slot, so holes fill first.

Events go to each request's ``on_event`` callback, on the scheduler's thread. ``submit`` and
``cancel`` may be called from any thread; ``run_once`` from one thread only.

``Engine.generate`` runs on a *static* scheduler (``SchedulerConfig.static``): every request is
submitted before the first iteration, all prompts are fed in it, and the batch then only
shrinks (packed like any other, so a finished row costs no later step); the policy weighs how
much sooner the batch ends rather than throughput.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdraft.batching import PREFILL_CHUNK, PREFILL_TOKENS, feed_chunk, prefill_groups
from specdraft.engine import Batch, Engine, Memory, StreamEvent, check_prompt, joined_features
from specdraft.errors import ContextOverflowError, SpecdraftError
from specdraft.metrics import SpecStats
from specdraft.model.kv_cache import KVCache
from specdraft.sampling import GREEDY, Sampling, make_generator
from specdraft.sequence import GenerationConfig, Sequence

DEFAULT_ROW_CAPACITY = 2048  # positions per slot when the model's context is longer


class Overloaded(SpecdraftError):
    """The queue is full: the request is refused rather than queued without bound."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """max_batch: slots decoded together. max_queue: requests that may wait for a slot.
    row_capacity: positions per slot, prompt + output (None: the model's context, at most
    ``DEFAULT_ROW_CAPACITY``); the cache holds max_batch x row_capacity positions, which bounds
    the tokens in flight. max_tokens_in_flight: a tighter bound on them (None: the cache's): a
    waiting request takes a free slot only while the positions claimed by the requests holding
    slots (each its prompt plus its max_new_tokens, at most a slot) stay within it, so many short
    requests run together where few long ones would (at least one slot). prefill_tokens: prompt tokens fed between two decode steps (at least
    one chunk). pack: move running requests into free slots below them (module doc; only with
    a proposer that implements ``move``). batch_grid: the batch sizes the adaptive policy's cost
    model is measured at. static: a batch whose requests all come first (``Engine.generate``;
    module doc): a request may ask for more tokens than its slot holds (its sequence stops at
    the slot's end), the policy prices every step at ``max_batch`` rows (the size it measured
    first; ``Batch.priced``) as the batch shrinks, the cost model is left to measure each
    batch's own size, and the engine's learned state is not snapshotted for
    ``reset_memory``."""

    max_batch: int = 16
    max_queue: int = 256
    row_capacity: int | None = None
    max_tokens_in_flight: int | None = None
    prefill_chunk: int = PREFILL_CHUNK
    prefill_tokens: int = PREFILL_CHUNK
    pack: bool = True
    static: bool = False

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_queue", "prefill_chunk", "prefill_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SpecdraftError(f"{name} must be an integer >= 1, got {value!r}")
        if self.row_capacity is not None and (not isinstance(self.row_capacity, int) or self.row_capacity < 2):
            raise SpecdraftError(f"row_capacity must be an integer >= 2, got {self.row_capacity!r}")
        limit = self.max_tokens_in_flight
        if limit is not None and (not isinstance(limit, int) or limit < 2):
            raise SpecdraftError(f"max_tokens_in_flight must be an integer >= 2, got {limit!r}")

    @property
    def batch_grid(self) -> tuple[int, ...]:
        """1, 2, 4, ... up to max_batch (included)."""
        sizes, b = [], 1
        while b < self.max_batch:
            sizes.append(b)
            b *= 2
        return tuple(sizes + [self.max_batch])


@dataclass(frozen=True, slots=True)
class RequestEvent:
    text: str  # newly final text (may be "")
    finished: bool
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", "cancelled"
    error: str | None = None  # set when the scheduler failed the request


@dataclass(slots=True, eq=False)
class Request:
    """One request and its progress. Timestamps are ``time.perf_counter()`` seconds."""

    id: int
    seq: Sequence
    on_event: Callable[[RequestEvent], None]
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    slot: int | None = None
    cancelled: bool = False
    prefill: "_Prefill | None" = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.seq.prompt)

    @property
    def completion_tokens(self) -> int:
        """Tokens emitted, an ending EOS token included (as OpenAI counts them)."""
        return self.seq.generated + (self.seq.finish_reason == "eos")

    @property
    def accepted_tokens(self) -> int:
        """Draft tokens the target accepted for this request."""
        return self.seq.stats.accepted


@dataclass(slots=True, eq=False)
class _Prefill:
    """The prompts of requests that joined together, fed in chunks into a cache of their own:
    one row per distinct prompt (``prompts``), member i's in row ``source[i]``; a shorter
    prompt is done, and its requests join, before a longer one."""

    members: list[Request]
    source: list[int]  # per member: its prompt's row
    prompts: list[list[int]]  # per row: the prompt fed there
    cache: KVCache  # [G rows, P positions]
    last_hidden: Tensor  # [G, H]: the state after each row's last prompt token, once done
    done: list[bool]  # per row: its whole prompt is in
    parts: list[dict[int, list[Tensor]]] | None  # per row: the prompt's features, when the proposer wants them
    fed: int = 0  # positions fed so far (the same for every row)

    @property
    def longest(self) -> int:
        return max(len(t) for t in self.prompts)

    def live(self, i: int) -> bool:
        """Whether row i's request still waits for this prefill (not freed, not joined)."""
        return self.members[i].prefill is self

    @property
    def waited_for(self) -> bool:
        """Whether some row's request still waits for this prefill."""
        return any(r.prefill is self for r in self.members)


@dataclass(slots=True)
class SchedulerCounters:
    """What the scheduler has done, for metrics (cumulative)."""

    steps: int = 0  # decode steps run
    rows_run: int = 0  # rows computed over all steps (idle slots included)
    prefill_tokens: int = 0
    prefill_forwards: int = 0  # forwards that fed prompt chunks (a group's rows share one)
    finished: int = 0
    cancelled: int = 0
    moved: int = 0  # running requests moved to a lower slot (packing)
    last_step_rows: int = 0  # rows the last step computed (0: none ran yet / idle)


class Scheduler:
    def __init__(self, engine: Engine, config: SchedulerConfig = SchedulerConfig(),
                 stats: SpecStats | None = None) -> None:
        self.engine = engine
        self.config = config
        limit = engine.model.config.max_context
        self.row_capacity = min(limit, config.row_capacity or DEFAULT_ROW_CAPACITY)
        self.max_tokens_in_flight = config.max_batch * self.row_capacity  # what the cache holds
        if config.max_tokens_in_flight is not None:
            if config.max_tokens_in_flight < self.row_capacity:
                raise SpecdraftError(f"the tokens in flight ({config.max_tokens_in_flight}) must hold at least one "
                                     f"request's context ({self.row_capacity} tokens)")
            self.max_tokens_in_flight = min(self.max_tokens_in_flight, config.max_tokens_in_flight)
        self.cache = engine.model.new_cache(config.max_batch, self.row_capacity)
        self.rows: list[Request | None] = [None] * config.max_batch  # slot -> its request
        self.last: list[int] = [0] * config.max_batch  # slot -> its last emitted token
        self.waiting: deque[Request] = deque()
        self.joining: list[Request] = []  # have a slot, prompt being prefilled
        self.prefilling: list[_Prefill] = []  # their groups, oldest first
        self.stats = stats if stats is not None else SpecStats()  # all requests' counts and the steps' timings
        self.counters = SchedulerCounters()
        self.on_step: Callable[[int, list[Request]], None] | None = None  # (rows computed, requests running)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._next_id = 0
        # what the engine knew before any request (reset_memory; a static batch never resets)
        self._baseline = None if config.static else Memory.of(engine)
        self._reset: threading.Event | None = None  # set once a requested reset is done
        cost = engine.policy.cost
        if cost is not None and not cost.batch_grid and not config.static:
            cost.batch_grid = config.batch_grid

    # -- any thread -------------------------------------------------------------------------
    def submit(self, prompt: Seq[int], config: GenerationConfig, sampling: Sampling = GREEDY,
               on_event: Callable[[RequestEvent], None] = lambda e: None) -> Request:
        """Queue a request. Raises a ``SpecdraftError`` for a prompt that does not fit a slot
        (with its max_new_tokens) and ``Overloaded`` when ``max_queue`` requests already wait."""
        self.check(prompt, config)
        seq = Sequence(
            prompt=list(prompt), config=config, tokenizer=self.engine.tokenizer, sampling=sampling,
            generator=None if sampling.greedy else make_generator(sampling, self.engine.model.device),
            capacity=min(self.row_capacity, len(prompt) + config.max_new_tokens + 1),
        )
        with self._wake:
            if len(self.waiting) >= self.config.max_queue:
                raise Overloaded(f"the server is overloaded: {len(self.waiting)} requests are waiting; retry later")
            request = Request(self._next_id, seq, on_event)
            self._next_id += 1
            self.waiting.append(request)
            self._wake.notify_all()
        return request

    def check(self, prompt: Seq[int], config: GenerationConfig) -> None:
        """Raise a one-line error if the prompt (with its max_new_tokens) does not fit a slot."""
        check_prompt(prompt, self.engine.model.config.vocab_size)
        total = len(prompt) + (1 if self.config.static else config.max_new_tokens)
        if total > self.row_capacity:
            raise ContextOverflowError(
                f"the context per request is {self.row_capacity} tokens, but {total} were asked for "
                f"({len(prompt)} in the prompt, {config.max_new_tokens} to generate)")

    def cancel(self, request: Request) -> None:
        """Stop a request (a client that went away): its slot is freed before the next step."""
        with self._wake:
            request.cancelled = True
            self._wake.notify_all()

    def reset_memory(self) -> threading.Event | None:
        """Ask for the engine's learned state (policy evidence, a proposer's memory of earlier
        outputs) to go back to what it was before the first request, as a benchmark's cells
        each start (``Memory``). Only while idle: returns None when requests are in flight, else
        an event set once the scheduler's thread has done it."""
        with self._wake:
            if self.waiting or self.busy or self._baseline is None:
                return None
            if self._reset is None:
                self._reset = threading.Event()
            done = self._reset
            self._wake.notify_all()
        return done

    def wait_for_work(self, timeout: float) -> None:
        """Block until a request is submitted or cancelled, or ``timeout`` seconds pass."""
        with self._wake:
            if not self.waiting and not self.busy and self._reset is None:
                self._wake.wait(timeout)

    def load(self) -> tuple[int, int, int]:
        """(running, joining, waiting) requests."""
        with self._lock:
            return sum(r is not None for r in self.rows) - len(self.joining), len(self.joining), len(self.waiting)

    @property
    def tokens_in_flight(self) -> int:
        """Positions claimed by the requests holding slots (each its prompt and max_new_tokens,
        at most a slot; ``max_tokens_in_flight`` bounds the sum)."""
        with self._lock:
            return self._claimed()

    def _claimed(self) -> int:
        """``tokens_in_flight``, for a caller that holds the lock."""
        return sum(r.seq.capacity for r in self.rows if r is not None)

    @property
    def busy(self) -> bool:
        """Whether some request holds a slot."""
        return any(r is not None for r in self.rows)

    # -- the scheduler's thread -------------------------------------------------------------
    def run_once(self) -> bool:
        """One iteration (module doc). Returns whether any request is left."""
        with self._lock:
            reset, self._reset = self._reset, None
        if reset is not None and self._baseline is not None:
            self._baseline.restore(self.engine)
            reset.set()
        self._reap()
        self._admit()
        self._prefill()
        self._pack()
        self._decode()
        self._reap()
        with self._lock:
            return bool(self.waiting) or self.busy

    def run_until_idle(self) -> None:
        while self.run_once():
            pass

    def close(self) -> None:
        """Free every slot without events (a caller that stops early, e.g. a closed
        ``Engine.stream``): the proposer and the policy forget the requests."""
        with self._lock:
            held = [r for r in self.rows if r is not None]
            self.waiting.clear()
        for r in held:
            self._free(r)

    def fail_all(self, message: str) -> None:
        """End every request with an error (the scheduler cannot go on)."""
        with self._lock:
            requests = [r for r in self.rows if r is not None] + list(self.waiting)
            self.waiting.clear()
        for r in requests:
            if r.slot is not None:
                self._free(r)
            r.finished_at = time.perf_counter()
            r.on_event(RequestEvent("", True, "error", error=message))

    def _reap(self) -> None:
        """Free the slots of finished and cancelled requests; drop cancelled waiting ones."""
        with self._lock:
            gone = [r for r in self.waiting if r.cancelled]
            for r in gone:
                self.waiting.remove(r)
        for r in gone:
            self._end(r, "cancelled")
        for r in list(self.rows):
            if r is not None and (r.cancelled or r.seq.finished):
                self._free(r)
                self._end(r, "cancelled" if r.cancelled and not r.seq.finished else None)

    def _end(self, r: Request, reason: str | None) -> None:
        r.finished_at = time.perf_counter()
        if reason == "cancelled":
            self.counters.cancelled += 1
            r.on_event(RequestEvent("", True, "cancelled"))
        else:
            self.counters.finished += 1

    def _free(self, r: Request) -> None:
        slot = r.slot
        assert slot is not None
        self.engine.proposer.end(slot)
        self.engine.policy.end(slot)
        self.cache.reset_row(slot)
        with self._lock:
            self.rows[slot] = None
            if r in self.joining:
                self.joining.remove(r)
        self.last[slot] = 0
        r.slot = None
        r.prefill = None

    def _admit(self) -> None:
        """Give free slots (lowest first) to waiting requests, oldest first, while their claims
        fit the tokens in flight (the oldest waits for room rather than be overtaken); group
        this iteration's newcomers for their prefill (module doc, step 3)."""
        admitted: list[Request] = []
        with self._lock:  # only this thread fills slots: count them once (2,000 rows join at once)
            free = deque(i for i, r in enumerate(self.rows) if r is None)
            claimed = self._claimed()
        while True:
            with self._lock:
                if not free or not self.waiting:
                    break
                if claimed + self.waiting[0].seq.capacity > self.max_tokens_in_flight:
                    break
                r = self.waiting.popleft()
                r.slot = free.popleft()
                claimed += r.seq.capacity
                self.rows[r.slot] = r
                self.joining.append(r)
            self.engine.proposer.begin(r.slot, r.seq)
            self.engine.policy.begin(r.slot)
            admitted.append(r)
        # a group's chunk fits one iteration's budget (and PREFILL_TOKENS, the scores' memory)
        budget, chunk = min(self.config.prefill_tokens, PREFILL_TOKENS), self.config.prefill_chunk
        same: dict[tuple[int, ...], list[Request]] = {}  # a prompt -> the requests that sent it, oldest first
        for r in admitted:
            same.setdefault(tuple(r.seq.prompt), []).append(r)
        askers = list(same.values())
        for group in sorted(prefill_groups([len(rs[0].seq.prompt) for rs in askers], budget, chunk), key=min):
            self.prefilling.append(self._group([askers[i] for i in sorted(group)]))

    def _group(self, askers: list[list[Request]]) -> _Prefill:
        """The prefill state of prompts fed together (one row each, in a cache of their own);
        ``askers[j]``: the requests that sent prompt j."""
        model = self.engine.model
        prompts = [list(rs[0].seq.prompt) for rs in askers]
        members = [r for rs in askers for r in rs]
        source = [j for j, rs in enumerate(askers) for _ in rs]
        hidden = torch.zeros(len(prompts), model.config.hidden_size, dtype=model.dtype, device=model.device)  # [G, H]
        parts = [{} for _ in prompts] if self.engine.wants.prompt else None
        cache = model.new_cache(len(prompts), max(len(t) for t in prompts))
        p = _Prefill(members, source, prompts, cache, hidden, [False] * len(prompts), parts)
        for r in members:
            r.prefill = p
        return p

    @torch.inference_mode()
    def _prefill(self) -> None:
        """Feed up to ``prefill_tokens`` positions (a group's rows x its chunk's width), oldest
        group first; each request joins as soon as its own prompt is in."""
        budget = self.config.prefill_tokens
        t0 = time.perf_counter()
        for p in list(self.prefilling):
            prompts = p.prompts
            while p.fed < p.longest and budget > 0 and p.waited_for:
                width = min(self.config.prefill_chunk, p.longest - p.fed)
                feed_chunk(self.engine.model, prompts, p.fed, width, p.cache, p.last_hidden, p.done,
                           self.engine.wants.taps, p.parts)
                self.counters.prefill_forwards += 1
                self.counters.prefill_tokens += sum(max(0, min(len(t), p.fed + width) - p.fed) for t in prompts)
                p.fed += width
                budget -= len(prompts) * width
                self._join([i for i, row in enumerate(p.source) if p.done[row] and p.live(i)], p)
            if p.waited_for:
                break  # out of budget: this group goes on next iteration, and the later ones wait
            self.prefilling.remove(p)
            if budget <= 0:
                break
        self.stats.prefill_s += time.perf_counter() - t0

    def _join(self, joining: list[int], p: _Prefill) -> None:
        """These members' prompts are in: copy each into its slot, draw the first tokens, start
        decoding."""
        if not joining:
            return
        members = [p.members[i] for i in joining]
        rows = [p.source[i] for i in joining]
        slots = [r.slot for r in members]
        assert all(slot is not None for slot in slots)
        self.cache.copy_rows(p.cache, slots, rows)  # type: ignore[arg-type]
        logits = self.engine.model.lm_logits(p.last_hidden[rows])  # [n, V]
        tokens = self.engine.first_tokens(logits, [r.seq for r in members])
        for row, r, slot, token in zip(rows, members, slots, tokens):
            assert slot is not None
            if p.parts is not None:
                self.engine.proposer.prefilled(slot, joined_features(p.parts[row]))  # type: ignore[attr-defined]
            r.seq.append([token])
            r.first_token_at = time.perf_counter()
            with self._lock:
                self.joining.remove(r)
            r.prefill = None
            self.last[slot] = token
            self._deliver(r)

    @torch.inference_mode()
    def _pack(self) -> None:
        """Move the running request of the highest slot into the lowest free slot while one lies
        below it (module doc, step 4)."""
        if not self.config.pack or not hasattr(self.engine.proposer, "move"):
            return
        free = deque(i for i, r in enumerate(self.rows) if r is None)
        running = [i for i, r in enumerate(self.rows) if r is not None and r.prefill is None]
        # a vacated slot lies above every request still to move, so it is never a destination
        while free and running and free[0] < running[-1]:
            src, dst = running.pop(), free.popleft()
            r = self.rows[src]
            assert r is not None
            self.cache.move_row(src, dst)
            self.engine.proposer.move(src, dst)  # type: ignore[attr-defined]
            self.engine.policy.move(src, dst)
            with self._lock:
                self.rows[dst], self.rows[src] = r, None
            self.last[dst], self.last[src] = self.last[src], 0
            r.slot = dst
            self.counters.moved += 1

    def _decode(self) -> None:
        """One engine step over the slots up to the last running one."""
        live = [i for i, r in enumerate(self.rows) if r is not None and r.prefill is None and not r.seq.finished]
        if not live:
            return
        hi = live[-1] + 1
        rows = [r.seq if r is not None and r.prefill is None and not r.cancelled else None for r in self.rows[:hi]]
        batch = Batch(rows, self.cache.head(hi), self.last[:hi], static=self.config.static,
                      priced=self.config.max_batch if self.config.static else 0)
        events = self.engine.step(batch, self.stats)
        self.cache.lengths[:hi] = batch.cache.lengths
        self.last[:hi] = batch.last
        self.counters.steps += 1
        self.counters.rows_run += hi
        self.counters.last_step_rows = hi
        if self.on_step is not None:
            self.on_step(hi, [self.rows[i] for i in live])  # type: ignore[misc]
        for event in events:
            r = self.rows[event.row]
            assert r is not None
            self._deliver(r, event)

    def _deliver(self, r: Request, event: StreamEvent | None = None) -> None:
        """Hand a request its newly final text (``event``'s, or whatever is pending)."""
        text = event.text if event is not None else r.seq.take_stream()
        finished = r.seq.finished
        if text or finished:
            reason = _finish_reason(r.seq.finish_reason) if finished else None
            r.on_event(RequestEvent(text, finished, reason))


def _finish_reason(reason: str | None) -> str:
    """OpenAI's names: "stop" for an end-of-sequence token or a stop string, else "length"."""
    return "stop" if reason in ("eos", "stop") else "length"
