"""The per-instance tables: everything a guest names by a local id, owned by its Instance.

- queues:  local queue id -> priority (`queue.py`)
- futures: forward-future resource rep -> the scheduler future and its lowered result (`forward.py`)
- pages:   local page / sequence ids -> physical pages (host.kv.InstancePages)
- generations: generation ids -> host-kept sampling state (`generations.py`)
- decode_loops: decode-stream resource rep -> a host-run decode loop (`decoding.py`)
- samplers: sampler records already checked -> their engine SamplerSpec (`samplers.py`)
- adapters: adapter handles -> engine adapter names, sequences -> their bound handle (`adapters.py`)
- children: child resource reps -> the children it spawned (`children.py`)
- outbound: pending-response reps -> its HTTP requests, and its MCP calls (host/outbound/;
  `http.py`, `mcp.py`); tables built without one may reach nothing

Only the instance's own thread touches `queues` and `futures` (its host calls run there); the
runtime clears them with `clear()` once the instance has ended. `pages` is thread-safe by itself.
Every table is bounded: going past a bound traps the instance, naming the call and the bound.
"""
from __future__ import annotations

from host.bindings.adapters import AdapterTable
from host.bindings.children import ChildTable
from host.bindings.decoding import DecodeLoopTable
from host.bindings.forward import FutureTable
from host.bindings.generations import GenerationTable
from host.bindings.queue import QueueTable
from host.bindings.samplers import SamplerCache
from host.kv import InstancePages
from host.outbound import InstanceOutbound, Outbound
from host.runtime_config import OutboundLimits

__all__ = ["InstanceTables"]


class InstanceTables:
    """The tables of one instance: one per WIT interface that names things by a local id, each
    kept beside its binding. Built by the runtime; the sandbox holds it as `InstanceTables`
    (host/sandbox/services.py)."""

    def __init__(self, pages: InstancePages, outbound: InstanceOutbound | None = None) -> None:
        self.queues = QueueTable()
        self.futures = FutureTable()
        self.pages = pages
        self.generations = GenerationTable()
        self.decode_loops = DecodeLoopTable()
        self.samplers = SamplerCache()
        self.adapters = AdapterTable()
        self.children = ChildTable()
        self.outbound = outbound or Outbound().for_instance("", OutboundLimits())

    def stop_loops(self) -> None:
        """Stop every decode loop, now and any added later, and wake a call waiting for the
        instance's pages to be restored (the instance is ending)."""
        self.decode_loops.stop_all()
        self.pages.interrupt("the instance is ending")

    def clear(self) -> None:
        """At the instance's end: decode loops stopped, every page reference back, queues and
        futures forgotten."""
        self.decode_loops.clear()
        self.pages.release_all()
        self.futures.clear()
        self.queues.clear()
        self.adapters.clear()
        self.children.clear()
        self.outbound.clear()
