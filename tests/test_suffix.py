"""Suffix decoding: the counted suffix trie against brute force (built at once, token by
token, with removals), longest-match lookup and frequency-ordered, match-sized draft trees on
hand-made sequences, the global trie of earlier outputs and its node cap, greedy equivalence
through the engine (ragged batches, fixed and adaptive policy) and the statistical lossless
test at temperature 1."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdraft.draft import Draft
from specdraft.errors import SpecdraftError
from specdraft.bench.harness import Memory
from specdraft.metrics import SpecStats
from specdraft.proposers import make_proposer
from specdraft.proposers.suffix import SuffixConfig, SuffixProposer, merge
from specdraft.proposers.suffix_tree import ROOT, Growth, SuffixTrie
from specdraft.sequence import GenerationConfig
from test_accept import ENGINE_ROWS, _engine_lossless_check, check_siblings_lossless, sampled_setup, sibling_setup  # noqa: F401 (fixtures)
from test_spec_engine import GEN, Setup, loopy, spec_engine, tiny  # noqa: F401 (fixtures)

# =========================================================================== the trie


def brute_counts(seqs: list[list[int]], depth: int) -> Counter:
    """Occurrences of every substring of at most ``depth`` tokens."""
    out: Counter = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                out[tuple(s[i:j])] += 1
    return out


def dump(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every node's string and count, by walking the children lists."""
    out: dict[tuple[int, ...], int] = {}
    stack: list[tuple[int, tuple[int, ...]]] = [(ROOT, ())]
    while stack:
        node, text = stack.pop()
        for c in trie.children(node):
            out[text + (trie.token[c],)] = trie.counts[c]
            stack.append((c, text + (trie.token[c],)))
    return out


tokens = st.lists(st.integers(0, 3), max_size=40)


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(tokens, min_size=1, max_size=3), depth=st.integers(1, 7))
def test_trie_counts_equal_brute_force(seqs: list[list[int]], depth: int) -> None:
    trie = SuffixTrie(depth)
    for s in seqs:
        trie.add(s)
    assert dump(trie) == dict(brute_counts(seqs, depth))
    assert trie.nodes == len(trie.edges) == len(brute_counts(seqs, depth))
    assert trie.counts[ROOT] == sum(map(len, seqs))


@settings(max_examples=60, deadline=None)
@given(seq=tokens, cuts=st.lists(st.integers(0, 40), max_size=5), depth=st.integers(1, 7))
def test_incremental_extension_equals_building_from_scratch(seq: list[int], cuts: list[int], depth: int) -> None:
    """A proposer row fed in random chunks (as decode steps emit them) holds the same trie as
    one built from the whole sequence, and its ends are the nodes of the sequence's suffixes."""
    config = SuffixConfig(max_depth=max(1, depth - 1), min_match=1, global_min_match=1)
    proposer = SuffixProposer(config, max_draft=1)
    seq_obj = SimpleNamespace(tokens=[], output=[])
    proposer.begin(0, seq_obj)  # type: ignore[arg-type]
    for cut in sorted(cuts) + [len(seq)]:
        seq_obj.tokens.extend(seq[len(seq_obj.tokens) : cut])
        proposer.propose([seq_obj], [1], None)  # type: ignore[list-item, arg-type]
    row = proposer.rows[0]
    whole = SuffixTrie(proposer.depth)
    whole.add(seq)
    assert dump(row.trie) == dump(whole)
    assert [row.trie.find(seq[len(seq) - j :]) for j in range(len(row.ends))] == row.ends
    assert len(row.ends) == min(len(seq), proposer.depth - 1) + 1


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(tokens, min_size=2, max_size=4), depth=st.integers(1, 6))
def test_removing_a_sequence_undoes_adding_it(seqs: list[list[int]], depth: int) -> None:
    trie = SuffixTrie(depth)
    for s in seqs:
        trie.add(s)
    trie.remove(seqs[0])
    assert dump(trie) == dict(brute_counts(seqs[1:], depth))
    assert trie.nodes == len(trie.edges)
    trie.add(seqs[0])  # freed ids are reused consistently
    assert dump(trie) == dict(brute_counts(seqs, depth))


def test_follow_and_ends_of_read_without_counting() -> None:
    trie = SuffixTrie(4)
    trie.add([1, 2, 3, 4, 5])
    before = dump(trie)
    ends = trie.ends_of([9, 1, 2, 3])
    assert ends == [ROOT, trie.find([3]), trie.find([2, 3]), trie.find([1, 2, 3])]
    assert trie.follow(ends, 4) == [ROOT, trie.find([4]), trie.find([3, 4]), trie.find([2, 3, 4])]  # depth 4 dropped
    assert trie.follow(ends, 7) == [ROOT]
    assert dump(trie) == before


# =========================================================================== proposals


class Row:
    """A sequence as the proposer sees it (tokens, output) driven by hand."""

    def __init__(self, proposer: SuffixProposer, tokens: list[int], row: int = 0) -> None:
        self.tokens, self.prompt, self.proposer, self.row = list(tokens), list(tokens), proposer, row
        proposer.begin(row, self)  # type: ignore[arg-type]

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    def propose(self, budget: int) -> Draft:
        seqs: list = [None] * (self.row + 1)
        budgets = [0] * (self.row + 1)
        seqs[self.row], budgets[self.row] = self, budget
        return self.proposer.propose(seqs, budgets, None)[self.row]  # type: ignore[arg-type]


def local(**options) -> SuffixProposer:
    return SuffixProposer(SuffixConfig(use_global=False, global_min_match=1, **options))


def path_probs(draft: Draft, probs: dict[tuple[int, ...], float]) -> list[float]:
    return [probs[tuple(draft.tokens[j] for j in draft.path_to(i))] for i in range(len(draft))]


def test_the_more_frequent_continuation_comes_first() -> None:
    # "1 2" was followed by 3 twice and by 4 once; the context ends in "1 2"
    seq = [5, 1, 2, 3, 6, 1, 2, 4, 7, 1, 2, 3, 8, 1, 2]
    d = Row(local(min_match=2, factor=4.0, min_prob=0.0), seq).propose(5)
    assert d.tokens[0] == 3 and d.parents[0] == -1
    assert 4 in [d.tokens[i] for i in range(len(d)) if d.parents[i] == -1]
    probs = {(3,): 2 / 3, (4,): 1 / 3, (3, 6): 1 / 3, (3, 8): 1 / 3, (4, 7): 1 / 3}
    got = path_probs(d, probs)
    assert got == sorted(got, reverse=True)  # best-first
    assert all(p < i for i, p in enumerate(d.parents))  # parents before children
    assert len(d) == 5 and d.p_draft is None


def test_the_longest_match_wins_over_a_more_frequent_short_one() -> None:
    # "2" is mostly followed by 9, but "1 2" (the longer match) only by 3
    seq = [2, 9, 2, 9, 2, 9, 1, 2, 3, 5, 1, 2]
    d = Row(local(min_match=1, factor=1.0, min_prob=0.0, matches=1), seq).propose(4)
    assert d.tokens == (3, 5)  # 2 nodes: factor 1 x a 2-token match
    d = Row(local(min_match=1, factor=1.0, min_prob=0.0, max_depth=1), seq).propose(4)
    assert d.tokens == (9,)


def test_the_tree_size_follows_the_match_length() -> None:
    text = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    for m in range(1, 6):  # the context ends with the first m tokens of the text
        seq = [1, *text, 2, *text[:m]] if m > 1 else [1, *text, 2, 3, text[0]]
        d = Row(local(min_match=1, factor=1.5, min_prob=0.0), seq).propose(8)
        assert len(d) == min(8, int(1.5 * m)), m
        assert list(d.tokens) == text[m : m + len(d)]


def test_budget_min_prob_and_no_match() -> None:
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 1, 2]  # four continuations, 1/4 each
    assert len(Row(local(factor=8.0, min_prob=0.0), seq).propose(3)) == 3
    assert len(Row(local(factor=8.0, min_prob=0.3), seq).propose(8)) == 0  # every path is at 0.25
    d = Row(local(factor=8.0, min_prob=0.2), seq).propose(8)  # 4 children of "1 2", then 1 each (0.25)
    assert sorted(d.tokens[i] for i in range(len(d)) if d.parents[i] == -1) == [3, 4, 5, 6]
    assert len(d) == 8 and d.depths() == [1, 1, 1, 1, 2, 2, 2, 2]
    assert len(Row(local(), [1, 2, 3, 4, 5]).propose(8)) == 0
    assert len(Row(local(min_match=3), seq).propose(8)) == 0  # "x 1 2" never occurred before


def test_a_loop_is_drafted_past_its_latest_period() -> None:
    """In a loop the longest match's only earlier occurrence is one period back and stops at
    the end of the context; a shorter match two periods back continues further."""
    seq = [9, 8] + [1, 2, 3] * 4
    d = Row(local(min_match=1, factor=4.0, matches=3), seq).propose(6)
    assert d.tokens == (1, 2, 3, 1, 2, 3)
    d = Row(local(min_match=1, factor=4.0, matches=1), seq).propose(6)
    assert len(d) == 3


def test_rows_and_growth_are_independent_and_deterministic() -> None:
    proposer = local(min_match=1, factor=4.0)
    a = Row(proposer, [1, 2, 3, 1, 2], row=0)
    b = Row(proposer, [7, 8, 9, 7, 8], row=1)
    assert a.propose(4).tokens == (3, 1, 2) and b.propose(4).tokens == (9, 7, 8)
    again = Row(local(min_match=1, factor=4.0), [1, 2, 3, 1, 2])
    assert again.propose(4) == a.propose(4)


# =========================================================================== the global trie


def test_a_pattern_from_an_earlier_output_is_proposed() -> None:
    proposer = SuffixProposer(SuffixConfig(min_match=2, factor=4.0, global_min_match=3, label_cap=6))
    first = Row(proposer, [1, 2])
    first.tokens += [40, 41, 42, 43, 44, 45, 46, 47]  # "generated"
    assert len(Row(proposer, [5, 40, 41, 42], row=1).propose(4)) == 0  # not yet finished
    proposer.end(0)
    proposer.end(1)
    d = Row(proposer, [5, 6, 40, 41, 42]).propose(4)
    assert d.tokens == (43, 44, 45, 46) and d.label == "g3"
    assert len(Row(proposer, [5, 6, 41, 42]).propose(4)) == 0  # 2 tokens: below global_min_match
    assert len(Row(SuffixProposer(SuffixConfig(use_global=False)), [5, 6, 40, 41, 42]).propose(4)) == 0


def test_the_global_trie_is_followed_as_it_changes() -> None:
    proposer = SuffixProposer(SuffixConfig(min_match=2, factor=4.0, global_min_match=2))
    for output in ([50, 51, 52], [30, 31, 32, 33]):
        if output[0] == 30:  # the global trie changes while row 0 is running
            row = Row(proposer, [5, 6, 30])
            assert len(row.propose(4)) == 0
        other = Row(proposer, [1], row=1)
        other.tokens += output
        proposer.end(1)
    row.tokens.append(31)
    assert row.propose(4).tokens == (32, 33)  # looked up again
    row.tokens.append(32)
    assert row.propose(4).tokens == (33,)  # followed


def test_the_node_cap_holds_and_the_oldest_outputs_go_first() -> None:
    cap = 500
    proposer = SuffixProposer(SuffixConfig(max_depth=4, max_nodes=cap), max_draft=4)
    outputs = [[100 + 10 * i + j for j in range(30)] for i in range(6)]  # distinct, 30 tokens each
    for out in outputs:
        r = Row(proposer, [1])
        r.tokens += out
        proposer.end(0)
        assert 0 < proposer.global_trie.nodes <= cap
    kept = list(proposer.outputs)
    assert kept == outputs[-len(kept) :] and len(kept) < len(outputs)
    assert dump(proposer.global_trie) == dict(brute_counts(kept, proposer.depth))
    assert proposer.memory_bytes() > 0


def test_an_output_larger_than_the_cap_is_not_kept() -> None:
    proposer = SuffixProposer(SuffixConfig(max_depth=4, max_nodes=10), max_draft=4)
    r = Row(proposer, [1])
    r.tokens += list(range(100, 140))
    proposer.end(0)
    assert proposer.global_trie.nodes == 0 and not proposer.outputs


def test_restore_forgets_the_outputs_remembered_since_the_snapshot() -> None:
    proposer = SuffixProposer(SuffixConfig(max_depth=4, global_min_match=2), max_draft=4)
    first = Row(proposer, [1])
    first.tokens += [40, 41, 42, 43]
    proposer.end(0)
    before = dump(proposer.global_trie)
    snap = proposer.snapshot()
    second = Row(proposer, [1])
    second.tokens += [60, 61, 62, 63]
    proposer.end(0)
    assert Row(proposer, [5, 60, 61]).propose(4).tokens == (62, 63)
    proposer.end(0)
    proposer.restore(snap)
    assert dump(proposer.global_trie) == before and list(proposer.outputs) == [[40, 41, 42, 43]]
    assert len(Row(proposer, [5, 60, 61]).propose(4)) == 0  # the later output is forgotten
    assert Row(proposer, [5, 40, 41], row=1).propose(4).tokens == (42, 43)  # the earlier one is not
    with pytest.raises(SpecdraftError):
        proposer.restore(snap)  # rows are active


# =========================================================================== settings


@pytest.mark.parametrize("options", [dict(max_depth=0), dict(min_match=5, max_depth=4), dict(factor=0.0),
                                     dict(min_prob=1.5), dict(max_nodes=-1), dict(matches=0), dict(label_cap=-1),
                                     dict(global_min_match=0), dict(global_min_match=5, max_depth=4)])
def test_bad_settings_raise_one_line(options: dict) -> None:
    with pytest.raises(SpecdraftError) as e:
        SuffixConfig(**options)
    assert "\n" not in str(e.value) and str(e.value).startswith("suffix:")


def test_registered_with_options() -> None:
    p = make_proposer("suffix", {"factor": "2.5", "use_global": "false", "max_depth": "12"})
    assert isinstance(p, SuffixProposer)
    assert p.config == SuffixConfig(factor=2.5, use_global=False, max_depth=12)
    with pytest.raises(SpecdraftError):
        make_proposer("suffix", {"depth": "3"})


# =========================================================================== through the engine


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("k", [3, 8])
def test_greedy_equals_plain_on_loopy(loopy: Setup, policy: str, k: int) -> None:
    """Twice with one proposer: the second run also drafts from the first run's outputs."""
    proposer = SuffixProposer(SuffixConfig(), max_draft=k)  # the defaults
    engine = spec_engine(loopy.loaded, proposer, k, policy, batch=len(loopy.prompts))
    for run in range(2):
        stats = SpecStats()
        results = engine.generate(loopy.prompts, GEN, stats=stats)
        for row, (r, ref) in enumerate(zip(results, loopy.refs)):
            assert r.tokens == ref, f"run {run} row {row} differs"
        assert stats.accepted >= 10, "the test is vacuous if (almost) nothing is accepted"
        assert stats.steps < stats.emitted
    assert proposer.outputs and not proposer.rows


def test_bench_repeats_start_from_the_same_memory(loopy: Setup) -> None:
    """The bench's Memory: a repeat after restore() drafts exactly as the first run did; without
    it, the second run drafts from the first run's outputs (what the restore must prevent)."""
    engine = spec_engine(loopy.loaded, SuffixProposer(SuffixConfig(), max_draft=6), 6, "adaptive",
                         batch=len(loopy.prompts))
    engine.generate([p[:3] for p in loopy.prompts], GenerationConfig(max_new_tokens=6))  # learned before
    memory = Memory.of(engine)

    def run() -> tuple[int, int, int]:
        stats = SpecStats()
        engine.generate(loopy.prompts, GEN, stats=stats)
        return stats.proposed, stats.accepted, stats.steps

    first = run()
    unrestored = run()
    memory.restore(engine)
    assert run() == first
    assert unrestored != first


def test_greedy_equals_plain_on_the_tiny_model(tiny: Setup) -> None:
    proposer = SuffixProposer(SuffixConfig(min_match=1, factor=4.0, min_prob=0.0), max_draft=6)
    stats = SpecStats()
    results = spec_engine(tiny.loaded, proposer, 6).generate(tiny.prompts, GEN, stats=stats)
    assert [r.tokens for r in results] == tiny.refs
    assert stats.proposed > 0


def test_engine_sampling_is_lossless(sampled_setup) -> None:  # noqa: F811 (fixture)
    first, joint, triple, stats = _engine_lossless_check(
        sampled_setup, proposer=lambda _m, _t: SuffixProposer(SuffixConfig(), max_draft=4), k=4)
    assert stats.accepted > 0.05 * ENGINE_ROWS, "drafts should be accepted in the first steps"
    assert not first.rejects, first
    assert not joint.rejects, joint
    assert not triple.rejects, triple


def test_merge_shares_prefixes_best_first_within_the_budget() -> None:
    a = Growth([1, 2, 3], [-1, 0, 1], 2.5)
    b = Growth([1, 4, 5], [-1, 0, -1], 1.0)  # "1" is shared, "1 4" and "5" are new
    assert merge([a, b], 8) == ([1, 2, 3, 4, 5], [-1, 0, 1, 0, -1])
    assert merge([a, b], 4) == ([1, 2, 3, 4], [-1, 0, 1, 0])
    assert merge([b, a], 2) == ([1, 4], [-1, 0])


def test_siblings_are_lossless_through_the_engine(sibling_setup, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Trees whose later siblings are often accepted: a sampler that skips the residual
    between siblings must be caught (see ``check_siblings_lossless``)."""
    check_siblings_lossless(sibling_setup, lambda _m, _t: SuffixProposer(SuffixConfig(min_prob=0.0), max_draft=4), 4,
                            monkeypatch)
