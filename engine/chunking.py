"""Splitting one forward pass into a prefix chunk and the rest, with the same results.

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

from engine.batch import ForwardRequest
from engine.paging import kv_len as paged_kv_len

__all__ = ["split_request", "truncate_row"]


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
        tuple(truncate_row(row, first_kv_len) for row in request.mask[:num_first]))
    rest = replace(
        request, token_ids=request.token_ids[num_first:], positions=request.positions[num_first:],
        output_indices=tuple(request.output_indices[k] - num_first for k in rest_outputs),
        samplers=tuple(request.samplers[k] for k in rest_outputs),
        mask=None if request.mask is None else request.mask[num_first:])
    return first, rest, first_outputs, rest_outputs
