"""Build the hand-written WAT test guests into components (wasm-tools), cached on disk.

A guest `tests/host/wat/<name>.wat` starts with a header line `;; world: <world>`. Its body is
wrapped as `(module <prelude_imports> <its own (import ...) lines> <prelude_lib> <rest>)` unless it
is a whole `(module ...)` itself. World `inferlet` comes from wit/ (the contract, untouched); other
worlds come from tests/host/wit/ (test-only, with wit/ as a dependency). Then:
    wasm-tools parse  ->  wasm-tools component embed <wit> --world <world>  ->  component new
The result is cached under .cache/test-components/, keyed by the sha256 of everything that goes in.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

__all__ = ["ComponentBuilder", "components", "make_runtime", "program_cache_dir", "WAT_DIR"]

REPO_DIR = Path(__file__).resolve().parents[2]
WAT_DIR = Path(__file__).resolve().parent / "wat"
TEST_WIT_DIR = Path(__file__).resolve().parent / "wit"
CONTRACT_WIT = REPO_DIR / "wit" / "inferlet.wit"
CACHE_DIR = REPO_DIR / ".cache" / "test-components"
_HEADER = re.compile(r";;\s*world:\s*([\w-]+)")


def _wasm_tools() -> str:
    local = Path(sys.executable).parent / "wasm-tools"
    return str(local) if local.exists() else (shutil.which("wasm-tools") or "wasm-tools")


def _run(args: list[str], stdin: bytes | None = None) -> bytes:
    done = subprocess.run(args, input=stdin, capture_output=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} failed:\n{done.stderr.decode(errors='replace')}")
    return done.stdout


class ComponentBuilder:
    """Builds (and memoizes) the test guests by name."""

    def __init__(self, cache_dir: Path = CACHE_DIR) -> None:
        self.cache_dir = cache_dir
        self._built: dict[str, bytes] = {}

    def module_text(self, name: str) -> tuple[str, str]:
        """(world, whole WAT module text) of guest `name`."""
        text = (WAT_DIR / f"{name}.wat").read_text()
        header = _HEADER.match(text)
        if header is None:
            raise ValueError(f"{name}.wat: first line must be ';; world: <world>'")
        body = text[header.end():]
        if body.lstrip().startswith("(module"):
            return header.group(1), body
        import_lines = [line for line in body.splitlines() if line.lstrip().startswith("(import ")]
        rest = [line for line in body.splitlines() if not line.lstrip().startswith("(import ")]
        parts = [(WAT_DIR / "prelude_imports.wat").read_text(), *import_lines,
                 (WAT_DIR / "prelude_lib.wat").read_text(), *rest]
        return header.group(1), "(module\n" + "\n".join(parts) + "\n)\n"

    def core_module(self, name: str) -> bytes:
        """Guest `name` as a plain core wasm module (not a component)."""
        return _run([_wasm_tools(), "parse", "-", "-o", "/dev/stdout"],
                    self.module_text(name)[1].encode())

    def component(self, name: str) -> bytes:
        """Guest `name` as a component of its world (memoized, and cached on disk)."""
        if name not in self._built:
            self._built[name] = self._build(name)
        return self._built[name]

    def _build(self, name: str) -> bytes:
        world, text = self.module_text(name)
        key = hashlib.sha256()
        for part in (world, text, CONTRACT_WIT.read_text(), *self._test_wit_texts()):
            key.update(part.encode())
        cached = self.cache_dir / f"{name}-{key.hexdigest()[:20]}.wasm"
        if cached.exists():
            return cached.read_bytes()
        with tempfile.TemporaryDirectory() as tmp:
            wit_dir = self._wit_dir(Path(tmp), world)
            core = Path(tmp) / "core.wasm"
            core.write_bytes(self.core_module(name))
            embedded = Path(tmp) / "embedded.wasm"
            _run([_wasm_tools(), "component", "embed", str(wit_dir), str(core), "--world", world,
                  "-o", str(embedded)])
            wasm = _run([_wasm_tools(), "component", "new", str(embedded), "-o", "/dev/stdout"])
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.tmp")
        partial.write_bytes(wasm)
        partial.replace(cached)
        return wasm

    @staticmethod
    def _test_wit_texts() -> list[str]:
        return [p.read_text() for p in sorted(TEST_WIT_DIR.rglob("*.wit"))]

    @staticmethod
    def _wit_dir(tmp: Path, world: str) -> Path:
        """wit/ itself for the contract world; else tests/host/wit plus wit/ as a dependency."""
        if world == "inferlet":
            return CONTRACT_WIT.parent
        wit_dir = tmp / "wit"
        shutil.copytree(TEST_WIT_DIR, wit_dir)
        (wit_dir / "deps" / "inferlet").mkdir(parents=True, exist_ok=True)
        shutil.copy(CONTRACT_WIT, wit_dir / "deps" / "inferlet" / "inferlet.wit")
        return wit_dir


@pytest.fixture(scope="session")
def components() -> ComponentBuilder:
    """The session's builder of WAT test guests."""
    return ComponentBuilder()


@pytest.fixture(scope="session")
def program_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One compiled-artifact cache for the session's runtimes (each guest compiles once)."""
    return tmp_path_factory.mktemp("pie-cache")


@pytest.fixture
def make_runtime(program_cache_dir: Path):
    """make_runtime(engine, limits=None, policy=None, **config_fields) -> a started Runtime,
    closed after the test; config_fields are further RuntimeConfig fields (kv_shares, ...)."""
    from host import InstanceLimits, Runtime, RuntimeConfig

    made: list = []

    def make(engine, limits: "InstanceLimits | None" = None, policy=None, **config_fields):
        config = RuntimeConfig(cache_dir=program_cache_dir,
                               limits=limits or InstanceLimits(max_idle_s=5.0), scheduler=policy,
                               **config_fields)
        runtime = Runtime(engine, config)
        made.append(runtime)
        return runtime

    yield make
    for runtime in made:
        runtime.close()
