"""The target-model runtime: config, loaders, decoder, KV cache and tokenizer."""

from specdraft.model.config import ModelConfig, RopeScaling
from specdraft.model.kv_cache import KVCache
from specdraft.model.transformer import ModelOutput, Transformer

__all__ = ["KVCache", "ModelConfig", "ModelOutput", "RopeScaling", "Transformer"]
