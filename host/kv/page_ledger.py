"""The local page table of one instance, and the refcount discipline behind it.

Local ids are u32 names private to an instance; each maps to a physical page of the shared
`PageAllocator` and holds exactly one pool reference. Ids are never reused, so a stale id is told apart
from a forged one. Every reference is taken in `_add_local` (or by the export registry) and returned
in `_release_physical`, which defers the release while a submission that may still touch the page
is in flight (its `on_done` pin ends it), so a page is never handed to another instance while the
engine could still write it for this one. `release_all` returns everything, deferred pages too.

`InstancePages` (host/kv/instance_pages.py) builds the WIT-level operations on top of this table.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Sequence, TypeVar

from engine.batch import TokenCopy
from host.errors import OutOfPagesError, QuotaError, TrapError
from host.kv.allocator import PageAllocator
from host.kv.exports import ExportRegistry
from host.kv.masks import MaskRow

__all__ = ["PageLedger", "LocalPage", "PageSequence", "NeedPages", "ReclaimHook"]

ReclaimHook = Callable[[int], bool]   # num_pages_needed -> freed any
_T = TypeVar("_T")
DEFERRED_WAIT_S = 5.0   # longest wait for this instance's own in-flight work before reclaiming


class NeedPages(Exception):
    """Internal: a locked step needs `num_pages` pool pages that only a reclaim could free."""

    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages)
        self.num_pages = num_pages


class LocalPage:
    __slots__ = ("physical_id", "read_only", "mask_row")

    def __init__(self, physical_id: int, read_only: bool = False,
                 mask_row: MaskRow | None = None) -> None:
        self.physical_id = physical_id
        self.read_only = read_only
        self.mask_row = mask_row        # slots hidden from attention (host.kv.masks); None: none


class PageSequence:
    __slots__ = ("page_ids", "physical_ids")

    def __init__(self) -> None:
        self.page_ids: list[int] = []                     # local ids, in order
        self.physical_ids: tuple[int, ...] | None = None  # cache; None = stale


class PageLedger:
    """Local page and sequence tables of one instance, with the checks every call shares.
    Thread-safe: every public method takes the instance's lock (an RLock)."""

    def __init__(self, allocator: PageAllocator, exports: ExportRegistry, *, instance_id: str,
                 tenant: str, page_quota: int, page_size: int,
                 reclaim: ReclaimHook | None = None) -> None:
        if page_quota < 0:
            raise ValueError(f"page_quota must be >= 0, got {page_quota}")
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.allocator = allocator
        self.exports = exports
        self.instance_id = instance_id
        self.tenant = tenant
        self.page_quota = page_quota
        self.page_size = page_size
        self.reclaim = reclaim
        self.lock = threading.RLock()
        self._pins_done = threading.Condition(self.lock)
        self.pages: dict[int, LocalPage] = {}
        self.sequences: dict[int, PageSequence] = {}
        self.next_page_id = 0
        self.next_sequence_id = 0
        self.num_masked_pages = 0
        self._next_pin_id = 0
        self._pins_in_flight: set[int] = set()
        self._deferred: deque[tuple[int, int]] = deque()   # (newest pin it waits for, page)
        self._closed = False

    @property
    def num_pages_held(self) -> int:
        return len(self.pages)

    def physical_ids(self) -> set[int]:
        """The distinct pool pages this instance holds references on (deferred releases too)."""
        with self.lock:
            held = {page.physical_id for page in self.pages.values()}
            held.update(physical_id for _, physical_id in self._deferred)
            return held

    # -------------------------------------------------------------- lifecycle
    def release_all(self) -> None:
        """Return every pool reference of the instance and drop its sequences and non-persistent
        exports. Idempotent; later calls on this instance trap."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            physical_ids = [page.physical_id for page in self.pages.values()]
            physical_ids += [physical_id for _, physical_id in self._deferred]
            self.pages.clear()
            self.sequences.clear()
            self._deferred.clear()
            self._pins_in_flight.clear()
            self._pins_done.notify_all()
            self.num_masked_pages = 0
            self.allocator.release(physical_ids)
            self.exports.drop_owner(self.instance_id)

    @property
    def closed(self) -> bool:
        return self._closed

    # ---------------------------------------------------------------- helpers
    def pin(self) -> Callable[[], None]:
        """Count one submission in flight; the returned callback (idempotent) ends it. Pages
        released while it is in flight return to the pool only once it is done."""
        pin_id = self._next_pin_id
        self._next_pin_id += 1
        self._pins_in_flight.add(pin_id)

        def on_done() -> None:
            with self.lock:
                if pin_id not in self._pins_in_flight:
                    return
                self._pins_in_flight.discard(pin_id)
                if self._deferred:          # else nothing to flush, and nobody waits
                    self._flush_deferred()
                    self._pins_done.notify_all()
        return on_done

    def _flush_deferred(self) -> None:
        """Release the deferred pages whose in-flight submissions have all finished."""
        oldest = min(self._pins_in_flight, default=self._next_pin_id)
        ready = []
        while self._deferred and self._deferred[0][0] < oldest:
            ready.append(self._deferred.popleft()[1])
        if ready and not self._closed:
            self.allocator.release(ready)

    def _release_physical(self, physical_id: int) -> None:
        if self._pins_in_flight:
            # Submissions pinned so far (ids < _next_pin_id) may still touch the page.
            self._deferred.append((self._next_pin_id - 1, physical_id))
        else:
            self.allocator.release((physical_id,))

    def drop_local(self, page_id: int) -> None:
        page = self.pages.pop(page_id)
        if page.mask_row is not None:
            self.num_masked_pages -= 1
        self._release_physical(page.physical_id)

    def add_local(self, physical_id: int, read_only: bool = False,
                  mask_row: MaskRow | None = None) -> int:
        page_id = self.next_page_id
        self.next_page_id += 1
        self.pages[page_id] = LocalPage(physical_id, read_only, mask_row)
        if mask_row is not None:
            self.num_masked_pages += 1
        return page_id

    def pages_to_copy(self, call: str, page_ids: Sequence[int]) -> list[int]:
        """The distinct pages among `page_ids` that a write must copy first (shared with another
        id, an export or another instance). Traps on an imported (read-only) page."""
        result = []
        for page_id in page_ids:
            page = self.pages[page_id]
            if page.read_only:
                raise TrapError(f"{call}: page id {page_id} is read-only (imported); copy its "
                                f"tokens into a page of your own to extend it")
            if self.allocator.refcount(page.physical_id) > 1 and page_id not in result:
                result.append(page_id)
        return result

    def copy_on_write(self, page_ids: list[int], new_physical_ids: list[int],
                       num_slots: list[int]) -> list[TokenCopy]:
        """Remap each local page to its new physical page, copying its first slots. The old page
        is released after the pinned submission that carries the copy has run."""
        copies = []
        for page_id, new_id, slots in zip(page_ids, new_physical_ids, num_slots):
            page = self.pages[page_id]
            if slots:
                copies.append(TokenCopy(page.physical_id, new_id, 0, 0, slots))
            self._release_physical(page.physical_id)
            page.physical_id = new_id
        return copies

    def invalidate_sequences(self) -> None:
        for sequence in self.sequences.values():
            sequence.physical_ids = None

    def take_pages(self, num_pages: int) -> list[int]:
        """Pool pages without reclaim (we hold our lock); NeedPages asks `_with_reclaim` to
        reclaim outside the lock and retry."""
        if not num_pages:
            return []
        try:
            return self.allocator.allocate(num_pages)
        except OutOfPagesError:
            raise NeedPages(num_pages) from None

    def with_reclaim(self, call: str, prepare: Callable[[], _T]) -> _T:
        """Run `prepare` under the lock; when it needs pages the pool lacks, reclaim (outside
        our lock: the runtime may lock other instances) and retry."""
        while True:
            with self.lock:
                self.check_open(call)
                try:
                    return prepare()
                except NeedPages as need:
                    num_pages = need.num_pages
            self._reclaim_or_raise(call, num_pages)

    def allocate_physical(self, call: str, num_pages: int) -> list[int]:
        while True:
            try:
                return self.allocator.allocate(num_pages)
            except OutOfPagesError:
                self._reclaim_or_raise(call, num_pages)

    def _reclaim_or_raise(self, call: str, num_pages: int) -> None:
        """Make room for a retry, or raise OutOfPagesError. Pages this instance released that
        are still pinned by its own in-flight submissions come first (the engine is about to
        return them); only then are other instances reclaimed."""
        if self._wait_for_deferred():
            return
        if self.reclaim is None or not self.reclaim(num_pages):
            stats = self.allocator.statistics()
            raise OutOfPagesError(f"{call}: out of KV pages: {num_pages} asked, "
                                  f"{stats.num_free} free of {stats.num_pages}")

    def _wait_for_deferred(self) -> bool:
        """Wait (at most DEFERRED_WAIT_S) for some deferred releases of this instance to reach
        the pool. True when some did. Called without the lock held by this thread."""
        deadline = time.monotonic() + DEFERRED_WAIT_S
        with self.lock:
            num_before = len(self._deferred)
            while self._deferred and len(self._deferred) == num_before and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._pins_done.wait(remaining)
            return len(self._deferred) < num_before

    def check_open(self, call: str) -> None:
        if self._closed:
            raise TrapError(f"{call}: instance {self.instance_id} was released")

    def within_quota(self, num_new: int) -> bool:
        """Whether `num_new` more local pages stay within the quota."""
        return len(self.pages) + num_new <= self.page_quota

    def check_quota(self, call: str, num_new: int) -> None:
        if num_new < 0:
            raise TrapError(f"{call}: negative page count {num_new}")
        if not self.within_quota(num_new):
            raise QuotaError(f"{call}: {num_new} pages asked, quota {self.page_quota} "
                             f"(holding {len(self.pages)})")

    def page(self, call: str, page_id: int) -> LocalPage:
        page = self.pages.get(page_id)
        if page is None:
            if 0 <= page_id < self.next_page_id:
                raise TrapError(f"{call}: page id {page_id} was already freed")
            raise TrapError(f"{call}: unknown page id {page_id}")
        return page

    def check_page_ids(self, call: str, page_ids: Sequence[int], allow_repeats: bool = False) -> None:
        for page_id in page_ids:
            self.page(call, page_id)
        if not allow_repeats and len(set(page_ids)) != len(page_ids):
            seen: set[int] = set()
            repeated = next(pid for pid in page_ids if pid in seen or seen.add(pid))
            raise TrapError(f"{call}: page id {repeated} listed twice")

    def check_slots(self, call: str, offset: int, num_tokens: int) -> None:
        if offset < 0 or num_tokens < 0 or offset + num_tokens > self.page_size:
            raise TrapError(f"{call}: slots [{offset}, {offset + num_tokens}) outside a page of "
                            f"{self.page_size}")

    def sequence(self, call: str, sequence_id: int) -> PageSequence:
        sequence = self.sequences.get(sequence_id)
        if sequence is None:
            raise TrapError(f"{call}: unknown sequence id {sequence_id}")
        return sequence
