"""`pie:inferlet/adapters`: LoRA adapters an instance opens by name and binds to its sequences.

The engine holds the adapters (engine.adapters.AdapterStore, `Engine.adapters`); here an instance
gets local handles on them (`AdapterTable`, bounded) and binds sequences to handles. The forward
bindings (forward.py, decoding.py) put the bound adapter's name on every pass of the sequence
(`with_adapter`, `AdapterPages` for a decode loop's later passes); the engine applies it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from host.bindings.context import BindingContext
from host.errors import TrapError
from host.scheduling.work import PreparedForward

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES", "AdapterTable", "AdapterPages",
           "with_adapter", "MAX_ADAPTER_HANDLES", "MAX_BOUND_SEQUENCES", "MAX_NAME_CHARS"]

MAX_ADAPTER_HANDLES = 256      # per instance: open adapters
MAX_BOUND_SEQUENCES = 65536    # per instance: sequences bound to an adapter
MAX_NAME_CHARS = 64            # an adapter name (engine.adapters.ADAPTER_NAME)


class AdapterTable:
    """Local adapter handles (never reused, from 1) -> engine adapter names, and sequence ids ->
    the handle they are bound to. Only the instance's own thread touches it."""

    def __init__(self) -> None:
        self._names: dict[int, str] = {}
        self._handle_of: dict[str, int] = {}
        self._bound: dict[int, int] = {}
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

    def bind(self, call: str, sequence_id: int, handle: int | None) -> None:
        if handle is None:
            self._bound.pop(sequence_id, None)
            return
        if handle not in self._names:
            raise TrapError(f"{call}: unknown adapter handle {handle}")
        if sequence_id not in self._bound and len(self._bound) >= MAX_BOUND_SEQUENCES:
            raise TrapError(f"{call}: {MAX_BOUND_SEQUENCES} sequences already bound to adapters")
        self._bound[sequence_id] = handle

    def bound(self, sequence_id: int) -> int | None:
        return self._bound.get(sequence_id)

    @property
    def num_opened(self) -> int:
        """Adapters the instance has opened so far (its passes' K/V may depend on them)."""
        return len(self._names)

    def adapter_of(self, sequence_id: int) -> str | None:
        """The engine name of the adapter `sequence_id` is bound to, or None."""
        handle = self._bound.get(sequence_id)
        return None if handle is None else self._names[handle]

    def forget_sequence(self, sequence_id: int) -> None:
        self._bound.pop(sequence_id, None)

    def clear(self) -> None:
        self._names.clear()
        self._handle_of.clear()
        self._bound.clear()


def with_adapter(prepared: PreparedForward, adapter: str | None) -> PreparedForward:
    """`prepared` with its request naming `adapter` (unchanged when None)."""
    if adapter is None:
        return prepared
    return dataclasses.replace(prepared, request=dataclasses.replace(prepared.request,
                                                                      adapter=adapter))


class AdapterPages:
    """A decode loop's page table (host.scheduling.decode_loop.DecodePages) whose passes name
    `adapter`: the instance's own, with the adapter put on each pass it prepares."""

    def __init__(self, pages: Any, adapter: str) -> None:
        self._pages = pages
        self._adapter = adapter
        self.page_size = pages.page_size

    def prepare(self, *args: Any, **kwargs: Any) -> tuple[PreparedForward, int | None] | None:
        step = self._pages.prepare(*args, **kwargs)
        return None if step is None else (with_adapter(step[0], self._adapter), step[1])

    def undo_grow(self, sequence_id: int, page_id: int) -> None:
        self._pages.undo_grow(sequence_id, page_id)


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
    ctx.tables.adapters.bind("adapters.bind", sequence_id, handle)


def bound(ctx: BindingContext, sequence_id: int) -> int | None:
    return ctx.tables.adapters.bound(sequence_id)


FUNCTIONS = {"open": open_adapter, "available": available, "bind": bind, "bound": bound}
METHODS: dict = {}
RESOURCES: dict = {}
