"""Medusa heads: checkpoints (round trip, and one-line refusals), drafts that are the heads'
guesses from the target's state at the last committed token, greedy output equal to plain
decoding (chains and trees, both policies), and lossless sampling with later siblings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdraft.engine import Engine
from specdraft.errors import ModelFileError, SpecdraftError
from specdraft.heads.medusa import MedusaConfig, MedusaHeads, load_medusa, save_medusa
from specdraft.heads.vocab import DraftVocab
from specdraft.metrics import SpecStats
from specdraft.model.loader import LoadedModel, load
from specdraft.policy import Policy, PolicyConfig
from specdraft.proposers import make_proposer
from specdraft.proposers.base import ProposerContext
from specdraft.proposers.medusa import MedusaProposer
from specdraft.sequence import GenerationConfig
from test_accept import check_siblings_lossless, sibling_setup  # noqa: F401  (a fixture)
from test_spec_engine import cost_table

GEN = GenerationConfig(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_hf: Path) -> LoadedModel:
    return load(tiny_hf)


def random_heads(loaded: LoadedModel, heads: int = 3, draft_vocab: int = 200, seed: int = 0) -> MedusaHeads:
    """Heads over the first ``draft_vocab`` ids, LM head from the target, small random blocks."""
    c = loaded.config
    vocab = DraftVocab(torch.arange(draft_vocab), c.vocab_size)
    out = MedusaHeads.from_target(MedusaConfig(heads, c.hidden_size, draft_vocab, c.vocab_size), vocab,
                                  loaded.model.lm_head.weight.detach())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in out.blocks:
            block.weight.copy_(torch.randn(block.weight.shape, generator=g) * 0.05)
    return out


def prompts(loaded: LoadedModel) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [loaded.tokenizer.encode("a b a b a b"), torch.randint(3, 300, (17,), generator=g).tolist(),
            torch.randint(3, 300, (3,), generator=g).tolist()]


def test_checkpoints_round_trip_and_bad_ones_are_refused_in_one_line(tiny: LoadedModel, tmp_path: Path) -> None:
    heads = random_heads(tiny)
    folder = save_medusa(heads, tmp_path / "heads", target="tiny")
    again = load_medusa(folder, tiny.config.hidden_size, tiny.config.vocab_size)
    x = torch.randn(4, tiny.config.hidden_size)
    assert torch.equal(again(x), heads(x)) and torch.equal(again.target_ids, heads.target_ids)
    for hidden, vocab, needle in ((32, tiny.config.vocab_size, "hidden size 64"), (64, 999, "320 tokens")):
        with pytest.raises(ModelFileError, match=needle) as e:
            load_medusa(folder, hidden, vocab)
        assert "\n" not in str(e.value)
    with pytest.raises(ModelFileError, match="no heads"):
        load_medusa(tmp_path / "nowhere", 64, 320)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with pytest.raises(ModelFileError, match="corrupt or truncated"):
        load_medusa(folder, 64, 320)
    with pytest.raises(SpecdraftError, match="needs trained heads"):
        make_proposer("medusa", {}, ProposerContext(tiny.model, tiny.tokenizer))


@torch.inference_mode()
def test_drafts_are_the_heads_guesses_from_the_last_committed_state(tiny: LoadedModel) -> None:
    heads = random_heads(tiny)
    proposer = MedusaProposer(heads, topk=2)
    seen = []
    real = proposer.propose

    def spy(seqs, budgets, cache):  # type: ignore[no-untyped-def]
        drafts = real(seqs, budgets, cache)
        seen.extend((list(s.tokens), d, b, s.room) for s, d, b in zip(seqs, drafts, budgets) if s is not None and len(d))
        return drafts

    proposer.propose = spy  # type: ignore[method-assign]
    engine = Engine(tiny.model, tiny.tokenizer, proposer, Policy(PolicyConfig(kind="fixed", k=4)))
    engine.generate(prompts(tiny), GEN)
    assert len(seen) > 10
    for tokens, draft, budget, room in seen:
        n = len(tokens) - 1  # the state is the target's at the token before the root
        cache = tiny.model.new_cache(1, n)
        state = tiny.model(torch.tensor([tokens[:n]]), torch.arange(n)[None], cache).last_hidden[0, -1]
        probs = heads(state).float().softmax(-1).topk(2, dim=-1)  # [K, 2]
        reach = room - 1  # no deeper than the tokens the row may still emit
        want = _best_paths(heads.target_ids[probs.indices].tolist()[:reach], probs.values.tolist()[:reach], budget)
        got = {tuple(draft.tokens[i] for i in draft.path_to(n)): c for n, c in enumerate(draft.confidence)}
        assert set(got) == set(want)
        assert all(got[path] == pytest.approx(want[path], rel=1e-5) for path in got)


def _best_paths(ids: list[list[int]], probs: list[list[float]], budget: int) -> dict[tuple[int, ...], float]:
    """Every path of the heads' candidate tree with its product of probabilities, by brute
    force; the ``budget`` best (ties broken by the path's first-candidate order, as best-first)."""
    paths: list[tuple[tuple[int, ...], float, tuple[int, ...]]] = [((), 1.0, ())]
    for d in range(len(ids)):
        paths += [(p + (ids[d][j],), c * probs[d][j], o + (j,)) for p, c, o in paths if len(p) == d
                  for j in range(len(ids[d]))]
    ranked = sorted((x for x in paths if x[0]), key=lambda x: (-x[1], len(x[0]), x[2]))[:budget]
    return {p: c for p, c, _ in ranked}


@pytest.mark.parametrize("topk", [1, 3], ids=["chain", "tree"])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_greedy_output_equals_plain(tiny: LoadedModel, topk: int, policy: str) -> None:
    batch = prompts(tiny)
    plain = Engine(tiny.model, tiny.tokenizer).generate(batch, GEN)
    cost = cost_table(len(batch)) if policy == "adaptive" else None
    policy_ = Policy(PolicyConfig(kind=policy, k=4, objective="throughput", stop_after=10**6), cost)
    engine = Engine(tiny.model, tiny.tokenizer, MedusaProposer(random_heads(tiny), topk), policy_)
    stats = SpecStats()
    got = engine.generate(batch, GEN, stats=stats)
    assert [r.tokens for r in got] == [r.tokens for r in plain]
    assert stats.proposed > 0


@torch.inference_mode()
def test_sampled_siblings_are_lossless(sibling_setup, monkeypatch: pytest.MonkeyPatch, tiny: LoadedModel) -> None:  # noqa: F811
    """Heads built to guess, after the shared prompt, the three likeliest second tokens
    (summed over the first): later siblings are then often accepted, and the output follows
    the target's distribution. (Medusa's first tree is computed from the prompt's last state,
    before the first token is drawn, so it is the same for every row: on this tiny model no
    fixed set of siblings gives the skipped-residual bug a bias the 2,000-row check can see;
    the other tree methods' tests catch it.)"""
    model, _, prompt, p1, p2 = sibling_setup[:5]
    c = tiny.config
    n = len(prompt)
    state = model(torch.tensor([prompt]), torch.arange(n)[None], model.new_cache(1, n)).last_hidden[0, -1]  # [H]
    second = (p1[:, None] * p2).sum(0).topk(3).indices.tolist()  # the likeliest x2, whatever x1
    vocab = DraftVocab(torch.arange(c.vocab_size), c.vocab_size)
    heads = MedusaHeads(MedusaConfig(2, c.hidden_size, c.vocab_size, c.vocab_size), vocab)
    with torch.no_grad():
        heads.lm_head.weight.zero_()
        for score, token in zip((3.0, 2.0, 1.0), second):  # logits = score at the prompt's state
            heads.lm_head.weight[token] = score * state / state.dot(state)
    check_siblings_lossless(sibling_setup, lambda _m, _t: MedusaProposer(heads, topk=3), 4, monkeypatch,
                            catches_the_bug=False)


def test_exports_to_vllm_medusa_layout(tiny: LoadedModel, tmp_path: Path) -> None:
    import json

    from safetensors.torch import load_file

    from specdraft.heads.export import export_heads

    heads = random_heads(tiny, heads=3)
    folder = save_medusa(heads, tmp_path / "heads", target="tiny")
    out = export_heads(folder, tmp_path / "vllm", "vllm-medusa")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["num_heads"] == 3
    assert config["truncated_vocab_size"] == 200
    t = load_file(str(out / "model.safetensors"))
    x = torch.randn(tiny.config.hidden_size)
    for i in range(3):  # vLLM's head i: x + SiLU(W x + b), then its own LM head, over token_map
        h = x + torch.nn.functional.silu(t[f"blocks.{i}.layers.0.weight"] @ x + t[f"blocks.{i}.layers.0.bias"])
        assert torch.allclose(t[f"lm_heads.{i}.weight"] @ h, heads(x)[i], atol=1e-5)
    assert torch.equal(t["token_map"], heads.target_ids)
