"""Per-instance resource tables: local page / sequence ids -> physical pages of the shared pool.

An instance names pages by u32 ids local to it; `InstanceResources` translates and checks them, so
a forged, stale or double-freed id is a `TrapError` naming the call and the id, and no instance can
reach another's pages. Each local page id holds exactly one pool reference; sharing, exporting and
importing add references (no copy) and a forward pass that writes into a page with other references
first copies it (copy-on-write), so sharers never see each other's writes.

Accounting rule: every pool reference is taken in one place and returned in one place
(`_drop_local` / export release / `release_all`). Releases of pages that a pending pass or copy may
still touch are deferred until the instance has nothing in flight, so a freed page is never handed to
another instance while the engine could still write it for this one.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from engine.batch import ForwardRequest, SamplerSpec, TokenCopy
from host.errors import OutOfPagesError, QuotaError, TrapError
from host.masks import check_mask_rows, fold_hidden, hidden_intervals, page_mask_bits
from host.pages import ExportInfo, ExportRegistry, PagePool, PoolStats

__all__ = ["PagePool", "PoolStats", "ExportRegistry", "ExportInfo", "InstanceResources",
           "PreparedForward", "PreparedCopy", "ReclaimHook"]

ReclaimHook = Callable[[int], bool]   # num_pages_needed -> freed any
_T = TypeVar("_T")


class _NeedPages(Exception):
    """Internal: a locked step needs `num_pages` pool pages that only a reclaim could free."""

    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages)
        self.num_pages = num_pages


@dataclass(frozen=True)
class PreparedForward:
    """A checked pass ready for the scheduler: the engine request (physical ids), the copies that
    must run right before it (copy-on-write), and `on_done`, which the scheduler calls exactly once
    when the pass has run, failed or been cancelled."""

    request: ForwardRequest
    copies: tuple[TokenCopy, ...] = ()
    on_done: Callable[[], None] | None = None


@dataclass(frozen=True)
class PreparedCopy:
    """A checked kv.copy-tokens: the copies to run in order on a queue (a copy-on-write of the
    destination first when it was shared), and `on_done` as for PreparedForward."""

    copies: tuple[TokenCopy, ...]
    on_done: Callable[[], None] | None = None


class _LocalPage:
    __slots__ = ("physical_id", "read_only", "mask_bits")

    def __init__(self, physical_id: int, read_only: bool = False, mask_bits: int = 0) -> None:
        self.physical_id = physical_id
        self.read_only = read_only
        self.mask_bits = mask_bits      # bit k set: slot k hidden from attention


class _Sequence:
    __slots__ = ("page_ids", "physical_ids")

    def __init__(self) -> None:
        self.page_ids: list[int] = []                     # local ids, in order
        self.physical_ids: tuple[int, ...] | None = None  # cache; None = stale


class InstanceResources:
    """The page and sequence tables of one instance. Thread-safe (the runtime may call
    `release_all` from another thread while the instance runs).

    Quota: every local page id (allocated, shared or imported) counts against `page_quota`.
    reclaim: called with the number of pages needed when the pool is empty; the runtime terminates
    newer instances and returns True once it has returned pages to the pool (False: nothing to
    reclaim). Allocation then retries; with nothing to reclaim it raises OutOfPagesError.
    """

    def __init__(self, pool: PagePool, exports: ExportRegistry, *, instance_id: str,
                 tenant: str, page_quota: int, page_size: int,
                 reclaim: ReclaimHook | None = None) -> None:
        if page_quota < 0:
            raise ValueError(f"page_quota must be >= 0, got {page_quota}")
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.pool = pool
        self.exports = exports
        self.instance_id = instance_id
        self.tenant = tenant
        self.page_quota = page_quota
        self.page_size = page_size
        self.reclaim = reclaim
        self._lock = threading.RLock()
        self._pages: dict[int, _LocalPage] = {}
        self._sequences: dict[int, _Sequence] = {}
        self._next_page_id = 0
        self._next_sequence_id = 0
        self._num_masked_pages = 0
        self._next_pin_id = 0
        self._pins_in_flight: set[int] = set()
        self._deferred: deque[tuple[int, int]] = deque()   # (newest pin it waits for, page)
        self._closed = False

    # ------------------------------------------------------------------ pages
    @property
    def num_pages_held(self) -> int:
        return len(self._pages)

    def allocate_pages(self, num_pages: int) -> list[int]:
        call = "kv.allocate-pages"
        with self._lock:
            self._check_open(call)
            self._check_quota(call, num_pages)
        physical_ids = self._allocate_physical(call, num_pages)
        with self._lock:
            if self._closed:
                self.pool.release(physical_ids)
                raise TrapError(f"{call}: instance {self.instance_id} was released")
            return [self._add_local(pid) for pid in physical_ids]

    def free_pages(self, page_ids: Sequence[int]) -> None:
        """Drop local ids (removing them from every sequence that lists them)."""
        call = "kv.free-pages"
        with self._lock:
            self._check_open(call)
            self._check_page_ids(call, page_ids)
            dropped = set(page_ids)
            for sequence in self._sequences.values():
                if any(pid in dropped for pid in sequence.page_ids):
                    sequence.page_ids = [pid for pid in sequence.page_ids if pid not in dropped]
                    sequence.physical_ids = None
            for page_id in page_ids:
                self._drop_local(page_id)

    def share_pages(self, page_ids: Sequence[int]) -> list[int]:
        """New local ids on the same physical pages (read-only flag and mask bits carried over)."""
        call = "kv.share-pages"
        with self._lock:
            self._check_open(call)
            self._check_page_ids(call, page_ids, allow_repeats=True)
            self._check_quota(call, len(page_ids))
            pages = [self._pages[pid] for pid in page_ids]
            self.pool.retain([page.physical_id for page in pages])
            return [self._add_local(page.physical_id, page.read_only, page.mask_bits)
                    for page in pages]

    def mask_tokens(self, page_id: int, offset: int, num_tokens: int, masked: bool) -> None:
        call = "kv.mask-tokens"
        with self._lock:
            self._check_open(call)
            page = self._page(call, page_id)
            self._check_slots(call, offset, num_tokens)
            bits = page_mask_bits(offset, num_tokens)
            before = page.mask_bits
            page.mask_bits = before | bits if masked else before & ~bits
            self._num_masked_pages += bool(page.mask_bits) - bool(before)

    def copy_tokens_request(self, src_page_id: int, dst_page_id: int, src_offset: int,
                            dst_offset: int, num_tokens: int) -> PreparedCopy:
        """Check and translate kv.copy-tokens. A shared destination is copied whole first (COW);
        an imported one traps. Submit the result with `BatchScheduler.submit_copy`."""
        call = "kv.copy-tokens"
        return self._with_reclaim(call, lambda: self._prepare_copy_locked(
            call, src_page_id, dst_page_id, src_offset, dst_offset, num_tokens))

    def _prepare_copy_locked(self, call: str, src_page_id: int, dst_page_id: int,
                             src_offset: int, dst_offset: int, num_tokens: int) -> PreparedCopy:
        src = self._page(call, src_page_id)
        self._page(call, dst_page_id)
        self._check_slots(call, src_offset, num_tokens)
        self._check_slots(call, dst_offset, num_tokens)
        cow_ids = self._pages_to_copy(call, [dst_page_id])
        new_ids = self._take_pages(len(cow_ids))
        on_done = self._pin()
        copies = self._copy_on_write(cow_ids, new_ids, [self.page_size])
        copies.append(TokenCopy(src.physical_id, self._pages[dst_page_id].physical_id,
                                src_offset, dst_offset, num_tokens))
        return PreparedCopy(tuple(copies), on_done)

    # ---------------------------------------------------------------- exports
    def export_pages(self, name: str, page_ids: Sequence[int], persistent: bool) -> str | None:
        """Publish pages under `name` in this tenant. None on success, else the reason."""
        call = "kv.export-pages"
        with self._lock:
            self._check_open(call)
            if not name:
                return "export name must not be empty"
            self._check_page_ids(call, page_ids)
            physical_ids = [self._pages[pid].physical_id for pid in page_ids]
            if not self.exports.publish(self.tenant, name, physical_ids,
                                        owner_id=self.instance_id, persistent=persistent):
                return f"export name {name!r} is taken"
            return None

    def import_pages(self, name: str) -> list[int] | str:
        """New read-only local ids sharing an export's pages, or the reason it failed."""
        call = "kv.import-pages"
        with self._lock:
            self._check_open(call)
            info = self.exports.get(self.tenant, name)
            if info is None:
                return f"export {name!r} not found"
            self._check_quota(call, len(info.page_ids))
            physical_ids = self.exports.acquire(self.tenant, name)
            if physical_ids is None:
                return f"export {name!r} not found"
            if len(self._pages) + len(physical_ids) > self.page_quota:   # changed meanwhile
                self.pool.release(physical_ids)
                self._check_quota(call, len(physical_ids))
            return [self._add_local(pid, read_only=True) for pid in physical_ids]

    def list_exports(self) -> list[str]:
        return self.exports.names(self.tenant)

    def release_export(self, name: str) -> str | None:
        with self._lock:
            self._check_open("kv.release-export")
            return self.exports.release(self.tenant, name, self.instance_id)

    # -------------------------------------------------------------- sequences
    def create_sequence(self) -> int:
        with self._lock:
            self._check_open("kv.create-sequence")
            sequence_id = self._next_sequence_id
            self._next_sequence_id += 1
            self._sequences[sequence_id] = _Sequence()
            return sequence_id

    def sequence_append(self, sequence_id: int, page_ids: Sequence[int]) -> None:
        call = "kv.sequence-append"
        with self._lock:
            self._check_open(call)
            sequence = self._sequence(call, sequence_id)
            self._check_page_ids(call, page_ids, allow_repeats=True)
            sequence.page_ids.extend(page_ids)
            sequence.physical_ids = None

    def sequence_remove(self, sequence_id: int, index: int, count: int) -> None:
        call = "kv.sequence-remove"
        with self._lock:
            self._check_open(call)
            sequence = self._sequence(call, sequence_id)
            size = len(sequence.page_ids)
            if index < 0 or count < 0 or index + count > size:
                raise TrapError(f"{call}: range [{index}, {index + count}) outside sequence "
                                f"{sequence_id} of {size} pages")
            del sequence.page_ids[index:index + count]
            sequence.physical_ids = None

    def sequence_pages(self, sequence_id: int) -> list[int]:
        with self._lock:
            return list(self._sequence("kv.sequence-pages", sequence_id).page_ids)

    def destroy_sequence(self, sequence_id: int) -> None:
        with self._lock:
            self._sequence("kv.destroy-sequence", sequence_id)
            del self._sequences[sequence_id]

    # ---------------------------------------------------------------- forward
    def prepare_forward(self, sequence_id: int, token_ids: Sequence[int],
                        positions: Sequence[int], last_page_len: int,
                        output_indices: Sequence[int], samplers: Sequence[SamplerSpec],
                        mask: Sequence[Sequence[int]] | None = None) -> PreparedForward:
        """Check a forward.submit over a sequence and translate it to an engine request.

        The pass writes kv slots [kv_len - num_tokens, kv_len), kv_len = (num_pages - 1) *
        page_size + last_page_len. Those pages must be writable: an imported page traps, a
        shared one is copied first (its slots before the write) and remapped for this instance
        only. Hidden slots (mask-tokens) are folded into the mask rows; with none and no guest
        mask the request has mask=None. Without a remap or a mask the work is O(num_tokens).
        """
        call = "forward.submit"
        return self._with_reclaim(call, lambda: self._prepare_forward_locked(
            call, sequence_id, token_ids, positions, last_page_len, output_indices, samplers,
            mask))

    def _prepare_forward_locked(self, call: str, sequence_id: int, token_ids: Sequence[int],
                                positions: Sequence[int], last_page_len: int,
                                output_indices: Sequence[int], samplers: Sequence[SamplerSpec],
                                mask: Sequence[Sequence[int]] | None) -> PreparedForward:
        sequence = self._sequence(call, sequence_id)
        num_tokens = len(token_ids)
        kv_len = self._check_pass_shape(call, sequence, num_tokens, positions, last_page_len,
                                        output_indices, samplers)
        rows = None if mask is None else check_mask_rows(mask, num_tokens, kv_len, call)
        first_slot = kv_len - num_tokens
        first_index = first_slot // self.page_size
        tail_ids = sequence.page_ids[first_index:]
        cow_ids = self._pages_to_copy(call, tail_ids)
        new_ids = self._take_pages(len(cow_ids))      # the last step that may fail
        on_done = self._pin()
        copies: list[TokenCopy] = []
        if cow_ids:
            first_offset = first_slot - first_index * self.page_size
            offsets = [first_offset if pid == tail_ids[0] else 0 for pid in cow_ids]
            copies = self._copy_on_write(cow_ids, new_ids, offsets)
            self._invalidate_sequences()
        if self._num_masked_pages:
            masks = [self._pages[pid].mask_bits for pid in sequence.page_ids]
            rows = fold_hidden(rows, num_tokens, kv_len,
                               hidden_intervals(masks, self.page_size, kv_len))
        if sequence.physical_ids is None:
            sequence.physical_ids = tuple(self._pages[pid].physical_id
                                          for pid in sequence.page_ids)
        request = ForwardRequest(tuple(token_ids), tuple(positions), sequence.physical_ids,
                                 last_page_len, tuple(output_indices), tuple(samplers), rows)
        return PreparedForward(request, tuple(copies), on_done)

    def _check_pass_shape(self, call: str, sequence: _Sequence, num_tokens: int,
                          positions: Sequence[int], last_page_len: int,
                          output_indices: Sequence[int], samplers: Sequence[SamplerSpec]) -> int:
        if num_tokens == 0:
            raise TrapError(f"{call}: no input tokens")
        if len(positions) != num_tokens:
            raise TrapError(f"{call}: {len(positions)} positions for {num_tokens} tokens")
        if not sequence.page_ids:
            raise TrapError(f"{call}: the sequence has no pages")
        if not 1 <= last_page_len <= self.page_size:
            raise TrapError(f"{call}: last-page-len {last_page_len} outside 1..{self.page_size}")
        kv_len = (len(sequence.page_ids) - 1) * self.page_size + last_page_len
        if num_tokens > kv_len:
            raise TrapError(f"{call}: {num_tokens} tokens but the pages hold {kv_len}")
        if len(samplers) != len(output_indices):
            raise TrapError(f"{call}: {len(samplers)} samplers for "
                            f"{len(output_indices)} output indices")
        for index in output_indices:
            if not 0 <= index < num_tokens:
                raise TrapError(f"{call}: output index {index} outside 0..{num_tokens - 1}")
        return kv_len

    # -------------------------------------------------------------- lifecycle
    def release_all(self) -> None:
        """Return every pool reference of the instance and drop its sequences and non-persistent
        exports. Idempotent; later calls on this instance trap."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            physical_ids = [page.physical_id for page in self._pages.values()]
            physical_ids += [physical_id for _, physical_id in self._deferred]
            self._pages.clear()
            self._sequences.clear()
            self._deferred.clear()
            self._pins_in_flight.clear()
            self._num_masked_pages = 0
            self.pool.release(physical_ids)
            self.exports.drop_owner(self.instance_id)

    @property
    def closed(self) -> bool:
        return self._closed

    # ---------------------------------------------------------------- helpers
    def _pin(self) -> Callable[[], None]:
        """Count one submission in flight; the returned callback (idempotent) ends it. Pages
        released while it is in flight return to the pool only once it is done."""
        pin_id = self._next_pin_id
        self._next_pin_id += 1
        self._pins_in_flight.add(pin_id)

        def on_done() -> None:
            with self._lock:
                if pin_id not in self._pins_in_flight:
                    return
                self._pins_in_flight.discard(pin_id)
                self._flush_deferred()
        return on_done

    def _flush_deferred(self) -> None:
        """Release the deferred pages whose in-flight submissions have all finished."""
        oldest = min(self._pins_in_flight, default=self._next_pin_id)
        ready = []
        while self._deferred and self._deferred[0][0] < oldest:
            ready.append(self._deferred.popleft()[1])
        if ready and not self._closed:
            self.pool.release(ready)

    def _release_physical(self, physical_id: int) -> None:
        if self._pins_in_flight:
            # Submissions pinned so far (ids < _next_pin_id) may still touch the page.
            self._deferred.append((self._next_pin_id - 1, physical_id))
        else:
            self.pool.release((physical_id,))

    def _drop_local(self, page_id: int) -> None:
        page = self._pages.pop(page_id)
        if page.mask_bits:
            self._num_masked_pages -= 1
        self._release_physical(page.physical_id)

    def _add_local(self, physical_id: int, read_only: bool = False, mask_bits: int = 0) -> int:
        page_id = self._next_page_id
        self._next_page_id += 1
        self._pages[page_id] = _LocalPage(physical_id, read_only, mask_bits)
        if mask_bits:
            self._num_masked_pages += 1
        return page_id

    def _pages_to_copy(self, call: str, page_ids: Sequence[int]) -> list[int]:
        """The distinct pages among `page_ids` that a write must copy first (shared with another
        id, an export or another instance). Traps on an imported (read-only) page."""
        result = []
        for page_id in page_ids:
            page = self._pages[page_id]
            if page.read_only:
                raise TrapError(f"{call}: page id {page_id} is read-only (imported); copy its "
                                f"tokens into a page of your own to extend it")
            if self.pool.refcount(page.physical_id) > 1 and page_id not in result:
                result.append(page_id)
        return result

    def _copy_on_write(self, page_ids: list[int], new_physical_ids: list[int],
                       num_slots: list[int]) -> list[TokenCopy]:
        """Remap each local page to its new physical page, copying its first slots. The old page
        is released after the pinned submission that carries the copy has run."""
        copies = []
        for page_id, new_id, slots in zip(page_ids, new_physical_ids, num_slots):
            page = self._pages[page_id]
            if slots:
                copies.append(TokenCopy(page.physical_id, new_id, 0, 0, slots))
            self._release_physical(page.physical_id)
            page.physical_id = new_id
        return copies

    def _invalidate_sequences(self) -> None:
        for sequence in self._sequences.values():
            sequence.physical_ids = None

    def _take_pages(self, num_pages: int) -> list[int]:
        """Pool pages without reclaim (we hold our lock); _NeedPages asks `_with_reclaim` to
        reclaim outside the lock and retry."""
        if not num_pages:
            return []
        try:
            return self.pool.allocate(num_pages)
        except OutOfPagesError:
            raise _NeedPages(num_pages) from None

    def _with_reclaim(self, call: str, prepare: Callable[[], _T]) -> _T:
        """Run `prepare` under the lock; when it needs pages the pool lacks, reclaim (outside
        our lock: the runtime may lock other instances) and retry."""
        while True:
            with self._lock:
                self._check_open(call)
                try:
                    return prepare()
                except _NeedPages as need:
                    num_pages = need.num_pages
            self._reclaim_or_raise(call, num_pages)

    def _allocate_physical(self, call: str, num_pages: int) -> list[int]:
        while True:
            try:
                return self.pool.allocate(num_pages)
            except OutOfPagesError:
                self._reclaim_or_raise(call, num_pages)

    def _reclaim_or_raise(self, call: str, num_pages: int) -> None:
        if self.reclaim is None or not self.reclaim(num_pages):
            stats = self.pool.statistics()
            raise OutOfPagesError(f"{call}: out of KV pages: {num_pages} asked, "
                                  f"{stats.num_free} free of {stats.num_pages}")

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise TrapError(f"{call}: instance {self.instance_id} was released")

    def _check_quota(self, call: str, num_new: int) -> None:
        if num_new < 0:
            raise TrapError(f"{call}: negative page count {num_new}")
        if len(self._pages) + num_new > self.page_quota:
            raise QuotaError(f"{call}: {num_new} pages asked, quota {self.page_quota} "
                             f"(holding {len(self._pages)})")

    def _page(self, call: str, page_id: int) -> _LocalPage:
        page = self._pages.get(page_id)
        if page is None:
            if 0 <= page_id < self._next_page_id:
                raise TrapError(f"{call}: page id {page_id} was already freed")
            raise TrapError(f"{call}: unknown page id {page_id}")
        return page

    def _check_page_ids(self, call: str, page_ids: Sequence[int], allow_repeats: bool = False) -> None:
        for page_id in page_ids:
            self._page(call, page_id)
        if not allow_repeats and len(set(page_ids)) != len(page_ids):
            seen: set[int] = set()
            repeated = next(pid for pid in page_ids if pid in seen or seen.add(pid))
            raise TrapError(f"{call}: page id {repeated} listed twice")

    def _check_slots(self, call: str, offset: int, num_tokens: int) -> None:
        if offset < 0 or num_tokens < 0 or offset + num_tokens > self.page_size:
            raise TrapError(f"{call}: slots [{offset}, {offset + num_tokens}) outside a page of "
                            f"{self.page_size}")

    def _sequence(self, call: str, sequence_id: int) -> _Sequence:
        sequence = self._sequences.get(sequence_id)
        if sequence is None:
            raise TrapError(f"{call}: unknown sequence id {sequence_id}")
        return sequence
