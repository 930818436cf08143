"""The scheduler's calls into the engine and the end of each item, apart from its queueing.

`run_forward` runs a batch's passes so that one bad request fails alone; `resolve` ends an item:
its `on_done` first (pages it pinned may be released), then its future.
"""
from __future__ import annotations

import logging
from concurrent.futures import InvalidStateError
from operator import attrgetter
from typing import Callable, Sequence

from engine.batch import ForwardBatch, ForwardResult
from engine.errors import RequestError
from engine.protocol import EngineLike
from host.scheduling.items import Item

__all__ = ["run_forward", "forward_after_error", "check_results", "resolve", "end_pin"]

_log = logging.getLogger("host.scheduling.scheduler")
_request_of = attrgetter("request")


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
