"""Tenants: who a bearer token belongs to, and the quotas each tenant's usage is checked against.

A tenant is a namespace: its programs, instances, KV exports, topics and key-value store are its
own (the runtime namespaces exports/topics/store by the `tenant` given at launch). Quotas:
- max_instances: concurrent instances;
- max_kv_pages: KV pages, as *reservations*: each instance reserves a page quota at launch
  (default max_kv_pages // max_instances) and the runtime holds it to that; the reservations of a
  tenant's live instances never sum past max_kv_pages, so neither do the pages they hold;
- max_program_bytes: bytes of stored programs;
- max_adapter_bytes: bytes of stored LoRA adapters (host/server/adapters.py);
- prefix_cache_pages: the most KV pages the built-in OpenAI inferlet's shared chat prefixes hold
  for the tenant (persistent exports, so also within kv_share_pages); 0 turns the sharing off;
- kv_share_pages: the tenant's guaranteed share of the pool (`resolve_kv_shares`): its instances
  within it are never terminated for another tenant's demand, and its exports (persistent ones
  included) count against it and never hold more (host/kv/contention.py).
`QuotaBook` is owned by the server's trio thread (never touched from instance threads).
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from host.runtime_config import OutboundLimits
from host.server.server_config import TenantConfig

__all__ = ["Tenant", "TenantRegistry", "QuotaExceeded", "QuotaBook", "resolve_kv_shares"]


def resolve_kv_shares(tenants: tuple[TenantConfig, ...], num_pages: int) -> tuple[tuple[str, int], ...]:
    """Every tenant's guaranteed pages: its `kv_share_pages`, else an equal part (floor) of
    what the given shares leave of the pool; never more than its max_kv_pages. ValueError when
    the given shares sum past the pool."""
    given = sum(t.kv_share_pages for t in tenants if t.kv_share_pages is not None)
    if given > num_pages:
        raise ValueError(f"tenants: kv_share_pages sum to {given}, more than the pool of "
                         f"{num_pages} KV pages")
    num_unset = sum(1 for t in tenants if t.kv_share_pages is None)
    equal = (num_pages - given) // max(1, num_unset)
    return tuple((t.name, min(t.max_kv_pages, equal if t.kv_share_pages is None
                              else t.kv_share_pages)) for t in tenants)


@dataclass(frozen=True)
class Tenant:
    """An authenticated tenant: its name and its quotas."""

    name: str
    max_instances: int
    max_kv_pages: int
    max_program_bytes: int
    prefix_cache_pages: int = 0      # the built-in's shared chat prefixes (TenantConfig)
    max_receive_wait_s: float | None = None   # its instances' InstanceLimits (None: the server's)
    max_adapter_bytes: int = 256 * 1024 * 1024   # stored LoRA adapters (TenantConfig)
    outbound: OutboundLimits = field(default_factory=OutboundLimits)   # its instances' HTTP, MCP
    spare_instances: int = 0         # of its latest launched upload, made ahead (TenantConfig)

    @property
    def default_kv_pages(self) -> int:
        """The page reservation of an instance launched without asking for one."""
        return max(1, self.max_kv_pages // self.max_instances)


class TenantRegistry:
    """Bearer token -> Tenant, compared in constant time."""

    def __init__(self, tenants: tuple[TenantConfig, ...]) -> None:
        self._by_token = [(t.resolved_token().encode(),
                           Tenant(t.name, t.max_instances, t.max_kv_pages, t.max_program_bytes,
                                  t.resolved_prefix_cache_pages, t.max_receive_wait_s,
                                  t.max_adapter_bytes, t.outbound, t.spare_instances))
                          for t in tenants]

    def authenticate(self, token: str) -> Tenant | None:
        """The tenant whose token this is, or None."""
        found = None
        candidate = token.encode("utf-8", "surrogatepass")   # a lone surrogate matches none
        for secret, tenant in self._by_token:
            if hmac.compare_digest(secret, candidate):
                found = tenant
        return found

    def all(self) -> list[Tenant]:
        """Every tenant, in the configured order."""
        return [t for _, t in self._by_token]


class QuotaExceeded(Exception):
    """A launch or upload would exceed a tenant quota; the message names quota and usage."""


@dataclass
class _Usage:
    num_instances: int = 0
    num_reserved_pages: int = 0


class QuotaBook:
    """Live instance counts and page reservations per tenant (trio thread only)."""

    def __init__(self) -> None:
        self._usage: dict[str, _Usage] = {}
        self._reservations: dict[str, tuple[str, int]] = {}  # instance id -> (tenant, pages)

    def check_launch(self, tenant: Tenant, kv_pages: int, num_lingering: int = 0) -> None:
        """Raise QuotaExceeded if one more instance reserving `kv_pages` would not fit.
        `num_lingering`: the tenant's ended instances whose threads are still blocked in a WASI
        call (they hold their Store and memory until it returns): they count as instances."""
        usage = self._usage.get(tenant.name, _Usage())
        if usage.num_instances + num_lingering + 1 > tenant.max_instances:
            lingering = (f" and {num_lingering} ended but still blocked in a WASI call"
                         if num_lingering else "")
            raise QuotaExceeded(f"tenant {tenant.name!r}: instance quota reached "
                                f"({usage.num_instances} running{lingering}, of "
                                f"max_instances {tenant.max_instances})")
        if kv_pages <= 0:
            raise QuotaExceeded(f"kv_pages must be positive, got {kv_pages}")
        free = tenant.max_kv_pages - usage.num_reserved_pages
        if kv_pages > free:
            raise QuotaExceeded(f"tenant {tenant.name!r}: KV page quota: {kv_pages} pages asked, "
                                f"{free} of {tenant.max_kv_pages} unreserved")

    def add(self, tenant: Tenant, instance_id: str, kv_pages: int) -> None:
        """Record a launched instance (after check_launch passed)."""
        usage = self._usage.setdefault(tenant.name, _Usage())
        usage.num_instances += 1
        usage.num_reserved_pages += kv_pages
        self._reservations[instance_id] = (tenant.name, kv_pages)

    def remove(self, instance_id: str) -> None:
        """Forget an ended instance (idempotent)."""
        entry = self._reservations.pop(instance_id, None)
        if entry is None:
            return
        usage = self._usage[entry[0]]
        usage.num_instances -= 1
        usage.num_reserved_pages -= entry[1]

    def num_instances(self, tenant_name: str) -> int:
        return self._usage.get(tenant_name, _Usage()).num_instances

    def reserved_pages(self, tenant_name: str) -> int:
        return self._usage.get(tenant_name, _Usage()).num_reserved_pages
