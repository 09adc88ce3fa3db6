"""Lookahead decoding: greedy equivalence with plain decoding on ragged batches (fixed and
adaptive policies, the plain tiny model and the "loopy" one where drafts are accepted), the
Jacobi update and the n-gram harvest on a hand-made step, the budget and the pool bound,
bad settings, and the statistical lossless check through the engine at temperature 1."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdraft.accept import Acceptance
from specdraft.draft import Draft
from specdraft.errors import SpecdraftError
from specdraft.metrics import SpecStats
from specdraft.proposers import describe_methods, make_proposer
from specdraft.proposers.base import Verified
from specdraft.proposers.lookahead import LookaheadConfig, LookaheadProposer, NgramPool, split_budget
from test_accept import ENGINE_ROWS, _engine_lossless_check, check_siblings_lossless, sampled_setup, sibling_setup  # noqa: F401 (fixtures)
from test_spec_engine import GEN, Setup, loopy, spec_engine, tiny  # noqa: F401 (fixtures)

# =========================================================================== greedy equivalence

SETTINGS = [
    LookaheadConfig(),
    LookaheadConfig(window=3, ngram=4, candidates=2, use_prompt=False),
    LookaheadConfig(window=6, ngram=2, candidates=6, pool_size=8),
]


@pytest.mark.parametrize("config", SETTINGS, ids=["default", "W3N4G2-noprompt", "W6N2G6-tinypool"])
@pytest.mark.parametrize("k, policy", [(4, "fixed"), (12, "fixed"), (8, "adaptive")])
def test_lookahead_greedy_equals_plain(loopy: Setup, config: LookaheadConfig, k: int, policy: str) -> None:
    # the row's brake (stop_after) and the policy's margin would leave too few accepted drafts on
    # the tiny model for the comparison to mean much: equivalence is what is tested here
    engine = spec_engine(loopy.loaded, LookaheadProposer(config), k, policy, batch=len(loopy.prompts), stop_after=10**6,
                         margin=0.0)
    stats = SpecStats()
    results = engine.generate(loopy.prompts, GEN, stats=stats)
    for row, (r, ref) in enumerate(zip(results, loopy.refs)):
        assert r.tokens == ref, f"row {row} differs"
    assert stats.accepted >= 10, "the test is vacuous if (almost) nothing is accepted"
    assert stats.steps < stats.emitted


def test_lookahead_greedy_equals_plain_on_the_plain_tiny_model(tiny: Setup) -> None:
    stats = SpecStats()
    engine = spec_engine(tiny.loaded, LookaheadProposer(), 8)
    assert [r.tokens for r in engine.generate(tiny.prompts, GEN, stats=stats)] == tiny.refs
    assert stats.proposed > 0


def test_each_row_alone_equals_the_batch(loopy: Setup) -> None:
    engine = spec_engine(loopy.loaded, LookaheadProposer(), 8)
    batch = engine.generate(loopy.prompts, GEN)
    for p, b in list(zip(loopy.prompts, batch))[1::2]:
        assert engine.generate([p], GEN)[0].tokens == b.tokens


# =========================================================================== one step by hand


def _fake_seq(tokens: list[int], prompt_len: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(tokens=list(tokens), prompt=list(tokens[: prompt_len or len(tokens)]))


def _verified(draft: Draft, argmax: dict[int, int], vocab: int = 50) -> Verified:
    """Logits [1 + N, V] whose argmax at node i (row i + 1) is argmax[i] (0 elsewhere)."""
    logits = torch.zeros(len(draft) + 1, vocab)
    for node, token in argmax.items():
        logits[node + 1, token] = 5.0
    return Verified(logits, torch.zeros(len(draft) + 1, 4))


def test_window_is_a_spine_with_columns_and_jacobi_updates_it() -> None:
    config = LookaheadConfig(window=3, ngram=3, candidates=0)
    p = LookaheadProposer(config)
    seq = _fake_seq([1, 2, 3])
    p.begin(0, seq)  # type: ignore[arg-type]
    state = p.rows[0]
    state.window[:] = [[10, 11], [20, 21], [30, 31]]
    draft = p.propose([seq], [6], None)[0]  # type: ignore[list-item]
    # spine 10 -> 20 -> 30 under the root; each column's level 1 under its spine node
    paths = {tuple(draft.tokens[i] for i in path) for path in draft.paths()}
    assert paths == {(10, 11), (10, 20, 21), (10, 20, 30, 31)}
    assert len(draft) == 6 and draft.p_draft is None
    tops = [node for node, _ in state.fed]
    assert [draft.tokens[t] for t in tops] == [11, 21, 31]
    # the target's argmax at the column tops are the new guesses 12, 22, 32
    verified = _verified(draft, {tops[0]: 12, tops[1]: 22, tops[2]: 32})
    p.observe(0, draft, Acceptance((), (7,)), verified)
    seq.tokens.append(7)
    assert state.window == [[11, 12], [21, 22], [31, 32]]  # one level up, nothing committed past
    # harvested: each column + its new guess, keyed by the column's oldest guess
    assert state.pool.continuations(10, 4) == [(11, 12)]
    assert state.pool.continuations(20, 4) == [(21, 22)]
    assert state.pool.continuations(30, 4) == [(31, 32)]
    # a step that commits three tokens (two accepted + bonus) drops two columns
    draft = p.propose([seq], [6], None)[0]  # type: ignore[list-item]
    tops = [node for node, _ in state.fed]
    p.observe(0, draft, Acceptance((0, 1), (11, 21, 9)), _verified(draft, {tops[0]: 13, tops[1]: 23, tops[2]: 33}))
    seq.tokens += [11, 21, 9]
    assert state.window[0] == [32, 33]
    assert len(state.window) == 3 and all(len(c) == 2 for c in state.window)
    assert all(t in seq.tokens for c in state.window[1:] for t in c)  # new columns: context tokens


def test_a_draft_other_than_the_proposed_one_only_shifts_the_window() -> None:
    p = LookaheadProposer(LookaheadConfig(window=3, ngram=3, candidates=0))
    seq = _fake_seq([1, 2, 3])
    p.begin(0, seq)  # type: ignore[arg-type]
    state = p.rows[0]
    state.window[:] = [[10, 11], [20, 21], [30, 31]]
    draft = p.propose([seq], [6], None)[0]  # type: ignore[list-item]
    cut = draft.up_to_depth(1)  # as the engine's policy may trim a draft
    p.observe(0, cut, Acceptance((), (7,)), _verified(cut, {0: 12}))
    assert state.window[:2] == [[20, 21], [30, 31]] and len(state.pool) == 1  # shifted by one; no guess


def test_candidates_come_from_the_pool_by_the_root_token() -> None:
    config = LookaheadConfig(window=2, ngram=3, candidates=2)
    p = LookaheadProposer(config)
    # the text holds 5 -> (6, 7) and 5 -> (8, 9); the root is 5
    seq = _fake_seq([5, 6, 7, 1, 5, 8, 9, 2, 5])
    p.begin(0, seq)  # type: ignore[arg-type]
    draft = p.propose([seq], [8], None)[0]  # type: ignore[list-item]
    paths = [tuple(draft.tokens[i] for i in path) for path in draft.paths()]
    assert paths[:2] == [(8, 9), (6, 7)]  # newest first
    assert len(draft) <= 8
    # use_prompt=False: the prompt's n-grams are not in the pool
    q = LookaheadProposer(LookaheadConfig(window=2, ngram=3, candidates=2, use_prompt=False))
    q.begin(0, seq)  # type: ignore[arg-type]
    q.propose([seq], [8], None)
    assert len(q.rows[0].pool) == 0


def test_candidates_whose_context_matches_come_first() -> None:
    pool = NgramPool(size=10, per_key=4)
    pool.add((5, 1, 1), before=(7, 8))
    pool.add((5, 2, 2), before=(9, 9))
    pool.add((5, 3, 3), before=(6, 8))
    assert pool.continuations(5, 3, before=(1, 7, 8)) == [(1, 1), (3, 3), (2, 2)]  # 2 tokens match, 1, 0
    assert pool.continuations(5, 3) == [(3, 3), (2, 2), (1, 1)]  # no context: newest first
    assert pool.continuations(5, 1, before=(9,)) == [(2, 2)]
    assert pool.continuations(4, 3) == []


def test_budget_is_respected_and_split() -> None:
    config = LookaheadConfig(window=4, ngram=3, candidates=4)
    assert split_budget(8, config) == 4 and split_budget(3, config) == 0 and split_budget(100, config) == 8
    p = LookaheadProposer(config)
    seq = _fake_seq([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 3, 3, 1])
    p.begin(0, seq)  # type: ignore[arg-type]
    for budget in range(0, 20):
        draft = p.propose([seq], [budget], None)[0]  # type: ignore[list-item]
        assert len(draft) <= budget
        assert len(p.rows[0].fed) <= config.window
        if budget == 0:
            assert len(draft) == 0 and not p.rows[0].fed
    # idle rows get empty drafts; rows never begun too
    assert [len(d) for d in p.propose([None, seq], [4, 4], None)] == [0, 0]  # type: ignore[list-item]


def test_pool_bound_per_key_and_total() -> None:
    pool = NgramPool(size=5, per_key=2)
    for g in [(1, 2), (1, 3), (1, 4), (2, 5), (3, 6), (4, 7), (5, 8)]:
        pool.add(g)
    assert len(pool) == 5
    assert pool.continuations(1, 9) == [(4,)]  # per key 2, then the oldest overall went first
    pool.add((2, 5))  # refreshing moves an n-gram to the back of the queue
    pool.add((6, 9))  # drops (1, 4)
    pool.add((7, 1))  # drops (3, 6), not the refreshed (2, 5)
    assert len(pool) == 5 and pool.continuations(1, 9) == [] and pool.continuations(3, 9) == []
    assert pool.continuations(2, 9) == [(5,)]
    assert pool.nbytes() > 0


def test_pool_bound_holds_through_a_generation(loopy: Setup) -> None:
    proposer = LookaheadProposer(LookaheadConfig(pool_size=10))
    seen = []

    class Watch(LookaheadProposer):
        def observe(self, row, draft, acceptance, verified) -> None:
            super().observe(row, draft, acceptance, verified)
            seen.append(len(self.rows[row].pool))

    watch = Watch(proposer.config)
    results = spec_engine(loopy.loaded, watch, 8).generate(loopy.prompts[:3], GEN)
    assert [r.tokens for r in results] == loopy.refs[:3]
    assert seen and max(seen) <= 10


@pytest.mark.parametrize("options", [
    {"window": 0}, {"ngram": 1}, {"ngram": 17}, {"candidates": -1}, {"pool_size": 0}, {"candidates": 8, "pool_size": 4},
])
def test_bad_settings_are_refused_in_one_line(options: dict) -> None:
    with pytest.raises(SpecdraftError) as err:
        LookaheadConfig(**options)
    assert "\n" not in str(err.value) and "lookahead" in str(err.value)
    with pytest.raises(SpecdraftError):
        make_proposer("lookahead", {k: str(v) for k, v in options.items()})
    with pytest.raises(SpecdraftError):
        make_proposer("lookahead", {"window": "wide"})


def test_registered() -> None:
    p = make_proposer("lookahead", {"window": "3", "use_prompt": "false"})
    assert isinstance(p, LookaheadProposer) and p.config == LookaheadConfig(window=3, use_prompt=False)
    assert "lookahead" in describe_methods()


# =========================================================================== lossless sampling


def test_lookahead_is_lossless_through_the_engine(sampled_setup) -> None:  # noqa: F811
    make = lambda model, tokenizer: LookaheadProposer(LookaheadConfig(window=3, ngram=3, candidates=3))  # noqa: E731
    first, joint, triple, stats = _engine_lossless_check(sampled_setup, proposer=make, k=8)
    assert stats.accepted > 0.05 * ENGINE_ROWS, "drafts should be accepted in the first steps"
    assert not first.rejects, first
    assert not joint.rejects, joint
    assert not triple.rejects, triple


# =========================================================================== the cold-start bench


def test_step_recorder_records_every_step_and_changes_nothing(loopy: Setup) -> None:
    from specdraft.bench.coldstart import StepRecorder
    from specdraft.engine import Engine

    base = spec_engine(loopy.loaded, LookaheadProposer(), 8)
    recorder = StepRecorder(LookaheadProposer())
    engine = Engine(base.model, base.tokenizer, recorder, base.policy)
    stats = SpecStats()
    results = engine.generate(loopy.prompts[:3], GEN, stats=stats)
    assert [r.tokens for r in results] == loopy.refs[:3]
    assert len(recorder.finished) == 3 and not recorder.rows
    steps = [s for r in recorder.finished for s in r]
    assert len(steps) == stats.steps and sum(s.accepted for s in steps) == stats.accepted
    assert sum(s.proposed for s in steps) == stats.proposed


def test_estimated_speedup_from_a_cost_curve() -> None:
    from specdraft.bench.coldstart import StepRecord, cost_at, estimated_speedup, smooth

    cost = {1: 40.0, 2: 50.0, 4: 54.0, 8: 62.0}
    assert cost_at(cost, 3) == 52.0 and cost_at(cost, 12) == 70.0  # between points; past the end
    plain = [StepRecord(0, 0, 1)] * 4
    assert estimated_speedup(plain, cost) == 1.0
    # two passes of 3 nodes that emit 3 tokens each: 6 tokens for 2 x cost(4) instead of 6 x cost(1)
    assert estimated_speedup([StepRecord(3, 2, 3)] * 2, cost) == pytest.approx(6 * 40 / (2 * 54))
    assert estimated_speedup(plain, None) is None
    assert smooth([0.0, 3.0, 0.0, 3.0], 3) == [1.5, 1.0, 2.0, 1.5]


def test_coldstart_command_writes_json_and_plot(tiny_hf, tmp_path) -> None:
    import json

    from specdraft.bench.coldstart import main

    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "a b a b a b"}\n{"prompt": "Hello there"}\n')
    out = tmp_path / "out"
    code = main(["--out", str(out), "--model", str(tiny_hf), "--workload", f"mine={prompts}", "--prompts", "2",
                 "--max-new-tokens", "12", "--method", "lookahead:policy=fixed,k=6", "--method", "ngram",
                 "--cost-curve", str(tmp_path / "none.json")])
    assert code == 0
    data = json.loads((out / "coldstart.json").read_text())
    assert [r["method"] for r in data["results"]] == ["lookahead:policy=fixed,k=6", "ngram"]
    assert all(r["requests"] == 2 and r["est_speedup"] is None for r in data["results"])
    assert (out / "coldstart.png").stat().st_size > 0
    assert main(["--out", str(out), "--model", str(tiny_hf), "--method", "nosuch"]) == 2


def test_siblings_are_lossless_through_the_engine(sibling_setup, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Pool candidates from the prompt give the root several siblings, often accepted."""
    check_siblings_lossless(sibling_setup, lambda _m, _t: LookaheadProposer(LookaheadConfig(window=2, ngram=2, candidates=3)),
                            6, monkeypatch)
