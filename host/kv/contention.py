"""The contention policy: when the pool is dry, whose pages may be taken back, and in what order.

Pure functions over a snapshot (`PoolView`); the runtime builds the snapshot, suspends the victim
this module names (its pages copied to host memory, host/runtime.py), and asks again until the
requester's pages are free or no victim is left; then the requester itself waits, suspended, for
its turn. Suspended instances are restored in `restore_order` when the pool has room.

Shares. Each tenant has a guaranteed share of the pool (its reservation): a configured number of
pages, or, for tenants without one, an equal split of what the configured shares leave, among the
tenants that hold pages or run instances. Inside a tenant each running instance's fair share is the
tenant's share divided by its number of running instances (under `pie run` there is one tenant,
"default", whose share is the whole pool: fair share = pool // instances).

Who may be suspended for a requester R that needs `num_pages` more:
- an instance V of another tenant, only when V's tenant holds more than its share and R's tenant
  stays within its share after the allocation (an instance whose tenant is within its share is
  never suspended for another tenant's demand);
- an instance V of R's tenant, only when V holds more than its fair share and more than R will
  hold after the allocation (an instance at or below its fair share is never suspended for one
  that holds more);
- never an instance already suspended.
Order: the tenant most over its share first; inside it, the instance holding the most pages
first; the newest first on ties.

Restore order: tenants by how far under their share they are (most under first), inside a tenant
the oldest suspension first; the head waits until the pool holds its pages (and what it asked
for), and no one behind it is restored before it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

__all__ = ["Holder", "PoolView", "Suspended", "tenant_shares", "next_victim", "reclaim_reason",
           "restore_order"]


@dataclass(frozen=True)
class Holder:
    """One running instance as the policy sees it: `num_pages` = its local page ids (its quota's
    count); `launch_index` orders launches (larger = newer)."""

    instance_id: str
    tenant: str
    num_pages: int
    launch_index: int
    suspended: bool = False       # its pages are swapped out (or about to be): not a victim


@dataclass(frozen=True)
class Suspended:
    """One suspended instance as the restore order sees it: `since` (monotonic) orders
    suspensions; `num_pages` = pool pages its restore takes (its swapped pages and what it
    asked for when it suspended itself)."""

    instance_id: str
    tenant: str
    since: float
    num_pages: int


@dataclass(frozen=True)
class PoolView:
    """A snapshot: the pool size, the running instances, the distinct physical pages each tenant
    holds (its instances' pages and its exports, persistent ones included), and the shares."""

    num_pages: int
    holders: tuple[Holder, ...]
    tenant_pages: Mapping[str, int]
    shares: Mapping[str, int]

    def overage(self, tenant: str) -> int:
        """Pages `tenant` holds above its share (negative: below)."""
        return self.tenant_pages.get(tenant, 0) - self.shares.get(tenant, 0)

    def fair_share(self, tenant: str) -> int:
        """One running instance's fair share of its tenant's share."""
        num_running = sum(1 for holder in self.holders if holder.tenant == tenant)
        return self.shares.get(tenant, 0) // max(1, num_running)


def tenant_shares(num_pages: int, configured: Mapping[str, int],
                  active_tenants: set[str]) -> dict[str, int]:
    """The guaranteed share of every configured or active tenant. Configured shares are taken
    as they are (their sum must not exceed the pool: checked where they are configured); the
    other active tenants split the rest equally (floor)."""
    shares = dict(configured)
    others = sorted(active_tenants - set(configured))
    if others:
        rest = max(0, num_pages - sum(configured.values()))
        shares.update((tenant, rest // len(others)) for tenant in others)
    return shares


def next_victim(view: PoolView, requester_id: str, num_pages: int) -> Holder | None:
    """The instance to suspend so that `requester_id` may get `num_pages` more pages, or None
    when no instance may be suspended for it."""
    requester = next((h for h in view.holders if h.instance_id == requester_id), None)
    if requester is None:
        return None
    will_hold = requester.num_pages + num_pages
    requester_within_share = (view.tenant_pages.get(requester.tenant, 0) + num_pages
                              <= view.shares.get(requester.tenant, 0))
    eligible = []
    for holder in view.holders:
        if holder.instance_id == requester_id or holder.num_pages == 0 or holder.suspended:
            continue
        if holder.tenant == requester.tenant:
            if holder.num_pages > max(view.fair_share(holder.tenant), will_hold):
                eligible.append(holder)
        elif requester_within_share and view.overage(holder.tenant) > 0:
            eligible.append(holder)
    if not eligible:
        return None
    return max(eligible, key=lambda h: (view.overage(h.tenant), h.num_pages, h.launch_index))


def restore_order(view: PoolView, suspended: list[Suspended]) -> list[Suspended]:
    """The suspended instances in the order they are restored: tenants by overage (most under
    their share first), then the oldest suspension first."""
    return sorted(suspended, key=lambda s: (view.overage(s.tenant), s.since, s.instance_id))


def reclaim_reason(view: PoolView, victim: Holder, requester_id: str,
                   requester_tenant: str) -> str:
    """Why `victim` loses its pages to `requester_id` (of `requester_tenant`): the words after
    "suspended" or "terminated"."""
    why = (f"this instance held {victim.num_pages} pages, over its fair share of "
           f"{view.fair_share(victim.tenant)}" if victim.tenant == requester_tenant else
           f"tenant {victim.tenant!r} held {view.tenant_pages.get(victim.tenant, 0)} pages, over "
           f"its guaranteed share of {view.shares.get(victim.tenant, 0)}")
    return f"to free pages for instance {requester_id} ({why})"
