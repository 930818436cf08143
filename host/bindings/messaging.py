"""`pie:inferlet/messaging`: the instance's client channel, topics, and the tenant's store.
Blocking receives wait at most `max_receive_wait_s` (and `max_blocking_s`), then trap naming the
limit, and wake with Cancelled on terminate; while they wait the guest runs no Wasm
(GuestActivity: the epoch ticker may rest)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from host.bindings.context import BindingContext
from host.errors import TrapError

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES", "MAX_MESSAGE_CHARS"]

INTERFACE = "pie:inferlet/messaging@0.1.0"
MAX_MESSAGE_CHARS = 1 << 20


def send(ctx: BindingContext, message: str) -> None:
    _check_size("messaging.send", message)
    ctx.channel.send(message)


def receive(ctx: BindingContext) -> str:
    timeout, limit = _receive_timeout(ctx)
    with _blocking(ctx):
        message = ctx.channel.receive(timeout)
    return _received(ctx, "messaging.receive", message, timeout, limit)


def try_receive(ctx: BindingContext) -> str | None:
    return ctx.channel.try_receive()


def broadcast(ctx: BindingContext, topic: str, message: str) -> None:
    _check_size("messaging.broadcast", message)
    ctx.channel.broadcast(topic, message)


def subscribe(ctx: BindingContext, topic: str) -> None:
    ctx.channel.subscribe(topic)


def receive_topic(ctx: BindingContext, topic: str) -> str:
    timeout, limit = _receive_timeout(ctx)
    with _blocking(ctx):
        message = ctx.channel.receive_topic(topic, timeout)
    return _received(ctx, "messaging.receive-topic", message, timeout, limit)


def try_receive_topic(ctx: BindingContext, topic: str) -> str | None:
    return ctx.channel.try_receive_topic(topic)


def store_get(ctx: BindingContext, key: str) -> str | None:
    return ctx.channel.store_get(key)


def store_set(ctx: BindingContext, key: str, value: str) -> None:
    _check_size("messaging.store-set", value)
    ctx.channel.store_set(key, value)


def store_delete(ctx: BindingContext, key: str) -> bool:
    return ctx.channel.store_delete(key)


@contextmanager
def _blocking(ctx: BindingContext) -> Iterator[None]:
    """Around a wait of the instance: the scheduler's hold after a batch stops waiting for it,
    and its guest is counted out of those that may run Wasm (the epoch ticker may rest)."""
    ctx.services.scheduler.owner_waiting(ctx.instance_id)
    with ctx.services.guests.blocked():
        yield


def _receive_timeout(ctx: BindingContext) -> tuple[float | None, str]:
    """The longest a receive may wait, and the InstanceLimits field that sets it."""
    blocking, waiting = ctx.blocking_timeout(), ctx.limits.max_receive_wait_s
    if waiting is None or (blocking is not None and blocking <= waiting):
        return blocking, "max_blocking_s"
    return waiting, "max_receive_wait_s"


def _received(ctx: BindingContext, call: str, message: str | None, timeout: float | None,
              limit: str) -> str:
    if message is None:
        ctx.check_not_cancelled(call)
        raise TrapError(f"{call}: no message within {timeout:g} s ({limit})")
    return message


def _check_size(call: str, text: str) -> None:
    if len(text) > MAX_MESSAGE_CHARS:
        raise TrapError(f"{call}: {len(text)} characters, more than {MAX_MESSAGE_CHARS}")


FUNCTIONS = {
    "send": send, "receive": receive, "try-receive": try_receive, "broadcast": broadcast,
    "subscribe": subscribe, "receive-topic": receive_topic,
    "try-receive-topic": try_receive_topic, "store-get": store_get, "store-set": store_set,
    "store-delete": store_delete,
}
METHODS: dict = {}
RESOURCES: dict = {}
