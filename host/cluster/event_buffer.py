"""EventBuffer: a replica's instance events waiting for the front that launched them.

Instance threads `put`; each front takes its own in order with a long poll (`take`). Bounded in
bytes: a message event that would pass `max_bytes` waiting is refused (the replica then ends its
instance: its front is not reading); a final event is always kept, so every instance's end
reaches its front. Thread-safe.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

__all__ = ["ReplicaEvent", "EventBuffer"]


@dataclass(frozen=True)
class ReplicaEvent:
    """One instance event as it crosses to the front: the replica-local instance id, the kind
    and data of host.sandbox.events.InstanceEvent, and when it was emitted (time.time())."""

    local_id: str
    kind: str
    data: str
    emitted_at: float

    @property
    def num_bytes(self) -> int:
        return len(self.data) + len(self.local_id) + 32


class EventBuffer:
    """Per front: its events in emission order, at most `max_bytes` of message events waiting."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"EventBuffer: max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self._cond = threading.Condition()
        self._queues: dict[str, deque[ReplicaEvent]] = {}
        self._num_bytes: dict[str, int] = {}
        self._closed = False
        self._stopped: set[str] = set()      # fronts that let go: their events wait, untaken

    def put(self, front_id: str, event: ReplicaEvent, final: bool) -> bool:
        """Queue `event` for `front_id`; False (dropped) when it is a message event that would
        pass max_bytes waiting for that front."""
        with self._cond:
            num_bytes = self._num_bytes.get(front_id, 0) + event.num_bytes
            if not final and num_bytes > self.max_bytes:
                return False
            self._queues.setdefault(front_id, deque()).append(event)
            self._num_bytes[front_id] = num_bytes
            self._cond.notify_all()
            return True

    def take(self, front_id: str, max_wait_s: float, max_events: int) -> list[ReplicaEvent]:
        """Up to `max_events` of the front's events, oldest first, waiting up to `max_wait_s`
        for the first one (an empty list after that, or once closed)."""
        deadline = time.monotonic() + max_wait_s
        with self._cond:
            while (not self._queues.get(front_id) and not self._closed
                   and front_id not in self._stopped):
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(left)
            queue = self._queues.get(front_id)
            if not queue or front_id in self._stopped:
                return []
            taken = [queue.popleft() for _ in range(min(max_events, len(queue)))]
            self._num_bytes[front_id] -= sum(event.num_bytes for event in taken)
            if not queue:
                del self._queues[front_id]
                del self._num_bytes[front_id]
            return taken

    def move(self, local_id: str, from_front: str, to_front: str) -> None:
        """The events of instance `local_id` waiting for `from_front` go to `to_front` (after
        those waiting there already), in order."""
        with self._cond:
            source = self._queues.get(from_front)
            if not source or from_front == to_front:
                return
            moving = [event for event in source if event.local_id == local_id]
            if not moving:
                return
            kept = deque(event for event in source if event.local_id != local_id)
            num_bytes = sum(event.num_bytes for event in moving)
            if kept:
                self._queues[from_front] = kept
                self._num_bytes[from_front] -= num_bytes
            else:
                del self._queues[from_front]
                del self._num_bytes[from_front]
            self._queues.setdefault(to_front, deque()).extend(moving)
            self._num_bytes[to_front] = self._num_bytes.get(to_front, 0) + num_bytes
            self._cond.notify_all()

    def stop(self, front_id: str) -> None:
        """The front let go: its events stay queued (for `move`), `take` returns none of them."""
        with self._cond:
            self._stopped.add(front_id)
            self._cond.notify_all()

    def drop(self, front_id: str) -> None:
        """Forget the front: its waiting events go."""
        with self._cond:
            self._queues.pop(front_id, None)
            self._num_bytes.pop(front_id, None)
            self._stopped.discard(front_id)

    def stopped(self, front_id: str) -> bool:
        with self._cond:
            return front_id in self._stopped

    def waiting_ids(self) -> set[tuple[str, str]]:
        """(front id, local id) of every instance with events waiting."""
        with self._cond:
            return {(front_id, event.local_id) for front_id, queue in self._queues.items()
                    for event in queue}

    def num_bytes(self, front_id: str) -> int:
        with self._cond:
            return self._num_bytes.get(front_id, 0)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Wake every waiting `take` (they return what is queued, or nothing)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
