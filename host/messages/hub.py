"""Messages: client <-> instance channels, topics between the instances of a tenant, and a small
key-value store per tenant.

Everything here is thread-safe and owned by one `MessageHub` (no module state). Blocking receives
wait on a condition and are woken by `close` (terminate): they then raise `Cancelled` naming the call
and the reason. A receive with a timeout returns None when it expires (the caller decides whether
that is a trap). Topic broadcasts reach only the instances subscribed before the broadcast.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from host.errors import Cancelled, TrapError

__all__ = ["Inbox", "KeyValueStore", "MessageHub", "InstanceChannel"]


class Inbox:
    """A FIFO of strings. With `capacity`, a put into a full inbox drops the oldest message
    (counted in num_dropped) so a reader that never reads cannot grow memory without bound."""

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"Inbox capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.num_dropped = 0
        self._cond = threading.Condition()
        self._messages: deque[str] = deque()
        self._closed_reason: str | None = None

    def put(self, message: str) -> bool:
        """Append a message; False (dropped) when the inbox is closed."""
        with self._cond:
            if self._closed_reason is not None:
                return False
            if self.capacity is not None and len(self._messages) >= self.capacity:
                self._messages.popleft()
                self.num_dropped += 1
            self._messages.append(message)
            self._cond.notify()
            return True

    def receive(self, timeout: float | None = None, *, call: str = "messaging.receive") -> str | None:
        """The oldest message, waiting for one. None when `timeout` seconds pass first; raises
        Cancelled once the inbox is closed (pending messages are then dropped)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._check_open(call)
                if self._messages:
                    return self._messages.popleft()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def try_receive(self, *, call: str = "messaging.try-receive") -> str | None:
        with self._cond:
            self._check_open(call)
            return self._messages.popleft() if self._messages else None

    def close(self, reason: str) -> None:
        """Wake every waiter with Cancelled(reason); later puts are dropped. Idempotent."""
        with self._cond:
            if self._closed_reason is None:
                self._closed_reason = reason
                self._messages.clear()
            self._cond.notify_all()

    @property
    def num_pending(self) -> int:
        with self._cond:
            return len(self._messages)

    def _check_open(self, call: str) -> None:
        if self._closed_reason is not None:
            raise Cancelled(f"{call}: {self._closed_reason}")


class KeyValueStore:
    """A tenant's string -> string store, at most `max_keys` keys."""

    def __init__(self, max_keys: int = 10_000) -> None:
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._values: dict[str, str] = {}

    def get(self, key: str) -> str | None:
        with self._lock:
            return self._values.get(key)

    def set(self, key: str, value: str) -> None:
        with self._lock:
            if key not in self._values and len(self._values) >= self.max_keys:
                raise TrapError(f"messaging.store-set: the store is full ({self.max_keys} keys); "
                                f"cannot add {key!r}")
            self._values[key] = value

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._values.pop(key, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)


class MessageHub:
    """All channels of a runtime. `open` an instance's channel at launch, `close` it at the end."""

    def __init__(self, *, topic_capacity: int = 1024, store_max_keys: int = 10_000) -> None:
        self.topic_capacity = topic_capacity
        self.store_max_keys = store_max_keys
        self._lock = threading.Lock()
        self._channels: dict[str, InstanceChannel] = {}
        self._topics: dict[tuple[str, str], dict[str, Inbox]] = {}   # (tenant, topic) -> subscribers
        self._stores: dict[str, KeyValueStore] = {}

    def open(self, instance_id: str, tenant: str,
             send_to_client: Callable[[str], None]) -> "InstanceChannel":
        with self._lock:
            if instance_id in self._channels:
                raise ValueError(f"instance {instance_id} already has a channel")
            channel = InstanceChannel(self, instance_id, tenant, send_to_client)
            self._channels[instance_id] = channel
            return channel

    def channel(self, instance_id: str) -> "InstanceChannel | None":
        with self._lock:
            return self._channels.get(instance_id)

    def deliver(self, instance_id: str, message: str) -> bool:
        """Client -> instance. False when the instance has no open channel."""
        channel = self.channel(instance_id)
        return channel is not None and channel.inbox.put(message)

    def close(self, instance_id: str, reason: str) -> None:
        """End an instance's messaging: wake its blocked receives with Cancelled(reason) and drop
        its subscriptions. Idempotent."""
        with self._lock:
            channel = self._channels.pop(instance_id, None)
            for key in list(self._topics):
                self._topics[key].pop(instance_id, None)
                if not self._topics[key]:
                    del self._topics[key]
        if channel is not None:
            channel.close(reason)

    def store(self, tenant: str) -> KeyValueStore:
        with self._lock:
            store = self._stores.get(tenant)
            if store is None:
                store = self._stores[tenant] = KeyValueStore(self.store_max_keys)
            return store

    def subscribe(self, tenant: str, topic: str, instance_id: str) -> Inbox:
        with self._lock:
            if instance_id not in self._channels:
                raise Cancelled(f"messaging.subscribe: instance {instance_id} has no open channel")
            subscribers = self._topics.setdefault((tenant, topic), {})
            inbox = subscribers.get(instance_id)
            if inbox is None:
                inbox = subscribers[instance_id] = Inbox(self.topic_capacity)
            return inbox

    def broadcast(self, tenant: str, topic: str, message: str) -> int:
        """Deliver to the tenant's current subscribers of `topic`; returns how many."""
        with self._lock:
            inboxes = list(self._topics.get((tenant, topic), {}).values())
        return sum(inbox.put(message) for inbox in inboxes)

    def subscription(self, tenant: str, topic: str, instance_id: str) -> Inbox | None:
        with self._lock:
            return self._topics.get((tenant, topic), {}).get(instance_id)


class InstanceChannel:
    """One instance's view of messaging: what the `messaging` WIT binding calls."""

    def __init__(self, hub: MessageHub, instance_id: str, tenant: str,
                 send_to_client: Callable[[str], None]) -> None:
        self.hub = hub
        self.instance_id = instance_id
        self.tenant = tenant
        self.inbox = Inbox()
        self._send_to_client = send_to_client
        self._closed_reason: str | None = None
        self._subscriptions: dict[str, Inbox] = {}
        self._lock = threading.Lock()

    def send(self, message: str) -> None:
        if self._closed_reason is not None:
            raise Cancelled(f"messaging.send: {self._closed_reason}")
        self._send_to_client(message)

    def receive(self, timeout: float | None = None) -> str | None:
        return self.inbox.receive(timeout, call="messaging.receive")

    def try_receive(self) -> str | None:
        return self.inbox.try_receive(call="messaging.try-receive")

    def broadcast(self, topic: str, message: str) -> int:
        if self._closed_reason is not None:
            raise Cancelled(f"messaging.broadcast: {self._closed_reason}")
        return self.hub.broadcast(self.tenant, topic, message)

    def subscribe(self, topic: str) -> None:
        if self._closed_reason is not None:
            raise Cancelled(f"messaging.subscribe: {self._closed_reason}")
        inbox = self.hub.subscribe(self.tenant, topic, self.instance_id)
        with self._lock:
            self._subscriptions[topic] = inbox

    def receive_topic(self, topic: str, timeout: float | None = None) -> str | None:
        return self._topic_inbox("messaging.receive-topic", topic).receive(
            timeout, call="messaging.receive-topic")

    def try_receive_topic(self, topic: str) -> str | None:
        return self._topic_inbox("messaging.try-receive-topic", topic).try_receive(
            call="messaging.try-receive-topic")

    def store_get(self, key: str) -> str | None:
        return self.hub.store(self.tenant).get(key)

    def store_set(self, key: str, value: str) -> None:
        self.hub.store(self.tenant).set(key, value)

    def store_delete(self, key: str) -> bool:
        return self.hub.store(self.tenant).delete(key)

    def close(self, reason: str) -> None:
        """Wake blocked receives (client and topics) with Cancelled(reason)."""
        with self._lock:
            if self._closed_reason is None:
                self._closed_reason = reason
            inboxes = list(self._subscriptions.values())
        self.inbox.close(reason)
        for inbox in inboxes:
            inbox.close(reason)

    def _topic_inbox(self, call: str, topic: str) -> Inbox:
        with self._lock:
            if self._closed_reason is not None:
                raise Cancelled(f"{call}: {self._closed_reason}")
            inbox = self._subscriptions.get(topic)
        if inbox is None:
            raise TrapError(f"{call}: not subscribed to topic {topic!r}")
        return inbox
