"""The batch policy: when a batch fires, and what it holds. Pure functions of what the scheduler
shows them (a `FireView` taken under its lock, its queues, the fair shares), and the fair shares
themselves.

When a batch fires -- "adaptive": as soon as the engine is idle and anything is pending, except
right after a batch, when the next one is held until every *expected* owner has blocked again or
ended, or until the hold's bound has passed, whichever comes first. The expected owners are those
blocked on one of the batch's passes when it resolved (the batch wakes them); one is back when it
waits on a pass that is not done yet, or on a message, and has ended when it is cancelled. The
bound is min(max_hold_ms, hold_fraction x that batch's engine time), from its end
(`hold_after`). So the decode steps of many instances, which come back at slightly different
times, regroup into full batches; a lone instance is held only until it waits again.

The start hold (`start_hold_ms` > 0): a batch whose passes are all the first passes of launched
instances waits for the other instances launched and not blocked yet, each of them once, until its
oldest pass has waited start_hold_ms in all; within that bound it also waits until
LAUNCH_BURST_GAP_S has passed since the last launch by a client (the first of a burst may block
before the next launch is known). A child's spawn opens no such pause: the children a parent
spawns in a row are waited for as starting instances while they are, and a lone child's first
pass is not held for launches that are not coming. A batch with any other pass is never held
for starting instances.

"k-or-t": when k queues have work or the oldest item has waited t_ms.

What a batch holds (`take_batch`): each queue contributes at most its head pass (and the copies
queued before it). Heads go in by (their group's served tokens, their owner's served tokens,
priority, age) until the batch holds max_batch_tokens; with more than one owner, no owner puts
more than max_tokens_per_owner tokens in (a longer pass is cut into a chunk, engine/chunking.py).
When every head fits whole -- the common decode step -- they are all taken in one sort by that
key; otherwise a heap takes them one by one, re-keying an entry whose owner or group was charged
since it was pushed. The two orders differ only there, never in who is taken.

Fair shares (`FairShares`): tokens served per owner (instance) and per group (tenant); an owner
(group) coming back after being idle is credited with at most one batch of lag, so idling cannot
bank a long monopoly.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Hashable, Iterable

from host.scheduling.items import Item, Taken
from host.scheduling.types import SchedulerPolicy

__all__ = ["FireView", "Fire", "decide", "hold_after", "take_batch", "FairShares",
           "LAUNCH_BURST_GAP_S"]

LAUNCH_BURST_GAP_S = 0.002   # the start hold's pause in a burst of launches (module docstring)

Queues = dict[Hashable, deque[Item]]


# ----------------------------------------------------------------------------- when it fires
@dataclass(frozen=True, slots=True)
class FireView:
    """What the firing rule reads, taken under the scheduler's lock. `only_first_passes` and
    `oldest_at` are filled only when the rule can need them (`needs_queue_scan`)."""

    now: float
    running: bool               # a batch runs (on the engine or a waiting thread)
    num_pending: int
    num_queues: int
    holding: bool               # expected owners are not back yet
    hold_until: float
    starting: bool              # owners launched and not blocked yet
    last_start: float           # monotonic time of the last launch
    only_first_passes: bool     # every pending pass is a launched owner's first
    oldest_at: float            # the oldest queue head's enqueue time


@dataclass(frozen=True, slots=True)
class Fire:
    """The rule's answer. `now`: take a batch. Else wait `wait_s` seconds (None: until
    notified). `end_hold`: the hold after a batch has passed its bound; `start_hold_until`:
    hold this batch for the starting owners until then; `forget_starting`: those owners were
    waited for (each is, once)."""

    now: bool = False
    wait_s: float | None = None
    end_hold: bool = False
    start_hold_until: float | None = None
    forget_starting: bool = False


FIRE = Fire(now=True)
IDLE = Fire()


def needs_queue_scan(policy: SchedulerPolicy, start_hold_s: float, starting: bool,
                     last_start: float, now: float) -> bool:
    """Whether `decide` may read `only_first_passes` / `oldest_at` (a scan of the queues)."""
    if policy.kind != "adaptive":
        return True
    return start_hold_s > 0 and (starting or last_start + LAUNCH_BURST_GAP_S > now)


def decide(view: FireView, policy: SchedulerPolicy, start_hold_s: float) -> Fire:
    """When the next batch fires (module docstring). An answer that changes the scheduler's
    state (end_hold, start_hold_until, forget_starting) is applied and asked again."""
    if view.running:
        return IDLE                                    # the one running notifies
    if view.holding:
        if view.hold_until <= view.now:
            return Fire(end_hold=True)
        return Fire(wait_s=view.hold_until - view.now)
    if not view.num_pending:
        return IDLE
    if policy.kind == "adaptive":
        return _decide_adaptive(view, start_hold_s)
    if view.num_queues >= policy.k:
        return FIRE
    wait_s = view.oldest_at + policy.t_ms / 1000 - view.now
    return FIRE if wait_s <= 0 else Fire(wait_s=wait_s)


def _decide_adaptive(view: FireView, start_hold_s: float) -> Fire:
    if view.starting and view.only_first_passes:
        until = view.oldest_at + start_hold_s          # a pass waits that long in all
        if until > view.now:
            return Fire(start_hold_until=until, forget_starting=True)
        return Fire(forget_starting=True)
    if start_hold_s > 0 and view.only_first_passes:
        quiet_at = view.last_start + LAUNCH_BURST_GAP_S
        if quiet_at > view.now:
            wait_s = min(quiet_at, view.oldest_at + start_hold_s) - view.now
            if wait_s > 0:
                return Fire(wait_s=wait_s)
    return FIRE


def hold_after(policy: SchedulerPolicy, awaited_owners: set[Hashable], engine_s: float,
               now: float) -> tuple[set[Hashable], float]:
    """The hold after a batch that ran `engine_s` and woke `awaited_owners`: (the owners the
    next batch waits for, the hold's end)."""
    if policy.kind != "adaptive":
        return set(), now
    bound_s = min(policy.max_hold_ms / 1000, policy.hold_fraction * engine_s)
    return (awaited_owners if bound_s > 0 else set()), now + bound_s


# ----------------------------------------------------------------------------- what it holds
def take_batch(queues: Queues, fair: FairShares, policy: SchedulerPolicy, page_size: int,
               max_tokens: int | None = None) -> tuple[list[Item], list[Item]]:
    """(copy items, forward items) of the next batch, in run order; `max_tokens`: the batch's
    tokens (default policy.max_batch_tokens). Mutates `queues` (taken items leave, empty queues
    go) and charges `fair`."""
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


# ----------------------------------------------------------------------------- fair shares
class FairShares:
    """Served-token counters of the owners and groups that have work, with their groups. Not
    thread-safe: the scheduler calls it under its own lock."""

    def __init__(self, max_lag_tokens: int) -> None:
        self.max_lag_tokens = max_lag_tokens
        self._groups: dict[Hashable, Hashable] = {}        # owner -> group (default: itself)
        self._owner_served: dict[Hashable, float] = {}
        self._group_served: dict[Hashable, float] = {}

    def set_group(self, owner: Hashable, group: Hashable) -> None:
        """Count `owner`'s tokens for `group` too (a tenant); owners without one are their own."""
        self._groups[owner] = ("group", group)

    def group_of(self, owner: Hashable) -> Hashable:
        return self._groups.get(owner, ("owner", owner))

    def settle(self, active_owners: Iterable[Hashable]) -> None:
        """Before forming a batch: owners (groups) with work and no counter, or lagging by more
        than max_lag_tokens behind the least served active one, are brought up to that lag."""
        owners = set(active_owners)
        _settle(self._owner_served, owners, self.max_lag_tokens)
        _settle(self._group_served, {self.group_of(owner) for owner in owners},
                self.max_lag_tokens)

    def key(self, owner: Hashable) -> tuple[float, float]:
        """The fairness part of a queue head's sort key (smaller goes first)."""
        return (self._group_served.get(self.group_of(owner), 0.0),
                self._owner_served.get(owner, 0.0))

    def charge(self, owner: Hashable, num_tokens: int) -> None:
        """`owner` got `num_tokens` into a batch."""
        group = self.group_of(owner)
        self._owner_served[owner] = self._owner_served.get(owner, 0.0) + num_tokens
        self._group_served[group] = self._group_served.get(group, 0.0) + num_tokens

    def forget(self, owner: Hashable) -> None:
        """`owner` ended: drop its counter (and its group's, once no owner is left in it)."""
        group = self.group_of(owner)
        self._owner_served.pop(owner, None)
        self._groups.pop(owner, None)
        if not any(self.group_of(other) == group for other in self._owner_served):
            self._group_served.pop(group, None)


def _settle(served: dict[Hashable, float], active: set[Hashable], max_lag: int) -> None:
    if len(active) == 1:                       # alone, it is its own floor
        served.setdefault(next(iter(active)), 0.0)
        return
    known = [served[name] for name in active if name in served]
    if not known:
        for name in active:
            served[name] = 0.0
        return
    floor = min(known) - max_lag
    for name in active:
        served[name] = max(served.get(name, floor + max_lag), floor)
