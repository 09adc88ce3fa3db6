"""The adaptive policy with drafts whose nodes carry the proposer's confidence (EAGLE, MTP):
calibration, the outlook a budget is chosen from, trimming to the most confident nodes."""

from __future__ import annotations

import pytest

from specdraft.accept import Acceptance
from specdraft.draft import Draft
from specdraft.policy import CostModel, Plan, Policy, PolicyConfig
from specdraft.policy.cost import monotone
from specdraft.policy.scored import Calibration, Outlook


def costs(batch: int, per_node: float, k: int = 8) -> CostModel:
    """One forward over q tokens costs 1 + per_node * (q - 1) seconds."""
    return CostModel(table={batch: {q: 1.0 + per_node * (q - 1) for q in range(1, k + 2)}})


def tree(conf_first: float = 0.8) -> Draft:
    """A 6-node tree: two children of the root, two grandchildren under the first, one under
    the second, one great-grandchild. Confidences are path probabilities."""
    parents = (-1, -1, 0, 0, 1, 2)
    c0 = conf_first
    conf = (c0, 0.1, c0 * 0.7, c0 * 0.1, 0.05, c0 * 0.7 * 0.6)
    return Draft((10, 11, 12, 13, 14, 15), parents, label="eagle", confidence=conf)


def drafted(drafts: list[Draft]) -> Plan:
    """A plan whose budgets are what each row drafted (a trim with no ``budgets`` call before it)."""
    return Plan([len(d) for d in drafts], len(drafts))


def accepted(path: tuple[int, ...]) -> Acceptance:
    return Acceptance(path, tuple(range(len(path) + 1)))


def test_top_keeps_the_most_confident_nodes_as_a_tree() -> None:
    d = tree()
    assert d.by_confidence() == [0, 2, 5, 1, 3, 4]
    top3 = d.top(3)
    assert top3.tokens == (10, 12, 15) and top3.parents == (-1, 0, 1)
    assert top3.confidence == (d.confidence[0], d.confidence[2], d.confidence[5])
    assert d.top(0) == Draft((), (), label="eagle", confidence=())
    assert d.top(99) is d
    with pytest.raises(ValueError, match="above its parent"):
        Draft((1, 2), (-1, 0), confidence=(0.2, 0.5))
    with pytest.raises(ValueError, match="confidences for"):
        Draft((1, 2), (-1, 0), confidence=(0.2,))
    with pytest.raises(ValueError, match="parent"):
        d.subset([2])
    assert d.up_to_depth(1).confidence == (d.confidence[0], d.confidence[1])


def test_calibration_learns_how_often_each_depth_is_accepted_per_unit_of_confidence() -> None:
    """A proposer twice as sure as it should be at depth 1 and right at depth 2: after many drafts
    the scales are about 0.5 and 1, and a draft's expected yield uses them."""
    cal = Calibration()
    chain = Draft.chain([1, 2], label="x")
    chain = Draft(chain.tokens, chain.parents, label="x", confidence=(0.8, 0.4))
    for i in range(400):  # depth 1 accepted 40% of the time; depth 2 (given 1) half of those: 20% = conf/2
        path = (0, 1) if i % 5 == 0 else (0,) if i % 5 == 1 else ()
        cal.observe(chain, accepted(path), decay=0.99)
    assert cal.scale(1) == pytest.approx(0.5, abs=0.05)
    assert cal.scale(2) == pytest.approx(0.5, abs=0.05)
    assert cal.scale(7) == 1.0  # no evidence: the confidence is taken at its word
    gains = cal.gains(chain)
    assert gains[0] == 0 and gains[1] == pytest.approx(0.4, abs=0.05) and gains[2] == pytest.approx(0.6, abs=0.08)


def test_outlook_is_monotone_and_scaled_by_the_rows_record() -> None:
    o = Outlook(trust=3.0)
    assert not o.known
    o.add([0.0, 0.5, 0.9, 1.2], decay=0.9)
    o.add([0.0, 0.5], decay=0.9)  # a shorter draft leaves the longer counts alone
    assert o.known and o.at(3) == pytest.approx(1.2) and o.at(10) == pytest.approx(1.2)
    o.gains[2] = 0.2  # a stale dip: keeping more nodes never yields less
    assert o.at(2) == pytest.approx(0.5)
    assert o.at(1) <= 1.0
    for _ in range(30):
        o.observe(expected=1.0, accepted=0, decay=0.9)  # this request's drafts never pay
    assert o.realism < 0.25 and o.at(3) < 0.3
    fresh = o.restart(1.5)
    assert fresh.realism == 1.0 and fresh.weight == [min(w, 1.5) for w in o.weight] and fresh.trust == 3.0


def _learn(policy: Policy, rows: int, draft: Draft, path: tuple[int, ...], steps: int) -> None:
    for _ in range(steps):
        for row in range(rows):
            policy.trim([draft] * rows, drafted([draft] * rows)) if row == 0 else None
            policy.observe(row, draft, accepted(path))


def test_a_tree_is_priced_by_its_expected_yield_not_by_per_node_acceptance() -> None:
    """Eight siblings of which one is accepted every time read as 1/8 acceptance per node, but
    yield one token per step: with cheap verification the policy keeps drafting, and trims to
    the nodes that carry the yield."""
    conf = (0.9, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01)
    wide = Draft(tuple(range(8)), (-1,) * 8, label="eagle", confidence=conf)
    policy = Policy(PolicyConfig(kind="adaptive", k=8), costs(1, per_node=0.02))
    policy.begin(0)
    _learn(policy, 1, wide, (0,), 30)
    plan = policy.budgets([8], 1)
    assert plan.budgets[0] >= 1
    kept = policy.trim([wide], plan)[0]
    assert 1 <= len(kept) < 8 and kept.tokens[0] == 0  # the sure node stays, the long shots go


def test_verification_cost_decides_how_many_nodes_are_kept() -> None:
    d = tree(0.9)
    cheap = Policy(PolicyConfig(kind="adaptive", k=8), costs(1, per_node=0.001))
    dear = Policy(PolicyConfig(kind="adaptive", k=8), costs(1, per_node=0.3))
    for p in (cheap, dear):
        p.begin(0)
    n_cheap, n_dear = len(cheap.trim([d], drafted([d]))[0]), len(dear.trim([d], drafted([d]))[0])
    assert n_cheap == len(d) and 1 <= n_dear < n_cheap
    unsure = tree(0.05)
    assert len(dear.trim([unsure], drafted([unsure]))[0]) == 0  # nothing worth a verification: plain step


def test_a_row_whose_confident_drafts_fail_stops_drafting_and_others_are_unaffected() -> None:
    """Confidence alone does not keep a request drafting: its own record scales its outlook."""
    d = tree(0.9)
    config = PolicyConfig(kind="adaptive", k=8, probe_every=1000)
    policy, other = (Policy(config, costs(1, per_node=0.05)) for _ in range(2))
    for p in (policy, other):
        p.begin(0)
        for budget in (2, 4, 6, 8):
            p.observe_propose_time(budget, 0.02 * budget)  # drafting costs: gated before it runs
        p.trim([d], drafted([d]))
        assert p.budgets([8], 1).budgets[0] > 0
    for _ in range(40):
        assert len(policy.trim([d], drafted([d]))[0]) > 0 or policy.outlooks[0].realism < 0.6
        policy.observe(0, d, accepted(()))
        other.trim([d], drafted([d]))
        other.observe(0, d, accepted((0, 2, 5)))
    plan = policy.budgets([8], 1)
    assert plan.budgets == [0] and len(policy.trim([d], plan)[0]) == 0
    plan = other.budgets([8], 1)
    assert plan.budgets[0] > 0 and len(other.trim([d], plan)[0]) >= 3


def test_one_unlucky_first_draft_does_not_stop_a_proposer_that_pays_on_average() -> None:
    """The first scored draft is unsure and fails. Judged on it alone, drafting would stop and the
    drafts that would show it pays would never come; the prior outlook keeps the proposer drafting
    until its own record says otherwise, and that record does decide once it is long enough."""
    unsure = tree(0.1)  # about 0.4 tokens expected from its 6 nodes
    policies = []
    for prior, trust in ((4.0, 3.0), (0.0, 1.0)):  # the defaults; no prior and one token of trust
        config = PolicyConfig(kind="adaptive", k=8, probe_every=1000, outlook_prior=prior, trust=trust)
        policies.append(Policy(config, costs(1, per_node=0.02)))
        policies[-1].begin(0)
        for budget in (2, 4, 6, 8):
            policies[-1].observe_propose_time(budget, 0.03 * budget)  # a quarter of a step at k = 8
        policies[-1].trim([unsure], drafted([unsure]))
        policies[-1].observe(0, unsure, accepted(()))
    policy, without = policies
    assert policy.budgets([8], 1).budgets[0] > 0 and without.budgets([8], 1).budgets[0] == 0  # (and never drafts again)
    good = tree(0.9)  # its drafts then yield about 2 tokens each: the row keeps drafting
    for _ in range(20):
        plan = policy.budgets([8], 1)
        assert plan.budgets[0] > 0
        policy.trim([good], plan)
        policy.observe(0, good, accepted((0, 2)))
    budgets = []
    for _ in range(60):  # ...until they stop paying for long enough
        plan = policy.budgets([8], 1)
        budgets.append(plan.budgets[0])
        policy.trim([unsure], plan)
        policy.observe(0, unsure, accepted(()))
    assert budgets[0] > 0 and budgets[-10:] == [0] * 10


def test_the_whole_budget_is_asked_for_now_and_then() -> None:
    """A budget chosen from the outlook only refreshes the outlook up to that size; every
    probe_every drafting steps the policy asks for k so that larger trees stay measured."""
    d = tree(0.9).top(2)
    config = PolicyConfig(kind="adaptive", k=8, probe_every=4)
    policy = Policy(config, costs(1, per_node=0.3))
    policy.begin(0)
    for budget in (2, 4, 6, 8):
        policy.observe_propose_time(budget, 0.02 * budget)  # a costly proposer: budgeted before it runs
    seen = []
    for _ in range(12):
        plan = policy.budgets([8], 1)
        seen.append(plan.budgets[0])
        policy.trim([d], plan)
        policy.observe(0, d, accepted((0, 1)))
    assert 8 in seen[1:] and any(0 < b < 8 for b in seen)


def test_monotone_latency_pools_noisy_points() -> None:
    assert monotone({1: 30.0, 2: 26.0, 4: 24.0, 9: 29.0}) == pytest.approx({1: 26.666, 2: 26.666, 4: 26.666, 9: 29.0}, abs=1e-3)
    assert monotone({1: 1.0, 2: 2.0, 4: 3.0}) == {1: 1.0, 2: 2.0, 4: 3.0}
