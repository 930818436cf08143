"""The look-ahead: host decode loops' passes prepared before the engine asks for them.

A decode loop's next pass depends only on the token its last pass samples, so the host need not
wait for the host. Two depths, one idea:

- depth 1 (`SchedulerPolicy.overlap`): the host prepares batch N+1 while the engine runs N. The
  engine thread runs this loop:

      while batches come:
          helper.start(resolve N-1, then prepare_next of each decode pass of N)
          outcomes = engine.forward(N)            # N+1's passes are prepared meanwhile
          N+1 = those passes, fed N's tokens (ForwardBatch.fed_from), + what else is queued

  A pass prepared ahead runs even when its loop ends at its predecessor (a stop token, stop());
  its output is dropped and a page it took given back. A loop prepares ahead only when that
  pass surely follows and takes the common decode route, and only on a queue with nothing else
  queued. A batch carrying a pass some guest is blocked on is resolved at once and the next one
  held as the adaptive policy holds it. While nothing is queued, held, cancelled or closing, the
  next batch is exactly the passes prepared ahead, sent without taking the scheduler's lock
  (`_chain`).
- depth N (`SchedulerPolicy.chain_steps`, without overlap): when every pass of a batch is a
  decode loop's chained pass (nobody waits on the batch), the engine thread asks each loop for
  the pass after its last step (`chain_step`, its input the token that step sampled) and runs
  those at once, up to chain_steps steps, handing back after any step that ends with work
  queued; each loop then gets the results of all its steps in one resolution (a tuple). Each
  step is counted and charged to its owners' fair shares as soon as it has run.

The scheduler is reached only through `LookaheadHost`.
"""
from __future__ import annotations

import logging
import threading
from itertools import repeat
from operator import attrgetter
from typing import Hashable, Protocol

from engine.batch import ForwardBatch, ForwardResult
from engine.protocol import EngineLike
from host.errors import Cancelled
from host.scheduling.helper_thread import HelperThread
from host.scheduling.items import (Item, check_results, end_pin, forward_after_error, resolve,
                                   run_forward)
from host.scheduling.types import SchedulerPolicy
from host.scheduling.work import PreparedForward

__all__ = ["Lookahead", "LookaheadHost"]

_log = logging.getLogger("host.scheduling.scheduler")

# A batch that ran, to resolve: [(items, outcomes, to_count)], a box the resolving thread
# empties, so that the batch's objects are freed there and not on the engine thread. to_count:
# the batch (of the short path) is still to count in the statistics.
Resolution = list[tuple[list[Item], list, bool]]
# The passes prepared ahead: (the index each follows in the running batch, None when each
# follows the pass at its own index (every pass has one); their items; their requests).
Ahead = tuple[list[int] | None, list[Item], tuple]

_request_of = attrgetter("request")


class LookaheadHost(Protocol):
    """What the look-ahead uses of the scheduler (host/scheduling/scheduler.py). "Under the
    lock": with `lock` held."""

    engine: EngineLike
    lock: threading.RLock

    @property
    def closed(self) -> bool: ...
    def wait_for_batch(self) -> bool: ...                       # under the lock
    def wait_hold(self) -> None: ...                            # under the lock
    def take_queued(self, num_taken: int = 0) -> tuple[list[Item], list[Item]]: ...   # lock
    def set_running(self, running: bool) -> None: ...           # under the lock
    def stopped(self) -> None: ...                              # under the lock
    def run_engine(self, copy_items: list[Item], forward_items: list[Item],
                   fed_from: tuple | None = None) -> list: ...
    def resolve(self, items: list[Item], outcomes: list) -> None: ...
    def run_wakes(self) -> None: ...
    def record_step(self, items: list[Item], failed: bool, charge: bool) -> None: ...
    def admit_ahead(self, items: list[Item]) -> None: ...
    def without_queued(self, items: list[Item]) -> list[Item]: ...
    def has_other_work(self) -> bool: ...
    def has_queued(self) -> bool: ...
    def holding(self) -> bool: ...


class Lookahead:
    """The look-ahead of one scheduler: `run` is the engine thread's loop at depth 1
    (`overlaps`); `chain` runs the further steps of a batch at depth N."""

    def __init__(self, host: LookaheadHost, policy: SchedulerPolicy) -> None:
        self._host = host
        self.overlaps = bool(policy.overlap)
        self._max_tokens = policy.max_batch_tokens
        self._chain_steps = policy.chain_steps or 1
        self._cancelled_owners: set[Hashable] = set()    # since the last batch was formed

    def cancel_owner(self, owner_id: Hashable) -> None:
        """Under the host's lock: drop `owner_id`'s passes prepared ahead, not yet run."""
        if self.overlaps:
            self._cancelled_owners.add(owner_id)

    # ---------------------------------------------------------------- depth N
    def chain(self, forward_items: list[Item], outcomes: list) -> list:
        """`outcomes` of the batch of `forward_items` that just ran, with the outcome of each
        item that took further steps replaced by the tuple of its results, first step first
        (last, the exception of a step that failed it)."""
        if (self._chain_steps <= 1 or not forward_items
                or not all(item.chain_step is not None for item in forward_items)):
            return outcomes
        results = {index: [outcome] for index, outcome in enumerate(outcomes)
                   if isinstance(outcome, ForwardResult)}
        active = list(results)
        for _ in range(self._chain_steps - 1):
            if self._host.has_queued():              # a racing submission waits one step
                break
            step = _next_step(forward_items, active, results)
            if not step:
                break
            step_results = self._run_step(step)
            active = []
            for (index, _), result in zip(step, step_results):
                results[index].append(result)
                if isinstance(result, ForwardResult):       # a failed pass ends its loop
                    active.append(index)
            self._host.record_step([forward_items[index] for index, _ in step],
                                   len(active) < len(step), charge=True)
        return [tuple(results[index]) if len(results.get(index, ())) > 1 else outcome
                for index, outcome in enumerate(outcomes)]

    def _run_step(self, step: list[tuple[int, PreparedForward]]) -> list:
        """A result or an exception per pass of the step; a pass's pin, if it has one, ends
        once it has run."""
        try:
            return run_forward(self._host.engine, [prepared for _, prepared in step])
        finally:
            for _, prepared in step:
                end_pin(prepared.on_done)

    # ---------------------------------------------------------------- depth 1
    def run(self) -> None:
        """The engine thread: run batches until the host closes; then resolve the last and
        drop what was ahead."""
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
                with self._host.lock:
                    self._host.stopped()

    def _may_chain(self) -> bool:
        """Whether the next batch is just the passes prepared ahead (read without the lock: a
        submission racing this check joins the batch after)."""
        return not (self._host.has_other_work() or self._cancelled_owners)

    def _chain(self, helper: HelperThread, ahead: list[Item], fed_from: tuple,
               requests: tuple, unresolved: Resolution
               ) -> tuple[list[Item], tuple, tuple, Resolution]:
        """The short path: while `_may_chain`, each batch is the passes prepared ahead during
        the one before, run as they are while the helper resolves that one and prepares the
        next; a batch is counted in the statistics when it is resolved. Returns as `_run_one`."""
        host, between, cancelled = self._host, self._between, self._cancelled_owners
        forward, helper_result = host.engine.forward, self._helper_result
        has_other_work = host.has_other_work
        while True:               # each line here delays the next batch: kept to the least
            helper.start(between, unresolved, ahead)
            del unresolved
            try:
                outcomes = forward(ForwardBatch(requests, fed_from))
                if len(outcomes) != len(ahead):
                    check_results(outcomes, len(ahead))         # raises
                failed = False
            except Exception as error:                 # noqa: BLE001 -- outcomes
                outcomes = forward_after_error(host.engine, ahead, fed_from, error)
                failed = True
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
            if not ahead or has_other_work() or cancelled:
                return ahead, fed_from, requests, unresolved     # as `_may_chain`

    def _take(self, ahead: list[Item], fed_from: tuple
              ) -> tuple[list[Item], list[Item], tuple | None] | None:
        """The next batch: (copy items, forward items: the passes prepared ahead first, their
        fed_from); None once closed. Waits for work when nothing is ahead, else only for a
        hold."""
        host = self._host
        dropped: list[Item] = []
        with host.lock:
            host.set_running(bool(ahead))
            if ahead:
                host.wait_hold()
            elif not host.wait_for_batch():
                return None                       # closed
            if host.closed:
                return None                       # run() drops what is ahead
            host.set_running(True)
            if self._cancelled_owners and ahead:
                kept = [i for i, item in enumerate(ahead)
                        if item.owner not in self._cancelled_owners]
                dropped = [item for item in ahead if item.owner in self._cancelled_owners]
                ahead, fed_from = [ahead[i] for i in kept], tuple(fed_from[i] for i in kept)
            self._cancelled_owners.clear()
            copy_items, forward_items = host.take_queued(len(ahead))
        self._drop(dropped, "instance terminated: pass prepared ahead not run")
        if not ahead:
            return copy_items, forward_items, None
        if forward_items:
            fed_from += (None,) * len(forward_items)
        return copy_items, ahead + forward_items, fed_from

    def _run_one(self, helper: HelperThread, copy_items: list[Item],
                 forward_items: list[Item], fed_from: tuple | None,
                 unresolved: Resolution) -> tuple[list[Item], tuple, tuple, Resolution]:
        """Run one batch while the helper resolves the last and prepares ahead; returns the
        next batch's passes prepared ahead, the results feeding them, their requests, and this
        batch's resolution if it is still to do."""
        helper.start(self._between, unresolved, forward_items)
        del unresolved
        try:
            outcomes = self._host.run_engine(copy_items, forward_items, fed_from)
        finally:
            ahead = self._helper_result(helper)
        forward_outcomes = outcomes[len(copy_items):] if copy_items else outcomes
        next_ahead, fed, requests = self._fed(ahead, forward_outcomes)
        resolution = [(copy_items + forward_items, outcomes, False)]
        del copy_items, forward_items, outcomes, forward_outcomes, fed_from
        if self._host.holding():                          # a guest waits on this batch
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
        indices = [index for index, item in enumerate(forward_items)
                   if item.prepare_next is not None]
        if not indices:
            return [], [], ()
        free = {id(item) for item in self._host.without_queued(
            [forward_items[index] for index in indices])}
        indices = [index for index in indices if id(forward_items[index]) in free]
        sources: list[int] = []
        items: list[Item] = []
        for index in indices[:self._max_tokens]:
            item = _prepare_one(forward_items[index])
            if item is not None:
                sources.append(index)
                items.append(item)
        self._host.admit_ahead(items)
        identity = len(sources) == len(forward_items)        # each follows its own index
        return (None if identity else sources), items, tuple(map(_request_of, items))

    def _resolve(self, resolution: Resolution) -> None:
        """Resolve the batch in the box, if any (emptying it: its objects are freed here)."""
        if resolution:
            items, outcomes, to_count = resolution.pop()
            if to_count:                      # a batch of the short path: nothing to hold for
                failed = any(map(isinstance, outcomes, repeat(BaseException)))
                self._host.record_step(items, failed, charge=False)
            self._host.resolve(items, outcomes)
            self._host.run_wakes()

    @staticmethod
    def _drop(items: list[Item], reason: str) -> None:
        """End passes prepared ahead that will not run (their loops see the error)."""
        for item in items:
            resolve(item, Cancelled(reason))


def _prepare_one(source: Item) -> Item | None:
    """The item of the pass after `source` (depth 1), or None."""
    try:
        next_pass = source.prepare_next()
    except Exception:
        _log.exception("scheduler: preparing a pass ahead failed")
        return None
    if next_pass is None:
        return None
    prepared, on_outcome = next_pass
    return source.following(prepared.request, prepared.on_done, on_outcome)


def _next_step(forward_items: list[Item], active: list[int], results: dict
               ) -> list[tuple[int, PreparedForward]]:
    """(item index, its next pass prepared) for each active item whose loop goes on (depth N)."""
    step = []
    for index in active:
        try:
            prepared = forward_items[index].chain_step(results[index][-1])
        except Exception:                                   # noqa: BLE001 -- it stops here
            _log.exception("scheduler: preparing a chained step failed")
            prepared = None
        if prepared is not None:
            step.append((index, prepared))
    return step
