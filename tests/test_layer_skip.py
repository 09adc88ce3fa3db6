"""Self-speculation (layer skip) on tiny random models: greedy equivalence with plain decoding
on ragged batches (fixed and adaptive policies, L = 1 and num_layers - 1, chains and first-level trees), drafts
equal to the early-exit model's own greedy continuation, the target cache left as found, the
lossless property at temperature 1 through the engine (that this check catches a wrong
p_draft is shown in test_draft_model), and bad settings refused."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from specdraft.batching import prefill
from specdraft.bench.layer_sweep import add_estimates
from specdraft.engine import Engine
from specdraft.errors import SpecdraftError
from specdraft.metrics import SpecStats
from specdraft.model.kv_cache import KVCache
from specdraft.model.loader import LoadedModel, load
from specdraft.model.transformer import Transformer
from specdraft.proposers import make_proposer
from specdraft.proposers.base import ProposerContext
from specdraft.proposers.layer_skip import LayerSkipConfig, LayerSkipProposer
from specdraft.sequence import GenerationConfig, Sequence
from test_accept import _engine_lossless_check, check_siblings_lossless, sampled_setup, sibling_setup  # noqa: F401  (fixtures)
from test_draft_model import Setup, engine
from tiny_models import write_hf_model

GEN = GenerationConfig(max_new_tokens=24, ignore_eos=True)
LAYERS = 4


@pytest.fixture(scope="module")
def setup(tiny_hf: Path) -> Setup:
    target = load(write_hf_model(tiny_hf.parent / "four-layers", seed=0, layers=LAYERS))
    g = torch.Generator().manual_seed(4)
    prompts = [target.tokenizer.encode("a b a b a b"), *(torch.randint(3, 320, (n,), generator=g).tolist()
                                                        for n in (2, 23, 40))]
    refs = [r.tokens for r in Engine(target.model, target.tokenizer).generate(prompts, GEN)]
    return Setup(target, prompts, refs)


def context(target: LoadedModel) -> ProposerContext:
    return ProposerContext(target.model, target.tokenizer, max_draft=4)


@pytest.mark.parametrize("layers", [1, LAYERS - 1])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("branches", [1, 2], ids=["chain", "tree"])
def test_greedy_equals_plain(setup: Setup, layers: int, policy: str, branches: int) -> None:
    proposer = make_proposer("layer-skip", {"layers": str(layers), "branches": str(branches)}, context(setup.target))
    stats = SpecStats()
    results = engine(setup.target, proposer, policy=policy).generate(setup.prompts, GEN, stats=stats)
    for row, (r, ref) in enumerate(zip(results, setup.refs)):
        assert r.tokens == ref, f"row {row} differs from plain decoding"
    assert stats.proposed > 0


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_skipping_a_middle_block_equals_plain(setup: Setup, policy: str) -> None:
    proposer = make_proposer("layer-skip", {"layers": "1", "last": "2"}, context(setup.target))
    assert proposer.layer_ids == (0, 2, 3)
    stats = SpecStats()
    results = engine(setup.target, proposer, policy=policy).generate(setup.prompts, GEN, stats=stats)
    assert [r.tokens for r in results] == setup.refs
    assert stats.proposed > 0


def acceptance(setup: Setup, layers: int) -> float:
    stats = SpecStats()
    engine(setup.target, LayerSkipProposer(setup.target.model, layers)).generate(setup.prompts, GEN, stats=stats)
    return stats.acceptance_rate


def test_more_layers_draft_better(setup: Setup) -> None:
    assert acceptance(setup, LAYERS - 1) > 2 * acceptance(setup, 1)


@torch.inference_mode()
def early_exit_greedy(model: Transformer, tokens: list[int], layers: int, n: int) -> list[int]:
    """n greedy tokens of the model cut after ``layers`` layers (plain decoding, own cache)."""
    cache = model.new_cache(1, len(tokens) + n)
    out = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache, num_layers=layers)
    drafted: list[int] = []
    for _ in range(n):
        drafted.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[drafted[-1]]]), torch.tensor([[cache.lengths[0]]]), cache, num_layers=layers)
    return drafted


def prefilled(setup: Setup) -> tuple[list[Sequence], KVCache]:
    """The setup's prompts prefilled by the engine, each with its first token appended."""
    model, tokenizer = setup.target.model, setup.target.tokenizer
    seqs = [Sequence(prompt=list(p), config=GEN, tokenizer=tokenizer, capacity=len(p) + GEN.max_new_tokens + 1)
            for p in setup.prompts]
    cache = model.new_cache(len(seqs), max(map(len, setup.prompts)) + GEN.max_new_tokens + 1)
    with torch.inference_mode():
        first = model.lm_logits(prefill(model, setup.prompts, cache)).argmax(-1).tolist()  # [B] greedy
    for s, tok in zip(seqs, first):
        s.append([tok])
    return seqs, cache


@pytest.mark.parametrize("layers", [1, LAYERS - 1])
def test_drafts_are_the_early_exit_greedy_tokens_and_the_cache_is_untouched(setup: Setup, layers: int) -> None:
    target = setup.target
    seqs, cache = prefilled(setup)
    k_before, v_before, lengths = cache.k.clone(), cache.v.clone(), list(cache.lengths)
    budgets = [4, 0, 3, 4]
    drafts = LayerSkipProposer(target.model, layers).propose(seqs, budgets, cache)
    assert cache.lengths == lengths
    for row, n in enumerate(lengths):  # the committed positions of every layer are unchanged
        assert torch.equal(cache.k[:, row, :, :n], k_before[:, row, :, :n])
        assert torch.equal(cache.v[:, row, :, :n], v_before[:, row, :, :n])
    for row, (s, draft) in enumerate(zip(seqs, drafts)):
        assert draft.p_draft is None and draft.is_chain
        assert list(draft.tokens) == early_exit_greedy(target.model, s.tokens, layers, budgets[row])


@torch.inference_mode()
def early_exit_confidence(model: Transformer, tokens: list[int], layers: int, drafted: list[int]) -> list[float]:
    """The cut model's top probability before each drafted token (teacher-forced)."""
    full = tokens + drafted[:-1]
    cache = model.new_cache(1, len(full))
    out = model(torch.tensor([full]), torch.arange(len(full))[None], cache, num_layers=layers)
    return out.logits[0, len(tokens) - 1:].float().softmax(-1).amax(-1).tolist()


def test_the_confidence_stop_cuts_each_chain_where_the_exit_is_unsure(setup: Setup) -> None:
    target, layers, budget = setup.target, 2, 4
    seqs, cache = prefilled(setup)
    whole = LayerSkipProposer(target.model, layers).propose(seqs, [budget] * len(seqs), cache)
    conf = [early_exit_confidence(target.model, s.tokens, layers, list(d.tokens)) for s, d in zip(seqs, whole)]
    gamma = sorted(c for row in conf for c in row)[len(seqs) * budget // 2]  # about half the nodes are sure enough
    cut = LayerSkipProposer(target.model, layers, stop_below=gamma).propose(seqs, [budget] * len(seqs), cache)
    lengths = []
    for row, (w, c, p) in enumerate(zip(whole, cut, conf)):
        keep = next((i for i, x in enumerate(p) if x < gamma), budget)  # the first unsure node and all after it go
        assert list(c.tokens) == list(w.tokens)[:keep], f"row {row}"
        lengths.append(keep)
    assert 0 < sum(lengths) < len(seqs) * budget
    assert all(len(d.tokens) == 0 for d in LayerSkipProposer(target.model, layers, stop_below=0.999).propose(
        seqs, [budget] * len(seqs), cache))


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_confidence_stopped_drafts_equal_plain(setup: Setup, policy: str) -> None:
    proposer = make_proposer("layer-skip", {"layers": "2", "stop_below": "0.02"}, context(setup.target))
    stats = SpecStats()
    results = engine(setup.target, proposer, policy=policy).generate(setup.prompts, GEN, stats=stats)
    assert [r.tokens for r in results] == setup.refs
    assert stats.proposed > 0


def test_sampling_with_the_confidence_stop_is_lossless(sampled_setup) -> None:  # noqa: F811
    first, joint, triple, stats = _engine_lossless_check(
        sampled_setup, proposer=lambda model, tokenizer: LayerSkipProposer(model, 1, stop_below=0.3))
    assert stats.accepted > 0.02 * 2000
    assert not first.rejects, first
    assert not joint.rejects, joint
    assert not triple.rejects, triple


def test_a_middle_skip_drafts_on_the_targets_own_prefix_and_leaves_the_cache_as_found(setup: Setup) -> None:
    target = setup.target
    seqs, cache = prefilled(setup)
    k_before, lengths = cache.k.clone(), list(cache.lengths)
    proposer = LayerSkipProposer(target.model, 1, last=2)
    drafts = proposer.propose(seqs, [3] * len(seqs), cache)
    assert cache.lengths == lengths
    for row, n in enumerate(lengths):
        assert torch.equal(cache.k[:, row, :, :n], k_before[:, row, :, :n])
    with torch.inference_mode():  # the first drafted token: layers 0, 2, 3 over the target's own prefix
        scratch = copy.deepcopy(cache)
        roots = torch.tensor([[s.tokens[-1]] for s in seqs])
        out = target.model(roots, torch.tensor(lengths)[:, None], scratch, layers=(0, 2, 3))
    assert [d.tokens[0] for d in drafts] == out.logits[:, -1].argmax(-1).tolist()


def test_engine_sampling_is_lossless(sampled_setup) -> None:  # noqa: F811
    first, joint, triple, stats = _engine_lossless_check(
        sampled_setup, proposer=lambda model, tokenizer: LayerSkipProposer(model, 1))
    assert stats.accepted > 0.05 * 2000
    assert not first.rejects, first
    assert not joint.rejects, joint
    assert not triple.rejects, triple


def test_sampling_over_a_reduced_draft_vocabulary_is_lossless(sampled_setup) -> None:  # noqa: F811
    """An adapter that drafts over half the vocabulary (zero draft probability elsewhere): the
    residual must give the other tokens their whole target probability."""
    from specdraft.heads.adapter import AdapterConfig, ExitAdapter
    from specdraft.heads.vocab import DraftVocab

    def proposer(model, _tokenizer):  # type: ignore[no-untyped-def]
        v = model.config.vocab_size
        vocab = DraftVocab(torch.arange(0, v, 2), v)
        adapter = ExitAdapter(AdapterConfig.for_target(model.config, 1), vocab).start_from(model.norm.weight)
        return LayerSkipProposer(model, 1, adapter=adapter)

    first, joint, triple, stats = _engine_lossless_check(sampled_setup, proposer=proposer)
    assert stats.accepted > 0.02 * 2000
    assert not first.rejects, first
    assert not joint.rejects, joint
    assert not triple.rejects, triple


def test_bad_settings_are_refused_with_one_line(setup: Setup) -> None:
    for layers in ("0", str(LAYERS), "99"):
        with pytest.raises(SpecdraftError, match="layers") as err:
            make_proposer("layer-skip", {"layers": layers}, context(setup.target))
        assert "\n" not in str(err.value)
    with pytest.raises(SpecdraftError, match="needs the target"):
        make_proposer("layer-skip", {}, None)
    with pytest.raises(SpecdraftError, match="branches"):
        LayerSkipConfig(branches=0)
    with pytest.raises(SpecdraftError, match="layers must be"):
        make_proposer("layer-skip", {"layers": "two"}, context(setup.target))
    with pytest.raises(SpecdraftError, match="layers \\+ last must be at most 3") as err:
        make_proposer("layer-skip", {"layers": "2", "last": "2"}, context(setup.target))
    assert "\n" not in str(err.value)
    with pytest.raises(SpecdraftError, match="last must be"):
        LayerSkipConfig(last=-1)
    for bad in (-0.1, 1.0, 2):
        with pytest.raises(SpecdraftError, match="stop_below must be in"):
            LayerSkipConfig(stop_below=bad)


def test_sweep_speedup_estimate() -> None:
    rows = [{"layers": 15, "tau": 2.0}]
    add_estimates(rows, {1: 40.0, 4: 54.0, 8: 64.0}, total=30, head=0.2, k=4)
    verify = 54.0 + (64.0 - 54.0) / 4  # c(5), interpolated
    assert rows[0]["est_speedup"] == pytest.approx(2.0 * 40.0 / (verify + 4 * 0.5 * 40.0))
    assert rows[0]["cost_fraction_with_head"] == pytest.approx(0.2 + 0.8 * 0.5)


@pytest.mark.parametrize("distinct", [True, False], ids=["without-replacement", "with-replacement"])
def test_sampled_siblings_are_lossless_through_the_engine(sibling_setup, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                                          distinct: bool) -> None:
    """branches=3 from the first layer, the siblings drawn without replacement (the default) or
    independently: later candidates are often accepted; the sampler that skips the residual
    between them must be caught."""
    check_siblings_lossless(sibling_setup, lambda model, _t: LayerSkipProposer(model, 1, branches=3, distinct=distinct),
                            4, monkeypatch)


def test_siblings_without_replacement_are_distinct_and_carry_their_own_distribution() -> None:
    from specdraft.proposers.autoregressive import _without_replacement

    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        tokens, dists = _without_replacement(p, 3, g)
        assert len(set(tokens)) == 3 and 4 not in tokens
        for i, (t, q) in enumerate(zip(tokens, dists)):
            assert q.sum().item() == pytest.approx(1.0) and q[t] > 0
            assert all(q[earlier] == 0 for earlier in tokens[:i])  # the i-th is drawn without the earlier ones
        assert torch.allclose(dists[0], p)
    assert len(_without_replacement(torch.tensor([0.6, 0.4, 0.0]), 3, g)[0]) == 2  # only two tokens have mass
    firsts = [tuple(_without_replacement(p, 2, g)[0]) for _ in range(4000)]
    assert firsts.count((1, 0)) / 4000 == pytest.approx(0.3 * 0.5 / 0.7, abs=0.03)  # successive sampling
