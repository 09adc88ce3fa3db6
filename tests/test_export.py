"""export_truncated: the exported folder loads, has the target's vocabulary, and computes the
target's early-exit forward; bad layer counts are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.model.export import export_truncated
from specdraft.model.loader import load
from tiny_models import write_gguf_model, write_hf_model


@pytest.fixture(scope="module")
def qwen_gguf(tiny_hf: Path) -> Path:
    """A 3-layer Qwen2 (q/k/v biases, tied embeddings) as a GGUF file: a GGUF tokenizer too."""
    folder = write_hf_model(tiny_hf.parent / "qwen-3", "qwen2", seed=2, layers=3, tie_embeddings=True)
    return write_gguf_model(tiny_hf.parent / "qwen-3.gguf", folder, qtype="F32")


@pytest.mark.parametrize("source", ["tiny_hf", "qwen_gguf"])
def test_exported_folder_is_the_early_exit_model(source: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    target = load(request.getfixturevalue(source))
    layers = target.config.num_layers - 1
    draft = load(export_truncated(target, layers, tmp_path / "draft"))
    assert draft.config.num_layers == layers
    assert draft.tokenizer.same_vocabulary(target.tokenizer)
    assert draft.tokenizer.eos_ids == target.tokenizer.eos_ids
    assert draft.tokenizer.encode_chat([{"role": "user", "content": "hi there"}]) == \
        target.tokenizer.encode_chat([{"role": "user", "content": "hi there"}])
    tokens = torch.randint(3, 320, (2, 12), generator=torch.Generator().manual_seed(0))  # [2, 12]
    positions = torch.arange(12).expand(2, 12)  # [2, 12]
    with torch.no_grad():
        want = target.model(tokens, positions, target.model.new_cache(2, 12), num_layers=layers).logits
        got = draft.model(tokens, positions, draft.model.new_cache(2, 12)).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bad_layer_count_is_refused(tiny_hf: Path, tmp_path: Path) -> None:
    target = load(tiny_hf)
    for layers in (0, target.config.num_layers + 1):
        with pytest.raises(SpecdraftError, match="layers must be"):
            export_truncated(target, layers, tmp_path / "x")
