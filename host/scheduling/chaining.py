"""Chained steps (SchedulerPolicy.chain_steps): a batch of host decode loops' passes runs several
engine steps before the host resolves it.

Without it, every decode step of a host loop goes back to the host between two forwards: the
pass is resolved (its loop keeps the output, then prepares, pins and queues its next pass as an
item) and the next batch is formed. On a CPU engine that host work sits between the forwards,
on cold caches: ~200 us a step at 8 loops on a 2-vCPU EPYC, ~1.2% of the wall. With chaining,
when every pass of a batch is a host loop's chained pass (no future: nobody waits on the batch),
the engine thread asks each loop for the pass after its last step (`Item.chain_step`:
DecodeLoop.chain_step, its input the token the step sampled) and runs those at once, up to
chain_steps steps in all; each loop then gets the results of all its steps in one resolution
(a tuple for its on_outcome).

A loop goes on only while its next pass surely follows (the loop decides, as it would once the
output is kept: no stop token sampled, below max_tokens and the unread bound, not stopped, the
common decode route taken: its tail page its own alone, no mask, a new page of its quota when
the last is full; and no reader woken by the outputs it has, so a streaming reader still gets
each output as it comes). Each step is prepared like the loop's own next pass (checked, the
loop's position and pages moved on), without a pin of its own: the loop's pass that began the
chain holds its instance's pin until the chain is resolved, so pages released meanwhile return
once the chain is over, as they would behind that pin anyway. The chain hands back after any step
that ends with work queued (a new instance's prompt, a guest's own pass): other work waits at
most one step, as without chaining. A pass of a step the engine fails ends its loop, its outputs
before it kept, as a failed pass does (a RequestError fails the pass it names alone). Each step
is counted in the statistics and charged to its owners' fair shares as soon as it has run.
"""
from __future__ import annotations

import logging
from typing import Any

from engine.batch import ForwardResult
from host.scheduling.engine_calls import end_pin, run_forward
from host.scheduling.items import Item
from host.scheduling.work import PreparedForward

__all__ = ["run_chain"]

_log = logging.getLogger("host.scheduling.scheduler")


def run_chain(scheduler: Any, forward_items: list[Item], outcomes: list) -> list:
    """`outcomes` of the batch of `forward_items` that just ran (one each), with the outcome of
    each item that took further steps replaced by the tuple of its results, first step first
    (last, the exception of a step that failed it). `scheduler`: the BatchScheduler (its
    policy, engine, lock, counts and fair shares)."""
    if not forward_items or not all(item.chain_step is not None for item in forward_items):
        return outcomes
    results = {index: [outcome] for index, outcome in enumerate(outcomes)
               if isinstance(outcome, ForwardResult)}
    active = list(results)
    for _ in range(scheduler.policy.chain_steps - 1):
        if scheduler._num_pending or scheduler._closed:    # read unlocked: a racing submission
            break                                           # waits one step at most
        step = _next_step(forward_items, active, results)
        if not step:
            break
        step_results = _run_step(scheduler, step)
        active = []
        for (index, _), result in zip(step, step_results):
            results[index].append(result)
            if isinstance(result, ForwardResult):           # a failed pass ends its loop
                active.append(index)
        _count_step(scheduler, [forward_items[index] for index, _ in step],
                    len(active) < len(step))
    return [tuple(results[index]) if len(results.get(index, ())) > 1 else outcome
            for index, outcome in enumerate(outcomes)]


def _next_step(forward_items: list[Item], active: list[int], results: dict
               ) -> list[tuple[int, PreparedForward]]:
    """(item index, its next pass prepared) for each active item whose loop goes on."""
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


def _run_step(scheduler: Any, step: list[tuple[int, PreparedForward]]) -> list:
    """A result or an exception per pass of the step (run_forward: a RequestError fails the
    pass it names alone); a pass's pin, if it has one, ends once it has run."""
    try:
        return run_forward(scheduler.engine, [prepared for _, prepared in step])
    finally:
        for _, prepared in step:
            end_pin(prepared.on_done)


def _count_step(scheduler: Any, items: list[Item], failed: bool) -> None:
    """Count a chained step that has run (its items; whether a pass failed) as a batch in the
    statistics and charge its passes' owners, at once: a chain may run for seconds."""
    with scheduler._lock:
        scheduler._counts.record_batch(0, len(items), failed)
        for item in items:
            scheduler._fair.charge(item.owner, 1)
