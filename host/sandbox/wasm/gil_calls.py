"""The wasmtime C helpers that every host call uses, called without releasing the GIL.

ctypes releases the GIL around each call into a CDLL (wasmtime-py loads libwasmtime that way) and
takes it back afterwards. A host call converts its arguments and result with a few dozen such
calls (allocate or free a value, a list, a record, a string; map a resource handle). With one
instance that costs little; with many instance threads each release lets another thread in, and
taking the GIL back means waiting for that thread, so with many instances keeping the GIL in
these helpers removes most of that waiting; one instance alone gains nothing.

`keep_gil_in_value_helpers()` rebinds the functions named below in `wasmtime._bindings` (the
module globals its wrappers call) to the same symbols loaded through `ctypes.PyDLL`, with the same
argtypes and restype. Only small functions that allocate, copy, free or map values: none runs
wasm, calls back into Python or blocks. Left as they were: everything that compiles,
instantiates, calls or drops a resource (which may run a destructor), and the type queries (the
host's converters no longer make them per call, see fast_calls.py). Idempotent; checks the
wasmtime-py version it was written for.
"""
from __future__ import annotations

import ctypes
import threading

from wasmtime import _bindings, _ffi

from host.sandbox.wasm.wasmtime_fix import require_pinned_version

__all__ = ["keep_gil_in_value_helpers", "GIL_KEEPING_FUNCTIONS"]

GIL_KEEPING_FUNCTIONS = (
    "wasmtime_component_val_new", "wasmtime_component_val_free", "wasmtime_component_val_clone",
    "wasmtime_component_val_delete",
    *(f"wasmtime_component_{kind}_{op}" for kind in ("vallist", "valrecord", "valtuple")
      for op in ("new", "new_uninit", "new_empty", "copy", "delete")),
    "wasm_byte_vec_new", "wasm_byte_vec_new_uninitialized", "wasm_byte_vec_new_empty",
    "wasm_byte_vec_copy", "wasm_byte_vec_delete",
    "wasmtime_component_resource_host_new", "wasmtime_component_resource_host_rep",
    "wasmtime_component_resource_host_owned", "wasmtime_component_resource_host_clone",
    "wasmtime_component_resource_host_delete", "wasmtime_component_resource_host_to_any",
    "wasmtime_component_resource_any_to_host", "wasmtime_component_resource_any_owned",
    "wasmtime_component_resource_any_clone", "wasmtime_component_resource_any_delete",
)
_LOCK = threading.Lock()


def keep_gil_in_value_helpers() -> None:
    """Install (once per process). Raises RuntimeError on another wasmtime-py version."""
    require_pinned_version("host/sandbox/wasm/gil_calls.py")
    with _LOCK:
        if is_installed():
            return
        library = ctypes.PyDLL(_ffi.dll._name)
        for name in GIL_KEEPING_FUNCTIONS:
            original = getattr(_bindings, f"_{name}")
            keeping = getattr(library, name)
            keeping.argtypes, keeping.restype = original.argtypes, original.restype
            setattr(_bindings, f"_{name}", keeping)


def is_installed() -> bool:
    return all(keeps_gil(getattr(_bindings, f"_{name}")) for name in GIL_KEEPING_FUNCTIONS)


def keeps_gil(function: ctypes._CFuncPtr) -> bool:
    """True for a ctypes foreign function that holds the GIL while it runs (PyDLL)."""
    return bool(function._flags_ & ctypes._FUNCFLAG_PYTHONAPI)
