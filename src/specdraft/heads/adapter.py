"""A trained early-exit adapter for self-speculation (Kangaroo, Liu et al. 2024).

Self-speculation drafts with the target's first L layers, but an untrained early exit (the
target's final norm and LM head on layer L's state) does not predict the last layer: on the
default model it is accepted about 0% of the time. Kangaroo adds a small adapter between the
shallow sub-network and the LM head: one attention layer and two norms,

    h' = h + o_proj(attention(input_layernorm(h)))      (causal over the row's layer-L states)
    logits = target_lm_head(norm(h'))

where h is the target's layer-L state (tap L) of each position. The adapter owns only its
attention's keys/values; the LM head is the target's. With ``o_proj`` = 0 and ``norm`` = the
target's final norm it is exactly the untrained early exit, where training starts.

An adapter may carry a reduced draft vocabulary (``d2t`` / ``t2d`` in its file, EAGLE-3's
names; chosen after training from the target's answers): drafting then reads only those rows of
the target's LM head (:class:`specdraft.heads.vocab.ReducedHead`), the larger part of a draft
token's cost at the full vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from specdraft.errors import ModelFileError, SpecdraftError
from specdraft.heads.feature_head import Attend, AttentionProjections
from specdraft.heads.vocab import DraftVocab
from specdraft.model.config import ModelConfig
from specdraft.model.rope import apply_rope
from specdraft.model.transformer import RMSNorm

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    exit_layer: int  # L: the adapter reads the output of the target's first L layers
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    target_vocab: int
    target_layers: int

    def __post_init__(self) -> None:
        if not 1 <= self.exit_layer < self.target_layers:
            raise SpecdraftError(f"adapter: exit layer must be in 1..{self.target_layers - 1}, got {self.exit_layer}")

    @classmethod
    def for_target(cls, c: ModelConfig, exit_layer: int) -> "AdapterConfig":
        return cls(exit_layer, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.vocab_size,
                   c.num_layers)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


class ExitAdapter(nn.Module):
    def __init__(self, config: AdapterConfig, vocab: DraftVocab | None = None) -> None:
        super().__init__()
        self.config = config
        self.vocab = vocab  # the tokens it drafts (None: the whole vocabulary)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = AttentionProjections(config, config.hidden_size)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @torch.no_grad()
    def start_from(self, target_norm: Tensor) -> "ExitAdapter":
        """The untrained early exit: no attention output, the target's final norm."""
        self.self_attn.o_proj.weight.zero_()
        self.norm.weight.copy_(target_norm.float())
        return self

    def layer(self, hidden: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        """hidden: [B, T, H] layer-L states; cos, sin: [B, T, 1, D] -> pre-norm states [B, T, H]."""
        c, a = self.config, self.self_attn
        b, t, _ = hidden.shape
        x = self.input_layernorm(hidden)
        q = apply_rope(a.q_proj(x).view(b, t, c.num_heads, c.head_dim), cos, sin).transpose(1, 2)  # [B, Hq, T, D]
        k = apply_rope(a.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim), cos, sin).transpose(1, 2)  # [B, Hkv, T, D]
        v = a.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        out = attend(q, k, v).transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim)  # [B, T, Hq*D]
        return hidden + a.o_proj(out)

    def logits(self, prenorm: Tensor, lm_head: nn.Module) -> Tensor:
        """[..., H] -> [..., V] float32 through the target's LM head."""
        return lm_head(self.norm(prenorm).to(lm_head.weight.dtype)).float()


def save_adapter(adapter: ExitAdapter, folder: str | Path, name: str, extra: dict[str, Any] | None = None,
                 dtype: torch.dtype | None = None) -> Path:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = adapter.config
    tensors = {k: (v.to(dtype) if dtype is not None else v).detach().contiguous() for k, v in adapter.state_dict().items()}
    if adapter.vocab is not None:
        tensors |= {"d2t": adapter.vocab.d2t, "t2d": adapter.vocab.t2d}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {"architectures": ["specdraft-exit-adapter"], "exit_layer": c.exit_layer, "hidden_size": c.hidden_size,
              "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
              "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.target_vocab, "num_hidden_layers": c.target_layers,
              **({"draft_vocab_size": adapter.vocab.size} if adapter.vocab is not None else {}),
              "specdraft": {"target": name, **(extra or {})}}
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder


def load_adapter(folder: str | Path, target: ModelConfig) -> ExitAdapter:
    """An adapter saved by ``save_adapter``, checked against the target (one-line refusals)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise ModelFileError(f"layer-skip: no adapter in {folder} (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        raw = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
        if raw.get("architectures") != ["specdraft-exit-adapter"]:
            raise ModelFileError(f"layer-skip: {folder} holds a {raw.get('architectures') or raw.get('architecture')} "
                                 f"checkpoint, not an early-exit adapter")
        tensors = load_file(str(folder / WEIGHTS_FILE))
        shape = (int(raw["hidden_size"]), int(raw["vocab_size"]), int(raw["num_hidden_layers"]))
        exit_layer = int(raw["exit_layer"])
    except (json.JSONDecodeError, SafetensorError, KeyError, ValueError, TypeError, OSError) as e:
        raise ModelFileError(f"layer-skip: {folder} is corrupt or truncated ({type(e).__name__})") from None
    if shape != (target.hidden_size, target.vocab_size, target.num_layers):
        raise ModelFileError(
            f"layer-skip: the adapter in {folder} was trained for a target with hidden size {shape[0]}, {shape[1]} "
            f"tokens and {shape[2]} layers ({raw.get('specdraft', {}).get('target', '?')}); this model has "
            f"{target.hidden_size}, {target.vocab_size} and {target.num_layers}")
    try:
        maps = (tensors.pop("d2t"), tensors.pop("t2d")) if "d2t" in tensors or "t2d" in tensors else None
        vocab = DraftVocab.from_maps(*maps) if maps is not None else None
    except (KeyError, SpecdraftError) as e:
        raise ModelFileError(f"layer-skip: {folder} has a broken draft vocabulary ({e})") from None
    if vocab is not None and vocab.target_size != target.vocab_size:
        raise ModelFileError(f"layer-skip: the draft vocabulary in {folder} maps {vocab.target_size} tokens; "
                             f"this model has {target.vocab_size}")
    adapter = ExitAdapter(AdapterConfig.for_target(target, exit_layer), vocab)
    try:
        adapter.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    except RuntimeError as e:
        raise ModelFileError(f"layer-skip: {folder} does not hold the tensors its config describes ({type(e).__name__})") from None
    return adapter
