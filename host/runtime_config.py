"""Frozen configuration of the runtime and of each instance, validated once here (ValueError)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from host.scheduling.scheduler import SchedulerPolicy

__all__ = ["InstanceLimits", "RuntimeConfig", "default_cache_dir"]


def default_cache_dir() -> Path:
    """`$PIE_CACHE_DIR`, else ~/.cache/pie."""
    configured = os.environ.get("PIE_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "pie"


@dataclass(frozen=True)
class InstanceLimits:
    """What one instance may use.

    memory_mb:      linear memory limit of the guest (a Python guest needs >= 13 MiB to start).
    max_idle_s:     longest the guest may compute without calling the host before it traps with
                    "no host call for N s" (time blocked in the host does not count).
    page_quota:     most KV pages held at once; None = the whole pool.
    max_blocking_s: longest one blocking host call (future get, receive, synchronize) may wait;
                    None = until the instance is terminated.
    """

    memory_mb: int = 256
    max_idle_s: float = 10.0
    page_quota: int | None = None
    max_blocking_s: float | None = None

    def __post_init__(self) -> None:
        if self.memory_mb <= 0 or self.memory_mb > 4096:
            raise ValueError(f"InstanceLimits.memory_mb must be in 1..4096, got {self.memory_mb}")
        if not self.max_idle_s > 0:
            raise ValueError(f"InstanceLimits.max_idle_s must be > 0, got {self.max_idle_s}")
        if self.page_quota is not None and self.page_quota < 0:
            raise ValueError(f"InstanceLimits.page_quota must be >= 0, got {self.page_quota}")
        if self.max_blocking_s is not None and not self.max_blocking_s > 0:
            raise ValueError(f"InstanceLimits.max_blocking_s must be > 0 or None, "
                             f"got {self.max_blocking_s}")


@dataclass(frozen=True)
class RuntimeConfig:
    """How the runtime is set up.

    cache_dir:     where compiled components are kept (keyed by sha256 + wasmtime + engine config).
    scheduler:     the batching policy; None = host.scheduling.scheduler.SchedulerPolicy() (adaptive).
    limits:        the default InstanceLimits of a launch.
    epoch_tick_ms: how often the epoch ticker advances the Wasmtime epoch.
    kv_shares:     (tenant, pages) guaranteed to each named tenant (host/kv/contention.py); the
                   tenants not named split what is left equally. Their sum must fit the pool
                   (checked by the Runtime, which knows the pool).
    """

    cache_dir: Path = field(default_factory=default_cache_dir)
    scheduler: "SchedulerPolicy | None" = None
    limits: InstanceLimits = field(default_factory=InstanceLimits)
    epoch_tick_ms: int = 10
    kv_shares: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_shares", tuple((str(t), int(n)) for t, n in self.kv_shares))
        names = [tenant for tenant, _ in self.kv_shares]
        if len(set(names)) != len(names):
            raise ValueError(f"RuntimeConfig.kv_shares: a tenant is named twice in {names}")
        for tenant, num_pages in self.kv_shares:
            if num_pages < 0:
                raise ValueError(f"RuntimeConfig.kv_shares: tenant {tenant!r} share must be "
                                 f">= 0 pages, got {num_pages}")
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        if not 1 <= self.epoch_tick_ms <= 1000:
            raise ValueError(f"RuntimeConfig.epoch_tick_ms must be in 1..1000, "
                             f"got {self.epoch_tick_ms}")
        if not isinstance(self.limits, InstanceLimits):
            raise ValueError(f"RuntimeConfig.limits must be InstanceLimits, got {self.limits!r}")
