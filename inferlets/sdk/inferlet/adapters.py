"""LoRA adapters (WIT `adapters`): open one by name, list what the host offers.

    ctx = inferlet.Context(adapter="my-finetune")        # every pass of ctx runs with it
    ctx.generate(64, adapter=None)                      # this call on the base model

Adapters are registered with the host (`pie run --adapter NAME=PATH`); a Context binds its
sequence to one (`Context.use_adapter`), and its forks inherit it.
"""
from __future__ import annotations

from inferlet._wit import Err, adapters
from inferlet.errors import InferletError

__all__ = ["Adapter", "available_adapters", "open_adapter"]


class Adapter:
    """An opened adapter: its name and the instance-local handle the host gave it."""

    __slots__ = ("name", "handle")

    def __init__(self, name: str, handle: int) -> None:
        self.name = name
        self.handle = handle

    def __repr__(self) -> str:
        return f"Adapter({self.name!r})"


def open_adapter(adapter: "str | Adapter") -> Adapter:
    """The adapter `name` opened (an Adapter is returned as is); InferletError when the host
    has none by that name."""
    if isinstance(adapter, Adapter):
        return adapter
    if not isinstance(adapter, str):
        raise TypeError(f"an adapter is a name or an Adapter, not {type(adapter).__name__}")
    try:
        return Adapter(adapter, adapters.open(adapter))
    except Err as err:
        raise InferletError(f"adapter {adapter!r}: {err.value}") from None


def available_adapters() -> list[str]:
    """The names of the adapters the host offers, sorted."""
    return list(adapters.available())


def bind(sequence_id: int, adapter: "Adapter | None") -> None:
    """Run every later pass of the sequence with `adapter` (None: the base model)."""
    adapters.bind(sequence_id, None if adapter is None else adapter.handle)
