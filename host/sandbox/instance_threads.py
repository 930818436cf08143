"""The threads instances run on: each instance has a thread of its own while it runs, taken from
the idle threads of instances that have ended when there is one.

Starting a thread is slow exactly when instances launch together: `threading.Thread.start`
returns only once the new thread has run, and with the cores busy with the instances launched
just before, the OS runs a new thread after those, and each `start` waits its turn. A thread
that waits on a lock is woken at once instead. So a thread whose instance has ended waits for
the next instance (at most `max_idle` threads wait, each at most `idle_s`), and `num_spare`
threads are started with the pool: a launch then hands its instance over with one lock release.
A new thread is started only when none is idle.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

__all__ = ["InstanceThreads"]

_log = logging.getLogger(__name__)
IDLE_NAME = "pie-idle"


class _Worker:
    """One pool thread's hand-over slot: `wake` is held while it waits (a binary semaphore)."""

    __slots__ = ("wake", "target", "name")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()
        self.target: Callable[[], None] | None = None   # None when woken: exit
        self.name = IDLE_NAME


class InstanceThreads:
    """Runs each target on a thread of its own: an idle pool thread, else a new one (daemon
    threads, named after their target while they run it). Thread-safe."""

    def __init__(self, num_spare: int = 8, max_idle: int = 64, idle_s: float = 60.0) -> None:
        if not 0 <= num_spare <= max_idle:
            raise ValueError(f"InstanceThreads: need 0 <= num_spare <= max_idle, got "
                             f"{num_spare} and {max_idle}")
        if not idle_s > 0:
            raise ValueError(f"InstanceThreads: idle_s must be > 0, got {idle_s}")
        self._max_idle = max_idle
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []      # most recently idle last (its stack is warm)
        self._closed = False
        for _ in range(num_spare):
            self._start_thread(None, IDLE_NAME)

    @property
    def num_idle(self) -> int:
        """Threads waiting for an instance."""
        with self._lock:
            return len(self._idle)

    def run(self, target: Callable[[], None], name: str) -> None:
        """Call `target()` on a thread of its own named `name`. `target` should not raise (an
        exception is logged). Once the pool is closed, on a new thread that exits after it (an
        instance launched while the runtime closes still runs to its end and frees what it
        holds)."""
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            self._start_thread(target, name)
            return
        worker.target, worker.name = target, name
        worker.wake.release()

    def close(self) -> None:
        """Idle threads exit; a thread running a target exits after it, and so will those
        `run` starts from now on."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.wake.release()               # target None: exit

    def _start_thread(self, target: Callable[[], None] | None, name: str) -> None:
        worker = _Worker()
        worker.target = target   # in the slot, not the Thread's args: those live as long as it
        thread = threading.Thread(target=self._loop, args=(worker,), name=name, daemon=True)
        thread.start()

    def _loop(self, worker: _Worker) -> None:
        """A pool thread: run the target, then wait for the next one (or exit)."""
        thread = threading.current_thread()
        target, worker.target = worker.target, None
        while True:
            if target is not None:
                try:
                    target()
                except Exception:  # noqa: BLE001 -- the thread goes on serving the pool
                    _log.exception("instance thread %s: its target raised", thread.name)
                target = None
                thread.name = IDLE_NAME
            if not self._wait_for_target(worker):
                return
            target, worker.target = worker.target, None
            if target is None:
                return
            thread.name = worker.name

    def _wait_for_target(self, worker: _Worker) -> bool:
        """Wait idle until `run` hands `worker` a target (True) or it should exit (False)."""
        with self._lock:
            if self._closed or len(self._idle) >= self._max_idle:
                return False
            self._idle.append(worker)
        if worker.wake.acquire(timeout=self._idle_s):
            return True
        with self._lock:
            if worker in self._idle:            # idle too long and not taken: exit
                self._idle.remove(worker)
                return False
        worker.wake.acquire()                   # `run` took it meanwhile: its target is coming
        return True
