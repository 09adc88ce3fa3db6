"""The seam trained heads draft from: the target's hidden states at every prompt position
(``prefilled``) and layer taps at every verification slot (``Verified.taps``), equal to what a
plain forward over the same tokens computes; nothing for proposers that ask for none."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

import pytest
import torch

from specdraft.accept import Acceptance
from specdraft.draft import Draft
from specdraft.batching import prefill
from specdraft.engine import Engine, joined_features
from specdraft.model.loader import LoadedModel, load
from specdraft.policy import Policy, PolicyConfig
from specdraft.proposers import METHODS, make_proposer
from specdraft.proposers.base import NO_FEATURES, FeatureRequest, Features, ProposerContext, Verified, feature_request
from specdraft.sequence import GenerationConfig, Sequence

TAPS = (0, 1, 2)  # the embeddings and both layers of the tiny model


class Recorder:
    """Drafts the last two tokens again (a chain: some accepted, some not) and records what
    the engine hands it."""

    name = "recorder"
    features = FeatureRequest(taps=TAPS, prompt=True)

    def __init__(self) -> None:
        self.prefills: dict[int, Features] = {}
        self.steps: list[tuple[int, list[int], Draft, Verified]] = []
        self.seqs: dict[int, Sequence] = {}

    def begin(self, row: int, seq: Sequence) -> None:
        self.seqs[row] = seq

    def prefilled(self, row: int, features: Features) -> None:
        self.prefills[row] = features

    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache) -> list[Draft]:  # type: ignore[no-untyped-def]
        return [Draft.chain(s.tokens[-2:][:b]) if s is not None and b > 0 else Draft.empty()
                for s, b in zip(seqs, budgets)]

    def observe(self, row: int, draft: Draft, acceptance: Acceptance, verified: Verified) -> None:
        seq = self.seqs[row]
        before = seq.tokens[: len(seq.tokens) - len(acceptance.tokens)]  # the context the step verified
        self.steps.append((row, before, draft, verified))

    def end(self, row: int) -> None:
        pass

    def memory_bytes(self) -> int:
        return 0


@pytest.fixture(scope="module")
def tiny(tiny_hf: Path) -> LoadedModel:
    return load(tiny_hf)


@torch.inference_mode()
def direct(loaded: LoadedModel, tokens: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """One plain forward over ``tokens``: final-norm states and the taps, [T, H] each."""
    model = loaded.model
    cache = model.new_cache(1, len(tokens))
    out = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache, return_hidden=TAPS)
    return out.last_hidden[0], {k: v[0] for k, v in out.hidden.items()}


def prompts(loaded: LoadedModel) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [loaded.tokenizer.encode("a b a b a b"), torch.randint(3, 300, (23,), generator=g).tolist(),
            torch.randint(3, 300, (4,), generator=g).tolist()]


def test_prefill_features_cover_every_prompt_position_in_groups_and_chunks(tiny: LoadedModel) -> None:
    batch = prompts(tiny)
    cache = tiny.model.new_cache(len(batch), max(map(len, batch)) + 4)
    parts: list[dict[int, list[torch.Tensor]]] = [{} for _ in batch]
    with torch.inference_mode():  # several groups, several chunks
        prefill(tiny.model, batch, cache, chunk=5, budget=24, taps=feature_request(Recorder()).taps, parts=parts)
    features = [joined_features(p) for p in parts]
    assert len(features) == len(batch)
    for f, p in zip(features, batch):
        last, taps = direct(tiny, p)
        assert f.last_hidden.shape == (len(p), tiny.config.hidden_size)
        torch.testing.assert_close(f.last_hidden, last, atol=1e-5, rtol=1e-4)
        assert set(f.taps) == set(TAPS)
        for layer in TAPS:
            torch.testing.assert_close(f.taps[layer], taps[layer], atol=1e-5, rtol=1e-4)


def test_generation_hands_prompt_features_and_verification_taps_to_the_proposer(tiny: LoadedModel) -> None:
    recorder = Recorder()
    engine = Engine(tiny.model, tiny.tokenizer, recorder, Policy(PolicyConfig(kind="fixed", k=2)))
    batch = prompts(tiny)
    plain = Engine(tiny.model, tiny.tokenizer).generate(batch, GenerationConfig(max_new_tokens=10, ignore_eos=True))
    got = engine.generate(batch, GenerationConfig(max_new_tokens=10, ignore_eos=True))
    assert [r.tokens for r in got] == [r.tokens for r in plain]
    assert sorted(recorder.prefills) == [0, 1, 2]
    for row, p in enumerate(batch):
        torch.testing.assert_close(recorder.prefills[row].last_hidden, direct(tiny, p)[0], atol=1e-5, rtol=1e-4)
    assert len(recorder.steps) > 6
    for row, before, draft, verified in recorder.steps:
        fed = before + list(draft.tokens)  # a chain: the root is the last token of `before`
        last, taps = direct(tiny, fed)
        slots = slice(len(before) - 1, len(fed))  # the root and every draft node
        torch.testing.assert_close(verified.hidden[: len(draft) + 1], last[slots], atol=1e-5, rtol=1e-4)
        assert set(verified.taps) == set(TAPS)
        for layer in TAPS:
            torch.testing.assert_close(verified.taps[layer][: len(draft) + 1], taps[layer][slots], atol=1e-5, rtol=1e-4)


def test_registered_methods_ask_for_no_features(tiny: LoadedModel, tmp_path: Path) -> None:
    """The lookup and model proposers draft from tokens: the forwards return no taps for them."""
    context = ProposerContext(tiny.model, tiny.tokenizer)
    for name, options in (("plain", {}), ("ngram", {}), ("suffix", {}), ("lookahead", {}), ("layer-skip", {"layers": "1"}),
                          ("draft", {"path": str(tiny.source)})):
        assert feature_request(make_proposer(name, options, context)) == NO_FEATURES, name
    assert set(METHODS) >= {"plain", "ngram", "suffix", "lookahead", "layer-skip", "draft", "rest"}
    with pytest.raises(TypeError, match="FeatureRequest"):
        feature_request(type("Bad", (), {"features": (1, 2)})())
