"""`pie:inferlet/adapters`: LoRA adapters an instance opens by name and binds to its sequences.

The engine holds the adapters (engine.adapters.AdapterStore, `Engine.adapters`); here an instance
gets local handles on them (`AdapterTable`, bounded) and binds its sequences to them: the
sequence keeps the adapter's name (host.kv.InstancePages.bind_adapter) and puts it on every pass
prepared for it, a decode loop's later passes too; the engine applies it.
"""
from __future__ import annotations

from typing import Sequence

from host.bindings.context import BindingContext
from host.errors import TrapError

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES", "AdapterTable",
           "MAX_ADAPTER_HANDLES", "MAX_NAME_CHARS"]

MAX_ADAPTER_HANDLES = 256      # per instance: open adapters
MAX_NAME_CHARS = 64            # an adapter name (engine.adapters.ADAPTER_NAME)


class AdapterTable:
    """Local adapter handles (never reused, from 1) <-> engine adapter names. Which adapter a
    sequence runs with is the sequence's (host.kv.InstancePages.bind_adapter). Only the
    instance's own thread touches it."""

    def __init__(self) -> None:
        self._names: dict[int, str] = {}
        self._handle_of: dict[str, int] = {}
        self._next_handle = 1

    def open(self, call: str, name: str) -> int:
        """The handle of `name` (the same for every open of one name)."""
        handle = self._handle_of.get(name)
        if handle is not None:
            return handle
        if len(self._names) >= MAX_ADAPTER_HANDLES:
            raise TrapError(f"{call}: {MAX_ADAPTER_HANDLES} adapters already open")
        handle = self._next_handle
        self._next_handle += 1
        self._names[handle], self._handle_of[name] = name, handle
        return handle

    def name_of(self, call: str, handle: int) -> str:
        """The engine name of an open handle; traps on an unknown one."""
        name = self._names.get(handle)
        if name is None:
            raise TrapError(f"{call}: unknown adapter handle {handle}")
        return name

    def handle_of(self, name: str) -> int | None:
        return self._handle_of.get(name)

    @property
    def num_opened(self) -> int:
        """Adapters the instance has opened so far (its passes' K/V may depend on them)."""
        return len(self._names)

    def clear(self) -> None:
        self._names.clear()
        self._handle_of.clear()


def available_names(ctx: BindingContext) -> Sequence[str]:
    """The adapters the instance may open (none for an engine without adapters), sorted: its
    tenant's own (a server's uploads) and the unscoped ones (`pie run --adapter`)."""
    store = getattr(ctx.services.engine, "adapters", None)
    return () if store is None else store.names_in(ctx.tenant or None)


INTERFACE = "pie:inferlet/adapters@0.1.0"


def open_adapter(ctx: BindingContext, name: str) -> int | str:
    """result<u32, string>: a handle on `name` (an int), or the err text when the engine has no
    such adapter for the instance's tenant (its own adapter of that name, else an unscoped
    one; engine.adapters.AdapterStore.resolve)."""
    if len(name) > MAX_NAME_CHARS:
        return f"adapter names are at most {MAX_NAME_CHARS} characters"
    store = getattr(ctx.services.engine, "adapters", None)
    engine_name = None if store is None else store.resolve(name, ctx.tenant or None)
    if engine_name is None:
        return f"no adapter named {name!r}"
    return ctx.tables.adapters.open("adapters.open", engine_name)


def available(ctx: BindingContext) -> list[str]:
    return list(available_names(ctx))


def bind(ctx: BindingContext, sequence_id: int, handle: int | None) -> None:
    call = "adapters.bind"
    name = None if handle is None else ctx.tables.adapters.name_of(call, handle)
    ctx.tables.pages.bind_adapter(call, sequence_id, name)


def bound(ctx: BindingContext, sequence_id: int) -> int | None:
    name = ctx.tables.pages.adapter_of(sequence_id)
    return None if name is None else ctx.tables.adapters.handle_of(name)


FUNCTIONS = {"open": open_adapter, "available": available, "bind": bind, "bound": bound}
METHODS: dict = {}
RESOURCES: dict = {}
