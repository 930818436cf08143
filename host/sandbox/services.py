"""What an instance is given: the services every instance of a runtime shares (`HostServices`,
`ModelInfo`) and what its launch gives it (`Launch`)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

from wasmtime import Engine
from wasmtime.component import Linker

from engine.protocol import EngineLike
from host.messages.hub import InstanceChannel, MessageHub
from host.runtime_config import InstanceLimits
from host.sandbox.events import InstanceOutcome
from host.sandbox.guest_activity import GuestActivity
from host.sandbox.instance_threads import InstanceThreads
from host.scheduling.scheduler import BatchScheduler

if TYPE_CHECKING:
    from host.kv import InstancePages
    from host.sandbox.instance import Instance

__all__ = ["HostServices", "InstanceTables", "Launch", "ModelInfo"]


class InstanceTables(Protocol):
    """What the sandbox needs of an instance's tables (host/bindings/tables.py holds them)."""

    pages: InstancePages             # its KV pages (the runtime reads what it holds)

    def stop_loops(self) -> None:
        """Submit no further pass of the instance's host decode loops."""

    def clear(self) -> None:
        """At the instance's end: every table emptied, every page reference back."""


@dataclass(frozen=True)
class ModelInfo:
    """The model as every instance sees it (runtime.get-model-info, less the per-instance quota)."""

    name: str
    page_size: int
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    chat_template: str
    max_batch_tokens: int


@dataclass(frozen=True)
class HostServices:
    """What the bindings of every instance of one runtime share. `current` holds, per thread,
    the Instance whose guest runs on that thread (each instance has its own thread)."""

    wasm_engine: Engine              # epoch interruption on
    linker: Linker
    scheduler: BatchScheduler
    hub: MessageHub
    engine: EngineLike
    model_info: ModelInfo
    version: str
    epoch_tick_ms: int
    current: threading.local
    threads: InstanceThreads         # each running instance's thread comes from here
    counts_memory: bool = False      # LinearMemories creates and counts every linear memory
    guests: GuestActivity = field(default_factory=GuestActivity)   # what the epoch ticker needs


@dataclass(frozen=True)
class Launch:
    """Who an instance is and what it holds, from its launch (host/runtime.py)."""

    instance_id: str
    tenant: str
    args: tuple[str, ...]
    limits: InstanceLimits
    tables: InstanceTables
    channel: InstanceChannel
    launch_index: int
    on_finish: Callable[["Instance", InstanceOutcome], None]
