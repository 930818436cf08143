"""`pie:inferlet/forward`: submit a pass on a queue; the guest holds a forward-future resource.

The future is a host resource (rep local to the instance); the instance keeps its own table of
live futures, since Wasmtime runs no destructor for handles a guest never dropped. `get` blocks
through `Instance.wait_future`, which terminate wakes.
"""
from __future__ import annotations

from typing import Any

from wasmtime.component import Record, ResourceHost

from engine.batch import Distribution, ForwardResult, SamplerSpec
from host.bindings.queue import queue_priority
from host.errors import TrapError
from host.instance import ForwardFutureEntry

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES", "FORWARD_FUTURE_TYPE",
           "MAX_LIVE_FUTURES"]

INTERFACE = "pie:inferlet/forward@0.1.0"
FORWARD_FUTURE_TYPE = 1
MAX_LIVE_FUTURES = 65536   # per instance


def submit(instance: Any, queue_id: int, sequence_id: int, token_ids: list[int],
           positions: list[int], last_page_len: int, output_indices: list[int],
           samplers: list[Record], mask: list[list[int]] | None) -> ResourceHost:
    call = "forward.submit"
    priority = queue_priority(instance, call, queue_id)
    if len(instance.futures) >= MAX_LIVE_FUTURES:
        raise TrapError(f"{call}: {MAX_LIVE_FUTURES} forward-futures alive; drop some first")
    specs = [_sampler_spec(call, index, sampler) for index, sampler in enumerate(samplers)]
    prepared = instance.resources.prepare_forward(sequence_id, token_ids, positions,
                                                  last_page_len, output_indices, specs, mask)
    future = instance.services.scheduler.submit_forward((instance.instance_id, queue_id),
                                                        priority, prepared)
    rep = instance.next_future_rep
    instance.next_future_rep += 1
    instance.futures[rep] = ForwardFutureEntry(future)
    return ResourceHost.own(rep, FORWARD_FUTURE_TYPE)


def ready(instance: Any, store: Any, handle: Any) -> bool:
    return _entry(instance, store, handle, "forward-future.ready").future.done()


def get(instance: Any, store: Any, handle: Any) -> list | str:
    call = "forward-future.get"
    entry = _entry(instance, store, handle, call)
    if entry.result is None:
        try:
            result: ForwardResult = instance.wait_future(entry.future, call)
        except TrapError:     # terminated (Cancelled) or max_blocking_s passed
            raise
        except Exception as exc:  # noqa: BLE001 -- the engine failed the batch: err, not trap
            entry.result = f"engine failed the batch: {exc}"
        else:
            entry.result = [_lower_output(output) for output in result.outputs]
    return entry.result


def drop(instance: Any, rep: int) -> None:
    instance.futures.pop(rep, None)


def _entry(instance: Any, store: Any, handle: Any, call: str) -> ForwardFutureEntry:
    rep = handle.to_host(store).rep
    entry = instance.futures.get(rep)
    if entry is None:
        raise TrapError(f"{call}: unknown forward-future {rep}")
    return entry


def _sampler_spec(call: str, index: int, sampler: Record) -> SamplerSpec:
    try:
        return SamplerSpec(kind=sampler.kind, temperature=sampler.temperature,
                           top_k=getattr(sampler, "top-k"), top_p=getattr(sampler, "top-p"),
                           min_p=getattr(sampler, "min-p"), seed=sampler.seed,
                           num_top=getattr(sampler, "num-top"))
    except ValueError as exc:
        raise TrapError(f"{call}: sampler {index}: {exc}") from None


def _lower_output(output: int | Distribution) -> int | Record:
    """variant output: a token is lowered as int, a distribution as a Record (untagged)."""
    if isinstance(output, Distribution):
        record = Record()
        setattr(record, "token-ids", list(output.token_ids))
        record.probs = list(output.probs)
        return record
    return int(output)


FUNCTIONS = {"submit": submit}
METHODS = {"[method]forward-future.ready": ready, "[method]forward-future.get": get}
RESOURCES = {"forward-future": (FORWARD_FUTURE_TYPE, drop)}
