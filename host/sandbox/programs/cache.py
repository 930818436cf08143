"""Programs: validate uploaded component bytes, compile once, keep the compiled artifact on disk.

A program is content-addressed by the sha256 of its bytes. Compiling a componentize-py component
is slow and loading its serialized artifact is quick, so `ProgramCache.load` looks in memory,
then on disk (`<cache_dir>/components/<sha256>-<config>.cwasm`, keyed also by the wasmtime
version and the engine config, since an artifact only loads into a matching engine), and
compiles only when both miss. Concurrent loads of the same bytes compile once. For the host's
counted memories (`copy_on_write` False) the heap image in the data segments of the component's
one memory is taken out before compiling (`split_memory_image`, at each load that misses the
memo): the Program holds it, the memory creator maps it in copy-on-write
(host/sandbox/programs/memory_image.py says why, host/sandbox/image_files.py how).

Before compiling, the component's top-level import and export names are read from its binary
(`component_names.py`): an import the host does not provide or a missing `run` is refused
without compiling. Compilation runs in a child process bounded in time and memory
(`compile_worker.py`). Every refusal is remembered by hash (the newest `_MAX_REFUSALS_KEPT`),
so the same bytes are refused again at once.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from wasmtime import Engine, WasmtimeError
from wasmtime.component import Component, ComponentInstanceType, FuncType, ResultType, String

from host.sandbox.programs.compile_worker import (CompileRefused, compile_bounded, engine_config_key,
                                         make_engine)
from host.sandbox.programs.component_names import ComponentFormatError, read_names
from host.sandbox.programs.memory_image import MemoryImage, split_memory_image

__all__ = ["Program", "ProgramError", "ProgramStats", "ProgramCache", "make_engine",
           "WASI_PACKAGES"]

WASI_PACKAGES = ("wasi:cli/", "wasi:clocks/", "wasi:filesystem/", "wasi:io/", "wasi:random/",
                 "wasi:sockets/")   # what Linker.add_wasip2 provides (sandboxed by WasiConfig)
_WASM_MAGIC = b"\0asm"
_CORE_VERSION = b"\x01\x00\x00\x00"
_MAX_REFUSALS_KEPT = 4096


class ProgramError(ValueError):
    """The bytes are not a runnable inferlet; the message says why."""


@dataclass(frozen=True)
class Program:
    """A validated, compiled inferlet. `hash` is the hex sha256 of its bytes; `memory_image`
    what its one memory starts as when that was taken out of its data segments (else None)."""

    hash: str
    num_bytes: int
    component: Component = field(compare=False, repr=False)
    memory_image: MemoryImage | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ProgramStats:
    num_programs: int        # distinct programs loaded in this process
    num_compiles: int        # compilations from bytes (disk and memory both missed)
    num_disk_loads: int      # artifacts deserialized from the disk cache
    num_memory_hits: int     # loads answered by the in-process memo
    num_refusals: int = 0    # loads refused (a remembered refusal counts again)


class ProgramCache:
    """Loads programs for one engine. `provided` maps each host interface name to the names of
    the functions and resources the host defines in it (what an inferlet may import).
    compile_timeout_s / compile_memory_mb bound the compilation of one component.
    copy_on_write: whether `engine` was made with copy-on-write memory images (make_engine()
    without LinearMemories); artifacts are compiled and cached for that config."""

    def __init__(self, engine: Engine, cache_dir: Path | None,
                 provided: Mapping[str, frozenset[str]], *, compile_timeout_s: float = 300.0,
                 compile_memory_mb: int = 4096, copy_on_write: bool = True) -> None:
        self.engine = engine
        self.copy_on_write = copy_on_write
        self.compile_timeout_s = compile_timeout_s
        self.compile_memory_mb = compile_memory_mb
        self._refusals: dict[str, str] = {}     # hash -> the refusal's message, oldest first
        self.cache_dir = Path(cache_dir) / "components" if cache_dir is not None else None
        self.provided = dict(provided)
        self._lock = threading.Lock()
        self._programs: dict[str, Program] = {}
        self._hash_locks: dict[str, threading.Lock] = {}
        self._counts = {"compiles": 0, "disk": 0, "memory": 0, "refusals": 0}
        wasmtime_version = importlib.metadata.version("wasmtime")
        self._artifact_suffix = hashlib.sha256(
            f"{wasmtime_version}|{engine_config_key(copy_on_write)}|{platform.machine()}"
            .encode()).hexdigest()[:16]

    def load(self, wasm_bytes: bytes) -> Program:
        """Validate and compile `wasm_bytes` (or reuse a cached artifact). Raises ProgramError."""
        wasm_bytes = bytes(wasm_bytes)
        program_hash = hashlib.sha256(wasm_bytes).hexdigest()
        with self._lock:
            if program_hash in self._programs:
                self._counts["memory"] += 1
                return self._programs[program_hash]
            hash_lock = self._hash_locks.setdefault(program_hash, threading.Lock())
        with hash_lock:   # one compile per hash, other hashes proceed
            with self._lock:
                if program_hash in self._programs:
                    self._counts["memory"] += 1
                    return self._programs[program_hash]
            try:
                program = self._load_new(program_hash, wasm_bytes)
            except ProgramError as exc:
                self._remember_refusal(program_hash, str(exc))
                raise
            with self._lock:
                self._programs[program_hash] = program
            return program

    def _load_new(self, program_hash: str, wasm_bytes: bytes) -> Program:
        with self._lock:
            refusal = self._refusals.get(program_hash)
        if refusal is not None:
            raise ProgramError(refusal)
        check_header(wasm_bytes)
        check_names(wasm_bytes, self.provided)
        split = None if self.copy_on_write else split_memory_image(wasm_bytes)
        compiled_bytes, image = split if split is not None else (wasm_bytes, None)
        component = self._load_artifact(program_hash)
        if component is None:
            component, artifact = self._compile(compiled_bytes)
            check_world(component, self.engine, self.provided)
            self._store_artifact(program_hash, artifact)
        else:
            check_world(component, self.engine, self.provided)
        return Program(program_hash, len(wasm_bytes), component, image)

    def _remember_refusal(self, program_hash: str, message: str) -> None:
        with self._lock:
            self._counts["refusals"] += 1
            self._refusals.pop(program_hash, None)
            self._refusals[program_hash] = message
            while len(self._refusals) > _MAX_REFUSALS_KEPT:
                self._refusals.pop(next(iter(self._refusals)))

    def get(self, program_hash: str) -> Program:
        """A program loaded before, by hash. Raises ProgramError for an unknown hash."""
        with self._lock:
            program = self._programs.get(program_hash)
        if program is None:
            raise ProgramError(f"unknown program {program_hash!r}: load its bytes first")
        return program

    def statistics(self) -> ProgramStats:
        with self._lock:
            return ProgramStats(len(self._programs), self._counts["compiles"],
                                self._counts["disk"], self._counts["memory"],
                                self._counts["refusals"])

    def _artifact_path(self, program_hash: str) -> Path | None:
        if self.cache_dir is None:
            return None
        return self.cache_dir / f"{program_hash}-{self._artifact_suffix}.cwasm"

    def _load_artifact(self, program_hash: str) -> Component | None:
        path = self._artifact_path(program_hash)
        if path is None or not path.exists():
            return None
        try:
            component = Component.deserialize_file(self.engine, str(path))
        except WasmtimeError:
            path.unlink(missing_ok=True)   # stale or corrupt: compile again
            return None
        with self._lock:
            self._counts["disk"] += 1
        return component

    def _compile(self, wasm_bytes: bytes) -> tuple[Component, bytes]:
        """The component and its serialized artifact, compiled in a bounded child process."""
        try:
            artifact = compile_bounded(wasm_bytes, timeout_s=self.compile_timeout_s,
                                       memory_mb=self.compile_memory_mb,
                                       copy_on_write=self.copy_on_write)
            component = Component.deserialize(self.engine, artifact)
        except CompileRefused as exc:
            raise ProgramError(str(exc)) from None
        except WasmtimeError as exc:
            raise ProgramError(f"cannot load the compiled component: {_first_line(exc)}") from None
        with self._lock:
            self._counts["compiles"] += 1
        return component, artifact

    def _store_artifact(self, program_hash: str, artifact: bytes) -> None:
        path = self._artifact_path(program_hash)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        partial.write_bytes(artifact)
        partial.replace(path)   # atomic: a reader sees the whole artifact or none


def check_header(wasm_bytes: bytes) -> None:
    """Reject what is not a component binary, with the reason."""
    if len(wasm_bytes) < 8 or not wasm_bytes.startswith(_WASM_MAGIC):
        raise ProgramError(f"not a WebAssembly binary: starts with {wasm_bytes[:8]!r}, "
                           f"expected b'\\x00asm'")
    if wasm_bytes[4:8] == _CORE_VERSION:
        raise ProgramError("a core WebAssembly module, not a component: build the inferlet "
                           "with `pie build` (componentize-py) or `wasm-tools component new`")


def check_names(wasm_bytes: bytes, provided: Mapping[str, frozenset[str]]) -> None:
    """Before compiling: the component's top-level names read from its binary. It must export
    `run` and import only WASI and interfaces the host provides."""
    try:
        names = read_names(wasm_bytes)
    except ComponentFormatError as exc:
        raise ProgramError(f"not a valid component: {exc}") from None
    if "run" not in names.exports:
        raise ProgramError(f"not an inferlet: no export `run` (exports: "
                           f"{sorted(names.exports)[:20]}); target world pie:inferlet/inferlet")
    for name in names.imports:
        if not name.startswith(WASI_PACKAGES) and name not in provided:
            raise ProgramError(f"imports `{name[:200]}`, which this host does not provide "
                               f"(it provides {sorted(provided)} and WASI 0.2)")


def check_world(component: Component, engine: Engine,
                provided: Mapping[str, frozenset[str]]) -> None:
    """After compiling (types need the compiled component): the component targets world
    pie:inferlet/inferlet: it exports `run: func() -> result<string, string>` and imports
    nothing the host does not provide, down to each function of each interface."""
    component_type = component.type
    exports = component_type.exports(engine)
    if "run" not in exports:
        raise ProgramError(f"not an inferlet: no export `run` (exports: {sorted(exports)}); "
                           f"target world pie:inferlet/inferlet")
    run_type = exports["run"].ty
    if not _is_run_signature(run_type):
        raise ProgramError("not an inferlet: export `run` must be "
                           "`func() -> result<string, string>`")
    for name, extern in component_type.imports(engine).items():
        if name.startswith(WASI_PACKAGES):
            continue
        if name not in provided:
            raise ProgramError(f"imports `{name}`, which this host does not provide "
                               f"(it provides {sorted(provided)} and WASI 0.2)")
        item_type = extern.ty
        if not isinstance(item_type, ComponentInstanceType):
            raise ProgramError(f"imports `{name}` as something other than an interface")
        for item_name, item in item_type.exports(engine).items():
            if isinstance(item.ty, FuncType) and item_name not in provided[name]:
                raise ProgramError(f"imports `{name}.{item_name}`, which this host does not "
                                   f"provide (built against another version of the WIT?)")


def _is_run_signature(run_type: object) -> bool:
    if not isinstance(run_type, FuncType) or run_type.params:
        return False
    result = run_type.result
    return (isinstance(result, ResultType) and isinstance(result.ok, String)
            and isinstance(result.err, String))


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
