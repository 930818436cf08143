"""Host functions whose argument/result converters are built once per (function, program).

wasmtime-py 50's `LinkerInstance.add_func` callback rebuilds the function's type on every call
(`FuncType.params` / `.result`: a few FFI calls and Python objects per parameter), and its list,
record, variant, option and result converters ask the C API again, for every value they convert,
for their element / field / case types. On a decode step (forward.submit + get + drop) that
reflection would be most of the instance thread's time.

`add_host_function` registers a function like `add_func` does, with a callback that converts with
*frozen* copies of those types: the same wasmtime-py classes (so the same conversion code and
ownership of C values) whose type queries answer from fields filled once. The signature is cached
per program (keyed by its sha256 hash, taken from the instance the calling thread runs): the type
a host function is called with comes from the importing component, so a guest that imports a
name with another signature gets converters built from its own signature, never another
program's. A call on a thread without an instance converts without caching.

With the C extension built (host/sandbox/wasm/wit_codec.py), the values themselves are converted in C
from descriptors kept beside those types; wasmtime-py's converters remain for the types it does
not take (flags, list<u8>, resources inside other values) and for every value when it is not
built. Either way a resource argument reaches the binding as its host rep (an int, looked up in
the calling instance's own table) and a binding returns an owned resource as a HostResource.

`add_host_resource` registers a resource's destructor the same way: called straight from its own
C callback, without wasmtime-py's per-drop closure and exception shim.
"""
from __future__ import annotations

import ctypes
import operator
from typing import Any, Callable

from wasmtime import StoreContext, WasmtimeError
from wasmtime import _ffi as ffi
from wasmtime.component import ResourceHost, ResourceType, _linker
from wasmtime.component._types import (F32, F64, S8, S16, S32, S64, U8, U16, U32, U64, FuncType,
                                       ListType, OptionType, Record, RecordType, ResultType,
                                       ValType, VariantType)

from host.sandbox.wasm.wasmtime_fix import case_classes, host_error, lower_variant
from host.sandbox.wasm.wit_codec import HostResource, descriptor, is_resource, load_codec

__all__ = ["add_host_function", "add_host_resource", "freeze_type", "host_call", "Signature"]

_CODEC = load_codec()     # None: every value converts in Python


# Numbers: lifted straight from the union field, and nothing to free or reset afterwards.
_SCALAR_FIELDS = {S8: "s8", S16: "s16", S32: "s32", S64: "s64", U16: "u16", U32: "u32",
                  U64: "u64", F32: "f32", F64: "f64"}


def _scalar_getter(ty: ValType | None) -> Callable[[Any], Any] | None:
    field = _SCALAR_FIELDS.get(type(ty))
    return None if field is None else operator.attrgetter(f"of.{field}")


class _FrozenList(ListType):
    """list<T>; a list of numbers is lifted in one comprehension (list<u32> token ids)."""

    def __init__(self, element: ValType) -> None:   # no C pointer: Managed.close() skips it
        self._element = element
        self._bytes = isinstance(element, U8)
        self._get_scalar = _scalar_getter(element)

    @property
    def element(self) -> ValType:
        return self._element

    def _is_bytes(self) -> bool:
        return self._bytes

    def convert_from_c(self, c: Any) -> Any:
        get = self._get_scalar
        if get is None:
            return super().convert_from_c(c)
        if c.kind != ffi.WASMTIME_COMPONENT_LIST.value:
            raise TypeError(f"expected a list value, got kind {c.kind}")
        try:
            data = c.of.list.data
            return [get(data[i]) for i in range(c.of.list.size)]
        finally:
            ffi.wasmtime_component_valtuple_delete(ctypes.byref(c.of.tuple))   # as wasmtime-py


class _FrozenRecord(RecordType):
    """A record, lifted without decoding each field's name again (the names are the type's)."""

    def __init__(self, fields: list[tuple[str, ValType]]) -> None:
        self._fields = fields
        # (name, type, getter): a number field is read straight from the union (owns nothing)
        self._lifts = [(name, ty, _scalar_getter(ty)) for name, ty in fields]

    @property
    def fields(self) -> list[tuple[str, ValType]]:
        return self._fields

    def convert_from_c(self, c: Any) -> Any:
        if c.kind != ffi.WASMTIME_COMPONENT_RECORD.value:
            raise TypeError(f"expected a record value, got kind {c.kind}")
        try:
            if c.of.record.size != len(self._fields):
                raise TypeError(f"record of {c.of.record.size} fields, expected "
                                f"{len(self._fields)}")
            record = Record()
            data = c.of.record.data
            for i, (name, ty, get_scalar) in enumerate(self._lifts):
                value = data[i].val
                if get_scalar is not None:
                    setattr(record, name, get_scalar(value))
                    continue
                setattr(record, name, ty.convert_from_c(value))
                value.kind = ffi.WASMTIME_COMPONENT_BOOL   # moved out: the delete must skip it
                value.of.boolean = False
            return record
        finally:
            ffi.wasmtime_component_valrecord_delete(c.of.record)


class _FrozenCases:
    """The variant-like part: cases, taggedness and each case's Python classes, computed once.
    `_lower` is host/sandbox/wasm/wasmtime_fix.py's `lower_variant` over those fields instead of querying the
    types."""

    def _freeze_cases(self, cases: list[tuple[str, ValType | None]]) -> None:
        self._frozen_cases = cases
        self._is_tagged = super()._tagged()       # type: ignore[misc]  # reads _cases()
        self._case_tests = [(name, ty, case_classes(ty)) for name, ty in cases]

    def _cases(self) -> list[tuple[str, ValType | None]]:
        return self._frozen_cases

    def _tagged(self) -> bool:
        return self._is_tagged

    def _lower(self, store: Any, val: Any) -> tuple[str, Any]:
        return lower_variant(store, val, self._is_tagged, self._case_tests)


class _FrozenVariant(_FrozenCases, VariantType):
    def __init__(self, cases: list[tuple[str, ValType | None]]) -> None:
        self._freeze_cases(cases)

    @property
    def cases(self) -> list[tuple[str, ValType | None]]:
        return self._frozen_cases


class _FrozenOption(_FrozenCases, OptionType):
    def __init__(self, payload: ValType) -> None:
        self._payload = payload
        self._freeze_cases([("none", None), ("some", payload)])

    @property
    def payload(self) -> ValType:
        return self._payload


class _FrozenResult(_FrozenCases, ResultType):
    def __init__(self, ok: ValType | None, err: ValType | None) -> None:
        self._ok, self._err = ok, err
        self._freeze_cases([("ok", ok), ("err", err)])

    @property
    def ok(self) -> ValType | None:
        return self._ok

    @property
    def err(self) -> ValType | None:
        return self._err




def freeze_type(ty: ValType | None) -> ValType | None:
    """A copy of `ty` whose type queries need no FFI call. Types whose conversion asks nothing
    (primitives, strings, enums, resources) and the kinds pie's WIT does not use (tuple, flags)
    are returned as they are."""
    if ty is None:
        return None
    if isinstance(ty, ListType):
        return _FrozenList(freeze_type(ty.element))
    if isinstance(ty, RecordType):
        return _FrozenRecord([(name, freeze_type(field)) for name, field in ty.fields])
    if isinstance(ty, VariantType):
        return _FrozenVariant([(name, freeze_type(case)) for name, case in ty.cases])
    if isinstance(ty, OptionType):
        return _FrozenOption(freeze_type(ty.payload))
    if isinstance(ty, ResultType):
        return _FrozenResult(freeze_type(ty.ok), freeze_type(ty.err))
    return ty


class Signature:
    """A host function's frozen parameter / result types and, with the C codec, their
    descriptors (None: that value converts in Python). Either way a resource argument is lifted
    to its host rep and a HostResource result is handed to the guest as an owned resource."""

    __slots__ = ("param_types", "result_type", "param_descs", "python_params", "resource_params",
                 "result_desc")

    def __init__(self, param_types: tuple[ValType, ...], result_type: ValType | None) -> None:
        self.param_types = param_types
        self.result_type = result_type
        descs = tuple(descriptor(ty) for ty in param_types) if _CODEC and param_types else None
        self.param_descs = descs
        self.python_params = [i for i, desc in enumerate(descs or ()) if desc is None]
        self.resource_params = [i for i, ty in enumerate(param_types) if is_resource(ty)]
        self.result_desc = descriptor(result_type) if _CODEC else None

    def lift(self, store: Any, context: Any, args: Any) -> list:
        """The arguments as Python values (`context`, `args`: the callback's C pointers)."""
        if self.param_descs is None:
            values = [ty.convert_from_c(args[i]) for i, ty in enumerate(self.param_types)]
            for i in self.resource_params:
                values[i] = values[i].to_host(store).rep
            return values
        values = _CODEC.lift_args(args, self.param_descs, context)
        for i in self.python_params:
            values[i] = self.param_types[i].convert_from_c(args[i])
        return values

    def lower(self, store: Any, context: Any, value: Any, results: Any) -> None:
        """Write the result (the function has one)."""
        if self.result_desc is not None:
            _CODEC.lower(value, self.result_desc, results, context)
            return
        if isinstance(value, HostResource):
            value = ResourceHost.own(value.rep, value.type_id)
        self.result_type.convert_to_c(store, value, results)


class _HostEntry:
    """What the callback finds under its handle: the function and its signatures per program."""

    __slots__ = ("func", "current", "signatures")

    def __init__(self, func: Callable[..., Any], current: Any) -> None:
        self.func = func
        self.current = current
        self.signatures: dict[str, Signature] = {}

    def signature(self, ty_raw: Any, store: Any) -> Signature:
        instance = getattr(self.current, "instance", None)
        key = instance.program.hash if instance is not None else None
        signature = self.signatures.get(key) if key is not None else None
        if signature is None:
            with FuncType._from_ptr(ty_raw, owner=store) as func_type:
                signature = Signature(tuple(freeze_type(ty) for _, ty in func_type.params),
                                      freeze_type(func_type.result))
            if key is not None:
                self.signatures[key] = signature
        return signature


def host_call(idx, context, ty_raw, args, nargs, results, nresults):  # type: ignore
    """The body of every pie host function (the C callback below calls it): find the function,
    convert its arguments, call it, convert its result. An exception becomes the error Wasmtime
    gets (wasmtime_fix.host_error: one that is no WasmtimeError is re-raised on this thread)."""
    store = StoreContext(context)
    try:
        entry: _HostEntry = _linker.FUNCTIONS.get(idx or 0)
        signature = entry.signature(ty_raw, store)
        result_type = signature.result_type
        if len(signature.param_types) != nargs or nresults != (0 if result_type is None else 1):
            raise WasmtimeError(f"host function called with {nargs} arguments / {nresults} "
                                f"results for a signature of {len(signature.param_types)}")
        value = entry.func(store, *signature.lift(store, context, args))
        if result_type is not None:
            signature.lower(store, context, value, results)
    except Exception as exc:  # noqa: BLE001 -- handed to Wasmtime, re-raised on this thread
        return host_error(exc)
    finally:
        store._invalidate()
    return 0


# The C callback registered for every host function (bench/host_overhead.py times host calls by
# registering a timed callback in its place before it builds a Runtime).
_call_host_function = ffi.wasmtime_component_func_callback_t(host_call)


def add_host_function(interface: Any, name: str, func: Callable[..., Any], current: Any) -> None:
    """`interface.add_func(name, func)` with cached converters. `current` is the thread-local
    whose `instance` attribute is the Instance running on the calling thread."""
    interface._assert_not_locked()
    name_bytes = name.encode("utf-8")
    name_buf = ctypes.create_string_buffer(name_bytes)
    idx = _linker.FUNCTIONS.allocate(_HostEntry(func, current))
    error = ffi.wasmtime_component_linker_instance_add_func(
        interface.ptr(), name_buf, len(name_bytes), _call_host_function, idx,
        _linker.func_finalize)
    if error:
        raise WasmtimeError._from_ptr(error)


def resource_dtor(idx, context, rep):  # type: ignore
    """The body of every pie resource destructor (the C callback below calls it): the dtor
    registered under `idx` gets the store and the rep; an exception becomes the error Wasmtime
    gets (as in `host_call`)."""
    store = StoreContext(context)
    try:
        _linker.RESOURCE_DTORS.get(idx or 0)(store, rep)
    except Exception as exc:  # noqa: BLE001 -- handed to Wasmtime, re-raised on this thread
        return host_error(exc)
    finally:
        store._invalidate()
    return 0


# The C callback registered for every host resource's destructor: wasmtime-py's own wraps the
# call in a closure and its exception shim, on every drop of a handle.
_drop_host_resource = ffi.wasmtime_component_resource_destructor_t(resource_dtor)


def add_host_resource(interface: Any, name: str, ty: ResourceType,
                      dtor: Callable[[Any, int], None]) -> None:
    """`interface.add_resource(name, ty, dtor)` with the callback above: `dtor(store, rep)` runs
    when the guest drops a handle of the resource."""
    interface._assert_not_locked()
    name_bytes = name.encode("utf-8")
    name_buf = ctypes.create_string_buffer(name_bytes)
    idx = _linker.RESOURCE_DTORS.allocate(dtor)
    error = ffi.wasmtime_component_linker_instance_add_resource(
        interface.ptr(), name_buf, len(name_bytes), ty.ptr(), _drop_host_resource, idx,
        _linker.resource_dtor_finalize)
    if error:
        raise WasmtimeError._from_ptr(error)
