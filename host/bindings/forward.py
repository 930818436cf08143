"""`pie:inferlet/forward`: submit a pass on a queue; the guest holds a forward-future resource.

The future is a host resource (rep local to the instance); the instance keeps its own table of
live futures, since Wasmtime runs no destructor for handles a guest never dropped. `get` blocks
through `Instance.wait_future`, which terminate wakes.
"""
from __future__ import annotations

from typing import Any

from wasmtime.component import Record, ResourceHost

from engine.batch import Distribution, ForwardResult, SamplerSpec, sampler_problem
from host.bindings.context import BindingContext
from host.errors import TrapError
from host.sandbox.tables import ForwardFutureEntry

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES", "FORWARD_FUTURE_TYPE"]

INTERFACE = "pie:inferlet/forward@0.1.0"
FORWARD_FUTURE_TYPE = 1


def submit(ctx: BindingContext, queue_id: int, sequence_id: int, token_ids: list[int],
           positions: list[int], last_page_len: int, output_indices: list[int],
           samplers: list[Record], mask: list[list[int]] | None) -> ResourceHost:
    call = "forward.submit"
    priority = ctx.tables.queues.priority(call, queue_id)
    vocab_size = ctx.services.model_info.vocab_size
    specs = [_sampler_spec(call, index, sampler, vocab_size)
             for index, sampler in enumerate(samplers)]
    prepared = ctx.tables.pages.prepare_forward(sequence_id, token_ids, positions,
                                                  last_page_len, output_indices, specs, mask)
    future = ctx.services.scheduler.submit_forward((ctx.instance_id, queue_id),
                                                        priority, prepared)
    rep = ctx.tables.futures.add(call, future)
    return ResourceHost.own(rep, FORWARD_FUTURE_TYPE)


def ready(ctx: BindingContext, store: Any, handle: Any) -> bool:
    return _entry(ctx, store, handle, "forward-future.ready").future.done()


def get(ctx: BindingContext, store: Any, handle: Any) -> list | str:
    call = "forward-future.get"
    entry = _entry(ctx, store, handle, call)
    if entry.result is None:
        try:
            result: ForwardResult = ctx.wait_future(entry.future, call)
        except TrapError:     # terminated (Cancelled) or max_blocking_s passed
            raise
        except Exception as exc:  # noqa: BLE001 -- the engine failed the batch: err, not trap
            entry.result = f"engine failed the batch: {exc}"
        else:
            entry.result = [_lower_output(output) for output in result.outputs]
    return entry.result


def drop(ctx: BindingContext, rep: int) -> None:
    ctx.tables.futures.drop(rep)


def _entry(ctx: BindingContext, store: Any, handle: Any, call: str) -> ForwardFutureEntry:
    return ctx.tables.futures.get(call, handle.to_host(store).rep)


def _sampler_spec(call: str, index: int, sampler: Record, vocab_size: int) -> SamplerSpec:
    """The guest's sampler record as a SamplerSpec; any NaN / inf / out-of-range field traps the
    calling instance here, before the pass can reach a batch shared with other instances."""
    try:
        spec = SamplerSpec(kind=sampler.kind, temperature=sampler.temperature,
                           top_k=getattr(sampler, "top-k"), top_p=getattr(sampler, "top-p"),
                           min_p=getattr(sampler, "min-p"), seed=sampler.seed,
                           num_top=getattr(sampler, "num-top"))
    except ValueError as exc:
        raise TrapError(f"{call}: sampler {index}: {exc}") from None
    problem = sampler_problem(spec, vocab_size)
    if problem is not None:
        raise TrapError(f"{call}: sampler {index}: {problem}")
    return spec


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
