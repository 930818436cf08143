"""Which weight format and activation dtype the engine runs, and why (decided once at load).

Rules (the whole policy):
- "float32" / "bfloat16": dense weights of that dtype (float32 is exact against transformers).
- "quantized": a GGUF's quantized matrices stay as their blocks, multiplied in place by the C
  kernels (engine.quant), float32 activations and KV. CPU only; needs the built extension.
- "auto": CUDA -> bfloat16. CPU -> quantized when the C kernels are built; otherwise bfloat16 on a
  CPU with native bf16 and float32 elsewhere, with one warning that the kernels are missing.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.quant import kernels

__all__ = ["DtypeChoice", "choose_dtype", "cpu_has_native_bf16"]

_log = logging.getLogger("pie.engine")


@dataclass(frozen=True)
class DtypeChoice:
    """dtype: of activations, KV and dense weights; keep_quantized: GGUF blocks stay blocks."""

    dtype: torch.dtype
    keep_quantized: bool
    reason: str


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bfloat16 natively (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = cpuinfo.read()
    except OSError:
        flags = ""
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        return True
    return "AMX" in torch.backends.cpu.get_cpu_capability()


def choose_dtype(name: str, device: torch.device) -> DtypeChoice:
    """Apply the module rules; ValueError for an unknown name or an impossible request."""
    if name == "float32":
        return DtypeChoice(torch.float32, False, "dtype float32 asked for")
    if name == "bfloat16":
        return DtypeChoice(torch.bfloat16, False, "dtype bfloat16 asked for")
    if name == "quantized":
        if device.type != "cpu":
            raise ValueError(f"dtype 'quantized' runs on the CPU only, not {device}")
        if not kernels.available():
            raise ValueError(f"dtype 'quantized' needs the C kernels: {kernels.unavailable_reason()}")
        return DtypeChoice(torch.float32, True, "dtype quantized asked for")
    if name != "auto":
        raise ValueError(f"dtype must be auto, float32, bfloat16 or quantized, got {name!r}")
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, False, "auto on CUDA")
    if kernels.available():
        return DtypeChoice(torch.float32, True, "auto on the CPU with the C kernels built")
    _log.warning("%s; the CPU engine falls back to its torch path (several times slower); "
                 "reinstall with a C compiler present (make setup) to build it",
                 kernels.unavailable_reason())
    if cpu_has_native_bf16():
        return DtypeChoice(torch.bfloat16, False, "auto on a CPU with native bf16, no C kernels")
    return DtypeChoice(torch.float32, False, "auto on the CPU, no C kernels")
