"""Messages: client <-> instance channels, topics between the instances of a tenant, and a small
key-value store per tenant.

Everything here is thread-safe and owned by one `MessageHub` (no module state). Blocking receives
wait on a condition and are woken by `close` (terminate): they then raise `Cancelled` naming the call
and the reason. A receive with a timeout returns None when it expires (the caller decides whether
that is a trap). Topic broadcasts reach only the instances subscribed before the broadcast.

Every store is bounded by `MessageLimits` (host/runtime_config.py) in characters as well as in
entries: a tenant's key-value store refuses a set past its size; a subscription's inbox drops its
oldest unread broadcasts; an instance's inbox of client messages refuses a message past its size.

A `TopicRelay` (set with `set_relay`) carries topics beyond this hub: it hears when a (tenant,
topic) gets its first subscriber here and loses its last, and every broadcast made here; what
it brings in from elsewhere is delivered with `deliver_topic` (local subscribers only). A
store source (`set_store_source`) gives each tenant's key-value store from elsewhere instead.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Protocol

from host.errors import Cancelled, LimitError, TrapError
from host.runtime_config import MessageLimits

__all__ = ["Inbox", "KeyValueStore", "MessageHub", "InstanceChannel", "TopicRelay"]


class TopicRelay(Protocol):
    """Topics beyond one hub. `subscribed` returns once broadcasts made elsewhere after it will
    reach this hub; each is called on the calling instance's thread, outside the hub's lock."""

    def subscribed(self, tenant: str, topic: str) -> None: ...

    def unsubscribed(self, tenant: str, topic: str) -> None: ...

    def broadcast(self, tenant: str, topic: str, message: str) -> None: ...


class Inbox:
    """A FIFO of strings, bounded by `capacity` messages and `max_chars` characters (None: no
    bound). When a put would pass a bound, the oldest messages are dropped to make room (counted
    in num_dropped), or, with `refuse_when_full`, the put raises LimitError naming `name` and the
    bound and nothing is dropped. A message longer than max_chars on its own is never queued."""

    def __init__(self, capacity: int | None = None, max_chars: int | None = None, *,
                 refuse_when_full: bool = False, name: str = "inbox") -> None:
        for bound_name, bound in (("capacity", capacity), ("max_chars", max_chars)):
            if bound is not None and bound <= 0:
                raise ValueError(f"Inbox {bound_name} must be positive, got {bound}")
        self.capacity = capacity
        self.max_chars = max_chars
        self.refuse_when_full = refuse_when_full
        self.name = name
        self.num_dropped = 0
        self._num_chars = 0
        self._cond = threading.Condition()
        self._messages: deque[str] = deque()
        self._closed_reason: str | None = None
        self._num_waiting = 0            # receives blocked on an empty inbox

    def put(self, message: str) -> bool:
        """Append a message; False when the inbox is closed, or when the message alone is over
        max_chars and the inbox drops rather than refuses (it is then counted as dropped)."""
        with self._cond:
            if self._closed_reason is not None:
                return False
            if self._full_after(len(message)):
                if self.refuse_when_full:
                    raise LimitError(self._refusal(len(message)))
                if self.max_chars is not None and len(message) > self.max_chars:
                    self.num_dropped += 1
                    return False
                while self._messages and self._full_after(len(message)):
                    self._num_chars -= len(self._messages.popleft())
                    self.num_dropped += 1
            self._messages.append(message)
            self._num_chars += len(message)
            self._cond.notify()
            return True

    def _full_after(self, num_chars: int) -> bool:
        """Whether one more message of num_chars characters passes a bound."""
        return ((self.capacity is not None and len(self._messages) + 1 > self.capacity)
                or (self.max_chars is not None and self._num_chars + num_chars > self.max_chars))

    def _refusal(self, num_chars: int) -> str:
        return (f"{self.name} is full: {len(self._messages)} unread messages of "
                f"{self._num_chars} characters, and {num_chars} more would pass its limit of "
                f"{self.max_chars} characters / {self.capacity} messages")

    def _pop(self) -> str:
        message = self._messages.popleft()
        self._num_chars -= len(message)
        return message

    def receive(self, timeout: float | None = None, *, call: str = "messaging.receive") -> str | None:
        """The oldest message, waiting for one. None when `timeout` seconds pass first; raises
        Cancelled once the inbox is closed (pending messages are then dropped)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._check_open(call)
                if self._messages:
                    return self._pop()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._num_waiting += 1
                try:
                    self._cond.wait(remaining)
                finally:
                    self._num_waiting -= 1

    def try_receive(self, *, call: str = "messaging.try-receive") -> str | None:
        with self._cond:
            self._check_open(call)
            return self._pop() if self._messages else None

    def close(self, reason: str) -> None:
        """Wake every waiter with Cancelled(reason); later puts are dropped. Idempotent."""
        with self._cond:
            if self._closed_reason is None:
                self._closed_reason = reason
                self._messages.clear()
                self._num_chars = 0
            self._cond.notify_all()

    @property
    def num_pending(self) -> int:
        with self._cond:
            return len(self._messages)

    @property
    def is_awaited(self) -> bool:
        """Whether a receive waits on it with nothing queued (the reader waits for input)."""
        with self._cond:
            return self._num_waiting > 0 and not self._messages

    @property
    def num_pending_chars(self) -> int:
        with self._cond:
            return self._num_chars

    def _check_open(self, call: str) -> None:
        if self._closed_reason is not None:
            raise Cancelled(f"{call}: {self._closed_reason}")


class KeyValueStore:
    """A tenant's string -> string store: at most `max_keys` keys and `max_chars` characters of
    keys and values together. A set past either bound raises LimitError and changes nothing."""

    def __init__(self, max_keys: int = 10_000, max_chars: int = 8 << 20) -> None:
        self.max_keys = max_keys
        self.max_chars = max_chars
        self._lock = threading.Lock()
        self._values: dict[str, str] = {}
        self._num_chars = 0

    def get(self, key: str) -> str | None:
        with self._lock:
            return self._values.get(key)

    def set(self, key: str, value: str) -> None:
        with self._lock:
            old = self._values.get(key)
            if old is None and len(self._values) >= self.max_keys:
                raise LimitError(f"messaging.store-set: the store is full ({self.max_keys} keys); "
                                 f"cannot add {key[:64]!r}")
            freed = 0 if old is None else len(key) + len(old)
            num_chars = self._num_chars - freed + len(key) + len(value)
            if num_chars > self.max_chars:
                raise LimitError(f"messaging.store-set: the store would hold {num_chars} "
                                 f"characters, more than its limit of {self.max_chars} "
                                 f"(store_max_chars); cannot set {key[:64]!r}")
            self._values[key] = value
            self._num_chars = num_chars

    @property
    def num_chars(self) -> int:
        with self._lock:
            return self._num_chars

    def delete(self, key: str) -> bool:
        with self._lock:
            old = self._values.pop(key, None)
            if old is None:
                return False
            self._num_chars -= len(key) + len(old)
            return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)


class MessageHub:
    """All channels of a runtime. `open` an instance's channel at launch, `close` it at the end."""

    def __init__(self, limits: MessageLimits = MessageLimits()) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._channels: dict[str, InstanceChannel] = {}
        self._topics: dict[tuple[str, str], dict[str, Inbox]] = {}   # (tenant, topic) -> subscribers
        self._stores: dict[str, KeyValueStore] = {}
        self._relay: TopicRelay | None = None
        self._store_source: Callable[[str], KeyValueStore] | None = None

    def set_relay(self, relay: TopicRelay | None) -> None:
        """Carry this hub's topics beyond it through `relay` (None: local only)."""
        self._relay = relay

    def set_store_source(self, source: "Callable[[str], KeyValueStore] | None") -> None:
        """Take each tenant's key-value store from `source(tenant)` (an object with
        KeyValueStore's get / set / delete) instead of this hub (None: this hub's own)."""
        self._store_source = source

    def open(self, instance_id: str, tenant: str,
             send_to_client: Callable[[str], None]) -> "InstanceChannel":
        with self._lock:
            if instance_id in self._channels:
                raise ValueError(f"instance {instance_id} already has a channel")
            channel = InstanceChannel(self, instance_id, tenant, send_to_client,
                                      Inbox(max_chars=self.limits.client_max_chars,
                                            refuse_when_full=True,
                                            name=f"the client inbox of instance {instance_id} "
                                                 f"(client_max_chars)"))
            self._channels[instance_id] = channel
            return channel

    def channel(self, instance_id: str) -> "InstanceChannel | None":
        with self._lock:
            return self._channels.get(instance_id)

    def waiting_for_client(self, instance_id: str) -> bool:
        """Whether the instance waits in `messaging.receive` with no client message queued
        (False for an instance without an open channel)."""
        channel = self.channel(instance_id)
        return channel is not None and channel.inbox.is_awaited

    def deliver(self, instance_id: str, message: str) -> bool:
        """Client -> instance. False when the instance has no open channel; LimitError when its
        unread client messages would pass client_max_chars."""
        channel = self.channel(instance_id)
        return channel is not None and channel.inbox.put(message)

    def close(self, instance_id: str, reason: str) -> None:
        """End an instance's messaging: wake its blocked receives with Cancelled(reason) and drop
        its subscriptions. Idempotent."""
        emptied = []
        with self._lock:
            channel = self._channels.pop(instance_id, None)
            for key in list(self._topics):
                if self._topics[key].pop(instance_id, None) is not None and not self._topics[key]:
                    del self._topics[key]
                    emptied.append(key)
        if channel is not None:
            channel.close(reason)
        if self._relay is not None:
            for tenant, topic in emptied:
                self._relay.unsubscribed(tenant, topic)

    def store(self, tenant: str) -> KeyValueStore:
        if self._store_source is not None:
            return self._store_source(tenant)
        with self._lock:
            store = self._stores.get(tenant)
            if store is None:
                store = self._stores[tenant] = KeyValueStore(self.limits.store_max_keys,
                                                             self.limits.store_max_chars)
            return store

    def subscribe(self, tenant: str, topic: str, instance_id: str) -> Inbox:
        with self._lock:
            if instance_id not in self._channels:
                raise Cancelled(f"messaging.subscribe: instance {instance_id} has no open channel")
            first = (tenant, topic) not in self._topics
            subscribers = self._topics.setdefault((tenant, topic), {})
            inbox = subscribers.get(instance_id)
            if inbox is None:
                inbox = subscribers[instance_id] = Inbox(self.limits.topic_max_messages,
                                                         self.limits.topic_max_chars)
        if first and self._relay is not None:
            self._relay.subscribed(tenant, topic)
        return inbox

    def broadcast(self, tenant: str, topic: str, message: str) -> int:
        """Deliver to the tenant's current subscribers of `topic` (and hand it to the relay);
        returns how many here."""
        if self._relay is not None:
            self._relay.broadcast(tenant, topic, message)
        return self.deliver_topic(tenant, topic, message)

    def deliver_topic(self, tenant: str, topic: str, message: str) -> int:
        """Deliver to the tenant's subscribers of `topic` in this hub only; returns how many."""
        with self._lock:
            inboxes = list(self._topics.get((tenant, topic), {}).values())
        return sum(inbox.put(message) for inbox in inboxes)

    def subscription(self, tenant: str, topic: str, instance_id: str) -> Inbox | None:
        with self._lock:
            return self._topics.get((tenant, topic), {}).get(instance_id)


class InstanceChannel:
    """One instance's view of messaging: what the `messaging` WIT binding calls."""

    def __init__(self, hub: MessageHub, instance_id: str, tenant: str,
                 send_to_client: Callable[[str], None], inbox: Inbox) -> None:
        self.hub = hub
        self.instance_id = instance_id
        self.tenant = tenant
        self.inbox = inbox
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
        limit = self.hub.limits.max_subscriptions
        with self._lock:
            if topic not in self._subscriptions and len(self._subscriptions) >= limit:
                raise LimitError(f"messaging.subscribe: already subscribed to {limit} topics "
                                 f"(max_subscriptions); cannot subscribe to {topic[:64]!r}")
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
