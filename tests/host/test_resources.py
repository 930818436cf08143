"""Per-instance page tables over a shared pool: ids, quota, sharing, copy-on-write, exports,
masks, accounting. Tiny pools (8 pages of 4 tokens) and exact page ids."""
from __future__ import annotations

import threading
import time

import pytest

from engine.batch import GREEDY, TokenCopy
from host.errors import OutOfPagesError, QuotaError, TrapError
from host.kv import ExportRegistry, InstancePages, PageAllocator, PageStats

START = PageStats(num_pages=8, num_free=8, num_used=0, num_shared=0)


def fill(resources, page_ids, num_tokens):
    """A sequence over page_ids whose first pass writes num_tokens tokens; returns (seq, prepared)."""
    seq = resources.create_sequence()
    resources.sequence_append(seq, page_ids)
    last = (num_tokens - 1) % 4 + 1
    prepared = resources.prepare(seq, list(range(1, num_tokens + 1)),
                                 list(range(num_tokens)), last, [num_tokens - 1], [GREEDY])
    return seq, prepared


def test_pool_allocates_lowest_ids_and_counts(pool):
    assert pool.allocate(3) == [0, 1, 2]
    pool.retain([1])
    assert pool.statistics() == PageStats(8, 5, 3, 1)
    pool.release([0, 1])
    assert pool.allocate(1) == [0]
    with pytest.raises(ValueError, match="page 7 is free"):
        pool.release([7])
    with pytest.raises(OutOfPagesError, match="out of KV pages: 9 asked, 5 free of 8"):
        pool.allocate(9)
    assert pool.statistics() == PageStats(8, 5, 3, 0)


def test_allocate_maps_local_ids_to_physical(make_resources, pool):
    a, b = make_resources("a"), make_resources("b")
    assert a.allocate_pages(2) == [0, 1]
    assert b.allocate_pages(1) == [0]            # local ids are per instance
    seq, prepared = fill(b, [0], 3)
    assert prepared.request.page_ids == (2,)     # b's page 0 is physical 2
    assert a.num_pages_held == 2 and pool.statistics().num_used == 3


def test_quota_counts_every_local_id(make_resources, pool):
    a = make_resources(page_quota=3)
    a.allocate_pages(2)
    with pytest.raises(QuotaError, match=r"kv.allocate-pages: 2 pages asked, quota 3 \(holding 2\)"):
        a.allocate_pages(2)
    with pytest.raises(QuotaError, match="kv.share-pages: 2 pages asked, quota 3"):
        a.share_pages([0, 1])
    b = make_resources("b")
    assert b.export_pages("two", b.allocate_pages(2), persistent=False) is None
    with pytest.raises(QuotaError, match=r"kv.import-pages: 2 pages asked, quota 3 \(holding 2\)"):
        a.import_pages("two")
    assert pool.statistics().num_used == 4 and pool.refcount(2) == 2   # b + its export


def test_forged_stale_and_double_free_trap_and_lose_nothing(make_resources, pool):
    a = make_resources()
    a.allocate_pages(2)
    with pytest.raises(TrapError, match="kv.free-pages: unknown page id 99"):
        a.free_pages([0, 99])
    a.free_pages([0])
    with pytest.raises(TrapError, match="kv.free-pages: page id 0 was already freed"):
        a.free_pages([0])
    with pytest.raises(TrapError, match="kv.free-pages: page id 1 listed twice"):
        a.free_pages([1, 1])
    with pytest.raises(TrapError, match="kv.share-pages: page id 0 was already freed"):
        a.share_pages([0])
    with pytest.raises(TrapError, match="kv.mask-tokens: unknown page id 5"):
        a.mask_tokens(5, 0, 1, True)
    assert a.num_pages_held == 1 and pool.statistics().num_used == 1
    assert a.allocate_pages(1) == [2]            # ids are never reused


def test_out_of_pages_without_reclaim(make_resources, pool):
    a = make_resources(page_quota=16)
    a.allocate_pages(6)
    with pytest.raises(OutOfPagesError, match="kv.allocate-pages: out of KV pages: 3 asked, 2 free"):
        a.allocate_pages(3)
    assert pool.statistics().num_free == 2


def test_reclaim_hook_frees_pages_then_allocation_retries(make_resources, pool):
    calls = []
    newer = make_resources("newer")
    newer.allocate_pages(5)

    def reclaim(num_pages):
        calls.append(num_pages)
        if newer.closed:
            return False
        newer.release_all()
        return True

    older = make_resources("older", reclaim=reclaim)
    assert older.allocate_pages(6) == [0, 1, 2, 3, 4, 5]
    assert calls == [6]
    make_resources("other").allocate_pages(2)
    with pytest.raises(OutOfPagesError, match="out of KV pages: 1 asked, 0 free of 8"):
        older.allocate_pages(1)
    assert calls == [6, 1]


def test_share_then_write_copies_on_write(make_resources, pool):
    a = make_resources()
    pages = a.allocate_pages(2)
    seq, prepared = fill(a, pages, 5)            # page 0 full, page 1 holds 1 token
    prepared.on_done()
    fork = a.share_pages(pages)
    assert fork == [2, 3] and pool.refcount(0) == 2 and pool.refcount(1) == 2
    fork_seq = a.create_sequence()
    a.sequence_append(fork_seq, fork)
    step = a.prepare(fork_seq, [9], [5], 2, [0], [GREEDY])
    assert step.copies == (TokenCopy(src_page_id=1, dst_page_id=2, src_offset=0, dst_offset=0,
                                     num_tokens=1),)
    assert step.request.page_ids == (0, 2)       # fork remapped its last page only
    assert pool.refcount(1) == 2                 # old page kept until the copy has run
    step.on_done()
    assert pool.refcount(1) == 1 and pool.refcount(0) == 2
    original = a.prepare(seq, [8], [5], 2, [0], [GREEDY])
    assert original.copies == () and original.request.page_ids == (0, 1)   # untouched
    original.on_done()
    a.release_all()
    assert pool.statistics() == START


def test_cow_over_two_shared_tail_pages(make_resources, pool):
    a = make_resources()
    pages = a.allocate_pages(3)
    seq, prepared = fill(a, pages[:2], 6)
    prepared.on_done()
    fork = a.share_pages(pages[:2]) + [pages[2]]
    fork_seq = a.create_sequence()
    a.sequence_append(fork_seq, fork)
    # writes positions 6..9: slots 2,3 of page 1 (shared) and 0,1 of page 2 (own)
    step = a.prepare(fork_seq, [1, 2, 3, 4], [6, 7, 8, 9], 2, [3], [GREEDY])
    assert step.copies == (TokenCopy(1, 3, 0, 0, 2),)
    assert step.request.page_ids == (0, 3, 2)


def test_writing_into_imported_page_traps(make_resources):
    a, b = make_resources("a"), make_resources("b")
    pages = a.allocate_pages(1)
    seq, prepared = fill(a, pages, 2)
    assert a.export_pages("prefix", pages, persistent=False) is None
    imported = b.import_pages("prefix")
    assert imported == [0]
    own = b.allocate_pages(1)
    b_seq = b.create_sequence()
    b.sequence_append(b_seq, imported + own)
    assert b.prepare(b_seq, [5], [4], 1, [0], [GREEDY]).request.page_ids == (0, 1)
    with pytest.raises(TrapError, match="forward.submit: page id 0 is read-only"):
        b.prepare(b_seq, [5, 6, 7], [2, 3, 4], 1, [0], [GREEDY])
    with pytest.raises(TrapError, match="kv.copy-tokens: page id 2 is read-only"):
        b.copy_tokens_request(1, b.share_pages(imported)[0], 0, 0, 1)


def test_exports_are_namespaced_by_tenant(make_resources):
    a, b, other = make_resources("a"), make_resources("b"), make_resources("c", tenant="u")
    a.export_pages("shared", a.allocate_pages(1), persistent=False)
    assert b.list_exports() == ["shared"] and other.list_exports() == []
    assert other.import_pages("shared") == "export 'shared' not found"
    assert b.export_pages("shared", b.allocate_pages(1), False) == "export name 'shared' is taken"
    assert other.export_pages("shared", other.allocate_pages(1), False) is None
    assert a.export_pages("", [0], False) == "export name must have 1..256 characters"


def test_export_count_is_limited_per_tenant(pool):
    registry = ExportRegistry(pool, max_exports_per_namespace=2)
    (page,) = pool.allocate(1)
    assert registry.publish("t", "a", [page], owner_id="x", persistent=False) is None
    assert registry.publish("u", "a", [page], owner_id="y", persistent=False) is None
    assert registry.publish("t", "b", [page], owner_id="x", persistent=False) is None
    assert registry.publish("t", "c", [page], owner_id="x", persistent=False).startswith(
        "too many exports (2)")
    assert registry.drop_owner("x") == 2 and pool.refcount(page) == 2
    assert registry.publish("t", "c", [page], owner_id="x", persistent=False) is None


def test_export_lifetimes_and_release_rights(make_resources, pool):
    a, b = make_resources("a"), make_resources("b")
    a.export_pages("temp", a.allocate_pages(1), persistent=False)
    a.export_pages("kept", a.allocate_pages(1), persistent=True)
    assert b.release_export("temp") == "export 'temp' belongs to another instance"
    a.release_all()
    assert b.list_exports() == ["kept"]          # non-persistent export went with its owner
    assert pool.statistics().num_used == 1
    assert b.import_pages("kept") == [0] and pool.refcount(1) == 2
    assert b.release_export("kept") is None      # anyone of the tenant may drop a persistent one
    assert b.release_export("kept") == "export 'kept' not found"
    assert pool.refcount(1) == 1                 # b's import still holds the page
    b.release_all()
    assert pool.statistics() == START


def test_release_all_returns_everything(make_resources, pool):
    a, b = make_resources("a"), make_resources("b")
    pages = a.allocate_pages(3)
    seq, pending = fill(a, pages[:2], 5)         # left in flight
    a.share_pages(pages)
    a.export_pages("x", pages[:1], persistent=False)
    b.import_pages("x")
    a.free_pages([pages[2]])                     # deferred: a pass is in flight
    assert pool.statistics().num_used == 3
    a.release_all()
    a.release_all()                              # idempotent
    pending.on_done()                            # late completion releases nothing twice
    assert pool.statistics() == PageStats(8, 7, 1, 0)   # b's import holds page 0
    with pytest.raises(TrapError, match="kv.allocate-pages: instance a was released"):
        a.allocate_pages(1)
    b.release_all()
    assert pool.statistics() == START


def test_free_while_in_flight_defers_the_release(make_resources, pool):
    a = make_resources()
    pages = a.allocate_pages(2)
    seq, first = fill(a, pages, 5)
    a.free_pages(pages)
    assert a.sequence_pages(seq) == [] and pool.statistics().num_free == 6
    second = a.copy_tokens_request(*a.allocate_pages(2), 0, 0, 1)
    first.on_done()                              # pages freed before `second` are now free
    assert pool.statistics().num_free == 6 and pool.allocate(2) == [0, 1]
    second.on_done()


def test_allocation_waits_for_own_deferred_pages_before_reclaiming(make_resources, pool):
    reclaimed = []
    a = make_resources(reclaim=lambda n: reclaimed.append(n) or False)
    pages = a.allocate_pages(8)
    seq, pending = fill(a, pages[:1], 1)
    a.free_pages(pages[4:])                      # deferred: `pending` may still write them
    timer = threading.Timer(0.05, pending.on_done)
    timer.start()
    assert a.allocate_pages(4) == [8, 9, 10, 11]
    timer.join()
    assert reclaimed == [] and pool.statistics().num_free == 0


def test_shared_ids_keep_masks_and_read_only(make_resources):
    a, b = make_resources("a"), make_resources("b")
    pages = a.allocate_pages(1)
    a.mask_tokens(pages[0], 0, 1, True)
    a.export_pages("p", pages, False)
    (fork,) = a.share_pages(pages)
    seq = a.create_sequence()
    a.sequence_append(seq, [fork])
    assert a.prepare(seq, [3], [1], 2, [0], [GREEDY]).request.mask == ((0, 1, 1),)
    (imported,) = b.import_pages("p")
    (again,) = b.share_pages([imported])
    with pytest.raises(TrapError, match=f"page id {again} is read-only"):
        b.copy_tokens_request(imported, again, 0, 0, 1)


def test_decode_step_reuses_the_physical_page_tuple(make_resources):
    a = make_resources()
    pages = a.allocate_pages(2)
    seq, first = fill(a, pages[:1], 3)
    second = a.prepare(seq, [4], [3], 4, [0], [GREEDY])
    assert second.request.page_ids is first.request.page_ids
    a.sequence_append(seq, pages[1:])
    third = a.prepare(seq, [5], [4], 1, [0], [GREEDY])
    assert third.request.page_ids == (0, 1)


def test_copy_tokens_request_translates_and_copies_shared_destination(make_resources, pool):
    a = make_resources()
    src, dst = a.allocate_pages(2)
    assert a.copy_tokens_request(src, dst, 1, 2, 2).copies == (TokenCopy(0, 1, 1, 2, 2),)
    a.share_pages([dst])
    copy = a.copy_tokens_request(src, dst, 0, 0, 1)
    assert copy.copies == (TokenCopy(1, 2, 0, 0, 4), TokenCopy(0, 2, 0, 0, 1))
    with pytest.raises(TrapError, match=r"kv.copy-tokens: slots \[2, 5\) outside a page of 4"):
        a.copy_tokens_request(src, dst, 2, 0, 3)


def test_bad_passes_and_sequence_calls_trap(make_resources):
    a = make_resources()
    pages = a.allocate_pages(2)
    seq = a.create_sequence()
    with pytest.raises(TrapError, match="forward.submit: the sequence has no pages"):
        a.prepare(seq, [1], [0], 1, [], [])
    a.sequence_append(seq, pages)
    cases = [
        (([1, 2], [0], 1, [], []), "1 positions for 2 tokens"),
        (([1], [0], 5, [], []), "last-page-len 5 outside 1..4"),
        (([1] * 6, list(range(6)), 1, [], []), "6 tokens but the pages hold 5"),
        (([1], [0], 1, [1], [GREEDY]), "output index 1 outside 0..0"),
        (([1], [0], 1, [0], []), "0 samplers for 1 output indices"),
        (([], [], 1, [], []), "no input tokens"),
    ]
    for args, message in cases:
        with pytest.raises(TrapError, match=f"forward.submit: {message}"):
            a.prepare(seq, *args)
    checked = make_resources("v", vocab_size=259)
    checked_seq = checked.create_sequence()
    checked.sequence_append(checked_seq, checked.allocate_pages(1))
    with pytest.raises(TrapError, match=r"forward.submit: token id 300 outside the vocabulary \(0..258\)"):
        checked.prepare(checked_seq, [1, 300], [0, 1], 2, [], [])
    with pytest.raises(TrapError, match="forward.submit: unknown sequence id 9"):
        a.prepare(9, [1], [0], 1, [], [])
    with pytest.raises(TrapError, match=r"kv.sequence-remove: range \[1, 3\) outside sequence"):
        a.sequence_remove(seq, 1, 2)
    with pytest.raises(TrapError, match="kv.sequence-append: unknown page id 7"):
        a.sequence_append(seq, [7])
    a.sequence_remove(seq, 0, 1)
    assert a.sequence_pages(seq) == [1]
    a.destroy_sequence(seq)
    with pytest.raises(TrapError, match="kv.destroy-sequence: unknown sequence id 0"):
        a.destroy_sequence(seq)


def test_owner_writing_an_exported_page_copies_it(make_resources, pool):
    a = make_resources()
    pages = a.allocate_pages(1)
    seq, prepared = fill(a, pages, 2)
    prepared.on_done()
    a.export_pages("snapshot", pages, persistent=True)
    step = a.prepare(seq, [3], [2], 3, [0], [GREEDY])
    assert step.copies == (TokenCopy(0, 1, 0, 0, 2),) and step.request.page_ids == (1,)
    step.on_done()
    assert pool.refcount(0) == 1                 # the export alone holds the snapshot
    a.release_all()
    assert pool.statistics().num_used == 1


def test_concurrent_instances_return_every_reference():
    pool = PageAllocator(64)
    exports = ExportRegistry(pool)
    errors: list[BaseException] = []

    def work(index: int) -> None:
        r = InstancePages(pool, exports, instance_id=f"i{index}", tenant="t",
                              page_quota=16, page_size=4)
        try:
            for round_ in range(30):
                pages = r.allocate_pages(2)
                seq, step = fill(r, pages, 5)
                fork = r.share_pages(pages)
                r.export_pages(f"e{index}.{round_}", fork[:1], persistent=round_ % 2 == 0)
                imported = r.import_pages(f"e{(index + 1) % 8}.{round_}")
                r.free_pages(pages + (imported if isinstance(imported, list) else []))
                step.on_done()
                r.release_export(f"e{index}.{round_}")
                r.free_pages(fork)
                r.destroy_sequence(seq)
        except BaseException as error:            # reported below
            errors.append(error)
        finally:
            r.release_all()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and exports.num_exports() == 0
    assert pool.statistics() == PageStats(64, 64, 0, 0)


def test_release_all_from_another_thread_mid_activity(make_resources, pool):
    """Terminate while the instance works: its calls then trap, and nothing leaks."""
    a = make_resources(page_quota=8)
    outcome: list[BaseException] = []

    def busy() -> None:
        try:
            while True:
                pages = a.allocate_pages(2)
                seq, step = fill(a, pages, 5)
                a.share_pages(pages)
                step.on_done()
                a.free_pages(a.sequence_pages(seq))
                a.destroy_sequence(seq)
                a.free_pages(list(a._pages))
        except BaseException as error:            # expected: a trap once released
            outcome.append(error)

    thread = threading.Thread(target=busy)
    thread.start()
    time.sleep(0.05)
    a.release_all()
    thread.join(timeout=5)
    assert isinstance(outcome[0], TrapError) and "instance a was released" in str(outcome[0])
    assert pool.statistics() == START
