"""Check a ForwardBatch against the engine's geometry before anything runs.

Every error is a RequestError (a ValueError) carrying the request index and the field, so the host can fail that
batch's requests with a clear message; nothing is written to the KV pool for a rejected batch.
(Mask rows are checked while the page table decodes them, with the same kind of message.)
"""
from __future__ import annotations

from typing import Container

from engine.batch import ForwardBatch, ForwardRequest, SamplerSpec, sampler_problem
from engine.errors import RequestError
from engine.paging import kv_len

__all__ = ["validate_batch", "validate_request"]


def _fail(index: int, field: str, reason: str) -> RequestError:
    return RequestError(index, field, reason)


def _check_ints(index: int, field: str, values: tuple, low: int, high: int, what: str) -> None:
    """All values are ints in [low, high)."""
    if not values:
        return
    if not all(isinstance(v, int) for v in values):
        raise _fail(index, field, f"{what} must be integers")
    smallest, largest = min(values), max(values)
    if smallest < low or largest >= high:
        bad = smallest if smallest < low else largest
        raise _fail(index, field, f"{what} {bad} out of range [{low}, {high})")


def validate_request(index: int, request: ForwardRequest, *, page_size: int, num_pages: int,
                     vocab_size: int, max_position: int, adapters: Container[str] = ()) -> None:
    """Raise RequestError (naming `index` and the field) if the request does not fit the engine.
    `adapters`: the adapter names a request may name."""
    if not isinstance(request, ForwardRequest):
        raise _fail(index, "request", f"a {type(request).__name__}, not a ForwardRequest")
    if request.adapter is not None and (not isinstance(request.adapter, str)
                                        or request.adapter not in adapters):
        raise _fail(index, "adapter", f"{str(request.adapter)[:80]!r} is not a registered "
                    f"adapter")
    num_tokens = len(request.token_ids)
    if num_tokens == 0:
        raise _fail(index, "token_ids", "empty: a forward pass needs at least one token")
    _check_ints(index, "token_ids", request.token_ids, 0, vocab_size, "token id")
    if len(request.positions) != num_tokens:
        raise _fail(index, "positions", f"{len(request.positions)} positions for {num_tokens} tokens")
    _check_ints(index, "positions", request.positions, 0, max_position, "position")
    if not request.page_ids:
        raise _fail(index, "page_ids", "empty: the new tokens need at least one page")
    _check_ints(index, "page_ids", request.page_ids, 0, num_pages, "page id")
    if not isinstance(request.last_page_len, int) or not 1 <= request.last_page_len <= page_size:
        raise _fail(index, "last_page_len",
                    f"{request.last_page_len} not in [1, page_size={page_size}]")
    num_slots = kv_len(len(request.page_ids), request.last_page_len, page_size)
    if num_tokens > num_slots:
        raise _fail(index, "page_ids", f"{len(request.page_ids)} pages with last_page_len "
                    f"{request.last_page_len} hold {num_slots} tokens, fewer than the {num_tokens} "
                    f"new tokens")
    _check_ints(index, "output_indices", request.output_indices, 0, num_tokens, "output index")
    if len(request.samplers) != len(request.output_indices):
        raise _fail(index, "samplers", f"{len(request.samplers)} samplers for "
                    f"{len(request.output_indices)} output indices")
    for number, sampler in enumerate(request.samplers):
        if not isinstance(sampler, SamplerSpec):
            raise _fail(index, "samplers", f"sampler {number} is a {type(sampler).__name__}, "
                        f"not a SamplerSpec")
        problem = sampler_problem(sampler, vocab_size)
        if problem is not None:
            raise _fail(index, "samplers", f"sampler {number}: {problem}")
    if request.mask is not None and len(request.mask) != num_tokens:
        raise _fail(index, "mask", f"{len(request.mask)} mask rows for {num_tokens} tokens")
    for spec in request.samplers:
        _check_ints(index, "samplers.logit_bias", tuple(t for t, _ in spec.logit_bias), 0,
                    vocab_size, "token id")
        _check_ints(index, "samplers.allowed_token_ids", spec.allowed_token_ids or (), 0,
                    vocab_size, "token id")
    if request.num_drafted:
        _check_verify(index, request)


def _check_verify(index: int, request: ForwardRequest) -> None:
    num_drafted, num_tokens = request.num_drafted, len(request.token_ids)
    if not 0 < num_drafted < num_tokens:
        raise _fail(index, "num_drafted", f"{num_drafted} drafts need 1..{num_tokens - 1} "
                    f"(the pass also carries the token before them)")
    expected = tuple(range(num_tokens - num_drafted - 1, num_tokens))
    if request.output_indices != expected:
        raise _fail(index, "output_indices", f"a verify pass outputs the last {num_drafted + 1} "
                    f"positions {expected[0]}..{expected[-1]}")
    if len(set(request.samplers)) != 1 or request.samplers[0].kind not in ("greedy", "sample") \
            or request.samplers[0].num_logprobs is not None:
        raise _fail(index, "samplers", "a verify pass takes one greedy or sample sampler "
                    "(repeated per output), without log-probabilities")


def _check_states(batch: ForwardBatch) -> None:
    """A generation state advances once per pass: at most one output of the batch names it."""
    seen: set[int] = set()
    for index, request in enumerate(batch.requests):
        states = {id(s.state) for s in request.samplers if s.state is not None}
        if request.num_drafted == 0 and len(states) < sum(s.state is not None
                                                         for s in request.samplers):
            raise _fail(index, "samplers", "a generation state is attached to several outputs")
        if states & seen:
            raise _fail(index, "samplers", "a generation state is attached to outputs of "
                        "several passes of one batch")
        seen |= states


def validate_batch(batch: ForwardBatch, *, page_size: int, num_pages: int, vocab_size: int,
                   max_position: int, adapters: Container[str] = ()) -> None:
    """Validate every request of the batch (ValueError on the first bad one)."""
    if not isinstance(batch, ForwardBatch):
        raise ValueError(f"expected a ForwardBatch, got {type(batch).__name__}")
    for index, request in enumerate(batch.requests):
        validate_request(index, request, page_size=page_size, num_pages=num_pages,
                         vocab_size=vocab_size, max_position=max_position, adapters=adapters)
    _check_states(batch)
