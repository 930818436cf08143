"""Suspension and restore: what the runtime does, when the KV pool runs dry, instead of ending
an instance that a moment's wait would serve.

A suspension (`Suspensions.suspend`, on the thread of the instance that needs pages):
1. the victim's page table closes its gate (host/kv/instance_pages.py: its calls that would reach
   the pool or the engine wait; its host decode loops end quietly);
2. its submissions in flight drain (they run as usual);
3. with the engine held (`BatchScheduler.run_exclusive`), the pages it alone references leave
   the pool: swapped (charged to its tenant in the swap space, host/kv/swap.py,
   `EngineLike.kv_page_nbytes` each, and copied to host memory, `EngineLike.read_pages`) or,
   when every one of them can be recomputed from the tokens that wrote them
   (host/kv/page_log.py) and that is cheaper on this device (host/restore_costs.py), released
   with nothing copied, to be recomputed by a prefill on restore; its scheduler queues are
   held (`BatchScheduler.suspend_owner`). An instance that has opened a LoRA adapter is always
   swapped (its passes' K/V depend on the adapter).
A refused charge ("swap space full") recomputes the victim instead when it can be; otherwise it
undoes step 1 and the caller terminates the victim.

A restore (the `pie-restore` thread, woken whenever pages return to the pool, and every
_TICK_S while anything is suspended): the suspended instances in host/kv/contention.py's
`restore_order`; the head is restored once the pool holds its pages (and, for an instance that
suspended itself asking for pages, those too): fresh pages allocated, written back with the
engine held (`EngineLike.write_pages`, or the recompute passes through `EngineLike.forward`; a
failed recompute ends the instance), its local ids remapped, the pages it asked for handed
to it (InstancePages.hand_over), its queues released, its gate opened. Nothing behind the
head is restored before it; every instance restorable at once is restored under one hold of
the engine (each hold waits for the batch running). A suspension longer than `deadline_s` ends
the instance ("suspended ... (suspend_deadline_s)").
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Protocol

from engine.protocol import EngineLike
from host.errors import OutOfPagesError
from host.kv import InstancePages, PageAllocator
from host.kv.contention import PoolView, Suspended, restore_order
from host.kv.swap import SwapSpace
from host.restore_costs import RestoreCosts
from host.scheduling.scheduler import BatchScheduler

__all__ = ["Suspensions", "SuspensionStats", "Suspendable"]

_log = logging.getLogger("pie.suspensions")
_TICK_S = 0.05                 # the restorer looks at least this often while any is suspended
_DRAIN_WAIT_S = 5.0            # longest wait for a victim's submissions in flight


class Suspendable(Protocol):
    """What a suspension needs of an instance (host/sandbox/instance.py's Instance)."""

    instance_id: str
    tenant: str

    @property
    def tables(self) -> object: ...      # .pages: InstancePages

    def terminate(self, reason: str, status: str = "terminated") -> bool: ...


@dataclass(frozen=True)
class SuspensionStats:
    """Counters since the runtime started, and what is suspended now."""

    num_suspended: int = 0              # instances suspended now
    num_suspensions: int = 0
    num_restores: int = 0
    num_swapped_pages: int = 0          # pages copied out, in all
    num_restored_pages: int = 0         # pages back in the pool by restores, in all
    num_recomputed_pages: int = 0       # of those, pages recomputed by a prefill (not copied)
    num_pages_in_swap: int = 0          # now
    swap_bytes: int = 0                 # host bytes held now
    swap_capacity_bytes: int = 0
    suspended_s: float = 0.0            # time spent suspended by suspensions that ended
    num_deadline_terminations: int = 0  # suspended past suspend_deadline_s
    tenant_suspensions: tuple[tuple[str, int], ...] = ()   # (tenant, suspensions), by tenant


class _Record:
    """One suspension (under Suspensions._lock)."""

    __slots__ = ("instance", "tenant", "since", "num_asked", "num_pages", "nbytes", "ready",
                 "ended", "terminating", "recompute", "num_recomputed")

    def __init__(self, instance: Suspendable, num_asked: int) -> None:
        self.instance = instance
        self.tenant = instance.tenant
        self.since = time.monotonic()
        self.num_asked = num_asked      # pages it asked for (0: a victim)
        self.num_pages = 0              # pages swapped out
        self.nbytes = 0                 # charged to the tenant's swap space
        self.ready = False              # swapped out: the restorer may take it
        self.ended = False
        self.terminating = False
        self.recompute = False          # its pages are recomputed on restore, not copied
        self.num_recomputed = 0         # pages holding tokens to recompute


class Suspensions:
    """The runtime's suspended instances, its swap space and the restorer thread.
    Thread-safe; `close` stops the thread."""

    def __init__(self, engine: EngineLike, scheduler: BatchScheduler, allocator: PageAllocator,
                 swap: SwapSpace, deadline_s: float, pool_view: Callable[[], PoolView],
                 costs: RestoreCosts = RestoreCosts(0.0, 0.0, "swap")) -> None:
        self.engine = engine
        self.costs = costs
        self.scheduler = scheduler
        self.allocator = allocator
        self.swap = swap
        self.deadline_s = deadline_s
        self._pool_view = pool_view
        self._lock = threading.Lock()
        self._records: dict[str, _Record] = {}
        self._stats = SuspensionStats(swap_capacity_bytes=swap.capacity_bytes)
        self._restoring = threading.Lock()    # one caller picks and restores at a time
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pie-restore", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ suspend
    def suspend(self, instance: Suspendable, num_asked: int = 0) -> tuple[bool, str | None]:
        """Suspend `instance` (steps 1-3 above); `num_asked`: pages it asked for itself (its
        restore waits for those too). (True, None) once suspended; (False, why) when the swap
        space refused its pages (nothing changed: the caller terminates it or traps);
        (False, None) when it could not be suspended now (already suspending or ended, or its
        submissions did not drain in _DRAIN_WAIT_S)."""
        pages: InstancePages = instance.tables.pages
        if not pages.begin_suspend():
            return False, None
        if not pages.wait_drained(_DRAIN_WAIT_S):
            pages.abort_suspend()
            return False, None
        record = _Record(instance, num_asked)
        with self._lock:
            self._records[instance.instance_id] = record

        def charge(nbytes: int) -> str | None:      # under the page table's lock
            with self._lock:
                if record.ended:
                    return "the instance ended"
                refused = self.swap.charge(record.tenant, nbytes)
                if refused is None:
                    record.nbytes = nbytes
                return refused

        adapters = getattr(instance.tables, "adapters", None)
        choose = (None if self.costs.mode == "swap"
                  or adapters is not None and adapters.num_opened
                  else self.costs.recompute_cheaper)
        swapped = self.scheduler.run_exclusive(
            lambda: pages.swap_out(self.engine.read_pages, charge, self.engine.kv_page_nbytes,
                                   choose))
        if swapped.refused is not None:
            pages.abort_suspend()
            with self._lock:
                if self._records.get(instance.instance_id) is record:
                    del self._records[instance.instance_id]
                record.ended = True
            return False, swapped.refused
        self.scheduler.suspend_owner(instance.instance_id)
        with self._lock:
            record.num_pages = swapped.num_pages
            record.recompute, record.num_recomputed = swapped.recompute, swapped.num_recomputed
            record.ready = True
            s = self._stats
            by_tenant = dict(s.tenant_suspensions)
            by_tenant[record.tenant] = by_tenant.get(record.tenant, 0) + 1
            num_swapped = 0 if swapped.recompute else swapped.num_pages
            self._stats = replace(s, num_suspensions=s.num_suspensions + 1,
                                  num_swapped_pages=s.num_swapped_pages + num_swapped,
                                  tenant_suspensions=tuple(sorted(by_tenant.items())))
            ended = record.ended              # it ended meanwhile: forget ran before the hold
        if ended:
            self.scheduler.resume_owner(instance.instance_id)
        self._wake.set()
        return True, None

    def forget(self, instance_id: str) -> None:
        """The instance ended: drop its suspension (if any) and refund its swap bytes."""
        with self._lock:
            record = self._records.pop(instance_id, None)
            if record is not None:
                self._end(record)
        if record is not None:
            self.scheduler.resume_owner(instance_id)      # nothing is left to release there
            self._wake.set()

    def wake(self) -> None:
        """Pages returned to the pool: let the restorer look (cheap; any thread)."""
        if self._records:
            self._wake.set()

    def is_suspended(self, instance_id: str) -> bool:
        with self._lock:
            return instance_id in self._records

    def statistics(self) -> SuspensionStats:
        with self._lock:
            swap = self.swap.statistics()
            return replace(self._stats, num_suspended=len(self._records),
                           num_pages_in_swap=sum(r.num_pages for r in self._records.values()
                                                 if not r.recompute),
                           swap_bytes=swap.used_bytes)

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    # ------------------------------------------------------------------ restore
    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(_TICK_S if self._records else 1.0)
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                self.restore_ready()
                self._end_overdue(time.monotonic())
            except Exception:                     # noqa: BLE001 -- the thread must go on
                _log.exception("suspensions: restore failed")

    def restore_ready(self) -> int:
        """Restore suspended instances in `restore_order` while the pool holds the head's
        pages, all of them under one hold of the engine; returns how many were restored.
        Called by the restorer thread (tests call it too); never from a batch's resolution."""
        with self._restoring:
            taken = self._take_restorable()
            if not taken:
                return 0
            return self.scheduler.run_exclusive(lambda: self._swap_in_all(taken))

    def _take_restorable(self) -> list[tuple[_Record, list[int], int]]:
        """Under _restoring: the suspended instances to restore now, in `restore_order` while
        the pool holds the head's pages, each with its fresh pool pages allocated (what it
        asked for handed over already) and its number of swapped pages."""
        taken: list[tuple[_Record, list[int], int]] = []
        taken_ids: set[str] = set()
        while True:
            with self._lock:
                records = [r for r in self._records.values() if r.ready and not r.terminating
                           and r.instance.instance_id not in taken_ids]
            if not records or self.allocator.num_free() < min(r.num_pages + r.num_asked
                                                              for r in records):
                return taken                       # nobody fits: no snapshot needed
            view = self._pool_view()
            by_id = {r.instance.instance_id: r for r in records}
            order = restore_order(view, [Suspended(r.instance.instance_id, r.tenant, r.since,
                                                   r.num_pages + r.num_asked) for r in records])
            record = by_id[order[0].instance_id]
            pages: InstancePages = record.instance.tables.pages
            num_swapped = pages.num_swapped_pages()
            try:
                physical_ids = self.allocator.allocate(num_swapped + record.num_asked)
            except OutOfPagesError:                # short, or taken meanwhile
                return taken
            pages.hand_over(physical_ids[num_swapped:])   # what it asked for: its retry's
            taken.append((record, physical_ids[:num_swapped], num_swapped))
            taken_ids.add(record.instance.instance_id)

    def _swap_in_all(self, taken: list[tuple[_Record, list[int], int]]) -> int:
        """With the engine held: put each taken instance's pages back (copied or recomputed),
        end its suspension and release its queues. Returns how many were restored."""
        num_restored = 0
        for record, physical_ids, num_swapped in taken:
            pages: InstancePages = record.instance.tables.pages
            try:
                pages.swap_in(physical_ids, self.engine.write_pages, self.engine.forward)
            except Exception as error:                    # noqa: BLE001 -- its KV is lost
                self._end_failed(record, error)
                continue
            instance_id = record.instance.instance_id
            with self._lock:
                if self._records.get(instance_id) is record:
                    del self._records[instance_id]
                    self._end(record)
                    s = self._stats
                    num_recomputed = record.num_recomputed if record.recompute else 0
                    self._stats = replace(
                        s, num_restores=s.num_restores + 1,
                        num_restored_pages=s.num_restored_pages + num_swapped,
                        num_recomputed_pages=s.num_recomputed_pages + num_recomputed)
            self.scheduler.resume_owner(instance_id)
            num_restored += 1
        return num_restored

    def _end_failed(self, record: _Record, error: Exception) -> None:
        """A restore's recompute failed: the instance's pages hold nothing it wrote; end it."""
        _log.error("suspensions: restoring instance %s failed: %s",
                   record.instance.instance_id, error)
        with self._lock:
            record.terminating = True
        record.instance.terminate(f"its KV pages could not be recomputed after a suspension: "
                                  f"{error}", status="trap")

    def _end_overdue(self, now: float) -> None:
        """Terminate the instances suspended longer than the deadline (once each)."""
        with self._lock:
            overdue = [r for r in self._records.values()
                       if not r.terminating and now - r.since > self.deadline_s]
            for record in overdue:
                record.terminating = True
            if overdue:
                s = self._stats
                self._stats = replace(s, num_deadline_terminations=s.num_deadline_terminations
                                      + len(overdue))
        for record in overdue:
            record.instance.terminate(
                f"suspended for more than {self.deadline_s:g} s waiting for KV pages "
                f"(suspend_deadline_s)", status="trap")

    def _end(self, record: _Record) -> None:
        """Under _lock: a suspension is over (restored or its instance ended)."""
        record.ended = True
        self.swap.refund(record.tenant, record.nbytes)
        record.nbytes = 0
        self._stats = replace(self._stats, suspended_s=self._stats.suspended_s
                              + time.monotonic() - record.since)

