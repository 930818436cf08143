"""A pass's requests grouped by the path they take through the model.

On the quantized CPU engine a request runs either as token rows of the C decode kernel (the
fused decoder's path: decode steps, short prompts; `takes_token_rows`) or on the per-layer path
(long prompts, custom masks). The two paths agree only to the last bits of float32, and with
8-bit activations a last-bit difference in a layer's input moves the next layer's output by ~1%
of a row, so the path must not depend on the batch a request came in. `split_by_path` runs the
requests that take token rows apart from the rest: which path a request takes, and so every bit
of its output, depends on the request alone (the kernels on either path compute each row the
same way whatever the other rows are).

Requests of one pass are independent (none reads K/V another writes in the same pass), so the
groups may run in any order; the token-row requests go first, in sub-batches whose row table
(rows x longest context) stays within MAX_KV_ROW_ENTRIES and whose rows stay within the fused
decoder's limit.
"""
from __future__ import annotations

from typing import Callable

from engine.batch import ForwardBatch, ForwardRequest

__all__ = ["split_by_path"]


def split_by_path(batch: ForwardBatch, takes_rows: Callable[[ForwardRequest], bool],
                  kv_len: Callable[[ForwardRequest], int], max_rows: int, max_entries: int
                  ) -> list[tuple[ForwardBatch, list[int]]]:
    """[(sub-batch, the batch's output row of each of its output rows)] that together run
    `batch`: the requests for which `takes_rows` holds, in order, packed into sub-batches of at
    most `max_rows` tokens and `max_entries` (tokens x longest `kv_len`), then the others in
    one. A batch of one kind (and within the limits) comes back whole."""
    rows_of, next_row = [], 0                      # each request's output rows in the batch
    for request in batch.requests:
        rows_of.append(list(range(next_row, next_row + len(request.output_indices))))
        next_row += len(request.output_indices)
    token_rows = [i for i, request in enumerate(batch.requests) if takes_rows(request)]
    taken = set(token_rows)
    others = [i for i in range(len(batch.requests)) if i not in taken]
    groups = _packed(batch, token_rows, kv_len, max_rows, max_entries)
    if others:
        groups.append(others)
    if len(groups) == 1:
        return [(batch, list(range(next_row)))]
    return [(ForwardBatch(tuple(batch.requests[i] for i in group)),
             [row for i in group for row in rows_of[i]]) for group in groups]


def _packed(batch: ForwardBatch, indices: list[int], kv_len: Callable[[ForwardRequest], int],
            max_rows: int, max_entries: int) -> list[list[int]]:
    """`indices` of batch's requests in order, cut into groups within both limits (a request
    beyond them alone makes a group of its own)."""
    groups: list[list[int]] = []
    group: list[int] = []
    num_tokens = longest = 0
    for i in indices:
        request = batch.requests[i]
        tokens, context = len(request.token_ids), kv_len(request)
        wider = max(longest, context)
        if group and (num_tokens + tokens > max_rows
                      or (num_tokens + tokens) * wider > max_entries):
            groups.append(group)
            group, num_tokens, wider = [], 0, context
        group.append(i)
        num_tokens, longest = num_tokens + tokens, wider
    if group:
        groups.append(group)
    return groups
