"""FrontPresence: which fronts a replica still hears from, for ending what nobody will read.

A front is present while it takes its events (each long poll or pushed batch marks it seen,
at least every poll interval) and from its first launch on. One not seen for `grace_s` (it
crashed, or let go of its instances and no front attached them) is gone: the replica then
ends the instances whose events go to it and drops their waiting events. Thread-safe.
"""
from __future__ import annotations

import threading
import time

__all__ = ["FrontPresence"]


class FrontPresence:
    """When each front was last seen; `gone()` those unseen for longer than `grace_s`."""

    def __init__(self, grace_s: float) -> None:
        if not grace_s > 0:
            raise ValueError(f"FrontPresence: grace_s must be positive, got {grace_s}")
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._seen_at: dict[str, float] = {}
        self._away: set[str] = set()          # let go: unseen from now on, whatever it polls

    def seen(self, front_id: str) -> None:
        with self._lock:
            if front_id not in self._away:
                self._seen_at[front_id] = time.monotonic()

    def left(self, front_id: str) -> None:
        """The front let go of its instances: its grace starts now."""
        with self._lock:
            self._away.add(front_id)
            self._seen_at[front_id] = time.monotonic()

    def gone(self) -> list[str]:
        """Fronts not seen for longer than grace_s."""
        cutoff = time.monotonic() - self.grace_s
        with self._lock:
            return [front_id for front_id, at in self._seen_at.items() if at < cutoff]

    def forget(self, front_id: str) -> None:
        with self._lock:
            self._seen_at.pop(front_id, None)
            self._away.discard(front_id)
