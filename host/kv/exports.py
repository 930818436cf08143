"""Named exports of KV pages: one tenant's instances publish pages under a name, others of the same
tenant import them without recomputing. Thread-safe; each export holds one allocator reference per
page until it is released (or, when not persistent, until its owner ends).

Exports count against their tenant: the distinct pages a namespace's exports hold (persistent
ones included) are part of the tenant's usage in the contention policy (host/kv/contention.py),
and never exceed `page_limit(namespace)` (the runtime passes the tenant's guaranteed share), so
exports alone can never take pages guaranteed to another tenant.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from collections import Counter
from typing import Callable, Sequence

from host.kv.allocator import PageAllocator

__all__ = ["ExportRegistry", "ExportInfo"]


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

    def __init__(self, allocator: PageAllocator, max_exports_per_namespace: int = 4096,
                 page_limit: Callable[[str], int] | None = None) -> None:
        """`page_limit(namespace)`: most distinct pages that namespace's exports may hold
        together; None = the whole pool."""
        if max_exports_per_namespace <= 0:
            raise ValueError(f"max_exports_per_namespace must be positive, "
                             f"got {max_exports_per_namespace}")
        self.allocator = allocator
        self.max_exports_per_namespace = max_exports_per_namespace
        self.page_limit = page_limit or (lambda namespace: allocator.num_pages)
        self._lock = threading.Lock()
        self._exports: dict[tuple[str, str], ExportInfo] = {}
        self._counts: dict[str, int] = {}              # namespace -> number of exports
        self._pages: dict[str, Counter[int]] = {}      # namespace -> page -> exports listing it

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
            held = self._pages.setdefault(namespace, Counter())
            num_after = len(held.keys() | set(page_ids))
            limit = self.page_limit(namespace)
            if num_after > limit:
                if not held:
                    del self._pages[namespace]
                return (f"exports of tenant {namespace!r} would hold {num_after} KV pages, over "
                        f"the tenant's export limit of {limit} (its guaranteed share)")
            self.allocator.retain(page_ids)
            held.update(page_ids)
            self._exports[key] = ExportInfo(namespace, name, tuple(page_ids), owner_id, persistent)
            self._counts[namespace] = self._counts.get(namespace, 0) + 1
            return None

    def page_ids(self, namespace: str) -> set[int]:
        """The distinct physical pages the namespace's exports hold."""
        with self._lock:
            return set(self._pages.get(namespace, ()))

    def num_pages(self) -> int:
        """The distinct physical pages all exports hold together."""
        with self._lock:
            return len(set().union(*self._pages.values()))

    def namespaces(self) -> set[str]:
        """The namespaces holding at least one export."""
        with self._lock:
            return set(self._pages)

    def acquire(self, namespace: str, name: str) -> tuple[int, ...] | None:
        """The export's pages with one new reference each for the caller (who must release them);
        None when there is no such export in this namespace."""
        with self._lock:
            info = self._exports.get((namespace, name))
            if info is None:
                return None
            self.allocator.retain(info.page_ids)
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
        held = self._pages[info.namespace]
        held.subtract(info.page_ids)
        for page_id in info.page_ids:
            if held[page_id] <= 0:
                del held[page_id]
        if not held:
            del self._pages[info.namespace]
        self.allocator.release(info.page_ids)

    def num_exports(self) -> int:
        with self._lock:
            return len(self._exports)
