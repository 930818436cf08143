"""The page table of one instance: local page / sequence ids -> physical pages of the shared pool.

An instance names pages by u32 ids local to it; `InstancePages` translates and checks them, so
a forged, stale or double-freed id is a `TrapError` naming the call and the id, and no instance can
reach another's pages. Ids are never reused, so a stale id is told apart from a forged one.

References: each local page id holds exactly one pool reference; sharing, exporting and importing
add references (no copy), and a pass that writes into a page with other references first copies
it (copy-on-write), so sharers never see each other's writes. Every reference is taken in
`_add_local` (or by the export registry) and returned in `_release_physical`, which defers the
release while a submission that may still touch the page is in flight (its `on_done` pin ends
it): a page is never handed to another instance while the engine could still write it for this
one. `release_all` returns everything, deferred pages too.

A forward pass is translated by one method, `prepare`; a one-token decode step over a tail page of
the instance's own takes an early route there, and a host decode loop's next pass is the same call
without reclaim.

Suspension (host/runtime.py, when the pool runs dry): `begin_suspend` closes the gate (every call
that would reach the pool or the engine waits, a host decode loop's next pass declines), the
instance's passes in flight drain (`wait_drained`), `swap_out` copies the pages this instance
alone references to host memory and returns them to the pool; `swap_in` puts them into fresh
pool pages and opens the gate. Local ids never change: only the physical id behind them does.
Pages with other references (shared, exported, imported) stay where they are. Every pass is
recorded per page (host/kv/page_log.py), so that `swap_out` may instead release the pages
uncopied and `swap_in` recompute them by prefill passes, when every one of them can be.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Literal, Sequence, TypeVar, overload

from engine.batch import ForwardBatch, ForwardRequest, SamplerSpec, TokenCopy
from engine.paging import kv_len as paged_kv_len
from host.errors import Cancelled, OutOfPagesError, QuotaError, TrapError
from host.kv.allocator import PageAllocator
from host.kv.exports import ExportRegistry
from host.kv.page_log import PageLogs, RecomputePlan
from host.kv.masks import (MaskRow, check_mask_rows, fold_hidden, hidden_intervals,
                           mask_page_slots)
from host.scheduling.work import PreparedCopy, PreparedForward

__all__ = ["InstancePages", "LocalPage", "PageSequence", "ReclaimHook", "SwapOut", "Forward",
           "MAX_EXPORT_NAME_CHARS", "MAX_SEQUENCES", "SWAPPED"]

ReclaimHook = Callable[[int], bool]   # num_pages_needed -> freed any
_T = TypeVar("_T")
MAX_EXPORT_NAME_CHARS = 256
MAX_SEQUENCES = 65536          # per instance, at once
DEFERRED_WAIT_S = 5.0          # longest wait for its own in-flight passes before reclaiming
SWAPPED = -1                   # LocalPage.physical_id of a page swapped out (suspended)
ReadPages = Callable[[list[int]], object]          # engine.read_pages: physical ids -> data
WritePages = Callable[[list[int], object], None]   # engine.write_pages
ChargeSwap = Callable[[int], str | None]           # bytes -> None, or why they are refused
ChooseRecompute = Callable[[int, int], bool]       # (pages, tokens) -> recompute (else swap)
Forward = Callable[[ForwardBatch], object]         # engine.forward


class SwapOut:
    """What `swap_out` did: the pages released and their bytes in host memory (0 when they are
    to be recomputed: `num_recomputed` of them hold tokens to recompute), or `refused` (the
    swap space's reason) with nothing changed."""

    __slots__ = ("num_pages", "nbytes", "refused", "recompute", "num_recomputed")

    def __init__(self, num_pages: int, nbytes: int, refused: str | None = None,
                 plan: RecomputePlan | None = None) -> None:
        self.num_pages = num_pages
        self.nbytes = nbytes
        self.refused = refused
        self.recompute = plan is not None
        self.num_recomputed = 0 if plan is None else sum(
            len(group.own) for wave in plan.waves for group in wave)


class _Suspension:
    """The state of a suspended (or suspending) instance's pages."""

    __slots__ = ("swapped", "data", "nbytes", "resident", "since", "plan")

    def __init__(self) -> None:
        self.since = time.monotonic()     # the gate closed
        self.swapped: list[int] = []      # local ids swapped out, in `data`'s order
        self.data: object = None          # engine.read_pages' result; None: nothing swapped
        self.plan: RecomputePlan | None = None    # set: the pages are recomputed, not copied
        self.nbytes = 0
        self.resident = True              # False once swap_out has run


class NeedPages(Exception):
    """Internal: a locked step needs `num_pages` pool pages that only a reclaim could free."""

    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages)
        self.num_pages = num_pages


class LocalPage:
    """What one local page id names: a physical page, and how this id may use it."""

    __slots__ = ("physical_id", "read_only", "mask_row")

    def __init__(self, physical_id: int, read_only: bool = False,
                 mask_row: MaskRow | None = None) -> None:
        self.physical_id = physical_id
        self.read_only = read_only      # imported: a pass may not write it
        self.mask_row = mask_row        # slots hidden from attention (host.kv.masks); None: none


class PageSequence:
    """A host-kept list of local page ids, with its physical ids cached for passes, and the
    adapter its passes run with (the engine's name; None: the base model)."""

    __slots__ = ("page_ids", "physical_ids", "layout", "adapter")

    def __init__(self) -> None:
        self.page_ids: list[int] = []                     # local ids, in order
        self.physical_ids: tuple[int, ...] | None = None  # cache; None = stale
        self.layout = 0           # bumped when pages leave it (an append keeps every prefix)
        self.adapter: str | None = None


class InstancePages:
    """The page and sequence tables of one instance, and the references they hold. Thread-safe:
    every public method takes the instance's lock (the runtime may call `release_all` from
    another thread while the instance runs).

    Quota: every local page id (allocated, shared or imported) counts against `page_quota`.
    reclaim: called with the number of pages needed when the pool is empty; the runtime suspends
    other instances (or this one) and returns True when the allocation should retry (the pages
    it freed handed over: `hand_over`; or this instance suspended: the retry waits at its gate),
    False when nothing could be done; it may raise OutOfPagesError naming why no wait can serve
    the request. Allocation then retries; with nothing to reclaim it raises OutOfPagesError.
    vocab_size: when given, a pass traps on a token id outside the vocabulary.
    max_kv_len: when given, a pass traps when it spans more KV slots than this (the model's
    context length): a sequence listing one page thousands of times would otherwise make one
    pass read that many slots and stall every other instance's batch.
    """

    def __init__(self, allocator: PageAllocator, exports: ExportRegistry, *, instance_id: str,
                 tenant: str, page_quota: int, page_size: int,
                 reclaim: ReclaimHook | None = None, vocab_size: int | None = None,
                 max_kv_len: int | None = None) -> None:
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
        self.vocab_size = vocab_size      # None: token ids are not checked here
        self.max_kv_len = max_kv_len      # None: no bound on a pass's KV length
        self._reclaim = reclaim
        self._lock = threading.RLock()
        self._pins_done = threading.Condition(self._lock)
        self._pages: dict[int, LocalPage] = {}              # local page id -> page
        self._sequences: dict[int, PageSequence] = {}       # sequence id -> its pages
        self._next_page_id = 0
        self._next_sequence_id = 0
        self._num_masked_pages = 0                          # pages with hidden slots
        self._next_pin_id = 0
        self._pins_in_flight: set[int] = set()
        self._deferred: deque[tuple[int, int]] = deque()   # (newest pin it waits for, page)
        self._closed = False
        self._suspension: _Suspension | None = None       # set from begin_suspend to swap_in
        self._gate = threading.Condition(self._lock)       # notified when the gate opens
        self._interrupted: str | None = None               # interrupt()'s reason
        self._reserve: list[int] = []      # pool pages handed over for the next take (hand_over)
        self._suspended_s = 0.0            # time behind a closed gate, suspensions that ended
        self._logs = PageLogs(page_size, self._is_read_only)   # what wrote each page

    @property
    def num_pages_held(self) -> int:
        return len(self._pages)

    @property
    def suspended(self) -> bool:
        """Between begin_suspend and swap_in / abort_suspend (read without the lock)."""
        return self._suspension is not None

    def num_resident_pages(self) -> int:
        """Local page ids backed by a pool page now (swapped-out ones excluded)."""
        with self._lock:
            if self._suspension is None or self._suspension.resident:
                return len(self._pages)
            return sum(1 for page in self._pages.values() if page.physical_id != SWAPPED)

    def num_swapped_pages(self) -> int:
        """Pages of this instance in host memory now (swap_out's, not yet swapped in)."""
        with self._lock:
            return 0 if self._suspension is None else len(self._suspension.swapped)

    @property
    def closed(self) -> bool:
        return self._closed

    def suspended_ms(self) -> int:
        """Milliseconds the gate has been closed (begin_suspend to swap_in / abort_suspend), the
        current suspension included. Read without waiting at the gate."""
        with self._lock:
            suspension = self._suspension
            now_s = 0.0 if suspension is None else time.monotonic() - suspension.since
            return int((self._suspended_s + now_s) * 1000)

    def _is_read_only(self, page_id: int) -> bool:
        page = self._pages.get(page_id)
        return page is not None and page.read_only

    def _open_gate(self) -> None:
        """Under the lock: end the suspension (its time counted) and wake the calls waiting."""
        if self._suspension is not None:
            self._suspended_s += time.monotonic() - self._suspension.since
        self._suspension = None
        self._gate.notify_all()

    def physical_ids(self) -> set[int]:
        """The distinct pool pages this instance holds references on (deferred releases too)."""
        with self._lock:
            held = {page.physical_id for page in self._pages.values()}
            held.update(physical_id for _, physical_id in self._deferred)
            held.update(self._reserve)
            held.discard(SWAPPED)
            return held

    def release_all(self) -> None:
        """Return every pool reference of the instance and drop its sequences and non-persistent
        exports. Idempotent; later calls on this instance trap."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            physical_ids = [page.physical_id for page in self._pages.values()
                            if page.physical_id != SWAPPED]
            physical_ids += [physical_id for _, physical_id in self._deferred]
            physical_ids += self._reserve
            self._reserve = []
            self._suspension = None               # its host copy is dropped with it
            self._gate.notify_all()
            self._pages.clear()
            self._logs.clear()
            self._sequences.clear()
            self._deferred.clear()
            self._pins_in_flight.clear()
            self._pins_done.notify_all()
            self._num_masked_pages = 0
            self.allocator.release(physical_ids)
            self.exports.drop_owner(self.instance_id)

    # ------------------------------------------------------------- suspension
    def begin_suspend(self) -> bool:
        """Close the gate: from now every call that would reach the pool or the engine waits
        (`_wait_resident`) until `swap_in` or `abort_suspend`, and a host decode loop's next
        pass declines (the loop ends; the guest goes on with calls that wait). False, with
        nothing changed, when the instance is released or already suspending."""
        with self._lock:
            if self._closed or self._suspension is not None:
                return False
            self._suspension = _Suspension()
            return True

    def wait_drained(self, timeout_s: float) -> bool:
        """After begin_suspend: wait (at most `timeout_s`) until no submission of this instance
        is in flight and every deferred release has reached the pool. False on timeout or when
        released meanwhile."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while (self._pins_in_flight or self._deferred) and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._pins_done.wait(remaining)
            return not self._closed and self._suspension is not None

    def swap_out(self, read_pages: ReadPages, charge: ChargeSwap, page_nbytes: int,
                 choose_recompute: ChooseRecompute | None = None) -> SwapOut:
        """After wait_drained, with the engine held (BatchScheduler.run_exclusive): the pages
        this instance alone references (allocator refcount 1: not shared, exported or imported)
        leave the pool. Either copied: `page_nbytes` each charged with `charge`, then copied to
        host memory with `read_pages` (physical ids, in local id order); or, when every one of
        them is recomputable (host/kv/page_log.py) and `choose_recompute(pages, tokens)` says
        so, or the swap space refuses them, released with their record kept, to be recomputed
        by swap_in. Either way their local ids are marked swapped and their pool pages
        returned. A refused charge with no recompute possible changes nothing and nothing is
        read (SwapOut.refused says why; the gate stays closed: call abort_suspend)."""
        with self._lock:
            suspension = self._suspension
            if suspension is None or not suspension.resident or self._closed:
                raise RuntimeError(f"instance {self.instance_id}: swap_out outside a suspension")
            if self._pins_in_flight or self._deferred:
                raise RuntimeError(f"instance {self.instance_id}: swap_out before drained")
            local_ids = [pid for pid, page in sorted(self._pages.items())
                         if self.allocator.refcount(page.physical_id) == 1]
            physical_ids = [self._pages[pid].physical_id for pid in local_ids]
            plan = (None if choose_recompute is None
                    else self._logs.plan(local_ids, self._pages.__contains__))
            nbytes = len(local_ids) * page_nbytes
            if plan is None or not choose_recompute(len(local_ids), plan.num_tokens):
                refused = charge(nbytes)
                if refused is not None and plan is None:
                    return SwapOut(0, 0, refused)
                if refused is None:
                    plan = None               # charged: copied
            data = None
            if plan is not None:
                nbytes = 0
            elif physical_ids:
                data = read_pages(physical_ids)
            suspension.plan = plan
            for page_id in local_ids:
                self._pages[page_id].physical_id = SWAPPED
            for sequence in self._sequences.values():
                sequence.physical_ids = None
            suspension.swapped, suspension.data, suspension.nbytes = local_ids, data, nbytes
            suspension.resident = False
            physical_ids += self._reserve          # handed over, unused: back too
            self._reserve = []
            self.allocator.release(physical_ids)
            return SwapOut(len(local_ids), nbytes, plan=plan)

    def swap_in(self, physical_ids: Sequence[int], write_pages: WritePages,
                forward: Forward | None = None) -> int:
        """End a suspension, with the engine held: put the swapped pages into `physical_ids`
        (fresh pool pages, one reference each, as many as num_swapped_pages) with
        `write_pages`, or, for pages released to be recomputed, remap them and run the plan's
        prefill passes with `forward`; then open the gate. Pages the instance dropped
        while suspended are written but returned at once. Returns the bytes freed in host
        memory. Released meanwhile: the pages go back to the pool, 0. When `forward` raises,
        the gate stays closed (the pages remapped, released with the instance): the caller
        ends the instance."""
        with self._lock:
            suspension = self._suspension
            if self._closed or suspension is None:
                self.allocator.release(physical_ids)
                return 0
            if len(physical_ids) != len(suspension.swapped):
                raise ValueError(f"swap_in: {len(physical_ids)} pages for "
                                 f"{len(suspension.swapped)} swapped")
            if suspension.data is not None:
                write_pages(list(physical_ids), suspension.data)
            unused = []
            for page_id, physical_id in zip(suspension.swapped, physical_ids):
                page = self._pages.get(page_id)
                if page is None or page.physical_id != SWAPPED:
                    unused.append(physical_id)
                else:
                    page.physical_id = physical_id
            for sequence in self._sequences.values():
                sequence.physical_ids = None
            if unused:
                self.allocator.release(unused)
            if suspension.plan is not None:
                self._recompute(suspension.plan, forward)
            self._open_gate()
            return suspension.nbytes

    def _recompute(self, plan: RecomputePlan, forward: Forward | None) -> None:
        """Under the lock, the pages remapped: run the plan's passes, wave by wave (a pass
        whose pages were dropped meanwhile is skipped)."""
        if forward is None:
            raise ValueError(f"instance {self.instance_id}: swap_in of recomputed pages "
                             f"needs forward")
        pages = self._pages
        for wave in plan.waves:
            requests = tuple(group.request(lambda pid: pages[pid].physical_id) for group in wave
                             if all(pid in pages for pid in group.prefix + group.own))
            if requests:
                forward(ForwardBatch(requests))

    def abort_suspend(self) -> None:
        """Open the gate of a suspension that did not swap out (nothing was moved)."""
        with self._lock:
            if self._suspension is not None and self._suspension.resident:
                self._open_gate()

    def hand_over(self, physical_ids: Sequence[int]) -> None:
        """Pool pages (one reference each) taken for this instance by the runtime's reclaim or
        restore: its next allocation or copy-on-write takes them first, so no other instance
        takes the pages freed for it; what that take leaves is returned to the pool."""
        with self._lock:
            if self._closed:
                self.allocator.release(physical_ids)
            else:
                self._reserve.extend(physical_ids)

    def interrupt(self, reason: str) -> None:
        """The instance is ending: a call waiting at the gate (and every later one that would
        wait there) raises Cancelled with `reason`."""
        with self._lock:
            self._interrupted = reason
            self._gate.notify_all()
            self._pins_done.notify_all()

    def _wait_resident(self, call: str) -> None:
        """Under the lock: wait while suspended (the gate closed); trap when released or
        interrupted."""
        while self._suspension is not None and not self._closed:
            if self._interrupted is not None:
                raise Cancelled(f"{call}: {self._interrupted}")
            self._gate.wait()
        self._check_open(call)

    # ------------------------------------------------------------------ pages
    def allocate_pages(self, num_pages: int) -> list[int]:
        """New local ids on fresh pool pages (lowest physical ids first). QuotaError over the
        quota; OutOfPagesError when the pool stays short after waiting for this instance's own
        pending releases and after the reclaim hook."""
        call = "kv.allocate-pages"
        with self._lock:
            self._wait_resident(call)
            self._check_quota(call, num_pages)
        physical_ids = self._allocate_physical(call, num_pages)
        with self._lock:      # re-checked: the pool was reached without our lock
            try:
                self._check_open(call)
                self._check_quota(call, num_pages)
            except TrapError:
                self.allocator.release(physical_ids)
                raise
            return [self._add_local(pid) for pid in physical_ids]

    def free_pages(self, page_ids: Sequence[int]) -> None:
        """Drop local ids (removing them from every sequence that lists them)."""
        call = "kv.free-pages"
        with self._lock:
            self._wait_resident(call)
            self._check_page_ids(call, page_ids)
            dropped = set(page_ids)
            for sequence in self._sequences.values():
                if any(pid in dropped for pid in sequence.page_ids):
                    sequence.page_ids = [pid for pid in sequence.page_ids if pid not in dropped]
                    sequence.physical_ids = None
                    sequence.layout += 1
            for page_id in page_ids:
                self._drop_local(page_id)

    def share_pages(self, page_ids: Sequence[int]) -> list[int]:
        """New local ids on the same physical pages (read-only flag and hidden slots carried)."""
        call = "kv.share-pages"
        with self._lock:
            self._wait_resident(call)
            self._check_page_ids(call, page_ids, allow_repeats=True)
            self._check_quota(call, len(page_ids))
            pages = [self._pages[pid] for pid in page_ids]
            self.allocator.retain([page.physical_id for page in pages])
            new_ids = [self._add_local(page.physical_id, page.read_only, page.mask_row)
                       for page in pages]
            for src_id, dst_id in zip(page_ids, new_ids):
                self._logs.share(src_id, dst_id)
            return new_ids

    def mask_tokens(self, page_id: int, offset: int, num_tokens: int, masked: bool) -> None:
        """Hide / show slots of a page for later passes that read it through this id."""
        call = "kv.mask-tokens"
        with self._lock:
            self._check_open(call)
            page = self._page(call, page_id)
            self._check_slots(call, offset, num_tokens)
            before = page.mask_row
            page.mask_row = mask_page_slots(before, self.page_size, offset, num_tokens, masked)
            self._num_masked_pages += (page.mask_row is not None) - (before is not None)

    def copy_tokens_request(self, src_page_id: int, dst_page_id: int, src_offset: int,
                            dst_offset: int, num_tokens: int) -> PreparedCopy:
        """Check and translate kv.copy-tokens. A shared destination is copied whole first (COW);
        an imported one traps. Submit the result with `BatchScheduler.submit_copy`."""
        call = "kv.copy-tokens"
        return self._with_reclaim(call, lambda: self._prepare_copy(
            call, src_page_id, dst_page_id, src_offset, dst_offset, num_tokens))

    def _prepare_copy(self, call: str, src_page_id: int, dst_page_id: int, src_offset: int,
                      dst_offset: int, num_tokens: int) -> PreparedCopy:
        """Under the lock: copy_tokens_request. NeedPages when a copy-on-write lacks pages."""
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
        self._logs.dirty(dst_page_id)
        return PreparedCopy(tuple(copies), on_done)

    # ---------------------------------------------------------------- exports
    def export_pages(self, name: str, page_ids: Sequence[int], persistent: bool) -> str | None:
        """Publish pages under `name` in this tenant. None on success, else the reason."""
        call = "kv.export-pages"
        with self._lock:
            self._wait_resident(call)
            if not 0 < len(name) <= MAX_EXPORT_NAME_CHARS:
                return f"export name must have 1..{MAX_EXPORT_NAME_CHARS} characters"
            self._check_page_ids(call, page_ids)
            physical_ids = [self._pages[pid].physical_id for pid in page_ids]
            return self.exports.publish(self.tenant, name, physical_ids,
                                        owner_id=self.instance_id, persistent=persistent)

    def import_pages(self, name: str) -> list[int] | str:
        """New read-only local ids sharing an export's pages, or the reason it failed."""
        call = "kv.import-pages"
        with self._lock:
            self._wait_resident(call)
            physical_ids = self.exports.acquire(self.tenant, name)
            if physical_ids is None:
                return f"export {name!r} not found"
            if not self._within_quota(len(physical_ids)):
                self.allocator.release(physical_ids)
                self._check_quota(call, len(physical_ids))     # raises QuotaError
            new_ids = [self._add_local(pid, read_only=True) for pid in physical_ids]
            for page_id in new_ids:
                self._logs.dirty(page_id)      # another instance's passes wrote it
            return new_ids

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
            if len(self._sequences) >= MAX_SEQUENCES:
                raise TrapError(f"kv.create-sequence: {MAX_SEQUENCES} sequences already exist; "
                                f"destroy some first")
            sequence_id = self._next_sequence_id
            self._next_sequence_id += 1
            self._sequences[sequence_id] = PageSequence()
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
            sequence.layout += 1

    def sequence_pages(self, sequence_id: int) -> list[int]:
        with self._lock:
            self._check_open("kv.sequence-pages")
            return list(self._sequence("kv.sequence-pages", sequence_id).page_ids)

    def bind_adapter(self, call: str, sequence_id: int, adapter: str | None) -> None:
        """Every pass prepared for the sequence from now on names `adapter` (None: no adapter)."""
        with self._lock:
            self._check_open(call)
            self._sequence(call, sequence_id).adapter = adapter

    def adapter_of(self, sequence_id: int) -> str | None:
        """The adapter the sequence's passes name; None also for an unknown sequence."""
        with self._lock:
            sequence = self._sequences.get(sequence_id)
            return None if sequence is None else sequence.adapter

    def destroy_sequence(self, sequence_id: int) -> None:
        with self._lock:
            self._check_open("kv.destroy-sequence")
            self._sequence("kv.destroy-sequence", sequence_id)
            del self._sequences[sequence_id]

    # ---------------------------------------------------------------- passes
    @overload
    def prepare(self, sequence_id: int, token_ids: Sequence[int], positions: Sequence[int],
                last_page_len: int, output_indices: Sequence[int],
                samplers: Sequence[SamplerSpec], mask: Sequence[Sequence[int]] | None = None, *,
                call: str = "forward.submit", reclaim: Literal[True] = True, grow: bool = False,
                general: bool = True, pinned: bool = True, fed: bool = False
                ) -> PreparedForward: ...

    @overload
    def prepare(self, sequence_id: int, token_ids: Sequence[int], positions: Sequence[int],
                last_page_len: int, output_indices: Sequence[int],
                samplers: Sequence[SamplerSpec], mask: Sequence[Sequence[int]] | None = None, *,
                call: str = "forward.submit", reclaim: Literal[False], grow: bool = False,
                general: bool = True, pinned: bool = True, fed: bool = False
                ) -> tuple[PreparedForward, int | None] | None: ...

    def prepare(self, sequence_id: int, token_ids: Sequence[int], positions: Sequence[int],
                last_page_len: int, output_indices: Sequence[int],
                samplers: Sequence[SamplerSpec], mask: Sequence[Sequence[int]] | None = None, *,
                call: str = "forward.submit", reclaim: bool = True, grow: bool = False,
                general: bool = True, pinned: bool = True, fed: bool = False
                ) -> PreparedForward | tuple[PreparedForward, int | None] | None:
        """Check a pass over a sequence and translate it to an engine request; TrapError (naming
        `call`) when the guest's arguments are wrong.

        The pass writes kv slots [kv_len - num_tokens, kv_len), kv_len = (num_pages - 1) *
        page_size + last_page_len. Those pages must be writable: an imported page traps, a
        shared one is copied first (its slots before the write) and remapped for this instance
        only. Hidden slots (mask-tokens) are folded into the mask rows; with none and no guest
        mask the request has mask=None. Without a remap or a mask the work is O(num_tokens).
        A decode step (one token, its output sampled, no mask) over a tail page of the
        instance's own and no hidden slots takes an early route to the same request.

        reclaim True (a guest's call): when a copy-on-write finds the pool short, the instance's
        own pending releases are waited for, then others reclaimed (OutOfPagesError as
        allocate_pages); returns the pass.
        reclaim False: a host decode loop's next pass, for the thread that resolved the previous
        one (it must not wait for pages); returns (the pass, the local id of the page `grow`
        added or None), or None, with nothing changed, when the quota is reached or the pool or a
        copy-on-write is short of pages, or (`general` False) when the early route declines.
        `grow`: a new page of the instance (within its quota) joins the end of the sequence
        first. `pinned` False: the early route takes no pin of its own (a chained step: the
        chain's first pass holds one); the general route always pins.
        `fed`: the input token is a placeholder the engine replaces with an earlier pass's
        output (ForwardBatch.fed_from): the pages it writes cannot be recomputed.
        """
        decode_step = (mask is None and len(token_ids) == len(positions) == len(samplers)
                       == len(output_indices) == 1 and output_indices[0] == 0)
        if reclaim:
            if decode_step:                 # the common case first
                with self._lock:
                    self._wait_resident(call)
                    prepared = self._decode_step(self._sequence(call, sequence_id),
                                                 token_ids[0], positions[0], last_page_len,
                                                 samplers[0])
                if prepared is not None:
                    return prepared
            return self._with_reclaim(call, lambda: self._prepare_general(
                call, sequence_id, token_ids, positions, last_page_len, output_indices,
                samplers, mask))
        with self._lock:                    # a host decode loop's next pass: no reclaim
            self._check_open(call)
            if self._suspension is not None:
                return None                 # suspended: the loop ends, the guest's call waits
            sequence = self._sequence(call, sequence_id)
            new_page_id = self._grow(sequence) if grow else None
            if grow and new_page_id is None:
                return None
            try:
                prepared = (self._decode_step(sequence, token_ids[0], positions[0],
                                              last_page_len, samplers[0], pinned, fed)
                            if decode_step else None)
                if prepared is None and general:
                    prepared = self._prepare_general(call, sequence_id, token_ids, positions,
                                                     last_page_len, output_indices, samplers,
                                                     mask, fed)
            except NeedPages:
                prepared = None
            except TrapError:
                self._drop_last_page(sequence, new_page_id)
                raise
            if prepared is None:         # short of pages, or (general False) the route declined
                self._drop_last_page(sequence, new_page_id)
                return None
            return prepared, new_page_id

    def undo_grow(self, sequence_id: int, page_id: int) -> None:
        """Give back a page `prepare(..., grow=True)` added for a pass whose output did not
        count, if it is still the sequence's last (and the instance has not ended)."""
        with self._lock:
            sequence = self._sequences.get(sequence_id)   # None: destroyed, or ended
            if sequence is not None:
                self._drop_last_page(sequence, page_id)

    def _grow(self, sequence: PageSequence) -> int | None:
        """Under the lock: a new page of the instance at the sequence's end, without reclaim;
        its local id, or None when the quota is reached or the pool is empty."""
        if not self._within_quota(1):
            return None
        try:
            page_id = self._add_local(self._take_pages(1)[0])
        except NeedPages:
            return None
        sequence.page_ids.append(page_id)
        sequence.physical_ids = None
        return page_id

    def _drop_last_page(self, sequence: PageSequence, page_id: int | None) -> None:
        """Under the lock: `page_id` (None: nothing) off the sequence's end if it is still there,
        and released."""
        if page_id is not None and sequence.page_ids and sequence.page_ids[-1] == page_id:
            sequence.page_ids.pop()
            sequence.physical_ids = None
            self._drop_local(page_id)

    def _decode_step(self, sequence: PageSequence, token_id: int, position: int,
                     last_page_len: int, sampler: SamplerSpec, pinned: bool = True,
                     fed: bool = False) -> PreparedForward | None:
        """Under the lock: the early route of a decode step: a valid shape, no hidden slots, a
        tail page of this instance alone. None: anything else (the general route checks,
        copies or traps). The step is recorded (host/kv/page_log.py)."""
        page_ids, page_size = sequence.page_ids, self.page_size
        if (not page_ids or not 1 <= last_page_len <= page_size or self._num_masked_pages
                or (self.vocab_size is not None and token_id >= self.vocab_size)):
            return None
        if (self.max_kv_len is not None      # the KV length, inline: page_ids is not empty
                and (len(page_ids) - 1) * page_size + last_page_len > self.max_kv_len):
            return None
        tail = self._pages[page_ids[-1]]
        if tail.read_only or self.allocator.refcount(tail.physical_id) > 1:
            return None                   # the general route traps (read-only) or copies it
        request = ForwardRequest.decode_step(token_id, position, self._physical_ids(sequence),
                                             last_page_len, sampler, sequence.adapter)
        if fed or sequence.adapter is not None:      # the base model cannot recompute it
            self._logs.dirty(page_ids[-1])
        else:
            self._logs.note_step(sequence, page_ids, sequence.layout, token_id, position,
                                 last_page_len)
        return PreparedForward(request, (), self._pin() if pinned else None)

    def _prepare_general(self, call: str, sequence_id: int, token_ids: Sequence[int],
                         positions: Sequence[int], last_page_len: int,
                         output_indices: Sequence[int], samplers: Sequence[SamplerSpec],
                         mask: Sequence[Sequence[int]] | None, fed: bool = False
                         ) -> PreparedForward:
        """Under the lock: the general route of prepare. NeedPages when a copy-on-write lacks
        pages (nothing changed then). The pass is recorded (host/kv/page_log.py)."""
        sequence = self._sequence(call, sequence_id)
        num_tokens = len(token_ids)
        kv_len = self._check_pass_shape(call, sequence, token_ids, positions, last_page_len,
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
            for other in self._sequences.values():
                other.physical_ids = None
        if self._num_masked_pages:
            masks = [self._pages[pid].mask_row for pid in sequence.page_ids]
            rows = fold_hidden(rows, num_tokens, kv_len,
                               hidden_intervals(masks, self.page_size, kv_len))
        request = ForwardRequest(tuple(token_ids), tuple(positions), self._physical_ids(sequence),
                                 last_page_len, tuple(output_indices), tuple(samplers), rows,
                                 adapter=sequence.adapter)
        self._logs.note_pass(sequence, sequence.page_ids, sequence.layout, first_slot,
                             token_ids, positions,
                             plain=rows is None and not fed and sequence.adapter is None)
        return PreparedForward(request, tuple(copies), on_done)

    def _physical_ids(self, sequence: PageSequence) -> tuple[int, ...]:
        """Under the lock: the sequence's pool pages, cached until the sequence changes."""
        if sequence.physical_ids is None:
            sequence.physical_ids = tuple(self._pages[pid].physical_id
                                          for pid in sequence.page_ids)
        return sequence.physical_ids

    def _check_pass_shape(self, call: str, sequence: PageSequence, token_ids: Sequence[int],
                          positions: Sequence[int], last_page_len: int,
                          output_indices: Sequence[int], samplers: Sequence[SamplerSpec]) -> int:
        """The pass's KV length, after trapping on any argument a pass may not have."""
        num_tokens = len(token_ids)
        if num_tokens == 0:
            raise TrapError(f"{call}: no input tokens")
        if self.vocab_size is not None and max(token_ids) >= self.vocab_size:
            raise TrapError(f"{call}: token id {max(token_ids)} outside the vocabulary "
                            f"(0..{self.vocab_size - 1})")
        if len(positions) != num_tokens:
            raise TrapError(f"{call}: {len(positions)} positions for {num_tokens} tokens")
        if not sequence.page_ids:
            raise TrapError(f"{call}: the sequence has no pages")
        if not 1 <= last_page_len <= self.page_size:
            raise TrapError(f"{call}: last-page-len {last_page_len} outside 1..{self.page_size}")
        num_slots = paged_kv_len(len(sequence.page_ids), last_page_len, self.page_size)
        if self.max_kv_len is not None and num_slots > self.max_kv_len:
            raise TrapError(f"{call}: the pass spans {num_slots} KV slots "
                            f"({len(sequence.page_ids)} pages), more than the model's context "
                            f"length {self.max_kv_len}")
        if num_tokens > num_slots:
            raise TrapError(f"{call}: {num_tokens} tokens but the pages hold {num_slots}")
        if len(samplers) != len(output_indices):
            raise TrapError(f"{call}: {len(samplers)} samplers for "
                            f"{len(output_indices)} output indices")
        for index in output_indices:
            if not 0 <= index < num_tokens:
                raise TrapError(f"{call}: output index {index} outside 0..{num_tokens - 1}")
        return num_slots

    # ------------------------------------------------------------- references
    def _add_local(self, physical_id: int, read_only: bool = False,
                   mask_row: MaskRow | None = None) -> int:
        """Under the lock: a new local id holding one (already taken) reference on the page."""
        page_id = self._next_page_id
        self._next_page_id += 1
        self._pages[page_id] = LocalPage(physical_id, read_only, mask_row)
        if mask_row is not None:
            self._num_masked_pages += 1
        return page_id

    def _drop_local(self, page_id: int) -> None:
        """Under the lock: drop a local id and return its reference."""
        page = self._pages.pop(page_id)
        self._logs.drop(page_id)
        if page.mask_row is not None:
            self._num_masked_pages -= 1
        if page.physical_id != SWAPPED:   # a swapped one's host copy is skipped by swap_in
            self._release_physical(page.physical_id)

    def _release_physical(self, physical_id: int) -> None:
        """Under the lock: return one reference, once the submissions pinned so far are done."""
        if self._pins_in_flight:
            # Submissions pinned so far (ids < _next_pin_id) may still touch the page.
            self._deferred.append((self._next_pin_id - 1, physical_id))
        else:
            self.allocator.release((physical_id,))

    def _pin(self) -> Callable[[], None]:
        """Under the lock: count one submission in flight; the returned callback (idempotent)
        ends it. Pages released while it is in flight return to the pool only once it is done."""
        pin_id = self._next_pin_id
        self._next_pin_id += 1
        self._pins_in_flight.add(pin_id)

        def on_done() -> None:
            with self._lock:
                if pin_id not in self._pins_in_flight:
                    return
                self._pins_in_flight.discard(pin_id)
                if self._deferred:          # else nothing to flush, and nobody waits
                    self._flush_deferred()
                    self._pins_done.notify_all()
                elif self._suspension is not None and not self._pins_in_flight:
                    self._pins_done.notify_all()       # wait_drained
        return on_done

    def _flush_deferred(self) -> None:
        """Under the lock: release the deferred pages whose pinned submissions have all ended."""
        oldest = min(self._pins_in_flight, default=self._next_pin_id)
        ready = []
        while self._deferred and self._deferred[0][0] < oldest:
            ready.append(self._deferred.popleft()[1])
        if ready and not self._closed:
            self.allocator.release(ready)

    def _pages_to_copy(self, call: str, page_ids: Sequence[int]) -> list[int]:
        """The distinct pages among `page_ids` that a write must copy first (shared with another
        id, an export or another instance). Traps on an imported (read-only) page."""
        result = []
        for page_id in page_ids:
            page = self._pages[page_id]
            if page.read_only:
                raise TrapError(f"{call}: page id {page_id} is read-only (imported); copy its "
                                f"tokens into a page of your own to extend it")
            if self.allocator.refcount(page.physical_id) > 1 and page_id not in result:
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

    # ---------------------------------------------------------------- reclaim
    def _take_pages(self, num_pages: int) -> list[int]:
        """Pool pages without reclaim (we hold our lock); NeedPages asks `_with_reclaim` to
        reclaim outside the lock and retry."""
        if not num_pages:
            return []
        if self._reserve:
            return self._take_reserved(num_pages)
        try:
            return self.allocator.allocate(num_pages)
        except OutOfPagesError:
            raise NeedPages(num_pages) from None

    def _take_reserved(self, num_pages: int) -> list[int]:
        """Under the lock: `num_pages` pool pages, the handed-over ones first (the rest of
        them returned to the pool); NeedPages, keeping the reserve, when the pool lacks the
        others."""
        taken = self._reserve[:num_pages]
        if len(taken) < num_pages:
            try:
                taken += self.allocator.allocate(num_pages - len(taken))
            except OutOfPagesError:
                raise NeedPages(num_pages - len(taken)) from None
        leftover, self._reserve = self._reserve[num_pages:], []
        if leftover:
            self.allocator.release(leftover)
        return taken

    def _with_reclaim(self, call: str, prepare: Callable[[], _T]) -> _T:
        """Run `prepare` under the lock; when it needs pages the pool lacks, reclaim (outside
        our lock: the runtime may lock other instances) and retry."""
        while True:
            with self._lock:
                self._wait_resident(call)
                try:
                    return prepare()
                except NeedPages as need:
                    num_pages = need.num_pages
            self._reclaim_or_raise(call, num_pages)

    def _allocate_physical(self, call: str, num_pages: int) -> list[int]:
        """Pool pages, reclaiming when the pool is short. Called without the lock."""
        while True:
            try:
                with self._lock:
                    return self._take_pages(num_pages)
            except NeedPages as need:
                self._reclaim_or_raise(call, need.num_pages)
            with self._lock:              # suspended meanwhile: wait for the restore first
                self._wait_resident(call)

    def _reclaim_or_raise(self, call: str, num_pages: int) -> None:
        """Make room for a retry, or raise OutOfPagesError. Pages this instance released that
        are still pinned by its own in-flight submissions come first (the engine is about to
        return them); only then are other instances reclaimed."""
        if self._wait_for_deferred():
            return
        if self._reclaim is None or not self._reclaim(num_pages):
            stats = self.allocator.statistics()
            raise OutOfPagesError(f"{call}: out of KV pages: {num_pages} asked, "
                                  f"{stats.num_free} free of {stats.num_pages}")

    def _wait_for_deferred(self) -> bool:
        """Wait (at most DEFERRED_WAIT_S) for some deferred releases of this instance to reach
        the pool. True when some did. Called without the lock held by this thread."""
        deadline = time.monotonic() + DEFERRED_WAIT_S
        with self._lock:
            num_before = len(self._deferred)
            while self._deferred and len(self._deferred) == num_before and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._pins_done.wait(remaining)
            return len(self._deferred) < num_before

    # ----------------------------------------------------------------- checks
    def _check_open(self, call: str) -> None:
        if self._closed:
            raise TrapError(f"{call}: instance {self.instance_id} was released")

    def _within_quota(self, num_new: int) -> bool:
        """Whether `num_new` more local pages stay within the quota."""
        return len(self._pages) + num_new <= self.page_quota

    def _check_quota(self, call: str, num_new: int) -> None:
        if num_new < 0:
            raise TrapError(f"{call}: negative page count {num_new}")
        if not self._within_quota(num_new):
            raise QuotaError(f"{call}: {num_new} pages asked, quota {self.page_quota} "
                             f"(holding {len(self._pages)})")

    def _page(self, call: str, page_id: int) -> LocalPage:
        page = self._pages.get(page_id)
        if page is None:
            if 0 <= page_id < self._next_page_id:
                raise TrapError(f"{call}: page id {page_id} was already freed")
            raise TrapError(f"{call}: unknown page id {page_id}")
        return page

    def _check_page_ids(self, call: str, page_ids: Sequence[int],
                        allow_repeats: bool = False) -> None:
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

    def _sequence(self, call: str, sequence_id: int) -> PageSequence:
        sequence = self._sequences.get(sequence_id)
        if sequence is None:
            raise TrapError(f"{call}: unknown sequence id {sequence_id}")
        return sequence
