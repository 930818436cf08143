"""The physical KV page pool (refcounted) and the registry of named exports.

Both are shared by every instance of a runtime and are thread-safe. Neither knows local ids: the
per-instance tables of `host/resources.py` translate and check those before calling in here, so a
misuse reaching this module is a host bug and raises ValueError / RuntimeError, not TrapError.
"""
from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

from host.errors import OutOfPagesError

__all__ = ["PagePool", "PoolStats", "ExportRegistry", "ExportInfo"]


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool: num_free + num_used == num_pages; num_shared counts used pages
    with more than one reference (sharers, exports, imports)."""

    num_pages: int
    num_free: int
    num_used: int
    num_shared: int


class PagePool:
    """Refcounted physical pages [0, num_pages). `allocate` hands out the lowest free ids first
    (deterministic, so tests can name exact ids); a page returns to the free list when its last
    reference is released."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"PagePool: num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._lock = threading.Lock()
        self._refcounts = [0] * num_pages
        self._free_ids = list(range(num_pages))  # a heap; already sorted
        self._num_shared = 0

    def allocate(self, num_pages: int) -> list[int]:
        """Take `num_pages` free pages (refcount 1 each). Raises OutOfPagesError, taking nothing,
        when fewer are free."""
        if num_pages < 0:
            raise ValueError(f"PagePool.allocate: num_pages must be >= 0, got {num_pages}")
        with self._lock:
            if num_pages > len(self._free_ids):
                raise OutOfPagesError(f"out of KV pages: {num_pages} asked, "
                                      f"{len(self._free_ids)} free of {self.num_pages}")
            page_ids = [heapq.heappop(self._free_ids) for _ in range(num_pages)]
            for page_id in page_ids:
                self._refcounts[page_id] = 1
            return page_ids

    def num_free(self) -> int:
        with self._lock:
            return len(self._free_ids)

    def retain(self, page_ids: Iterable[int]) -> None:
        """Add one reference to each page (each must be in use)."""
        with self._lock:
            page_ids = list(page_ids)
            for page_id in page_ids:
                self._check_used(page_id, "retain")
            for page_id in page_ids:
                count = self._refcounts[page_id] + 1
                self._refcounts[page_id] = count
                if count == 2:
                    self._num_shared += 1

    def release(self, page_ids: Iterable[int]) -> None:
        """Drop one reference from each page; a page whose count reaches 0 is free again.
        A page listed twice loses two references."""
        with self._lock:
            page_ids = list(page_ids)
            needed: dict[int, int] = {}
            for page_id in page_ids:
                self._check_used(page_id, "release")
                needed[page_id] = needed.get(page_id, 0) + 1
            for page_id, count in needed.items():
                if count > self._refcounts[page_id]:
                    raise ValueError(f"PagePool.release: page {page_id} released {count} times "
                                     f"with {self._refcounts[page_id]} references")
            for page_id in page_ids:
                count = self._refcounts[page_id] - 1
                self._refcounts[page_id] = count
                if count == 1:
                    self._num_shared -= 1
                elif count == 0:
                    heapq.heappush(self._free_ids, page_id)

    def refcount(self, page_id: int) -> int:
        """References held on `page_id` (0 when free). Read without the lock: one list read."""
        return self._refcounts[page_id]

    def statistics(self) -> PoolStats:
        with self._lock:
            num_free = len(self._free_ids)
            return PoolStats(num_pages=self.num_pages, num_free=num_free,
                             num_used=self.num_pages - num_free, num_shared=self._num_shared)

    def _check_used(self, page_id: int, call: str) -> None:
        if not 0 <= page_id < self.num_pages:
            raise ValueError(f"PagePool.{call}: page {page_id} out of range [0, {self.num_pages})")
        if self._refcounts[page_id] == 0:
            raise ValueError(f"PagePool.{call}: page {page_id} is free")


@dataclass(frozen=True)
class ExportInfo:
    """One named export: the physical pages it holds a reference on, and who made it."""

    namespace: str
    name: str
    page_ids: tuple[int, ...]
    owner_id: str
    persistent: bool


class ExportRegistry:
    """Exports keyed by (namespace, name); the namespace is the tenant, so a name is never visible
    across tenants. Each export holds one pool reference per listed page until it is released, or
    (when not persistent) until its owner is dropped."""

    def __init__(self, pool: PagePool, max_exports_per_namespace: int = 4096) -> None:
        if max_exports_per_namespace <= 0:
            raise ValueError(f"max_exports_per_namespace must be positive, "
                             f"got {max_exports_per_namespace}")
        self.pool = pool
        self.max_exports_per_namespace = max_exports_per_namespace
        self._lock = threading.Lock()
        self._exports: dict[tuple[str, str], ExportInfo] = {}
        self._counts: dict[str, int] = {}              # namespace -> number of exports

    def publish(self, namespace: str, name: str, page_ids: Sequence[int], *, owner_id: str,
                persistent: bool) -> str | None:
        """Register an export, retaining its pages. Returns None, or why nothing was retained
        (the name is taken, or the namespace already holds max_exports_per_namespace)."""
        key = (namespace, name)
        with self._lock:
            if key in self._exports:
                return f"export name {name!r} is taken"
            if self._counts.get(namespace, 0) >= self.max_exports_per_namespace:
                return f"too many exports ({self.max_exports_per_namespace}); release some first"
            self.pool.retain(page_ids)
            self._exports[key] = ExportInfo(namespace, name, tuple(page_ids), owner_id, persistent)
            self._counts[namespace] = self._counts.get(namespace, 0) + 1
            return None

    def acquire(self, namespace: str, name: str) -> tuple[int, ...] | None:
        """The export's pages with one new reference each for the caller (who must release them);
        None when there is no such export in this namespace."""
        with self._lock:
            info = self._exports.get((namespace, name))
            if info is None:
                return None
            self.pool.retain(info.page_ids)
            return info.page_ids

    def names(self, namespace: str) -> list[str]:
        with self._lock:
            return sorted(name for ns, name in self._exports if ns == namespace)

    def get(self, namespace: str, name: str) -> ExportInfo | None:
        with self._lock:
            return self._exports.get((namespace, name))

    def release(self, namespace: str, name: str, requester_id: str) -> str | None:
        """Drop an export made by `requester_id`, or a persistent one of the namespace.
        Returns None on success, else the reason (for the guest's err)."""
        key = (namespace, name)
        with self._lock:
            info = self._exports.get(key)
            if info is None:
                return f"export {name!r} not found"
            if info.owner_id != requester_id and not info.persistent:
                return f"export {name!r} belongs to another instance"
            self._remove(key)
            return None

    def drop_owner(self, owner_id: str) -> int:
        """Drop the non-persistent exports of `owner_id`; returns how many were dropped."""
        with self._lock:
            keys = [key for key, info in self._exports.items()
                    if info.owner_id == owner_id and not info.persistent]
            for key in keys:
                self._remove(key)
            return len(keys)

    def _remove(self, key: tuple[str, str]) -> None:
        """Under the lock: forget an export and return its page references."""
        info = self._exports.pop(key)
        self._counts[info.namespace] -= 1
        if not self._counts[info.namespace]:
            del self._counts[info.namespace]
        self.pool.release(info.page_ids)

    def num_exports(self) -> int:
        with self._lock:
            return len(self._exports)
