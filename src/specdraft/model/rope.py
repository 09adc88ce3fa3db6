"""Rotary position embeddings (Hugging Face ``rotate_half`` layout) with the scaling variants
that Llama, Mistral and Qwen2 configs use: none, linear, llama3 and yarn."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from specdraft.model.config import ModelConfig, RopeScaling


def inverse_frequencies(config: ModelConfig) -> tuple[Tensor, float]:
    """Return (inv_freq [D/2] float64, attention scale applied to cos/sin)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float64, device="cpu")
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    if scaling.kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return _yarn(inv_freq, scaling, dim, config.rope_theta)


def _llama3(inv_freq: Tensor, s: RopeScaling) -> Tensor:
    assert s.original_max_position is not None
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(inv_freq: Tensor, s: RopeScaling, dim: int, base: float) -> tuple[Tensor, float]:
    assert s.original_max_position is not None
    attention = s.attention_factor if s.attention_factor is not None else 0.1 * math.log(s.factor) + 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1 where the original frequency is kept
    interpolated = inv_freq / s.factor
    return interpolated * (1 - extrapolation) + inv_freq * extrapolation, attention


def rope_table(config: ModelConfig, length: int, device: torch.device | str) -> tuple[Tensor, Tensor]:
    """cos, sin: [length, D] float32 for positions 0..length-1. ``sin``'s first half is
    negated, so that :func:`apply_rope` needs only a roll (see there)."""
    inv_freq, scale = inverse_frequencies(config)
    freqs = torch.outer(torch.arange(length, dtype=torch.float64, device="cpu"), inv_freq)  # [S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [S, D]
    sin = emb.sin() * scale
    sin[:, : freqs.shape[1]] *= -1
    return (emb.cos() * scale).float().to(device), sin.float().to(device)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Hugging Face's ``x * cos + rotate_half(x) * sin``, with rotate_half(x) = [-x2, x1]
    written as roll(x) = [x2, x1] times the sign-folded ``sin`` table.

    x: [..., D]; cos, sin: broadcastable to x, in x's dtype.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
