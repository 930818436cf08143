"""The built-in OpenAI inferlet: built with `pie build` at the server's first start, then cached.

The component is cached under `<data_dir>/builtin/` keyed by the hash of its source, the SDK and the
WIT (host.sandbox.build.build_cached), so a later start (or a changed SDK) builds only when needed; the
runtime then compiles it (with its own on-disk cache of compiled artifacts).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import trio

__all__ = ["BUILTIN_NAME", "builtin_source", "build_builtin", "load_builtin"]

BUILTIN_NAME = "builtin:openai"


def builtin_source() -> Path:
    from inferlets.builtin import BUILTIN_DIR
    return BUILTIN_DIR / "openai_completions.py"


def build_builtin(data_dir: Path) -> bytes:
    """The built-in component's bytes (built now unless cached in data_dir/builtin)."""
    from host.sandbox.build import build_cached
    path, _ = build_cached(builtin_source(), Path(data_dir) / "builtin")
    return path.read_bytes()


async def load_builtin(runtime: Any, data_dir: Path) -> tuple[Any, str]:
    """(compiled Program, sha256) of the built-in inferlet; blocking work runs in threads."""
    data = await trio.to_thread.run_sync(build_builtin, data_dir)
    program = await trio.to_thread.run_sync(runtime.load_program, data)
    return program, hashlib.sha256(data).hexdigest()
