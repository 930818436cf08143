"""`pie build`: turn an inferlet's app.py into a WebAssembly component with componentize-py.

The component bundles CPython 3.14, the `inferlet` SDK (inferlets/sdk/inferlet) and the app.
The WIT contract is read from the SDK package's `inferlet.wit`, which in the source tree is a
symlink to the one copy in wit/ and in an installed wheel is package data (setuptools copies the
symlink's content), so `pie build` finds it either way.

Checks made before componentize-py runs, each a BuildError naming the file: not a .py file, a
module name that clashes with the SDK or the bindings, a syntax error (file:line:col), no entry
point (`@inferlet.main` or a `WitWorld` class). componentize-py failures are summarised: a missing
or unbundleable import names the module.
"""
from __future__ import annotations

import ast
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import inferlets.sdk

__all__ = ["BuildError", "build", "build_cached", "componentize_py", "default_build_cache", "sdk_path",
           "source_hash", "wit_path"]

WORLD = "inferlet"
_RESERVED_NAMES = {"inferlet", "wit_world", "componentize_py_types", "componentize_py_runtime",
                   "componentize_py_async_support", "poll_loop"}


class BuildError(Exception):
    """An inferlet could not be built; the message names the file and the reason."""


def sdk_path() -> Path:
    """The directory holding the `inferlet` package (put on the guest's python path)."""
    return Path(inferlets.sdk.__file__).resolve().parent


def wit_path() -> Path:
    """The WIT contract the components target."""
    path = sdk_path() / "inferlet" / "inferlet.wit"
    if not path.is_file():
        raise BuildError(f"the WIT contract is missing: {path} (reinstall pie)")
    return path


def default_build_cache() -> Path:
    """Where `pie run app.py` keeps built components: $PIE_CACHE_DIR/builds or ~/.cache/pie/builds."""
    root = os.environ.get("PIE_CACHE_DIR") or Path.home() / ".cache" / "pie"
    return Path(root) / "builds"


def check_app(app_path: Path) -> str:
    """Validate the app file before building; returns its module name."""
    if not app_path.is_file():
        raise BuildError(f"{app_path}: no such file")
    if app_path.suffix != ".py":
        raise BuildError(f"{app_path}: an inferlet is a Python file ending in .py")
    module = app_path.stem
    if not module.isidentifier():
        raise BuildError(f"{app_path}: '{module}' is not a valid Python module name; rename the file")
    if module in _RESERVED_NAMES:
        raise BuildError(f"{app_path}: the module name '{module}' clashes with the SDK; rename the file")
    source = app_path.read_text(encoding="utf-8")
    try:
        tree = ast.parse(source, filename=str(app_path))
    except SyntaxError as err:
        raise BuildError(f"{app_path}:{err.lineno}:{err.offset}: syntax error: {err.msg}") from None
    if not _has_entry_point(tree):
        raise BuildError(f"{app_path}: no entry point: decorate a function with @inferlet.main "
                         "(or define a WitWorld class with a run method)")
    return module


def _has_entry_point(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "WitWorld":
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                name = decorator.attr if isinstance(decorator, ast.Attribute) else getattr(decorator, "id", "")
                if name == "main":
                    return True
    return False


def build(app_path: str | Path, output_path: str | Path, *, timeout_s: float = 300.0) -> Path:
    """Build `app_path` into the component `output_path`; raises BuildError with the cause."""
    app_path, output_path = Path(app_path).resolve(), Path(output_path).resolve()
    module = check_app(app_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    tool = componentize_py()
    with tempfile.TemporaryDirectory(prefix="pie-build-") as work_dir:
        tmp_out = Path(work_dir) / "app.wasm"
        command = [tool, "-q", "-d", str(wit_path()), "-w", WORLD, "componentize",
                   "-p", str(app_path.parent), "-p", str(sdk_path()), module, "-o", str(tmp_out)]
        try:
            done = subprocess.run(command, cwd=work_dir, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise BuildError(f"{app_path}: componentize-py took longer than {timeout_s:.0f} s") from None
        if done.returncode != 0 or not tmp_out.is_file():
            raise BuildError(f"{app_path}: {_summarise_failure(done.stderr + done.stdout)}")
        shutil.move(str(tmp_out), output_path)
    return output_path


def componentize_py() -> str:
    beside = Path(sys.executable).parent / "componentize-py"
    found = str(beside) if beside.is_file() else shutil.which("componentize-py")
    if not found:
        raise BuildError("componentize-py is not installed (pip install componentize-py==0.25.1)")
    return found


_MISSING = re.compile(r"(?:ModuleNotFoundError|ImportError): (.*)")


def _summarise_failure(output: str) -> str:
    """The cause of a componentize-py failure, in one or a few lines."""
    match = _MISSING.search(output)
    if match:
        return (f"an import cannot be bundled: {match.group(1)} (only pure-Python modules next "
                "to the app, in the SDK or in the active virtualenv's site-packages can be bundled)")
    lines = [line for line in output.strip().splitlines() if line.strip()]
    tail = "\n".join(lines[-12:]) if lines else "no output"
    return f"componentize-py failed:\n{tail}"


def source_hash(app_path: Path) -> str:
    """sha256 over the app, the SDK sources, the WIT and the tool version: the build cache key."""
    digest = hashlib.sha256()
    digest.update(b"componentize-py==0.25.1\n")
    digest.update(app_path.read_bytes())
    for path in sorted((sdk_path() / "inferlet").glob("*.py")) + [wit_path()]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def build_cached(app_path: str | Path, cache_dir: str | Path | None = None) -> tuple[Path, bool]:
    """Build `app_path` unless an identical build is cached; returns (component path, was_cached).

    The key is `source_hash`; modules next to the app that it imports are not part of the key.
    """
    app_path = Path(app_path).resolve()
    check_app(app_path)
    cache = Path(cache_dir) if cache_dir is not None else default_build_cache()
    target = cache / f"{app_path.stem}-{source_hash(app_path)[:32]}.wasm"
    if target.is_file():
        return target, True
    cache.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial")
    build(app_path, partial)
    os.replace(partial, target)
    return target, False
