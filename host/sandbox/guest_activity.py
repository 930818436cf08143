"""Which instances may be running guest code: the runtime's epoch ticker ticks only while some do.

Wasmtime's epoch only matters to a guest that runs Wasm (its deadline callback traps a guest
computing past `max_idle_s`, or a terminated one); a guest blocked in a host wait (a forward's
result, a decode loop's outputs, a message) runs none. Every wake of the ticker costs CPU (much
of it the kernel's), and a ticker that ran regardless would wake every epoch_tick_ms of an idle
runtime for nothing. So instances count themselves here: `enter` when their guest starts
(waking the ticker, so a fresh guest's deadlines run from its first tick) and when a host wait
ends, `leave` when a wait begins and when the guest has ended. An instance blocked in a WASI
call stays counted (the ticker's idle check ends it there).

The ticker (host/runtime.py) ticks every epoch_tick_ms while any instance is counted; when none
is, it waits until woken (a guest starts, `wake` by terminate or close) or IDLE_WAIT_S passes. A
guest that resumes from a wait does not wake it: short steps between waits, the common case,
would each cost a wake-up. So a guest that resumes and then computes without end is seen at the
ticker's next look, at most IDLE_WAIT_S later: its idle trap still comes at max_idle_s past its
last host call when that is longer than IDLE_WAIT_S (the default 10 s), up to IDLE_WAIT_S late
when shorter.

It also gates the starts (host/sandbox/start_gate.py): `start` waits for a slot of the gate, if
the runtime has one, before counting the guest in; the slot goes back at the guest's first
host wait (`blocked`) or at `end`, whichever comes first. Thread-safe.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from host.sandbox.start_gate import StartGate

__all__ = ["GuestActivity", "IDLE_WAIT_S"]

IDLE_WAIT_S = 0.25      # the ticker's longest wait while no guest is counted


class GuestActivity:
    """The count of instances whose guest may run Wasm now, and the ticker's wait on it."""

    def __init__(self, start_gate: StartGate | None = None) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._num_active = 0
        self._woken = False
        self.start_gate = start_gate
        self._slots = threading.local()      # .token: the start slot this thread's guest holds

    def start(self) -> None:
        """The calling thread's guest is about to start: wait for a start slot (with a gate),
        then count it in and tell the ticker."""
        if self.start_gate is not None:
            self._slots.token = self.start_gate.acquire()
        self.enter(wake=True)

    def end(self) -> None:
        """The calling thread's guest has ended (after `start`): counted out, its slot back."""
        self._release_slot()
        self.leave()

    @property
    def num_active(self) -> int:
        return self._num_active

    def enter(self, wake: bool = False) -> None:
        """A guest starts (`wake`: tell the ticker at once) or resumes after a host wait."""
        with self._cond:
            self._num_active += 1
            if wake:                   # the ticker's wait sees the count: no flag needed
                self._cond.notify_all()

    def leave(self) -> None:
        """A guest blocks in a host wait, or has ended."""
        with self._cond:
            self._num_active -= 1

    @contextmanager
    def blocked(self) -> Iterator[None]:
        """Around a host wait of the calling instance's guest (the first gives its start slot
        back)."""
        self._release_slot()
        self.leave()
        try:
            yield
        finally:
            self.enter()

    def _release_slot(self) -> None:
        token = getattr(self._slots, "token", None)
        if token is not None:
            self._slots.token = None
            self.start_gate.release(token)

    def wake(self) -> None:
        """Make the ticker look again now, counted guests or not (an instance was terminated,
        the runtime closes)."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def wait_for_guests(self, timeout: float) -> None:
        """The ticker, with no guest counted: wait until one starts, `wake`, or `timeout`."""
        with self._cond:
            if not self._num_active and not self._woken:
                self._cond.wait(timeout)
            self._woken = False
