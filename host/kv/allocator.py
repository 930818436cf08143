"""The allocator of the engine's physical KV pages: a refcount per page, lowest free ids first.

Shared by every instance of a runtime and thread-safe. It knows no local ids: the per-instance
tables (host/kv/instance_pages.py) translate and check those before calling in here, so a misuse
reaching this module is a host bug and raises ValueError / RuntimeError, not TrapError.
"""
from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

from host.errors import OutOfPagesError

__all__ = ["PageAllocator", "PageStats"]


@dataclass(frozen=True)
class PageStats:
    """A snapshot of the pool: num_free + num_used == num_pages; num_shared counts used pages
    with more than one reference (sharers, exports, imports)."""

    num_pages: int
    num_free: int
    num_used: int
    num_shared: int


class PageAllocator:
    """Refcounted physical pages [0, num_pages). `allocate` hands out the lowest free ids first
    (deterministic, so tests can name exact ids); a page returns to the free list when its last
    reference is released. `refcount(page_id)`: the references held on a page (0 when free),
    read without the lock."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"PageAllocator: num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._lock = threading.Lock()
        self._refcounts = [0] * num_pages
        self._free_ids = list(range(num_pages))  # a heap; already sorted
        self._num_shared = 0
        # the list's own item read (a C call: no Python frame per copy-on-write check); the
        # list is never replaced
        self.refcount: Callable[[int], int] = self._refcounts.__getitem__
        self.on_free: Callable[[], None] | None = None   # called (no lock held) after a release

    def allocate(self, num_pages: int) -> list[int]:
        """Take `num_pages` free pages (refcount 1 each). Raises OutOfPagesError, taking nothing,
        when fewer are free."""
        if num_pages < 0:
            raise ValueError(f"PageAllocator.allocate: num_pages must be >= 0, got {num_pages}")
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
        """Drop one reference from each page; a page whose count reaches 0 is free again (then
        `on_free`, if set, is called, without the lock: it must not block). A page listed twice
        loses two references."""
        with self._lock:
            page_ids = list(page_ids)
            needed: dict[int, int] = {}
            for page_id in page_ids:
                self._check_used(page_id, "release")
                needed[page_id] = needed.get(page_id, 0) + 1
            for page_id, count in needed.items():
                if count > self._refcounts[page_id]:
                    raise ValueError(f"PageAllocator.release: page {page_id} released {count} times "
                                     f"with {self._refcounts[page_id]} references")
            num_freed = 0
            for page_id in page_ids:
                count = self._refcounts[page_id] - 1
                self._refcounts[page_id] = count
                if count == 1:
                    self._num_shared -= 1
                elif count == 0:
                    heapq.heappush(self._free_ids, page_id)
                    num_freed += 1
        if num_freed and self.on_free is not None:
            self.on_free()

    def statistics(self) -> PageStats:
        with self._lock:
            num_free = len(self._free_ids)
            return PageStats(num_pages=self.num_pages, num_free=num_free,
                             num_used=self.num_pages - num_free, num_shared=self._num_shared)

    def _check_used(self, page_id: int, call: str) -> None:
        if not 0 <= page_id < self.num_pages:
            raise ValueError(f"PageAllocator.{call}: page {page_id} out of range [0, {self.num_pages})")
        if self._refcounts[page_id] == 0:
            raise ValueError(f"PageAllocator.{call}: page {page_id} is free")
