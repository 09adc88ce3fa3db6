"""EAGLE-3 head checkpoints: ``config.json`` + ``model.safetensors`` in the layout SpecForge
writes and SGLang and vLLM load, so a head trained here serves there unchanged.

- config.json: a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``,
  ``num_hidden_layers: 1``, the target's attention/MLP shape, ``vocab_size`` (the target's),
  ``draft_vocab_size``, and ``eagle_config.eagle_aux_hidden_state_layer_ids`` (the taps: the
  inputs of those target layers, i.e. our tap i = the output of the first i layers).
  ``specdraft`` holds what we add: the target's name and layer count, the training settings
  and the held-out measure.
- model.safetensors: ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``,
  ``d2t`` (int64 offsets) and ``t2d`` (bool). The embedding is the target's and not stored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specdraft.errors import ModelFileError, SpecdraftError
from specdraft.heads.eagle import EagleHead
from specdraft.heads.feature_head import HeadConfig
from specdraft.heads.vocab import DraftVocab
from specdraft.model.config import ModelConfig, RopeScaling

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def eagle3_config(head: EagleHead, target: ModelConfig, name: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json of an EAGLE-3 head for ``target``."""
    c = head.config
    rope = None if target.rope_scaling is None else _hf_rope_scaling(target.rope_scaling)
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": target.rope_theta,
        "rope_scaling": rope, "max_position_embeddings": target.max_position,
        "vocab_size": c.target_vocab, "draft_vocab_size": c.draft_vocab, "tie_word_embeddings": False,
        "torch_dtype": str(head.fc.weight.dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.taps), "use_aux_hidden_state": True},
        "specdraft": {"target": name, "target_layers": c.target_layers, **(extra or {})},
    }


def _hf_rope_scaling(r: RopeScaling) -> dict[str, Any]:
    """Hugging Face's ``rope_scaling`` for the target's scaling (what the serving engine rebuilds)."""
    out: dict[str, Any] = {"rope_type": r.kind, "factor": r.factor}
    if r.original_max_position is not None:
        out["original_max_position_embeddings"] = r.original_max_position
    if r.kind == "llama3":
        out.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
    if r.kind == "yarn":
        out.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow)
        if r.attention_factor is not None:
            out["attention_factor"] = r.attention_factor
    return out


def save_eagle(head: EagleHead, folder: str | Path, target: ModelConfig, name: str,
               extra: dict[str, Any] | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write the head (in ``dtype``, default its own) and its config."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if dtype is not None else v).detach().contiguous() for k, v in head.state_dict().items()}
    vocab = head.vocab
    tensors.update({"d2t": vocab.d2t, "t2d": vocab.t2d})
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    config = eagle3_config(head, target, name, extra)
    if dtype is not None:
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder


def load_eagle(folder: str | Path, target: ModelConfig) -> EagleHead:
    """A head saved by ``save_eagle`` (or SpecForge, for a Llama-family target), checked against
    the target: refused in one line when missing, corrupt, or made for another target."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise ModelFileError(f"eagle: no head in {folder} (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        raw = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
        tensors = load_file(str(folder / WEIGHTS_FILE))
        if raw.get("architectures") != ["LlamaForCausalLMEagle3"]:
            raise ModelFileError(f"eagle: {folder} holds a {raw.get('architectures') or raw.get('architecture')} "
                                 f"checkpoint, not an EAGLE-3 head (LlamaForCausalLMEagle3)")
        ours = raw.get("specdraft", {})
        taps = tuple(int(t) for t in raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        layers = int(ours.get("target_layers", target.num_layers))
        shape = (int(raw["hidden_size"]), int(raw["vocab_size"]), layers)
    except (json.JSONDecodeError, SafetensorError, KeyError, ValueError, TypeError, OSError) as e:
        raise ModelFileError(f"eagle: {folder} is corrupt or truncated ({type(e).__name__})") from None
    if shape != (target.hidden_size, target.vocab_size, target.num_layers):
        raise ModelFileError(
            f"eagle: the head in {folder} was trained for a target with hidden size {shape[0]}, {shape[1]} tokens and "
            f"{shape[2]} layers ({ours.get('target', '?')}); this model has {target.hidden_size}, {target.vocab_size} "
            f"and {target.num_layers}")
    try:
        config = HeadConfig(int(raw["hidden_size"]), int(raw["num_attention_heads"]), int(raw["num_key_value_heads"]),
                             int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]),
                             int(raw["intermediate_size"]), float(raw["rms_norm_eps"]), taps,
                             int(raw["draft_vocab_size"]), int(raw["vocab_size"]), layers)
        head = EagleHead(config, DraftVocab.from_maps(tensors.pop("d2t"), tensors.pop("t2d")))
        tensors.pop("embed_tokens.weight", None)  # SpecForge may store the target's embedding
        head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    except (KeyError, RuntimeError, SpecdraftError, ValueError, TypeError, ZeroDivisionError) as e:
        raise ModelFileError(f"eagle: {folder} does not hold the tensors its config describes ({type(e).__name__})") from None
    if config.head_dim != target.head_dim:
        raise ModelFileError(f"eagle: the head in {folder} has head_dim {config.head_dim}; this model's RoPE has "
                             f"{target.head_dim}")
    return head
