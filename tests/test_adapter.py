"""The trained early-exit adapter (Kangaroo) for layer-skip: it starts as the untrained exit,
drafts with its own cache exactly what training computes, keeps greedy output equal to plain
decoding, learns from the target's answers, and bad checkpoints are refused in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from specdraft.engine import Engine
from specdraft.errors import ModelFileError, SpecdraftError
from specdraft.heads.adapter import AdapterConfig, ExitAdapter, load_adapter, save_adapter
from specdraft.heads.vocab import DraftVocab
from specdraft.metrics import SpecStats
from specdraft.model.loader import LoadedModel, load
from specdraft.policy import Policy, PolicyConfig
from specdraft.proposers import make_proposer
from specdraft.proposers.base import ProposerContext
from specdraft.proposers.layer_skip import LayerSkipProposer
from specdraft.sequence import GenerationConfig
from test_eagle import prompts

GEN = GenerationConfig(max_new_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_hf: Path) -> LoadedModel:
    return load(tiny_hf)


def random_adapter(loaded: LoadedModel, exit_layer: int = 1, seed: int = 0, vocab: int = 0) -> ExitAdapter:
    """vocab > 0: a reduced draft vocabulary of that many random target ids."""
    torch.manual_seed(seed)
    v = loaded.config.vocab_size
    ids = torch.sort(torch.randperm(v)[:vocab]).values if vocab else None
    adapter = ExitAdapter(AdapterConfig.for_target(loaded.config, exit_layer), DraftVocab(ids, v) if vocab else None)
    with torch.no_grad():
        for p in adapter.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.5 / p.shape[1] ** 0.5)
    return adapter


def test_the_untrained_start_is_the_plain_early_exit(tiny: LoadedModel) -> None:
    from specdraft.train.adapter import adapter_logits
    from specdraft.train.teacher import TeacherConfig, teacher_batches

    adapter = random_adapter(tiny).start_from(tiny.model.norm.weight)
    [(_, batch)] = list(teacher_batches(tiny.model, [(prompts(tiny)[1], [5, 6, 7])], TeacherConfig(taps=(1,), top_k=1)))
    m = tiny.model
    tokens = batch.tokens
    exit_logits = m(tokens, torch.arange(tokens.shape[1])[None], m.new_cache(1, tokens.shape[1]), num_layers=1).logits
    torch.testing.assert_close(adapter_logits(adapter, tiny, batch), exit_logits, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def _chain_logits(tiny: LoadedModel, adapter: ExitAdapter, tokens: list[int]):  # type: ignore[no-untyped-def]
    from specdraft.train.adapter import adapter_logits
    from specdraft.train.teacher import TeacherConfig, teacher_batches

    [(_, batch)] = list(teacher_batches(tiny.model, [(tokens, [])], TeacherConfig(taps=(adapter.config.exit_layer,), top_k=1)))
    logits = adapter_logits(adapter, tiny, batch)[0]  # [T, V]
    if adapter.vocab is not None:
        logits[:, ~adapter.vocab.t2d] = float("-inf")
    return logits


@pytest.mark.parametrize("vocab", [0, 40])
def test_drafts_are_the_adapters_greedy_chain(tiny: LoadedModel, vocab: int) -> None:
    """Every greedy draft is the adapter's chain computed over the whole sequence at once
    (its cache's exact and scratch entries, positions and masks are right); with a reduced
    draft vocabulary, the chain over those tokens only."""
    adapter = random_adapter(tiny, vocab=vocab)
    proposer = LayerSkipProposer(tiny.model, 1, adapter=adapter)
    assert (proposer.head is not None) == bool(vocab)
    seen = []
    real = proposer.propose

    def spy(seqs, budgets, cache):  # type: ignore[no-untyped-def]
        drafts = real(seqs, budgets, cache)
        seen.extend((list(s.tokens), d) for s, d in zip(seqs, drafts) if s is not None and len(d))
        return drafts

    proposer.propose = spy  # type: ignore[method-assign]
    Engine(tiny.model, tiny.tokenizer, proposer, Policy(PolicyConfig(kind="fixed", k=3))).generate(prompts(tiny), GEN)
    assert len(seen) > 10
    for tokens, draft in seen:
        logits = _chain_logits(tiny, adapter, tokens + list(draft.tokens))
        n = len(tokens)
        want = [int(logits[n - 1 + i].argmax()) for i in range(len(draft))]
        assert list(draft.tokens) == want
        assert not vocab or all(bool(adapter.vocab.t2d[t]) for t in draft.tokens)  # type: ignore[union-attr]


@pytest.mark.parametrize("policy,vocab", [("fixed", 0), ("adaptive", 0), ("fixed", 40)])
def test_greedy_output_equals_plain(tiny: LoadedModel, policy: str, vocab: int) -> None:
    from test_spec_engine import cost_table

    batch = prompts(tiny)
    plain = Engine(tiny.model, tiny.tokenizer).generate(batch, GEN)
    cost = cost_table(len(batch)) if policy == "adaptive" else None
    proposer = LayerSkipProposer(tiny.model, 1, adapter=random_adapter(tiny, vocab=vocab))
    stats = SpecStats()
    got = Engine(tiny.model, tiny.tokenizer, proposer, Policy(PolicyConfig(kind=policy, k=4, stop_after=10**6), cost)
                 ).generate(batch, GEN, stats=stats)
    assert [r.tokens for r in got] == [r.tokens for r in plain] and stats.proposed > 0


def test_checkpoints_round_trip_and_bad_ones_are_refused(tiny: LoadedModel, tmp_path: Path) -> None:
    adapter = random_adapter(tiny)
    folder = save_adapter(adapter, tmp_path / "a", "tiny")
    again = load_adapter(folder, tiny.config)
    x = torch.randn(1, 3, tiny.config.hidden_size)
    assert torch.equal(again.norm(x), adapter.norm(x)) and again.config == adapter.config
    with pytest.raises(ModelFileError, match="hidden size 64") as e:
        load_adapter(folder, dataclasses.replace(tiny.config, hidden_size=32))
    assert "\n" not in str(e.value)
    c = tiny.config
    for other in (dict(vocab_size=c.vocab_size + 1), dict(num_layers=c.num_layers + 1)):  # another target
        with pytest.raises(ModelFileError, match="for a target with hidden size") as e:
            load_adapter(folder, dataclasses.replace(c, **other))
        assert "\n" not in str(e.value) and str(c.vocab_size) in str(e.value)
    (folder / "model.safetensors").write_bytes(b"oops")
    with pytest.raises(ModelFileError, match="corrupt or truncated"):
        load_adapter(folder, tiny.config)
    context = ProposerContext(tiny.model, tiny.tokenizer)
    with pytest.raises(ModelFileError, match="no adapter"):
        make_proposer("layer-skip", {"adapter": str(tmp_path / "nowhere")}, context)
    good = save_adapter(adapter, tmp_path / "b", "tiny")
    with pytest.raises(SpecdraftError, match="exits after layer 1"):
        make_proposer("layer-skip", {"adapter": str(good), "layers": "2"}, context)
    assert make_proposer("layer-skip", {"adapter": str(good)}, context).layers == 1


def test_a_draft_vocabulary_round_trips_and_a_broken_one_is_refused(tiny: LoadedModel, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    adapter = random_adapter(tiny, vocab=40)
    folder = save_adapter(adapter, tmp_path / "a", "tiny")
    again = load_adapter(folder, tiny.config)
    assert again.vocab is not None and torch.equal(again.vocab.target_ids, adapter.vocab.target_ids)  # type: ignore[union-attr]
    context = ProposerContext(tiny.model, tiny.tokenizer)
    assert make_proposer("layer-skip", {"adapter": str(folder)}, context).head is not None
    assert make_proposer("layer-skip", {"adapter": str(folder), "full_vocab": "true"}, context).head is None
    tensors = load_file(str(folder / "model.safetensors"))
    for broken in ({k: v for k, v in tensors.items() if k != "t2d"},  # one map of two
                   {**tensors, "t2d": ~tensors["t2d"]}):  # maps that disagree
        save_file(broken, str(folder / "model.safetensors"))
        with pytest.raises(ModelFileError, match="broken draft vocabulary") as e:
            load_adapter(folder, tiny.config)
        assert "\n" not in str(e.value)


def test_training_learns_and_resumes(tiny: LoadedModel, tiny_hf: Path, tmp_path: Path) -> None:
    from specdraft.cli import main
    from specdraft.train.adapter import AdapterTrainConfig, evaluate, train_adapter
    from specdraft.train.common import TeacherCache, splits
    from specdraft.train.data import DataConfig, generate_data
    from specdraft.train.prompts import TrainPrompt
    from specdraft.train.teacher import TeacherConfig, length_batches

    data = tmp_path / "data"
    items = [TrainPrompt(f"p/{i}", "p", f"Say {i} twice. " * (1 + i % 3), None) for i in range(80)]
    generate_data(tiny, items, data, DataConfig(max_new_tokens=24, temperatures=(0.0,), batch_size=8))
    cfg = AdapterTrainConfig(exit_layer=1, epochs=4, lr=5e-3, batch_tokens=512, eval_steps=3, draft_vocab=64)
    stopped = train_adapter(tiny, data, tmp_path / "a", AdapterTrainConfig(**{**cfg.key(), "time_budget_s": 0.0}))
    assert stopped.positions == 0
    result = train_adapter(tiny, data, tmp_path / "a", cfg)
    curve = [json.loads(line) for line in (tmp_path / "a" / "curve.jsonl").read_text().splitlines()]
    assert curve[-1] == {"epochs": 4.0, **result.row(), "draft_vocab": 64}  # measured over its draft vocabulary
    pairs, _, _ = splits(data, None)
    teacher = TeacherConfig(taps=(1,), top_k=8, batch_tokens=512)
    batches = list(TeacherCache(tiny, pairs, teacher).all(length_batches([len(p) + len(a) for p, a in pairs], 512)))
    start = ExitAdapter(AdapterConfig.for_target(tiny.config, 1)).start_from(tiny.model.norm.weight)
    trained = load_adapter(tmp_path / "a", tiny.config)
    assert result.positions > 0 and trained.vocab is not None and trained.vocab.size == 64
    assert tiny.tokenizer.eos_id in trained.vocab.target_ids.tolist()
    assert evaluate(trained, tiny, batches, 3).tau > evaluate(start, tiny, batches, 3).tau + 0.1
    assert main(["train", "layer-skip", "--data", str(data), "--out", str(tmp_path / "x"), "--exit-layer", "9",
                 "--model", str(tiny_hf)]) == 2
