"""Speculative decoding through the engine: greedy equivalence with plain decoding (n-gram
chains and trees, fixed and adaptive policies, ragged batches), KV rollback and tree commit
with a hand-written proposer, stop conditions inside accepted runs, bad input, the n-gram
proposer and the policy on their own, the ``verify`` command, and one real-model check."""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from collections.abc import Sequence as Seq
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import specdraft.verify as verify_module
from specdraft.accept import Acceptance
from specdraft.cli import main
from specdraft.draft import Draft
from specdraft.engine import Engine
from specdraft.errors import ModelFileError, SpecdraftError
from specdraft.metrics import SpecStats
from specdraft.model.loader import LoadedModel, default_model_path, load
from specdraft.policy import (PROBE_GAP_MAX, PROBE_SETUP_SHARE, CostModel, Plan, Policy, PolicyConfig, expected_tokens,
                              progress)
from specdraft.policy.cost import lone_rows
from specdraft.policy.evidence import REALISM_MAX, Realism
from specdraft.proposers import make_proposer
from specdraft.proposers.base import Proposer
from specdraft.proposers.ngram import NgramConfig, NgramIndex, NgramProposer, continuation
from specdraft.sampling import Sampling
from specdraft.sequence import GenerationConfig, Sequence
from specdraft.verify import Mismatch, VerifyReport, compare_prompt, first_difference
from specdraft.workloads import Prompt
from tiny_models import write_hf_model

# =========================================================================== models and prompts
#
# The tiny random model hardly ever repeats itself, so n-gram drafts are rarely accepted on it.
# "loopy" is the same model with its attention output scaled down: it leans on the last token,
# so its greedy text falls into loops that the n-gram proposer predicts, while attention (and
# so the KV cache, positions and masks) still matters. Its prompts include some of its own
# greedy text, which makes the loops show up early. Both models are used.

TEXTS = [
    "a b a b a b a b a b",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Hello",
    "12345 12345 12345 12345",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
]
GEN = GenerationConfig(max_new_tokens=40, ignore_eos=True)


@dataclass(frozen=True)
class Setup:
    loaded: LoadedModel
    prompts: list[list[int]]  # a ragged batch
    refs: list[list[int]]  # plain greedy outputs (GEN)


def base_prompts(loaded: LoadedModel) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    vocab = loaded.tokenizer.vocab_size
    randoms = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 30)]
    return [loaded.tokenizer.encode(t) for t in TEXTS] + randoms


def plain_engine(loaded: LoadedModel) -> Engine:
    return Engine(loaded.model, loaded.tokenizer)


def make_setup(loaded: LoadedModel, warm: int = 0) -> Setup:
    prompts = base_prompts(loaded)
    if warm:  # append the model's own continuation to the first prompts
        cont = plain_engine(loaded).generate(prompts[:4], GenerationConfig(max_new_tokens=warm, ignore_eos=True))
        prompts = [p + c.tokens for p, c in zip(prompts, cont)] + prompts[4:]
    return Setup(loaded, prompts, [r.tokens for r in plain_engine(loaded).generate(prompts, GEN)])


@pytest.fixture(scope="module")
def tiny(tiny_hf: Path) -> Setup:
    return make_setup(load(tiny_hf))


@pytest.fixture(scope="module")
def loopy(tiny: Setup) -> Setup:
    model = copy.deepcopy(tiny.loaded.model)
    with torch.no_grad():
        for layer in model.layers:
            layer.wo.weight.mul_(0.2)
    return make_setup(LoadedModel(model, tiny.loaded.tokenizer, tiny.loaded.source), warm=24)


def cost_table(batch: int, per_token: float = 0.001, k: int = 8) -> CostModel:
    """A hand-made cost model: one forward costs 1 + per_token * (q - 1) seconds."""
    return CostModel(table={batch: {q: 1.0 + per_token * (q - 1) for q in range(1, k + 2)}})


def spec_engine(loaded: LoadedModel, proposer: Proposer, k: int, policy: str = "fixed", batch: int = 1,
                stop_after: int | None = None, margin: float | None = None) -> Engine:
    cost = cost_table(batch, k=k) if policy == "adaptive" else None
    # throughput: keep drafting for the rows that can while others cannot, so that the ragged
    # batches of the equivalence tests accept enough to mean something
    config = PolicyConfig(kind=policy, k=k, objective="throughput")
    if stop_after is not None:  # the row's brake (default: the policy's)
        config = dataclasses.replace(config, stop_after=stop_after)
    if margin is not None:  # the share by which speculation must beat plain (default: the policy's)
        config = dataclasses.replace(config, margin=margin)
    return Engine(loaded.model, loaded.tokenizer, proposer, Policy(config, cost))


# =========================================================================== greedy equivalence


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("branches", [1, 2], ids=["chain", "tree"])
def test_ngram_greedy_equals_plain(loopy: Setup, k: int, policy: str, branches: int) -> None:
    engine = spec_engine(loopy.loaded, NgramProposer(NgramConfig(branches=branches)), k, policy, batch=len(loopy.prompts))
    stats = SpecStats()
    results = engine.generate(loopy.prompts, GEN, stats=stats)
    for row, (r, ref) in enumerate(zip(results, loopy.refs)):
        assert r.tokens == ref, f"row {row} differs"
        assert r.finish_reason == "length"
    assert stats.accepted >= 5 * min(k, 2), "the test is vacuous if (almost) nothing is accepted"
    assert stats.steps < stats.emitted  # some steps emitted more than one token


@pytest.mark.parametrize("branches", [1, 3], ids=["chain", "tree"])
def test_ngram_greedy_equals_plain_on_the_plain_tiny_model(tiny: Setup, branches: int) -> None:
    stats = SpecStats()
    engine = spec_engine(tiny.loaded, NgramProposer(NgramConfig(branches=branches)), 6)
    results = engine.generate(tiny.prompts, GEN, stats=stats)
    assert [r.tokens for r in results] == tiny.refs
    assert stats.proposed > 0 and stats.accepted > 0


def test_each_row_alone_equals_the_batch(loopy: Setup) -> None:
    engine = spec_engine(loopy.loaded, NgramProposer(NgramConfig(branches=2)), 4)
    for p, ref in list(zip(loopy.prompts, loopy.refs))[::2]:
        assert engine.generate([p], GEN)[0].tokens == ref


def test_sampled_speculation_is_reproducible(loopy: Setup) -> None:
    settings = [Sampling(temperature=0.8, top_k=20, seed=s) for s in range(len(loopy.prompts))]
    runs = [spec_engine(loopy.loaded, NgramProposer(NgramConfig(branches=2)), 4).generate(loopy.prompts, GEN, settings)
            for _ in range(2)]
    assert [r.tokens for r in runs[0]] == [r.tokens for r in runs[1]]
    assert sum(r.stats.accepted for r in runs[0]) > 0


# =========================================================================== hand-written proposers


class OracleProposer:
    """Knows each row's plain greedy continuation and proposes trees in which some siblings
    are right and some wrong, in patterns that change from step to step: wrong siblings
    first (so the accepted path is not a prefix of the node order and the cache commit must
    gather), a wrong token partway down (rollback), the whole budget right, or nothing right."""

    name = "oracle"

    def __init__(self, truths: list[list[int]], prompts: list[list[int]], vocab: int, shape: str = "tree") -> None:
        self.truths, self.prompts, self.vocab, self.shape = truths, prompts, vocab, shape
        self.step = 0
        self.expected: dict[int, int] = {}  # row -> tokens the verifier must accept this step
        self.proposed = [0] * len(truths)
        self.accepted = [0] * len(truths)
        self.history: list[list[tuple[int, int]]] = [[] for _ in truths]  # (draft depth, accepted) per step

    def begin(self, row: int, seq: Sequence) -> None:
        assert seq.prompt == self.prompts[row]

    def end(self, row: int) -> None:
        pass

    def memory_bytes(self) -> int:
        return 0

    def _wrong(self, token: int) -> int:
        return (token + 1 + self.step % 7) % self.vocab

    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache=None) -> list[Draft]:
        self.step += 1
        drafts = []
        for row, (seq, budget) in enumerate(zip(seqs, budgets)):
            if seq is None or budget <= 0:
                self.expected[row] = 0
                drafts.append(Draft.empty())
                continue
            done = len(seq.tokens) - len(self.prompts[row])
            truth = self.truths[row][done:] + [0] * budget  # the tokens after the root
            right = [self.step % 5, budget, 0, 2, 3][(self.step + row) % 5]  # right tokens before a wrong one
            right = min(right, budget)
            path = truth[:right] + [self._wrong(truth[right])]
            if self.shape == "chain":
                paths = [path]
            else:  # wrong siblings before the right ones, at the root and one level down
                paths = [[self._wrong(truth[0])], [truth[0], self._wrong(truth[1])], path]
            draft = Draft.from_paths(paths, max_nodes=budget)
            self.expected[row] = len(draft.path_to(_deepest_right(draft, truth)))
            self.proposed[row] += len(draft)
            drafts.append(draft)
        return drafts

    def observe(self, row: int, draft: Draft, acceptance: Acceptance, verified=None) -> None:
        assert acceptance.accepted == self.expected[row]
        self.accepted[row] += acceptance.accepted
        self.history[row].append((max(draft.depths(), default=0), acceptance.accepted))


def _deepest_right(draft: Draft, truth: list[int]) -> int:
    """The deepest node whose path spells a prefix of ``truth`` (-1 = none)."""
    best, best_depth = -1, 0
    depths = draft.depths()
    for i in range(len(draft)):
        if [draft.tokens[j] for j in draft.path_to(i)] == truth[: depths[i]] and depths[i] > best_depth:
            best, best_depth = i, depths[i]
    return best


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("k", [3, 8])
def test_rollback_and_tree_commit_match_plain(tiny: Setup, shape: str, k: int) -> None:
    prompts, truths = tiny.prompts, tiny.refs
    oracle = OracleProposer(truths, prompts, tiny.loaded.tokenizer.vocab_size, shape)
    engine = spec_engine(tiny.loaded, oracle, k)
    total = SpecStats()
    results = engine.generate(prompts, GEN, stats=total)
    for row, (r, ref) in enumerate(zip(results, truths)):
        assert r.tokens == ref, f"row {row}"
        s = r.stats
        assert s.emitted == len(r.tokens) - 1  # the first token comes from the prefill
        assert s.tau == pytest.approx(s.emitted / s.steps)
        assert s.proposed == oracle.proposed[row]
        assert s.accepted == oracle.accepted[row]
        assert s.steps == len(oracle.history[row]) and s.accepted <= s.emitted
        # per position d: steps whose draft reached depth d / accepted a token at depth d
        depth = max(d for d, _ in oracle.history[row])
        assert s.drafts_at == [sum(d >= i for d, _ in oracle.history[row]) for i in range(1, depth + 1)]
        most = max(a for _, a in oracle.history[row])
        assert s.accepted_at[:most] == [sum(a >= i for _, a in oracle.history[row]) for i in range(1, most + 1)]
        assert not any(s.accepted_at[most:])
        assert sum(s.accepted_at) == s.accepted and len(s.accepted_at) <= len(s.drafts_at) <= k
    assert total.steps == sum(len(h) for h in oracle.history)
    assert total.accepted > total.steps // 2  # plenty of multi-token steps
    assert total.emitted == sum(len(r.tokens) - 1 for r in results)
    assert total.proposed == sum(oracle.proposed) and total.accepted == sum(oracle.accepted)


class OverBudget:
    name = "over-budget"

    def begin(self, row: int, seq: Sequence) -> None:
        pass

    def end(self, row: int) -> None:
        pass

    def memory_bytes(self) -> int:
        return 0

    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache=None) -> list[Draft]:
        return [Draft.chain([5] * (b + 1)) for b in budgets]

    def observe(self, row: int, draft: Draft, acceptance: Acceptance, verified=None) -> None:
        pass


def test_draft_over_budget_raises(tiny: Setup) -> None:
    engine = spec_engine(tiny.loaded, OverBudget(), 4)
    with pytest.raises(RuntimeError, match="budget"):
        engine.generate(tiny.prompts[:2], GenerationConfig(max_new_tokens=8))


# =========================================================================== stop conditions inside accepted runs


def _chain_oracle(truths: list[list[int]], prompts: list[list[int]]) -> Proposer:
    """Proposes the plain continuation itself: every step accepts its whole budget."""

    class Perfect(OverBudget):
        name = "perfect"

        def propose(self, seqs, budgets, cache=None):
            out = []
            for row, (seq, b) in enumerate(zip(seqs, budgets)):
                if seq is None or b <= 0:
                    out.append(Draft.empty())
                    continue
                done = len(seq.tokens) - len(prompts[row])
                out.append(Draft.chain((truths[row][done:] + [3] * b)[:b]))
            return out

    return Perfect()


class DeepTree(OverBudget):
    """A tree proposer (``trees``) that knows the plain continuation and ignores the row's
    remaining tokens: each draft is the right chain as deep as the budget, then wrong leaves
    under the root until the budget is spent. Records each step's budget and the room the
    row had, and the depth of what was verified."""

    name = "deep-tree"
    trees = True

    def __init__(self, truths: list[list[int]], prompts: list[list[int]]) -> None:
        self.truths, self.prompts = truths, prompts
        self.asked: list[tuple[int, int]] = []  # (budget, room) per drafting row and step
        self.verified_depths: list[tuple[int, int]] = []  # (depth verified, room before the step)
        self.rooms: dict[int, int] = {}

    def propose(self, seqs, budgets, cache=None):
        out = []
        for row, (seq, b) in enumerate(zip(seqs, budgets)):
            if seq is None or b <= 0:
                out.append(Draft.empty())
                continue
            self.asked.append((b, seq.room))
            self.rooms[row] = seq.room
            done = len(seq.tokens) - len(self.prompts[row])
            chain = (self.truths[row][done:] + [3] * b)[: max(1, b // 2)]
            wrong = [t for t in range(50) if t != chain[0]][: b - len(chain)]  # distinct leaves under the root
            out.append(Draft(tuple(chain + wrong), tuple(range(-1, len(chain) - 1)) + (-1,) * len(wrong)))
        return out

    def observe(self, row: int, draft: Draft, acceptance: Acceptance, verified=None) -> None:
        self.verified_depths.append((max(draft.depths(), default=0), self.rooms[row]))


def test_a_tree_proposers_budget_is_nodes_and_its_depth_is_capped_by_the_remaining_tokens(tiny: Setup) -> None:
    """Near a request's end a tree proposer still gets its whole budget of nodes; the engine
    keeps only the nodes the request could still emit, and the output is plain decoding's."""
    loaded, prompts, truths = tiny.loaded, tiny.prompts[:3], tiny.refs[:3]
    proposer = DeepTree(truths, prompts)
    engine = Engine(loaded.model, loaded.tokenizer, proposer, Policy(PolicyConfig(kind="fixed", k=8)))
    gen = GenerationConfig(max_new_tokens=9, ignore_eos=True)  # the first token, a step of 5, then room 3
    for r, ref in zip(engine.generate(prompts, gen), truths):
        assert r.tokens == ref[:9] and r.finish_reason == "length"
    assert all(b == 8 for b, _ in proposer.asked)  # never cut to the remaining tokens
    assert any(room - 1 < 8 // 2 for _, room in proposer.asked)  # some drafts were deeper than the room
    assert all(depth <= room - 1 for depth, room in proposer.verified_depths)
    assert max(depth for depth, _ in proposer.verified_depths) == 8 // 2


@pytest.fixture(params=["tiny", "loopy"])
def setup(request: pytest.FixtureRequest) -> Setup:
    return request.getfixturevalue(request.param)


def _stop_engines(loaded: LoadedModel, tokenizer, truths, prompts) -> dict[str, Engine]:
    policy = lambda: Policy(PolicyConfig(kind="fixed", k=8))  # noqa: E731
    return {
        "perfect chain": Engine(loaded.model, tokenizer, _chain_oracle(truths, prompts), policy()),
        "ngram": Engine(loaded.model, tokenizer, NgramProposer(), policy()),
        "ngram tree": Engine(loaded.model, tokenizer, NgramProposer(NgramConfig(branches=2)), policy()),
    }


def test_eos_inside_an_accepted_run(setup: Setup) -> None:
    loaded = setup.loaded
    prompts, truths = setup.prompts[:4], setup.refs[:4]
    ref = truths[0]
    # the first token at index >= 5 that does not occur earlier in row 0's output
    index = next(i for i in range(5, len(ref)) if ref[i] not in ref[:i])
    tok = copy.copy(loaded.tokenizer)
    tok.eos_ids = frozenset({ref[index]})
    gen = GenerationConfig(max_new_tokens=40)
    plain = Engine(loaded.model, tok).generate(prompts, gen)
    assert plain[0].finish_reason == "eos" and plain[0].tokens == ref[:index]
    for name, engine in _stop_engines(loaded, tok, truths, prompts).items():
        got = engine.generate(prompts, gen)
        for a, b in zip(plain, got):
            assert (b.tokens, b.text, b.finish_reason) == (a.tokens, a.text, a.finish_reason), name
        if name == "perfect chain":  # the EOS was drafted and verified inside a multi-token step
            assert got[0].stats.steps < index


def test_stop_string_inside_an_accepted_run(setup: Setup) -> None:
    loaded = setup.loaded
    prompts, truths = setup.prompts[:4], setup.refs[:4]
    free = plain_engine(loaded).generate(prompts[:1], GEN)[0]
    stop = next(free.text[i : i + 2] for i in range(8, len(free.text))
                if free.text[i : i + 2].isascii() and free.text[i : i + 2].isprintable()
                and free.text[i : i + 2].strip() and free.text.find(free.text[i : i + 2]) == i)
    gen = GenerationConfig(max_new_tokens=40, ignore_eos=True, stop=(stop,))
    plain = plain_engine(loaded).generate(prompts, gen)
    assert plain[0].finish_reason == "stop" and plain[0].text == free.text[: free.text.find(stop)]
    for name, engine in _stop_engines(loaded, loaded.tokenizer, truths, prompts).items():
        streamed: dict[int, list[str]] = {}
        got = engine.generate(prompts, gen, on_text=lambda e: streamed.setdefault(e.row, []).append(e.text))
        for row, (a, b) in enumerate(zip(plain, got)):
            assert (b.tokens, b.text, b.finish_reason) == (a.tokens, a.text, a.finish_reason), name
            assert "".join(streamed.get(row, [])) == b.text
        if name == "perfect chain":  # the stop string ended a multi-token step
            assert got[0].stats.steps < len(got[0].tokens) - 1


@pytest.mark.parametrize("max_new", [1, 2, 7, 9])
def test_max_new_tokens_inside_an_accepted_run(setup: Setup, max_new: int) -> None:
    loaded = setup.loaded
    prompts, truths = setup.prompts[:4], setup.refs[:4]
    gen = GenerationConfig(max_new_tokens=max_new, ignore_eos=True)
    for name, engine in _stop_engines(loaded, loaded.tokenizer, truths, prompts).items():
        got = engine.generate(prompts, gen)
        for r, ref in zip(got, truths):
            assert r.tokens == ref[:max_new] and r.finish_reason == "length", name
            assert r.stats.emitted == max_new - 1


# =========================================================================== bad input and the context limit


@pytest.mark.parametrize("k", [0, -1, 257, 10**6])
def test_bad_draft_length_raises(k: int) -> None:
    with pytest.raises(SpecdraftError):
        PolicyConfig(k=k)


@pytest.mark.parametrize("options", [dict(max_n=-1), dict(min_n=3, max_n=2), dict(max_n=10**6), dict(min_n=0),
                                     dict(branches=0), dict(branches=5, max_occurrences=4)])
def test_bad_ngram_config_raises(options: dict) -> None:
    with pytest.raises(SpecdraftError):
        NgramConfig(**options)
    with pytest.raises(SpecdraftError):
        make_proposer("ngram", {k: str(v) for k, v in options.items()})


def test_adaptive_policy_needs_a_cost_model() -> None:
    with pytest.raises(SpecdraftError):
        Policy(PolicyConfig(kind="adaptive"))
    with pytest.raises(SpecdraftError):
        PolicyConfig(kind="sometimes")  # type: ignore[arg-type]
    with pytest.raises(SpecdraftError, match="objective"):
        PolicyConfig(objective="latency")  # type: ignore[arg-type]


def _near_full_prompt(loaded: LoadedModel) -> list[int]:
    """A looping prompt of max_context - 3 tokens (so n-gram drafts exist right at the end)."""
    n = loaded.config.max_context - 3
    base = loaded.tokenizer.encode("a b c a b c ")
    return (base * (n // len(base) + 1))[:n]


@pytest.mark.parametrize("branches", [1, 2])
def test_prompt_that_nearly_fills_the_context(loopy: Setup, branches: int) -> None:
    prompt = _near_full_prompt(loopy.loaded)
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    ref = plain_engine(loopy.loaded).generate([prompt], gen)[0]
    got = spec_engine(loopy.loaded, NgramProposer(NgramConfig(branches=branches)), 8).generate([prompt], gen)[0]
    assert got.tokens == ref.tokens and got.finish_reason == ref.finish_reason == "context"
    assert len(got.tokens) == 3


def test_batch_mixing_a_near_full_prompt_with_short_ones(loopy: Setup) -> None:
    prompts = [loopy.prompts[0], _near_full_prompt(loopy.loaded), loopy.prompts[3]]
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    plain = plain_engine(loopy.loaded).generate(prompts, gen)
    for proposer in (NgramProposer(), NgramProposer(NgramConfig(branches=2))):
        got = spec_engine(loopy.loaded, proposer, 8, "adaptive", batch=3).generate(prompts, gen)
        for a, b in zip(plain, got):
            assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason)
    assert [r.finish_reason for r in plain] == ["length", "context", "length"]


# =========================================================================== the n-gram proposer

CLASSIC = NgramConfig(max_n=3, min_n=1)  # the unit tests below were written for suffixes of 1..3 tokens


def propose(proposer: NgramProposer, tokens: list[int], budget: int, row: int = 0) -> Draft:
    seq = SimpleNamespace(tokens=tokens)
    if row not in proposer.index:
        proposer.begin(row, seq)  # type: ignore[arg-type]
    return proposer.propose([seq], [budget], None)[0]  # type: ignore[list-item]


def test_ngram_proposes_after_the_most_recent_longest_match() -> None:
    # suffix (1, 2, 3) occurs earlier ending at 3 and at 7; the most recent is followed by 7, 5
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert propose(NgramProposer(CLASSIC), tokens, 3).tokens == (7, 5, 1)
    # the longest suffix wins over a more recent shorter one: (4, 3) -> 9, although (3) -> 6
    tokens = [4, 3, 9, 7, 3, 6, 4, 3]
    d = propose(NgramProposer(NgramConfig(min_n=1, max_n=2)), tokens, 4)
    assert d.tokens == (9, 7, 3, 6) and d.is_chain
    assert propose(NgramProposer(NgramConfig(min_n=1, max_n=1)), tokens, 2).tokens == (6, 4)


def test_ngram_respects_the_budget_and_min_n() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    for budget in range(1, 9):
        d = propose(NgramProposer(CLASSIC), tokens, budget)
        assert len(d) == budget and d.tokens == tuple(continuation(tokens, 2, budget))
    assert len(propose(NgramProposer(CLASSIC), tokens, 0)) == 0
    # with min_n = 3 the two-token suffix (1, 2) is too short to count
    assert len(propose(NgramProposer(NgramConfig(min_n=3, max_n=3)), tokens, 4)) == 0


def test_ngram_empty_without_a_match() -> None:
    assert len(propose(NgramProposer(CLASSIC), [1, 2, 3, 4], 5)) == 0
    assert len(propose(NgramProposer(CLASSIC), [7], 5)) == 0
    # idle rows and zero budgets get empty drafts
    p = NgramProposer(CLASSIC)
    p.begin(0, SimpleNamespace(tokens=[1, 1, 1]))  # type: ignore[arg-type]
    assert [len(d) for d in p.propose([None], [4], None)] == [0]


def test_ngram_continues_periodic_patterns_past_the_context() -> None:
    assert propose(NgramProposer(CLASSIC), [1, 2, 3, 1, 2, 3], 8).tokens == (1, 2, 3, 1, 2, 3, 1, 2)
    assert propose(NgramProposer(CLASSIC), [5, 5, 5], 6).tokens == (5,) * 6
    assert propose(NgramProposer(CLASSIC), [9, 1, 2, 1, 2], 5).tokens == (1, 2, 1, 2, 1)


def test_ngram_branches_give_a_tree_of_distinct_continuations() -> None:
    tokens = [7, 1, 8, 7, 2, 8, 7, 3, 8, 7]  # after 7 came 1, 2 and 3 (3 most recently)
    d = propose(NgramProposer(NgramConfig(min_n=1, max_n=1, branches=3)), tokens, 6)
    assert not d.is_chain and len(d) <= 6
    roots = [d.tokens[c] for c in d.children()[0]]
    assert roots == [3, 2, 1]  # newest occurrence first, all distinct
    assert [d.tokens[i] for i in d.paths()[0]] == [3, 8, 7]  # the newest keeps half the budget
    for group in d.children():
        assert len({d.tokens[c] for c in group}) == len(group)
    # two occurrences with the same continuation merge into one path
    same = propose(NgramProposer(NgramConfig(min_n=1, max_n=1, branches=2)), [7, 1, 7, 1, 7], 4)
    assert same.is_chain and same.tokens == (1, 7, 1, 7)
    # a budget of one keeps a single node
    assert len(propose(NgramProposer(NgramConfig(min_n=1, max_n=1, branches=3)), tokens, 1)) == 1


def test_ngram_index_is_incremental() -> None:
    config = NgramConfig(min_n=1, max_n=2)
    proposer = NgramProposer(config)
    tokens = [1, 2, 3, 4, 5]
    propose(proposer, tokens, 2)
    index = proposer.index[0]
    assert index.indexed_to == len(tokens) - 1  # everything but the current suffix
    assert (4, 5) not in index.table and (5,) not in index.table  # never matched with itself
    before = {k: list(v) for k, v in index.table.items()}
    tokens += [6, 1, 2]
    propose(proposer, tokens, 2)
    assert index.indexed_to == len(tokens) - 1
    # only the n-grams ending at the new positions 5, 6, 7 were added, each once
    added = {k: [e for e in v if e not in before.get(k, [])] for k, v in index.table.items()}
    new_ends = sorted(e for v in added.values() for e in v)
    assert new_ends == [5, 5, 6, 6, 7, 7]
    assert all(len(v) == len(set(v)) for v in index.table.values())
    # a fresh index built in one go is identical
    fresh = NgramIndex(config)
    fresh.extend(tokens, len(tokens) - 1)
    assert fresh.table == index.table
    # extending to the same position again adds nothing
    index.extend(tokens, len(tokens) - 1)
    assert fresh.table == index.table
    # the table keeps only the most recent max_occurrences positions per n-gram
    small = NgramIndex(NgramConfig(min_n=1, max_n=1, max_occurrences=2))
    small.extend([4] * 6, 6)
    assert small.table[(4,)] == [5, 6]
    assert small.lookup([4] * 7) == ([6, 5], 1)


def test_ngram_rows_are_independent() -> None:
    p = NgramProposer(CLASSIC)
    a = SimpleNamespace(tokens=[1, 2, 1])
    b = SimpleNamespace(tokens=[3, 4, 3])
    p.begin(0, a)  # type: ignore[arg-type]
    p.begin(1, b)  # type: ignore[arg-type]
    da, db = p.propose([a, b], [2, 2], None)  # type: ignore[list-item]
    assert da.tokens == (2, 1) and db.tokens == (4, 3)
    p.end(0)
    assert 0 not in p.index and p.memory_bytes() > 0


# =========================================================================== the policy


def _evidence(policy: Policy, row: int, steps: int, accepted: int, depth: int = 8) -> None:
    draft = Draft.chain(list(range(depth)))
    for _ in range(steps):
        policy.observe(row, draft, Acceptance(tuple(range(accepted)), tuple(range(accepted + 1))))


def test_adaptive_picks_a_long_draft_when_extra_tokens_are_nearly_free() -> None:
    policy = Policy(PolicyConfig(kind="adaptive", k=8), cost_table(1, per_token=0.001))
    policy.begin(0)
    _evidence(policy, 0, 10, accepted=8)
    assert policy.alpha(0) > 0.9
    assert policy.budgets([8], 1).budgets == [8]
    assert policy.budgets([3], 1).budgets == [3]  # capped by the row's room


def test_adaptive_turns_speculation_off_when_verification_is_expensive() -> None:
    batch = 64
    gate_first = PolicyConfig(kind="adaptive", k=8, look_cost=0.0)  # the budget gate, before proposing
    policy = Policy(gate_first, cost_table(batch, per_token=1.0))  # cost grows like q
    for row in range(batch):
        policy.begin(row)
        _evidence(policy, row, 10, accepted=8)
    assert policy.budgets([8] * batch, batch).budgets == [0] * batch
    # and a low acceptance turns it off even when extra tokens cost little
    cheap = Policy(gate_first, cost_table(1, per_token=0.3))
    cheap.begin(0)
    _evidence(cheap, 0, 20, accepted=0)
    assert cheap.budgets([8], 1).budgets == [0]


def test_a_cheap_proposer_drafts_first_and_is_gated_on_its_drafts() -> None:
    """A proposer that costs almost nothing drafts the full k whatever the row's alpha; the
    gate then acts on the drafts in trim(): a row with a poor record gets its draft cut to
    nothing, and after probe_every such steps one probe of probe_k is kept. A proposer whose
    drafting costs a noticeable share of a target step is gated before it runs."""
    config = PolicyConfig(kind="adaptive", k=8, probe_every=3, stop_after=10**6)  # (the row's brake: below)
    policy = Policy(config, cost_table(1, per_token=0.1))  # a probe is cheap
    policy.begin(0)
    _evidence(policy, 0, 30, accepted=0)
    draft = Draft.chain(range(8))
    kept = []
    for _ in range(3):
        plan = policy.budgets([8], 1)
        assert plan.budgets == [8] and plan.mode == "look"
        kept.append(len(policy.trim([draft], plan)[0]))
    assert kept == [0, 0, config.probe_k]
    assert policy.trim([Draft.empty()], policy.budgets([8], 1))[0] == Draft.empty()  # nothing drafted: nothing to gate
    good = Policy(config, cost_table(1, per_token=0.001))
    good.begin(0)
    _evidence(good, 0, 30, accepted=8)
    plan = good.budgets([8], 1)
    assert plan.budgets == [8] and len(good.trim([draft], plan)[0]) == 8
    dear = Policy(config, cost_table(1, per_token=0.3))  # drafting costs 10% of a target step
    dear.begin(0)
    _evidence(dear, 0, 30, accepted=0)
    for _ in range(4):
        dear.observe_propose_time(8, 0.1)
    assert dear.budgets([8], 1).budgets == [0]
    off = Policy(PolicyConfig(kind="adaptive", k=8, look_cost=0.0), cost_table(1, per_token=0.3))
    off.begin(0)
    _evidence(off, 0, 30, accepted=0)
    assert off.budgets([8], 1).budgets == [0]  # look_cost 0: always gated first
    with pytest.raises(SpecdraftError):
        PolicyConfig(look_cost=2.0)


def test_a_request_whose_drafts_keep_failing_stops_drafting_whatever_the_labels_say() -> None:
    """A row whose last stop_after drafts all failed drafts nothing for probe_every steps,
    even when its drafts' label (pooled over earlier requests) says they pay; a failed retry
    doubles the wait, a draft that pays releases the row at once. Other rows go on."""
    config = PolicyConfig(kind="adaptive", k=8, probe_every=4, stop_after=3)  # (default 4)
    policy = Policy(config, cost_table(2, per_token=0.01))
    good = Draft.chain(range(8), label="long-match")
    for row in (0, 1):
        policy.begin(row)
    for _ in range(20):  # earlier requests: this label was nearly always accepted
        policy.observe(1, good, Acceptance(tuple(range(8)), tuple(range(9))))
    assert policy.label_alpha("long-match") > 0.9
    missed, paid = Acceptance((), (1,)), Acceptance((0,), (0, 1))

    def step(outcome: Acceptance | None) -> int:
        kept = policy.trim([good, good], policy.budgets([8, 8], 2))
        assert len(kept[1]) == 8  # the other row is never held back
        if outcome is not None and len(kept[0]):
            policy.observe(0, kept[0], outcome)
        return len(kept[0])

    assert [step(missed) for _ in range(3)] == [8, 8, 8]  # three failures...
    assert [step(missed) for _ in range(4)] == [0, 0, 0, 8]  # ...then a wait, and a retry that fails
    assert [step(missed) for _ in range(8)] == [0] * 7 + [8]  # twice the wait
    assert policy.held(0) and step(None) == 0
    policy.observe(0, good, paid)  # a draft that pays (a probe's) releases the row
    assert not policy.held(0) and step(None) == 8
    policy.end(0)
    policy.begin(0)  # a new request starts free
    assert step(None) == 8
    fixed = Policy(PolicyConfig(kind="fixed", k=8))
    fixed.begin(0)
    for _ in range(5):
        fixed.observe(0, good, missed)
    assert fixed.budgets([8], 1).budgets == [8] and not fixed.held(0)  # the fixed policy always drafts k


def test_adaptive_alpha_follows_the_evidence() -> None:
    policy = Policy(PolicyConfig(kind="adaptive", k=8, prior=0.5), cost_table(1))
    policy.begin(0)
    assert policy.alpha(0) == pytest.approx(0.5)
    _evidence(policy, 0, 3, accepted=6)
    high = policy.alpha(0)
    assert high > 0.5
    _evidence(policy, 0, 3, accepted=0)
    assert policy.alpha(0) < high
    # an empty draft is no evidence
    a = policy.alpha(0)
    policy.observe(0, Draft.empty(), Acceptance((), (1,)))
    assert policy.alpha(0) == a
    # older outcomes weigh less than newer ones: after many rejections, alpha is near 0
    _evidence(policy, 0, 200, accepted=0)
    assert policy.alpha(0) < 0.05


def test_adaptive_probes_only_where_cheap() -> None:
    config = PolicyConfig(kind="adaptive", k=8, look_cost=0.0, probe_every=4, stop_after=10**6)
    cheap = Policy(config, cost_table(1, per_token=0.1))
    cheap.begin(0)
    _evidence(cheap, 0, 50, accepted=0)
    probe = Draft.chain(range(config.probe_k))
    missed, paid = Acceptance((), (1,)), Acceptance((0,), (0, 1))
    assert [cheap.budgets([8], 1).budgets[0] for _ in range(4)] == [0, 0, 0, config.probe_k]
    cheap.observe(0, probe, missed)  # found nothing: wait twice as long
    assert [cheap.budgets([8], 1).budgets[0] for _ in range(8)] == [0] * 7 + [config.probe_k]
    cheap.observe(0, probe, missed)
    assert [cheap.budgets([8], 1).budgets[0] for _ in range(16)] == [0] * 15 + [config.probe_k]
    cheap.observe(0, probe, paid)  # paid: back to the configured wait
    cheap.budgets([8], 1)
    assert cheap.probe_gap == config.probe_every
    never = Policy(config, cost_table(1, per_token=0.1))  # probes that never pay: up to PROBE_GAP_MAX
    never.begin(0)
    _evidence(never, 0, 50, accepted=0)
    probes = []
    for step in range(600):
        if never.budgets([8], 1).budgets[0] > 0:
            probes.append(step)
            never.observe(0, probe, missed)
    assert [b - a for a, b in zip(probes, probes[1:])][-3:] == [PROBE_GAP_MAX] * 3
    dear = Policy(config, cost_table(64, per_token=1.0))
    dear.begin(0)
    _evidence(dear, 0, 50, accepted=0)
    assert [dear.budgets([8], 64).budgets[0] for _ in range(8)] == [0] * 8


def test_a_costly_proposer_probes_with_fewer_tokens_or_not_at_all() -> None:
    """A probe's price includes the proposer's drafting: a draft model whose tokens cost 0.2 of
    a target step each probes with 2 tokens (1.02 + 0.4 <= 1.6 plain steps), not probe_k = 4;
    one whose tokens cost a whole step never probes."""
    config = PolicyConfig(kind="adaptive", k=8, look_cost=0.0, probe_every=2, stop_after=10**6)
    for per_token, probe in ((0.2, 2), (1.0, 0)):
        policy = Policy(config, cost_table(1, per_token=0.01))
        policy.begin(0)
        _evidence(policy, 0, 50, accepted=0)
        for depth in (2, 4, 6, 8):
            policy.observe_propose_time(depth, per_token * depth)  # seconds: a plain step costs 1
        assert [policy.budgets([8], 1).budgets[0] for _ in range(2)] == [0, probe]


def test_a_proposers_setup_time_is_paid_only_where_it_is_repaid() -> None:
    config = PolicyConfig(kind="adaptive", k=8, look_cost=0.0, probe_every=4, prior=0.8, stop_after=10**6)
    policy = Policy(config, cost_table(1, per_token=0.02))  # drafting pays well at alpha 0.8
    policy.begin(0)
    assert policy.budgets([8], 1, [64]).budgets == [8]
    assert policy.budgets([8], 1, [64], [5.0]).budgets == [8]  # 5 s of setup, 64 s of plain decoding left
    assert policy.budgets([8], 1, [64], [50.0]).budgets == [0]  # more than it saves
    assert policy.budgets([8], 1, [4], [5.0]).budgets == [0]  # too little left to repay it
    low = Policy(config, cost_table(1, per_token=0.1))  # a method that is never accepted
    low.begin(0)
    _evidence(low, 0, 50, accepted=0)
    assert [low.budgets([8], 1, [64], [0.1]).budgets[0] for _ in range(4)] == [0, 0, 0, config.probe_k]  # cheap probe
    low.observe(0, Draft.chain(range(config.probe_k)), Acceptance((), (1,)))
    # a setup is paid once it is at most PROBE_SETUP_SHARE of the plain steps since the last
    # probe: 1.0 s (a plain step costs 1 s) waits 50 steps, not the 8 between probes
    assert [low.budgets([8], 1, [64], [1.0]).budgets[0] for _ in range(40)] == [0] * 40
    assert PROBE_SETUP_SHARE * 40 < 1.0 <= PROBE_SETUP_SHARE * 52
    assert config.probe_k in [low.budgets([8], 1, [64], [1.0]).budgets[0] for _ in range(12)]
    # a probe asks an eighth of the rows (at least one): of two rows of 0.7 s, one, paid after
    # 35 steps; the rows a probe asks add up their setups (16 rows: 2 of 0.7 s, after 70 steps)
    for rows, wait in ((2, 35), (16, 70)):
        policy = Policy(config, cost_table(rows, per_token=0.1))
        for row in range(rows):
            policy.begin(row)
            _evidence(policy, row, 50, accepted=0)
        got = [policy.budgets([8] * rows, rows, [64] * rows, [0.7] * rows).budgets for _ in range(wait + 5)]
        first = next(i for i, b in enumerate(got) if any(b))
        assert wait - 1 <= first <= wait and max(got[first]) == config.probe_k
        assert sum(n > 0 for n in got[first]) == max(1, rows // 8)


def test_a_probe_asks_the_rows_with_the_least_setup_then_each_in_turn() -> None:
    """At 16 rows a probe asks two: those with the least catch-up first, and among equals the
    next ones in turn, so that every row is probed over time."""
    config = PolicyConfig(kind="adaptive", k=8, look_cost=0.0, probe_every=2, stop_after=10**6)
    policy = Policy(config, cost_table(16, per_token=0.01))
    for row in range(16):
        policy.begin(row)
        _evidence(policy, row, 50, accepted=0)
    setup = [0.0] * 16
    setup[5] = setup[9] = 0.5  # two rows with a long backlog
    asked = []
    for _ in range(40):
        plan = policy.budgets([8] * 16, 16, None, setup)
        if any(plan.budgets):
            asked.append([row for row, n in enumerate(plan.budgets) if n > 0])
            for row in asked[-1]:
                policy.observe(row, Draft.chain(range(config.probe_k)), Acceptance((), (1,)))
    assert asked and all(len(rows) == 2 and 5 not in rows and 9 not in rows for rows in asked)
    assert len({row for rows in asked for row in rows}) >= 6  # in turn, not the same two rows


def test_fixed_policy_returns_k_capped() -> None:
    policy = Policy(PolicyConfig(kind="fixed", k=4))
    assert policy.budgets([0, 2, 4, 9], 4).budgets == [0, 2, 4, 4]


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


# =========================================================================== the verify command


def test_verify_cli_reports_identical(tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": t}) for i, t in enumerate(TEXTS[:3])) + "\n")
    code = main(["verify", "--model", str(tiny_gguf), "--prompts", str(prompts), "--limit", "3",
                 "--max-new-tokens", "16"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "identical: 3/3" in out


@pytest.fixture(scope="module")
def other_tiny(tiny_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny model with other weights and the same tokenizer."""
    return load(write_hf_model(tmp_path_factory.mktemp("other") / "tiny-llama-seed1", "llama", seed=1))


def test_verify_reports_the_first_difference(tiny: Setup, other_tiny: LoadedModel) -> None:
    tiny = tiny.loaded
    assert other_tiny.tokenizer.encode("Hello there") == tiny.tokenizer.encode("Hello there")
    gen = GenerationConfig(max_new_tokens=12)
    plain = Engine(tiny.model, tiny.tokenizer)
    spec = Engine(other_tiny.model, tiny.tokenizer, NgramProposer(), Policy(PolicyConfig(kind="fixed", k=4)))
    report = VerifyReport()
    compare_prompt(Prompt("x", "mine", ("Hello there",)), plain, spec, gen, 200, report)
    assert report.prompts == 1 and report.turns == 1 and report.matched_turns == 0
    [m] = report.mismatches
    ids = tiny.tokenizer.encode_chat([{"role": "user", "content": "Hello there"}])
    ref = plain.generate([ids], gen)[0]
    got = spec.generate([ids], gen)[0]
    assert isinstance(m, Mismatch) and (m.prompt_id, m.workload, m.turn) == ("x", "mine", 0)
    assert m.token_index == first_difference(ref.tokens, got.tokens) >= 0
    assert m.char_index == first_difference(ref.text, got.text) >= 0
    assert (m.plain, m.speculative) == (ref.text, got.text)


def test_verify_cli_exits_1_on_a_mismatch(tiny_gguf: Path, other_tiny: LoadedModel, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    real_build = verify_module.build_engine

    def build(loaded, method="plain", **kw):  # the speculative engine runs on other weights
        if method != "plain":
            loaded = LoadedModel(other_tiny.model, loaded.tokenizer, loaded.source)
        return real_build(loaded, method, **kw)

    monkeypatch.setattr(verify_module, "build_engine", build)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "only", "prompt": "Hello there"}) + "\n")
    code = main(["verify", "--model", str(tiny_gguf), "--prompts", str(prompts), "--max-new-tokens", "12"])
    out = capsys.readouterr().out
    assert code == 1
    assert "identical: 0/1" in out and "MISMATCH only" in out and "first difference at token" in out


def test_verify_resumes_from_its_journal(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture) -> None:
    """With --out, finished prompts go to a journal; a rerun checks only the others, a torn
    last line is checked again, and a run under other conditions starts over."""
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    checked: list[str] = []
    real_compare = verify_module.compare_prompt

    def compare(prompt, *args, **kw):  # type: ignore[no-untyped-def]
        checked.append(prompt.id)
        return real_compare(prompt, *args, **kw)

    monkeypatch.setattr(verify_module, "compare_prompt", compare)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": t}) for i, t in enumerate(TEXTS[:4])) + "\n")
    out = tmp_path / "r" / "ngram.json"
    journal = tmp_path / "r" / "ngram.progress.jsonl"

    def run(limit: int, *extra: str) -> tuple[int, str]:
        code = main(["verify", "--model", str(tiny_gguf), "--prompts", str(prompts), "--limit", str(limit),
                     "--max-new-tokens", "12", "--out", str(out), *extra])
        return code, capsys.readouterr().out

    code, text = run(2)
    assert code == 0 and checked == ["p0", "p1"] and "identical: 2/2" in text
    first = json.loads(out.read_text())
    assert len(journal.read_text().splitlines()) == 3  # the header and two prompts
    code, text = run(3)
    assert code == 0 and checked == ["p0", "p1", "p2"] and "identical: 3/3" in text and "resumed: 2 prompts" in text
    again = json.loads(out.read_text())
    assert again["resumed_prompts"] == 2 and again["resumed_by_other_code"] == 0
    assert again["turns"] == first["turns"] + 1 and again["stats"]["steps"] > first["stats"]["steps"]
    journal.write_text(journal.read_text() + '{"key": "torn')  # a run killed while writing its line
    code, text = run(4)
    assert code == 0 and checked[3:] == ["p3"] and "identical: 4/4" in text
    lines = journal.read_text().splitlines()  # the torn line closed off, the next one whole
    assert len(lines) == 6 and lines[-2] == '{"key": "torn' and json.loads(lines[-1])["prompt"] == "p3"
    code, text = run(4, "--k", "3")
    assert code == 0 and checked[4:] == ["p0", "p1", "p2", "p3"] and "resumed" not in text


# =========================================================================== the real model


@pytest.mark.real_model
def test_ngram_greedy_equals_plain_on_the_default_model() -> None:
    try:
        path = default_model_path()
    except ModelFileError:
        pytest.skip("the default model is not installed")
    loaded = load(path, dtype="float32")
    questions = [
        "Repeat after me: the cat sat on the mat, the cat sat on the mat.",
        "List the numbers from one to ten.",
        "Write a Python function that adds two numbers.",
        "What is the capital of France?",
    ]
    prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    gen = GenerationConfig(max_new_tokens=32)
    plain = plain_engine(loaded).generate(prompts, gen)
    stats = SpecStats()
    spec = spec_engine(loaded, NgramProposer(), 6).generate(prompts, gen, stats=stats)
    for a, b in zip(plain, spec):
        assert (a.text, a.tokens, a.finish_reason) == (b.text, b.tokens, b.finish_reason)
    assert stats.accepted > 0


class _CatchingUp(NgramProposer):
    """An n-gram proposer that reports every proposal as spent catching up (``setup_spent``)."""

    def propose(self, seqs, budgets, cache):
        drafts = super().propose(seqs, budgets, cache)
        self.setup_spent = 1e6  # seconds: more than the whole call took
        return drafts


def test_time_spent_catching_up_is_not_charged_to_drafting(tiny: Setup) -> None:
    """A proposer's catch-up is priced as setup (``setup_seconds``): the engine leaves the time
    it reports in ``setup_spent`` out of what a draft budget is observed to cost."""
    costs = []
    for proposer in (NgramProposer(), _CatchingUp()):
        engine = Engine(tiny.loaded.model, tiny.loaded.tokenizer, proposer, Policy(PolicyConfig(kind="fixed", k=4)))
        engine.generate(tiny.prompts[:2], GEN)
        [(batch, cost)] = engine.policy.propose_costs.items()
        costs.append([t for _, t in cost.samples])
    plain, caught = costs
    assert plain and min(plain) > 0
    assert caught and max(caught) == 0.0


def test_propose_cost_fits_constant_and_per_level_costs() -> None:
    from specdraft.policy import ProposeCost

    lookup, model = ProposeCost(), ProposeCost()
    for depth in [1, 3, 5, 8, 2, 6] * 3:
        lookup.observe(depth, 0.002)  # a table lookup: the same whatever the depth
        model.observe(depth, 0.001 + 0.010 * depth)  # one draft forward per level
    assert lookup.estimate(8) == pytest.approx(0.002, abs=1e-9)
    assert model.estimate(4) == pytest.approx(0.041, rel=1e-6)
    assert model.estimate(0) == 0.0
    same = ProposeCost()
    for _ in range(6):
        same.observe(4, 0.04)  # no spread in depth yet: charged per level
    assert same.estimate(8) == pytest.approx(0.08)
    origin = ProposeCost()
    for budget, seconds in ((1, 0.001), (2, 0.002), (4, 0.010)):
        origin.observe(budget, seconds)
    assert origin.estimate(1) == pytest.approx(0.045 / 21)  # the fitted line would cross zero: through the origin


def test_proposing_cost_skips_the_first_step_and_scales_unmeasured_batch_sizes_by_rows() -> None:
    """The proposer's very first drafting step (one-time costs) is not counted, only that one;
    a batch size not measured yet is priced from the nearest measured ones, per row: a draining
    batch passes through each size once, and pricing 60 rows at a 10-row cost had the policy
    draft whole trees there (50 ms a step) to keep one token per row."""
    policy = Policy(PolicyConfig(kind="adaptive", k=8), cost_table(64, per_token=0.01))
    policy.observe_propose_time(2, 0.011, batch=1)  # the first ever: one-time costs
    policy.observe_propose_time(1, 0.003, batch=1)
    assert policy.proposing(1, 2) == pytest.approx(0.006)  # not 5.5 ms a node, from the slow first step
    policy.observe_propose_time(8, 0.008, batch=10)  # a new size's first step counts
    assert policy.proposing(10, 8) == pytest.approx(0.008)
    assert policy.proposing(60, 8) == pytest.approx(0.048)  # 6x the rows of the largest smaller size
    assert policy.proposing(5, 8) == pytest.approx(0.008)  # 5x one row's 24 ms, bounded by 10 rows' 8 ms
    policy.observe_propose_time(8, 0.030, batch=40)
    assert policy.proposing(60, 8) == pytest.approx(0.045)  # from 40 rows, now the nearest below
    assert policy.proposing(20, 8) == pytest.approx(0.016)  # from 10 rows (0.016 < 40 rows' 0.030)
    only_large = Policy(PolicyConfig(kind="adaptive", k=8), cost_table(64, per_token=0.01))
    only_large.observe_propose_time(8, 1.0, batch=32)  # (the first: not counted)
    assert only_large.proposing(8, 8) == 0.0  # nothing measured: taken as cheap
    only_large.observe_propose_time(8, 0.032, batch=32)
    assert only_large.proposing(8, 8) == pytest.approx(0.008)  # the larger size's time per row


def test_verify_reuses_cached_plain_outputs(tiny: Setup, tmp_path: Path) -> None:
    from specdraft.verify import ReferenceCache

    loaded = tiny.loaded
    gen = GenerationConfig(max_new_tokens=10)
    cache = ReferenceCache(tmp_path, {"model": "tiny"})
    spec = spec_engine(loaded, NgramProposer(), 4)
    first = VerifyReport()
    compare_prompt(Prompt("a", "mine", ("Hello there",)), plain_engine(loaded), spec, gen, 200, first, cache)

    class NoPlain:  # a second run must not decode plainly again
        tokenizer = loaded.tokenizer

        def generate(self, *args, **kwargs):
            raise AssertionError("plain decoding ran although its output was cached")

    again = ReferenceCache(tmp_path, {"model": "tiny"})  # re-read from disk
    with open(again.path, "a") as f:
        f.write('{"key": "torn')  # an interrupted write is skipped, not fatal
    second = VerifyReport()
    compare_prompt(Prompt("a", "mine", ("Hello there",)), NoPlain(), spec, gen, 200, second, ReferenceCache(tmp_path, {"model": "tiny"}))
    assert first.matched_turns == second.matched_turns == 1 and not second.mismatches
    other = ReferenceCache(tmp_path, {"model": "other"})
    assert other.path != again.path and not other.entries
    # a run started earlier sees what another run appended since (verify runs in parallel)
    early, late = ReferenceCache(tmp_path, {"model": "x"}), ReferenceCache(tmp_path, {"model": "x"})
    late.put([1, 2, 3], "abc", [7, 8])
    assert early.get([1, 2, 3]) == ("abc", [7, 8]) and early.get([4]) is None


def test_the_reference_cache_is_keyed_by_the_models_numerics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain outputs from before a change of a mode's numerics are not reused for it (version 1,
    the first, is left out of the key, so that caches from before versions existed stay valid
    while it is current)."""
    from specdraft.model.transformer import numerics_version
    from specdraft.verify import ReferenceCache, VerifyConfig

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    plain = ReferenceCache.for_run(VerifyConfig(), model, "cpu")
    invariant = ReferenceCache.for_run(VerifyConfig(dtype="bfloat16", batch_invariant=True), model, "cpu")
    assert plain.conditions.get("numerics", 1) == numerics_version(False)
    assert invariant.conditions["numerics"] == numerics_version(True) > 1
    assert plain.path != invariant.path


def test_acceptance_by_position_keeps_positions_never_accepted() -> None:
    stats = SpecStats()
    stats.record(Draft.chain([5, 6, 7]), Acceptance((0,), (5, 9)), 2)
    stats.record(Draft.chain([5, 6]), Acceptance((), (4,)), 1)
    assert stats.acceptance_by_position == [0.5, 0.0, 0.0]
    never = SpecStats()
    never.record(Draft.chain([1, 2]), Acceptance((), (3,)), 1)
    assert never.acceptance_by_position == [0.0, 0.0] and "by position [0.00, 0.00]" in never.summary()


def test_draft_up_to_depth_keeps_parents_and_p_draft() -> None:
    d = Draft((5, 6, 7, 8, 9), (-1, 0, -1, 1, 2), torch.eye(5), label="n3")
    cut = d.up_to_depth(2)
    assert cut.tokens == (5, 6, 7, 9) and cut.parents == (-1, 0, -1, 2) and cut.label == "n3"
    assert torch.equal(cut.p_draft, torch.eye(5)[[0, 1, 2, 4]])
    assert len(d.up_to_depth(0)) == 0 and d.up_to_depth(3) is d


def test_policy_trims_drafts_whose_label_rarely_pays() -> None:
    policy = Policy(PolicyConfig(kind="adaptive", k=8), cost_table(1, per_token=0.1))
    policy.begin(0)
    weak, strong = Draft.chain(range(8), label="n2"), Draft.chain(range(8), label="n4")
    assert policy.trim_labels([weak, strong], 1) == [weak, strong]  # no evidence yet: untouched
    for _ in range(20):
        policy.observe(0, weak, Acceptance((), (1,)))  # 2-token matches are always wrong
        policy.observe(0, strong, Acceptance(tuple(range(8)), tuple(range(9))))  # 4-token ones right
    assert policy.label_alpha("n2") < 0.1 and policy.label_alpha("n4") > 0.9
    cut_weak, cut_strong = policy.trim_labels([weak, strong], 1)
    assert len(cut_weak) == 0 and cut_strong == strong
    assert policy.trim([weak, strong], Plan([8, 8], 1)) == [cut_weak, cut_strong]  # the batch cut keeps what pays
    assert policy.label_alpha("n9") is None
    fixed = Policy(PolicyConfig(kind="fixed", k=8))
    fixed.observe(0, weak, Acceptance((), (1,)))
    assert fixed.trim([weak], Plan([8], 1)) == [weak]  # the fixed policy drafts what it is given


def test_policy_prices_each_rows_draft_in_the_packed_forward() -> None:
    """The verification forward is packed: a row pays for its own nodes, not for the widest
    row's. One 8-token draft in a batch of eight is priced as one more token per row, an eighth
    of the same draft in every row; so a lone row whose drafts are good keeps its draft, one
    whose drafts fail has it cut; every row drafting is cut to a depth that pays; a probe step
    keeps its drafts; fixed keeps everything."""
    batch = 8
    cost = CostModel(table={batch: {q: 1.0 + 0.2 * (q - 1) for q in range(1, 10)}})  # 20% per token and row
    policy = Policy(PolicyConfig(kind="adaptive", k=8), cost)
    for row in range(batch):
        policy.begin(row)
        for _ in range(10):  # alpha ~0.8 for every row
            policy.observe(row, Draft.chain(range(5)), Acceptance(tuple(range(4)), tuple(range(5))))
    assert 0.75 < policy.alpha(0) < 0.85
    assert policy.verifying(batch, [8] + [0] * (batch - 1)) == pytest.approx(1.2)  # = cost.latency(batch, 2, ...)
    assert policy.verifying(batch, [8] * batch) == pytest.approx(2.6)
    lone = [Draft.chain(range(8))] + [Draft.empty()] * (batch - 1)
    plan = Plan([8] * batch, batch)
    assert policy.batch_depth(lone, batch) >= 3
    assert policy.trim(lone, plan)[0] == lone[0].up_to_depth(policy.batch_depth(lone, batch))
    full = [Draft.chain(range(8))] * batch
    depth = policy.batch_depth(full, batch)
    assert 3 <= depth < 8 and policy.trim(full, plan) == [d.up_to_depth(depth) for d in full]
    assert policy.batch_depth(lone, batch) > depth  # alone, the row's deeper nodes are cheap enough
    failing = Policy(PolicyConfig(kind="adaptive", k=8), cost)
    for row in range(batch):
        failing.begin(row)
        for _ in range(10):  # row 0's drafts are all rejected
            failing.observe(row, Draft.chain(range(5)), Acceptance((), (1,)) if row == 0
                            else Acceptance(tuple(range(4)), tuple(range(5))))
    assert failing.batch_depth(lone, batch) == 0 and all(len(d) == 0 for d in failing.trim(lone, plan))
    assert policy.trim(lone, Plan([8] * batch, batch, "probe")) == lone
    assert Policy(PolicyConfig(kind="fixed", k=8)).trim(lone, plan) == lone
    # attention keeps the padded width: measured with lone_rows rows drafting, it is priced on top
    alone = policy.batch_depth(lone, batch)
    r = lone_rows(batch)  # 3 of 8: enough that the measured forward's attention is not split
    cost.lone[batch] = {q: 1.0 + 0.2 * r * (q - 1) / batch + 0.004 * (batch - r) * (q - 1) for q in range(1, 10)}
    assert cost.slot(batch, 8) == pytest.approx(0.004)  # per padding slot
    assert policy.verifying(batch, [8] + [0] * (batch - 1)) == pytest.approx(1.2 + 0.004 * 56)  # 56 slots
    assert policy.verifying(batch, [8] * batch) == pytest.approx(2.6)  # no padding: every row drafts 8
    assert policy.verifying(batch, [8] * 4 + [0] * 4) == pytest.approx(1.8 + 0.004 * 32)  # 32 slots
    assert 0 < policy.batch_depth(lone, batch) < alone  # the padding makes the lone row's deep nodes dear




def test_speculation_must_beat_plain_by_the_margin() -> None:
    """A draft expected to gain 3% over plain decoding is not worth the estimates' error: with
    the default margin (5%) the budget and the batch depth stay plain; with no margin, or a
    draft that gains 20%, it speculates."""
    batch = 16

    def policy_for(gain: float, margin: float) -> Policy:
        policy = Policy(PolicyConfig(kind="adaptive", k=8, margin=margin, objective="throughput"), CostModel())
        for row in range(batch):
            policy.begin(row)
            for _ in range(40):  # 3 of 4 single-token drafts accepted
                for ok in (True, True, True, False):
                    policy.observe(row, Draft.chain([1]), Acceptance((1,) if ok else (), (1,)))
        alpha = policy.alpha(0)
        per_token = (1 + alpha) / gain - 1  # a 1-token draft (1 + alpha tokens) gains `gain`
        policy.cost = CostModel(table={batch: {q: 1.0 + per_token * (q - 1) for q in range(1, 10)}})
        return policy

    drafts = [Draft.chain([5])] * batch
    for gain, margin, speculates in ((1.03, 0.05, False), (1.03, 0.0, True), (1.2, 0.05, True)):
        policy = policy_for(gain, margin)
        assert (policy.best_length([8] * batch, batch) > 0) == speculates, (gain, margin)
        assert (policy.batch_depth(drafts, batch) > 0) == speculates, (gain, margin)
    with pytest.raises(SpecdraftError, match="margin"):
        PolicyConfig(margin=1.5)


def test_drafts_that_yield_less_than_expected_are_expected_less() -> None:
    """The policy compares what each kept draft was expected to add with what was accepted
    (``Realism``): drafts that keep yielding half their expectation are then priced at half,
    and a batch where they paid on paper stops speculating; drafts that beat it raise the
    expectation, by at most ``REALISM_MAX``."""
    batch = 16
    policy = Policy(PolicyConfig(kind="adaptive", k=8, objective="throughput", look_cost=0.0),
                    cost_table(batch, per_token=0.5))
    for row in range(batch):
        policy.begin(row)
        _evidence(policy, row, 20, accepted=8)  # alpha ~0.95: every row's drafts look good
    drafts = [Draft.chain([5])] * batch  # one token each: expected 1.95 tokens for 1.5 the cost
    assert policy.realism.factor == 1.0 and policy.batch_depth(drafts, batch) == 1
    for _ in range(30):  # kept drafts, of which only every other row's token is accepted
        kept = policy.trim(drafts, Plan([1] * batch, batch))
        assert set(policy.expected_extra) == {row for row, d in enumerate(kept) if len(d)}
        for row, d in enumerate(kept):
            if len(d):
                policy.observe(row, d, Acceptance((0,) if row % 2 else (), (5,) if row % 2 else (1,)))
        if not any(len(d) for d in kept):
            break
    assert policy.realism.factor < 0.75 and policy.batch_depth(drafts, batch) == 0
    policy.realism = Realism()  # the rows' alphas alone would still draft: the realism decided
    assert policy.batch_depth(drafts, batch) == 1
    r = Realism()
    for _ in range(50):
        r.observe(expected=1.0, accepted=3)
    assert r.factor == REALISM_MAX and r.scale(3.0) == 1.0 + REALISM_MAX * 2.0


def test_a_probe_pays_only_if_its_accepted_tokens_repay_its_wider_forward() -> None:
    """At batch 16 a probe asks two rows, 4 tokens each: its forward costs 1.25 plain steps (16
    rows of 1.5 tokens at 0.5 per token), so it must gain 16 x 0.25 = 4 tokens. One accepted
    token does not repay it (the next probe waits twice as long); 2 in each row do (the wait
    resets)."""
    batch = 16
    policy = Policy(PolicyConfig(kind="adaptive", k=8, probe_every=4, look_cost=0.0), cost_table(batch, per_token=0.5))
    for row in range(batch):
        policy.begin(row)
        _evidence(policy, row, 30, accepted=1, depth=4)  # alpha 0.5: speculation is off, only probes draft

    def probe(accepted: int) -> int:
        """Step until the next probe, verify it with ``accepted`` tokens in each row it asked (up
        to that row's draft); the gap after."""
        for _ in range(PROBE_GAP_MAX + 1):
            plan = policy.budgets([4] * batch, batch)
            if any(plan.budgets):
                break
            policy.trim([Draft.empty()] * batch, plan)
        asked = [row for row, n in enumerate(plan.budgets) if n > 0]
        assert plan.mode == "probe" and len(asked) == 2 and all(plan.budgets[row] == 4 for row in asked)
        kept = policy.trim([Draft.chain(range(7, 7 + n)) if n else Draft.empty() for n in plan.budgets], plan)
        for i, row in enumerate(asked):
            a = accepted if i == 0 or accepted > 1 else 0
            policy.observe(row, kept[row], Acceptance(tuple(range(a)), tuple(range(7, 7 + a)) + (1,)))
        policy.budgets([0] * batch, batch)  # settles the probe
        return policy.probe_gap

    assert policy.probe_gap == 4
    assert probe(1) == 8 and probe(1) == 16  # accepted, but not repaid
    assert probe(2) == 4  # 4 tokens for a quarter of a step's more cost: repaid


def test_static_batch_policy_follows_its_slowest_row() -> None:
    """In a static batch the slowest row sets the end: with one row that never accepts and as
    much left to do as the others, speculating only adds cost (0 drafts, and every draft cut);
    once that row is nearly done, the other rows' drafts pay again. Without remaining counts
    (throughput) the seven good rows pay for the width."""
    batch = 8
    cost = CostModel(table={batch: {q: 1.0 + 0.1 * (q - 1) for q in range(1, 10)}})  # width costs 10%/token
    policy = Policy(PolicyConfig(kind="adaptive", k=8), cost)
    for row in range(batch):
        policy.begin(row)
        for _ in range(10):
            if row == 0:  # row 0: every draft rejected
                policy.observe(row, Draft.chain(range(5)), Acceptance((), (1,)))
            else:  # the others: alpha ~0.8
                policy.observe(row, Draft.chain(range(5)), Acceptance(tuple(range(4)), tuple(range(5))))
    assert policy.alpha(0) < 0.1 < 0.75 < policy.alpha(1)
    caps = [8] * batch
    assert policy.best_length(caps, batch) >= 3  # throughput
    assert policy.best_length(caps, batch, remaining=[40] * batch) == 0
    assert policy.best_length(caps, batch, remaining=[2] + [40] * (batch - 1)) >= 3
    drafts = [Draft.chain(range(8))] * batch
    assert policy.batch_depth(drafts, batch) >= 3
    assert policy.batch_depth(drafts, batch, remaining=[40] * batch) == 0
    assert policy.batch_depth(drafts, batch, remaining=[2] + [40] * (batch - 1)) >= 3
    # a finished row is not the slowest one
    live = [False] + [True] * (batch - 1)
    assert policy.batch_depth(drafts, batch, live, remaining=[0] + [40] * (batch - 1)) >= 3
    assert policy.trim(drafts, Plan([8] * batch, batch, remaining=[40] * batch), [True] * batch) == [Draft.empty()] * batch
    throughput = Policy(PolicyConfig(kind="adaptive", k=8, objective="throughput"), cost)
    throughput.evidence, throughput.by_label = policy.evidence, policy.by_label
    assert throughput.budgets(caps, batch, [40] * batch).budgets[1] >= 3  # remaining counts ignored
    assert throughput.trim(drafts, Plan([8] * batch, batch, remaining=[40] * batch), [True] * batch)[1] == drafts[1].up_to_depth(
        throughput.batch_depth(drafts, batch))


def test_new_requests_start_from_the_pooled_alpha_of_earlier_ones() -> None:
    """The first requests start at the configured prior; once earlier requests' drafts were
    (almost) all rejected, a new request starts pessimistic and does not draft at once, and
    once they were accepted, optimistic."""
    cost = cost_table(1, per_token=0.3)
    policy = Policy(PolicyConfig(kind="adaptive", k=8, look_cost=0.0, prior=0.5, probe_every=100), cost)
    policy.begin(0)
    assert policy.alpha(0) == 0.5 and policy.budgets([8], 1).budgets[0] > 0
    for _ in range(12):
        policy.observe(0, Draft.chain(range(4)), Acceptance((), (1,)))
    policy.end(0)
    policy.begin(1)
    assert policy.alpha(1) == pytest.approx(policy.pooled_alpha()) and policy.alpha(1) < 0.1
    assert policy.budgets([0, 8], 1).budgets == [0, 0]
    for _ in range(40):
        policy.observe(1, Draft.chain(range(4)), Acceptance(tuple(range(4)), tuple(range(5))))
    policy.end(1)
    policy.begin(2)
    assert policy.alpha(2) > 0.75 and policy.budgets([0, 0, 8], 1).budgets[2] >= 4
    assert Policy(PolicyConfig(kind="adaptive", k=8, prior=0.3), cost).pooled_alpha() == 0.3


def test_progress_is_throughput_or_the_slowest_rows_share() -> None:
    assert progress([1.0, 3.0], None) == 4.0
    assert progress([1.0, 3.0], [10, 10]) == pytest.approx(0.1)
    assert progress([1.0, 3.0], [1, 30]) == pytest.approx(0.1)
    assert progress([], [1]) == 0.0


def test_ngram_labels_drafts_with_the_match_length() -> None:
    tokens = [1, 2, 3, 9, 2, 3, 4, 1, 2, 3]
    assert propose(NgramProposer(CLASSIC), tokens, 2).label == "n3"
    assert propose(NgramProposer(CLASSIC), [7, 3, 5, 1, 3, 5], 2).label == "n2"


def test_interrupted_verify_reports_the_prompts_it_finished(tiny_gguf: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture) -> None:
    real = verify_module.compare_prompt
    calls = []

    def compare(prompt, *args):  # the third prompt is stopped half-way, as by Ctrl-C or SIGTERM
        calls.append(prompt.id)
        if len(calls) == 3:
            args[-2].prompts += 1  # the partial prompt's count must be rolled back
            raise KeyboardInterrupt
        return real(prompt, *args)

    monkeypatch.setattr(verify_module, "compare_prompt", compare)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": t}) for i, t in enumerate(TEXTS)) + "\n")
    out_json = tmp_path / "v.json"
    code = main(["verify", "--model", str(tiny_gguf), "--prompts", str(prompts), "--max-new-tokens", "8",
                 "--out", str(out_json)])
    out = capsys.readouterr().out
    assert code == 130
    assert "identical: 2/2 prompts" in out and "INTERRUPTED: 2 of 5 prompts checked" in out
    saved = json.loads(out_json.read_text())
    assert saved["interrupted"] and saved["prompts"] == 2 and saved["planned_prompts"] == 5


# =========================================================================== the context's end


@pytest.fixture(scope="module")
def ctx256(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny model whose context is 256 positions."""
    return load(write_hf_model(tmp_path_factory.mktemp("ctx256") / "m", "llama", seed=0, max_position=256))


def _every_method(loaded: LoadedModel, tmp_path: Path) -> list[tuple[str, dict[str, str]]]:
    from specdraft.datastore import Datastore, DatastoreInfo, save, tokenizer_fingerprint

    info = DatastoreInfo(fingerprint=tokenizer_fingerprint(loaded.tokenizer), tokens=0, documents=0, description="test")
    store = save(Datastore.from_documents([loaded.tokenizer.encode(t) for t in TEXTS], info), tmp_path / "s.sdds")
    return [("ngram", {}), ("ngram", {"branches": "2"}), ("suffix", {}), ("lookahead", {}), ("layer-skip", {"layers": "1"}),
            ("draft", {"path": str(loaded.source)}), ("draft", {"path": str(loaded.source), "branches": "2"}),
            ("rest", {"datastore": str(store)})]


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_a_row_that_reaches_the_context_beside_one_still_drafting(ctx256: LoadedModel, tmp_path: Path,
                                                                  policy: str) -> None:
    """One row fills the context and finishes while the other keeps drafting: the finished row
    must not be handed the next verification's positions (every method used to overflow)."""
    from specdraft.api import build_engine

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (230, 10)]
    gen = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    ref = plain_engine(ctx256).generate(prompts, gen)
    assert [r.finish_reason for r in ref] == ["context", "length"]
    cost = cost_table(2) if policy == "adaptive" else None
    for method, options in _every_method(ctx256, tmp_path):
        got = build_engine(ctx256, method, k=8, policy=policy, options=options, cost=cost).generate(prompts, gen)
        assert [(r.tokens, r.finish_reason) for r in got] == [(r.tokens, r.finish_reason) for r in ref], (method, options)


def test_the_adaptive_policy_measures_costs_within_a_short_context(tmp_path: Path) -> None:
    """A model whose context is shorter than the cost model's usual 128-token prefix + k."""
    from specdraft.api import build_engine

    short = load(write_hf_model(tmp_path / "short", "llama", seed=0, max_position=132))
    prompt = short.tokenizer.encode(TEXTS[0])
    gen = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    ref = plain_engine(short).generate([prompt], gen)[0].tokens
    for method in ("ngram", "suffix"):
        engine = build_engine(short, method, k=8, policy="adaptive")
        assert engine.generate([prompt], gen)[0].tokens == ref
        table = engine.policy.cost.table[1]  # measured, not given
        assert max(table) == 9 and all(t > 0 for t in table.values())


def test_random_batches_near_the_context_end_equal_plain(ctx256: LoadedModel, tmp_path: Path) -> None:
    """Seeded random ragged batches whose rows reach the context at different steps, every
    method, fixed k: the same tokens and finish reasons as plain decoding."""
    from specdraft.api import build_engine

    rng = torch.Generator().manual_seed(7)
    methods = _every_method(ctx256, tmp_path)
    for case in range(24):
        sizes = torch.randint(200, 254, (int(torch.randint(2, 4, (), generator=rng)),), generator=rng).tolist()
        sizes[-1] = int(torch.randint(3, 40, (), generator=rng))  # one short row keeps drafting
        prompts = [torch.randint(3, 300, (n,), generator=rng).tolist() for n in sizes]
        gen = GenerationConfig(max_new_tokens=int(torch.randint(3, 60, (), generator=rng)), ignore_eos=True)
        k = int(torch.randint(1, 9, (), generator=rng))
        method, options = methods[case % len(methods)]
        ref = plain_engine(ctx256).generate(prompts, gen)
        got = build_engine(ctx256, method, k=k, policy="fixed", options=options).generate(prompts, gen)
        assert [(r.tokens, r.finish_reason) for r in got] == [(r.tokens, r.finish_reason) for r in ref], \
            (case, method, options, sizes, gen.max_new_tokens, k)
