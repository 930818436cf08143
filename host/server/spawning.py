"""`pie serve`'s SpawnHooks (host/spawns.py): how a running instance's children.spawn finds a
program and is admitted.

- resolve: a program of the parent's tenant only, by the sha256 of its upload (`UploadStore`);
  another tenant's upload, or a name, is "unknown" whatever the program's bytes.
- admit: the child counts against its tenant's quotas like a launch: one instance more, and a
  page reservation of its limits' page_quota (its parent's), checked and recorded in the
  service's `QuotaBook` on the trio thread (which owns it; the instance thread waits for it),
  released there when the child ends. A refusal names the quota (QuotaExceeded's message).
"""
from __future__ import annotations

import itertools
from typing import Any, Callable

import trio

from host.runtime import SpawnHooks
from host.runtime_config import InstanceLimits
from host.server.tenants import Tenant, TenantRegistry
from host.server.uploads import is_sha256

__all__ = ["server_spawn_hooks"]


def server_spawn_hooks(service: Any, tenants: TenantRegistry,
                       trio_token: trio.lowlevel.TrioToken) -> SpawnHooks:
    """The hooks of `service` (a PieService, its runtime a Runtime) over `tenants`."""
    by_name = {tenant.name: tenant for tenant in tenants.all()}
    keys = itertools.count()

    def resolve(tenant_name: str, program: str) -> Any:
        if not is_sha256(program) or not service.store.owns(tenant_name, program):
            raise LookupError(f"no upload of tenant {tenant_name!r} has the sha256 {program!r}")
        try:
            return service.runtime.programs.get(program)
        except KeyError:                       # uploaded before a restart: compile it again
            return service.runtime.load_program(service.store.read(tenant_name, program))

    def admit(tenant_name: str, limits: InstanceLimits) -> Callable[[], None]:
        tenant = by_name.get(tenant_name)
        if tenant is None:
            raise LookupError(f"tenant {tenant_name!r} is not configured")
        num_pages = limits.page_quota if limits.page_quota else tenant.default_kv_pages
        key = f"child-{next(keys)}"
        try:
            trio.from_thread.run_sync(_reserve, service, tenant, key, num_pages,
                                      trio_token=trio_token)
        except trio.RunFinishedError:
            raise RuntimeError("the server is shutting down") from None

        def release() -> None:
            try:
                trio_token.run_sync_soon(service.quotas.remove, key)
            except trio.RunFinishedError:
                pass                            # the server is gone, its book with it
        return release
    return SpawnHooks(resolve=resolve, admit=admit)


def _reserve(service: Any, tenant: Tenant, key: str, num_pages: int) -> None:
    """On the trio thread: QuotaExceeded (naming the quota) or the reservation recorded."""
    if service.closing.is_set():
        raise RuntimeError("the server is shutting down: no new instances")
    service.quotas.check_launch(tenant, num_pages, service.runtime.num_lingering(tenant.name))
    service.quotas.add(tenant, key, num_pages)
