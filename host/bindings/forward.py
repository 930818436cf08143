"""`pie:inferlet/forward`: submit a pass on a queue; the guest holds a forward-future resource.

The future is a host resource (rep local to the instance); the instance keeps its own table of
live futures, since Wasmtime runs no destructor for handles a guest never dropped. `get` blocks
through `Instance.wait_future`, which terminate wakes.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from wasmtime.component import Record, Variant

from engine.batch import (Distribution, ForwardResult, SamplerSpec, TokenLogprobs, Verified,
                          sampler_problem)
from host.bindings import generations
from host.bindings.context import BindingContext
from host.errors import TrapError
from host.sandbox.tables import ForwardFutureEntry
from host.sandbox.wit_codec import HostResource

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES", "FORWARD_FUTURE_TYPE", "MAX_DRAFTS"]

INTERFACE = "pie:inferlet/forward@0.1.0"
FORWARD_FUTURE_TYPE = 1
MAX_DRAFTS = 64            # drafted tokens one verify pass may carry


def submit(ctx: BindingContext, queue_id: int, sequence_id: int, token_ids: list[int],
           positions: list[int], last_page_len: int, output_indices: list[int],
           samplers: list[Record], mask: list[list[int]] | None) -> HostResource:
    call = "forward.submit"
    priority = ctx.tables.queues.priority(call, queue_id)
    specs = [_spec(ctx, call, index, sampler, None)
             for index, sampler in enumerate(samplers)]
    prepared = ctx.tables.pages.prepare_forward(sequence_id, token_ids, positions,
                                                  last_page_len, output_indices, specs, mask)
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
    specs = [_spec(ctx, call, index, sampler, option)
             for index, (sampler, option) in enumerate(zip(samplers, options))]
    prepared = ctx.tables.pages.prepare_forward(sequence_id, token_ids, positions,
                                                  last_page_len, output_indices, specs, mask)
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
    spec = _spec(ctx, call, 0, sampler, options)
    if spec.kind not in ("greedy", "sample") or spec.num_logprobs is not None:
        raise TrapError(f"{call}: the sampler must be greedy or sample, without logprobs")
    num_outputs = num_drafted + 1
    indices = list(range(len(token_ids) - num_outputs, len(token_ids)))
    prepared = ctx.tables.pages.prepare_forward(sequence_id, token_ids, positions,
                                                  last_page_len, indices, [spec] * num_outputs,
                                                  None)
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
    return [int(o) if isinstance(o, int) else _distribution(o) for o in outputs]


def get_sampled(ctx: BindingContext, store: Any, future_rep: int) -> list | str:
    """result<list<sampled>>: every kind of output (a tagged variant)."""
    outputs = _outputs(ctx, future_rep, "forward-future.get-sampled")
    return outputs if isinstance(outputs, str) else [_lower_sampled(o) for o in outputs]


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


def _spec(ctx: BindingContext, call: str, index: int, sampler: Record,
          options: Record | None) -> SamplerSpec:
    """The engine's SamplerSpec of a WIT sampler and its options; traps naming the sampler.
    A sampler record seen before (same fields) is not checked again (the instance's cache)."""
    fields = (sampler.kind, sampler.temperature, getattr(sampler, "top-k"),
              getattr(sampler, "top-p"), getattr(sampler, "min-p"), sampler.seed,
              getattr(sampler, "num-top"))
    base = ctx.tables.samplers.get(fields)
    if base is None:
        base = _sampler_spec(call, index, sampler, ctx.services.model_info.vocab_size)
        ctx.tables.samplers.put(fields, base)
    try:
        return base if options is None else _with_options(ctx, call, index, base, options)
    except ValueError as exc:
        raise TrapError(f"{call}: sampler {index}: {exc}") from None


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


def _with_options(ctx: BindingContext, call: str, index: int, base: SamplerSpec,
                  options: Record) -> SamplerSpec:
    vocab_size = ctx.services.model_info.vocab_size
    logit_bias = getattr(options, "logit-bias")
    allowed = getattr(options, "allowed-token-ids")
    for field, token_ids in (("logit-bias", [t for t, _ in logit_bias]), ("allowed-token-ids",
                                                                          allowed or [])):
        if len(token_ids) > vocab_size or any(t >= vocab_size for t in token_ids):
            raise TrapError(f"{call}: sampler {index}: {field}: at most {vocab_size} token ids, "
                            f"each below {vocab_size}")
    state = None
    if options.generation is not None:
        state = ctx.tables.generations.get(call, options.generation)
    return dataclasses.replace(
        base, logit_bias=tuple((int(t), float(b)) for t, b in logit_bias),
        allowed_token_ids=None if allowed is None else tuple(allowed),
        presence_penalty=getattr(options, "presence-penalty"),
        frequency_penalty=getattr(options, "frequency-penalty"),
        repetition_penalty=getattr(options, "repetition-penalty"),
        num_logprobs=options.logprobs, state=state)


def _distribution(output: Distribution) -> Record:
    record = Record()
    setattr(record, "token-ids", list(output.token_ids))
    record.probs = list(output.probs)
    return record


def _lower_sampled(output: Any) -> Variant:
    """variant sampled (tagged: two of its cases are records)."""
    if isinstance(output, Distribution):
        return Variant("distribution", _distribution(output))
    if isinstance(output, TokenLogprobs):
        record = Record()
        setattr(record, "token-id", output.token_id)
        record.logprob = output.logprob
        setattr(record, "top-token-ids", list(output.top_token_ids))
        setattr(record, "top-logprobs", list(output.top_logprobs))
        return Variant("token-logprobs", record)
    if isinstance(output, Verified):
        return Variant("verified", list(output.token_ids))
    if isinstance(output, float):
        return Variant("entropy", output)
    return Variant("token", int(output))


FUNCTIONS = {"submit": submit, "submit-with": submit_with, "submit-verify": submit_verify,
             **generations.FUNCTIONS}
METHODS = {"[method]forward-future.ready": ready, "[method]forward-future.get": get,
           "[method]forward-future.get-sampled": get_sampled}
RESOURCES = {"forward-future": (FORWARD_FUTURE_TYPE, drop)}
