"""`pie:inferlet/queue`: in-order command streams of one instance, with a priority."""
from __future__ import annotations

from typing import Any

from host.errors import TrapError

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES", "queue_priority", "MAX_QUEUES"]

INTERFACE = "pie:inferlet/queue@0.1.0"
MAX_QUEUES = 4096   # per instance, at once


def queue_priority(instance: Any, call: str, queue_id: int) -> str:
    """The priority of a queue of this instance; traps on an unknown id."""
    priority = instance.queues.get(queue_id)
    if priority is None:
        raise TrapError(f"{call}: unknown queue id {queue_id}")
    return priority


def create(instance: Any, priority: str) -> int:
    if len(instance.queues) >= MAX_QUEUES:
        raise TrapError(f"queue.create: {MAX_QUEUES} queues already open")
    queue_id = instance.next_queue_id
    instance.next_queue_id += 1
    instance.queues[queue_id] = priority
    return queue_id


def synchronize(instance: Any, queue_id: int) -> None:
    queue_priority(instance, "queue.synchronize", queue_id)
    _wait_queue(instance, "queue.synchronize", queue_id)


def destroy(instance: Any, queue_id: int) -> None:
    queue_priority(instance, "queue.destroy", queue_id)
    _wait_queue(instance, "queue.destroy", queue_id)
    del instance.queues[queue_id]


def _wait_queue(instance: Any, call: str, queue_id: int) -> None:
    future = instance.services.scheduler.synchronize_future((instance.instance_id, queue_id))
    if future is None:
        return
    try:
        instance.wait_future(future, call)
    except TrapError:   # terminated (Cancelled) or max_blocking_s passed
        raise
    except Exception:  # noqa: BLE001 -- a failed pass reports through its own future's get
        instance.check_not_cancelled(call)


FUNCTIONS = {"create": create, "destroy": destroy, "synchronize": synchronize}
METHODS: dict = {}
RESOURCES: dict = {}
