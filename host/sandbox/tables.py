"""The per-instance tables: everything a guest names by a local id, owned by its Instance.

- queues:  local queue id -> priority (in-order command streams; `pie:inferlet/queue`)
- futures: forward-future resource rep -> the scheduler future and its lowered result
- pages:   local page / sequence ids -> physical pages (host.kv.InstancePages)
- generations: generation ids -> host-kept sampling state (grammar matcher, tokens for penalties)
- samplers: sampler records already checked -> their engine SamplerSpec (a decode loop submits
  the same sampler every step)

Only the instance's own thread touches `queues` and `futures` (its host calls run there); the
runtime clears them with `clear()` once the instance has ended. `pages` is thread-safe by itself.
Every table is bounded: going past a bound traps the instance, naming the call and the bound.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from engine.constrain import GenerationState
from host.errors import TrapError
from host.kv import InstancePages

__all__ = ["InstanceTables", "QueueTable", "FutureTable", "ForwardFutureEntry", "GenerationTable",
           "SamplerCache", "MAX_QUEUES", "MAX_LIVE_FUTURES", "MAX_GENERATIONS",
           "MAX_CACHED_SAMPLERS"]

MAX_QUEUES = 4096          # per instance, at once
MAX_LIVE_FUTURES = 65536   # per instance
MAX_GENERATIONS = 4096     # per instance, at once
MAX_CACHED_SAMPLERS = 64   # per instance: checked sampler records kept (emptied when full)


class QueueTable:
    """Local queue ids (never reused) -> priority."""

    def __init__(self) -> None:
        self._priorities: dict[int, str] = {}
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._priorities)

    def create(self, priority: str) -> int:
        if len(self._priorities) >= MAX_QUEUES:
            raise TrapError(f"queue.create: {MAX_QUEUES} queues already open")
        queue_id = self._next_id
        self._next_id += 1
        self._priorities[queue_id] = priority
        return queue_id

    def priority(self, call: str, queue_id: int) -> str:
        """The priority of a queue; traps on an unknown id."""
        priority = self._priorities.get(queue_id)
        if priority is None:
            raise TrapError(f"{call}: unknown queue id {queue_id}")
        return priority

    def remove(self, queue_id: int) -> None:
        del self._priorities[queue_id]

    def clear(self) -> None:
        self._priorities.clear()


class ForwardFutureEntry:
    """A forward-future resource the guest holds: the scheduler future and its lowered result."""

    __slots__ = ("future", "result")

    def __init__(self, future: Future) -> None:
        self.future = future
        self.result: Any = None


class FutureTable:
    """Forward-future resource reps (never reused, from 1) -> entries. Wasmtime runs no destructor
    for handles a guest never dropped, so the instance keeps its own table and clears it at its end."""

    def __init__(self) -> None:
        self._entries: dict[int, ForwardFutureEntry] = {}
        self._next_rep = 1

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, call: str, future: Future) -> int:
        if len(self._entries) >= MAX_LIVE_FUTURES:
            raise TrapError(f"{call}: {MAX_LIVE_FUTURES} forward-futures alive; drop some first")
        rep = self._next_rep
        self._next_rep += 1
        self._entries[rep] = ForwardFutureEntry(future)
        return rep

    def get(self, call: str, rep: int) -> ForwardFutureEntry:
        entry = self._entries.get(rep)
        if entry is None:
            raise TrapError(f"{call}: unknown forward-future {rep}")
        return entry

    def drop(self, rep: int) -> None:
        self._entries.pop(rep, None)

    def clear(self) -> None:
        self._entries.clear()


class GenerationTable:
    """Generation id -> GenerationState of one instance. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[int, GenerationState] = {}
        self._next_id = 1

    def add(self, call: str, state: GenerationState) -> int:
        with self._lock:
            if len(self._states) >= MAX_GENERATIONS:
                raise TrapError(f"{call}: {MAX_GENERATIONS} generations alive; destroy some first")
            generation_id = self._next_id
            self._next_id += 1
            self._states[generation_id] = state
            return generation_id

    def get(self, call: str, generation_id: int) -> GenerationState:
        with self._lock:
            state = self._states.get(generation_id)
        if state is None:
            raise TrapError(f"{call}: unknown generation {generation_id}")
        return state

    def remove(self, call: str, generation_id: int) -> None:
        with self._lock:
            if self._states.pop(generation_id, None) is None:
                raise TrapError(f"{call}: unknown generation {generation_id}")


class SamplerCache:
    """The fields of a sampler record already checked -> its SamplerSpec. Bounded: emptied when
    it holds MAX_CACHED_SAMPLERS (a guest cycling through many samplers only re-checks them)."""

    def __init__(self) -> None:
        self._specs: dict[tuple, Any] = {}

    def get(self, fields: tuple) -> Any:
        return self._specs.get(fields)

    def put(self, fields: tuple, spec: Any) -> None:
        if len(self._specs) >= MAX_CACHED_SAMPLERS:
            self._specs.clear()
        self._specs[fields] = spec


class InstanceTables:
    """The tables of one instance."""

    def __init__(self, pages: InstancePages) -> None:
        self.queues = QueueTable()
        self.futures = FutureTable()
        self.pages = pages
        self.generations = GenerationTable()
        self.samplers = SamplerCache()

    def clear(self) -> None:
        """At the instance's end: every page reference back, queues and futures forgotten."""
        self.pages.release_all()
        self.futures.clear()
        self.queues.clear()
