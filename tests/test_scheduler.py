"""Continuous batching on a tiny random model: requests that join and leave a running batch get
what they would get alone; cancelled requests free their slot; limits refuse clearly."""

from __future__ import annotations

import pytest

from specdraft.api import build_engine
from specdraft.engine import Engine
from specdraft.errors import ContextOverflowError, SpecdraftError
from specdraft.model.loader import load
from specdraft.policy import CostModel, measure_latency
from specdraft.sampling import Sampling
from specdraft.scheduler import Overloaded, Request, RequestEvent, Scheduler, SchedulerConfig
from specdraft.sequence import GenerationConfig

TEXTS = ["Hello there, how are", "The quick brown fox jumps over the lazy dog and then", "a",
         "Once upon a time", "def add(a, b):\n    return a + b\n\ndef add(a, b):", "She sells sea shells"]


@pytest.fixture(scope="module")
def tiny(tiny_hf):
    return load(tiny_hf)


def prompts(tiny) -> list[list[int]]:
    return [tiny.tokenizer.encode(t) for t in TEXTS]


def run(scheduler: Scheduler, submissions: list[tuple[int, list[int], GenerationConfig, Sampling]]
        ) -> tuple[list[Request], dict[int, list[RequestEvent]]]:
    """Submit each request at its iteration (first element), run until idle."""
    events: dict[int, list[RequestEvent]] = {}
    requests: list[Request] = []
    pending = sorted(submissions, key=lambda s: s[0])
    iteration = 0
    while pending or scheduler.run_once():
        while pending and pending[0][0] <= iteration:
            _, prompt, cfg, sampling = pending.pop(0)
            i = len(requests)
            events[i] = []
            requests.append(scheduler.submit(prompt, cfg, sampling, events[i].append))
        if pending:
            scheduler.run_once()
        iteration += 1
        assert iteration < 10_000
    return requests, events


@pytest.mark.parametrize("method", ["plain", "ngram", "draft"])
def test_joining_and_leaving_rows_equal_each_request_alone(tiny, tiny_hf, method):
    """Requests arrive while others run, more than there are slots (they queue and reuse
    slots), with prompts fed in small chunks between steps; greedy and seeded sampled output
    equal each request generated alone. (draft: the tiny model drafts for itself, so its
    cache's rows and views are exercised with drafts that are accepted.)"""
    options = {"path": str(tiny_hf)} if method == "draft" else None
    engine = build_engine(tiny, method, k=4, policy="fixed", options=options)
    scheduler = Scheduler(engine, SchedulerConfig(max_batch=3, prefill_chunk=4, prefill_tokens=6, row_capacity=96))
    cfgs = [GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in (20, 7, 30, 12, 25, 9)]
    samplings = [Sampling(), Sampling(temperature=0.8, seed=5), Sampling(), Sampling(temperature=1.0, top_k=20, seed=1),
                 Sampling(), Sampling()]
    arrivals = [0, 0, 3, 4, 4, 11]
    requests, events = run(scheduler, list(zip(arrivals, prompts(tiny), cfgs, samplings)))
    for i, (r, p, cfg, s) in enumerate(zip(requests, prompts(tiny), cfgs, samplings)):
        alone = engine.generate([p], cfg, s)[0]
        assert r.seq.output == alone.tokens, f"request {i}"
        assert "".join(e.text for e in events[i]) == alone.text
        assert [e.finished for e in events[i]].count(True) == 1 and events[i][-1].finished
        assert events[i][-1].finish_reason == "length"
        assert r.completion_tokens == cfg.max_new_tokens
    assert not scheduler.busy and scheduler.counters.finished == len(requests)
    assert all(n == 0 for n in scheduler.cache.lengths)
    if method == "draft":  # a model drafting for itself: (nearly) every draft token is accepted
        assert scheduler.stats.accepted > 0.9 * scheduler.stats.proposed > 0


def test_prompts_that_arrive_together_are_prefilled_together_and_each_joins_when_its_own_is_in(tiny_hf):
    """Six requests admitted in one iteration share each prompt chunk's forward (one group:
    rows x chunk width within the budget); the one-token prompt joins after the first
    chunk while longer ones are still fed; a request cancelled mid-prefill never joins; each
    output is bit for bit what the request gets alone (a batch-invariant bfloat16 model, so
    a row's prefill must not depend on its group)."""
    exact = load(tiny_hf, dtype="bfloat16", batch_invariant=True)
    engine = Engine(exact.model, exact.tokenizer)
    scheduler = Scheduler(engine, SchedulerConfig(max_batch=6, prefill_chunk=4, prefill_tokens=24, row_capacity=96))
    p = prompts(exact)
    longest = max(map(len, p))
    assert len(p[2]) == 1 and longest > 8  # "a"; several chunks of 4 for the others
    cfg = GenerationConfig(max_new_tokens=10, ignore_eos=True)
    requests = [scheduler.submit(q, cfg) for q in p]
    scheduler.run_once()  # admitted together; the first chunk (4 tokens of every row) is in
    assert scheduler.counters.prefill_forwards == 1
    assert requests[2].first_token_at is not None and requests[1].first_token_at is None
    scheduler.cancel(requests[1])  # the longest prompt, still being fed
    scheduler.run_until_idle()
    chunks = -(-longest // 4)
    assert scheduler.counters.prefill_forwards <= chunks
    assert requests[1].first_token_at is None and requests[1].seq.output == []
    for i, r in enumerate(requests):
        if i != 1:
            assert r.seq.output == engine.generate([p[i]], cfg)[0].tokens, f"request {i}"
    assert scheduler.counters.cancelled == 1 and not scheduler.prefilling


def test_requests_with_the_same_prompt_share_its_prefill_row(tiny_hf):
    """Three samples of one prompt and one other prompt, admitted together: the forward feeds
    two rows (the prompt tokens counted once), one of the three cancelled mid-prefill leaves
    the other two to join, and each output is bit for bit the request's alone (its own seed;
    a batch-invariant bfloat16 model)."""
    exact = load(tiny_hf, dtype="bfloat16", batch_invariant=True)
    engine = Engine(exact.model, exact.tokenizer)
    scheduler = Scheduler(engine, SchedulerConfig(max_batch=4, prefill_chunk=4, prefill_tokens=8, row_capacity=96))
    p = prompts(exact)
    same, other = max(p, key=len), p[0]
    assert len(same) > 4 and same != other
    cfg = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    sampled = [Sampling(temperature=1.0, seed=s) for s in (1, 2, 3)]
    requests = [scheduler.submit(same, cfg, sampling) for sampling in sampled] + [scheduler.submit(other, cfg)]
    scheduler.run_once()
    assert (scheduler.counters.prefill_forwards, scheduler.counters.prefill_tokens) == (1, 8)  # one chunk of two rows
    scheduler.cancel(requests[0])
    scheduler.run_until_idle()
    assert scheduler.counters.prefill_tokens == len(same) + len(other)
    assert requests[0].seq.output == [] and scheduler.counters.cancelled == 1
    for r, sampling in zip(requests[1:3], sampled[1:]):
        assert r.seq.output == engine.generate([same], cfg, [sampling])[0].tokens
    assert requests[1].seq.output != requests[2].seq.output  # two seeds, two samples
    assert requests[3].seq.output == engine.generate([other], cfg)[0].tokens


def test_a_cancelled_request_frees_its_slot_at_once(tiny):
    engine = Engine(tiny.model, tiny.tokenizer)
    scheduler = Scheduler(engine, SchedulerConfig(max_batch=2, row_capacity=128))
    p = prompts(tiny)
    events: list[RequestEvent] = []
    long = scheduler.submit(p[0], GenerationConfig(max_new_tokens=100, ignore_eos=True), on_event=events.append)
    other = scheduler.submit(p[1], GenerationConfig(max_new_tokens=6, ignore_eos=True))
    for _ in range(3):
        scheduler.run_once()
    assert long.slot == 0 and scheduler.counters.last_step_rows == 2
    scheduler.cancel(long)
    scheduler.run_once()
    assert long.slot is None and long not in scheduler.rows
    assert scheduler.rows[0] in (None, other)  # the other request moved down into the freed slot
    assert events[-1].finished and events[-1].finish_reason == "cancelled"
    assert scheduler.counters.cancelled == 1
    # the next step ran the other row only if it is still going; once it is done, no step runs
    scheduler.run_until_idle()
    steps = scheduler.counters.steps
    assert not scheduler.run_once() and scheduler.counters.steps == steps
    assert other.seq.finished and len(other.seq.output) == 6


def test_last_running_slot_bounds_the_step(tiny):
    """Rows past the last running slot are not computed: after the high slot finishes, steps
    run one row."""
    engine = Engine(tiny.model, tiny.tokenizer)
    scheduler = Scheduler(engine, SchedulerConfig(max_batch=4, row_capacity=128))
    p = prompts(tiny)
    first = scheduler.submit(p[0], GenerationConfig(max_new_tokens=40, ignore_eos=True))
    scheduler.submit(p[1], GenerationConfig(max_new_tokens=3, ignore_eos=True))
    for _ in range(8):
        scheduler.run_once()
    assert first.slot == 0 and not first.seq.finished
    assert scheduler.counters.last_step_rows == 1


class _Recorder:
    """Passes a proposer through and records every draft it makes, per request (sequence)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.drafts: dict[int, list[tuple[int, ...]]] = {}  # id(seq) -> its drafts' tokens, in order

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def propose(self, seqs, budgets, cache):
        drafts = self.inner.propose(seqs, budgets, cache)
        for seq, draft in zip(seqs, drafts):
            if seq is not None:
                self.drafts.setdefault(id(seq), []).append(draft.tokens)
        return drafts


def _engine(tiny, tiny_hf, method: str) -> Engine:
    """A fresh engine (no memory of earlier outputs) for ``method`` whose proposer records its
    drafts, each a function of the row's context and state only (fixed policy)."""
    e = _built(tiny, tiny_hf, method)
    return Engine(e.model, e.tokenizer, _Recorder(e.proposer), e.policy)


def _built(tiny, tiny_hf, method: str) -> Engine:
    if method == "mtp":
        from specdraft.policy import Policy, PolicyConfig
        from specdraft.proposers.base import ProposerContext
        from specdraft.proposers.feature_heads import EagleOptions, FeatureHeadProposer
        from test_eagle import random_head

        proposer = FeatureHeadProposer(random_head(tiny, kind="mtp"), ProposerContext(tiny.model, tiny.tokenizer),
                                       EagleOptions(depth=3, topk=2), "mtp")
        return Engine(tiny.model, tiny.tokenizer, proposer, Policy(PolicyConfig(kind="fixed", k=4)))
    options = {"draft": {"path": str(tiny_hf)}, "layer-skip": {"layers": 1}}.get(method)
    return build_engine(tiny, method, k=4, policy="fixed", options=options)


@pytest.mark.parametrize("method", ["ngram", "suffix", "lookahead", "draft", "mtp", "layer-skip"])
def test_packing_moves_each_rows_state_with_its_request(tiny, tiny_hf, method):
    """Short requests leave holes below running ones, which move down into them: every request
    gets the same output and the very same drafts as without packing, so the proposer's and the
    policy's per-row state moved with it; steps compute fewer rows."""
    cfgs = [GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in (24, 3, 4, 30, 26, 5)]
    p = prompts(tiny)
    runs = {}
    for pack in (False, True):
        scheduler = Scheduler(_engine(tiny, tiny_hf, method), SchedulerConfig(max_batch=4, row_capacity=96, pack=pack))
        requests, _ = run(scheduler, [(0, p[i], cfgs[i], Sampling()) for i in range(4)]
                          + [(6, p[i], cfgs[i], Sampling()) for i in (4, 5)])
        drafts = scheduler.engine.proposer.drafts
        runs[pack] = ([(r.seq.output, drafts[id(r.seq)]) for r in requests], requests, scheduler.counters)
    (unpacked_runs, _, unpacked), (packed_runs, packed_reqs, packed) = runs[False], runs[True]
    assert unpacked.moved == 0 and packed.moved >= 1
    assert packed.rows_run < unpacked.rows_run
    for i, ((out_a, drafts_a), (out_b, drafts_b)) in enumerate(zip(unpacked_runs, packed_runs)):
        assert out_b == out_a, f"request {i}"
        assert drafts_b == drafts_a, f"request {i}: its drafts changed when it moved"
    assert sum(r.seq.stats.proposed for r in packed_reqs) > 0
    if method == "draft":  # the draft cache's row moved too: a model drafting for itself is still always right
        assert all(r.seq.stats.accepted == r.seq.stats.proposed for r in packed_reqs)


def test_limits_refuse_with_one_line_errors(tiny):
    engine = Engine(tiny.model, tiny.tokenizer)
    scheduler = Scheduler(engine, SchedulerConfig(max_batch=1, max_queue=2, row_capacity=32))
    p = prompts(tiny)[0]
    cfg = GenerationConfig(max_new_tokens=4)
    scheduler.submit(p, cfg)
    scheduler.submit(p, cfg)
    with pytest.raises(Overloaded, match="overloaded"):
        scheduler.submit(p, cfg)
    with pytest.raises(ContextOverflowError, match="context per request is 32"):
        scheduler.submit(p, GenerationConfig(max_new_tokens=40))
    with pytest.raises(SpecdraftError, match="empty"):
        scheduler.submit([], cfg)
    with pytest.raises(SpecdraftError, match="vocabulary"):
        scheduler.submit([10**6], cfg)
    with pytest.raises(SpecdraftError, match="max_batch"):
        SchedulerConfig(max_batch=0)


def test_tokens_in_flight_bound_the_requests_in_slots_and_the_oldest_waits_first(tiny):
    """Two requests claiming L and S positions run together, a third claiming L waits (free slots
    notwithstanding) and a later short one does not overtake it; everyone finishes with what it
    would get alone."""
    engine = Engine(tiny.model, tiny.tokenizer)
    p = prompts(tiny)[0]
    long, short = GenerationConfig(max_new_tokens=15, ignore_eos=True), GenerationConfig(max_new_tokens=5, ignore_eos=True)
    big, small = len(p) + 16, len(p) + 6  # each claims its prompt, its new tokens and one more
    room = big + small + 4  # L + S fit, L + L do not, L + S + anything do not
    subs = [(0, p, long, Sampling()), (0, p, short, Sampling()), (0, p, long, Sampling()), (0, p, short, Sampling())]
    alone = {id(c): Engine(tiny.model, tiny.tokenizer).generate([p], c)[0].tokens for c in (long, short)}
    scheduler = Scheduler(engine, SchedulerConfig(max_batch=4, row_capacity=big, max_tokens_in_flight=room))
    claimed: list[int] = []
    held: list[list[int]] = []
    scheduler.on_step = lambda rows, running: (claimed.append(scheduler.tokens_in_flight),
                                               held.append(sorted(r.id for r in scheduler.rows if r is not None)))
    requests, events = run(scheduler, subs)
    assert [r.seq.capacity for r in requests] == [big, small, big, small]
    assert max(claimed) <= room and held[0] == [0, 1]  # the third does not fit beside the first two
    third = next(i for i, h in enumerate(held) if 2 in h)
    assert held[third - 1] == [0]  # the second had finished; the fourth (which fit) did not overtake the third
    assert 0 not in held[third] and 3 in held[third]  # the third took the first's room, then the fourth fit
    for r, (_, _, cfg, _) in zip(requests, subs):
        assert r.seq.output == alone[id(cfg)] and r.seq.finish_reason == "length"
    with pytest.raises(SpecdraftError, match="at least one request's context"):
        Scheduler(engine, SchedulerConfig(max_batch=4, row_capacity=big, max_tokens_in_flight=big - 1))
    assert Scheduler(engine, SchedulerConfig(max_batch=2, row_capacity=24)).max_tokens_in_flight == 48


@pytest.mark.parametrize("method", ["plain", "ngram"])
def test_a_static_batch_shrinks_as_its_rows_finish_and_prices_its_first_size(tiny, method):
    """Rows of a static batch that finish early cost no later step (the last rows move down),
    the policy prices every step at the batch's first size, and each row gets what it gets
    alone."""
    lengths = [3, 20, 6, 12]
    batch = prompts(tiny)[: len(lengths)]
    configs = [GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in lengths]
    alone = [build_engine(tiny, method).generate([p], c)[0].tokens for p, c in zip(batch, configs)]
    engine = build_engine(tiny, method)
    priced: list[int] = []
    budgets = engine.policy.budgets
    engine.policy.budgets = lambda caps, size, *a: (priced.append(size), budgets(caps, size, *a))[1]  # type: ignore[method-assign]
    scheduler = Scheduler(engine, SchedulerConfig(max_batch=len(batch), max_queue=len(batch), static=True,
                                                  row_capacity=64, prefill_tokens=10**6))
    rows: list[int] = []
    scheduler.on_step = lambda hi, running: rows.append(hi)
    requests, _ = run(scheduler, [(0, p, c, Sampling()) for p, c in zip(batch, configs)])
    assert [r.seq.output for r in requests] == alone
    assert rows[0] == len(batch) and rows[-1] == 1 and rows == sorted(rows, reverse=True)
    assert sum(rows) < len(batch) * len(rows)  # finished rows were not computed
    if method != "plain":
        assert priced and set(priced) == {len(batch)}


def test_cost_model_prices_a_batch_at_the_next_grid_size():
    cost = CostModel(table={1: {1: 1.0, 9: 2.0}, 4: {1: 3.0, 9: 4.0}}, batch_grid=(1, 4))
    assert cost.latency(3, 1, 9) == 3.0 and cost.latency(4, 9, 9) == 4.0 and cost.latency(1, 9, 9) == 2.0
    assert SchedulerConfig(max_batch=12).batch_grid == (1, 2, 4, 8, 12)


class _ClockedModel:
    """Forwards that advance a fake clock: q tokens per row take q ms, and calls 3 to 7 (a slow
    spell of a shared machine) take 50 ms more."""

    def __init__(self, tiny) -> None:
        self.tiny = tiny
        self.device = tiny.model.device
        self.config = tiny.config
        self.now = 0.0
        self.calls = 0

    def new_cache(self, rows: int, capacity: int):
        return self.tiny.model.new_cache(rows, capacity)

    def __call__(self, tokens, positions, cache, logits: bool = True, real: list[int] | None = None) -> None:
        """A packed forward (``real``) costs its real tokens' share of q ms plus 0.5 ms per padded column."""
        self.calls += 1
        q = tokens.shape[1]
        cost = 1e-3 * q if real is None else 1e-3 * sum(real) / len(real) + 0.5e-3 * (q - 1)
        self.now += cost + (0.05 if 3 <= self.calls <= 7 else 0.0)


def test_a_slow_spell_while_measuring_slows_no_token_count_alone(tiny):
    """The token counts take turns: a slow spell lands on one forward of each, and the medians
    keep the curve's true shape (measured one count after another, q=1 took all five slow
    forwards and looked as costly as q=2 and 3 together)."""
    model = _ClockedModel(tiny)
    got = measure_latency(model, 2, [1, 2, 3], prefix=0, clock=lambda: model.now)
    assert got == pytest.approx({1: 1e-3, 2: 2e-3, 3: 3e-3})


def test_the_padding_of_a_packed_forward_is_measured_with_the_curve(tiny):
    """With ``lone`` the curve comes with a packed forward's (``lone_rows`` rows drafting, the
    other rows one token each), measured in the same rounds; the cost model prices a packed
    forward as the curve at its tokens plus its padding slots at what one slot of the lone
    forward's padding cost."""
    model = _ClockedModel(tiny)
    full, lone = measure_latency(model, 2, [1, 2, 3], prefix=0, clock=lambda: model.now, lone=True)
    assert full == pytest.approx({1: 1e-3, 2: 2e-3, 3: 3e-3})
    assert lone == pytest.approx({1: 1e-3, 2: 1.5e-3 + 0.5e-3, 3: 2e-3 + 1e-3})
    cost = CostModel(table={2: full}, lone={2: lone})
    assert cost.slot(2, 2) == pytest.approx((3e-3 - 2e-3) / 2)  # the lone forward less the curve, over 2 slots
    assert cost.verification(2, 1.0, 2, 3) == pytest.approx(2e-3 + 1e-3 * 2 * 1 / 2)  # one row of two drafting 2
    assert cost.verification(2, 2.0, 2, 3) == pytest.approx(3e-3)  # both: no padding


def test_observed_forwards_correct_the_measured_cost_curve():
    """A token count observed OBSERVED_MIN times replaces the measured point; counts in between
    are scaled by the observed ratio; the curve stays non-decreasing."""
    assert not CostModel(table={8: {1: 1.0}}).observed and CostModel(table={}).learns is None
    given = CostModel(table={8: {1: 1.0, 9: 2.0}})
    for _ in range(3):
        given.observe(8, 1, 5.0)
    assert given.latency(8, 1, 9) == 1.0  # a given table is taken as it is
    cost = CostModel(table={8: {1: 1.0, 2: 1.1, 4: 1.3, 9: 2.0}}, learns=True)
    cost.observe(8, 2, 1.5)
    cost.observe(8, 2, 1.5)
    assert cost.latency(8, 2, 9) == 1.1  # two observations: not yet
    cost.observe(8, 2, 1.5)
    assert cost.latency(8, 2, 9) == pytest.approx(1.5)
    assert cost.latency(8, 1, 9) == pytest.approx(1.0 * 1.5 / 1.1)  # ratio held below the observed count
    assert cost.latency(8, 9, 9) == pytest.approx(2.0 * 1.5 / 1.1)  # and above it
    cost.observe(8, 1, 0.5)
    for _ in range(3):
        cost.observe(8, 4, 1.0)  # cheaper than q = 2 was observed: pooled, never decreasing
    curve = [cost.latency(8, q, 9) for q in (1, 2, 3, 4, 9)]
    assert curve == sorted(curve)
    cost.observe(3, 1, 9.0)  # no measured curve for that batch: ignored
    assert 3 not in cost.observed


def test_ragged_forwards_are_corrected_by_their_width_apart_from_the_curve():
    """A packed forward where only some rows drafted is priced by its width: what such
    forwards took against the price corrects that width's price alone (split attention or
    not, apart). Counted at its rounded
    mean (1 token per row) with the plain steps, an underpriced ragged forward made the plain
    step look dearer, and so drafting cheaper."""
    full, lone = {1: 1.0, 2: 1.2, 5: 2.0}, {1: 1.0, 2: 1.5, 5: 2.5}
    cost = CostModel(table={4: dict(full)}, lone={4: dict(lone)}, learns=True)
    priced = cost.verification(4, 1.0, 4, 5)  # one row in four drafting 4
    assert priced > cost.latency(4, 2.0, 5)  # the padding is priced
    for _ in range(3):
        cost.observe(4, 2.0, 2.0 * priced, width=4)  # it really took twice its price
        cost.observe(4, 1.0, 1.0, width=0)  # plain steps as measured
    assert cost.latency(4, 1, 5) == pytest.approx(1.0)  # the plain step keeps its price
    assert cost.verification(4, 1.0, 4, 5) == pytest.approx(2.0 * priced)
    assert cost.verification(4, 4.0, 4, 5) == pytest.approx(cost.latency(4, 5, 5))  # even: no ragged ratio
    unscaled = cost.latency(4, 2.0, 5) + cost.padded(4, 1.0, 2)
    assert cost.verification(4, 1.0, 2, 5) == pytest.approx(unscaled)  # width 2: not observed
    for _ in range(3):  # one row of four drafting 4: its attention is split, counted apart
        cost.observe(4, 2.0, 0.5 * priced, width=4, deep=1)
    assert cost.verification(4, 1.0, 4, 5, deep=1) == pytest.approx(0.5 * priced)
    assert cost.verification(4, 1.0, 4, 5, deep=4) == pytest.approx(2.0 * priced)  # no split
    for _ in range(5):
        cost.observe(4, 1.0, 1.5, width=0)  # plain steps run slower than the curve: ragged prices follow
    assert cost.latency(4, 1, 5) > 1.2
    assert cost.verification(4, 1.0, 4, 5) > 2.1 * priced


def test_forwards_of_fewer_rows_are_compared_with_the_curve_at_their_own_size():
    """A continuous batch drafts mostly while it drains: its two-token forwards run at 9 rows,
    its one-token ones at 16. Each is compared with the measured curve at its own size
    (interpolated between the grid sizes 8 and 16), so the corrected curve at 16 keeps its
    shape instead of pricing two tokens like one."""
    table = {8: {1: 0.5, 2: 0.6}, 16: {1: 1.0, 2: 1.2}}
    cost = CostModel(table=table, batch_grid=(8, 16), learns=True)
    for _ in range(3):
        cost.observe(16, 1, 1.0)
        cost.observe(9, 2, 0.675)  # what the measured curves say for 9 rows (0.6 + 0.6 / 8)
    assert cost.latency(16, 2, 2) == pytest.approx(1.2)
    assert cost.latency(16, 1, 2) == pytest.approx(1.0)
    cost.observe(12, 2, 0.9 * 2)  # twice what 12 rows should take: the q=2 point doubles once observed enough
    cost.observe(12, 2, 0.9 * 2)
    cost.observe(12, 2, 0.9 * 2)
    assert cost.latency(16, 2, 2) > 1.2
    alone = CostModel(table={16: {1: 1.0, 2: 1.2}}, batch_grid=(8, 16), learns=True)
    alone.observe(9, 2, 0.675)  # the size below is not measured: nothing to compare 9 rows with
    assert not alone.observed


def test_reset_memory_forgets_earlier_outputs_only_when_idle(tiny):
    engine = build_engine(tiny, "suffix", k=4, policy="fixed")
    scheduler = Scheduler(engine, SchedulerConfig(max_batch=2, row_capacity=96))
    before = engine.proposer.snapshot()
    scheduler.submit(prompts(tiny)[0], GenerationConfig(max_new_tokens=10, ignore_eos=True))
    assert scheduler.reset_memory() is None  # a request is waiting: refused
    scheduler.run_until_idle()
    assert engine.proposer.snapshot() != before  # the suffix trie now holds the output
    done = scheduler.reset_memory()
    assert done is not None and not done.is_set()
    scheduler.run_once()
    assert done.is_set() and engine.proposer.snapshot() == before


@pytest.mark.parametrize("method", ["plain", "ngram"])
def test_generate_is_a_static_batch_on_the_scheduler(tiny, method):
    """``Engine.generate`` and ``stream`` run on a static scheduler: the same texts either way,
    events per prompt index, the scheduler's prefill time in the caller's stats; a stream closed
    early frees every row (the proposer and the policy keep no request behind)."""
    from specdraft.metrics import SpecStats

    engine = build_engine(tiny, method)
    cfg = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    stats = SpecStats()
    results = engine.generate(prompts(tiny), cfg, stats=stats)
    streamed: dict[int, str] = {}
    for event in engine.stream(prompts(tiny), cfg):
        streamed[event.row] = streamed.get(event.row, "") + event.text
    assert [streamed[i] for i in range(len(TEXTS))] == [r.text for r in results]
    assert all(len(r.tokens) == 12 for r in results) and stats.prefill_s > 0 and stats.emitted > 0
    early = engine.stream(prompts(tiny), cfg)
    next(early)
    early.close()
    assert not engine.policy.evidence and not getattr(engine.proposer, "rows", {})
