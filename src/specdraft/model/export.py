"""Write a loaded model, cut after its first layers, as a Hugging Face model folder.

``export_truncated(loaded, layers, folder)`` writes ``config.json``, ``model.safetensors``
(the first ``layers`` decoder layers, the embeddings, the final norm and the LM head, in
Hugging Face naming, q/k/v and gate/up split again), ``tokenizer.json``,
``tokenizer_config.json`` and ``generation_config.json``. Loading the folder gives the
target's early-exit model (``forward(..., num_layers=layers)``) with the target's tokenizer:
a ready-made draft model for the ``draft`` method when no smaller model of the same family is
at hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import Tensor

from specdraft.errors import SpecdraftError, UnsupportedModelError
from specdraft.model.config import ModelConfig, RopeScaling
from specdraft.model.loader import LoadedModel
from specdraft.model.tokenizer import Tokenizer
from specdraft.model.transformer import Transformer


def export_truncated(loaded: LoadedModel, layers: int, folder: str | Path) -> Path:
    """Write the first ``layers`` layers of ``loaded`` (plus its norm, head and tokenizer) as a
    Hugging Face folder; returns the folder."""
    config = loaded.config
    if not 1 <= layers <= config.num_layers:
        raise SpecdraftError(f"export: layers must be in 1..{config.num_layers}, got {layers}")
    if config.rope_freq_factors is not None:
        raise UnsupportedModelError("export: per-frequency RoPE factors (GGUF rope_freqs) have no config.json form")
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", hf_config(config, layers))
    save_file(hf_weights(loaded.model, layers), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "tokenizer.json").write_text(loaded.tokenizer.to_json(), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config(loaded.tokenizer, config.max_position))
    _write_json(out / "generation_config.json", generation_config(loaded.tokenizer))
    return out


def hf_config(c: ModelConfig, layers: int) -> dict[str, Any]:
    """config.json for ``c`` with ``layers`` decoder layers."""
    raw: dict[str, Any] = {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM"}[c.architecture]],
        "model_type": c.architecture,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rope_theta": c.rope_theta,
        "rope_scaling": _rope_scaling(c.rope_scaling),
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position,
        "tie_word_embeddings": c.tie_embeddings,
        "torch_dtype": "float32",
    }
    if c.architecture == "qwen2":
        raw.update(use_sliding_window=c.sliding_window is not None, sliding_window=c.sliding_window)
    else:
        raw.update(attention_bias=c.attention_bias, sliding_window=c.sliding_window)
    return raw


def _rope_scaling(s: RopeScaling | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {"rope_type": s.kind, "factor": s.factor, "original_max_position_embeddings": s.original_max_position,
            "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
            "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "attention_factor": s.attention_factor}


def hf_weights(model: Transformer, layers: int) -> dict[str, Tensor]:
    """The first ``layers`` layers' weights in Hugging Face naming (fused projections split)."""
    c = model.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    w: dict[str, Tensor] = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight}
    if not c.tie_embeddings:
        w["lm_head.weight"] = model.lm_head.weight
    for i in range(layers):
        block, p = model.layers[i], f"model.layers.{i}."
        for name, part in zip(("q", "k", "v"), block.wqkv.weight.split([q, kv, kv])):
            w[p + f"self_attn.{name}_proj.weight"] = part
        if block.wqkv.bias is not None:
            for name, part in zip(("q", "k", "v"), block.wqkv.bias.split([q, kv, kv])):
                w[p + f"self_attn.{name}_proj.bias"] = part
        w[p + "self_attn.o_proj.weight"] = block.wo.weight
        w[p + "input_layernorm.weight"] = block.attn_norm.weight
        w[p + "post_attention_layernorm.weight"] = block.ffn_norm.weight
        gate, up = block.w_gate_up.weight.chunk(2)
        w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = gate, up
        w[p + "mlp.down_proj.weight"] = block.w_down.weight
    return {k: v.detach().cpu().contiguous().clone() for k, v in w.items()}


def tokenizer_config(tok: Tokenizer, max_position: int) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens by content, BOS/EOS flags, chat template."""
    strings = tok.token_strings()

    def content(token_id: int | None) -> str | None:
        return strings[token_id] if token_id is not None else None

    return {
        "bos_token": content(tok.bos_id),
        "eos_token": content(tok.eos_id),
        "pad_token": content(tok.pad_id),
        "unk_token": content(tok.unk_id),
        "add_bos_token": tok.add_bos,
        "add_eos_token": tok.add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position,
        "chat_template": tok.chat_template,
    }


def generation_config(tok: Tokenizer) -> dict[str, Any]:
    """generation_config.json: BOS, and every id that ends generation (the model's EOS first)."""
    eos = [tok.eos_id] if tok.eos_id is not None else []
    eos += sorted(i for i in tok.eos_ids if i != tok.eos_id)
    return {"bos_token_id": tok.bos_id, "eos_token_id": eos, "pad_token_id": tok.pad_id}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
