"""Attention masks in their one encoding: run-length rows.

A row is a tuple of run lengths alternating attend / skip, starting with attend (a first run of 0
means "starts with skip"); it sums to the length it covers. The guest's mask rows (forward.submit,
over the kv length), the engine's request rows, and the slots `mask-tokens` hides in one page
(a row over page_size; None = every slot attended) are all such rows. This module updates page
rows and folds the hidden slots of a sequence's pages into its pass's rows. Work is proportional
to the number of runs, not to kv_len.
"""
from __future__ import annotations

from typing import Sequence

from host.errors import TrapError

__all__ = ["MaskRow", "check_mask_rows", "hidden_intervals", "fold_hidden", "mask_page_slots"]

Interval = tuple[int, int]   # [start, end) over kv positions
MaskRow = tuple[int, ...]    # run lengths, attend first


def mask_page_slots(row: MaskRow | None, page_size: int, offset: int, num_tokens: int,
                    masked: bool) -> MaskRow | None:
    """A page's row with slots [offset, offset + num_tokens) hidden (masked) or shown again.
    None: every slot attended."""
    attend = _attend_intervals(row if row is not None else (page_size,))
    span = [(offset, offset + num_tokens)] if num_tokens else []
    attend = _subtract(attend, span) if masked else _union(attend, span)
    if attend == [(0, page_size)]:
        return None
    return _encode(attend, page_size)


def check_mask_rows(rows: Sequence[Sequence[int]], num_tokens: int, kv_len: int,
                    call: str) -> tuple[tuple[int, ...], ...]:
    """Validate a guest mask: one row per input token, non-negative runs summing to kv_len."""
    if len(rows) != num_tokens:
        raise TrapError(f"{call}: mask has {len(rows)} rows for {num_tokens} tokens")
    checked = []
    for index, row in enumerate(rows):
        row = tuple(int(run) for run in row)
        if any(run < 0 for run in row):
            raise TrapError(f"{call}: mask row {index} has a negative run")
        total = sum(row)
        if total != kv_len:
            raise TrapError(f"{call}: mask row {index} sums to {total}, kv length is {kv_len}")
        checked.append(row)
    return tuple(checked)


def hidden_intervals(page_rows: Sequence[MaskRow | None], page_size: int,
                     kv_len: int) -> list[Interval]:
    """Merged kv intervals hidden by the pages' rows (page i covers [i*page_size, ...)), clipped
    to kv_len."""
    intervals: list[Interval] = []
    for page_index, row in enumerate(page_rows):
        if row is None:
            continue
        base = page_index * page_size
        position = 0
        for index, run in enumerate(row):
            if index % 2 == 1:                       # a skip run
                _append_interval(intervals, base + position, min(base + position + run, kv_len))
            position += run
    return intervals


def _append_interval(intervals: list[Interval], start: int, end: int) -> None:
    if start >= end:
        return
    if intervals and intervals[-1][1] >= start:
        intervals[-1] = (intervals[-1][0], max(intervals[-1][1], end))
    else:
        intervals.append((start, end))


def _attend_intervals(row: Sequence[int]) -> list[Interval]:
    intervals: list[Interval] = []
    position = 0
    for index, run in enumerate(row):
        if index % 2 == 0:
            _append_interval(intervals, position, position + run)   # merges across 0 skips
        position += run
    return intervals


def _union(intervals: list[Interval], extra: list[Interval]) -> list[Interval]:
    """Sorted, merged union of two sorted interval lists."""
    merged: list[Interval] = []
    for start, end in sorted(intervals + extra):
        _append_interval(merged, start, end)
    return merged


def _subtract(attend: list[Interval], hidden: list[Interval]) -> list[Interval]:
    """attend minus hidden; both sorted and disjoint."""
    result = []
    h = 0
    for start, end in attend:
        while h < len(hidden) and hidden[h][1] <= start:
            h += 1
        k = h
        while start < end:
            if k >= len(hidden) or hidden[k][0] >= end:
                result.append((start, end))
                break
            if hidden[k][0] > start:
                result.append((start, hidden[k][0]))
            start = max(start, hidden[k][1])
            k += 1
    return result


def _encode(attend: list[Interval], kv_len: int) -> tuple[int, ...]:
    runs: list[int] = []
    position = 0
    for start, end in attend:
        runs.append(start - position)       # skip before (0 allowed only as the leading run)
        runs.append(end - start)            # attend
        position = end
    if kv_len > position:
        runs.append(kv_len - position)
    if not runs:
        return (0, kv_len)
    # runs = [skip, attend, skip, attend, ..., (skip)]; rows start with attend, so lead with 0.
    row = [0] + runs
    if row[1] == 0:                          # no leading skip: drop the 0, 0 pair
        row = row[2:]
    return tuple(row)


def fold_hidden(rows: tuple[tuple[int, ...], ...] | None, num_tokens: int, kv_len: int,
                hidden: list[Interval]) -> tuple[tuple[int, ...], ...] | None:
    """Rows with the hidden intervals removed from what each row attends. rows=None means
    "attend everything" (causal only). No hidden intervals: the rows come back unchanged."""
    if not hidden:
        return rows
    if rows is None:
        row = _encode(_subtract([(0, kv_len)], hidden), kv_len)
        return (row,) * num_tokens
    cache: dict[tuple[int, ...], tuple[int, ...]] = {}
    folded = []
    for row in rows:
        if row not in cache:
            cache[row] = _encode(_subtract(_attend_intervals(row), hidden), kv_len)
        folded.append(cache[row])
    return tuple(folded)
