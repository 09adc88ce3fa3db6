"""Plain generation on a tiny random model: ragged batches, stop conditions, streaming."""

import copy

import pytest
import torch

from specdraft.batching import prefill, prefill_groups
from specdraft.engine import Engine
from specdraft.errors import ContextOverflowError, SpecdraftError
from specdraft.model.loader import load
from specdraft.sampling import Sampling
from specdraft.sequence import GenerationConfig

PROMPTS = ["Hello there, how are", "The quick brown fox jumps over the lazy dog and then", "a", "Once upon a time"]


@pytest.fixture(scope="module")
def tiny(tiny_hf):
    return load(tiny_hf)


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine(tiny.model, tiny.tokenizer)


def encode(tiny, texts):
    return [tiny.tokenizer.encode(t) for t in texts]


def test_ragged_batch_equals_each_row_alone(tiny, engine):
    prompts = encode(tiny, PROMPTS)
    cfg = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    batch = engine.generate(prompts, cfg)
    for p, r in zip(prompts, batch):
        alone = engine.generate([p], cfg)[0]
        assert r.tokens == alone.tokens
        assert len(r.tokens) == 24 and r.finish_reason == "length"


def test_stream_concatenates_to_final_text(tiny, engine):
    prompts = encode(tiny, PROMPTS)
    chunks = {i: [] for i in range(len(prompts))}
    results = engine.generate(prompts, GenerationConfig(max_new_tokens=20, ignore_eos=True),
                              on_text=lambda e: chunks[e.row].append(e.text))
    for i, r in enumerate(results):
        assert "".join(chunks[i]) == r.text
        assert r.text == tiny.tokenizer.decode(r.tokens)


def test_stop_string_cuts_text_and_stream(tiny, engine):
    prompt = encode(tiny, ["The quick brown fox"])
    free = engine.generate(prompt, GenerationConfig(max_new_tokens=30, ignore_eos=True))[0]
    stop = free.text[10:13]
    assert stop.strip(), "the tiny model should produce visible text"
    streamed = []
    cut = engine.generate(prompt, GenerationConfig(max_new_tokens=30, ignore_eos=True, stop=(stop,)),
                          on_text=lambda e: streamed.append(e.text))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]
    assert "".join(streamed) == cut.text


def test_eos_ends_the_request(tiny):
    prompt = encode(tiny, ["Hello there"])
    engine = Engine(tiny.model, tiny.tokenizer)
    free = engine.generate(prompt, GenerationConfig(max_new_tokens=8, ignore_eos=True))[0]
    # pretend the 4th generated token is an end-of-sequence token
    tok = copy.copy(tiny.tokenizer)
    first_eos = free.tokens[3]
    tok.eos_ids = frozenset({first_eos})
    ended = Engine(tiny.model, tok).generate(prompt, GenerationConfig(max_new_tokens=8))[0]
    assert ended.finish_reason == "eos"
    assert ended.tokens == free.tokens[: free.tokens.index(first_eos)]


def test_sampling_is_seeded_and_per_row(tiny, engine):
    prompts = encode(tiny, PROMPTS[:3])
    cfg = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    settings = [Sampling(temperature=1.0, seed=s) for s in (1, 2, 3)]
    a = engine.generate(prompts, cfg, settings)
    b = engine.generate(prompts, cfg, settings)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    alone = engine.generate([prompts[1]], cfg, settings[1])[0]
    assert alone.tokens == a[1].tokens
    other = engine.generate([prompts[1]], cfg, Sampling(temperature=1.0, seed=99))[0]
    assert other.tokens != a[1].tokens


def test_generation_stops_at_the_context_end(tiny, engine):
    limit = tiny.config.max_context
    prompt = [5] * (limit - 4)
    r = engine.generate([prompt], GenerationConfig(max_new_tokens=50, ignore_eos=True))[0]
    assert r.finish_reason == "context"
    assert len(prompt) + len(r.tokens) == limit


@pytest.mark.parametrize(
    "prompts, error",
    [
        ([[5] * 10_000], ContextOverflowError),
        ([[]], SpecdraftError),
        ([], SpecdraftError),
        ([[10**9]], SpecdraftError),
    ],
)
def test_bad_prompts_raise_one_line(engine, prompts, error):
    with pytest.raises(error) as e:
        engine.generate(prompts, GenerationConfig(max_new_tokens=4))
    assert "\n" not in str(e.value)


def test_bad_generation_config():
    with pytest.raises(SpecdraftError):
        GenerationConfig(max_new_tokens=0)
    with pytest.raises(SpecdraftError):
        GenerationConfig(stop=("",))


@pytest.mark.parametrize("lengths, budget", [([5, 300, 7, 120, 1], 400), ([3] * 9, 27), ([50, 50], 10), ([], 10)])
def test_prefill_groups_cover_every_row_within_budget(lengths, budget):
    groups = prefill_groups(lengths, budget)
    assert sorted(r for g in groups for r in g) == list(range(len(lengths)))  # each row exactly once
    for g in groups:
        longest = max(lengths[r] for r in g)
        assert len(g) == 1 or len(g) * longest <= budget
        assert lengths[g[0]] == longest  # longest first
    firsts = [lengths[g[0]] for g in groups]
    assert firsts == sorted(firsts, reverse=True)


def test_grouped_prefill_equals_one_padded_batch(tiny):
    """Rows prefilled in groups (each in its own cache, copied in) get the logits and cache
    contents of one right-padded batch, and the same committed lengths."""
    prompts = encode(tiny, [p * 3 for p in PROMPTS])
    results = []
    pairs = 2 * max(len(p) for p in prompts)
    assert [len(g) for g in prefill_groups([len(p) for p in prompts], pairs)] == [2, 2]
    capacity = max(map(len, prompts)) + 4
    for budget in (10**9, 1, pairs):  # one group; every row alone; two groups of two
        cache = tiny.model.new_cache(len(prompts), capacity)
        with torch.inference_mode():
            logits = tiny.model.lm_logits(prefill(tiny.model, prompts, cache, chunk=8, budget=budget))  # [B, V]
        results.append((logits, cache))
    (one, c1), *others = results
    for grouped, c2 in others:
        assert c2.lengths == c1.lengths == [len(p) for p in prompts]
        torch.testing.assert_close(grouped, one, rtol=0, atol=1e-4)
        for row, n in enumerate(c1.lengths):
            torch.testing.assert_close(c2.k[:, row, :, :n], c1.k[:, row, :, :n], rtol=0, atol=1e-5)
            torch.testing.assert_close(c2.v[:, row, :, :n], c1.v[:, row, :, :n], rtol=0, atol=1e-5)
