"""Messages with the client, broadcasts between instances, and the tenant's key-value store."""
from __future__ import annotations

import json

from inferlet._wit import messaging

__all__ = ["send", "send_json", "receive", "receive_json", "try_receive", "broadcast",
           "Subscription", "subscribe", "store_get", "store_set", "store_delete"]


def send(message: str) -> None:
    """Send a message to the client (streamed to it as it comes)."""
    messaging.send(message)


def send_json(value) -> None:
    """Send a JSON-encoded value to the client."""
    messaging.send(json.dumps(value))


def receive() -> str:
    """Block until the client sends a message."""
    return messaging.receive()


def receive_json():
    """Block until the client sends a message; decode it as JSON."""
    return json.loads(messaging.receive())


def try_receive() -> str | None:
    """A message from the client if one is waiting, else None."""
    return messaging.try_receive()


def broadcast(topic: str, message: str) -> None:
    """Publish on `topic` to every instance of this tenant subscribed to it."""
    messaging.broadcast(topic, message)


class Subscription:
    """Broadcasts on one topic (those sent after `subscribe`)."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        messaging.subscribe(topic)

    def receive(self) -> str:
        """Block until a broadcast arrives."""
        return messaging.receive_topic(self.topic)

    def try_receive(self) -> str | None:
        """A broadcast if one is waiting, else None."""
        return messaging.try_receive_topic(self.topic)


def subscribe(topic: str) -> Subscription:
    """Start receiving `topic`'s broadcasts."""
    return Subscription(topic)


def store_get(key: str) -> str | None:
    """The value under `key` in the tenant's store, or None."""
    return messaging.store_get(key)


def store_set(key: str, value: str) -> None:
    """Set `key` in the tenant's store."""
    messaging.store_set(key, value)


def store_delete(key: str) -> bool:
    """Delete `key`; True if it existed."""
    return messaging.store_delete(key)
