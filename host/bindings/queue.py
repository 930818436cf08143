"""`pie:inferlet/queue`: in-order command streams of one instance, with a priority."""
from __future__ import annotations

from host.bindings.context import BindingContext
from host.errors import TrapError

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES"]

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
