"""A Llama layer's glue on FlashInfer's fused CUDA kernels: add + RMSNorm, RoPE, SiLU-and-mul.

Selected only with the flashinfer attention backend (CUDA; a test stand-in elsewhere): the torch
code in engine/model/llama.py stays the CPU path. What changes on this path, and why:
- the residual stream is in the model dtype (bfloat16), not float32: `fused_add_rmsnorm` takes one
  dtype for input, residual and weight (the norm weights are cast once, here); the sum and the
  norm are still computed in float32 inside the kernel;
- a norm is one kernel (`x += delta; h = RMSNorm(x) * w` in place), where torch runs ~6;
- RoPE rotates q and k in place, in one kernel, from a float32 cos/sin table by position;
- the MLP's `silu(gate) * up` is one kernel over the fused gate/up output.
No call reads a tensor on the host: the whole layer can be captured in a CUDA graph.
"""
from __future__ import annotations

from types import ModuleType

import torch

from engine.engine_config import ModelConfig
from engine.model.rope import cos_sin_cache

__all__ = ["FlashInferKernels"]


class FlashInferKernels:
    """The fused kernels of one model: `flashinfer` is the imported package (or a stand-in)."""

    def __init__(self, flashinfer: ModuleType, config: ModelConfig, device: torch.device) -> None:
        self._norm = flashinfer.norm
        self._rope = flashinfer.rope
        self._activation = flashinfer.activation
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.cos_sin_cache = cos_sin_cache(config).to(device)     # [max_position, D] float32

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                 weight: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] += delta (in place), then RMSNorm(x) * weight [N, hidden] in x's dtype.

        With a delta the result is written over `delta` (a sublayer's fresh output) and returned;
        without one it is a new tensor. weight [hidden] is in x's dtype."""
        if delta is None:
            return self._norm.rmsnorm(x, weight, self.eps)
        self._norm.fused_add_rmsnorm(delta, x, weight, self.eps)
        return delta

    def rope_(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotate q [N, Hq * D] and k [N, Hkv * D] in place (row-strided views of the fused
        projection are fine: only the last dim must be contiguous). positions [N] int32/int64."""
        self._rope.apply_rope_with_cos_sin_cache_inplace(positions, q, k, self.head_dim,
                                                         self.cos_sin_cache, is_neox=True)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [N, 2 * I] (gate first) -> silu(gate) * up [N, I]."""
        return self._activation.silu_and_mul(gate_up)
