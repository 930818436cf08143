"""The scheduler's bookkeeping of one queued submission (`Item`, possibly split into chunks) and
of one batch being formed (`Taken`). Used under the scheduler's lock only."""
from __future__ import annotations

import time
from typing import Callable, Hashable

from engine.batch import ForwardResult
from engine.chunking import split_request
from host.scheduling.types import PRIORITIES, SubmissionFuture

__all__ = ["Item", "Taken", "owner_of", "rank_of"]


class Item:
    """A queued pass (request) or copies (request None); a chunk has `parent` set and no
    future: its outputs go into the parent's. A chained pass (submit_chained) has no future
    either: `on_outcome` receives its result. `owner`: its queue key's owner (owner_of)."""

    __slots__ = ("queue_key", "owner", "rank", "order", "request", "copies", "future", "on_done",
                 "on_outcome", "num_tokens", "enqueued_at", "parent", "output_slots", "outputs",
                 "prepare_next", "chain_step")

    def __init__(self, queue_key: Hashable, rank: int, order: int, request, copies, on_done,
                 on_wait: Callable[[SubmissionFuture], None] | None) -> None:
        self.queue_key = queue_key
        self.owner = owner_of(queue_key)
        self.rank = rank
        self.order = order
        self.request = request                 # ForwardRequest, or None for a copy item
        self.copies = copies
        self.future = SubmissionFuture(self.owner, on_wait) if on_wait else None
        self.on_done = on_done
        self.on_outcome: Callable[[object], None] | None = None   # a chained pass: no future
        self.num_tokens = len(request.token_ids) if request is not None else 0
        self.enqueued_at = time.monotonic()
        self.parent: Item | None = None       # a chunk: the item whose pass it runs part of
        self.output_slots: list[int] = []      # a chunked pass: where its outputs go ...
        self.outputs: list | None = None       # ... in the whole pass's outputs
        # the look-ahead at depth 1 (lookahead.py): prepares the pass after this one while it runs
        self.prepare_next: Callable[[], object] | None = None
        # ... at depth N: the one-token pass after this one's
        self.chain_step: Callable[[object], object] | None = None

    def following(self, request, on_done: Callable[[], None] | None,
                  on_outcome: Callable[[object], None]) -> "Item":
        """The item of a one-token pass prepared ahead of this one on its queue (lookahead.py):
        no future, no copies; its order is set when it is charged."""
        item = Item.__new__(Item)
        item.queue_key, item.owner, item.rank, item.order = (self.queue_key, self.owner,
                                                              self.rank, 0)
        item.request, item.copies, item.future, item.on_done = request, (), None, on_done
        item.on_outcome, item.num_tokens, item.enqueued_at = on_outcome, 1, self.enqueued_at
        item.parent, item.output_slots, item.outputs = None, [], None
        item.prepare_next, item.chain_step = self.prepare_next, None
        return item

    def split(self, num_first: int, page_size: int) -> "Item":
        """Run the first `num_first` tokens as a chunk (returned); this item keeps the rest."""
        if self.outputs is None:
            self.outputs = [None] * len(self.request.output_indices)
            self.output_slots = list(range(len(self.request.output_indices)))
        first, rest, first_outputs, rest_outputs = split_request(self.request, num_first,
                                                                 page_size)
        chunk = Item(self.queue_key, self.rank, self.order, first, self.copies, None, None)
        chunk.parent = self
        chunk.output_slots = [self.output_slots[k] for k in first_outputs]
        self.output_slots = [self.output_slots[k] for k in rest_outputs]
        self.request, self.copies, self.num_tokens = rest, (), len(rest.token_ids)
        return chunk

    def merged(self, result: ForwardResult, slots: list[int] | None = None) -> ForwardResult:
        """Put a part's outputs in their `slots` (default: this item's, for its last part) of
        the whole pass's outputs; returns the whole pass's result so far."""
        if self.outputs is None:
            return result
        for slot, output in zip(self.output_slots if slots is None else slots, result.outputs):
            self.outputs[slot] = output
        return ForwardResult(tuple(self.outputs))


class Taken:
    """What one batch being formed holds: tokens in all, per owner; whether it is full."""

    def __init__(self, max_tokens: int, contended: bool) -> None:
        self.max_tokens = max_tokens
        self.contended = contended           # more than one owner has work
        self.num_tokens = 0
        self.full = False
        self._per_owner: dict[Hashable, int] = {}

    def room(self, owner: Hashable, max_per_owner: int) -> tuple[int, int]:
        """(tokens left in the batch, tokens `owner` may still add: its own cap counts only
        when others have work)."""
        batch_room = self.max_tokens - self.num_tokens
        if not self.contended:
            return batch_room, batch_room
        return batch_room, min(batch_room, max_per_owner - self._per_owner.get(owner, 0))

    def add(self, owner: Hashable, num_tokens: int) -> None:
        self.num_tokens += num_tokens
        self._per_owner[owner] = self._per_owner.get(owner, 0) + num_tokens


def owner_of(queue_key: Hashable) -> Hashable:
    """The owner (instance id) of a queue key (instance id, local queue id)."""
    return queue_key[0] if isinstance(queue_key, tuple) and queue_key else queue_key


def rank_of(priority: str) -> int:
    """A priority's rank (0 goes first). ValueError for a priority not in PRIORITIES."""
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
    return PRIORITIES.index(priority)
