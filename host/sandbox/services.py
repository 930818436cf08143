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
from host.sandbox.events import InstanceEvent, InstanceOutcome
from host.sandbox.guest_activity import GuestActivity
from host.sandbox.instance_threads import InstanceThreads
from host.scheduling.scheduler import BatchScheduler

if TYPE_CHECKING:
    from host.kv import InstancePages
    from host.sandbox.instance import Instance

__all__ = ["HostServices", "InstanceTables", "Launch", "ModelInfo", "Spawner"]


class InstanceTables(Protocol):
    """What the sandbox needs of an instance's tables (host/bindings/tables.py holds them)."""

    pages: InstancePages             # its KV pages (the runtime reads what it holds)

    def stop_loops(self) -> None:
        """Submit no further pass of the instance's host decode loops."""

    def clear(self) -> None:
        """At the instance's end: every table emptied, every page reference back."""


class Spawner(Protocol):
    """What a binding may ask of the runtime about child inferlets (host/spawns.py implements
    it): launch a child of the calling instance, message it, end it. Nothing else of the
    runtime is reachable from a WIT call."""

    def spawn(self, parent_id: str, program: str, args: tuple[str, ...], detached: bool,
              on_event: Callable[[InstanceEvent], None]) -> str:
        """Launch a child of `parent_id` ("" = the parent's own program, else a name or hash the
        runtime's resolver knows for the parent's tenant); `on_event` gets its messages and its
        end, on the child's thread. Returns the child's id; host.errors.SpawnRefused naming the
        program or the limit."""

    def send(self, child_id: str, message: str) -> bool:
        """Deliver a message to the child's messaging.receive; False once it has ended.
        host.errors.LimitError past its unread client messages' limit."""

    def kill(self, child_id: str, reason: str) -> bool:
        """End the child with status "terminated" and `reason`; False once it has ended."""


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
    spawner: Spawner | None = None   # child inferlets (children.spawn); None: none may be spawned


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
