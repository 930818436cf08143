"""`DeferredWakes`: guest wake-ups held back while a batch resolves.

A batch's future callbacks (a host decode loop submitting its next pass) run on the thread that
resolves the batch; a guest woken there would compete with them, and with the next batch's
forming, for the GIL. So a wake asked for during the resolution waits until the scheduler runs
it: right before the next batch goes to the engine, or right after this one when none follows.
"""
from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

__all__ = ["DeferredWakes"]

_log = logging.getLogger("host.scheduling.scheduler")


class DeferredWakes:
    """The wakes deferred by the thread resolving a batch. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wakes: list[Callable[[], None]] = []
        self._resolving: threading.Thread | None = None

    @contextmanager
    def resolving(self) -> Iterator[None]:
        """The calling thread resolves a batch meanwhile."""
        self._resolving = threading.current_thread()
        try:
            yield
        finally:
            self._resolving = None

    def defer(self, wake: Callable[[], None]) -> bool:
        """Keep `wake` for `run`, when called on the thread resolving a batch; else False (and
        nothing kept): the caller wakes now."""
        if self._resolving is not threading.current_thread():
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
