"""EAGLE-3 heads: the training-time test computes what drafting computes (chains and every
path of a dynamic tree), checkpoints round-trip in the EAGLE-3 layout and bad ones are refused
in one line, greedy output equals plain decoding, and sampled dynamic trees are lossless."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from specdraft.engine import Engine
from specdraft.errors import ModelFileError, SpecdraftError
from specdraft.heads.eagle import EagleHead, eagle3_taps
from specdraft.heads.feature_head import FeatureHead, ttt_inputs
from specdraft.heads.mtp import MtpHead
from specdraft.heads.eagle_checkpoint import load_eagle, save_eagle
from specdraft.heads.vocab import DraftVocab
from specdraft.metrics import SpecStats
from specdraft.model.loader import LoadedModel, load
from specdraft.policy import Policy, PolicyConfig
from specdraft.proposers import make_proposer
from specdraft.proposers.base import ProposerContext
from specdraft.proposers.feature_heads import BACKLOG_MIN, _best_tree, EagleOptions, FeatureHeadProposer
from specdraft.sequence import GenerationConfig, Sequence
from test_accept import check_siblings_lossless, sibling_setup  # noqa: F401  (a fixture)
from test_spec_engine import cost_table

GEN = GenerationConfig(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_hf: Path) -> LoadedModel:
    return load(tiny_hf)


def random_head(loaded: LoadedModel, draft_vocab: int = 200, seed: int = 0, scale: float = 0.3,
                kind: str = "eagle") -> FeatureHead:
    c = loaded.config
    torch.manual_seed(seed)
    vocab = DraftVocab(torch.arange(draft_vocab), c.vocab_size)
    head = EagleHead.for_target(c, vocab) if kind == "eagle" else MtpHead.for_target(c, vocab)
    with torch.no_grad():
        for p in head.parameters():
            if p.ndim == 2:
                p.normal_(0, scale / p.shape[1] ** 0.5)
        head.lm_head.weight.copy_(loaded.model.lm_head.weight[:draft_vocab] * 3)
    return head


def context(loaded: LoadedModel) -> ProposerContext:
    return ProposerContext(loaded.model, loaded.tokenizer)


def prompts(loaded: LoadedModel) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [loaded.tokenizer.encode("a b a b a b"), torch.randint(3, 300, (17,), generator=g).tolist(),
            torch.randint(3, 300, (3,), generator=g).tolist()]


def test_eagle3_layer_choice() -> None:
    assert eagle3_taps(30) == (2, 15, 27) and eagle3_taps(4) == (2, 2, 1)


@torch.inference_mode()
def _ttt_logp(loaded: LoadedModel, head: FeatureHead, tokens: list[int], anchor: int, steps: int) -> list[Tensor]:
    """The training-time test's log-probs [N] at ``anchor`` for steps 1..steps, over ``tokens``."""
    model = loaded.model
    t = anchor + 1
    out = model(torch.tensor([tokens[:t]]), torch.arange(t)[None], model.new_cache(1, t), logits=False,
                return_hidden=head.config.taps)
    taps = torch.cat([out.hidden[i] for i in head.config.taps], -1)  # [1, t, taps*H]
    ids = torch.tensor([(tokens + [0] * steps)[: t + steps]])  # [1, t + steps]
    emb, cos, sin = ttt_inputs(model.embed, ids, model.rope_cos, model.rope_sin, steps, torch.float32)
    states = head.ttt(taps, emb, cos, sin, steps)
    return [head.logits(s[0, anchor]).log_softmax(-1) for s in states]


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
@pytest.mark.parametrize("topk", [1, 3], ids=["chain", "tree"])
@pytest.mark.parametrize("length", [17, BACKLOG_MIN + 9], ids=["short", "backlog"])
def test_drafting_computes_what_the_training_time_test_trains(tiny: LoadedModel, topk: int, kind: str,
                                                              length: int) -> None:
    """Every node's score is its path's cumulative log-probability under the training-time
    test with that path as the tokens: the tree's attention mask, positions, the head's cache
    and the state hand-over are those training sees (for both kinds of feature head; a
    prompt long enough to be fed alone first, ``backlog``, included)."""
    head = random_head(tiny, kind=kind)
    proposer = FeatureHeadProposer(head, context(tiny), EagleOptions(depth=3, topk=topk))
    prompt = torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    seq = Sequence(prompt, GEN, tiny.tokenizer, capacity=64)
    m = tiny.model
    with torch.inference_mode():
        proposer.begin(0, seq)
        out = m(torch.tensor([prompt]), torch.arange(len(prompt))[None], m.new_cache(1, len(prompt)),
                return_hidden=head.config.taps)
        proposer.prefilled(0, _features(out, head))
        seq.append([int(out.logits[0, -1].argmax())])
        state, logp = proposer._feed_pending([0], [seq], 9 * 3)
        tokens, parents, scores = proposer._grow([0], state, logp, 3, topk, torch.tensor([10**6]))
        # growth that stops once no deeper node can make a draft of b nodes gives the same draft
        for b in (1, 2, 4, 7):
            again = proposer._grow([0], state, logp, 3, topk, torch.tensor([b]))
            assert _best_tree(*(x[0] for x in again), b, 99, "e") == _best_tree(tokens[0], parents[0], scores[0], b, 99, "e")
    assert tokens.shape[1] == topk + 2 * topk * topk
    for node in range(tokens.shape[1]):
        path = [node]
        while int(parents[0, path[-1]]) >= 0:
            path.append(int(parents[0, path[-1]]))
        path.reverse()
        walk = seq.tokens + [int(tokens[0, i]) for i in path]
        steps = _ttt_logp(tiny, head, walk, len(prompt) - 1, len(path))
        want = sum(float(steps[d][head.vocab.to_draft(torch.tensor(walk[len(prompt) + 1 + d]))]) for d in range(len(path)))
        assert abs(float(scores[0, node]) - want) < 1e-4, (node, path)


def test_a_prompt_backlog_is_priced_then_fed_at_the_first_proposal(tiny: LoadedModel) -> None:
    """The prompt is not fed in the prefill: the policy sees its cost (``setup_seconds``) for
    the row that has it, nothing for a short one, and nothing once the first proposal fed it."""
    head = random_head(tiny)
    proposer = FeatureHeadProposer(head, context(tiny), EagleOptions(depth=2, topk=2))
    m = tiny.model
    g = torch.Generator().manual_seed(2)
    seqs = []
    with torch.inference_mode():
        for row, n in enumerate((BACKLOG_MIN + 20, 5)):
            prompt = torch.randint(3, 300, (n,), generator=g).tolist()
            seq = Sequence(prompt, GEN, tiny.tokenizer, capacity=128)
            proposer.begin(row, seq)
            out = m(torch.tensor([prompt]), torch.arange(n)[None], m.new_cache(1, n), return_hidden=head.config.taps)
            proposer.prefilled(row, _features(out, head))
            seq.append([int(out.logits[0, -1].argmax())])
            seqs.append(seq)
        setup = proposer.setup_seconds(seqs)
        assert setup[0] > 0 and setup[1] == 0 and proposer.setup_seconds([None, seqs[1]]) == [0.0, 0.0]
        assert proposer.rows.length == {0: 0, 1: 0}  # nothing fed yet
        proposer.propose(seqs, [3, 3], m.new_cache(2, 128))
        assert proposer.setup_seconds(seqs) == [0.0, 0.0]
        assert proposer.rows.length == {0: BACKLOG_MIN + 20, 1: 5}  # every prompt position fed


def test_pending_taps_count_what_they_hold_through_a_rows_life() -> None:
    """``backlog`` (asked for every row at every step) is a kept count: it must match the
    entries actually pending after prefill, chain and tree observations, a catch-up's put-back,
    a move and an end."""
    from specdraft.accept import Acceptance
    from specdraft.proposers.base import Features, Verified
    from specdraft.proposers.head_state import HeadCache, PendingTaps

    h = 4
    rows = PendingTaps((1, 2))
    held = lambda r: sum(len(f) for f in rows.pending.get(r, ()))  # noqa: E731
    states = lambda n: {1: torch.randn(n, h), 2: torch.randn(n, h)}  # noqa: E731
    for r in (0, 1):
        rows.begin(r)
    rows.prefilled(0, Features(torch.randn(7, h), states(7)))
    rows.observe(0, Acceptance((0, 1), (5, 6, 7)), Verified(torch.randn(4, 9), torch.randn(4, h), states(4)))
    rows.observe(1, Acceptance((1, 3), (5, 6, 7)), Verified(torch.randn(5, 9), torch.randn(5, h), states(5)))
    assert [rows.backlog(r) for r in (0, 1)] == [held(0), held(1)] == [10, 3]
    [feats], _ = rows.take([0])
    assert feats.shape == (10, 2 * h) and rows.backlog(0) == held(0) == 0 and rows.length[0] == 10
    rows.put_back(0, feats[-1:])
    assert rows.backlog(0) == held(0) == 1 and rows.length[0] == 9
    rows.move(1, 0, HeadCache(1, h, torch.float32, torch.device("cpu")))
    assert rows.backlog(0) == held(0) == 3 and rows.backlog(1) == 0 and 1 not in rows.pending
    rows.end(0)
    assert rows.backlog(0) == 0 and rows.count == {}


def _features(out, head: FeatureHead):  # type: ignore[no-untyped-def]
    from specdraft.proposers.base import Features

    return Features(out.last_hidden[0], {i: out.hidden[i][0] for i in head.config.taps})


def test_checkpoints_round_trip_in_the_eagle3_layout_and_bad_ones_are_refused(tiny: LoadedModel,
                                                                               tmp_path: Path) -> None:
    head = random_head(tiny)
    folder = save_eagle(head, tmp_path / "head", tiny.config, "tiny")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 200
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(head.config.taps)
    from safetensors.torch import load_file

    keys = set(load_file(str(folder / "model.safetensors")))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= keys
    again = load_eagle(folder, tiny.config)
    x = torch.randn(2, 5, tiny.config.hidden_size)
    assert torch.equal(again.logits(x), head.logits(x)) and torch.equal(again.target_ids, head.target_ids)
    import dataclasses

    for change, needle in (({"hidden_size": 32}, "hidden size 64"), ({"vocab_size": 999}, "320 tokens"),
                           ({"num_layers": 7}, f"{tiny.config.num_layers} layers")):
        other = dataclasses.replace(tiny.config, **change)
        with pytest.raises(ModelFileError, match=needle) as e:
            load_eagle(folder, other)
        assert "\n" not in str(e.value)
    with pytest.raises(ModelFileError, match="no head"):
        load_eagle(tmp_path / "nowhere", tiny.config)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelFileError, match="corrupt or truncated"):
        load_eagle(folder, tiny.config)
    with pytest.raises(SpecdraftError, match="needs a trained head"):
        make_proposer("eagle", {}, context(tiny))


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
@pytest.mark.parametrize("topk", [1, 3], ids=["chain", "tree"])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_greedy_output_equals_plain(tiny: LoadedModel, topk: int, policy: str, kind: str) -> None:
    batch = prompts(tiny)
    plain = Engine(tiny.model, tiny.tokenizer).generate(batch, GEN)
    cost = cost_table(len(batch)) if policy == "adaptive" else None
    policy_ = Policy(PolicyConfig(kind=policy, k=6, objective="throughput", stop_after=10**6), cost)
    proposer = FeatureHeadProposer(random_head(tiny, kind=kind), context(tiny), EagleOptions(depth=4, topk=topk), kind)
    stats = SpecStats()
    got = Engine(tiny.model, tiny.tokenizer, proposer, policy_).generate(batch, GEN, stats=stats)
    assert [r.tokens for r in got] == [r.tokens for r in plain]
    assert stats.proposed > 0


def test_the_cold_start_recorder_passes_a_heads_feature_protocol_through(tiny: LoadedModel) -> None:
    """Wrapped in the cold-start bench's recorder, a feature head still gets its taps, prompt
    features and setup pricing: the same drafts as unwrapped, every step recorded. A proposer
    that cannot move a row gives a recorder that cannot either (the scheduler then never packs)."""
    from specdraft.bench.coldstart import StepRecorder
    from specdraft.proposers.ngram import NgramProposer

    batch = prompts(tiny)

    def run(wrap: bool) -> tuple[list[list[int]], SpecStats, object]:
        proposer = FeatureHeadProposer(random_head(tiny, kind="mtp"), context(tiny), EagleOptions(depth=3, topk=2), "mtp")
        used = StepRecorder(proposer) if wrap else proposer
        policy = Policy(PolicyConfig(kind="fixed", k=6))
        stats = SpecStats()
        got = Engine(tiny.model, tiny.tokenizer, used, policy).generate(batch, GEN, stats=stats)
        return [r.tokens for r in got], stats, used

    plain_tokens, plain_stats, _ = run(False)
    tokens, stats, recorder = run(True)
    assert tokens == plain_tokens and stats.proposed == plain_stats.proposed > 0
    assert (stats.accepted, stats.drafts_at) == (plain_stats.accepted, plain_stats.drafts_at)
    assert sum(len(r) for r in recorder.finished) == stats.steps  # type: ignore[attr-defined]
    assert hasattr(recorder, "move") and hasattr(recorder, "setup_seconds")
    bare = NgramProposer()
    assert hasattr(StepRecorder(bare), "move") == hasattr(bare, "move")
    assert not hasattr(StepRecorder(bare), "setup_seconds") and not hasattr(StepRecorder(bare), "prefilled")


class _BigramHead(EagleHead):
    """A head whose state is its input token's embedding and whose log-probs are the target's
    next-token distribution after the shared prompt given that token (``p2``): its dynamic
    tree's first level is the three likeliest second tokens, the deterministic top k."""

    def __init__(self, base: EagleHead, embed: Tensor, p2: Tensor) -> None:
        super().__init__(base.config, base.vocab)
        self.table, self.embed_rows = p2.clamp_min(1e-9).log(), embed

    def layer(self, emb, hidden, cos, sin, attend):  # type: ignore[no-untyped-def]
        b, t, h = emb.shape
        q = torch.zeros(b, self.config.num_heads, t, self.config.head_dim)
        kv = torch.zeros(b, self.config.num_kv_heads, t, self.config.head_dim)
        attend(q, kv, kv)  # keep the cache's bookkeeping
        return emb.float()

    def cpp_parts(self) -> None:  # its own layer and read-out: no C++ step
        return None

    def logits(self, prenorm: Tensor) -> Tensor:
        ids = (prenorm[..., None, :] == self.embed_rows).all(-1).float().argmax(-1)  # [...] the token
        return self.table[ids]


def test_sampled_dynamic_trees_are_lossless(sibling_setup, monkeypatch: pytest.MonkeyPatch, tiny: LoadedModel) -> None:  # noqa: F811
    model, tokenizer, prompt, p1, p2 = sibling_setup[:5]
    c = model.config
    base = EagleHead.for_target(c, DraftVocab(torch.arange(c.vocab_size), c.vocab_size))
    head = _BigramHead(base, model.embed.weight.float(), p2)

    def make(depth: int, topk: int):  # type: ignore[no-untyped-def]
        return lambda m, t: FeatureHeadProposer(head, ProposerContext(m, t), EagleOptions(depth=depth, topk=topk))

    # one level of four siblings: later siblings are accepted often enough that a sampler
    # skipping the residual between them is caught; then a deeper dynamic tree, exact too
    check_siblings_lossless(sibling_setup, make(1, 4), 4, monkeypatch)
    check_siblings_lossless(sibling_setup, make(3, 2), 4, monkeypatch, catches_the_bug=False)


def test_exports_to_speculators_and_eagle3_layouts(tiny: LoadedModel, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from specdraft.cli import main
    from specdraft.heads.export import export_heads

    head = random_head(tiny)
    folder = save_eagle(head, tmp_path / "head", tiny.config, "tiny")
    ours = load_file(str(folder / "model.safetensors"))
    spec = export_heads(folder, tmp_path / "spec", "speculators", verifier="org/tiny")
    config = json.loads((spec / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 200
    assert config["eagle_aux_hidden_state_layer_ids"] == list(head.config.taps)
    assert config["transformer_layer_config"]["hidden_size"] == tiny.config.hidden_size
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    theirs = load_file(str(spec / "model.safetensors"))
    assert set(theirs) == {k.replace("midlayer.", "layers.0.") for k in ours}
    check_with_speculators(spec, head, tiny)
    assert torch.equal(theirs["layers.0.self_attn.q_proj.weight"], ours["midlayer.self_attn.q_proj.weight"])
    same = export_heads(folder, tmp_path / "e3", "eagle3")
    assert torch.equal(load_eagle(same, tiny.config).fc.weight, head.fc.weight)
    with pytest.raises(SpecdraftError, match="needs a specdraft-medusa head"):
        export_heads(folder, tmp_path / "m", "vllm-medusa")
    assert main(["train", "export", str(tmp_path / "nowhere"), str(tmp_path / "x"), "--format", "eagle3"]) == 2


def check_with_speculators(folder: Path, head: Any, tiny: LoadedModel) -> None:
    """The speculators package's own config class reads the exported config.json (its schema is
    pydantic: a missing or mistyped field raises) and sees our head: the EAGLE-3 type, the draft
    vocabulary, the taps and the layer's shape, the verifier. setup.sh installs speculators
    (without its torch, vision and audio pins) for this test."""
    from speculators import SpeculatorModelConfig
    from speculators.models import Eagle3SpeculatorConfig

    config = SpeculatorModelConfig.from_pretrained(str(folder))
    assert isinstance(config, Eagle3SpeculatorConfig)
    assert config.draft_vocab_size == head.config.draft_vocab
    assert config.eagle_aux_hidden_state_layer_ids == list(head.config.taps)
    layer = config.transformer_layer_config
    assert layer.hidden_size == tiny.config.hidden_size and layer.vocab_size == tiny.config.vocab_size
    assert layer.num_attention_heads == tiny.config.num_heads and layer.num_key_value_heads == tiny.config.num_kv_heads
    assert config.speculators_config.verifier.name_or_path == "org/tiny"
    assert config.speculators_config.proposal_methods  # how vLLM drafts with it


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_cpp_head_step_computes_the_python_layer(tiny: LoadedModel, kind: str, dtype: torch.dtype) -> None:
    """The head's step from C++ (fused products, ``fastpath.head_layer``) gives the Python
    layer's states and log-probs within rounding, and the same cache entries: for prompts fed
    in a batch of unequal rows (writes at each row's own slots), a row subset (a view of the
    cache) and a dynamic tree's growth (scratch slots, ancestor masks)."""
    import copy

    from specdraft.model import fastpath

    head = random_head(tiny, kind=kind)
    model = copy.deepcopy(tiny.model).to(dtype)  # a copy: the module's model keeps its float32 weights
    runs = []
    for fast in (True, False):
        proposer = FeatureHeadProposer(head, ProposerContext(model, tiny.tokenizer), EagleOptions(depth=3, topk=3))
        if fastpath.extension() is None:
            pytest.skip(f"the C++ extension is unavailable here ({fastpath._state['failed']})")
        assert proposer.fast is not None  # the extension is there: the head's step must use it
        proposer.fast = proposer.fast if fast else None
        g = torch.Generator().manual_seed(4)
        seqs = []
        with torch.inference_mode():
            for row, n in enumerate((9, 14, 5)):
                prompt = torch.randint(3, 300, (n,), generator=g).tolist()
                seq = Sequence(prompt, GEN, tiny.tokenizer, capacity=64)
                proposer.begin(row, seq)
                out = model(torch.tensor([prompt]), torch.arange(n)[None], model.new_cache(1, n),
                            return_hidden=head.config.taps)
                proposer.prefilled(row, _features(out, head))
                seq.append([int(out.logits[0, -1].argmax())])
                seqs.append(seq)
            state, logp = proposer._feed_pending([0, 1, 2], seqs, 27)
            grown = proposer._grow([1, 2], state[1:], logp[1:], 3, 3, torch.tensor([10**6, 10**6]))
            if fast:  # the C++ loop grows the tree the Python loop grows with the same step, bit for bit
                for keep, nodes in (([10**6, 10**6], 3 + 9 + 9), ([4, 9], None), ([1, 1], 3)):  # [1, 1]: settled at once
                    cpp = proposer._grow([1, 2], state[1:], logp[1:], 3, 3, torch.tensor(keep))
                    py = proposer._grow_python([1, 2], state[1:], logp[1:], 3, 3, torch.tensor(keep))
                    assert all(torch.equal(a, b) for a, b in zip(cpp, py)), keep
                    assert nodes is None or cpp[0].shape == (2, nodes)
        runs.append((state, logp, grown, proposer.cache.k[:, :, :14].clone()))
    (s1, l1, g1, k1), (s2, l2, g2, k2) = runs
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert torch.allclose(s1.float(), s2.float(), atol=tol, rtol=tol)
    assert torch.allclose(l1, l2, atol=tol * 10, rtol=tol)
    assert torch.allclose(k1.float(), k2.float(), atol=tol, rtol=tol)  # the exact entries each row fed
    if dtype == torch.float32:
        assert torch.equal(g1[0], g2[0]) and torch.equal(g1[1], g2[1])  # the same tree
        assert torch.allclose(g1[2], g2[2], atol=1e-4)
