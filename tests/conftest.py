"""Shared fixtures. Model files are written once per session under pytest's tmp folder;
the helpers that write them live in ``tiny_models.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiny_models import write_gguf_model, write_hf_model

# --------------------------------------------------------------------------- tiny models


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama as a Hugging Face folder (config.json, safetensors, tokenizer)."""
    return write_hf_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_gguf(tiny_hf: Path) -> Path:
    """The same weights as ``tiny_hf`` in an F32 GGUF file (llama.cpp layout and metadata)."""
    return write_gguf_model(tiny_hf.parent / "tiny-llama-F32.gguf", tiny_hf, qtype="F32")


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory):
    """Keep the tests' on-disk caches (verify's plain outputs) out of the user's home."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDRAFT_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield
