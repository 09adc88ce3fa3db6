"""Tiny random-weight models for the tests, written to disk in the formats we load.

- :func:`write_hf_model` writes a Hugging Face folder (config.json, model.safetensors,
  tokenizer.json, tokenizer_config.json, generation_config.json) for a Llama, Mistral or
  Qwen2 decoder. Everything is deterministic from ``seed``.
- :func:`write_gguf_model` converts such a folder into a GGUF file the way llama.cpp's
  converter does (metadata keys, tensor names, the Q/K row permutation for llama-architecture
  models, tokenizer metadata), optionally quantized.

These are helpers, not tests. ``gguf`` 0.19 cannot quantize to K-quants, so Q4_K and Q6_K
blocks are packed here by a simple (not optimal) quantizer; the layout is checked against
``gguf.quants.dequantize`` by the tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

ARCHITECTURES = ("llama", "mistral", "qwen2")
QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, PAD_TOKEN = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>"
DEFAULT_VOCAB_SIZE = 320

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts several tokens and verifies them with one forward pass.",
    "A small draft model proposes, the large target model disposes.",
    "Hello, world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "The cache stores keys and values for every layer and every position.",
    "Rotary position embeddings rotate pairs of channels by an angle that grows with position.",
    "Numbers like 12345, 3.14159 and 2024 appear in text too.",
    "She sells sea shells by the sea shore; the shells she sells are sea shells.",
    "Once upon a time there was a little model that wanted to predict the next token.",
    "It was the best of times, it was the worst of times.",
    "Question: what is the capital of France? Answer: Paris.",
    "user: write a haiku about rain\nassistant: soft rain on the roof",
    "Tokens, tokens everywhere, and not a merge to spare.",
    "  indented text\twith tabs and  double  spaces  ",
    "UPPER CASE and lower case and MiXeD CaSe words.",
    "Emoji and accents: café, naïve, résumé, über.",
)


# --------------------------------------------------------------------------- Hugging Face folder


def train_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Any:
    """A tiny GPT-2 style byte-level BPE trained on fixed sentences (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"the tiny corpus only yields {tok.get_vocab_size()} tokens, asked for {vocab_size}")
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i
    return tok


def _hf_config(
    arch: str, *, vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
    max_position: int, tie_embeddings: bool, rope_scaling: dict[str, Any] | None, rope_theta: float,
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM"}[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position,
        "rms_norm_eps": 1e-5 if arch != "qwen2" else 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": dict(rope_scaling) if rope_scaling else None,
        "tie_word_embeddings": tie_embeddings,
        "initializer_range": 0.02,
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif arch == "mistral":
        config.update(sliding_window=4096)  # longer than any test sequence: plain causal attention
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    return config


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random weights, scaled so attention is far from uniform and logits vary by position."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + normal(hidden, std=0.1)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight()
        w[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden, std=2.0 / hidden**0.5)
        w[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden, std=2.0 / hidden**0.5)
        w[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden, std=1.0 / hidden**0.5)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim, std=1.0 / (heads * head_dim) ** 0.5)
        if config["model_type"] == "qwen2":
            w[p + "self_attn.q_proj.bias"] = normal(heads * head_dim, std=0.5)
            w[p + "self_attn.k_proj.bias"] = normal(kv_heads * head_dim, std=0.5)
            w[p + "self_attn.v_proj.bias"] = normal(kv_heads * head_dim, std=0.1)
        w[p + "post_attention_layernorm.weight"] = norm_weight()
        w[p + "mlp.gate_proj.weight"] = normal(inter, hidden, std=1.0 / hidden**0.5)
        w[p + "mlp.up_proj.weight"] = normal(inter, hidden, std=1.0 / hidden**0.5)
        w[p + "mlp.down_proj.weight"] = normal(hidden, inter, std=1.0 / inter**0.5)
    w["model.norm.weight"] = norm_weight()
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(config["vocab_size"], hidden, std=1.0 / hidden**0.5)
    return {k: v.contiguous() for k, v in w.items()}


def write_hf_model(
    folder: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    max_position: int = 256,
    tie_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
) -> Path:
    """Write a tiny random Hugging Face model folder and return its path."""
    from safetensors.torch import save_file

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size)
    config = _hf_config(
        arch, vocab_size=vocab_size, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
        intermediate=intermediate, max_position=max_position, tie_embeddings=tie_embeddings,
        rope_scaling=rope_scaling, rope_theta=rope_theta,
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(_random_weights(config, seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)
        },
        "additional_special_tokens": [BOS_TOKEN, EOS_TOKEN],
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position,
        "tokenizer_class": "GPT2Tokenizer",
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
    generation_config = {
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
    }
    (folder / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n", encoding="utf-8")
    return folder


# --------------------------------------------------------------------------- GGUF


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (``LlamaModel.permute``): rotate_half pairs -> interleaved."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Pack rows (last dim a multiple of 256) as Q4_K: 8 sub-blocks of 32 with 6-bit scales and
    mins. Returns uint8 [..., row_bytes]. Simple min/max fit, not llama.cpp's search."""
    shape = x.shape
    blocks = x.astype(np.float32).reshape(-1, 8, 32)
    n = blocks.shape[0]
    lo = np.minimum(blocks.min(-1), 0.0)  # [n, 8]
    hi = blocks.max(-1)
    scale = (hi - lo) / 15.0
    mins = -lo
    d = _f16(scale.max(-1) / 63.0)  # [n]
    dmin = _f16(mins.max(-1) / 63.0)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(np.divide(mins, dminf, out=np.zeros_like(mins), where=dminf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]  # [n, 8, 1]
    offset = (dminf * m)[..., None]
    q = np.divide(blocks + offset, step, out=np.zeros_like(blocks), where=step > 0)
    q = np.clip(np.rint(q), 0, 15).astype(np.uint8)  # [n, 8, 32]
    packed_scales = np.empty((n, 12), dtype=np.uint8)
    packed_scales[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    packed_scales[:, 4:8] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    packed_scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    q = q.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    out = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), packed_scales, qs], axis=1)
    return out.reshape(*shape[:-1], shape[-1] // 256 * 144)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Pack rows (last dim a multiple of 256) as Q6_K: 16 sub-blocks of 16 with int8 scales.
    Returns uint8 [..., row_bytes]."""
    shape = x.shape
    blocks = x.astype(np.float32).reshape(-1, 16, 16)
    n = blocks.shape[0]
    scale = np.abs(blocks).max(-1) / 31.0  # [n, 16]
    d = _f16(scale.max(-1) / 127.0)  # [n]
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -128, 127).astype(np.int8)
    step = (df * sc.astype(np.float32))[..., None]
    q = np.divide(blocks, step, out=np.zeros_like(blocks), where=step > 0)
    q = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    low = (q & 0x0F).reshape(n, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    high = (q >> 4).reshape(n, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)
    return out.reshape(*shape[:-1], shape[-1] // 256 * 210)


def quantize(x: np.ndarray, qtype: str) -> tuple[np.ndarray, Any]:
    """(data for GGUFWriter.add_tensor, raw_dtype or None)."""
    import gguf
    from gguf import quants

    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype == "F32":
        return x, None
    if qtype == "F16":
        return x.astype(np.float16), None
    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if x.shape[-1] % block:
        raise ValueError(f"{qtype} needs rows that are a multiple of {block}, got {x.shape}")
    if qtype == "Q4_K":
        return quantize_q4_k(x), kind
    if qtype == "Q6_K":
        return quantize_q6_k(x), kind
    return quants.quantize(x, kind), kind


def _gguf_rope_scaling(writer: Any, rope: dict[str, Any] | None, config: dict[str, Any]) -> np.ndarray | None:
    """Write the rope scaling keys as llama.cpp's converter does. Returns llama3's rope_freqs
    tensor (llama.cpp stores llama3 scaling as per-frequency factors, not as keys)."""
    import gguf

    if not rope:
        return None
    kind = rope.get("rope_type", rope.get("type"))
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif kind == "llama3":
        head_dim = config["head_dim"]
        base = config["rope_theta"]
        factor = float(rope.get("factor", 8.0))
        low_ff, high_ff = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
        original = int(rope["original_max_position_embeddings"])
        freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        factors = []
        for freq in freqs:
            wavelen = 2 * np.pi / freq
            if wavelen < original / high_ff:
                factors.append(1.0)
            elif wavelen > original / low_ff:
                factors.append(factor)
            else:
                smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
                factors.append(1.0 / ((1 - smooth) / factor + smooth))
        return np.array(factors, dtype=np.float32)
    elif kind not in (None, "default"):
        raise ValueError(f"no GGUF encoding for rope scaling {kind!r}")
    return None


def write_gguf_model(path: str | Path, hf_folder: str | Path, *, qtype: str = "F32",
                     architecture: str | None = None) -> Path:
    """Convert a tiny HF folder (from :func:`write_hf_model`) into a GGUF file.

    ``architecture`` overrides ``general.architecture`` (to write files we must reject).
    """
    import gguf
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")
    path, hf_folder = Path(path), Path(hf_folder)
    config = json.loads((hf_folder / "config.json").read_text(encoding="utf-8"))
    model_type = config["model_type"]
    arch = architecture or {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}[model_type]
    weights = {k: v.float().numpy() for k, v in load_file(str(hf_folder / "model.safetensors")).items()}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    permute = model_type in ("llama", "mistral")

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(hf_folder.name)
    writer.add_file_type(
        {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
         "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
         "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
         "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K}[qtype]
    )
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["head_dim"])
    if config["head_dim"] != config["hidden_size"] // heads:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    rope_freqs = _gguf_rope_scaling(writer, config.get("rope_scaling"), config)

    # tokenizer metadata, as llama.cpp writes a GPT-2 style BPE vocabulary
    tok_json = json.loads((hf_folder / "tokenizer.json").read_text(encoding="utf-8"))
    tok_config = json.loads((hf_folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer = Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    special_ids = {t["id"] for t in tok_json["added_tokens"] if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special_ids else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[tok_config["bos_token"]])
    writer.add_eos_token_id(vocab[tok_config["eos_token"]])
    writer.add_unk_token_id(vocab[tok_config["unk_token"]])
    writer.add_pad_token_id(vocab[tok_config["pad_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok_config["chat_template"])

    def add(name: str, w: np.ndarray, quantized: bool = True) -> None:
        data, raw = quantize(w, qtype) if quantized and w.ndim == 2 else (np.ascontiguousarray(w, np.float32), None)
        if raw is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=raw)

    add("token_embd.weight", weights["model.embed_tokens.weight"])
    if rope_freqs is not None:
        add("rope_freqs.weight", rope_freqs, quantized=False)
    layer_names = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for i in range(config["num_hidden_layers"]):
        for hf, gg in layer_names.items():
            w = weights.get(f"model.layers.{i}.{hf}")
            if w is None:
                continue
            if permute and hf.startswith("self_attn.q_proj"):
                w = permute_rows(w, heads)
            elif permute and hf.startswith("self_attn.k_proj"):
                w = permute_rows(w, kv_heads)
            add(f"blk.{i}.{gg}", w)
    add("output_norm.weight", weights["model.norm.weight"])
    if not config.get("tie_word_embeddings", False) and "lm_head.weight" in weights:
        add("output.weight", weights["lm_head.weight"])

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
