"""Which weight format and activation dtype the engine runs, and why (decided once at load).

Rules (the whole policy):
- "float32" / "bfloat16": dense weights of that dtype (float32 is exact against transformers).
- "quantized": a GGUF's quantized matrices stay as their blocks, multiplied in place by the C
  kernels (engine.quant), float32 activations, a float16 KV cache (half the bytes per page; the
  C attention widens it exactly, math in float32). CPU only; needs the built extension.
- every other choice keeps its KV cache in its activation dtype.
- kv_dtype "float32" / "float16" (CPU only) overrides the KV cache's dtype of any of the above;
  "auto" applies the rules.
- "auto": CUDA -> bfloat16. CPU -> quantized when the C kernels are built; otherwise bfloat16 on a
  CPU with native bf16 and float32 elsewhere, with one warning that the kernels are missing.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from engine.quant import kernels

__all__ = ["DtypeChoice", "choose_dtype", "cpu_has_native_bf16"]

_log = logging.getLogger("pie.engine")


@dataclass(frozen=True)
class DtypeChoice:
    """dtype: of activations and dense weights; keep_quantized: GGUF blocks stay blocks;
    kv_dtype: of the KV page pool (None: dtype)."""

    dtype: torch.dtype
    keep_quantized: bool
    reason: str
    kv_dtype: torch.dtype | None = None

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype


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


def choose_dtype(name: str, device: torch.device, kv_name: str = "auto") -> DtypeChoice:
    """Apply the module rules; ValueError for an unknown name or an impossible request."""
    choice = _choose_weights(name, device)
    if kv_name == "auto":
        return choice
    if kv_name not in ("float32", "float16"):
        raise ValueError(f"kv_dtype must be auto, float32 or float16, got {kv_name!r}")
    if device.type != "cpu":
        raise ValueError(f"kv_dtype {kv_name!r} is for the CPU; on {device} the KV cache keeps "
                         "the activation dtype (kv_dtype auto)")
    return dataclasses.replace(choice, kv_dtype=getattr(torch, kv_name),
                               reason=f"{choice.reason}, kv_dtype {kv_name} asked for")


def _choose_weights(name: str, device: torch.device) -> DtypeChoice:
    if name == "float32":
        return DtypeChoice(torch.float32, False, "dtype float32 asked for")
    if name == "bfloat16":
        return DtypeChoice(torch.bfloat16, False, "dtype bfloat16 asked for")
    if name == "quantized":
        if device.type != "cpu":
            raise ValueError(f"dtype 'quantized' runs on the CPU only, not {device}")
        if not kernels.available():
            raise ValueError(f"dtype 'quantized' needs the C kernels: {kernels.unavailable_reason()}")
        return DtypeChoice(torch.float32, True, "dtype quantized asked for", torch.float16)
    if name != "auto":
        raise ValueError(f"dtype must be auto, float32, bfloat16 or quantized, got {name!r}")
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, False, "auto on CUDA")
    if kernels.available():
        return DtypeChoice(torch.float32, True, "auto on the CPU with the C kernels built",
                           torch.float16)
    _log.warning("%s; the CPU engine falls back to its torch path (several times slower); "
                 "reinstall with a C compiler present (make setup) to build it",
                 kernels.unavailable_reason())
    if cpu_has_native_bf16():
        return DtypeChoice(torch.bfloat16, False, "auto on a CPU with native bf16, no C kernels")
    return DtypeChoice(torch.float32, False, "auto on the CPU, no C kernels")
