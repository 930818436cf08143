"""One queued submission's life: its future (`SubmissionFuture`), the scheduler's bookkeeping of it
while it waits (`Item`, possibly split into chunks), the batch being formed (`Taken`), the engine
call that runs a batch's passes (`run_forward`: one bad request fails alone) and its end
(`resolve`: its `on_done` first, so that pages it pinned may be released, then its future).
`Item` and `Taken` are used under the scheduler's lock only."""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, InvalidStateError
from operator import attrgetter
from typing import Callable, Hashable, Sequence

from engine.batch import ForwardBatch, ForwardResult
from engine.chunking import split_request
from engine.errors import RequestError
from engine.protocol import EngineLike
from host.scheduling.types import PRIORITIES

__all__ = ["SubmissionFuture", "Item", "Taken", "owner_of", "rank_of", "run_forward",
           "forward_after_error", "check_results", "resolve", "end_pin"]

_log = logging.getLogger("host.scheduling.scheduler")
_request_of = attrgetter("request")


class SubmissionFuture(Future):
    """The future of one submission, owned by `owner` (the first element of its queue key).

    A consumer about to block on it calls `wait_started()` (`result()` / `exception()` do,
    Instance.wait_future does): if it is not done yet, `awaited` turns True (its owner is
    blocked on it: the adaptive policy expects the owner back after the batch that resolves it)
    and `on_wait(self)` tells the scheduler the owner has blocked (its turn after the last
    batch is over; the adaptive scheduler may run the batch on this very thread)."""

    def __init__(self, owner: Hashable = None,
                 on_wait: Callable[["SubmissionFuture"], None] | None = None) -> None:
        super().__init__()
        self.awaited = False
        self.owner = owner
        self._on_wait = on_wait

    def wait_started(self) -> None:
        if self.done():
            return
        self.awaited = True
        if self._on_wait is not None:
            self._on_wait(self)

    def result(self, timeout: float | None = None):
        self.wait_started()
        return super().result(timeout)

    def exception(self, timeout: float | None = None):
        self.wait_started()
        return super().exception(timeout)



class Item:
    """A queued pass (request) or copies (request None); a chunk has `parent` set and no
    future: its outputs go into the parent's. A chained pass (submit_chained) has no future
    either: `on_outcome` receives its result. `owner`: its queue key's owner (owner_of)."""

    __slots__ = ("queue_key", "owner", "rank", "order", "request", "copies", "future", "on_done",
                 "on_outcome", "num_tokens", "enqueued_at", "parent", "output_slots", "outputs",
                 "prepare_next", "chain_step")

    def __init__(self, queue_key: Hashable, rank: int, order: int, request, copies, on_done,
                 on_wait: Callable[[SubmissionFuture], None] | None) -> None:
        self.queue_key = queue_key
        self.owner = owner_of(queue_key)
        self.rank = rank
        self.order = order
        self.request = request                 # ForwardRequest, or None for a copy item
        self.copies = copies
        self.future = SubmissionFuture(self.owner, on_wait) if on_wait else None
        self.on_done = on_done
        self.on_outcome: Callable[[object], None] | None = None   # a chained pass: no future
        self.num_tokens = len(request.token_ids) if request is not None else 0
        self.enqueued_at = time.monotonic()
        self.parent: Item | None = None       # a chunk: the item whose pass it runs part of
        self.output_slots: list[int] = []      # a chunked pass: where its outputs go ...
        self.outputs: list | None = None       # ... in the whole pass's outputs
        # the look-ahead at depth 1 (lookahead.py): prepares the pass after this one while it runs
        self.prepare_next: Callable[[], object] | None = None
        # ... at depth N: the one-token pass after this one's
        self.chain_step: Callable[[object], object] | None = None

    def following(self, request, on_done: Callable[[], None] | None,
                  on_outcome: Callable[[object], None]) -> "Item":
        """The item of a one-token pass prepared ahead of this one on its queue (lookahead.py):
        no future, no copies; its order is set when it is charged."""
        item = Item.__new__(Item)
        item.queue_key, item.owner, item.rank, item.order = (self.queue_key, self.owner,
                                                              self.rank, 0)
        item.request, item.copies, item.future, item.on_done = request, (), None, on_done
        item.on_outcome, item.num_tokens, item.enqueued_at = on_outcome, 1, self.enqueued_at
        item.parent, item.output_slots, item.outputs = None, [], None
        item.prepare_next, item.chain_step = self.prepare_next, None
        return item

    def split(self, num_first: int, page_size: int) -> "Item":
        """Run the first `num_first` tokens as a chunk (returned); this item keeps the rest."""
        if self.outputs is None:
            self.outputs = [None] * len(self.request.output_indices)
            self.output_slots = list(range(len(self.request.output_indices)))
        first, rest, first_outputs, rest_outputs = split_request(self.request, num_first,
                                                                 page_size)
        chunk = Item(self.queue_key, self.rank, self.order, first, self.copies, None, None)
        chunk.parent = self
        chunk.output_slots = [self.output_slots[k] for k in first_outputs]
        self.output_slots = [self.output_slots[k] for k in rest_outputs]
        self.request, self.copies, self.num_tokens = rest, (), len(rest.token_ids)
        return chunk

    def merged(self, result: ForwardResult, slots: list[int] | None = None) -> ForwardResult:
        """Put a part's outputs in their `slots` (default: this item's, for its last part) of
        the whole pass's outputs; returns the whole pass's result so far."""
        if self.outputs is None:
            return result
        for slot, output in zip(self.output_slots if slots is None else slots, result.outputs):
            self.outputs[slot] = output
        return ForwardResult(tuple(self.outputs))


class Taken:
    """What one batch being formed holds: tokens in all, per owner; whether it is full."""

    def __init__(self, max_tokens: int, contended: bool) -> None:
        self.max_tokens = max_tokens
        self.contended = contended           # more than one owner has work
        self.num_tokens = 0
        self.full = False
        self._per_owner: dict[Hashable, int] = {}

    def room(self, owner: Hashable, max_per_owner: int) -> tuple[int, int]:
        """(tokens left in the batch, tokens `owner` may still add: its own cap counts only
        when others have work)."""
        batch_room = self.max_tokens - self.num_tokens
        if not self.contended:
            return batch_room, batch_room
        return batch_room, min(batch_room, max_per_owner - self._per_owner.get(owner, 0))

    def add(self, owner: Hashable, num_tokens: int) -> None:
        self.num_tokens += num_tokens
        self._per_owner[owner] = self._per_owner.get(owner, 0) + num_tokens


def owner_of(queue_key: Hashable) -> Hashable:
    """The owner (instance id) of a queue key (instance id, local queue id)."""
    return queue_key[0] if isinstance(queue_key, tuple) and queue_key else queue_key


def rank_of(priority: str) -> int:
    """A priority's rank (0 goes first). ValueError for a priority not in PRIORITIES."""
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
    return PRIORITIES.index(priority)


def run_forward(engine: EngineLike, items: Sequence[Item],
                fed_from: Sequence[ForwardResult | None] | None = None) -> list:
    """Run the passes: a result or an exception per item. A RequestError (the engine validates
    before it computes) fails the pass it names alone and the others run again without it; any
    other exception fails them all. `fed_from`: per item, None or the result whose token is its
    input (ForwardBatch.fed_from)."""
    try:                                               # the common case: all run at once
        return _forward(engine, items, fed_from)
    except Exception as error:                         # noqa: BLE001 -- an outcome
        return forward_after_error(engine, items, fed_from, error)


def forward_after_error(engine: EngineLike, items: Sequence[Item],
                        fed_from: Sequence[ForwardResult | None] | None,
                        error: Exception) -> list:
    """run_forward's outcomes once the engine raised `error` for all of `items`."""
    outcomes: dict[int, object] = {}
    remaining = list(range(len(items)))
    while isinstance(error, RequestError) and 0 <= error.request_index < len(remaining):
        outcomes[remaining.pop(error.request_index)] = error
        if not remaining:
            break
        try:
            results = _forward(engine, [items[i] for i in remaining],
                               None if fed_from is None else [fed_from[i] for i in remaining])
        except Exception as next_error:                # noqa: BLE001 -- an outcome
            error = next_error
            continue
        outcomes.update(zip(remaining, results))
        remaining = []
    outcomes.update((i, error) for i in remaining)
    return [outcomes[i] for i in range(len(items))]


def _forward(engine: EngineLike, items: Sequence[Item],
             fed_from: Sequence[ForwardResult | None] | None) -> list:
    """One engine call for `items`' passes: a result each (RuntimeError if the count differs)."""
    batch = ForwardBatch(tuple(map(_request_of, items)),
                         None if fed_from is None else tuple(fed_from))
    return check_results(engine.forward(batch), len(items))


def check_results(results: Sequence[ForwardResult], num_requests: int) -> list:
    """The engine's results as a list (RuntimeError if there is not one per request)."""
    if len(results) != num_requests:
        raise RuntimeError(f"engine returned {len(results)} results for {num_requests} requests")
    return results if isinstance(results, list) else list(results)


def end_pin(on_done: Callable[[], None] | None) -> None:
    """Call a pass's `on_done` (None: nothing); a failure is logged, never raised out."""
    if on_done is not None:
        try:
            on_done()
        except Exception:
            _log.exception("scheduler: on_done callback failed")


def resolve(item: Item, outcome: object) -> None:
    """End a whole item: `on_done` (never raises out), then the future's result or exception
    (a chained pass: its `on_outcome`)."""
    end_pin(item.on_done)
    if item.future is None:
        if item.on_outcome is not None:
            try:
                item.on_outcome(outcome)
            except Exception:
                _log.exception("scheduler: on_outcome callback failed")
        return
    try:
        if isinstance(outcome, BaseException):
            item.future.set_exception(outcome)
        else:
            item.future.set_result(outcome)
    except InvalidStateError:                  # the waiter cancelled it
        pass
