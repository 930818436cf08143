"""Per-instance resource tables: local page / sequence ids -> physical pages of the shared pool.

An instance names pages by u32 ids local to it; `InstancePages` translates and checks them, so
a forged, stale or double-freed id is a `TrapError` naming the call and the id, and no instance can
reach another's pages. Each local page id holds exactly one pool reference; sharing, exporting and
importing add references (no copy) and a forward pass that writes into a page with other references
first copies it (copy-on-write), so sharers never see each other's writes.

Accounting (host/kv/page_ledger.py): every pool reference is taken in one place and returned in one
place; a page released while a submission that may still touch it is in flight returns to the pool
when that submission is done (`on_done`), and `release_all` returns everything.
"""
from __future__ import annotations

from typing import Sequence

from engine.batch import ForwardRequest, SamplerSpec, TokenCopy
from engine.paging import kv_len as paged_kv_len
from host.errors import TrapError
from host.kv.allocator import PageAllocator
from host.kv.exports import ExportRegistry
from host.kv.masks import check_mask_rows, fold_hidden, hidden_intervals, mask_page_slots
from host.kv.page_ledger import NeedPages, PageLedger, PageSequence, ReclaimHook
from host.scheduling.work import PreparedCopy, PreparedForward

__all__ = ["InstancePages", "MAX_EXPORT_NAME_CHARS", "MAX_SEQUENCES"]

MAX_EXPORT_NAME_CHARS = 256
MAX_SEQUENCES = 65536          # per instance, at once


class InstancePages:
    """The page and sequence tables of one instance. Thread-safe (the runtime may call
    `release_all` from another thread while the instance runs).

    Quota: every local page id (allocated, shared or imported) counts against `page_quota`.
    reclaim: called with the number of pages needed when the pool is empty; the runtime terminates
    newer instances and returns True once it has returned pages to the pool (False: nothing to
    reclaim). Allocation then retries; with nothing to reclaim it raises OutOfPagesError.
    vocab_size: when given, forward.submit traps on a token id outside the vocabulary.
    max_kv_len: when given, forward.submit traps on a pass over more KV slots than this (the
    model's context length): a sequence listing one page thousands of times would otherwise make
    one pass read that many slots and stall every other instance's batch.
    """

    def __init__(self, allocator: PageAllocator, exports: ExportRegistry, *, instance_id: str,
                 tenant: str, page_quota: int, page_size: int,
                 reclaim: ReclaimHook | None = None, vocab_size: int | None = None,
                 max_kv_len: int | None = None) -> None:
        self.ledger = PageLedger(allocator, exports, instance_id=instance_id, tenant=tenant,
                                 page_quota=page_quota, page_size=page_size, reclaim=reclaim)
        self.vocab_size = vocab_size      # None: token ids are not checked here
        self.max_kv_len = max_kv_len      # None: no bound on a pass's KV length

    @property
    def page_quota(self) -> int:
        return self.ledger.page_quota

    @property
    def page_size(self) -> int:
        return self.ledger.page_size

    @property
    def num_pages_held(self) -> int:
        return self.ledger.num_pages_held

    @property
    def closed(self) -> bool:
        return self.ledger.closed

    def physical_ids(self) -> set[int]:
        """The distinct pool pages this instance holds (PageLedger.physical_ids)."""
        return self.ledger.physical_ids()

    def release_all(self) -> None:
        """Return every page reference; later calls trap (PageLedger.release_all)."""
        self.ledger.release_all()

    # ------------------------------------------------------------------ pages
    def allocate_pages(self, num_pages: int) -> list[int]:
        """New local ids on fresh pool pages (lowest physical ids first). QuotaError over the
        quota; OutOfPagesError when the pool stays short after waiting for this instance's own
        pending releases and after the reclaim hook."""
        call = "kv.allocate-pages"
        with self.ledger.lock:
            self.ledger.check_open(call)
            self.ledger.check_quota(call, num_pages)
        physical_ids = self.ledger.allocate_physical(call, num_pages)
        with self.ledger.lock:      # re-checked: the pool was reached without our lock
            try:
                self.ledger.check_open(call)
                self.ledger.check_quota(call, num_pages)
            except TrapError:
                self.ledger.allocator.release(physical_ids)
                raise
            return [self.ledger.add_local(pid) for pid in physical_ids]

    def free_pages(self, page_ids: Sequence[int]) -> None:
        """Drop local ids (removing them from every sequence that lists them)."""
        call = "kv.free-pages"
        with self.ledger.lock:
            self.ledger.check_open(call)
            self.ledger.check_page_ids(call, page_ids)
            dropped = set(page_ids)
            for sequence in self.ledger.sequences.values():
                if any(pid in dropped for pid in sequence.page_ids):
                    sequence.page_ids = [pid for pid in sequence.page_ids if pid not in dropped]
                    sequence.physical_ids = None
            for page_id in page_ids:
                self.ledger.drop_local(page_id)

    def share_pages(self, page_ids: Sequence[int]) -> list[int]:
        """New local ids on the same physical pages (read-only flag and hidden slots carried over)."""
        call = "kv.share-pages"
        with self.ledger.lock:
            self.ledger.check_open(call)
            self.ledger.check_page_ids(call, page_ids, allow_repeats=True)
            self.ledger.check_quota(call, len(page_ids))
            pages = [self.ledger.pages[pid] for pid in page_ids]
            self.ledger.allocator.retain([page.physical_id for page in pages])
            return [self.ledger.add_local(page.physical_id, page.read_only, page.mask_row)
                    for page in pages]

    def mask_tokens(self, page_id: int, offset: int, num_tokens: int, masked: bool) -> None:
        """Hide / show slots of a page for later passes that read it through this id."""
        call = "kv.mask-tokens"
        with self.ledger.lock:
            self.ledger.check_open(call)
            page = self.ledger.page(call, page_id)
            self.ledger.check_slots(call, offset, num_tokens)
            before = page.mask_row
            page.mask_row = mask_page_slots(before, self.ledger.page_size, offset, num_tokens,
                                            masked)
            self.ledger.num_masked_pages += (page.mask_row is not None) - (before is not None)

    def copy_tokens_request(self, src_page_id: int, dst_page_id: int, src_offset: int,
                            dst_offset: int, num_tokens: int) -> PreparedCopy:
        """Check and translate kv.copy-tokens. A shared destination is copied whole first (COW);
        an imported one traps. Submit the result with `BatchScheduler.submit_copy`."""
        call = "kv.copy-tokens"
        return self.ledger.with_reclaim(call, lambda: self._prepare_copy_locked(
            call, src_page_id, dst_page_id, src_offset, dst_offset, num_tokens))

    def _prepare_copy_locked(self, call: str, src_page_id: int, dst_page_id: int,
                             src_offset: int, dst_offset: int, num_tokens: int) -> PreparedCopy:
        src = self.ledger.page(call, src_page_id)
        self.ledger.page(call, dst_page_id)
        self.ledger.check_slots(call, src_offset, num_tokens)
        self.ledger.check_slots(call, dst_offset, num_tokens)
        cow_ids = self.ledger.pages_to_copy(call, [dst_page_id])
        new_ids = self.ledger.take_pages(len(cow_ids))
        on_done = self.ledger.pin()
        copies = self.ledger.copy_on_write(cow_ids, new_ids, [self.ledger.page_size])
        copies.append(TokenCopy(src.physical_id, self.ledger.pages[dst_page_id].physical_id,
                                src_offset, dst_offset, num_tokens))
        return PreparedCopy(tuple(copies), on_done)

    # ---------------------------------------------------------------- exports
    def export_pages(self, name: str, page_ids: Sequence[int], persistent: bool) -> str | None:
        """Publish pages under `name` in this tenant. None on success, else the reason."""
        call = "kv.export-pages"
        with self.ledger.lock:
            self.ledger.check_open(call)
            if not 0 < len(name) <= MAX_EXPORT_NAME_CHARS:
                return f"export name must have 1..{MAX_EXPORT_NAME_CHARS} characters"
            self.ledger.check_page_ids(call, page_ids)
            physical_ids = [self.ledger.pages[pid].physical_id for pid in page_ids]
            return self.ledger.exports.publish(self.ledger.tenant, name, physical_ids,
                                        owner_id=self.ledger.instance_id, persistent=persistent)

    def import_pages(self, name: str) -> list[int] | str:
        """New read-only local ids sharing an export's pages, or the reason it failed."""
        call = "kv.import-pages"
        with self.ledger.lock:
            self.ledger.check_open(call)
            physical_ids = self.ledger.exports.acquire(self.ledger.tenant, name)
            if physical_ids is None:
                return f"export {name!r} not found"
            if len(self.ledger.pages) + len(physical_ids) > self.ledger.page_quota:
                self.ledger.allocator.release(physical_ids)
                self.ledger.check_quota(call, len(physical_ids))     # raises QuotaError
            return [self.ledger.add_local(pid, read_only=True) for pid in physical_ids]

    def list_exports(self) -> list[str]:
        return self.ledger.exports.names(self.ledger.tenant)

    def release_export(self, name: str) -> str | None:
        with self.ledger.lock:
            self.ledger.check_open("kv.release-export")
            return self.ledger.exports.release(self.ledger.tenant, name, self.ledger.instance_id)

    # -------------------------------------------------------------- sequences
    def create_sequence(self) -> int:
        with self.ledger.lock:
            self.ledger.check_open("kv.create-sequence")
            if len(self.ledger.sequences) >= MAX_SEQUENCES:
                raise TrapError(f"kv.create-sequence: {MAX_SEQUENCES} sequences already exist; "
                                f"destroy some first")
            sequence_id = self.ledger.next_sequence_id
            self.ledger.next_sequence_id += 1
            self.ledger.sequences[sequence_id] = PageSequence()
            return sequence_id

    def sequence_append(self, sequence_id: int, page_ids: Sequence[int]) -> None:
        call = "kv.sequence-append"
        with self.ledger.lock:
            self.ledger.check_open(call)
            sequence = self.ledger.sequence(call, sequence_id)
            self.ledger.check_page_ids(call, page_ids, allow_repeats=True)
            sequence.page_ids.extend(page_ids)
            sequence.physical_ids = None

    def sequence_remove(self, sequence_id: int, index: int, count: int) -> None:
        call = "kv.sequence-remove"
        with self.ledger.lock:
            self.ledger.check_open(call)
            sequence = self.ledger.sequence(call, sequence_id)
            size = len(sequence.page_ids)
            if index < 0 or count < 0 or index + count > size:
                raise TrapError(f"{call}: range [{index}, {index + count}) outside sequence "
                                f"{sequence_id} of {size} pages")
            del sequence.page_ids[index:index + count]
            sequence.physical_ids = None

    def sequence_pages(self, sequence_id: int) -> list[int]:
        with self.ledger.lock:
            self.ledger.check_open("kv.sequence-pages")
            return list(self.ledger.sequence("kv.sequence-pages", sequence_id).page_ids)

    def destroy_sequence(self, sequence_id: int) -> None:
        with self.ledger.lock:
            self.ledger.check_open("kv.destroy-sequence")
            self.ledger.sequence("kv.destroy-sequence", sequence_id)
            del self.ledger.sequences[sequence_id]

    # ---------------------------------------------------------------- forward
    def prepare_forward(self, sequence_id: int, token_ids: Sequence[int],
                        positions: Sequence[int], last_page_len: int,
                        output_indices: Sequence[int], samplers: Sequence[SamplerSpec],
                        mask: Sequence[Sequence[int]] | None = None, *,
                        call: str = "forward.submit") -> PreparedForward:
        """Check a forward.submit over a sequence and translate it to an engine request.

        The pass writes kv slots [kv_len - num_tokens, kv_len), kv_len = (num_pages - 1) *
        page_size + last_page_len. Those pages must be writable: an imported page traps, a
        shared one is copied first (its slots before the write) and remapped for this instance
        only. Hidden slots (mask-tokens) are folded into the mask rows; with none and no guest
        mask the request has mask=None. Without a remap or a mask the work is O(num_tokens).
        """
        if (mask is None and len(token_ids) == 1 and len(positions) == 1
                and len(output_indices) == 1 and output_indices[0] == 0 and len(samplers) == 1):
            with self.ledger.lock:                    # a decode step: the common case first
                self.ledger.check_open(call)
                prepared = self._decode_step_locked(self.ledger.sequence(call, sequence_id),
                                                    token_ids[0], positions[0], last_page_len,
                                                    samplers[0])
            if prepared is not None:
                return prepared
        return self.ledger.with_reclaim(call, lambda: self._prepare_forward_locked(
            call, sequence_id, token_ids, positions, last_page_len, output_indices, samplers,
            mask))

    def prepare_decode_step(self, sequence_id: int, token_id: int, position: int,
                            last_page_len: int, sampler: SamplerSpec, grow: bool,
                            general: bool = True, pinned: bool = True
                            ) -> tuple[PreparedForward, int | None] | None:
        """A decode loop's next pass (one token, its output sampled): prepare_forward without
        reclaim, for the thread that resolved the previous pass (it must not wait for pages).
        `grow`: a new page (the instance's, within its quota) joins the end of the sequence
        first; returns (the pass, that page's local id or None). None, with nothing changed,
        when the quota is reached or the pool or a copy-on-write is short of pages (the loop
        ends; the guest's own allocation may reclaim or trap), or, `general` False, when the
        common route declines (a copy, a mask, ...). TrapError as prepare_forward. `pinned`
        False: no pin of its own (a chained step: the chain's first pass holds one)."""
        call, new_page_id = "forward.submit-decode", None
        with self.ledger.lock:
            self.ledger.check_open(call)
            sequence = self.ledger.sequence(call, sequence_id)
            if grow:
                if not self.ledger.within_quota(1):
                    return None
                try:
                    new_page_id = self.ledger.add_local(self.ledger.take_pages(1)[0])
                except NeedPages:
                    return None
                sequence.page_ids.append(new_page_id)
                sequence.physical_ids = None
            try:
                prepared = (self._decode_step_locked(sequence, token_id, position, last_page_len,
                                                     sampler, pinned)
                            or general and self._prepare_forward_locked(
                                call, sequence_id, (token_id,), (position,), last_page_len, (0,),
                                (sampler,), None))
            except NeedPages:
                prepared = None
            except TrapError:
                self._drop_last_page_locked(sequence, new_page_id)
                raise
            if not prepared:             # short of pages, or (general False) the route declined
                self._drop_last_page_locked(sequence, new_page_id)
                return None
            return prepared, new_page_id

    def undo_decode_grow(self, sequence_id: int, page_id: int) -> None:
        """Give back a page prepare_decode_step added for a pass whose output did not count,
        if it is still the sequence's last (and the instance has not ended)."""
        with self.ledger.lock:
            sequence = self.ledger.sequences.get(sequence_id)   # None: destroyed, or ended
            if sequence is not None:
                self._drop_last_page_locked(sequence, page_id)

    def _drop_last_page_locked(self, sequence: PageSequence, page_id: int | None) -> None:
        """`page_id` (None: nothing) off the sequence's end if it is still there, and released."""
        if page_id is not None and sequence.page_ids and sequence.page_ids[-1] == page_id:
            sequence.page_ids.pop()
            sequence.physical_ids = None
            self.ledger.drop_local(page_id)

    def _decode_step_locked(self, sequence: PageSequence, token_id: int, position: int,
                            last_page_len: int, sampler: SamplerSpec, pinned: bool = True
                            ) -> PreparedForward | None:
        """The common decode step without prepare_forward's generality: a valid shape, no
        hidden slots, a tail page of this instance alone. None: anything else (the general path
        checks, copies or traps)."""
        ledger, page_ids = self.ledger, sequence.page_ids
        if (not page_ids or not 1 <= last_page_len <= ledger.page_size or ledger.num_masked_pages
                or (self.vocab_size is not None and token_id >= self.vocab_size)):
            return None
        if (self.max_kv_len is not None
                and paged_kv_len(len(page_ids), last_page_len, ledger.page_size) > self.max_kv_len):
            return None
        tail = ledger.pages[page_ids[-1]]
        if tail.read_only or ledger.allocator.refcount(tail.physical_id) > 1:
            return None                   # the general path traps (read-only) or copies it
        return PreparedForward(ForwardRequest.decode_step(
            token_id, position, self._physical_ids(sequence), last_page_len, sampler), (),
            ledger.pin() if pinned else None)

    def _prepare_forward_locked(self, call: str, sequence_id: int, token_ids: Sequence[int],
                                positions: Sequence[int], last_page_len: int,
                                output_indices: Sequence[int], samplers: Sequence[SamplerSpec],
                                mask: Sequence[Sequence[int]] | None) -> PreparedForward:
        sequence = self.ledger.sequence(call, sequence_id)
        num_tokens = len(token_ids)
        kv_len = self._check_pass_shape(call, sequence, token_ids, positions, last_page_len,
                                        output_indices, samplers)
        rows = None if mask is None else check_mask_rows(mask, num_tokens, kv_len, call)
        first_slot = kv_len - num_tokens
        first_index = first_slot // self.ledger.page_size
        tail_ids = sequence.page_ids[first_index:]
        cow_ids = self.ledger.pages_to_copy(call, tail_ids)
        new_ids = self.ledger.take_pages(len(cow_ids))      # the last step that may fail
        on_done = self.ledger.pin()
        copies: list[TokenCopy] = []
        if cow_ids:
            first_offset = first_slot - first_index * self.ledger.page_size
            offsets = [first_offset if pid == tail_ids[0] else 0 for pid in cow_ids]
            copies = self.ledger.copy_on_write(cow_ids, new_ids, offsets)
            self.ledger.invalidate_sequences()
        if self.ledger.num_masked_pages:
            masks = [self.ledger.pages[pid].mask_row for pid in sequence.page_ids]
            rows = fold_hidden(rows, num_tokens, kv_len,
                               hidden_intervals(masks, self.ledger.page_size, kv_len))
        request = ForwardRequest(tuple(token_ids), tuple(positions), self._physical_ids(sequence),
                                 last_page_len, tuple(output_indices), tuple(samplers), rows)
        return PreparedForward(request, tuple(copies), on_done)

    def _physical_ids(self, sequence: PageSequence) -> tuple[int, ...]:
        """Under the lock: the sequence's pool pages, cached until the sequence changes."""
        if sequence.physical_ids is None:
            sequence.physical_ids = tuple(self.ledger.pages[pid].physical_id
                                          for pid in sequence.page_ids)
        return sequence.physical_ids

    def _check_pass_shape(self, call: str, sequence: PageSequence, token_ids: Sequence[int],
                          positions: Sequence[int], last_page_len: int,
                          output_indices: Sequence[int], samplers: Sequence[SamplerSpec]) -> int:
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
        if not 1 <= last_page_len <= self.ledger.page_size:
            raise TrapError(f"{call}: last-page-len {last_page_len} outside 1..{self.ledger.page_size}")
        num_slots = paged_kv_len(len(sequence.page_ids), last_page_len, self.ledger.page_size)
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

