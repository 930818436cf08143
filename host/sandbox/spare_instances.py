"""Instances instantiated ahead of their launch: `SpareInstances`.

Most of an instance's start is Wasmtime instantiating the component (for a componentize-py guest
its heap image mapped into a memory, CPython's tables filled), none of which depends on
who launches it or with which arguments. So for a program named with `keep` the runtime
instantiates up to that many instances while it has nothing running (from FILL_DELAY_S after it
went idle until a launch comes: on a CPU they would take the cores of the instances running),
each on a thread of its own, and parks them right before their guest's `run`: a launch of that
program with the same limits then takes one (`take`), gives it its id, tenant, arguments,
tables and channel (`Instance.bind`), and lets it run. A launch with other limits, or when none
is ready, starts an instance of its own. Spares are kept per owner: a tenant's (`pie serve`'s
tenants' `spare_instances`) are taken only by that tenant's launches, the runtime's own (owner
"") by anyone's; a launch looks at its tenant's first.

A spare runs no guest code of its own before its launch: a host call during its instantiation (a
core module's start function calling a pie import) traps it, it is dropped and the program gets
no more spares (its launches start instances of their own, where such a call is answered). Its
Store and memory are the host's until the launch (not charged to any tenant); at most
RuntimeConfig.max_spare_instances exist at once. Thread-safe.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from host.runtime_config import InstanceLimits

__all__ = ["SpareInstances", "SpareHandover"]

_log = logging.getLogger("pie.spares")
FILL_DELAY_S = 0.02     # spares are made this long after `fill`: the ends of a burst go first


def spare_key(limits: InstanceLimits) -> InstanceLimits:
    """What a spare's limits must share with its launch's: all but page_quota (read only by the
    launch, for the instance's pages) and max_receive_wait_s (read only by a receive, after the
    launch bound its limits)."""
    return dataclasses.replace(limits, page_quota=None, max_receive_wait_s=None)


class SpareHandover:
    """A spare's side of its launch: the spare's thread waits here once instantiated."""

    def __init__(self, on_ready: Callable[[Any], None], on_end: Callable[[Any], None]) -> None:
        self._event = threading.Event()
        self._launched = False
        self.announced = False               # it reached its wait (instantiated)
        self._on_ready = on_ready
        self.on_end = on_end                 # called with the Instance when it ends unlaunched

    def wait_for_launch(self, instance: Any) -> bool:
        """On the spare's thread: announce it ready, wait; True once launched, False once
        discarded."""
        self.announced = True
        self._on_ready(instance)
        self._event.wait()
        return self._launched

    def launch(self) -> None:
        """Let the spare run (it has been bound to its launch)."""
        self._launched = True
        self._event.set()

    def discard(self) -> None:
        """Let the spare end without running."""
        self._event.set()


@dataclass
class _Kept:
    """One program's spares: how many to keep, with which limits, and those made."""

    program: Any
    owner: str                                        # the tenant whose launches take them
    num_spares: int
    limits: InstanceLimits                            # spare_key'd
    ready: list[Any] = field(default_factory=list)   # instantiated, waiting for a launch
    num_making: int = 0                               # started, not yet ready or ended
    failed: bool = False                              # a spare could not be made: none more


class SpareInstances:
    """The spares of the programs named with `keep`. `make(program, limits, handover)` returns
    an unstarted Instance that instantiates, then waits on `handover`; `run(target, name)` calls
    `target` on another thread; `warm(spare)` readies a spare's memory on its thread."""

    def __init__(self, make: Callable[[Any, InstanceLimits, SpareHandover], Any],
                 max_spares: int, run: Callable[[Callable[[], None], str], None],
                 is_idle: Callable[[], bool],
                 warm: Callable[[Any], None] = lambda spare: None) -> None:
        self._make = make
        self._warm = warm                          # a spare's memory, faulted in ahead
        self._run = run                            # runs a callable on another thread
        self._is_idle = is_idle                    # no instance runs
        self._max_spares = max_spares
        self._lock = threading.Condition(threading.Lock())
        self._kept: dict[tuple[str, str], _Kept] = {}   # (owner, program hash) -> its spares
        self._unlaunched: set[Any] = set()         # made, not taken by a launch, not ended
        self._closed = False

    @property
    def num_ready(self) -> int:
        """Spares instantiated and waiting for a launch, all programs together."""
        with self._lock:
            return sum(len(kept.ready) for kept in self._kept.values())

    def keep(self, program: Any, num_spares: int, limits: InstanceLimits,
             owner: str = "") -> None:
        """Keep `num_spares` spares of `program` for `owner`'s launches ("": anyone's) with
        `limits`, whatever their page_quota (0: none; discards what is ready beyond it, or all
        of them when the limits change). Raises ValueError past max_spare_instances in all.
        Spares are made by `fill`."""
        if not isinstance(num_spares, int) or num_spares < 0:
            raise ValueError(f"keep_spares: num_spares must be an int >= 0, got {num_spares!r}")
        limits, key = spare_key(limits), (owner, program.hash)
        with self._lock:
            others = sum(k.num_spares for other, k in self._kept.items() if other != key)
            if others + num_spares > self._max_spares:
                raise ValueError(f"keep_spares: {num_spares} spares of this program and {others} "
                                 f"of others pass max_spare_instances ({self._max_spares})")
            kept = self._kept.get(key)
            if kept is None or kept.limits != limits:
                stale = kept.ready if kept is not None else []
                kept = self._kept[key] = _Kept(program, owner, num_spares, limits,
                                               num_making=kept.num_making if kept else 0)
            else:
                kept.num_spares = num_spares
                stale, kept.ready = kept.ready[num_spares:], kept.ready[:num_spares]
            self._forget_if_unused(key)
        for spare in stale:
            spare.spare.discard()

    def take(self, program: Any, limits: InstanceLimits, owner: str = "") -> Any | None:
        """A ready spare of `program` made with `limits` but for page_quota, `owner`'s or else
        the runtime's own (the caller binds and starts it), or None."""
        with self._lock:
            for key in dict.fromkeys(((owner, program.hash), ("", program.hash))):
                kept = self._kept.get(key)
                if kept is not None and kept.ready and kept.limits == spare_key(limits):
                    spare = kept.ready.pop()
                    self._unlaunched.discard(spare)
                    return spare
            return None

    def fill(self) -> None:
        """If no instance runs, have the missing spares made, FILL_DELAY_S from now on a thread
        of `run`'s, for as long as none does; returns at once."""
        if not self._is_idle():
            return
        jobs = []
        with self._lock:
            if self._closed:
                return
            for kept in self._kept.values():
                num_missing = kept.num_spares - len(kept.ready) - kept.num_making
                if not kept.failed and num_missing > 0:
                    kept.num_making += num_missing
                    jobs.append((kept, num_missing))
        if jobs:
            self._run(lambda: self._make_all(jobs), "pie-spares")

    def _make_all(self, jobs: list[tuple[_Kept, int]]) -> None:
        """Make the spares of `jobs`, each only while the runtime is still idle: once a launch
        has come (or the pool closed), the rest are not made."""
        time.sleep(FILL_DELAY_S)     # the last instance's end, its waiter's wake
        for kept, num_spares in jobs:
            key = (kept.owner, kept.program.hash)
            for _ in range(num_spares):
                spare = None
                if self._is_idle():
                    spare = self._make(kept.program, kept.limits, SpareHandover(
                        partial(self._ready, key), partial(self._ended, key)))
                with self._lock:
                    if spare is None or self._closed:
                        self._kept[key].num_making -= 1
                        self._forget_if_unused(key)
                        self._lock.notify_all()
                        continue
                    self._unlaunched.add(spare)
                spare.start()

    def wait_filled(self, timeout: float) -> bool:
        """Wait until no spare is being made (every program's spares ready, or failed); False
        if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while any(kept.num_making for kept in self._kept.values()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(remaining)
            return True

    def close(self, timeout: float) -> None:
        """Discard every spare and wait (at most `timeout` for each) for their threads to drop
        them; none are made from now on."""
        with self._lock:
            self._closed = True
            ready = [spare for kept in self._kept.values() for spare in kept.ready]
            for kept in self._kept.values():
                kept.ready = []
            unlaunched = list(self._unlaunched)
        for spare in ready:
            spare.spare.discard()
        for spare in unlaunched:
            spare.wait(timeout)

    def _ready(self, key: tuple[str, str], spare: Any) -> None:
        """A spare's thread: instantiated, about to wait for its launch; its memory is warmed
        first (the pages its guest will likely write, faulted in while nothing runs)."""
        self._warm(spare)
        with self._lock:
            kept = self._kept[key]
            kept.num_making -= 1             # counted per program, whatever its limits now
            keep = (not self._closed and kept.limits == spare_key(spare.limits)
                    and len(kept.ready) < kept.num_spares)
            if keep:
                kept.ready.append(spare)
            self._forget_if_unused(key)
            self._lock.notify_all()
        if not keep:
            spare.spare.discard()

    def _ended(self, key: tuple[str, str], spare: Any) -> None:
        """A spare's thread: it ended without a launch (discarded, or it failed before ready).
        A failure is logged before it counts as no longer being made: whoever `wait_filled`
        wakes finds the warning written."""
        failed = not spare.spare.announced          # its thread has ended: no longer changes
        if failed:
            outcome = spare.outcome
            _log.warning("program %s: no spares (one ended before its launch: %s: %s); its "
                         "launches instantiate as they come", spare.program.hash[:12],
                         outcome.status if outcome else "?", outcome.value if outcome else "")
        with self._lock:
            self._unlaunched.discard(spare)
            kept = self._kept.get(key)
            if failed and kept is not None:
                kept.num_making -= 1
                kept.failed = kept.failed or kept.limits == spare_key(spare.limits)
                self._forget_if_unused(key)
            self._lock.notify_all()

    def _forget_if_unused(self, key: tuple[str, str]) -> None:
        """Under the lock: drop the entry of `key` once it keeps no spares and none is being made
        (a tenant that launches one program after another leaves no trail)."""
        kept = self._kept[key]
        if kept.num_spares == 0 and kept.num_making == 0 and not kept.ready:
            del self._kept[key]
