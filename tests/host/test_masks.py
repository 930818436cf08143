"""Mask folding: hidden token slots (kv.mask-tokens) folded into run-length mask rows, checked
against a dense reference, and through InstancePages."""
from __future__ import annotations

import random

import pytest

from engine.batch import GREEDY
from host.errors import TrapError
from host.kv.masks import fold_hidden, hidden_intervals, mask_page_slots
from tests.host.test_resources import fill


def dense(row, kv_len):
    bits, keep = [], True
    for run in row:
        bits += [keep] * run
        keep = not keep
    assert len(bits) == kv_len
    return bits


def page_row(bits: int, page_size: int):
    """A page's hidden slots (bit k = slot k hidden) built with mask_page_slots, one slot at a time."""
    row = None
    for slot in range(page_size):
        if (bits >> slot) & 1:
            row = mask_page_slots(row, page_size, slot, 1, True)
    return row


def test_fold_matches_a_dense_reference():
    rng = random.Random(7)
    for _ in range(300):
        page_size = rng.choice([1, 2, 4, 8])
        num_pages = rng.randint(1, 5)
        kv_len = (num_pages - 1) * page_size + rng.randint(1, page_size)
        masks = [rng.getrandbits(page_size) if rng.random() < 0.5 else 0 for _ in range(num_pages)]
        hidden = hidden_intervals([page_row(bits, page_size) for bits in masks], page_size, kv_len)
        hidden_dense = [bool((masks[p // page_size] >> (p % page_size)) & 1) for p in range(kv_len)]
        rows = []
        for _ in range(3):
            cuts = sorted(rng.randint(0, kv_len) for _ in range(rng.randint(0, 4)))
            row = [b - a for a, b in zip([0] + cuts, cuts + [kv_len])]
            rows.append(tuple(row))
        for given in (None, tuple(rows)):
            folded = fold_hidden(given, 3, kv_len, hidden)
            for index in range(3):
                want = [not h and (given is None or dense(given[index], kv_len)[p])
                        for p, h in enumerate(hidden_dense)]
                if folded is None:
                    assert not any(hidden_dense)
                    continue
                assert dense(folded[index], kv_len) == want
                if hidden:                                   # rebuilt rows are canonical
                    assert all(run > 0 for run in folded[index][1:])


def test_page_rows_and_intervals():
    assert mask_page_slots(None, 4, 1, 2, True) == (1, 2, 1)
    assert mask_page_slots((1, 2, 1), 4, 1, 1, False) == (2, 1, 1)
    assert mask_page_slots((2, 1, 1), 4, 2, 1, False) is None          # all shown again
    assert mask_page_slots(None, 4, 0, 4, True) == (0, 4)
    assert mask_page_slots(None, 4, 0, 1, True) == (0, 1, 3)
    assert mask_page_slots((0, 1, 3), 4, 2, 0, True) == (0, 1, 3)      # an empty span changes nothing
    assert hidden_intervals([(3, 1), (0, 1, 3), None], 4, 12) == [(3, 5)]
    assert hidden_intervals([(3, 1)], 4, 3) == []        # beyond kv_len
    assert fold_hidden(((2, 1, 1),), 1, 4, []) == ((2, 1, 1),)


def test_page_rows_match_a_dense_reference():
    rng = random.Random(11)
    for _ in range(300):
        page_size = rng.choice([1, 2, 4, 8, 16])
        row, hidden = None, [False] * page_size
        for _ in range(rng.randint(1, 6)):
            offset = rng.randrange(page_size)
            num_tokens = rng.randint(0, page_size - offset)
            masked = rng.random() < 0.6
            row = mask_page_slots(row, page_size, offset, num_tokens, masked)
            hidden[offset:offset + num_tokens] = [masked] * num_tokens
            if not any(hidden):
                assert row is None
            else:
                assert [not h for h in hidden] == dense(row, page_size)


def test_mask_tokens_fold_into_rows(make_resources):
    a = make_resources()
    pages = a.allocate_pages(2)
    seq, prepared = fill(a, pages, 6)
    assert prepared.request.mask is None
    a.mask_tokens(pages[0], 1, 2, True)          # hide kv 1, 2
    step = a.prepare(seq, [7, 8], [6, 7], 4, [1], [GREEDY])
    assert step.request.mask == ((1, 2, 5), (1, 2, 5))
    guest = a.prepare(seq, [7, 8], [6, 7], 4, [1], [GREEDY], mask=[[4, 4], [8]])
    assert guest.request.mask == ((1, 2, 1, 4), (1, 2, 5))
    a.mask_tokens(pages[0], 2, 1, False)         # show kv 2 again
    assert a.prepare(seq, [7], [7], 4, [0], [GREEDY]).request.mask == ((1, 1, 6),)
    a.mask_tokens(pages[0], 0, 4, False)
    assert a.prepare(seq, [7], [7], 4, [0], [GREEDY]).request.mask is None
    with pytest.raises(TrapError, match="forward.submit: mask row 0 sums to 7, kv length is 8"):
        a.prepare(seq, [7], [7], 4, [0], [GREEDY], mask=[[7]])
    with pytest.raises(TrapError, match=r"kv.mask-tokens: slots \[3, 5\) outside a page of 4"):
        a.mask_tokens(pages[0], 3, 2, True)


