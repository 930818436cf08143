"""BatchScheduler: the engine thread, and the rules that form batches.

What goes in a batch (host/scheduling/forming.py): each queue contributes at most its head pass.
Queues are taken fairly (host/scheduling/fairness.py): the group (tenant) and then the owner
(instance) served the fewest tokens first, and only among one owner's queues by priority (high,
normal, low), oldest head first, until the batch holds max_batch_tokens (a pass larger than that
still runs, alone, when it is the only owner's work). When more than one owner has work, no owner
puts more than max_tokens_per_owner tokens into a batch: a longer pass runs in chunks across
batches (engine/chunking.py; same results, its future resolves once the last chunk has
run). Copies queued before a queue's head pass (kv.copy-tokens) and the copy-on-write copies of the
chosen passes run on the engine thread, in that order, right before the batch's forward.

When a batch fires and on which thread: host/scheduling/firing.py (the adaptive hold,
run_on_waiter, k-or-t). With SchedulerPolicy.overlap the engine thread runs every batch and the
next one's decode-loop passes are prepared while one runs (host/scheduling/overlap.py).

Submitting never blocks (eager calls never wait on a batch); it returns a SubmissionFuture (a
concurrent.futures.Future), or, for a chained pass (a host decode loop's next step), nothing: its
`on_outcome` is called instead. An engine exception fails the futures of that batch with the
exception and the scheduler goes on; a RequestError fails the pass it names alone (engine_calls.py).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from operator import attrgetter
from typing import Callable, Hashable, Sequence

from engine.batch import ForwardResult, TokenCopy
from engine.protocol import EngineLike
from host.errors import Cancelled
from host.scheduling.chaining import run_chain
from host.scheduling.counts import BatchCounts
from host.scheduling.engine_calls import resolve, run_forward
from host.scheduling.fairness import FairShares
from host.scheduling.firing import FiringRules
from host.scheduling.forming import take_batch
from host.scheduling.items import Item as _Item, owner_of as _owner, rank_of
from host.scheduling.overlap import OverlapRunner
from host.scheduling.types import PRIORITIES, SchedulerPolicy, SchedulerStats, SubmissionFuture
from host.scheduling.wakes import DeferredWakes
from host.scheduling.work import PreparedCopy, PreparedForward

__all__ = ["BatchScheduler", "SchedulerPolicy", "SchedulerStats", "SubmissionFuture", "PRIORITIES"]

_log = logging.getLogger(__name__)
_copies_of, _future_of = attrgetter("copies"), attrgetter("future")


class BatchScheduler(FiringRules):
    """Owns the engine thread. queue_key = (instance_id, local queue id); the first element is
    the owner that `cancel_owner` matches. Thread-safe."""

    def __init__(self, engine: EngineLike, policy: SchedulerPolicy = SchedulerPolicy()) -> None:
        self.engine = engine
        self.policy = policy
        self._lock = threading.RLock()     # entered directly: the Condition's enter is Python
        self._cond = threading.Condition(self._lock)
        self._queues: dict[Hashable, deque[_Item]] = {}
        self._last_futures: dict[Hashable, Future] = {}
        self._orders = itertools.count()
        self._num_pending = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self._counts = BatchCounts()
        self._expected: set[Hashable] = set()   # adaptive: owners the next batch is held for
        self._hold_until = 0.0                  # monotonic end of that hold
        self._start_hold_s = (policy.start_hold_ms or 0) / 1000   # None (unresolved): none
        self._starting: set[Hashable] = set()   # adaptive: owners launched, not blocked yet
        self._unrun: set[Hashable] = set()      # ... launched, none of their passes taken yet
        self._last_start = float("-inf")        # ... monotonic time of the last launch
        self._running = False                   # a batch is running (engine or waiting thread)
        self._engine_idle = False               # the engine thread waits with no timer
        self._fair = FairShares(max_lag_tokens=policy.max_batch_tokens)
        self._wakes = DeferredWakes()
        self._chained: list[_Item] = []         # submitted while a batch resolves, on its thread
        self._overlap = OverlapRunner(self) if policy.overlap else None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            target = self._overlap.run if self._overlap is not None else self._run_loop
            self._thread = threading.Thread(target=target, name="pie-engine", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the engine thread (after the batch it is running); pending futures get Cancelled."""
        with self._lock:
            self._closed = True
            while self._running:                  # the batch in flight ends first
                self._cond.wait()
            items = [item for queue in self._queues.values() for item in queue]
            self._queues.clear()
            self._last_futures.clear()
            self._expected.clear()
            self._starting.clear()
            self._unrun.clear()
            self._num_pending = 0
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._finish(items, [Cancelled("scheduler closed: submission not run")] * len(items))
        self._wakes.run()

    def __enter__(self) -> "BatchScheduler":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ----------------------------------------------------------- submission
    def submit_forward(self, queue_key: Hashable, priority: str, prepared: PreparedForward,
                       prepare_next: Callable[[], object] | None = None
                       ) -> Future[ForwardResult]:
        """Queue a pass; its copy-on-write copies run right before the batch that carries it.
        `prepare_next`: as submit_chained's."""
        return self._submit(queue_key, priority, prepared.request, tuple(prepared.copies),
                            prepared.on_done, prepare_next)

    def submit_copy(self, queue_key: Hashable, priority: str,
                    copies: PreparedCopy | Sequence[TokenCopy],
                    on_done: Callable[[], None] | None = None) -> Future[None]:
        """Queue copies, in order with the queue's passes. Resolves to None once they ran."""
        if isinstance(copies, PreparedCopy):
            copies, on_done = copies.copies, copies.on_done
        return self._submit(queue_key, priority, None, tuple(copies), on_done)

    def submit_chained(self, queue_key: Hashable, priority: str, prepared: PreparedForward,
                       on_outcome: Callable[[object], None],
                       prepare_next: Callable[[], object] | None = None,
                       chain_step: Callable[[object], object] | None = None) -> bool:
        """Queue a pass with no future (a host decode loop's next step): once it has run, failed
        or been cancelled, its on_done and then `on_outcome(ForwardResult or exception)` are
        called on the thread that resolves it. `synchronize` does not wait for it. False when
        closed: nothing queued, on_done called, on_outcome never. From a batch's resolution, on
        its thread, it is queued with the batch's other chained passes once it has resolved.
        `prepare_next`: with overlap, prepares the pass after it while it runs (overlap.py).
        `chain_step`: without overlap, the one-token pass after it, run in the same batch's chain
        (chaining.py); on_outcome then gets a tuple of the results of every step it took."""
        item = _Item(queue_key, rank_of(priority), 0, prepared.request, tuple(prepared.copies),
                     prepared.on_done, None)
        item.on_outcome, item.prepare_next, item.chain_step = on_outcome, prepare_next, chain_step
        if self._wakes.resolving_here():
            with self._lock:                     # cancel_owner drops them from here too
                self._chained.append(item)
            return True
        if self._enqueue([item]):
            return True
        item.on_outcome = None
        resolve(item, None)
        return False

    def _submit(self, queue_key, priority, request, copies, on_done,
                prepare_next=None) -> Future:
        item = _Item(queue_key, rank_of(priority), 0, request, copies, on_done,
                     self._wait_started)
        item.prepare_next = prepare_next
        if not self._enqueue([item]):
            self._finish([item], [Cancelled("scheduler closed: submission refused")])
        return item.future

    def _enqueue(self, items: list[_Item]) -> bool:
        """Queue `items` in order unless closed (False)."""
        with self._lock:
            if self._closed:
                return False
            for item in items:
                item.order = next(self._orders)
                self._queues.setdefault(item.queue_key, deque()).append(item)
                if item.future is not None:
                    self._last_futures[item.queue_key] = item.future
            self._num_pending += len(items)
            if not self._expected or self._engine_idle:   # it fires, or times the hold
                self._cond.notify()
        return True

    def _enqueue_chained(self) -> None:
        """Queue the chained passes submitted while the last batch resolved (and not dropped
        by cancel_owner meanwhile)."""
        with self._lock:
            items, self._chained = self._chained, []
            queued = self._enqueue(items) if items else True
        if not queued:
            self._finish(items, [Cancelled("scheduler closed: submission not run")] * len(items))

    def synchronize_future(self, queue_key: Hashable) -> Future | None:
        """A future done (maybe with an error) once everything submitted on the queue so far has
        run; None when nothing is pending or running there."""
        with self._lock:
            future = self._last_futures.get(queue_key)
        return None if future is None or future.done() else future

    def cancel_owner(self, owner_id: str) -> int:
        """Drop the pending items of every queue whose key starts with `owner_id`; their futures
        get Cancelled. A batch already running is not interrupted. Returns the count dropped."""
        with self._lock:
            keys = [key for key in self._queues if _owner(key) == owner_id]
            items = [item for key in keys for item in self._queues.pop(key)]
            for key in [key for key in self._last_futures if _owner(key) == owner_id]:
                if any(item.future is self._last_futures[key] for item in items):
                    del self._last_futures[key]
            self._num_pending -= len(items)
            items += [item for item in self._chained if item.owner == owner_id]   # not queued yet
            self._chained = [item for item in self._chained if item.owner != owner_id]
            self._counts.num_cancelled += len(items)
            self._fair.forget(owner_id)
            self._unrun.discard(owner_id)
            if self._overlap is not None:
                self._overlap.cancel_owner(owner_id)
        self.owner_waiting(owner_id)                       # an ended owner is not waited for
        error = Cancelled(f"instance {owner_id} terminated: pending submission cancelled")
        self._finish(items, [error] * len(items))
        return len(items)

    def defer_wake(self, wake: Callable[[], None]) -> bool:
        """From a callback while its batch resolves: run `wake` (waking a guest) only once the
        next batch has gone to the engine, or right after this one when none follows at once
        (host/scheduling/wakes.py). False, and nothing kept, outside a batch's resolution."""
        return self._wakes.defer(wake)

    def set_owner_group(self, owner_id: Hashable, group: Hashable) -> None:
        """Share batches fairly between groups (tenants) first, then between their owners."""
        with self._lock:
            self._fair.set_group(owner_id, group)

    def statistics(self) -> SchedulerStats:
        with self._lock:
            return self._counts.stats(self._num_pending, len(self._queues))

    # ---------------------------------------------------------- engine thread
    def _run_loop(self) -> None:
        while True:
            with self._lock:
                if not self._wait_for_batch():
                    return
                self._running = True
                copy_items, forward_items = self._take_batch()
            self._run_taken(copy_items, forward_items)

    def _run_taken(self, copy_items: list[_Item], forward_items: list[_Item]) -> None:
        """Run a batch taken under the lock (`_running` set), on whichever thread took it."""
        try:
            self._run_batch(copy_items, forward_items)
        except Exception:                                  # never let a runner die
            _log.exception("scheduler: unexpected error running a batch")
        finally:
            with self._lock:
                self._running = False
                if self._closed or (self._engine_idle and self._num_pending):
                    self._cond.notify_all()                # what is left is the engine's
                next_is_due = self._num_pending and not self._expected and not self._closed
            if not next_is_due:                            # else the next batch runs them
                self._wakes.run()

    def _take_batch(self, num_taken: int = 0) -> tuple[list[_Item], list[_Item]]:
        """Under the lock: apply the rule (host/scheduling/forming.py), in the batch's tokens
        left after `num_taken`. Returns (copy items, forward items) in run order."""
        copy_items, forward_items = take_batch(self._queues, self._fair, self.policy,
                                               self.engine.page_size,
                                               self.policy.max_batch_tokens - num_taken)
        self._num_pending -= len(copy_items) + sum(item.parent is None for item in forward_items)
        if self._unrun:
            self._unrun.difference_update(item.owner for item in forward_items)
        return copy_items, forward_items

    def _run_batch(self, copy_items: list[_Item], forward_items: list[_Item]) -> None:
        self._wakes.run()                                  # the last batch's, deferred
        outcomes = self._run_engine(copy_items, forward_items)
        if ((self.policy.chain_steps or 1) > 1 and not copy_items
                and threading.current_thread() is self._thread):   # never on a guest's thread
            outcomes = run_chain(self, forward_items, outcomes)
        self._resolve(copy_items + forward_items, outcomes)

    def _run_engine(self, copy_items: list[_Item], forward_items: list[_Item],
                    fed_from: tuple | None = None) -> list:
        """Run a batch's copies, then its passes (`fed_from`: as run_forward's), and record it:
        an outcome per item (a copy item's None; an exception for a failed one)."""
        items = copy_items + forward_items
        copies = list(itertools.chain.from_iterable(map(_copies_of, items)))
        started = time.monotonic()
        try:
            if copies:
                self.engine.copy_tokens(copies)
        except Exception as error:                     # the batch fails, the scheduler goes on
            outcomes: list = [error] * len(items)
        else:
            outcomes = run_forward(self.engine, forward_items, fed_from)
            if copy_items:
                outcomes = [None] * len(copy_items) + outcomes
        failed = any(map(isinstance, outcomes, itertools.repeat(BaseException)))
        self._record(copy_items, forward_items, failed, time.monotonic() - started)
        return outcomes

    def _resolve(self, items: list[_Item], outcomes: list) -> None:
        """End a batch's items (on this thread: the chained passes they submit are queued at
        the end, the wakes they ask for deferred)."""
        self._wakes.start_resolving()
        try:
            self._finish(items, outcomes)
        finally:
            self._wakes.stop_resolving()
            self._enqueue_chained()
        self._forget(items)

    def _record(self, copy_items: list[_Item], forward_items: list[_Item], failed: bool,
                engine_s: float) -> None:
        with self._lock:
            self._expect(forward_items, engine_s)
            self._counts.record_batch(len(copy_items), len(forward_items), failed)

    def _forget(self, items: list[_Item]) -> None:
        """Drop the synchronize entries that these (now resolved) items were the last of."""
        if not any(map(_future_of, items)):               # chained passes and chunks
            return
        with self._lock:
            for item in items:
                if (item.future is not None
                        and self._last_futures.get(item.queue_key) is item.future):
                    del self._last_futures[item.queue_key]

    def _finish(self, items: list[_Item], outcomes: list) -> None:
        """End each item: its on_done first (pages it pinned may be released), then its future
        (an exception outcome is set as the future's exception)."""
        for item, outcome in zip(items, outcomes):
            if item.parent is not None:
                self._finish_chunk(item, outcome)
                continue
            if isinstance(outcome, ForwardResult):
                outcome = item.merged(outcome)
            resolve(item, outcome)

    def _finish_chunk(self, chunk: _Item, outcome: object) -> None:
        """A chunk ran: keep its outputs for its pass; a failure fails the whole pass (the rest,
        at the head of its queue, is dropped)."""
        parent = chunk.parent
        if not isinstance(outcome, BaseException):
            parent.merged(outcome, chunk.output_slots)
            return
        with self._lock:
            queue = self._queues.get(parent.queue_key)
            if not queue or queue[0] is not parent:
                return                                # cancelled meanwhile
            queue.popleft()
            self._num_pending -= 1
            if not queue:
                del self._queues[parent.queue_key]
        self._finish([parent], [outcome])
        self._forget([parent])
