"""Hugging Face model folder (config.json + *.safetensors) -> (ModelConfig, weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specdraft.errors import ModelFileError, UnsupportedModelError
from specdraft.model.config import ModelConfig, RopeScaling

_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFileError(f"{path.name} not found in {path.parent}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelFileError(f"{path} must hold a JSON object")
    return data


def read_config(folder: Path) -> ModelConfig:
    raw = read_json(folder / "config.json")
    model_type = raw.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise UnsupportedModelError(
            f"{folder.name}: unsupported model_type {model_type!r}; supported: {', '.join(_MODEL_TYPES)}"
        )
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        return ModelConfig(
            architecture=_MODEL_TYPES[model_type],
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rope_theta=float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(raw),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position=int(raw.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            sliding_window=_sliding_window(raw),
            name=folder.name,
        )
    except KeyError as e:
        raise ModelFileError(f"{folder / 'config.json'}: missing key {e.args[0]!r}") from None


def _sliding_window(raw: dict[str, Any]) -> int | None:
    if raw.get("model_type") == "qwen2" and not raw.get("use_sliding_window", False):
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None


def _rope_scaling(raw: dict[str, Any]) -> RopeScaling | None:
    s = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not s:
        return None
    kind = s.get("rope_type", s.get("type"))
    if kind in (None, "default"):
        return None
    if s.get("mscale") or s.get("mscale_all_dim") or s.get("truncate") is False:
        raise UnsupportedModelError(f"rope scaling options mscale/mscale_all_dim/truncate=false are not supported")
    original = s.get("original_max_position_embeddings")
    if not original and kind in ("llama3", "yarn"):  # transformers defaults it to the context length
        original = raw.get("max_position_embeddings")
    return RopeScaling(
        kind=str(kind),
        factor=float(s.get("factor", 1.0)),
        original_max_position=int(original) if original else None,
        low_freq_factor=float(s.get("low_freq_factor", 1.0)),
        high_freq_factor=float(s.get("high_freq_factor", 4.0)),
        beta_fast=float(s.get("beta_fast", 32.0)),
        beta_slow=float(s.get("beta_slow", 1.0)),
        attention_factor=s.get("attention_factor"),
    )


def load_hf(folder: Path) -> tuple[ModelConfig, dict[str, Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"no *.safetensors weights in {folder}")
    weights: dict[str, Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelFileError(f"{f} is truncated or corrupt: {e}") from None
    return config, {k: v.float() for k, v in weights.items()}
