"""Fair shares of the batches: tokens served per owner (instance) and per group (tenant).

The scheduler orders queue heads by (their group's served tokens, their owner's served tokens,
priority, age): the group and then the owner that has had the fewest tokens goes first, so a
batch is shared fairly across tenants and, inside a tenant, across instances; priorities order
work only among one owner's queues. An owner (group) coming back after being idle is credited
with at most one batch of lag (`max_lag_tokens`), so idling cannot bank a long monopoly.
Not thread-safe: the scheduler calls it under its own lock.
"""
from __future__ import annotations

from typing import Hashable, Iterable

__all__ = ["FairShares"]


class FairShares:
    """Served-token counters of the owners and groups that have work, with their groups."""

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
