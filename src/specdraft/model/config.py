"""Model configuration: one frozen dataclass for every Llama-family decoder we run."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdraft.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
ROPE_SCALING_TYPES = ("linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling as Hugging Face configs describe it (``rope_scaling``)."""

    kind: str  # "linear" | "llama3" | "yarn"
    factor: float
    original_max_position: int | None = None  # llama3, yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None = 0.1 * ln(factor) + 1

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope scaling {self.kind!r}; supported: {', '.join(ROPE_SCALING_TYPES)}"
            )
        if self.factor <= 0:
            raise UnsupportedModelError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.kind in ("llama3", "yarn") and not self.original_max_position:
            raise UnsupportedModelError(f"{self.kind} rope scaling needs original_max_position_embeddings")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama / SmolLM, Mistral, Qwen2)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None  # per-frequency divisors (llama.cpp's rope_freqs)
    rms_norm_eps: float = 1e-5
    max_position: int = 2048  # the model's context length
    tie_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections have a bias (Qwen2)
    sliding_window: int | None = None  # Mistral; enforced as a context limit, see max_context
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise UnsupportedModelError(f"model config: {name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"model config: {self.num_heads} attention heads is not a multiple of "
                f"{self.num_kv_heads} key/value heads"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"model config: head_dim must be even, got {self.head_dim}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise UnsupportedModelError(
                f"model config: {len(self.rope_freq_factors)} rope frequency factors for head_dim {self.head_dim}"
            )

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def max_context(self) -> int:
        """Longest sequence we run exactly: the context length, and the sliding window if smaller
        (within the window, sliding-window attention equals full attention)."""
        if self.sliding_window:
            return min(self.max_position, self.sliding_window)
        return self.max_position
