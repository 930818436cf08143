"""The WIT imports, in one place.

componentize-py generates the `wit_world` bindings package at build time from `wit/inferlet.wit`
(see host/sandbox/programs/build.py). Everything the SDK needs is imported here at module load: componentize-py
bundles only the modules imported while the app module loads.
"""
from __future__ import annotations

from componentize_py_types import Err
from wit_world.imports import (adapters, children, forward, http, kv, mcp, messaging, queue,
                               runtime, tokenize)

__all__ = ["Err", "adapters", "children", "forward", "http", "kv", "mcp", "messaging", "queue",
           "runtime", "tokenize"]
