"""Trained heads in other engines' layouts, so a GPU server can serve what was trained here.

- ``eagle3``: the layout a saved EAGLE head already has (SpecForge writes it; SGLang's and
  vLLM's ``LlamaForCausalLMEagle3`` load it): copied as it is.
- ``speculators``: the ``speculators`` library's EAGLE-3 format (vLLM loads it too): the same
  tensors with ``midlayer.`` renamed ``layers.0.``, and a config with
  ``speculators_model_type: eagle3``, the decoder layer's Llama config, the draft vocabulary,
  the auxiliary layer ids and a ``speculators_config`` naming the verifier.
- ``vllm-medusa``: vLLM's ``MedusaModel``: head i's residual block as
  ``blocks.{i}.layers.0``, one LM head per head (``lm_heads.{i}``, ours is shared, so copied),
  and ``token_map`` (draft id -> target id) for the reduced vocabulary.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from specdraft.errors import ModelFileError, SpecdraftError

FORMATS = ("eagle3", "speculators", "vllm-medusa")


def export_heads(source: str | Path, out: str | Path, fmt: str, verifier: str = "") -> Path:
    """Write the head folder ``source`` to ``out`` in ``fmt`` (one of FORMATS)."""
    src, dst = Path(source).expanduser(), Path(out).expanduser()
    if fmt not in FORMATS:
        raise SpecdraftError(f"unknown head format {fmt!r}; known: {', '.join(FORMATS)}")
    config = _read_config(src)
    arch = config.get("architectures", [""])[0] if config.get("architectures") else config.get("architecture", "")
    want = "specdraft-medusa" if fmt == "vllm-medusa" else "LlamaForCausalLMEagle3"
    if arch != want:
        raise SpecdraftError(f"{src} holds a {arch or 'unknown'} head; format {fmt} needs a {want} head")
    if dst.resolve() == src.resolve():
        raise SpecdraftError(f"export: the output folder is the source folder ({src})")
    dst.mkdir(parents=True, exist_ok=True)
    try:
        if fmt == "eagle3":
            for name in ("config.json", "model.safetensors"):
                shutil.copyfile(src / name, dst / name)
        elif fmt == "speculators":
            _write(dst, _speculators_config(config, verifier), {
                k.replace("midlayer.", "layers.0.", 1): v for k, v in _read_tensors(src).items()})
        else:
            _write(dst, *_vllm_medusa(config, _read_tensors(src)))
    except (KeyError, FileNotFoundError) as e:
        raise ModelFileError(f"export: {src} lacks {e} (not a complete {want} checkpoint)") from None
    return dst


def _speculators_config(c: dict[str, Any], verifier: str) -> dict[str, Any]:
    layer = {k: c[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                               "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size",
                               "hidden_act") if k in c}
    layer.update({"model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False})
    if c.get("rope_scaling"):
        layer["rope_scaling"] = c["rope_scaling"]  # as the head's config.json has it
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0", "transformer_layer_config": layer,
        "draft_vocab_size": c["draft_vocab_size"], "norm_before_residual": False,
        "target_hidden_size": c["hidden_size"],
        "eagle_aux_hidden_state_layer_ids": c["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier or c.get("specdraft", {}).get("target", ""),
                         "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": c.get("torch_dtype", "bfloat16"),
    }


def _vllm_medusa(c: dict[str, Any], t: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    k = int(c["medusa_num_heads"])
    out: dict[str, torch.Tensor] = {}
    for i in range(k):
        out[f"blocks.{i}.layers.0.weight"] = t[f"blocks.{i}.weight"]
        out[f"blocks.{i}.layers.0.bias"] = t[f"blocks.{i}.bias"]
        out[f"lm_heads.{i}.weight"] = t["lm_head.weight"].clone()
    ids = t["d2t"].to(torch.int64) + torch.arange(t["d2t"].numel())
    out["token_map"] = ids
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": c["hidden_size"],
              "vocab_size": c["vocab_size"], "num_heads": k, "num_hidden_layers": 1,
              "truncated_vocab_size": c["draft_vocab_size"], "original_lm_head": False, "medusa_fc_bias": True}
    return config, out


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFileError(f"no head in {folder} (expected config.json and model.safetensors)") from None
    except (json.JSONDecodeError, OSError) as e:
        raise ModelFileError(f"{folder / 'config.json'} is corrupt ({type(e).__name__})") from None


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(folder / "model.safetensors"))
    except (SafetensorError, OSError) as e:
        raise ModelFileError(f"{folder / 'model.safetensors'} is missing, corrupt or truncated ({type(e).__name__})") from None


def _write(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
