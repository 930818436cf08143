"""`DeferredWakes`: guest wake-ups held back while a batch resolves.

A batch's future callbacks (a host decode loop submitting its next pass) run on the thread that
resolves the batch; a guest woken there would compete with them, and with the next batch's
forming, for the GIL. So a wake asked for during the resolution waits until the scheduler runs
it: right before the next batch goes to the engine, or right after this one when none follows.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

__all__ = ["DeferredWakes"]

_log = logging.getLogger("host.scheduling.scheduler")


class DeferredWakes:
    """The wakes deferred by the thread resolving a batch. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wakes: list[Callable[[], None]] = []
        self._resolving: int | None = None     # the resolving thread's ident

    def start_resolving(self) -> None:
        """The calling thread resolves a batch until `stop_resolving`."""
        self._resolving = threading.get_ident()

    def stop_resolving(self) -> None:
        self._resolving = None

    def resolving_here(self) -> bool:
        """Whether the calling thread is resolving a batch."""
        return self._resolving == threading.get_ident()

    def defer(self, wake: Callable[[], None]) -> bool:
        """Keep `wake` for `run`, when called on the thread resolving a batch; else False (and
        nothing kept): the caller wakes now."""
        if not self.resolving_here():
            return False
        with self._lock:
            self._wakes.append(wake)
        return True

    def run(self) -> None:
        """Run (and forget) every wake kept so far."""
        with self._lock:
            wakes, self._wakes = self._wakes, []
        for wake in wakes:
            try:
                wake()
            except Exception:
                _log.exception("scheduler: a deferred wake failed")
