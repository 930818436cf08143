"""Host-call values converted in C: `WitCodec`, over the optional extension `_wit_values`.

Every host call lifts its arguments from libwasmtime's `wasmtime_component_val_t` array and
lowers its result into one. wasmtime-py does that in Python, a few ctypes objects and FFI calls
per value, a large share of the host's time on a decode step (forward.submit + get).
`_wit_values.c` does the same conversions in C, driven by a *descriptor* built here once per
function type (see that file for the format). Types it does not take -- flags, list<u8> (lifted
as bytes) and resources inside other values -- keep wasmtime-py's converter, per argument.

Resources, either way (fast_calls.Signature): a resource argument reaches the binding as the host
resource's rep (an int), and a binding returns an owned resource as a `HostResource(rep,
type_id)`.

`load_codec()` returns None (and the host keeps the Python converters) when the extension was
not built or its struct layout differs from the ctypes definitions of the installed wasmtime-py.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any, NamedTuple

from wasmtime import _bindings
from wasmtime.component._types import (F32, F64, S8, S16, S32, S64, U8, U16, U32, U64, Bool,
                                       BorrowType, Char, EnumType, ListType, OptionType, OwnType,
                                       Record, RecordType, ResultType, String, TupleType, ValType,
                                       Variant, VariantType)

from host.sandbox.wasm.wasmtime_fix import case_classes

__all__ = ["WitCodec", "HostResource", "descriptor", "load_codec", "is_resource"]

_log = logging.getLogger(__name__)
_SCALAR_KINDS = {Bool: 0, S8: 1, U8: 2, S16: 3, U16: 4, S32: 5, U32: 6, S64: 7, U64: 8, F32: 9,
                 F64: 10, Char: 11, String: 12, EnumType: 17}
_LIST, _RECORD, _TUPLE, _VARIANT, _OPTION, _RESULT, _RESOURCE = 13, 14, 15, 16, 18, 19, 21


class HostResource(NamedTuple):
    """An owned host resource a binding returns to the guest (e.g. a forward-future)."""

    rep: int
    type_id: int


def is_resource(ty: ValType | None) -> bool:
    return isinstance(ty, (OwnType, BorrowType))


def descriptor(ty: ValType | None, top: bool = True) -> tuple | None:
    """The C converter's descriptor of `ty`, or None when the Python converter must do it.
    `top`: a whole argument or result (a resource is taken there only)."""
    if ty is None:
        return None
    if is_resource(ty):
        return (_RESOURCE,) if top else None
    kind = _SCALAR_KINDS.get(type(ty))
    if kind is None:                       # the frozen copies subclass the wasmtime-py types
        kind = next((k for cls, k in _SCALAR_KINDS.items() if isinstance(ty, cls)), None)
    if kind is not None:
        return (kind,)
    if isinstance(ty, ListType):
        element = descriptor(ty.element, False)
        return None if element is None or isinstance(ty.element, U8) else (_LIST, element)
    if isinstance(ty, TupleType):
        elements = tuple(descriptor(element, False) for element in ty.elements)
        return None if None in elements else (_TUPLE, elements)
    if isinstance(ty, RecordType):
        names = tuple(name for name, _ in ty.fields)
        fields = tuple(descriptor(field, False) for _, field in ty.fields)
        return None if None in fields else (_RECORD, names, fields)
    if isinstance(ty, (VariantType, OptionType, ResultType)):
        return _variant_descriptor(ty)
    return None


def _variant_descriptor(ty: Any) -> tuple | None:
    cases = ty._cases()
    payloads = tuple(descriptor(case, False) for _, case in cases)
    if any(payload is None and case is not None for payload, (_, case) in zip(payloads, cases)):
        return None
    kind = _OPTION if isinstance(ty, OptionType) else _RESULT if isinstance(ty, ResultType) \
        else _VARIANT
    return (kind, tuple(name for name, _ in cases), payloads, bool(ty._tagged()),
            tuple(case_classes(case) for _, case in cases))


class WitCodec:
    """The loaded extension with libwasmtime's allocators installed."""

    def __init__(self, module: Any) -> None:
        self._module = module
        addresses = [ctypes.cast(getattr(_bindings, name), ctypes.c_void_p).value for name in (
            "_wasm_byte_vec_new", "_wasmtime_component_vallist_new_uninit",
            "_wasmtime_component_valrecord_new_uninit", "_wasmtime_component_val_new",
            "_wasmtime_component_val_delete", "_wasmtime_component_resource_any_to_host",
            "_wasmtime_component_resource_host_rep", "_wasmtime_component_resource_host_delete",
            "_wasmtime_component_resource_host_new", "_wasmtime_component_resource_host_to_any",
            "_wasmtime_error_delete")]
        module.init(*addresses, Record, Variant)
        self.lift = module.lift             # (address, desc[, context]) -> value
        self.lift_args = module.lift_args   # (address, descs, context) -> [value or None]
        self.lower = module.lower           # (value, desc, address[, context])


def layout_matches(layout: dict[str, int]) -> bool:
    """The extension's struct layout (as compiled) equals wasmtime-py's ctypes definitions."""
    val = _bindings.wasmtime_component_val
    expected = {"val": ctypes.sizeof(val), "of": val.of.offset,
                "record_entry": ctypes.sizeof(_bindings.wasmtime_component_valrecord_entry),
                "entry_value": _bindings.wasmtime_component_valrecord_entry.val.offset,
                "variant_val": _bindings.wasmtime_component_valvariant.val.offset,
                "result_val": _bindings.wasmtime_component_valresult.val.offset,
                "list_data": _bindings.wasmtime_component_vallist.data.offset,
                "bytes_data": _bindings.wasm_byte_vec_t.data.offset}
    return layout == expected


def load_codec() -> WitCodec | None:
    """The C codec, or None (logged once by the caller's first use) when it cannot be used."""
    try:
        from host.sandbox.wasm import _wit_values  # type: ignore[attr-defined]
    except ImportError:
        _log.info("host.sandbox.wasm._wit_values is not built: host calls convert in Python")
        return None
    if not layout_matches(_wit_values.layout()):
        _log.warning("host.sandbox.wasm._wit_values: struct layout differs from wasmtime-py's; "
                     "host calls convert in Python")
        return None
    return WitCodec(_wit_values)
