"""Splitting forward passes into shorter ones that, run in order, compute the same thing.

Used by the host's scheduler (a long pass of one owner runs in chunks across batches, so others'
decode steps are not stuck behind it) and by the engine (a batch of more than max_pass_tokens
input tokens runs as consecutive passes: long prompts' activations stay bounded).

One pass into a prefix chunk and the rest:

A pass writes kv slots [kv_len - num_tokens, kv_len) and each of its tokens attends (causally)
only to slots up to its own. Its first `num_first` tokens therefore see exactly the same slots
when run alone as a pass ending at kv_len - num_tokens + num_first (the earlier pages of the same
sequence, the last one partly filled); the rest then runs as the original pass minus those
tokens, reading the slots the chunk wrote. A custom mask row is ANDed with the causal mask, so
cutting the chunk's rows at its kv length drops only columns the causal mask hides anyway.
Outputs: each output index goes with the part holding its token; the scheduler's `Item` puts the
parts' outputs back in the order of the original pass.
"""
from __future__ import annotations

from dataclasses import replace

from engine.batch import ForwardBatch, ForwardRequest
from engine.paging import kv_len as paged_kv_len

__all__ = ["split_batch", "split_request", "truncate_row"]


def truncate_row(row: tuple[int, ...], num_slots: int) -> tuple[int, ...]:
    """A run-length row (attend, skip, ...) cut to its first `num_slots` slots."""
    runs: list[int] = []
    left = num_slots
    for run in row:
        if left <= 0:
            break
        runs.append(min(run, left))
        left -= runs[-1]
    return tuple(runs)


def split_request(request: ForwardRequest, num_first: int, page_size: int
                  ) -> tuple[ForwardRequest, ForwardRequest, list[int], list[int]]:
    """(first chunk, rest, positions of the original outputs in the first, ... in the rest).
    0 < num_first < len(request.token_ids)."""
    num_tokens = len(request.token_ids)
    if not 0 < num_first < num_tokens:
        raise ValueError(f"split_request: num_first {num_first} outside 1..{num_tokens - 1}")
    kv_len = paged_kv_len(len(request.page_ids), request.last_page_len, page_size)
    first_kv_len = kv_len - num_tokens + num_first
    num_first_pages = -(-first_kv_len // page_size)
    first_outputs = [k for k, index in enumerate(request.output_indices) if index < num_first]
    rest_outputs = [k for k, index in enumerate(request.output_indices) if index >= num_first]
    first = ForwardRequest(
        request.token_ids[:num_first], request.positions[:num_first],
        request.page_ids[:num_first_pages],
        first_kv_len - (num_first_pages - 1) * page_size,
        tuple(request.output_indices[k] for k in first_outputs),
        tuple(request.samplers[k] for k in first_outputs),
        None if request.mask is None else
        tuple(truncate_row(row, first_kv_len) for row in request.mask[:num_first]),
        adapter=request.adapter)
    rest = replace(
        request, token_ids=request.token_ids[num_first:], positions=request.positions[num_first:],
        output_indices=tuple(request.output_indices[k] - num_first for k in rest_outputs),
        samplers=tuple(request.samplers[k] for k in rest_outputs),
        mask=None if request.mask is None else request.mask[num_first:])
    return first, rest, first_outputs, rest_outputs


def split_batch(batch: ForwardBatch, max_tokens: int, page_size: int
                ) -> list[tuple[ForwardBatch, list[int]]]:
    """Consecutive batches of at most max_tokens input tokens each that, run in this order,
    compute what `batch` does, each with the batch's output row of each of its output rows. The
    logits rows of the parts, put at those rows, are the batch's [num_outputs, vocab].

    A request longer than max_tokens is cut (split_request) at every max_tokens of its own
    tokens, and a request or last piece that does not fit the room left in a part starts the
    next one: the pieces a request runs as never depend on the requests beside it, so neither
    does its arithmetic (which kernels a piece takes depends on its length)."""
    if max_tokens <= 0:
        raise ValueError(f"split_batch: max_tokens must be positive, got {max_tokens}")
    parts: list[tuple[ForwardBatch, list[int]]] = []
    requests: list[ForwardRequest] = []
    rows: list[int] = []
    num_tokens = next_row = 0
    for request in batch.requests:
        request_rows = list(range(next_row, next_row + len(request.output_indices)))
        next_row += len(request_rows)
        while len(request.token_ids) > max_tokens:
            first, request, first_outputs, rest_outputs = split_request(request, max_tokens,
                                                                        page_size)
            if requests:
                parts.append((ForwardBatch(tuple(requests)), rows))
                requests, rows, num_tokens = [], [], 0
            parts.append((ForwardBatch((first,)), [request_rows[k] for k in first_outputs]))
            request_rows = [request_rows[k] for k in rest_outputs]
        if requests and num_tokens + len(request.token_ids) > max_tokens:
            parts.append((ForwardBatch(tuple(requests)), rows))
            requests, rows, num_tokens = [], [], 0
        requests.append(request)
        rows.extend(request_rows)
        num_tokens += len(request.token_ids)
    if requests:
        parts.append((ForwardBatch(tuple(requests)), rows))
    return parts
