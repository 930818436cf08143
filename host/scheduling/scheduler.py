"""BatchScheduler: every instance's submitted passes, formed into engine batches, one at a time.

One step: take the batch the policy fires (host/scheduling/policy.py: when, and what it holds),
run it on the engine (copies first: queued kv.copy-tokens, then the passes' copy-on-write
copies), resolve it (each item's on_done, then its future or its decode loop's callback; the
guests' wakes deferred until the next batch has gone to the engine). Three threads take steps:

- the engine thread, for every batch no blocked guest takes;
- a guest's thread about to block on one of a batch's passes (adaptive, `run_on_waiter`), when
  that batch may fire right then (no hand-off to the engine thread and back);
- with a look-ahead (host/scheduling/lookahead.py), the engine thread alone: at depth 1
  (`SchedulerPolicy.overlap`) the next batch's decode-loop passes are prepared while one runs;
  at depth N (`chain_steps`) a batch of decode-loop passes runs several engine steps before it
  is resolved.

Submitting never blocks; it returns a SubmissionFuture, or, for a chained pass (a host decode
loop's next step), nothing: its `on_outcome` is called instead. An engine exception fails the
futures of that batch and the scheduler goes on; a RequestError fails the pass it names alone
(items.py). When more than one owner has work, no owner puts more than
max_tokens_per_owner tokens into a batch: a longer pass runs in chunks across batches (same
results; its future resolves once the last chunk has run). An owner may be suspended
(`suspend_owner`: its queues held, in their order, until `resume_owner`; host/suspensions.py),
and a caller may hold the engine between batches (`run_exclusive`: a suspension's page copies).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from operator import attrgetter
from typing import Callable, Hashable, Sequence, TypeVar

from engine.batch import ForwardResult, TokenCopy
from engine.protocol import EngineLike
from host.errors import Cancelled
from host.scheduling import policy as batch_policy
from host.scheduling.items import Item, SubmissionFuture, owner_of, rank_of, resolve, run_forward
from host.scheduling.lookahead import Lookahead
from host.scheduling.policy import FairShares, FireView, take_batch
from host.scheduling.types import PRIORITIES, SchedulerPolicy, SchedulerStats
from host.scheduling.work import PreparedCopy, PreparedForward

__all__ = ["BatchScheduler", "SchedulerPolicy", "SchedulerStats", "SubmissionFuture", "PRIORITIES"]

_log = logging.getLogger(__name__)
_copies_of, _future_of = attrgetter("copies"), attrgetter("future")

Batch = tuple[list[Item], list[Item]]      # (copy items, forward items), in run order
_R = TypeVar("_R")
_EXCLUSIVE_POLL_S = 0.005      # run_exclusive re-checks this often (a step's end notifies rarely)
NUM_RECENT = 64                # batch sizes kept for SchedulerStats.recent_batch_sizes


class BatchScheduler:
    """Owns the queues, the firing state and the engine thread. queue_key = (instance_id, local
    queue id); the first element is the owner that `cancel_owner` matches. Thread-safe."""

    def __init__(self, engine: EngineLike, policy: SchedulerPolicy = SchedulerPolicy()) -> None:
        self.engine = engine
        self.policy = policy
        self.lock = threading.RLock()      # entered directly: the Condition's enter is Python
        self._cond = threading.Condition(self.lock)
        self._queues: dict[Hashable, deque[Item]] = {}
        self._last_futures: dict[Hashable, Future] = {}
        self._orders = itertools.count()
        self._num_pending = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self._counts = BatchCounts()
        self._fair = FairShares(max_lag_tokens=policy.max_batch_tokens)
        self._wakes = DeferredWakes()
        self._chained: list[Item] = []          # submitted while a batch resolves, on its thread
        # the firing state (policy.py reads it through a FireView)
        self._expected: set[Hashable] = set()   # adaptive: owners the next batch is held for
        self._hold_until = 0.0                  # monotonic end of that hold
        self._start_hold_s = (policy.start_hold_ms or 0) / 1000   # None (unresolved): none
        self._starting: set[Hashable] = set()   # adaptive: owners launched, not blocked yet
        self._unrun: set[Hashable] = set()      # ... launched, none of their passes taken yet
        self._last_start = float("-inf")        # ... monotonic time of the last client launch
        self._running = False                   # a batch is running (engine or waiting thread)
        self._engine_idle = False               # the engine thread waits with no timer
        self._lookahead = Lookahead(self, policy)
        # suspended owners (suspend_owner): their queues, in order, out of the policy's sight
        self._held_owners: set[Hashable] = set()
        self._held: dict[Hashable, deque[Item]] = {}
        self._exclusive_wanted = 0              # run_exclusive callers waiting for the engine
        self._exclusive = False                 # one holds it now

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        with self.lock:
            if self._thread is not None:
                return
            target = self._lookahead.run if self._lookahead.overlaps else self._run_loop
            self._thread = threading.Thread(target=target, name="pie-engine", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the engine thread (after the batch it is running); pending futures get Cancelled."""
        with self.lock:
            self._closed = True
            while self._running:                  # the batch in flight ends first
                self._cond.wait()
            items = [item for queue in self._queues.values() for item in queue]
            items += [item for queue in self._held.values() for item in queue]
            self._queues.clear()
            self._held.clear()
            self._held_owners.clear()
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
        `prepare_next` / `chain_step`: the pass after it, for the look-ahead at depth 1 / N
        (lookahead.py); with chain_step, on_outcome gets a tuple of the results of every step
        it took."""
        item = Item(queue_key, rank_of(priority), 0, prepared.request, tuple(prepared.copies),
                    prepared.on_done, None)
        item.on_outcome, item.prepare_next, item.chain_step = on_outcome, prepare_next, chain_step
        if self._wakes.resolving_here():
            with self.lock:                      # cancel_owner drops them from here too
                self._chained.append(item)
            return True
        if self._enqueue([item]):
            return True
        item.on_outcome = None
        resolve(item, None)
        return False

    def _submit(self, queue_key, priority, request, copies, on_done,
                prepare_next=None) -> Future:
        item = Item(queue_key, rank_of(priority), 0, request, copies, on_done,
                    self._wait_started)
        item.prepare_next = prepare_next
        if not self._enqueue([item]):
            self._finish([item], [Cancelled("scheduler closed: submission refused")])
        return item.future

    def _enqueue(self, items: list[Item]) -> bool:
        """Queue `items` in order unless closed (False)."""
        with self.lock:
            if self._closed:
                return False
            num_held = 0
            for item in items:
                item.order = next(self._orders)
                if self._held_owners and item.owner in self._held_owners:
                    self._held.setdefault(item.queue_key, deque()).append(item)
                    num_held += 1
                else:
                    self._queues.setdefault(item.queue_key, deque()).append(item)
                if item.future is not None:
                    self._last_futures[item.queue_key] = item.future
            self._num_pending += len(items) - num_held
            if not self._expected or self._engine_idle:   # it fires, or times the hold
                self._cond.notify()
        return True

    def _enqueue_chained(self) -> None:
        """Queue the chained passes submitted while the last batch resolved (and not dropped
        by cancel_owner meanwhile)."""
        with self.lock:
            items, self._chained = self._chained, []
            queued = self._enqueue(items) if items else True
        if not queued:
            self._finish(items, [Cancelled("scheduler closed: submission not run")] * len(items))

    def synchronize_future(self, queue_key: Hashable) -> Future | None:
        """A future done (maybe with an error) once everything submitted on the queue so far has
        run; None when nothing is pending or running there."""
        with self.lock:
            future = self._last_futures.get(queue_key)
        return None if future is None or future.done() else future

    def cancel_owner(self, owner_id: str) -> int:
        """Drop the pending items of every queue whose key starts with `owner_id`; their futures
        get Cancelled. A batch already running is not interrupted. Returns the count dropped."""
        with self.lock:
            keys = [key for key in self._queues if owner_of(key) == owner_id]
            items = [item for key in keys for item in self._queues.pop(key)]
            held = [item for key in [k for k in self._held if owner_of(k) == owner_id]
                    for item in self._held.pop(key)]
            self._held_owners.discard(owner_id)
            for key in [key for key in self._last_futures if owner_of(key) == owner_id]:
                if any(item.future is self._last_futures[key] for item in items + held):
                    del self._last_futures[key]
            self._num_pending -= len(items)
            items += held
            items += [item for item in self._chained if item.owner == owner_id]   # not queued yet
            self._chained = [item for item in self._chained if item.owner != owner_id]
            self._counts.num_cancelled += len(items)
            self._fair.forget(owner_id)
            self._unrun.discard(owner_id)
            self._lookahead.cancel_owner(owner_id)
        self.owner_waiting(owner_id)                       # an ended owner is not waited for
        error = Cancelled(f"instance {owner_id} terminated: pending submission cancelled")
        self._finish(items, [error] * len(items))
        return len(items)

    def defer_wake(self, wake: Callable[[], None]) -> bool:
        """From a callback while its batch resolves: run `wake` (waking a guest) only once the
        next batch has gone to the engine, or right after this one when none follows at once
        (DeferredWakes). False, and nothing kept, outside a batch's resolution."""
        return self._wakes.defer(wake)

    def set_owner_group(self, owner_id: Hashable, group: Hashable) -> None:
        """Share batches fairly between groups (tenants) first, then between their owners."""
        with self.lock:
            self._fair.set_group(owner_id, group)

    def statistics(self) -> SchedulerStats:
        with self.lock:
            return self._counts.stats(self._num_pending, len(self._queues))

    # ------------------------------------------------------- suspension (host/runtime.py)
    def suspend_owner(self, owner_id: Hashable) -> int:
        """Hold every queue of `owner_id`: no batch takes its passes or copies, queued or
        submitted later, until `resume_owner`; a batch already running is not interrupted.
        The queues keep their order; `synchronize_future` and `cancel_owner` see them as
        before. Returns the number of items held now."""
        with self.lock:
            self._held_owners.add(owner_id)
            keys = [key for key in self._queues if owner_of(key) == owner_id]
            num_held = 0
            for key in keys:
                queue = self._queues.pop(key)
                self._held.setdefault(key, deque()).extend(queue)
                num_held += len(queue)
            self._num_pending -= num_held
            self._expected.discard(owner_id)
            self._starting.discard(owner_id)
            return num_held

    def resume_owner(self, owner_id: Hashable) -> int:
        """End `suspend_owner`: the held queues join the others, in their order, ahead of what
        their owner submits next. Returns the number of items released."""
        with self.lock:
            self._held_owners.discard(owner_id)
            keys = [key for key in self._held if owner_of(key) == owner_id]
            num_released = 0
            for key in keys:
                queue = self._held.pop(key)
                num_released += len(queue)
                queue.extend(self._queues.pop(key, ()))       # none: held owners queue here
                self._queues[key] = queue
            self._num_pending += num_released
            if num_released:
                self._cond.notify_all()
            return num_released

    def is_suspended(self, owner_id: Hashable) -> bool:
        with self.lock:
            return owner_id in self._held_owners

    def run_exclusive(self, work: Callable[[], _R]) -> _R:
        """Run `work` on this thread while no batch runs (it may call the engine: page copies
        out and in for a suspension); batches wait for it. Not from a batch's resolution."""
        with self.lock:
            self._exclusive_wanted += 1           # chains stop, the look-ahead yields
            self._cond.notify_all()
            try:
                while self._running or self._exclusive:
                    self._cond.wait(_EXCLUSIVE_POLL_S)
            finally:
                self._exclusive_wanted -= 1
            self._running = self._exclusive = True
        try:
            return work()
        finally:
            with self.lock:
                self._running = self._exclusive = False
                self._cond.notify_all()

    # ------------------------------------------------------- owners' comings and goings
    def owner_starting(self, owner_id: Hashable, burst: bool = True) -> None:
        """`owner_id` was launched: with `start_hold_ms`, a batch of first passes may wait for
        it until it first blocks or ends, and (`burst`: a client's launch, whose next one the
        host cannot see coming) for a pause in the launches (policy.py)."""
        if self.policy.kind == "adaptive" and self._start_hold_s > 0:
            with self.lock:
                self._starting.add(owner_id)
                self._unrun.add(owner_id)
                if burst:
                    self._last_start = time.monotonic()

    def owner_waiting(self, owner_id: Hashable) -> None:
        """`owner_id` is about to block (on a pass, a synchronize, a receive) or has ended: the
        hold after the last batch no longer waits for it."""
        with self.lock:
            self._starting.discard(owner_id)
            if owner_id in self._expected:
                self._expected.discard(owner_id)
                if not self._expected:
                    self._cond.notify()

    def _wait_started(self, future: SubmissionFuture) -> None:
        """`future`'s owner is about to block on it (SubmissionFuture.wait_started): take every
        step the policy fires now on this thread, while `future` is pending and no batch runs
        elsewhere (adaptive with run_on_waiter, no look-ahead at depth 1); else, as
        `owner_waiting`, let the engine thread fire or time it."""
        while not future.done():
            with self.lock:
                self._expected.discard(future.owner)
                self._starting.discard(future.owner)
                if not self._may_run_here():
                    if not self._expected or self._engine_idle:
                        self._cond.notify()           # it fires, or times the hold
                    return
                batch = self._take()
            self.step(batch)

    def _may_run_here(self) -> bool:
        """Under the lock, on a guest's thread: whether the batch the policy fires now is this
        thread's to run."""
        if (self._running or self._closed or self._expected or not self._num_pending
                or self._exclusive_wanted or self._exclusive
                or self.policy.kind != "adaptive" or not self.policy.run_on_waiter
                or self._lookahead.overlaps):
            return False
        return self._fire_now(end_hold=False)

    # ---------------------------------------------------------- the step
    def _run_loop(self) -> None:
        """The engine thread without a look-ahead at depth 1: step whenever the policy fires."""
        while True:
            with self.lock:
                if not self.wait_for_batch():
                    return
                batch = self._take()
            self.step(batch)

    def _take(self, num_taken: int = 0) -> Batch:
        """Under the lock, once the policy fires: mark a batch running and take it."""
        self._running = True
        return self.take_queued(num_taken)

    def step(self, batch: Batch) -> None:
        """Run a batch taken under the lock (marked running), then resolve it, on the calling
        thread; at depth N the look-ahead first runs the decode loops' further steps."""
        copy_items, forward_items = batch
        try:
            self._wakes.run()                              # the last batch's, deferred
            outcomes = self.run_engine(copy_items, forward_items)
            if (not copy_items and forward_items and forward_items[0].chain_step is not None
                    and threading.current_thread() is self._thread):   # never a guest's
                outcomes = self._lookahead.chain(forward_items, outcomes)   # checks them all
            self.resolve(copy_items + forward_items, outcomes)
        except Exception:                                  # never let a runner die
            _log.exception("scheduler: unexpected error running a batch")
        finally:
            with self.lock:
                self._running = False
                if (self._closed or self._exclusive_wanted
                        or (self._engine_idle and self._num_pending)):
                    self._cond.notify_all()                # what is left is the engine's
                next_is_due = self._num_pending and not self._expected and not self._closed
            if not next_is_due:                            # else the next batch runs them
                self._wakes.run()

    # ------------------------------------------- what the look-ahead uses (lookahead.py)
    def wait_for_batch(self) -> bool:
        """Under the lock: wait until the policy fires (never while a run_exclusive caller
        waits for the engine or holds it). False when closed."""
        while not self._closed:
            if self._exclusive_wanted or self._exclusive:
                self._cond.wait(_EXCLUSIVE_POLL_S)
                continue
            if self._fire_now(end_hold=True):
                return True
        return False

    def wait_hold(self) -> None:
        """Under the lock, with passes prepared ahead: wait while the hold after the last batch
        lasts (or until closed); first let a run_exclusive caller have the engine (the passes
        ahead wait, prepared)."""
        while not self._closed:
            if self._exclusive:                        # a caller holds the engine
                self._cond.wait(_EXCLUSIVE_POLL_S)
                continue
            if self._exclusive_wanted:                 # let it in
                self._running = False
                self._cond.notify_all()
                self._cond.wait(_EXCLUSIVE_POLL_S)
                continue
            self._running = True
            if not self._expected:
                return
            wait_s = self._hold_until - time.monotonic()
            if wait_s <= 0:
                self._counts.num_hold_timeouts += 1
                self._expected.clear()
                return
            self._cond.wait(wait_s)

    def take_queued(self, num_taken: int = 0) -> Batch:
        """Under the lock: the queued items of the next batch (policy.take_batch), in the
        batch's tokens left after `num_taken` passes prepared ahead."""
        if num_taken and (not self._num_pending or num_taken >= self.policy.max_batch_tokens):
            return [], []
        copy_items, forward_items = take_batch(self._queues, self._fair, self.policy,
                                               self.engine.page_size,
                                               self.policy.max_batch_tokens - num_taken)
        self._num_pending -= len(copy_items) + sum(item.parent is None for item in forward_items)
        if self._unrun:
            self._unrun.difference_update(item.owner for item in forward_items)
        return copy_items, forward_items

    def set_running(self, running: bool) -> None:
        """Under the lock: whether a batch (or passes prepared ahead) is running."""
        self._running = running
        if not running and self._exclusive_wanted:
            self._cond.notify_all()                        # run_exclusive's turn

    def stopped(self) -> None:
        """Under the lock: the look-ahead's loop has ended (close() may go on)."""
        self._running = False
        self._cond.notify_all()

    def run_engine(self, copy_items: list[Item], forward_items: list[Item],
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
        with self.lock:
            self._hold_after(forward_items, time.monotonic() - started)
            self._counts.record_batch(len(copy_items), len(forward_items), failed)
        return outcomes

    def resolve(self, items: list[Item], outcomes: list) -> None:
        """End a batch's items (on this thread: the chained passes they submit are queued at
        the end, the wakes they ask for deferred)."""
        self._wakes.start_resolving()
        try:
            self._finish(items, outcomes)
        finally:
            self._wakes.stop_resolving()
            self._enqueue_chained()
        self._forget(items)

    def run_wakes(self) -> None:
        """Run the wakes deferred while the last batch resolved."""
        self._wakes.run()

    def record_step(self, items: list[Item], failed: bool, charge: bool) -> None:
        """Count a batch the look-ahead ran without `run_engine` (its items; whether a pass
        failed); `charge`: charge its owners' fair shares a token each."""
        with self.lock:
            self._counts.record_batch(0, len(items), failed)
            if charge:
                for item in items:
                    self._fair.charge(item.owner, 1)

    def admit_ahead(self, items: list[Item]) -> None:
        """Passes prepared ahead join the order and are charged to their owners' fair shares."""
        with self.lock:
            for item in items:
                item.order = next(self._orders)
                self._fair.charge(item.owner, item.num_tokens)

    def without_queued(self, items: list[Item]) -> list[Item]:
        """`items` whose queue has nothing queued (only there may a pass be prepared ahead:
        the queue's order holds)."""
        with self.lock:
            return [item for item in items if item.queue_key not in self._queues]

    def has_other_work(self) -> bool:
        """Read without the lock (a racing submission waits one batch at most): anything
        queued, a hold, a run_exclusive caller waiting, or closing."""
        return bool(self._num_pending or self._expected or self._closed
                    or self._exclusive_wanted)

    def has_queued(self) -> bool:
        """Read without the lock, as has_other_work: anything queued, a run_exclusive caller
        waiting, or closing."""
        return bool(self._num_pending or self._closed or self._exclusive_wanted)

    def holding(self) -> bool:
        """Whether the next batch is held for owners blocked on the last (adaptive)."""
        return bool(self._expected)

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------ firing state
    def _fire_now(self, end_hold: bool) -> bool:
        """Under the lock: ask the policy, apply what it changes, and wait as it says (or, with
        `end_hold` False, on a guest's thread, never wait: False). True when it fires now."""
        while True:
            fire = batch_policy.decide(self._view(), self.policy, self._start_hold_s)
            if fire.now:
                return True
            if fire.forget_starting:
                starting, self._starting = self._starting, set()
                if fire.start_hold_until is not None:
                    self._expected |= starting
                    self._hold_until = max(self._hold_until, fire.start_hold_until)
                    self._counts.num_holds += 1
                continue
            if not end_hold:
                return False
            if fire.end_hold:
                self._counts.num_hold_timeouts += 1
                self._expected.clear()
                continue
            if fire.wait_s is None:
                self._engine_idle = True
                self._cond.wait()
                self._engine_idle = False
            else:
                self._cond.wait(fire.wait_s)
            return False

    def _view(self) -> FireView:
        """Under the lock: what the policy reads now (the queues scanned only when needed)."""
        now = time.monotonic()
        only_first, oldest_at = False, now
        if self._queues and batch_policy.needs_queue_scan(self.policy, self._start_hold_s,
                                                          bool(self._starting),
                                                          self._last_start, now):
            unrun = self._unrun
            only_first = all(owner_of(key) in unrun for key in self._queues)
            oldest_at = min(queue[0].enqueued_at for queue in self._queues.values())
        return FireView(now, self._running, self._num_pending, len(self._queues),
                        bool(self._expected), self._hold_until, bool(self._starting),
                        self._last_start, only_first, oldest_at)

    def _hold_after(self, forward_items: list[Item], engine_s: float) -> None:
        """Under the lock, right before the batch's futures resolve: hold the next batch for
        the owners blocked on one of them."""
        if self.policy.kind != "adaptive":
            return
        awaited = {future.owner for future in filter(None, map(_future_of, forward_items))
                   if future.awaited}
        self._expected, self._hold_until = batch_policy.hold_after(self.policy, awaited,
                                                                   engine_s, time.monotonic())
        self._counts.num_holds += bool(self._expected)

    # ------------------------------------------------------------ ending items
    def _forget(self, items: list[Item]) -> None:
        """Drop the synchronize entries that these (now resolved) items were the last of."""
        if not any(map(_future_of, items)):               # chained passes and chunks
            return
        with self.lock:
            for item in items:
                if (item.future is not None
                        and self._last_futures.get(item.queue_key) is item.future):
                    del self._last_futures[item.queue_key]

    def _finish(self, items: list[Item], outcomes: list) -> None:
        """End each item: its on_done first (pages it pinned may be released), then its future
        (an exception outcome is set as the future's exception)."""
        for item, outcome in zip(items, outcomes):
            if item.parent is not None:
                self._finish_chunk(item, outcome)
                continue
            if isinstance(outcome, ForwardResult):
                outcome = item.merged(outcome)
            resolve(item, outcome)

    def _finish_chunk(self, chunk: Item, outcome: object) -> None:
        """A chunk ran: keep its outputs for its pass; a failure fails the whole pass (the rest,
        at the head of its queue, is dropped)."""
        parent = chunk.parent
        if not isinstance(outcome, BaseException):
            parent.merged(outcome, chunk.output_slots)
            return
        with self.lock:
            queue = self._queues.get(parent.queue_key)
            if not queue or queue[0] is not parent:
                return                                # cancelled meanwhile
            queue.popleft()
            self._num_pending -= 1
            if not queue:
                del self._queues[parent.queue_key]
        self._finish([parent], [outcome])
        self._forget([parent])


class BatchCounts:
    """Counters of batches, passes, copies, cancellations and holds. Not thread-safe: the
    scheduler updates and reads them under its own lock."""

    def __init__(self) -> None:
        self.num_batches = self.num_failed_batches = self.num_forwards = 0
        self.num_copy_items = self.num_cancelled = 0
        self.num_holds = self.num_hold_timeouts = 0
        self._histogram: dict[int, int] = {}          # passes in a batch -> batches
        self._recent: deque[int] = deque(maxlen=NUM_RECENT)

    def record_batch(self, num_copy_items: int, num_forwards: int, failed: bool) -> None:
        """A batch ran (`num_forwards` 0: copies only, not counted as a batch)."""
        self.num_copy_items += num_copy_items
        if num_forwards:
            self.num_batches += 1
            self.num_failed_batches += failed
            self.num_forwards += num_forwards
            self._histogram[num_forwards] = self._histogram.get(num_forwards, 0) + 1
            self._recent.append(num_forwards)

    def stats(self, num_pending: int, num_queues: int) -> SchedulerStats:
        return SchedulerStats(
            num_batches=self.num_batches, num_failed_batches=self.num_failed_batches,
            num_forwards=self.num_forwards, num_copy_items=self.num_copy_items,
            num_cancelled=self.num_cancelled, num_pending=num_pending, num_queues=num_queues,
            max_batch_size=max(self._histogram, default=0),
            batch_size_histogram=tuple(sorted(self._histogram.items())),
            recent_batch_sizes=tuple(self._recent), num_holds=self.num_holds,
            num_hold_timeouts=self.num_hold_timeouts)


class DeferredWakes:
    """Guest wake-ups held back while a batch resolves. A batch's future callbacks (a host
    decode loop submitting its next pass) run on the thread that resolves the batch; a guest
    woken there would compete with them, and with the next batch's forming, for the GIL. So a
    wake asked for during the resolution waits until the scheduler runs it: right before the
    next batch goes to the engine, or right after this one when none follows. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wakes: list[Callable[[], None]] = []
        self._resolving: int | None = None     # the resolving thread's ident

    def start_resolving(self) -> None:
        """The calling thread resolves a batch until `stop_resolving`."""
        self._resolving = threading.get_ident()

    def stop_resolving(self) -> None:
        self._resolving = None

    def resolving_here(self) -> bool:
        """Whether the calling thread is resolving a batch."""
        return self._resolving == threading.get_ident()

    def defer(self, wake: Callable[[], None]) -> bool:
        """Keep `wake` for `run`, when called on the thread resolving a batch; else False (and
        nothing kept): the caller wakes now."""
        if not self.resolving_here():
            return False
        with self._lock:
            self._wakes.append(wake)
        return True

    def run(self) -> None:
        """Run (and forget) every wake kept so far."""
        with self._lock:
            wakes, self._wakes = self._wakes, []
        for wake in wakes:
            try:
                wake()
            except Exception:
                _log.exception("scheduler: a deferred wake failed")
