"""`pie:inferlet/messaging`: the instance's client channel, topics, and the tenant's store.
Blocking receives wait at most `max_blocking_s` and wake with Cancelled on terminate."""
from __future__ import annotations

from typing import Any

from host.errors import TrapError

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES", "MAX_MESSAGE_CHARS"]

INTERFACE = "pie:inferlet/messaging@0.1.0"
MAX_MESSAGE_CHARS = 1 << 20


def send(instance: Any, message: str) -> None:
    _check_size("messaging.send", message)
    instance.channel.send(message)


def receive(instance: Any) -> str:
    _blocking(instance)
    return _received(instance, "messaging.receive",
                     instance.channel.receive(instance.blocking_timeout()))


def try_receive(instance: Any) -> str | None:
    return instance.channel.try_receive()


def broadcast(instance: Any, topic: str, message: str) -> None:
    _check_size("messaging.broadcast", message)
    instance.channel.broadcast(topic, message)


def subscribe(instance: Any, topic: str) -> None:
    instance.channel.subscribe(topic)


def receive_topic(instance: Any, topic: str) -> str:
    _blocking(instance)
    return _received(instance, "messaging.receive-topic",
                     instance.channel.receive_topic(topic, instance.blocking_timeout()))


def try_receive_topic(instance: Any, topic: str) -> str | None:
    return instance.channel.try_receive_topic(topic)


def store_get(instance: Any, key: str) -> str | None:
    return instance.channel.store_get(key)


def store_set(instance: Any, key: str, value: str) -> None:
    _check_size("messaging.store-set", value)
    instance.channel.store_set(key, value)


def store_delete(instance: Any, key: str) -> bool:
    return instance.channel.store_delete(key)


def _blocking(instance: Any) -> None:
    """The instance is about to block: the scheduler's hold after a batch stops waiting for it."""
    instance.services.scheduler.owner_waiting(instance.instance_id)


def _received(instance: Any, call: str, message: str | None) -> str:
    if message is None:
        instance.check_not_cancelled(call)
        raise TrapError(f"{call}: no message within {instance.blocking_timeout():g} s")
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
