"""How many instances start at once: `StartGate`.

An instance's start (its Store, Wasmtime's instantiation, its guest up to the first host wait) is
a burst of CPU, mostly outside the GIL (Wasmtime, the guest's Wasm), with a dozen host calls
that take it. Launched together, instances start on threads of their own, and with many more of
them than cores they spend that CPU again in the kernel: context switches, CPU migrations and
the futex waits and wakes of the GIL's hand-offs. So a start waits here for one of `num_slots`
slots and gives it back at its guest's first host wait (or its end), and the starts queued
behind reach their first forward sooner. Too few slots (as many as the cores) leave a core idle
whenever one start waits for the GIL.

A slot held longer than `max_hold_s` stops counting, so a start that computes long before its
first wait (or never waits: a hostile guest spinning until its idle trap) delays the starts
queued behind it by at most that. A released slot wakes one waiter (the longest waiting:
threading.Condition's order); a start arriving then may take it first. Thread-safe.
"""
from __future__ import annotations

import itertools
import os
import threading
import time

__all__ = ["StartGate", "default_start_slots", "start_gate_for", "MAX_HOLD_S"]

MAX_HOLD_S = 0.05     # a start this much longer than usual no longer holds others up


def default_start_slots() -> int:
    """Twice the cores this process may run on: enough starts that one waiting for the GIL
    leaves no core idle, few enough that they do not convoy on it."""
    if hasattr(os, "sched_getaffinity"):
        return 2 * len(os.sched_getaffinity(0))
    return 2 * (os.cpu_count() or 1)


def start_gate_for(start_slots: int | None) -> "StartGate | None":
    """The gate of RuntimeConfig.start_slots: None (the default) twice the cores, 0 none."""
    if start_slots == 0:
        return None
    return StartGate(default_start_slots() if start_slots is None else start_slots)


class StartGate:
    """At most `num_slots` holders at once, each counted for at most `max_hold_s`."""

    def __init__(self, num_slots: int, max_hold_s: float = MAX_HOLD_S) -> None:
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"StartGate: num_slots must be an int >= 1, got {num_slots!r}")
        if not max_hold_s > 0:
            raise ValueError(f"StartGate: max_hold_s must be > 0, got {max_hold_s}")
        self.num_slots = num_slots
        self.max_hold_s = max_hold_s
        self._cond = threading.Condition(threading.Lock())
        self._holders: dict[int, float] = {}      # token -> when its hold stops counting
        self._tokens = itertools.count(1)

    @property
    def num_holding(self) -> int:
        """Slots held now (expired holds included until a waiter looks)."""
        return len(self._holders)

    def acquire(self) -> int:
        """Wait for a slot; returns the token to `release` it with."""
        with self._cond:
            while not self._free_slot():
                self._cond.wait(self._until_expiry())
            token = next(self._tokens)
            self._holders[token] = time.monotonic() + self.max_hold_s
            return token

    def release(self, token: int) -> None:
        """Give the slot back (nothing if its hold had expired and was dropped)."""
        with self._cond:
            if self._holders.pop(token, None) is not None:
                self._cond.notify()

    def _free_slot(self) -> bool:
        """Under the lock: whether a slot is free, once expired holds are dropped."""
        if len(self._holders) < self.num_slots:
            return True
        now = time.monotonic()
        for token in [t for t, expiry in self._holders.items() if expiry <= now]:
            del self._holders[token]
        return len(self._holders) < self.num_slots

    def _until_expiry(self) -> float | None:
        """Under the lock: seconds until the earliest hold expires (None: no holder)."""
        if not self._holders:
            return None
        return max(0.0, min(self._holders.values()) - time.monotonic())
