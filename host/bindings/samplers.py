"""The WIT sampler records as the engine's SamplerSpec (checked where they enter), and the
engine's outputs lowered to the WIT `distribution` / `sampled` values; shared by
`forward.submit*` (forward.py) and `forward.submit-decode` (decoding.py)."""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

from wasmtime.component import Record, Variant

from engine.batch import Distribution, SamplerSpec, TokenLogprobs, Verified, sampler_problem
from host.bindings.context import BindingContext
from host.errors import TrapError

__all__ = ["sampler_spec", "sampler_fields", "lower_distribution", "lower_sampled",
           "SamplerCache", "MAX_CACHED_SAMPLERS"]

MAX_CACHED_SAMPLERS = 64   # per instance: checked sampler records kept (emptied when full)

# sampler_fields(record): the fields of a WIT sampler record that make its SamplerSpec, as a
# tuple (the SamplerCache's key); a C call
sampler_fields = operator.attrgetter("kind", "temperature", "top-k", "top-p", "min-p", "seed",
                                     "num-top")


class SamplerCache:
    """The fields of a sampler record already checked -> its SamplerSpec. Bounded: emptied when
    it holds MAX_CACHED_SAMPLERS (a guest cycling through many samplers only re-checks them).
    `get(fields)`: the spec, or None when not checked yet (the dict's own get: a C call, so a
    binding may look a record up before it calls `sampler_spec`)."""

    def __init__(self) -> None:
        self._specs: dict[tuple, Any] = {}
        self.get: Callable[[tuple], Any] = self._specs.get     # the dict is never replaced

    def put(self, fields: tuple, spec: Any) -> None:
        if len(self._specs) >= MAX_CACHED_SAMPLERS:
            self._specs.clear()
        self._specs[fields] = spec



def sampler_spec(ctx: BindingContext, call: str, index: int, sampler: Record,
          options: Record | None) -> SamplerSpec:
    """The engine's SamplerSpec of a WIT sampler and its options; traps naming the sampler.
    A sampler record seen before (same fields) is not checked again (the instance's cache)."""
    fields = sampler_fields(sampler)
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
    logit_bias = getattr(options, "logit-bias")
    allowed = getattr(options, "allowed-token-ids")
    if (not logit_bias and allowed is None and options.generation is None
            and options.logprobs is None
            and getattr(options, "presence-penalty") == base.presence_penalty
            and getattr(options, "frequency-penalty") == base.frequency_penalty
            and getattr(options, "repetition-penalty") == base.repetition_penalty):
        return base           # options that change nothing (a NaN penalty is checked below)
    vocab_size = ctx.services.model_info.vocab_size
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


def lower_distribution(output: Distribution) -> Record:
    record = Record()
    setattr(record, "token-ids", list(output.token_ids))
    record.probs = list(output.probs)
    return record


def lower_sampled(output: Any) -> Variant:
    """variant sampled (tagged: two of its cases are records)."""
    if isinstance(output, Distribution):
        return Variant("distribution", lower_distribution(output))
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
