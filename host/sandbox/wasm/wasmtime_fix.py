"""Workarounds for two thread-safety bugs of wasmtime-py 50.0.1's component API.

1. `wasmtime/component/_enter.py` keeps the last Python exception raised by a host function in a
   module global (`LAST_EXCEPTION`). With many instances on many threads, an exception raised on
   one thread is re-raised on whichever thread looks next, or lost. Fix: the same two functions
   (`catch_exceptions`, `maybe_raise_last_exn`) with thread-local state.
2. `VariantLikeType._lower` in `_types.py` fills a module-global set (`case_test_cache`) while it
   decides which case of an untagged `result`/`option` a value belongs to; two threads lowering at
   once clobber each other's set (`TypeError: expected list value`). Fix: the same method with a
   local set.

`apply()` installs both (idempotent); `host/__init__.py` calls it once at import. Nothing else of
wasmtime-py is changed. The host also never lets a non-WasmtimeError escape a host function (see
host/sandbox/instance.py), so bug 1 is doubly covered.
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import threading
from typing import Any, Callable, Iterable

from wasmtime import StoreContext, WasmtimeError
from wasmtime.component import _enter, _linker, _types

__all__ = ["FIXED_VERSION", "apply", "is_applied", "case_classes", "lower_variant",
           "host_error", "require_pinned_version"]

FIXED_VERSION = "50.0.1"


class _ThreadState(threading.local):
    """The last host exception of *this* thread (what `_enter.LAST_EXCEPTION` should have been)."""

    last_exception: BaseException | None = None


_STATE = _ThreadState()
_ORIGINALS: dict[str, Any] = {}
_APPLY_LOCK = threading.Lock()


def _catch_exceptions(store_raw: Any, func: Callable[[StoreContext], None]) -> int:
    """Run a host function; keep a Python exception on this thread, hand Wasmtime an error."""
    store = StoreContext(store_raw)
    try:
        func(store)
    except Exception as exc:  # noqa: BLE001 -- re-raised on this same thread by the caller
        return host_error(exc)
    finally:
        store._invalidate()
    return 0


def host_error(exc: Exception) -> int:
    """What a host function hands Wasmtime for `exc`: a WasmtimeError as is, any other exception
    kept on this thread (re-raised there once the call returns) behind a generic error."""
    if not isinstance(exc, WasmtimeError):
        _STATE.last_exception = exc
        exc = WasmtimeError("python exception")
    return ctypes.cast(exc._consume(), ctypes.c_void_p).value  # type: ignore[return-value]


def _maybe_raise_last_exn() -> None:
    """Re-raise the exception a host function raised on this thread, if any."""
    exc = _STATE.last_exception
    if exc is not None:
        _STATE.last_exception = None
        raise exc


def case_classes(ty: Any) -> tuple[type, ...]:
    """The Python classes a value of case type `ty` may have (() for a case without payload)."""
    if ty is None:
        return ()
    classes: set[type] = set()
    ty.add_classes(classes)
    return tuple(classes)


def lower_variant(store: Any, val: Any, tagged: bool, case_tests: Iterable[tuple]) -> tuple[str, Any]:
    """Lower `val` for a variant-like type: the first case of `case_tests` (name, type, classes)
    it matches -> (case name, C payload or None). Tagged types take a `Variant`; untagged ones
    (option, result with distinct payload classes) match the payload's class. No shared state."""
    if tagged and not isinstance(val, _types.Variant):
        raise TypeError("expected Variant type")
    for name, ty, classes in case_tests:
        if tagged:
            if name != val.tag:
                continue
        elif ty is None:
            if val is not None:
                continue
        elif not isinstance(val, classes):
            continue
        if ty is None:
            return (name, None)
        raw = _types.ffi.wasmtime_component_val_t()
        ty.convert_to_c(store, val.payload if tagged else val, ctypes.pointer(raw))
        return (name, _types.ffi.wasmtime_component_val_new(ctypes.byref(raw)))
    raise ValueError("value not valid for this variant")


def _lower_variant(self: Any, store: Any, val: Any) -> Any:
    """`VariantLikeType._lower` without the module-global cache of case classes."""
    return lower_variant(store, val, self._tagged(),
                         ((name, ty, case_classes(ty)) for name, ty in self._cases()))


def require_pinned_version(patcher: str) -> None:
    """Raise RuntimeError unless wasmtime-py is FIXED_VERSION, the one `patcher` was written for."""
    installed = importlib.metadata.version("wasmtime")
    if installed != FIXED_VERSION:
        raise RuntimeError(f"{patcher} patches wasmtime-py {FIXED_VERSION}, found {installed}: "
                           f"check whether what it works around remains")


def is_applied() -> bool:
    """True once `apply()` has installed the fixes in this process."""
    return bool(_ORIGINALS)


def apply() -> None:
    """Install both fixes (idempotent). Raises RuntimeError on another wasmtime-py version."""
    require_pinned_version("host/sandbox/wasm/wasmtime_fix.py")
    with _APPLY_LOCK:
        if _ORIGINALS:
            return
        _ORIGINALS["catch_exceptions"] = _enter.catch_exceptions
        _ORIGINALS["maybe_raise_last_exn"] = _enter.maybe_raise_last_exn
        _ORIGINALS["_lower"] = _types.VariantLikeType._lower
        _enter.catch_exceptions = _catch_exceptions
        _enter.maybe_raise_last_exn = _maybe_raise_last_exn   # enter_wasm looks it up here
        _linker.catch_exceptions = _catch_exceptions          # imported by name into _linker
        _types.VariantLikeType._lower = _lower_variant        # type: ignore[method-assign]

