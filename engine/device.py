"""Where the engine runs and which attention backend it uses, decided once at start-up.

Rules (the whole policy):
- device "auto" -> "cuda" when `torch.cuda.is_available()`, else "cpu"; "cuda" without CUDA is a
  ValueError that says so (never a silent fall back to the CPU).
- attention "auto" -> "flashinfer" when the device is CUDA, the dtype is not float32 and
  `flashinfer` imports, else "torch".
  The torch backend runs on either device (the reference, and the fallback on CUDA).
- attention "flashinfer" on the CPU is a ValueError; on CUDA without the package it is a
  `FlashInferUnavailable` (an ImportError) naming the extra to install.
RoPE, norms and sampling are torch code and run on whichever device was chosen.

- On CUDA, a flashinfer whose version is not `FLASHINFER_CHECKED_VERSION` (the one the backend's
  calls were checked against, tests/engine/test_flashinfer_signatures.py) gives one
  `FlashInferVersionWarning` at start-up (`choose_device`); it still runs. The warning is issued
  from one place, so Python's default warning filter shows it once per process.

Nothing here imports flashinfer at module import time: a CPU machine never needs it.
"""
from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from types import ModuleType

import torch

from engine.engine_config import EngineConfig

__all__ = [
    "CUDA_EXTRA_INSTALL",
    "DeviceChoice",
    "FLASHINFER_CHECKED_VERSION",
    "FlashInferUnavailable",
    "FlashInferVersionWarning",
    "choose_device",
    "cuda_available",
    "flashinfer_available",
    "import_flashinfer",
    "unchecked_flashinfer_version",
    "resolve_attention_backend",
    "resolve_device",
]

CUDA_EXTRA_INSTALL = "pip install 'pie-serve[cuda]'"
# The one place the checked FlashInfer version is recorded: pyproject's `cuda` extra pins it (a test
# keeps the two equal) and `make check-cuda` installs it.
FLASHINFER_CHECKED_VERSION = "0.7.2.post1"


class FlashInferUnavailable(ImportError):
    """flashinfer was asked for but cannot be imported; the message names the `cuda` extra."""


class FlashInferVersionWarning(UserWarning):
    """The installed flashinfer is not the version the CUDA path was checked against."""


@dataclass(frozen=True)
class DeviceChoice:
    """The resolved device and attention backend ("torch" or "flashinfer")."""

    device: torch.device
    attention_backend: str

    def __post_init__(self) -> None:
        if self.attention_backend not in ("torch", "flashinfer"):
            raise ValueError(f"attention_backend must be torch or flashinfer, "
                             f"got {self.attention_backend!r}")
        if self.attention_backend == "flashinfer" and self.device.type != "cuda":
            raise ValueError(f"the flashinfer backend needs a CUDA device, got {self.device}")


def cuda_available() -> bool:
    """True when torch sees at least one CUDA device."""
    return bool(torch.cuda.is_available())


def resolve_device(requested: str) -> torch.device:
    """"cpu" | "cuda" | "cuda:N" | "auto" -> a torch.device (see the module rules)."""
    if requested == "auto":
        return torch.device("cuda" if cuda_available() else "cpu")
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda" or requested.startswith("cuda:"):
        if not cuda_available():
            raise ValueError(
                f"device {requested!r} requested but CUDA is not available "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'}); "
                f"use --device cpu or --device auto")
        try:
            return torch.device(requested)
        except RuntimeError as err:
            raise ValueError(f"device {requested!r} is not a valid CUDA device: {err}") from None
    raise ValueError(f"device must be cpu, cuda or auto, got {requested!r}")


def import_flashinfer() -> ModuleType:
    """Import flashinfer, or raise FlashInferUnavailable naming the extra and the cause.

    Besides a missing package, a broken install (no CUDA runtime, a torch/flashinfer mismatch)
    fails at import with OSError or RuntimeError; those are turned into the same clear error.
    """
    try:
        return importlib.import_module("flashinfer")
    except (ImportError, OSError, RuntimeError) as err:
        raise FlashInferUnavailable(
            f"the flashinfer attention backend needs the `cuda` extra: {CUDA_EXTRA_INSTALL} "
            f"(flashinfer-python, on a machine with an NVIDIA GPU); importing flashinfer failed: "
            f"{type(err).__name__}: {err}") from err


def flashinfer_available() -> bool:
    """True when flashinfer imports (never raises)."""
    try:
        import_flashinfer()
    except FlashInferUnavailable:
        return False
    return True


def unchecked_flashinfer_version(flashinfer: ModuleType) -> str | None:
    """The module's version when it is not FLASHINFER_CHECKED_VERSION, else None."""
    version = str(getattr(flashinfer, "__version__", "unknown"))
    return None if version == FLASHINFER_CHECKED_VERSION else version


def _warn_if_unchecked_flashinfer() -> None:
    """One FlashInferVersionWarning when an importable flashinfer is not the checked version."""
    try:
        flashinfer = import_flashinfer()
    except FlashInferUnavailable:
        return
    version = unchecked_flashinfer_version(flashinfer)
    if version is not None:
        warnings.warn(FlashInferVersionWarning(
            f"flashinfer {version} is installed; pie's CUDA path was checked against "
            f"{FLASHINFER_CHECKED_VERSION} (engine.device.FLASHINFER_CHECKED_VERSION): "
            f"argument names or dtypes may differ; {CUDA_EXTRA_INSTALL} installs the checked "
            f"version"), stacklevel=2)     # attributed to choose_device: one place, shown once


def resolve_attention_backend(requested: str, device: torch.device, dtype: str = "auto") -> str:
    """"auto" | "torch" | "flashinfer" on `device` -> "torch" or "flashinfer" (module rules).
    `dtype` (EngineConfig.dtype): "auto" never picks flashinfer for float32, which it cannot
    run."""
    if requested == "torch":
        return "torch"
    if requested == "flashinfer":
        if device.type != "cuda":
            raise ValueError(f"attention backend 'flashinfer' needs a CUDA device, got {device}; "
                             f"use --device cuda, or the torch backend on the CPU")
        import_flashinfer()          # raises FlashInferUnavailable naming the extra
        return "flashinfer"
    if requested == "auto":
        if device.type == "cuda" and dtype != "float32" and flashinfer_available():
            return "flashinfer"
        return "torch"
    raise ValueError(f"attention backend must be auto, torch or flashinfer, got {requested!r}")


def choose_device(config: EngineConfig) -> DeviceChoice:
    """Resolve `config.device` and `config.attention_backend` together (once, at start-up).

    On CUDA this is also where an unchecked flashinfer version is warned about (the attention
    backend and the CUDA sampler both use flashinfer there)."""
    device = resolve_device(config.device)
    choice = DeviceChoice(device, resolve_attention_backend(config.attention_backend, device,
                                                            config.dtype))
    if device.type == "cuda":
        _warn_if_unchecked_flashinfer()
    return choice
