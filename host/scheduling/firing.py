"""When a batch fires, and which thread runs it: the BatchScheduler's waiting rules.

When a batch fires -- "adaptive": as soon as the engine is idle and anything is pending, except
right after a batch, when the next one is held until every *expected* owner has blocked again or
ended, or until the hold bound has passed, whichever comes first. Likewise (`start_hold_ms` > 0,
with or without overlap), a batch about to fire whose passes are all the first passes of launched
instances waits for the other instances launched and not blocked yet (`owner_starting`), each of
them once, until its oldest pass has waited start_hold_ms in all (a stream of launches cannot hold
it longer): on a CPU engine a batch run while instances start shares the cores with them, and
prompts run together cost less than apart (8 instances launched at once: the first one's prefill,
alone, took 82-87 ms beside the others' start-up instead of ~30, and the other seven's ran after
it; 8 prompts in one pass 110 ms, in two 135-185 ms). Such a batch also waits, within that
bound, until LAUNCH_BURST_GAP_S has passed since the last launch: the first of a burst may block
before the next launch is known. A batch with any other pass (a running generation's step, one
prepared ahead) is never held for starting instances. The expected owners
(instances) are those that were blocked on one of the batch's passes when it resolved (the batch
wakes them); one has blocked again when it waits on a pass that is not done yet
(forward-future.get, queue.synchronize), or on a message (`owner_waiting`), and has ended when
`cancel_owner` is called for it. The bound is min(max_hold_ms, hold_fraction x the engine time of
that batch), counted from its end. So the decode steps of many instances (or of one instance's
forks), which come back at slightly different times, regroup into full batches; a lone instance is
held only until it waits again, i.e. not at all once its next pass is in. "k-or-t": when k queues
have work or the oldest item has waited t_ms.

Who runs a batch (one at a time): adaptive with run_on_waiter, the thread about to block on one of
its passes when the batch may fire right then (no hand-off to the engine thread and back); else,
and for what no blocked thread runs (a hold's bound, passes nobody waits on, k-or-t), the engine
thread.
"""
from __future__ import annotations

import time
from operator import attrgetter
from typing import Hashable

from host.scheduling.items import Item, owner_of
from host.scheduling.types import SubmissionFuture

# With start_hold_ms: a batch of first passes waits until no launch has come for this long
# (within the start hold). The first of a burst of launches 0.1-2 ms apart (launches with spares
# on 2 cores) could otherwise queue its pass and block before the next launch was known, and
# its prompt ran alone (a 1-prompt prefill ~60 ms, then the other seven's); a lone launch's
# first pass comes 2.5 ms or more after it, so it is not held.
LAUNCH_BURST_GAP_S = 0.002

__all__ = ["FiringRules"]

_future_of = attrgetter("future")


class FiringRules:
    """The BatchScheduler's rules of firing (a base class: its state is the scheduler's, all
    used under its lock but `owner_waiting` and `_wait_started`, which take it)."""

    def owner_starting(self, owner_id: Hashable) -> None:
        """`owner_id` was launched: with `start_hold_ms`, a batch of first passes may wait for
        it until it first blocks or ends (see the module's docstring)."""
        if self.policy.kind == "adaptive" and self._start_hold_s > 0:
            with self._lock:
                self._starting.add(owner_id)
                self._unrun.add(owner_id)
                self._last_start = time.monotonic()

    def owner_waiting(self, owner_id: Hashable) -> None:
        """`owner_id` is about to block (on a pass, a synchronize, a receive) or has ended: the
        hold after the last batch no longer waits for it."""
        with self._lock:
            self._starting.discard(owner_id)
            if owner_id in self._expected:
                self._expected.discard(owner_id)
                if not self._expected:
                    self._cond.notify()

    def _wait_started(self, future: SubmissionFuture) -> None:
        """`future`'s owner is about to block on it (`SubmissionFuture.wait_started`): run every
        batch the adaptive policy fires now on this thread, while `future` is pending and no
        batch runs elsewhere; else (as `owner_waiting`) let the engine thread fire or time it."""
        while not future.done():
            with self._lock:
                self._expected.discard(future.owner)
                self._starting.discard(future.owner)
                if self._starting and self._num_pending and not self._running:
                    self._hold_for_starting_if_first()
                if (self._running or self._closed or self._expected or not self._num_pending
                        or self.policy.kind != "adaptive" or not self.policy.run_on_waiter
                        or self._overlap is not None or self._launch_burst_wait_s() > 0):
                    if not self._expected or self._engine_idle:
                        self._cond.notify()           # it fires, or times the hold
                    return
                self._running = True
                copy_items, forward_items = self._take_batch()
            self._run_taken(copy_items, forward_items)

    def _wait_idle(self) -> None:
        """Under the lock, on the engine thread: wait with no timer until notified."""
        self._engine_idle = True
        self._cond.wait()
        self._engine_idle = False

    def _wait_for_batch(self) -> bool:
        """Under the lock: wait until the policy fires. False when closed."""
        while not self._closed:
            if self._running:                             # a waiting thread runs one
                self._wait_idle()
                continue
            if self._expected:                            # adaptive: holding after a batch
                self._wait_hold()
                continue
            if not self._num_pending:
                self._wait_idle()
                continue
            if self.policy.kind == "adaptive":
                if self._starting and self._hold_for_starting_if_first():
                    continue
                burst_wait_s = self._launch_burst_wait_s()
                if burst_wait_s > 0:
                    self._cond.wait(burst_wait_s)
                    continue
                return True
            wait_s = self._k_or_t_wait_s()
            if wait_s <= 0:
                return True
            self._cond.wait(wait_s)
        return False

    def _hold_for_starting_if_first(self) -> bool:
        """Under the lock, with owners starting and passes pending: when every pending pass is
        an owner's first (nothing of a running generation waits), hold the batch about to fire
        for the owners starting, each once, until the oldest pending pass has waited
        start_hold_ms in all (True): launches that keep coming never hold a pass longer."""
        if not self._only_first_passes():
            return False
        until = self._start_hold_end()                       # a pass waits that long in all
        starting, self._starting = self._starting, set()    # each owner is waited for once
        if until <= time.monotonic():
            return False
        self._expected |= starting
        self._hold_until = max(self._hold_until, until)    # never cuts a hold after a batch short
        self._counts.num_holds += 1
        return True

    def _launch_burst_wait_s(self) -> float:
        """Under the lock, with passes pending: how long a batch of first passes waits for the
        next launch of a burst (0: none). While launches come less than LAUNCH_BURST_GAP_S
        apart, the first instance's pass can be queued (and its owner blocked) before the next
        launch is known; the batch waits until that gap has passed since the last launch, and
        never past the start hold's end."""
        if self._start_hold_s <= 0:
            return 0.0
        now = time.monotonic()
        quiet_at = self._last_start + LAUNCH_BURST_GAP_S
        if quiet_at <= now or not self._only_first_passes():
            return 0.0
        return min(quiet_at, self._start_hold_end()) - now

    def _only_first_passes(self) -> bool:
        """Under the lock: every pending pass is a launched owner's first."""
        unrun = self._unrun
        return bool(self._queues) and all(owner_of(key) in unrun for key in self._queues)

    def _start_hold_end(self) -> float:
        """Under the lock, passes pending: when the oldest has waited start_hold_ms."""
        return min(queue[0].enqueued_at for queue in self._queues.values()) + self._start_hold_s

    def _wait_hold(self) -> None:
        """Under the lock: wait while the hold after the last batch lasts (or until closed)."""
        while self._expected and not self._closed:
            wait_s = self._hold_until - time.monotonic()
            if wait_s <= 0:
                self._counts.num_hold_timeouts += 1
                self._expected.clear()
                return
            self._cond.wait(wait_s)

    def _k_or_t_wait_s(self) -> float:
        if len(self._queues) >= self.policy.k:
            return 0.0
        oldest = min(queue[0].enqueued_at for queue in self._queues.values())
        return oldest + self.policy.t_ms / 1000 - time.monotonic()

    def _expect(self, forward_items: list[Item], engine_s: float) -> None:
        """Under the lock, right before the batch's futures resolve: hold the next batch for the
        owners blocked on one of them."""
        if self.policy.kind != "adaptive":
            return
        bound_s = min(self.policy.max_hold_ms / 1000, self.policy.hold_fraction * engine_s)
        self._expected = {future.owner for future in filter(None, map(_future_of, forward_items))
                          if future.awaited} if bound_s > 0 else set()
        self._hold_until = time.monotonic() + bound_s
        self._counts.num_holds += bool(self._expected)
