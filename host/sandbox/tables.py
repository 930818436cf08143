"""The per-instance tables: everything a guest names by a local id, owned by its Instance.

- queues:  local queue id -> priority (in-order command streams; `pie:inferlet/queue`)
- futures: forward-future resource rep -> the scheduler future and its lowered result
- pages:   local page / sequence ids -> physical pages (host.kv.InstancePages)
- generations: generation ids -> host-kept sampling state (grammar matcher, tokens for penalties)
- decode_loops: decode-stream resource rep -> a host-run decode loop (`forward.submit-decode`)
- samplers: sampler records already checked -> their engine SamplerSpec (a decode loop submits
  the same sampler every step)

Only the instance's own thread touches `queues` and `futures` (its host calls run there); the
runtime clears them with `clear()` once the instance has ended. `pages` is thread-safe by itself.
Every table is bounded: going past a bound traps the instance, naming the call and the bound.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Protocol

from engine.constrain import GenerationState
from host.errors import TrapError
from host.kv import InstancePages

__all__ = ["InstanceTables", "QueueTable", "FutureTable", "ForwardFutureEntry", "GenerationTable",
           "DecodeLoopTable", "StoppableLoop", "SamplerCache", "MAX_QUEUES", "MAX_LIVE_FUTURES",
           "MAX_GENERATIONS", "MAX_LIVE_DECODE_LOOPS", "MAX_CACHED_SAMPLERS"]

MAX_QUEUES = 4096          # per instance, at once
MAX_LIVE_FUTURES = 65536   # per instance
MAX_GENERATIONS = 4096     # per instance, at once
MAX_LIVE_DECODE_LOOPS = 1024   # per instance: decode-stream resources not dropped
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


class StoppableLoop(Protocol):
    """What the table needs of a decode loop (host/bindings/decoding.py)."""

    def stop(self) -> None:
        """Submit no further pass (one in flight still runs)."""


class DecodeLoopTable:
    """decode-stream resource reps (never reused, from 1) -> decode loops. Thread-safe:
    `stop_all` runs on whichever thread ends the instance."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loops: dict[int, Any] = {}
        self._next_rep = 1
        self._stopped = False

    def __len__(self) -> int:
        return len(self._loops)

    def add(self, call: str, loop: StoppableLoop) -> int:
        """Keep `loop` under a new rep; after `stop_all` the loop is stopped at once."""
        with self._lock:
            if len(self._loops) >= MAX_LIVE_DECODE_LOOPS:
                raise TrapError(f"{call}: {MAX_LIVE_DECODE_LOOPS} decode-streams alive; drop "
                                f"some first")
            rep = self._next_rep
            self._next_rep += 1
            self._loops[rep] = loop
            stopped = self._stopped
        if stopped:
            loop.stop()
        return rep

    def get(self, call: str, rep: int) -> Any:
        with self._lock:
            loop = self._loops.get(rep)
        if loop is None:
            raise TrapError(f"{call}: unknown decode-stream {rep}")
        return loop

    def drop(self, rep: int) -> None:
        with self._lock:
            loop = self._loops.pop(rep, None)
        if loop is not None:
            loop.stop()

    def stop_all(self) -> None:
        """Stop every loop, now and any added later (the instance is ending)."""
        with self._lock:
            self._stopped = True
            loops = list(self._loops.values())
        for loop in loops:
            loop.stop()

    def clear(self) -> None:
        self.stop_all()
        with self._lock:
            self._loops.clear()


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
        self.decode_loops = DecodeLoopTable()
        self.samplers = SamplerCache()

    def clear(self) -> None:
        """At the instance's end: decode loops stopped, every page reference back, queues and
        futures forgotten."""
        self.decode_loops.clear()
        self.pages.release_all()
        self.futures.clear()
        self.queues.clear()
