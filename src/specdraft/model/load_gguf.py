"""GGUF -> (ModelConfig, weights in Hugging Face naming). Dequantizes with the ``gguf`` package.

llama.cpp's converter permutes the rows of the Q and K projections of llama-architecture
models (for its interleaved RoPE); we use Hugging Face's ``rotate_half`` RoPE, so the
permutation is undone here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specdraft.errors import ModelFileError, UnsupportedModelError
from specdraft.model.config import ModelConfig, RopeScaling
from specdraft.model.quant import INT4_FORMATS, Int4Weight, Q8Weight

# GGUF architecture name -> our architecture name. llama.cpp writes Mistral models as "llama".
_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
SUPPORTED_QUANTS = ("F32", "F16", "BF16", "F64", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K")


def open_gguf(path: Path) -> Any:
    """Open a GGUF file; a missing, truncated or corrupt file raises ModelFileError."""
    import gguf

    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelFileError(f"{path} is not a GGUF file (bad magic bytes)")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/IndexError/... on damaged files
        raise ModelFileError(f"{path} is truncated or corrupt: {type(e).__name__}: {e}") from None


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value as a Python object (str, int, float, bool or list), or default."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_config(reader: Any, path: Path) -> ModelConfig:
    gguf_arch = field_value(reader, "general.architecture")
    if gguf_arch not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path.name}: unsupported architecture {gguf_arch!r}; supported: {', '.join(_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None, required: bool = True) -> Any:
        v = field_value(reader, f"{gguf_arch}.{key}", default)
        if v is None and required:
            raise ModelFileError(f"{path.name}: metadata key {gguf_arch}.{key} is missing")
        return v

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = get("vocab_size", None, required=False)
    if vocab is None:
        vocab = len(field_value(reader, "tokenizer.ggml.tokens", []))
    return ModelConfig(
        architecture=_ARCHITECTURES[gguf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(lambda k: get(k, None, required=False)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(get("context_length")),
        tie_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        name=str(field_value(reader, "general.name", path.stem)),
    )


def _rope_scaling(get: Any) -> RopeScaling | None:
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(get("rope.scaling.factor") or 1.0)
    original = get("rope.scaling.original_context_length")
    return RopeScaling(kind=str(kind), factor=factor, original_max_position=int(original) if original else None)


def _dequantize(t: Any) -> Tensor:
    from gguf import quants

    if t.tensor_type.name not in SUPPORTED_QUANTS:
        raise UnsupportedModelError(f"tensor {t.name}: quantization {t.tensor_type.name} is not supported")
    array = quants.dequantize(t.data, t.tensor_type)
    shape = tuple(int(n) for n in reversed(t.shape))  # GGML lists dims innermost first
    return torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))


def unpermute_rows(w: Tensor | Int4Weight, heads: int) -> Tensor | Int4Weight:
    """Undo llama.cpp's Q/K row permutation. w: [heads * head_dim, ...] -> same shape."""
    rows = w.shape[0]
    if isinstance(w, Int4Weight):
        order = unpermute_rows(torch.arange(rows), heads)  # [rows]: the source row of each row
        return w.rows(order)
    rest = w.shape[1:]
    return w.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def _read(t: Any, int4: bool) -> Tensor | Int4Weight:
    """A tensor dequantized to float32, or (int4) a Q4_0 / Q4_1 matrix kept at 4 bits."""
    if int4 and t.tensor_type.name in INT4_FORMATS and len(t.shape) == 2:
        shape = (int(t.shape[1]), int(t.shape[0]))  # GGML lists dims innermost first
        return Int4Weight.from_gguf_blocks(t.data, t.tensor_type.name, shape)
    return _dequantize(t)


HEAD_Q8 = "lm_head.q8"  # int4 mode: the LM head's Q8_0 blocks as stored (beside its dequantized copy)


def load_gguf(path: Path, int4: bool = False) -> tuple[ModelConfig, dict[str, Tensor | Int4Weight | Q8Weight], Any]:
    """Read config and dequantized float32 weights (HF names); with ``int4`` the Q4_0 / Q4_1
    matrices stay 4-bit (``Int4Weight``) and a Q8_0 LM head (the token embedding where they are
    tied) is also kept as stored, under ``HEAD_Q8``. Returns the reader too, for the tokenizer."""
    reader = open_gguf(path)
    config = read_config(reader, path)
    weights: dict[str, Tensor | Int4Weight | Q8Weight] = {}
    names = {_hf_name(t.name) for t in reader.tensors}
    head = "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight"
    for t in reader.tensors:
        name = _hf_name(t.name)
        if int4 and name == head and t.tensor_type.name == "Q8_0" and len(t.shape) == 2:
            weights[HEAD_Q8] = Q8Weight.from_gguf_blocks(t.data, (int(t.shape[1]), int(t.shape[0])))
        if t.name == "rope_freqs.weight":  # llama3-style scaling, stored as per-frequency divisors
            factors = tuple(float(x) for x in _dequantize(t).flatten())
            config = dataclasses.replace(config, rope_freq_factors=factors)
            continue
        if name is None:
            continue
        w = _read(t, int4 and name != "model.embed_tokens.weight")
        if config.architecture in ("llama", "mistral") and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rows(w, config.num_heads)
        elif config.architecture in ("llama", "mistral") and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rows(w, config.num_kv_heads)
        weights[name] = w
    return config, weights, reader


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    return None
