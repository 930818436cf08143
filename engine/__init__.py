"""pie's engine: a Llama-family model over a paged KV cache, driven by ragged forward batches.

The contract types (batch, config, protocol) import without torch; `Engine`, `load_engine` and
`load_default_engine` are imported on first use, so `import engine.batch` stays light for the host.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# OpenMP threads (torch's GEMMs on long passes) sleep between parallel regions instead of spinning,
# so they do not take a core from the C kernels and the instances beside them (the trade-off,
# measured: docs/performance/2026-11-25-cpu-engine-long-contexts.md; OMP_WAIT_POLICY=ACTIVE, or
# set empty for libgomp's default, to choose otherwise). libgomp reads it once, when torch loads it: this package imports
# torch only lazily, so it holds when `engine` is imported before torch (the CLI and the server
# do). A value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.batch import (GREEDY, Distribution, ForwardBatch, ForwardRequest, ForwardResult,
                          SamplerSpec, TokenCopy)
from engine.engine_config import EngineConfig, ModelConfig
from engine.protocol import EngineLike, EngineStats, TokenizerLike

if TYPE_CHECKING:
    from engine.engine import Engine, load_default_engine, load_engine

__all__ = [
    "Engine", "load_engine", "load_default_engine",
    "ForwardBatch", "ForwardRequest", "ForwardResult", "SamplerSpec", "GREEDY", "Distribution",
    "TokenCopy", "EngineConfig", "ModelConfig", "EngineLike", "EngineStats", "TokenizerLike",
]

_LAZY = {"Engine", "load_engine", "load_default_engine"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from engine import engine as _engine_module
        return getattr(_engine_module, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
