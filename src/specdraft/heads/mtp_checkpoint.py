"""MTP module checkpoints: our own (trained here, DeepSeek-V3 key names), and the native MTP
weights some models ship inside their own checkpoint.

Ours: ``config.json`` (``architectures: ["specdraft-mtp"]``, the block's shape, the draft
vocabulary, the target's name and layer count) and ``model.safetensors`` with the module's
tensors under ``model.layers.{L}.`` (L = the target's layer count, where DeepSeek-V3 puts its
first MTP layer) plus ``d2t``/``t2d``.

Native layouts, read from a target's Hugging Face folder (``load_native_mtp``), first MTP layer
only; the LM head is the target's unless the layer has its own:

| layout | prefix | embedding norm | hidden norm | projection (input order) | output norm |
|---|---|---|---|---|---|
| DeepSeek-V3 | ``model.layers.{L}.`` | ``enorm`` | ``hnorm`` | ``eh_proj`` ([emb, hidden]) | ``shared_head.norm`` |
| Qwen3-Next | ``mtp.`` (block ``mtp.layers.0.``) | ``pre_fc_norm_embedding`` | ``pre_fc_norm_hidden`` | ``fc`` ([emb, hidden]) | ``norm`` |
| MiMo | ``model.mtp_layers.0.`` | ``token_layernorm`` | ``hidden_layernorm`` | ``input_proj`` ([hidden, emb]) | ``final_layernorm`` |

The block must be a plain Llama/Qwen2 decoder layer (the architectures this project runs);
anything else (MLA, mixture of experts, q/k norms) is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specdraft.errors import ModelFileError, SpecdraftError
from specdraft.heads.feature_head import HeadConfig
from specdraft.heads.mtp import MtpHead
from specdraft.heads.vocab import DraftVocab
from specdraft.model.config import ModelConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
BLOCK = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
         "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


def save_mtp(head: MtpHead, folder: str | Path, target: ModelConfig, name: str,
             extra: dict[str, Any] | None = None, dtype: torch.dtype | None = None) -> Path:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = head.config
    prefix = f"model.layers.{c.target_layers}."
    tensors = {prefix + k: (v.to(dtype) if dtype is not None else v).detach().contiguous()
               for k, v in head.state_dict().items()}
    tensors.update({"d2t": head.vocab.d2t, "t2d": head.vocab.t2d})
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {"architectures": ["specdraft-mtp"], "mtp_layout": "deepseek_v3", "num_nextn_predict_layers": 1,
              "hidden_size": c.hidden_size, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
              "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps,
              "attention_bias": head.attention_bias, "vocab_size": c.target_vocab, "draft_vocab_size": c.draft_vocab,
              "num_hidden_layers": c.target_layers,
              "torch_dtype": str(dtype or head.eh_proj.weight.dtype).removeprefix("torch."),
              "specdraft": {"target": name, **(extra or {})}}
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder


def load_mtp(folder: str | Path, target: ModelConfig) -> MtpHead:
    """A module saved by ``save_mtp``, checked against the target (one-line refusals)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise ModelFileError(f"mtp: no module in {folder} (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        raw = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
        if raw.get("architectures") != ["specdraft-mtp"]:
            raise ModelFileError(f"mtp: {folder} holds a {raw.get('architectures') or raw.get('architecture')} "
                                 f"checkpoint, not an MTP module (specdraft-mtp)")
        tensors = load_file(str(folder / WEIGHTS_FILE))
        shape = (int(raw["hidden_size"]), int(raw["vocab_size"]), int(raw["num_hidden_layers"]))
    except (json.JSONDecodeError, SafetensorError, KeyError, ValueError, TypeError, OSError) as e:
        raise ModelFileError(f"mtp: {folder} is corrupt or truncated ({type(e).__name__})") from None
    _check_target(shape, target, folder, raw.get("specdraft", {}).get("target", "?"))
    prefix = f"model.layers.{target.num_layers}."
    try:
        vocab = DraftVocab.from_maps(tensors.pop("d2t"), tensors.pop("t2d"))
        head = MtpHead(HeadConfig.for_target(target, vocab.size, (target.num_layers,)), vocab,
                       bool(raw.get("attention_bias", False)))
        head.load_state_dict({k.removeprefix(prefix): v.float() for k, v in tensors.items()}, strict=True)
    except (KeyError, RuntimeError, SpecdraftError) as e:
        raise ModelFileError(f"mtp: {folder} does not hold the tensors its config describes ({type(e).__name__})") from None
    return head


def _check_target(shape: tuple[int, int, int], target: ModelConfig, folder: Path, name: str) -> None:
    if shape != (target.hidden_size, target.vocab_size, target.num_layers):
        raise ModelFileError(
            f"mtp: the module in {folder} was made for a target with hidden size {shape[0]}, {shape[1]} tokens and "
            f"{shape[2]} layers ({name}); this model has {target.hidden_size}, {target.vocab_size} and "
            f"{target.num_layers}")


# --------------------------------------------------------------------------- native MTP weights

_LAYOUTS: dict[str, tuple[str, str, dict[str, str]]] = {
    # name: (probe key, block prefix, our name -> theirs, relative to the layer prefix)
    "deepseek_v3": ("model.layers.{L}.eh_proj.weight", "model.layers.{L}.",
                    {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head.norm": "shared_head.norm",
                     "shared_head.head": "shared_head.head"}),
    "qwen3_next": ("mtp.fc.weight", "mtp.layers.0.",
                   {"enorm": "mtp.pre_fc_norm_embedding", "hnorm": "mtp.pre_fc_norm_hidden", "eh_proj": "mtp.fc",
                    "shared_head.norm": "mtp.norm"}),
    "mimo": ("model.mtp_layers.0.input_proj.weight", "model.mtp_layers.0.",
             {"enorm": "model.mtp_layers.0.token_layernorm", "hnorm": "model.mtp_layers.0.hidden_layernorm",
              "eh_proj": "model.mtp_layers.0.input_proj", "shared_head.norm": "model.mtp_layers.0.final_layernorm"}),
}


def native_mtp_layout(keys: set[str], num_layers: int) -> str | None:
    """Which native layout a checkpoint's tensor names follow (None: it ships no MTP layer)."""
    for name, (probe, _, _) in _LAYOUTS.items():
        if probe.format(L=num_layers) in keys:
            return name
    return None


def load_native_mtp(model_folder: str | Path, target: ModelConfig, target_lm_head: Tensor) -> MtpHead:
    """The first MTP layer a Hugging Face checkpoint ships, as an ``MtpHead`` over the full
    vocabulary (its LM head: the layer's own, else the target's)."""
    from safetensors import safe_open

    folder = Path(model_folder).expanduser()
    files = sorted(folder.glob("*.safetensors")) if str(model_folder) and folder.is_dir() else []
    if not files:
        raise ModelFileError(f"mtp: {folder} is not a Hugging Face model folder with safetensors files")
    where: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), "pt") as s:
                where.update({k: f for k in s.keys()})
        except Exception as e:  # noqa: BLE001  (safetensors raises several kinds for a damaged file)
            raise ModelFileError(f"mtp: {f} is corrupt or truncated ({type(e).__name__})") from None
    layout = native_mtp_layout(set(where), target.num_layers)
    if layout is None:
        raise ModelFileError(f"mtp: {folder} ships no MTP layer (DeepSeek-V3, Qwen3-Next or MiMo names)")
    _, block, names = _LAYOUTS[layout]
    block = block.format(L=target.num_layers)
    lookup = {ours: theirs.format(L=target.num_layers) if layout != "deepseek_v3" else block + theirs
              for ours, theirs in names.items()}
    state: dict[str, Tensor] = {}
    for ours, theirs in lookup.items():
        if theirs + ".weight" in where:
            state[ours + ".weight"] = _read(where, theirs + ".weight")
    for key in BLOCK + BIASES:
        if block + key in where:
            state[key] = _read(where, block + key)
    missing = [k for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", *BLOCK)
               if k not in state]
    if missing:
        raise ModelFileError(f"mtp: the {layout} MTP layer in {folder} is not a plain Llama/Qwen2 block "
                             f"(no {missing[0]}); only those are supported")
    if layout == "mimo":  # MiMo concatenates [hidden, embedding]; ours is [embedding, hidden]
        w = state["eh_proj.weight"]
        h = target.hidden_size
        state["eh_proj.weight"] = torch.cat([w[:, h:], w[:, :h]], dim=1)
    state.setdefault("shared_head.head.weight", target_lm_head.detach().float().cpu())
    vocab = DraftVocab(torch.arange(target.vocab_size), target.vocab_size)
    head = MtpHead(HeadConfig.for_target(target, target.vocab_size, (target.num_layers,)), vocab,
                   "self_attn.q_proj.bias" in state)
    try:
        head.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    except RuntimeError as e:
        raise ModelFileError(f"mtp: the MTP layer in {folder} does not match the model's shapes ({type(e).__name__})") from None
    return head


def _read(where: dict[str, Path], key: str) -> Tensor:
    from safetensors import safe_open

    with safe_open(str(where[key]), "pt") as s:
        return s.get_tensor(key)
