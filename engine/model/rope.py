"""Rotary position embedding tables (HF Llama convention: rotate_half over the two head halves)."""
from __future__ import annotations

import math

import torch

from engine.engine_config import ModelConfig

__all__ = ["inverse_frequencies", "rope_tables", "cos_sin_cache", "apply_rope"]


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.x frequency scaling: long wavelengths divided by `factor`, a smooth ramp between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    ramped = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    in_between = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
    return torch.where(in_between, ramped, scaled)


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float32 rotation frequencies, with the model's rope scaling applied."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"model {config.name}: unsupported rope scaling type {kind!r}")


def rope_tables(config: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin tables [max_position, head_dim].

    cos is HF's (each half repeated); the sin table's first half is negated, so that
    rotate_half(x) * sin == x.roll(head_dim // 2) * signed_sin (see apply_rope).
    """
    positions = torch.arange(config.max_position, dtype=torch.int64).float()
    freqs = torch.outer(positions, inverse_frequencies(config))       # [max_position, head_dim/2]
    signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)       # [max_position, head_dim]
    cos = torch.cat((freqs, freqs), dim=-1).cos()
    return cos.to(dtype), signed_sin.to(dtype)


def cos_sin_cache(config: ModelConfig) -> torch.Tensor:
    """float32 [max_position, head_dim]: cos of the head_dim / 2 frequencies, then their sin.

    The table FlashInfer's `apply_rope_with_cos_sin_cache_inplace` reads (vLLM's layout); with
    is_neox=True it rotates the two head halves, the same rotation as `apply_rope`."""
    positions = torch.arange(config.max_position, dtype=torch.int64).float()
    freqs = torch.outer(positions, inverse_frequencies(config))       # [max_position, head_dim/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] by cos/signed_sin [num_tokens, 1, head_dim].

    HF: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1). Rolling x by half a head
    gives cat(x2, x1), and the negation lives in signed_sin: 3 ops instead of 7.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
