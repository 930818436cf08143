"""`pie:inferlet/forward`: submit a pass on a queue; the guest holds a forward-future resource.

The future is a host resource (rep local to the instance); the instance keeps its own table of
live futures, since Wasmtime runs no destructor for handles a guest never dropped. `get` blocks
through `Instance.wait_future`, which terminate wakes.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any

from wasmtime.component import Record

from engine.batch import Distribution, ForwardResult
from host.bindings import decoding, generations
from host.bindings.context import BindingContext
from host.bindings.samplers import (lower_distribution, lower_sampled, sampler_fields,
                                    sampler_spec)
from host.errors import TrapError
from host.sandbox.wasm.wit_codec import HostResource

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES", "FORWARD_FUTURE_TYPE", "MAX_DRAFTS",
           "FutureTable", "ForwardFutureEntry", "MAX_LIVE_FUTURES"]

MAX_LIVE_FUTURES = 65536   # per instance


class ForwardFutureEntry:
    """A forward-future resource the guest holds: the scheduler future and its lowered result."""

    __slots__ = ("future", "result")

    def __init__(self, future: Future) -> None:
        self.future = future
        self.result: Any = None


class FutureTable:
    """Forward-future resource reps (never reused, from 1) -> entries. Wasmtime runs no destructor
    for handles a guest never dropped, so the instance keeps its own table and clears it at its end."""

    def __init__(self) -> None:
        self._entries: dict[int, ForwardFutureEntry] = {}
        self._next_rep = 1

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, call: str, future: Future) -> int:
        if len(self._entries) >= MAX_LIVE_FUTURES:
            raise TrapError(f"{call}: {MAX_LIVE_FUTURES} forward-futures alive; drop some first")
        rep = self._next_rep
        self._next_rep += 1
        self._entries[rep] = ForwardFutureEntry(future)
        return rep

    def get(self, call: str, rep: int) -> ForwardFutureEntry:
        entry = self._entries.get(rep)
        if entry is None:
            raise TrapError(f"{call}: unknown forward-future {rep}")
        return entry

    def drop(self, rep: int) -> None:
        self._entries.pop(rep, None)

    def clear(self) -> None:
        self._entries.clear()


INTERFACE = "pie:inferlet/forward@0.1.0"
FORWARD_FUTURE_TYPE = 1
MAX_DRAFTS = 64            # drafted tokens one verify pass may carry


def submit(ctx: BindingContext, queue_id: int, sequence_id: int, token_ids: list[int],
           positions: list[int], last_page_len: int, output_indices: list[int],
           samplers: list[Record], mask: list[list[int]] | None) -> HostResource:
    call = "forward.submit"
    queues, cached_spec = ctx.tables.queues, ctx.tables.samplers.get
    priority = queues.priority_of(queue_id) or queues.priority(call, queue_id)   # this one traps
    specs = [cached_spec(sampler_fields(sampler)) or sampler_spec(ctx, call, index, sampler, None)
             for index, sampler in enumerate(samplers)]
    prepared = ctx.tables.pages.prepare(sequence_id, token_ids, positions, last_page_len,
                                        output_indices, specs, mask)
    return _enqueue(ctx, call, queue_id, priority, prepared)


def submit_with(ctx: BindingContext, queue_id: int, sequence_id: int, token_ids: list[int],
                positions: list[int], last_page_len: int, output_indices: list[int],
                samplers: list[Record], options: list[Record],
                mask: list[list[int]] | None) -> HostResource:
    """submit, each sampler with its sampler-options."""
    call = "forward.submit-with"
    priority = ctx.tables.queues.priority(call, queue_id)
    if len(options) != len(samplers):
        raise TrapError(f"{call}: {len(options)} sampler-options for {len(samplers)} samplers")
    specs = [sampler_spec(ctx, call, index, sampler, option)
             for index, (sampler, option) in enumerate(zip(samplers, options))]
    prepared = ctx.tables.pages.prepare(sequence_id, token_ids, positions, last_page_len,
                                        output_indices, specs, mask)
    return _enqueue(ctx, call, queue_id, priority, prepared)


def submit_verify(ctx: BindingContext, queue_id: int, sequence_id: int, token_ids: list[int],
                  positions: list[int], last_page_len: int, num_drafted: int,
                  sampler: Record, options: Record) -> HostResource:
    """A pass whose last `num_drafted` tokens are drafts, verified by the engine's sampler."""
    call = "forward.submit-verify"
    priority = ctx.tables.queues.priority(call, queue_id)
    if not 0 < num_drafted < len(token_ids) or num_drafted > MAX_DRAFTS:
        raise TrapError(f"{call}: num-drafted {num_drafted} must be in 1..{MAX_DRAFTS} and below "
                        f"the {len(token_ids)} tokens of the pass")
    spec = sampler_spec(ctx, call, 0, sampler, options)
    if spec.kind not in ("greedy", "sample") or spec.num_logprobs is not None:
        raise TrapError(f"{call}: the sampler must be greedy or sample, without logprobs")
    num_outputs = num_drafted + 1
    indices = list(range(len(token_ids) - num_outputs, len(token_ids)))
    prepared = ctx.tables.pages.prepare(sequence_id, token_ids, positions, last_page_len,
                                        indices, [spec] * num_outputs)
    prepared = dataclasses.replace(prepared, request=dataclasses.replace(
        prepared.request, num_drafted=num_drafted))
    return _enqueue(ctx, call, queue_id, priority, prepared)


def _enqueue(ctx: BindingContext, call: str, queue_id: int, priority: str,
             prepared: Any) -> HostResource:
    future = ctx.services.scheduler.submit_forward((ctx.instance_id, queue_id), priority, prepared)
    return HostResource(ctx.tables.futures.add(call, future), FORWARD_FUTURE_TYPE)


def ready(ctx: BindingContext, store: Any, future_rep: int) -> bool:
    return _entry(ctx, future_rep, "forward-future.ready").future.done()


def get(ctx: BindingContext, store: Any, future_rep: int) -> list | str:
    """result<list<output>>: tokens as ints, distributions as records (untagged)."""
    outputs = _outputs(ctx, future_rep, "forward-future.get")
    if isinstance(outputs, str):
        return outputs
    if any(not isinstance(o, (int, Distribution)) for o in outputs):
        return "this pass has outputs only get-sampled returns (log-probs, entropy, verified)"
    return [int(o) if isinstance(o, int) else lower_distribution(o) for o in outputs]


def get_sampled(ctx: BindingContext, store: Any, future_rep: int) -> list | str:
    """result<list<sampled>>: every kind of output (a tagged variant)."""
    outputs = _outputs(ctx, future_rep, "forward-future.get-sampled")
    return outputs if isinstance(outputs, str) else [lower_sampled(o) for o in outputs]


def _outputs(ctx: BindingContext, future_rep: int, call: str) -> tuple | str:
    """The pass's outputs (engine objects), or the err text; waits once, then remembers."""
    entry = _entry(ctx, future_rep, call)
    if entry.result is None:
        try:
            result: ForwardResult = ctx.wait_future(entry.future, call)
        except TrapError:     # terminated (Cancelled) or max_blocking_s passed
            raise
        except Exception as exc:  # noqa: BLE001 -- the engine failed the batch: err, not trap
            entry.result = f"engine failed the batch: {exc}"
        else:
            entry.result = result.outputs
    return entry.result


def drop(ctx: BindingContext, rep: int) -> None:
    ctx.tables.futures.drop(rep)


def _entry(ctx: BindingContext, future_rep: int, call: str) -> ForwardFutureEntry:
    return ctx.tables.futures.get(call, future_rep)


FUNCTIONS = {"submit": submit, "submit-with": submit_with, "submit-verify": submit_verify,
             "submit-decode": decoding.submit_decode, **generations.FUNCTIONS}
METHODS = {"[method]forward-future.ready": ready, "[method]forward-future.get": get,
           "[method]forward-future.get-sampled": get_sampled,
           "[method]decode-stream.next": decoding.next_outputs,
           "[method]decode-stream.next-tokens": decoding.next_token_ids,
           "[method]decode-stream.added-pages": decoding.added_pages,
           "[method]decode-stream.stop": decoding.stop}
RESOURCES = {"forward-future": (FORWARD_FUTURE_TYPE, drop),
             "decode-stream": (decoding.DECODE_STREAM_TYPE, decoding.drop)}
