"""The swap space: host memory that suspended instances' KV pages occupy, bounded and charged.

A suspension (host/runtime.py) copies an instance's pages out of the engine's pool; their bytes
are charged here to its tenant before the pages are released. The space is bounded twice: all
tenants together by `capacity_bytes` (`swap_mb`), and each tenant by `tenant_limit(tenant)` (the
runtime passes the tenant's share of the pool, as a fraction of the capacity), so one tenant's
suspensions can never fill the space another tenant's need. A refused charge is the "swap space
full" that ends a suspension before it starts. Thread-safe.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

__all__ = ["SwapSpace", "SwapStats"]


@dataclass(frozen=True)
class SwapStats:
    """A snapshot: bytes held now (in all and per tenant) and the capacity."""

    capacity_bytes: int
    used_bytes: int
    tenant_bytes: dict[str, int]


class SwapSpace:
    """Charges and refunds of host bytes, per tenant, within `capacity_bytes` and each tenant's
    `tenant_limit(tenant)` (None: the whole capacity)."""

    def __init__(self, capacity_bytes: int,
                 tenant_limit: Callable[[str], int] | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"SwapSpace: capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.tenant_limit = tenant_limit or (lambda tenant: capacity_bytes)
        self._lock = threading.Lock()
        self._used = 0
        self._tenants: dict[str, int] = {}

    def charge(self, tenant: str, nbytes: int) -> str | None:
        """Charge `nbytes` to `tenant`: None when charged, else why not (nothing charged)."""
        if nbytes < 0:
            raise ValueError(f"SwapSpace.charge: nbytes must be >= 0, got {nbytes}")
        if nbytes == 0:
            return None
        limit = min(self.capacity_bytes, self.tenant_limit(tenant))
        with self._lock:
            held = self._tenants.get(tenant, 0)
            if self._used + nbytes > self.capacity_bytes:
                return (f"swap space full: {nbytes} bytes asked, {self._used} of "
                        f"{self.capacity_bytes} in use (swap_mb)")
            if held + nbytes > limit:
                return (f"swap space full for tenant {tenant!r}: {nbytes} bytes asked, {held} "
                        f"of its {limit} in use (its share of swap_mb)")
            self._used += nbytes
            self._tenants[tenant] = held + nbytes
            return None

    def refund(self, tenant: str, nbytes: int) -> None:
        """Return bytes `charge` took for `tenant`."""
        if nbytes <= 0:
            return
        with self._lock:
            held = self._tenants.get(tenant, 0)
            if nbytes > held:
                raise ValueError(f"SwapSpace.refund: {nbytes} bytes for tenant {tenant!r}, "
                                 f"which holds {held}")
            self._used -= nbytes
            if held == nbytes:
                del self._tenants[tenant]
            else:
                self._tenants[tenant] = held - nbytes

    def statistics(self) -> SwapStats:
        with self._lock:
            return SwapStats(self.capacity_bytes, self._used, dict(self._tenants))
