"""Attention backends over the paged KV pool, all driven by the same `PageTable` metadata.

A backend has `name`, `plan(page_table)` (once per forward pass), and per layer
`append_kv(kv_layer, k, v)` then `run(q, kv_layer) -> out`; `decode_plan` offers a batch as one
row per new token (decode steps, short prompts) to the quantized CPU engine's fused decoder (torch
backend only). `make_attention_backend` picks one by
name; a new backend (e.g. FlashInfer on CUDA) registers one more branch here.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from engine.attention.torch_paged import TorchPagedAttention
from engine.page_table import PageTable
from engine.quant.kernels import DecodeAttention

__all__ = ["AttentionBackend", "TorchPagedAttention", "make_attention_backend", "BACKEND_NAMES"]

BACKEND_NAMES = ("auto", "torch", "flashinfer")


class AttentionBackend(Protocol):
    """What the model calls per forward pass (plan) and per layer (append_kv, run)."""

    name: str

    def plan(self, table: PageTable) -> None: ...

    def append_kv(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def run(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor: ...

    def decode_plan(self, num_rows: int) -> DecodeAttention | None:
        """The planned batch's checked indices for engine.quant's fused C decoder, one row per
        new token, when the backend offers the batch that way (else None)."""


def make_attention_backend(name: str, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                           page_size: int, device: str | torch.device = "cpu",
                           c_decode: bool = False,
                           kernel_threads: Callable[[], int] | None = None) -> AttentionBackend:
    """Build the backend `name` ("auto" = the best one available for `device`). `c_decode`: the
    torch backend runs decode batches and short prompts (and, at the avx2 / avx512-vnni level, long prompts) on
    engine.quant's C kernels (quantized CPU mode); `kernel_threads`: their thread count at the
    time of a call (default torch's)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend must be one of {BACKEND_NAMES}, got {name!r}")
    device_type = torch.device(device).type
    if name == "flashinfer" or (name == "auto" and device_type == "cuda"):
        try:
            from engine.attention.flashinfer import FlashInferAttention  # CUDA only, added later
        except ImportError as err:
            if name == "flashinfer":
                raise ValueError(f"attention backend 'flashinfer' is not available: {err}") from err
        else:
            return FlashInferAttention(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                       head_dim=head_dim, page_size=page_size, device=device)
    return TorchPagedAttention(num_qo_heads, num_kv_heads, head_dim, page_size, device, c_decode,
                               kernel_threads)
