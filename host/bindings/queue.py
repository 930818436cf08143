"""`pie:inferlet/queue`: in-order command streams of one instance, with a priority."""
from __future__ import annotations

from typing import Callable

from host.bindings.context import BindingContext
from host.errors import TrapError

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES", "QueueTable", "MAX_QUEUES"]

MAX_QUEUES = 4096          # per instance, at once


class QueueTable:
    """Local queue ids (never reused) -> priority. `priority_of(queue_id)`: the priority, or
    None for an unknown id (the dict's own get: a C call); `priority` traps instead."""

    def __init__(self) -> None:
        self._priorities: dict[int, str] = {}
        self._next_id = 0
        self.priority_of: Callable[[int], str | None] = self._priorities.get   # never replaced

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


INTERFACE = "pie:inferlet/queue@0.1.0"


def create(ctx: BindingContext, priority: str) -> int:
    return ctx.tables.queues.create(priority)


def synchronize(ctx: BindingContext, queue_id: int) -> None:
    ctx.tables.queues.priority("queue.synchronize", queue_id)
    _wait_queue(ctx, "queue.synchronize", queue_id)


def destroy(ctx: BindingContext, queue_id: int) -> None:
    ctx.tables.queues.priority("queue.destroy", queue_id)
    _wait_queue(ctx, "queue.destroy", queue_id)
    ctx.tables.queues.remove(queue_id)


def _wait_queue(ctx: BindingContext, call: str, queue_id: int) -> None:
    future = ctx.services.scheduler.synchronize_future((ctx.instance_id, queue_id))
    if future is None:
        return
    try:
        ctx.wait_future(future, call)
    except TrapError:   # terminated (Cancelled) or max_blocking_s passed
        raise
    except Exception:  # noqa: BLE001 -- a failed pass reports through its own future's get
        ctx.check_not_cancelled(call)


FUNCTIONS = {"create": create, "destroy": destroy, "synchronize": synchronize}
METHODS: dict = {}
RESOURCES: dict = {}
