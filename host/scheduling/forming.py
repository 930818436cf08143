"""Forming one batch from the scheduler's queues (the rule of host/scheduling/scheduler.py).

Each queue contributes at most its head pass (and the copies queued before it). Heads go in by
(their group's served tokens, their owner's served tokens, priority, age) until the batch holds
max_batch_tokens; with more than one owner, no owner puts more than max_tokens_per_owner tokens
in (a longer pass is cut into a chunk, engine/chunking.py).

When every head fits whole -- the common decode step -- they are all taken in one sort by that
key; otherwise a heap takes them one by one, re-keying an entry whose owner or group was charged
since it was pushed. The two orders differ only there, never in who is taken.
Called under the scheduler's lock; mutates `queues` (taken items leave, empty queues go) and
charges `fair`.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Hashable

from host.scheduling.fairness import FairShares
from host.scheduling.items import Item, Taken
from host.scheduling.types import SchedulerPolicy

__all__ = ["take_batch"]

Queues = dict[Hashable, deque[Item]]


def take_batch(queues: Queues, fair: FairShares, policy: SchedulerPolicy, page_size: int,
               max_tokens: int | None = None) -> tuple[list[Item], list[Item]]:
    """(copy items, forward items) of the next batch, in run order; `max_tokens`: the batch's
    tokens (default policy.max_batch_tokens)."""
    if max_tokens is None:
        max_tokens = policy.max_batch_tokens
    owners = {queue[0].owner for queue in queues.values()}   # a queue holds one owner's items
    fair.settle(owners)
    contended = len(owners) > 1
    if _every_head_fits(queues, policy, contended, max_tokens):
        return _take_every_head(queues, fair)
    return _take_by_heap(queues, fair, policy, page_size, Taken(max_tokens, contended))


def _head_key(fair: FairShares, queue: deque[Item]) -> tuple:
    head = queue[0]
    return (*fair.key(head.owner), head.rank, head.order)


def _every_head_fits(queues: Queues, policy: SchedulerPolicy, contended: bool,
                     max_tokens: int) -> bool:
    """Whether every queue's head pass goes in whole: their tokens fit the batch and, with more
    than one owner, each owner's fit max_tokens_per_owner."""
    num_tokens = 0
    per_owner: dict[Hashable, int] = {}
    for queue in queues.values():
        head = next((item for item in queue if item.request is not None), None)
        if head is not None:
            num_tokens += head.num_tokens
            per_owner[head.owner] = per_owner.get(head.owner, 0) + head.num_tokens
    if num_tokens > max_tokens:
        return False
    return not contended or max(per_owner.values(), default=0) <= policy.max_tokens_per_owner


def _take_every_head(queues: Queues, fair: FairShares) -> tuple[list[Item], list[Item]]:
    copy_items: list[Item] = []
    forward_items: list[Item] = []
    for key in sorted(queues, key=lambda key: _head_key(fair, queues[key])):
        queue = queues[key]
        while queue and queue[0].request is None:
            copy_items.append(queue.popleft())
        if queue:
            item = queue.popleft()
            forward_items.append(item)
            fair.charge(item.owner, item.num_tokens)
        if not queue:
            del queues[key]
    return copy_items, forward_items


def _take_by_heap(queues: Queues, fair: FairShares, policy: SchedulerPolicy, page_size: int,
                  taken: Taken) -> tuple[list[Item], list[Item]]:
    copy_items: list[Item] = []
    forward_items: list[Item] = []
    tie = itertools.count()
    heap = [(_head_key(fair, queue), next(tie), key) for key, queue in queues.items()]
    heapq.heapify(heap)
    while heap:
        stored, _, key = heapq.heappop(heap)
        queue = queues[key]
        current = _head_key(fair, queue)
        if current > stored and not taken.full:      # its owner was served meanwhile
            heapq.heappush(heap, (current, next(tie), key))
            continue
        while queue and queue[0].request is None:
            copy_items.append(queue.popleft())
        if queue and not taken.full:
            item = _take_forward(queue, taken, policy, page_size)
            if item is not None:
                forward_items.append(item)
                fair.charge(item.owner, item.num_tokens)
        if not queue:
            del queues[key]
    return copy_items, forward_items


def _take_forward(queue: deque[Item], taken: Taken, policy: SchedulerPolicy,
                  page_size: int) -> Item | None:
    """The head pass; a chunk of it when others have work and it is longer than
    max_tokens_per_owner (the rest stays at the head); or None (this owner's share is used, or
    the batch is full)."""
    head = queue[0]
    owner = head.owner
    max_per_owner = policy.max_tokens_per_owner
    batch_room, owner_room = taken.room(owner, max_per_owner)
    if head.num_tokens <= owner_room or not taken.num_tokens and not taken.contended:
        item = queue.popleft()
    elif taken.contended and head.num_tokens > max_per_owner and owner_room > 0:
        item = head.split(owner_room, page_size)
    elif taken.contended and owner_room < batch_room:
        return None
    else:
        taken.full = True
        return None
    taken.add(owner, item.num_tokens)
    return item
