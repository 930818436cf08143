"""InstancePages.prepare's route for a one-token decode step gives what the general path
gives: the same request and no copies on a page of its own, and on a shared tail page, an
imported one, a token outside the vocabulary or an unknown sequence the general path's copies or
trap."""
from __future__ import annotations

import pytest

from engine.batch import GREEDY
from host.errors import TrapError
from host.kv import ExportRegistry, InstancePages, PageAllocator

PAGE_SIZE = 4
VOCAB_SIZE = 100


def _pages(pool: PageAllocator, exports: ExportRegistry, instance_id: str) -> InstancePages:
    return InstancePages(pool, exports, instance_id=instance_id, tenant="t", page_quota=16,
                         page_size=PAGE_SIZE, vocab_size=VOCAB_SIZE)


def _general(pages: InstancePages, *args):
    """The general path alone (what the route falls back to)."""
    return pages._with_reclaim("forward.submit",
                               lambda: pages._prepare_general("forward.submit", *args))


@pytest.fixture
def world():
    pool = PageAllocator(32)
    exports = ExportRegistry(pool)
    a = _pages(pool, exports, "a")
    sequence_id = a.create_sequence()
    a.sequence_append(sequence_id, a.allocate_pages(2))
    return pool, exports, a, sequence_id


def test_a_step_on_its_own_page_is_the_general_request(world) -> None:
    _, _, a, sequence_id = world
    step = (sequence_id, [7], [6], 3, [0], [GREEDY])
    routed, general = a.prepare(*step), _general(a, *step, None)
    assert routed.request == general.request and routed.copies == general.copies == ()


def test_a_step_on_a_shared_tail_page_copies_it_first(world) -> None:
    _, _, a, sequence_id = world
    a.share_pages([a.sequence_pages(sequence_id)[-1]])          # the tail now has two ids
    before = a.sequence_pages(sequence_id)
    routed = a.prepare(sequence_id, [7], [6], 3, [0], [GREEDY])
    assert len(routed.copies) == 1                               # copy-on-write, as in general
    assert a.sequence_pages(sequence_id) == before               # local ids unchanged
    assert routed.request.page_ids[-1] == routed.copies[0].dst_page_id


@pytest.mark.parametrize("case, message", [
    ("vocabulary", "outside the vocabulary"),
    ("sequence", "unknown sequence id"),
    ("imported", "read-only"),
    ("last_page_len", "outside 1..4")])
def test_a_bad_step_traps_as_the_general_path_does(world, case, message) -> None:
    pool, exports, a, sequence_id = world
    token_id, last_page_len = 7, 3
    if case == "vocabulary":
        token_id = VOCAB_SIZE
    elif case == "sequence":
        sequence_id = 99
    elif case == "last_page_len":
        last_page_len = 0
    elif case == "imported":
        assert a.export_pages("shared", a.sequence_pages(sequence_id), False) is None
        b = _pages(pool, exports, "b")
        sequence_id = b.create_sequence()
        b.sequence_append(sequence_id, b.import_pages("shared"))
        a = b
    step = (sequence_id, [token_id], [6], last_page_len, [0], [GREEDY])
    with pytest.raises(TrapError, match=message) as routed:
        a.prepare(*step)
    with pytest.raises(TrapError) as general:
        _general(a, *step, None)
    assert str(routed.value) == str(general.value)
