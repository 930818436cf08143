"""`pie:inferlet/forward`: submit a pass on a queue; the guest holds a forward-future resource.

The future is a host resource (rep local to the instance); the instance keeps its own table of
live futures, since Wasmtime runs no destructor for handles a guest never dropped. `get` blocks
through `Instance.wait_future`, which terminate wakes.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from wasmtime.component import Record, ResourceHost, Variant

from engine.batch import Distribution, ForwardResult, SamplerSpec, TokenLogprobs, Verified
from host.bindings import generations
from host.bindings.queue import queue_priority
from host.errors import TrapError
from host.instance import ForwardFutureEntry

__all__ = ["INTERFACE", "FUNCTIONS", "METHODS", "RESOURCES", "FORWARD_FUTURE_TYPE",
           "MAX_LIVE_FUTURES"]

INTERFACE = "pie:inferlet/forward@0.1.0"
FORWARD_FUTURE_TYPE = 1
MAX_LIVE_FUTURES = 65536   # per instance
MAX_DRAFTS = 64            # drafted tokens one verify pass may carry


def submit(instance: Any, queue_id: int, sequence_id: int, token_ids: list[int],
           positions: list[int], last_page_len: int, output_indices: list[int],
           samplers: list[Record], mask: list[list[int]] | None) -> ResourceHost:
    call = "forward.submit"
    priority = queue_priority(instance, call, queue_id)
    if len(instance.futures) >= MAX_LIVE_FUTURES:
        raise TrapError(f"{call}: {MAX_LIVE_FUTURES} forward-futures alive; drop some first")
    specs = [_sampler_spec(instance, call, index, sampler, None)
             for index, sampler in enumerate(samplers)]
    prepared = instance.resources.prepare_forward(sequence_id, token_ids, positions,
                                                  last_page_len, output_indices, specs, mask)
    return _enqueue(instance, queue_id, priority, prepared)


def submit_with(instance: Any, queue_id: int, sequence_id: int, token_ids: list[int],
                positions: list[int], last_page_len: int, output_indices: list[int],
                samplers: list[Record], options: list[Record],
                mask: list[list[int]] | None) -> ResourceHost:
    """submit, each sampler with its sampler-options."""
    call = "forward.submit-with"
    priority = queue_priority(instance, call, queue_id)
    if len(instance.futures) >= MAX_LIVE_FUTURES:
        raise TrapError(f"{call}: {MAX_LIVE_FUTURES} forward-futures alive; drop some first")
    if len(options) != len(samplers):
        raise TrapError(f"{call}: {len(options)} sampler-options for {len(samplers)} samplers")
    specs = [_sampler_spec(instance, call, index, sampler, option)
             for index, (sampler, option) in enumerate(zip(samplers, options))]
    prepared = instance.resources.prepare_forward(sequence_id, token_ids, positions,
                                                  last_page_len, output_indices, specs, mask)
    return _enqueue(instance, queue_id, priority, prepared)


def submit_verify(instance: Any, queue_id: int, sequence_id: int, token_ids: list[int],
                  positions: list[int], last_page_len: int, num_drafted: int,
                  sampler: Record, options: Record) -> ResourceHost:
    """A pass whose last `num_drafted` tokens are drafts, verified by the engine's sampler."""
    call = "forward.submit-verify"
    priority = queue_priority(instance, call, queue_id)
    if len(instance.futures) >= MAX_LIVE_FUTURES:
        raise TrapError(f"{call}: {MAX_LIVE_FUTURES} forward-futures alive; drop some first")
    if not 0 < num_drafted < len(token_ids) or num_drafted > MAX_DRAFTS:
        raise TrapError(f"{call}: num-drafted {num_drafted} must be in 1..{MAX_DRAFTS} and below "
                        f"the {len(token_ids)} tokens of the pass")
    spec = _sampler_spec(instance, call, 0, sampler, options)
    if spec.kind not in ("greedy", "sample") or spec.num_logprobs is not None:
        raise TrapError(f"{call}: the sampler must be greedy or sample, without logprobs")
    num_outputs = num_drafted + 1
    indices = list(range(len(token_ids) - num_outputs, len(token_ids)))
    prepared = instance.resources.prepare_forward(sequence_id, token_ids, positions,
                                                  last_page_len, indices, [spec] * num_outputs,
                                                  None)
    prepared = dataclasses.replace(prepared, request=dataclasses.replace(
        prepared.request, num_drafted=num_drafted))
    return _enqueue(instance, queue_id, priority, prepared)


def _enqueue(instance: Any, queue_id: int, priority: str, prepared: Any) -> ResourceHost:
    future = instance.services.scheduler.submit_forward((instance.instance_id, queue_id),
                                                        priority, prepared)
    rep = instance.next_future_rep
    instance.next_future_rep += 1
    instance.futures[rep] = ForwardFutureEntry(future)
    return ResourceHost.own(rep, FORWARD_FUTURE_TYPE)


def ready(instance: Any, store: Any, handle: Any) -> bool:
    return _entry(instance, store, handle, "forward-future.ready").future.done()


def get(instance: Any, store: Any, handle: Any) -> list | str:
    """result<list<output>>: tokens as ints, distributions as records (untagged)."""
    outputs = _outputs(instance, store, handle, "forward-future.get")
    if isinstance(outputs, str):
        return outputs
    if any(not isinstance(o, (int, Distribution)) for o in outputs):
        return "this pass has outputs only get-sampled returns (log-probs, entropy, verified)"
    return [int(o) if isinstance(o, int) else _distribution(o) for o in outputs]


def get_sampled(instance: Any, store: Any, handle: Any) -> list | str:
    """result<list<sampled>>: every kind of output (a tagged variant)."""
    outputs = _outputs(instance, store, handle, "forward-future.get-sampled")
    return outputs if isinstance(outputs, str) else [_lower_sampled(o) for o in outputs]


def _outputs(instance: Any, store: Any, handle: Any, call: str) -> tuple | str:
    """The pass's outputs (engine objects), or the err text; waits once, then remembers."""
    entry = _entry(instance, store, handle, call)
    if entry.result is None:
        try:
            result: ForwardResult = instance.wait_future(entry.future, call)
        except TrapError:     # terminated (Cancelled) or max_blocking_s passed
            raise
        except Exception as exc:  # noqa: BLE001 -- the engine failed the batch: err, not trap
            entry.result = f"engine failed the batch: {exc}"
        else:
            entry.result = result.outputs
    return entry.result


def drop(instance: Any, rep: int) -> None:
    instance.futures.pop(rep, None)


def _entry(instance: Any, store: Any, handle: Any, call: str) -> ForwardFutureEntry:
    rep = handle.to_host(store).rep
    entry = instance.futures.get(rep)
    if entry is None:
        raise TrapError(f"{call}: unknown forward-future {rep}")
    return entry


def _sampler_spec(instance: Any, call: str, index: int, sampler: Record,
                  options: Record | None) -> SamplerSpec:
    """The engine's SamplerSpec of a WIT sampler (+ options); traps naming the sampler."""
    try:
        base = SamplerSpec(kind=sampler.kind, temperature=sampler.temperature,
                           top_k=getattr(sampler, "top-k"), top_p=getattr(sampler, "top-p"),
                           min_p=getattr(sampler, "min-p"), seed=sampler.seed,
                           num_top=getattr(sampler, "num-top"))
        return base if options is None else _with_options(instance, call, index, base, options)
    except ValueError as exc:
        raise TrapError(f"{call}: sampler {index}: {exc}") from None


def _with_options(instance: Any, call: str, index: int, base: SamplerSpec,
                  options: Record) -> SamplerSpec:
    vocab_size = instance.services.engine.model_config.vocab_size
    logit_bias = getattr(options, "logit-bias")
    allowed = getattr(options, "allowed-token-ids")
    for field, token_ids in (("logit-bias", [t for t, _ in logit_bias]), ("allowed-token-ids",
                                                                          allowed or [])):
        if len(token_ids) > vocab_size or any(t >= vocab_size for t in token_ids):
            raise TrapError(f"{call}: sampler {index}: {field}: at most {vocab_size} token ids, "
                            f"each below {vocab_size}")
    state = None
    if options.generation is not None:
        state = generations.generations_of(instance).get(call, options.generation)
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
