"""The draft-model proposer on tiny random models: greedy equivalence with plain decoding on
ragged batches (fixed and adaptive policies, chains and first-level trees, greedy rows beside
sampled rows), acceptance with the target as its own draft and with an unrelated draft, the
lossless property at temperature 1 through the whole engine (and mixed-up p_draft rows, which
the same check rejects), refused drafts (other vocabulary, wider logits, no path), a
short-context draft, a GGUF draft and a bfloat16 draft."""

from __future__ import annotations

import copy
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from specdraft.draft import Draft
from specdraft.engine import Engine
from specdraft.errors import SpecdraftError, VocabularyMismatchError
from specdraft.metrics import SpecStats
from specdraft.model.kv_cache import KVCache
from specdraft.model.loader import LoadedModel, load
from specdraft.policy import CostModel, Policy, PolicyConfig
from specdraft.proposers import make_proposer
from specdraft.proposers.base import Proposer, ProposerContext
from specdraft.proposers.draft_model import DraftModelConfig, DraftModelProposer
from specdraft.sampling import Sampling
from specdraft.sequence import GenerationConfig, Sequence
from test_accept import _engine_lossless_check, check_siblings_lossless, sampled_setup, sibling_setup  # noqa: F401  (fixtures)
from tiny_models import write_gguf_model, write_hf_model

GEN = GenerationConfig(max_new_tokens=24, ignore_eos=True)


@dataclass(frozen=True)
class Setup:
    target: LoadedModel
    prompts: list[list[int]]  # ragged
    refs: list[list[int]]  # plain greedy outputs


@pytest.fixture(scope="module")
def setup(tiny_hf: Path) -> Setup:
    target = load(tiny_hf)
    g = torch.Generator().manual_seed(3)
    prompts = [target.tokenizer.encode("a b a b a b"), *(torch.randint(3, 320, (n,), generator=g).tolist()
                                                        for n in (2, 19, 41))]
    refs = [r.tokens for r in Engine(target.model, target.tokenizer).generate(prompts, GEN)]
    return Setup(target, prompts, refs)


@pytest.fixture(scope="module")
def unrelated_hf(tiny_hf: Path) -> Path:
    """Another random model with the same tokenizer (different seed, 3 layers)."""
    return write_hf_model(tiny_hf.parent / "unrelated", seed=1, layers=3)


def context(target: LoadedModel, k: int = 4) -> ProposerContext:
    return ProposerContext(target.model, target.tokenizer, max_draft=k)


def engine(target: LoadedModel, proposer: Proposer, k: int = 4, policy: str = "fixed", batch: int = 4) -> Engine:
    cost = CostModel(table={batch: {q: 1.0 + 0.001 * (q - 1) for q in range(1, k + 2)}}) if policy == "adaptive" else None
    config = PolicyConfig(kind=policy, k=k, objective="throughput")  # drafts for every row that finds one
    return Engine(target.model, target.tokenizer, proposer, Policy(config, cost))


def run(setup: Setup, proposer: Proposer, **kw: object) -> SpecStats:
    """Generate the setup's prompts with ``proposer``; check the output equals plain decoding."""
    stats = SpecStats()
    results = engine(setup.target, proposer, **kw).generate(setup.prompts, GEN, stats=stats)  # type: ignore[arg-type]
    for row, (r, ref) in enumerate(zip(results, setup.refs)):
        assert r.tokens == ref, f"row {row} differs from plain decoding"
    return stats


# =========================================================================== greedy


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("branches", [1, 3], ids=["chain", "tree"])
def test_self_draft_greedy_equals_plain(setup: Setup, tiny_hf: Path, policy: str, branches: int) -> None:
    proposer = make_proposer("draft", {"path": str(tiny_hf), "branches": str(branches)}, context(setup.target))
    stats = run(setup, proposer, policy=policy)
    assert stats.acceptance_rate >= (0.95 if branches == 1 else 0.95 / branches)  # the target as its own draft
    assert stats.tau > 0.8 * (4 - branches + 2)  # a chain of 4 - branches + 1 tokens, and the bonus
    assert proposer.memory_bytes() > 0


@pytest.mark.parametrize("k", [1, 5])
def test_unrelated_draft_greedy_equals_plain_and_accepts_little(setup: Setup, unrelated_hf: Path, k: int) -> None:
    proposer = make_proposer("draft", {"path": str(unrelated_hf)}, context(setup.target, k))
    stats = run(setup, proposer, k=k)
    assert stats.proposed > 50
    assert stats.acceptance_rate < 0.1


def test_greedy_rows_beside_sampled_rows_equal_plain(setup: Setup, tiny_hf: Path) -> None:
    samplings = [Sampling(), Sampling(temperature=1.0, seed=1), Sampling(), Sampling(temperature=0.7, top_k=5, seed=2)]
    proposer = make_proposer("draft", {"path": str(tiny_hf), "branches": "2"}, context(setup.target))
    results = engine(setup.target, proposer).generate(setup.prompts, GEN, samplings)
    for row in (0, 2):
        assert results[row].tokens == setup.refs[row]
    assert all(len(r.tokens) == GEN.max_new_tokens for r in results)


def test_gguf_and_bfloat16_drafts(setup: Setup, tiny_gguf: Path) -> None:
    gguf = make_proposer("draft", {"path": str(tiny_gguf)}, context(setup.target))
    assert run(setup, gguf).acceptance_rate >= 0.95
    bf16 = make_proposer("draft", {"path": str(tiny_gguf), "dtype": "bfloat16"}, context(setup.target))
    assert run(setup, bf16).acceptance_rate > 0.5


def test_short_context_draft_stops_drafting_without_error(setup: Setup, tiny_hf: Path) -> None:
    short = write_hf_model(tiny_hf.parent / "short-context", seed=0, max_position=48)
    stats = run(setup, make_proposer("draft", {"path": str(short)}, context(setup.target)))
    assert stats.accepted > 0  # the short prompts still draft


# =========================================================================== state


class Recorder:
    """Wraps a draft-model proposer and checks its cache after every observe: a row holds its
    context before the step's root, the root, and the accepted chain nodes it had fed."""

    name = "recorder"

    def __init__(self, inner: DraftModelProposer) -> None:
        self.inner = inner
        self.seqs: dict[int, Sequence] = {}
        self.checked = 0

    def begin(self, row: int, seq: Sequence) -> None:
        self.seqs[row] = seq
        self.inner.begin(row, seq)

    def end(self, row: int) -> None:
        self.inner.end(row)

    def memory_bytes(self) -> int:
        return self.inner.memory_bytes()

    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache: KVCache) -> list[Draft]:
        return self.inner.propose(seqs, budgets, cache)

    def observe(self, row, draft, acceptance, verified) -> None:  # type: ignore[no-untyped-def]
        drafted = row in self.inner.pending
        self.inner.observe(row, draft, acceptance, verified)
        assert self.inner.cache is not None
        n = self.inner.cache.lengths[row]
        tokens = self.seqs[row].tokens
        assert n <= len(tokens) - 1  # the newest token (the next root) is never in the cache yet
        if drafted and len(draft) and not self.seqs[row].finished:  # context + accepted chain nodes fed
            assert n == len(tokens) - len(acceptance.tokens) + min(acceptance.accepted, len(draft) - 1)
            self.checked += 1


def test_draft_cache_rolls_back_to_the_accepted_prefix(setup: Setup, tiny_hf: Path, unrelated_hf: Path) -> None:
    for path in (tiny_hf, unrelated_hf):
        rec = Recorder(make_proposer("draft", {"path": str(path)}, context(setup.target)))  # type: ignore[arg-type]
        run(setup, rec)
        assert rec.checked > 10


def test_fresh_rows_caught_up_in_groups_draft_as_one_padded_batch(setup: Setup, tiny_hf: Path) -> None:
    """Fresh rows of very different lengths are caught up in groups in caches of their own:
    the drafts (and so the counts) are those of one padded batch, and the target as its own
    draft is still accepted throughout (a row copied into the wrong place would not be)."""
    lengths = sorted(len(p) for p in setup.prompts)
    assert lengths[-1] > 4 * lengths[0]  # the setup's prompts are ragged enough to be split
    draft = load(tiny_hf).model
    vocab = setup.target.model.config.vocab_size
    stats = []
    for budget in (10_000, lengths[-1]):  # one group; then the longest prompt alone
        proposer = DraftModelProposer(draft, vocab, max_draft=4, group_tokens=budget)
        stats.append(run(setup, proposer))
    assert stats[1].proposed == stats[0].proposed and stats[1].accepted == stats[0].accepted
    assert stats[1].acceptance_rate >= 0.95


def test_setup_seconds_price_a_long_backlog_only(setup: Setup, tiny_hf: Path) -> None:
    draft = load(tiny_hf).model
    proposer = DraftModelProposer(draft, setup.target.model.config.vocab_size, max_draft=4)
    long_seq, short_seq = (Sequence(prompt=list(range(3, 3 + n)), config=GEN, tokenizer=setup.target.tokenizer,
                                    capacity=n + 30) for n in (150, 20))
    for row, seq in enumerate((long_seq, short_seq)):
        proposer.begin(row, seq)
    assert proposer.setup_seconds([None, short_seq]) == [0.0, 0.0]  # nothing to price: no measurement
    assert proposer.seconds_per_token is None
    long_cost, short_cost = proposer.setup_seconds([long_seq, short_seq])
    assert long_cost > 0 and short_cost == 0.0  # calibrated on two small forwards
    assert long_cost == pytest.approx(149 * proposer.seconds_per_token)  # the root is fed with the draft
    proposer.propose([long_seq, short_seq], [2, 2], setup.target.model.new_cache(2, 200))  # catches up, measured
    assert proposer.setup_seconds([long_seq, short_seq]) == [0.0, 0.0]
    proposer.end(0)
    proposer.begin(0, long_seq)  # a new request in row 0: its whole prompt is backlog again
    assert proposer.setup_seconds([long_seq, None])[0] == pytest.approx(149 * proposer.seconds_per_token)
    limit = draft.config.max_context  # a row past the draft's context is never drafted for: no setup
    beyond = Sequence(prompt=[5] * limit, config=GEN, tokenizer=setup.target.tokenizer, capacity=limit + 30)
    proposer.begin(1, beyond)
    assert proposer.setup_seconds([long_seq, beyond])[1] == 0.0


class Priced:
    """A proposer that reports a fixed setup time per row and records the budgets it gets."""

    def __init__(self, inner: Proposer, seconds: float) -> None:
        self.inner, self.seconds, self.name = inner, seconds, "priced"
        self.budgets: list[int] = []

    def setup_seconds(self, seqs: Seq[Sequence | None]) -> list[float]:
        return [self.seconds if s is not None else 0.0 for s in seqs]

    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache: KVCache) -> list[Draft]:
        self.budgets += budgets
        return self.inner.propose(seqs, budgets, cache)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_the_engine_passes_setup_times_to_the_policy(setup: Setup, tiny_hf: Path) -> None:
    """With a setup time longer than plain decoding of the whole request, the adaptive policy
    never drafts (nor probes); without one it drafts from the first step."""
    for seconds, drafted in ((0.0, True), (1e6, False)):
        priced = Priced(make_proposer("draft", {"path": str(tiny_hf)}, context(setup.target)), seconds)
        stats = run(setup, priced, policy="adaptive")  # type: ignore[arg-type]
        assert (stats.proposed > 0) == drafted and any(b > 0 for b in priced.budgets) == drafted


# =========================================================================== refused drafts


def test_empty_path_is_refused_with_one_line(setup: Setup) -> None:
    with pytest.raises(SpecdraftError, match=r"--opt path=") as err:
        make_proposer("draft", {}, context(setup.target))
    assert "\n" not in str(err.value)


def test_other_vocabulary_is_refused_with_one_line(setup: Setup, tiny_hf: Path) -> None:
    other = write_hf_model(tiny_hf.parent / "other-vocab", seed=0, vocab_size=300)
    with pytest.raises(VocabularyMismatchError, match="vocabulary") as err:
        make_proposer("draft", {"path": str(other)}, context(setup.target))
    assert "\n" not in str(err.value)


def test_wider_draft_logits_and_bad_options_are_refused(setup: Setup) -> None:
    with pytest.raises(VocabularyMismatchError, match="logits"):
        DraftModelProposer(setup.target.model, vocab=300)
    with pytest.raises(SpecdraftError, match="needs the target"):
        make_proposer("draft", {"path": "x.gguf"}, None)
    with pytest.raises(SpecdraftError, match="not found"):
        make_proposer("draft", {"path": "/nonexistent/draft.gguf"}, context(setup.target))
    with pytest.raises(SpecdraftError, match="dtype"):
        DraftModelConfig(path="x", dtype="int8")
    with pytest.raises(SpecdraftError, match="branches"):
        DraftModelConfig(path="x", branches=0)


# =========================================================================== lossless sampling


def close_draft(target: torch.nn.Module) -> torch.nn.Module:
    """A different model of the same vocabulary, close enough to the test target that its
    drafts are often accepted: other attention and LM-head scales (p_draft != p_target)."""
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for layer in draft.layers:
            layer.wo.weight.mul_(1.5)
        draft.lm_head.weight.mul_(0.8)
    return draft


class MixedUpRows:
    """A wrong proposer (a batching bug): each sampled draft carries the p_draft of the next
    row's draft of the same size instead of its own.

    (Claiming sampled tokens were deterministic, p_draft None, would *not* be wrong: whatever
    token a one-hot p_draft names, the verifier emits it with probability p_target(token) and
    otherwise samples p_target without it, so the output follows p_target for every token the
    draft chose from the context.)"""

    name = "mixed-up-rows"

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner

    def begin(self, row: int, seq: Sequence) -> None:
        self.inner.begin(row, seq)

    def end(self, row: int) -> None:
        self.inner.end(row)

    def memory_bytes(self) -> int:
        return 0

    def observe(self, row, draft, acceptance, verified) -> None:  # type: ignore[no-untyped-def]
        self.inner.observe(row, draft, acceptance, verified)

    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache: KVCache) -> list[Draft]:
        drafts = self.inner.propose(seqs, budgets, cache)
        sampled = [i for i, d in enumerate(drafts) if d.p_draft is not None]
        out = list(drafts)
        for i, j in zip(sampled, sampled[1:] + sampled[:1]):
            if len(drafts[i]) == len(drafts[j]):
                out[i] = Draft(drafts[i].tokens, drafts[i].parents, drafts[j].p_draft)
        return out


def test_engine_sampling_is_lossless(sampled_setup) -> None:  # noqa: F811
    draft = close_draft(sampled_setup[0])
    first, joint, triple, stats = _engine_lossless_check(
        sampled_setup, proposer=lambda model, tokenizer: DraftModelProposer(draft, model.config.vocab_size, 1, 4))
    assert 0.3 < stats.acceptance_rate < 0.95, "the draft should be close to the target, not equal"
    assert not first.rejects, first
    assert not joint.rejects, joint
    assert not triple.rejects, triple


def test_engine_check_rejects_a_wrong_p_draft(sampled_setup) -> None:  # noqa: F811
    draft = close_draft(sampled_setup[0])
    _, joint, triple, _ = _engine_lossless_check(
        sampled_setup, proposer=lambda model, tokenizer: MixedUpRows(DraftModelProposer(draft, model.config.vocab_size)))
    assert joint.rejects or triple.rejects, (joint, triple)


def flat_draft(target: torch.nn.Module) -> torch.nn.Module:
    """A draft much flatter than the target (LM head scaled down): its first candidate is often
    rejected, and a later one, drawn from the same p_draft, often accepted."""
    draft = copy.deepcopy(target)
    with torch.no_grad():
        draft.lm_head.weight.mul_(0.4)
    return draft


@pytest.mark.parametrize("distinct", [True, False], ids=["without-replacement", "with-replacement"])
def test_sampled_siblings_are_lossless_through_the_engine(sibling_setup, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                                          distinct: bool) -> None:
    """branches=3: three candidates drawn from p_draft at the first position, without replacement
    (the default) or independently; the sampler that skips the residual between them must be
    caught."""
    draft = flat_draft(sibling_setup[0])
    check_siblings_lossless(sibling_setup, lambda model, _t: DraftModelProposer(draft, model.config.vocab_size, 3, 4,
                                                                                  distinct=distinct), 4, monkeypatch)
