"""ClusterTopics: a replica's topics reaching the subscribers of every other replica.

The replica's MessageHub hands its relay (host/messages/hub.py `TopicRelay`) three things:
- the first local subscriber of a (tenant, topic): registered in the Directory (topics ->
  subscribed replicas), which names the other replicas; each is told at once, and the subscribe
  returns once they were (or `call_timeout_s` passed), so a broadcast made anywhere after it
  reaches the new subscriber;
- the last local subscriber gone: unregistered there, the others told without waiting;
- every local broadcast: queued for the replicas with subscribers of that (tenant, topic) and
  sent by one sender thread, all queued messages for one replica in one call, one call per
  replica in flight, so each replica receives one publisher's broadcasts in order. At most
  `max_waiting_chars` wait; past that the oldest are dropped, as a subscription's inbox drops
  its oldest unread broadcasts.
Without the Directory (gone, restarting) a topic works within its replica only. Calls between
replicas run in their "topics" concurrency group (one thread: in order). A
replica receiving a broadcast for a topic it has no subscriber of any more answers so, and the
sender forgets it there. Thread-safe.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError

__all__ = ["ClusterTopics", "TOPICS_GROUP", "TopicMessage"]

TOPICS_GROUP = "topics"
TopicMessage = tuple[str, str, str]          # (tenant, topic, message)
_log = logging.getLogger("pie.cluster")


class ClusterTopics:
    """The TopicRelay of replica `replica_id` (life `epoch`): `directory` the Directory actor,
    `peer(replica_id)` another replica's actor handle, `deliver(tenant, topic, message)` the
    local hub's delivery (returns how many received it)."""

    def __init__(self, replica_id: str, epoch: int, directory: Any,
                 peer: Callable[[str], Any], deliver: Callable[[str, str, str], int], *,
                 max_waiting_chars: int = 8 << 20, call_timeout_s: float = 5.0) -> None:
        self.replica_id = replica_id
        self.epoch = epoch
        self._directory = directory
        self._peer = peer
        self._deliver = deliver
        self._max_chars = max_waiting_chars
        self._timeout_s = call_timeout_s
        self._cond = threading.Condition()
        self._remote: dict[tuple[str, str], set[str]] = {}   # topic -> other subscribed replicas
        self._added: dict[tuple[str, str, str], int] = {}     # (tenant, topic, replica) -> when
        self._num_added = 0
        self._outbox: deque[tuple[frozenset[str], TopicMessage]] = deque()
        self._num_chars = 0
        self.num_dropped = 0
        self._closed = False
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name="pie-topics-sender")
        self._sender.start()

    def load(self) -> None:
        """Learn from the Directory which other replicas subscribe to what (at the replica's
        start: later changes come from the replicas themselves)."""
        topics = ray.get(self._directory.topic_map.remote(), timeout=self._timeout_s)
        with self._cond:
            for key, replica_ids in topics.items():
                others = set(replica_ids) - {self.replica_id}
                if others:
                    self._remote[key] = others

    # ---- TopicRelay -------------------------------------------------------------------------
    def subscribed(self, tenant: str, topic: str) -> None:
        peers = self._ask("subscribe_topic", tenant, topic)
        self._tell(peers, tenant, topic, True, wait=True)

    def unsubscribed(self, tenant: str, topic: str) -> None:
        peers = self._ask("unsubscribe_topic", tenant, topic)
        self._tell(peers, tenant, topic, False, wait=False)

    def broadcast(self, tenant: str, topic: str, message: str) -> None:
        with self._cond:
            targets = self._remote.get((tenant, topic))
            if not targets or self._closed:
                return
            self._outbox.append((frozenset(targets), (tenant, topic, message)))
            self._num_chars += len(message)
            while self._num_chars > self._max_chars and len(self._outbox) > 1:
                self._num_chars -= len(self._outbox.popleft()[1][2])
                self.num_dropped += 1
            self._cond.notify()

    # ---- calls of other replicas ------------------------------------------------------------
    def set_peer(self, tenant: str, topic: str, replica_id: str, subscribed: bool) -> None:
        """Replica `replica_id` has (or no longer has) subscribers of the tenant's topic."""
        if replica_id == self.replica_id:
            return
        with self._cond:
            if subscribed:
                self._num_added += 1
                self._added[(tenant, topic, replica_id)] = self._num_added
                self._remote.setdefault((tenant, topic), set()).add(replica_id)
            else:
                self._forget(tenant, topic, replica_id)

    def receive(self, messages: list[TopicMessage]) -> list[tuple[str, str]]:
        """Deliver broadcasts from another replica here; the (tenant, topic)s that had no
        subscriber here."""
        unheard = []
        for tenant, topic, message in messages:
            if self._deliver(tenant, topic, message) == 0:
                unheard.append((tenant, topic))
        return sorted(set(unheard))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._outbox.clear()
            self._cond.notify()

    # ---- internal ---------------------------------------------------------------------------
    def _ask(self, method: str, tenant: str, topic: str) -> list[str]:
        """The Directory's answer: the other replicas to tell. Without a Directory (gone, or
        restarting) none: the topic works within this replica until its next subscriber."""
        try:
            return ray.get(getattr(self._directory, method).remote(
                tenant, topic, self.replica_id, self.epoch), timeout=self._timeout_s)
        except (RayActorError, GetTimeoutError) as exc:
            _log.warning("topics: %s of %r not registered, the directory did not answer: %s",
                         method, topic[:64], str(exc).splitlines()[0][:200])
            return []

    def _tell(self, peers: list[str], tenant: str, topic: str, subscribed: bool,
              wait: bool) -> None:
        refs = []
        for replica_id in peers:
            try:
                refs.append(self._peer(replica_id).topic_peer.options(
                    concurrency_group=TOPICS_GROUP).remote(tenant, topic, self.replica_id,
                                                           subscribed))
            except Exception as exc:  # noqa: BLE001 -- a peer not there has no subscribers
                _log.info("topics: replica %s not told: %s", replica_id, exc)
        if wait and refs:
            ray.wait(refs, num_returns=len(refs), timeout=self._timeout_s)

    def _forget(self, tenant: str, topic: str, replica_id: str,
                added_before: int | None = None) -> None:
        """Under the lock: replica `replica_id` no longer hears the topic (unless it was added
        again after `added_before`)."""
        added = self._added.get((tenant, topic, replica_id), 0)
        if added_before is not None and added > added_before:
            return
        self._added.pop((tenant, topic, replica_id), None)
        held = self._remote.get((tenant, topic))
        if held is not None:
            held.discard(replica_id)
            if not held:
                del self._remote[(tenant, topic)]

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._outbox and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                taken = list(self._outbox)
                self._outbox.clear()
                self._num_chars = 0
                num_added = self._num_added
            self._send(taken, num_added)

    def _send(self, taken: list[tuple[frozenset[str], TopicMessage]], num_added: int) -> None:
        """One call per target replica with its messages in order; wait for them all, then
        forget the topics a target said it no longer hears."""
        batches: dict[str, list[TopicMessage]] = {}
        for targets, message in taken:
            for replica_id in targets:
                batches.setdefault(replica_id, []).append(message)
        calls = {}
        for replica_id, messages in batches.items():
            try:
                calls[replica_id] = self._peer(replica_id).receive_topics.options(
                    concurrency_group=TOPICS_GROUP).remote(messages)
            except Exception as exc:  # noqa: BLE001 -- gone: its subscribers went with it
                _log.info("topics: replica %s unreachable: %s", replica_id, exc)
        for replica_id, ref in calls.items():
            try:
                unheard = ray.get(ref, timeout=self._timeout_s)
            except Exception:  # noqa: BLE001 -- lost or slow: those broadcasts are dropped
                continue
            with self._cond:
                for tenant, topic in unheard:
                    self._forget(tenant, topic, replica_id, num_added)
