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

The engine thread's path between two batches is kept short: when nothing is queued, held,
cancelled or closing, the next batch is exactly the passes prepared ahead, their requests
gathered by the helper, and it goes to the engine without taking the scheduler's lock; the
helper counts the batch in the statistics when it resolves it (such a batch holds no future, so
there is nothing for the adaptive hold to wait for).
"""
from __future__ import annotations

import logging
from itertools import repeat
from operator import attrgetter
from typing import Any, Hashable

from engine.batch import ForwardBatch, ForwardResult
from host.errors import Cancelled
from host.scheduling.engine_calls import check_results, forward_after_error, resolve
from host.scheduling.helper_thread import HelperThread
from host.scheduling.items import Item

__all__ = ["OverlapRunner"]

_log = logging.getLogger("host.scheduling.scheduler")

# A batch that ran, to resolve: [(items, outcomes, to_count)], a box the resolving thread
# empties, so that the batch's objects are freed there and not on the engine thread. to_count:
# the batch (of the short path) is still to count in the statistics.
Resolution = list[tuple[list[Item], list, bool]]
# The passes prepared ahead: (the index each follows in the running batch, None when each
# follows the pass at its own index (every pass has one); their items; their requests).
Ahead = tuple[list[int] | None, list[Item], tuple]

_request_of = attrgetter("request")


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
            fed_from: tuple = ()                    # ... the results feeding their tokens ...
            requests: tuple = ()                    # ... and their requests
            unresolved: Resolution = []
            try:
                while True:
                    if unresolved and not ahead:
                        self._resolve(unresolved)
                    chain = bool(ahead) and self._may_chain()
                    taken = None if chain else self._take(ahead, fed_from)
                    if not chain and taken is None:
                        break                             # closed
                    if not chain and not taken[0] and not taken[1]:
                        ahead, fed_from = [], ()          # what was ahead was dropped
                        continue
                    try:
                        ahead, fed_from, requests, unresolved = (
                            self._chain(helper, ahead, fed_from, requests, unresolved) if chain
                            else self._run_one(helper, *taken, unresolved))
                    except Exception:                     # never let the engine thread die
                        _log.exception("scheduler: unexpected error running a batch")
                        ahead, fed_from, requests, unresolved = [], (), (), []
                    del taken
            finally:
                self._resolve(unresolved)
                self._drop(ahead, "scheduler closed: submission not run")
                with self._scheduler._lock:
                    self._scheduler._running = False
                    self._scheduler._cond.notify_all()

    def _may_chain(self) -> bool:
        """Whether the next batch is just the passes prepared ahead (read without the lock: a
        submission racing this check joins the batch after)."""
        s = self._scheduler
        return not (s._num_pending or s._expected or s._closed or self._cancelled_owners)

    def _chain(self, helper: HelperThread, ahead: list[Item], fed_from: tuple,
               requests: tuple, unresolved: Resolution
               ) -> tuple[list[Item], tuple, tuple, Resolution]:
        """The short path: while `_may_chain`, each batch is the passes prepared ahead during
        the one before, run as they are while the helper resolves that one and prepares the
        next; a batch is counted in the statistics when it is resolved. Returns as `_run_one`."""
        s, between, cancelled = self._scheduler, self._between, self._cancelled_owners
        forward, helper_result = s.engine.forward, self._helper_result
        while True:               # each line here delays the next batch: kept to the least
            helper.start(between, unresolved, ahead)
            del unresolved
            try:
                outcomes = forward(ForwardBatch(requests, fed_from))
                if len(outcomes) != len(ahead):
                    check_results(outcomes, len(ahead))         # raises
                failed = False
            except Exception as error:                 # noqa: BLE001 -- outcomes
                outcomes, failed = forward_after_error(s.engine, ahead, fed_from, error), True
            finally:
                next_ahead = helper_result(helper)
            unresolved = [(ahead, outcomes, True)]
            if failed:                                 # some outcomes may be exceptions
                ahead, fed_from, requests = self._fed(next_ahead, outcomes)
            else:
                sources, ahead, requests = next_ahead
                fed_from = (tuple(outcomes) if sources is None
                            else tuple(map(outcomes.__getitem__, sources)))
            del outcomes, next_ahead
            if not ahead or s._num_pending or s._expected or s._closed or cancelled:
                return ahead, fed_from, requests, unresolved     # as `_may_chain`

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
                 unresolved: Resolution) -> tuple[list[Item], tuple, tuple, Resolution]:
        """Run one batch while the helper resolves the last and prepares ahead; returns the
        next batch's passes prepared ahead, the results feeding them, their requests, and this
        batch's resolution if it is still to do."""
        helper.start(self._between, unresolved, forward_items)
        del unresolved
        try:
            outcomes = self._scheduler._run_engine(copy_items, forward_items, fed_from)
        finally:
            ahead = self._helper_result(helper)
        forward_outcomes = outcomes[len(copy_items):] if copy_items else outcomes
        next_ahead, fed, requests = self._fed(ahead, forward_outcomes)
        resolution = [(copy_items + forward_items, outcomes, False)]
        del copy_items, forward_items, outcomes, forward_outcomes, fed_from
        if self._scheduler._expected:                     # a guest waits on this batch
            self._resolve(resolution)
        return next_ahead, fed, requests, resolution

    @staticmethod
    def _helper_result(helper: HelperThread) -> Ahead:
        try:
            return helper.result()
        except Exception:                                 # never let the engine thread die
            _log.exception("scheduler: preparing ahead failed")
            return [], [], ()

    def _fed(self, ahead: Ahead, outcomes: list) -> tuple[list[Item], tuple, tuple]:
        """The passes prepared ahead that run next, the results feeding them (from the batch
        that ran: `outcomes`) and their requests; those whose predecessor failed are ended."""
        sources, items, requests = ahead
        fed = tuple(outcomes) if sources is None else tuple(map(outcomes.__getitem__, sources))
        if all(map(isinstance, fed, repeat(ForwardResult))):
            return items, fed, requests
        kept = [index for index, source in enumerate(fed) if isinstance(source, ForwardResult)]
        self._drop([item for item, source in zip(items, fed)
                    if not isinstance(source, ForwardResult)],
                   "engine failed the pass before it: pass prepared ahead not run")
        return ([items[index] for index in kept], tuple(fed[index] for index in kept),
                tuple(requests[index] for index in kept))

    def _between(self, unresolved: Resolution, forward_items: list[Item]) -> Ahead:
        """On the helper, while a batch runs: resolve the batch before it, then prepare ahead."""
        try:
            self._resolve(unresolved)
        except Exception:                                 # resolve() logs the callbacks'
            _log.exception("scheduler: unexpected error resolving a batch")
        return self._prepare_ahead(forward_items)

    def _prepare_ahead(self, forward_items: list[Item]) -> Ahead:
        """The passes that follow the running batch's decode-loop passes: (the index of the
        pass each follows, in `forward_items`; their items; their requests)."""
        s = self._scheduler
        indices = [index for index, item in enumerate(forward_items)
                   if item.prepare_next is not None]
        if not indices:
            return [], [], ()
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
        identity = len(sources) == len(forward_items)        # each follows its own index
        return (None if identity else sources), items, tuple(map(_request_of, items))

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
            items, outcomes, to_count = resolution.pop()
            if to_count:                      # a batch of the short path:
                self._count(items, outcomes)              # no future, nothing to hold for
            self._scheduler._resolve(items, outcomes)
            self._scheduler._wakes.run()

    def _count(self, items: list[Item], outcomes: list) -> None:
        """Count a batch of the short path in the statistics (BatchScheduler._record's count)."""
        failed = any(map(isinstance, outcomes, repeat(BaseException)))
        with self._scheduler._lock:
            self._scheduler._counts.record_batch(0, len(items), failed)

    @staticmethod
    def _drop(items: list[Item], reason: str) -> None:
        """End passes prepared ahead that will not run (their loops see the error)."""
        for item in items:
            resolve(item, Cancelled(reason))
