"""Compile one component in a child process, bounded in time and memory.

Compiling untrusted bytes is the one step of loading a program whose cost the uploader controls (a
small component can take Cranelift a long time and much memory). `compile_bounded` runs this file as
a script in a fresh Python (it imports only wasmtime, not the host): the child caps its address
space (RLIMIT_AS), compiles with the same engine config as the runtime, and writes the serialized
artifact to stdout; the parent kills it at the time limit and deserializes the artifact into its
own engine. The engine config lives here so parent and child cannot disagree on it.
"""
from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

from wasmtime import Config, Engine, WasmtimeError

__all__ = ["make_engine", "engine_config_key", "compile_bounded", "CompileRefused"]
_EXIT_INVALID = 2          # the bytes are not a valid component (message on stderr)
_EXIT_NO_MEMORY = 3        # the compiler ran out of its address-space limit


class CompileRefused(ValueError):
    """The component did not compile within the bounds, or is invalid; the message says which."""


def engine_config_key(copy_on_write: bool) -> str:
    """What of the engine config a compiled artifact depends on (part of its cache key; the
    copy-on-write config keeps the key it had before the choice existed). Without copy-on-write
    the host's memories take the memory image out of the component before it is compiled
    (host/sandbox/programs/memory_image.py), so its artifacts are of other bytes: `memory_image=1`."""
    return ("epoch_interruption=1" if copy_on_write
            else "epoch_interruption=1,memory_init_cow=0,memory_image=1")


def _config(copy_on_write: bool) -> Config:
    config = Config()
    config.epoch_interruption = True
    config.memory_init_cow = copy_on_write
    return config


def make_engine(memories: Any = None) -> Engine:
    """The Wasmtime engine every program and instance of a runtime shares (epoch interruption on:
    the instance's idle deadline; fuel off: it slows every guest). `memories`: None for
    Wasmtime's own linear memories with copy-on-write images of the data segments; or a
    host.sandbox.linear_memory.LinearMemories that creates and counts every memory (Wasmtime's
    images need its own memories: the host maps the image itself, host/sandbox/image_files.py)."""
    config = _config(copy_on_write=memories is None)
    if memories is not None:
        memories.install(config)
    return Engine(config)


def compile_bounded(wasm_bytes: bytes, *, timeout_s: float, memory_mb: int,
                    copy_on_write: bool = True) -> bytes:
    """The serialized artifact of `wasm_bytes` for an engine of make_engine()'s config (with
    copy-on-write memory images or not), compiled in a child process of at most `memory_mb` MiB
    of address space, killed after `timeout_s`. Raises CompileRefused naming the bound or the
    compiler's error."""
    command = [sys.executable, "-I", str(Path(__file__).resolve()), str(memory_mb),
               str(int(copy_on_write))]
    try:
        done = subprocess.run(command, input=wasm_bytes, capture_output=True, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        raise CompileRefused(f"compilation took longer than the limit of {timeout_s:g} s "
                             f"(compile_timeout_s)") from None
    if done.returncode == 0:
        return done.stdout
    error = done.stderr.decode("utf-8", errors="replace").strip()
    if done.returncode == _EXIT_INVALID:
        raise CompileRefused(f"not a valid component: {error}")
    if done.returncode == _EXIT_NO_MEMORY or "memory" in error.lower() or done.returncode < 0:
        raise CompileRefused(f"compilation needed more than the limit of {memory_mb} MiB "
                             f"(compile_memory_mb) (exit status {done.returncode})")
    raise CompileRefused(f"the compiler failed (exit status {done.returncode}): "
                         f"{error.splitlines()[-1] if error else 'no message'}")


def _child_main(memory_mb: int, copy_on_write: bool) -> int:
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    wasm_bytes = sys.stdin.buffer.read()
    from wasmtime.component import Component
    try:
        artifact = Component(Engine(_config(copy_on_write)), wasm_bytes).serialize()
    except WasmtimeError as exc:
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        sys.stderr.write(lines[0] if lines else "invalid component")
        return _EXIT_INVALID
    except MemoryError:
        return _EXIT_NO_MEMORY
    sys.stdout.buffer.write(artifact)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(int(sys.argv[1]), sys.argv[2] == "1"))
