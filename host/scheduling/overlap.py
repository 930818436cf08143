"""Overlapped batches (SchedulerPolicy.overlap): the host prepares a batch while the engine runs
the one before it.

Without it the engine waits, between two batches, while the host resolves the first (each pass's
on_done, its future or its decode loop's callback, the wakes) and forms the next: a decode loop
can prepare its next pass only once it has the token. With it, on the engine thread:

1. batch N goes to the engine; meanwhile a helper thread resolves batch N-1 (as the scheduler
   does without overlap) and then asks each decode-loop pass of N for the pass after it
   (`Item.prepare_next`, DecodeLoop.prepare_next), prepared with its input token left open;
2. when N returns, batch N+1 is those passes, each fed the token its predecessor produced
   (ForwardBatch.fed_from: the engine puts it in), and what else is queued (the batch rule, in
   the tokens left), and it goes to the engine at once;
3. the helper resolves N while N+1 runs.

A pass prepared ahead runs even when its loop ends at its predecessor (a stop token, stop());
its output is dropped (one wasted pass per loop) and a page it took is given back. A loop
prepares ahead only when that pass surely follows and takes the common decode route (no copy,
no mask), and only on a queue with nothing else queued (the queue's order holds); else it
chains its next pass at resolution, one batch later. A batch
that carries a pass some guest is blocked on (an awaited future) is resolved at once on the
engine thread and the next one held as the adaptive policy holds it, the passes prepared ahead
with it, so that guests stepping one pass at a time are not a batch behind. Passes prepared
ahead are charged to their owners' fair shares when prepared and count against
max_batch_tokens. A cancelled owner's passes prepared ahead are dropped before they run.
"""
from __future__ import annotations

import logging
from itertools import repeat
from typing import Any, Hashable

from engine.batch import ForwardResult
from host.errors import Cancelled
from host.scheduling.engine_calls import resolve
from host.scheduling.helper_thread import HelperThread
from host.scheduling.items import Item

__all__ = ["OverlapRunner"]

_log = logging.getLogger("host.scheduling.scheduler")

# A batch that ran, to resolve: [(items, outcomes, fed_from)], a box the resolving thread empties,
# so that the batch's objects are freed there and not on the engine thread.
Resolution = list[tuple[list[Item], list, tuple | None]]


class OverlapRunner:
    """The engine thread's loop of an overlapping BatchScheduler (`scheduler`: its internals are
    this runner's to use). `cancel_owner` is the scheduler's, under its lock."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler
        self._cancelled_owners: set[Hashable] = set()    # since the last batch was formed

    def cancel_owner(self, owner_id: Hashable) -> None:
        """Under the scheduler's lock: drop `owner_id`'s passes prepared ahead, not yet run."""
        self._cancelled_owners.add(owner_id)

    def run(self) -> None:
        """Run batches until the scheduler closes; then resolve the last, drop what was ahead."""
        with HelperThread("pie-overlap") as helper:
            ahead: list[Item] = []                  # the next batch's first passes ...
            fed_from: tuple = ()                    # ... and the results feeding their tokens
            unresolved: Resolution = []
            try:
                while True:
                    if unresolved and not ahead:
                        self._resolve(unresolved)
                    taken = self._take(ahead, fed_from)
                    if taken is None:
                        break
                    if not taken[0] and not taken[1]:     # what was ahead was dropped
                        ahead, fed_from = [], ()
                        continue
                    try:
                        ahead, fed_from, unresolved = self._run_one(helper, *taken, unresolved)
                    except Exception:                     # never let the engine thread die
                        _log.exception("scheduler: unexpected error running a batch")
                        ahead, fed_from, unresolved = [], (), []
                    del taken
            finally:
                self._resolve(unresolved)
                self._drop(ahead, "scheduler closed: submission not run")
                with self._scheduler._lock:
                    self._scheduler._running = False
                    self._scheduler._cond.notify_all()

    def _take(self, ahead: list[Item], fed_from: tuple
              ) -> tuple[list[Item], list[Item], tuple | None] | None:
        """The next batch: (copy items, forward items: the passes prepared ahead first, their
        fed_from); None once closed. Waits for work when nothing is ahead, else only for a
        hold."""
        s = self._scheduler
        dropped: list[Item] = []
        with s._lock:
            s._running = bool(ahead)
            if ahead:
                s._wait_hold()
            elif not s._wait_for_batch():
                return None                       # closed
            if s._closed:
                return None                       # run() drops what is ahead
            s._running = True
            if self._cancelled_owners and ahead:
                kept = [i for i, item in enumerate(ahead)
                        if item.owner not in self._cancelled_owners]
                dropped = [item for item in ahead if item.owner in self._cancelled_owners]
                ahead, fed_from = [ahead[i] for i in kept], tuple(fed_from[i] for i in kept)
            self._cancelled_owners.clear()
            taken = self._take_queued(len(ahead))
        self._drop(dropped, "instance terminated: pass prepared ahead not run")
        copy_items, forward_items = taken
        if not ahead:
            return copy_items, forward_items, None
        if forward_items:
            fed_from += (None,) * len(forward_items)
        return copy_items, ahead + forward_items, fed_from

    def _take_queued(self, num_ahead: int) -> tuple[list[Item], list[Item]]:
        """Under the lock: the queued items that go with `num_ahead` passes prepared ahead."""
        s = self._scheduler
        if not s._num_pending or num_ahead >= s.policy.max_batch_tokens:
            return [], []
        return s._take_batch(num_ahead)

    def _run_one(self, helper: HelperThread, copy_items: list[Item],
                 forward_items: list[Item], fed_from: tuple | None,
                 unresolved: Resolution) -> tuple[list[Item], tuple, Resolution]:
        """Run one batch while the helper resolves the last and prepares ahead; returns the
        next batch's passes prepared ahead, the results feeding them, and this batch's
        resolution if it is still to do."""
        helper.start(self._between, unresolved, forward_items)
        del unresolved
        try:
            outcomes = self._scheduler._run_engine(copy_items, forward_items, fed_from)
        finally:
            try:
                sources, ahead = helper.result()
            except Exception:                             # never let the engine thread die
                _log.exception("scheduler: preparing ahead failed")
                sources, ahead = [], []
        forward_outcomes = outcomes[len(copy_items):] if copy_items else outcomes
        fed = tuple(map(forward_outcomes.__getitem__, sources))
        if not all(map(isinstance, fed, repeat(ForwardResult))):
            failed = [item for item, source in zip(ahead, fed)
                      if not isinstance(source, ForwardResult)]
            ahead = [item for item, source in zip(ahead, fed) if isinstance(source, ForwardResult)]
            fed = tuple(source for source in fed if isinstance(source, ForwardResult))
            self._drop(failed, "engine failed the pass before it: pass prepared ahead not run")
        resolution = [(copy_items + forward_items, outcomes, fed_from)]
        del copy_items, forward_items, outcomes, forward_outcomes, fed_from
        if self._scheduler._expected:                     # a guest waits on this batch
            self._resolve(resolution)
        return ahead, fed, resolution

    def _between(self, unresolved: Resolution,
                 forward_items: list[Item]) -> tuple[list[int], list[Item]]:
        """On the helper, while a batch runs: resolve the batch before it, then prepare ahead."""
        try:
            self._resolve(unresolved)
        except Exception:                                 # resolve() logs the callbacks'
            _log.exception("scheduler: unexpected error resolving a batch")
        return self._prepare_ahead(forward_items)

    def _prepare_ahead(self, forward_items: list[Item]) -> tuple[list[int], list[Item]]:
        """The passes that follow the running batch's decode-loop passes: (the index of the
        pass each follows, in `forward_items`; their items)."""
        s = self._scheduler
        indices = [index for index, item in enumerate(forward_items)
                   if item.prepare_next is not None]
        if not indices:
            return [], []
        with s._lock:                          # a queue with items queued keeps its order
            indices = [index for index in indices
                       if forward_items[index].queue_key not in s._queues]
        sources: list[int] = []
        items: list[Item] = []
        for index in indices[:s.policy.max_batch_tokens]:
            item = self._prepare_one(forward_items[index])
            if item is not None:
                sources.append(index)
                items.append(item)
        with s._lock:
            for item in items:
                item.order = next(s._orders)
                s._fair.charge(item.owner, item.num_tokens)
        return sources, items

    @staticmethod
    def _prepare_one(source: Item) -> Item | None:
        """The item of the pass after `source`, or None."""
        try:
            next_pass = source.prepare_next()
        except Exception:
            _log.exception("scheduler: preparing a pass ahead failed")
            return None
        if next_pass is None:
            return None
        prepared, on_outcome = next_pass
        return source.following(prepared.request, prepared.on_done, on_outcome)

    def _resolve(self, resolution: Resolution) -> None:
        """Resolve the batch in the box, if any (emptying it: its objects are freed here)."""
        if resolution:
            items, outcomes, _ = resolution.pop()
            self._scheduler._resolve(items, outcomes)
            self._scheduler._wakes.run()

    @staticmethod
    def _drop(items: list[Item], reason: str) -> None:
        """End passes prepared ahead that will not run (their loops see the error)."""
        for item in items:
            resolve(item, Cancelled(reason))
