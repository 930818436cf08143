"""Which instances may be running guest code: the runtime's epoch ticker ticks only while some do.

Wasmtime's epoch only matters to a guest that runs Wasm (its deadline callback traps a guest
computing past `max_idle_s`, or a terminated one); a guest blocked in a host wait (a forward's
result, a decode loop's outputs, a message) runs none. Every wake of the ticker costs CPU (much
of it the kernel's), and a ticker that ran regardless would wake every epoch_tick_ms of an idle
runtime for nothing. So instances count themselves here: `start` / `enter` when their guest
starts (waking the ticker, so a fresh guest's deadlines run from its first tick), `end` /
`leave` when it has ended, and `wait_begins` / `wait_ends` around each host wait (`blocked`).
An instance blocked in a WASI call stays counted (the ticker's idle check ends it there).

The ticker (host/runtime.py) ticks every epoch_tick_ms while any instance is counted; when none
is, it waits until woken (a guest starts, `wake` by terminate or close) or IDLE_WAIT_S passes. A
guest that resumes from a wait does not wake it: short steps between waits, the common case,
would each cost a wake-up. So a guest that resumes and then computes without end is seen at the
ticker's next look, at most IDLE_WAIT_S later: its idle trap still comes at max_idle_s past its
last host call when that is longer than IDLE_WAIT_S (the default 10 s), up to IDLE_WAIT_S late
when shorter.

It also gates the starts (host/sandbox/start_gate.py): `start` waits for a slot of the gate, if
the runtime has one, before counting the guest in; the slot goes back at the guest's first
host wait (`blocked`, or `release_slot` before `wait_begins`) or at `end`, whichever comes
first. Thread-safe.
"""
from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from host.sandbox.start_gate import StartGate

__all__ = ["GuestActivity", "IDLE_WAIT_S"]

IDLE_WAIT_S = 0.25      # the ticker's longest wait while no guest is counted


class GuestActivity:
    """The count of instances whose guest may run Wasm now, and the ticker's wait on it: the
    guests counted in, less those in a host wait. `wait_begins()` / `wait_ends()`: the calling
    instance's guest blocks in a host wait / resumes (one list append / pop each, atomic C
    calls: no lock and no Python frame around every blocking host call)."""

    def __init__(self, start_gate: StartGate | None = None) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._num_counted = 0                # under _cond: entered and not left
        self._waits: list[None] = []         # one entry per guest in a host wait
        self._woken = False
        self.start_gate = start_gate
        self._slots = threading.local()      # .token: the start slot this thread's guest holds
        self.wait_begins: Callable[[], None] = functools.partial(self._waits.append, None)
        self.wait_ends: Callable[[], None] = self._waits.pop     # the list is never replaced

    def start(self) -> None:
        """The calling thread's guest is about to start: wait for a start slot (with a gate),
        then count it in and tell the ticker."""
        if self.start_gate is not None:
            self._slots.token = self.start_gate.acquire()
        self.enter(wake=True)

    def end(self) -> None:
        """The calling thread's guest has ended (after `start`): counted out, its slot back."""
        self.release_slot()
        self.leave()

    @property
    def num_active(self) -> int:
        return self._num_counted - len(self._waits)

    def enter(self, wake: bool = False) -> None:
        """A guest starts (`wake`: tell the ticker at once)."""
        with self._cond:
            self._num_counted += 1
            if wake:                   # the ticker's wait sees the count: no flag needed
                self._cond.notify_all()

    def leave(self) -> None:
        """A guest has ended."""
        with self._cond:
            self._num_counted -= 1

    @contextmanager
    def blocked(self) -> Iterator[None]:
        """Around a host wait of the calling instance's guest (the first gives its start slot
        back)."""
        self.release_slot()
        self.wait_begins()
        try:
            yield
        finally:
            self.wait_ends()

    def release_slot(self) -> None:
        """Give back the start slot the calling thread's guest holds, if any (its first wait)."""
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
            if not self.num_active and not self._woken:
                self._cond.wait(timeout)
            self._woken = False
