"""LoRA adapters: PEFT files checked against the base model (`peft.py`), kept resident by name up
to a memory budget (`store.py`: `AdapterStore`, the engine's `Engine.adapters`), and applied per
request inside one batch after the base projections (`apply.py`: `LoraPass`).

A request names its adapter in `ForwardRequest.adapter`; the base weights are never merged.
"""
from __future__ import annotations

from engine.adapters.apply import LoraPass, StackedAdapters, stack_adapters
from engine.adapters.peft import (CONFIG_FILE, TARGET_MODULES, WEIGHTS_FILE, AdapterError,
                                  AdapterSpec, LoraAdapter, load_adapter, read_adapter_spec)
from engine.adapters.store import AdapterInfo, AdapterStore, check_adapter_name, scoped_name

__all__ = ["AdapterError", "AdapterInfo", "AdapterSpec", "AdapterStore", "LoraAdapter", "LoraPass",
           "StackedAdapters", "CONFIG_FILE", "WEIGHTS_FILE", "TARGET_MODULES", "check_adapter_name",
           "load_adapter", "read_adapter_spec", "scoped_name", "stack_adapters"]
