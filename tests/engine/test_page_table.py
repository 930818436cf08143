"""ForwardBatch -> FlashInfer-format metadata: exact indptrs, append slots, packed masks."""
from __future__ import annotations

import pytest
import torch

from engine.batch import GREEDY, ForwardBatch, ForwardRequest
from engine.page_table import build_page_table, decode_mask_rows


def request(num_tokens: int, start: int, page_ids: tuple[int, ...], last: int, outputs=(),
            mask=None) -> ForwardRequest:
    return ForwardRequest(token_ids=tuple(range(10, 10 + num_tokens)),
                          positions=tuple(range(start, start + num_tokens)), page_ids=page_ids,
                          last_page_len=last, output_indices=tuple(outputs),
                          samplers=(GREEDY,) * len(outputs), mask=mask)


def mixed_batch() -> ForwardBatch:
    return ForwardBatch((
        request(5, 0, (2, 5), 1, outputs=(4,)),    # prefill: kv_len 5, slots 0..4
        request(1, 2, (7,), 3, outputs=(0,)),      # decode: kv_len 3, slot 2
        request(2, 8, (1, 3, 9), 2, outputs=(0, 1)),  # 2 new tokens after 8 cached: slots 8, 9
    ))


def test_mixed_batch_indptrs_exact():
    table = build_page_table(mixed_batch(), page_size=4)
    assert table.qo_indptr.tolist() == [0, 5, 6, 8]
    assert table.kv_indptr.tolist() == [0, 2, 3, 6]
    assert table.kv_page_indices.tolist() == [2, 5, 7, 1, 3, 9]
    assert table.kv_last_page_len.tolist() == [1, 3, 2]
    for name in ("qo_indptr", "kv_indptr", "kv_page_indices", "kv_last_page_len"):
        assert getattr(table, name).dtype == torch.int32, name
    assert table.kv_lens.tolist() == [5, 3, 10]
    assert table.positions.tolist() == [0, 1, 2, 3, 4, 2, 8, 9]
    assert table.input_ids.tolist() == [10, 11, 12, 13, 14, 10, 10, 11]
    assert table.output_rows.tolist() == [4, 5, 6, 7]
    assert table.custom_mask is None and table.mask_indptr is None


def test_outputs_are_all_rows_only_when_every_row_is_an_output_in_order():
    decode = ForwardBatch((request(1, 2, (7,), 3, outputs=(0,)), request(1, 0, (4,), 1, outputs=(0,))))
    assert build_page_table(decode, page_size=4).outputs_are_all_rows
    assert not build_page_table(mixed_batch(), page_size=4).outputs_are_all_rows   # 4 of 8 rows
    every_row = ForwardBatch((request(2, 0, (2,), 2, outputs=(0, 1)),))
    assert build_page_table(every_row, page_size=4).outputs_are_all_rows
    swapped = ForwardBatch((request(2, 0, (2,), 2, outputs=(1, 0)),))
    assert not build_page_table(swapped, page_size=4).outputs_are_all_rows
    no_output = ForwardBatch((request(1, 2, (7,), 3), request(1, 0, (4,), 1, outputs=(0,))))
    assert not build_page_table(no_output, page_size=4).outputs_are_all_rows


def test_new_tokens_go_to_tail_slots():
    table = build_page_table(mixed_batch(), page_size=4)
    assert table.append_page_ids.tolist() == [2, 2, 2, 2, 5, 7, 9, 9]
    assert table.append_slots.tolist() == [0, 1, 2, 3, 0, 2, 0, 1]


def test_decode_mask_rows_run_lengths():
    dense = decode_mask_rows(((2, 1, 2), (0, 3, 2), (5,)), kv_len=5)
    assert dense.int().tolist() == [[1, 1, 0, 1, 1], [0, 0, 0, 1, 1], [1, 1, 1, 1, 1]]


def test_packed_mask_is_custom_and_causal_per_request():
    masked = request(2, 3, (4, 6), 1, mask=((1, 2, 2), (1, 2, 2)))   # kv_len 5, hide slots 1-2
    batch = ForwardBatch((request(1, 0, (0,), 1), masked))
    table = build_page_table(batch, page_size=4)
    assert table.mask_indptr.tolist() == [0, 1, 11]
    assert table.custom_mask[:1].tolist() == [True]
    assert table.request_mask(1).int().tolist() == [[1, 0, 0, 1, 0],   # causal hides slot 4
                                                    [1, 0, 0, 1, 1]]


def test_bad_mask_row_names_request_and_field():
    bad = request(1, 4, (0, 1), 1, mask=((2, 2),))          # sums to 4, kv_len is 5
    with pytest.raises(ValueError, match=r"request 1: field mask: .*row 0"):
        build_page_table(ForwardBatch((request(1, 0, (3,), 1), bad)), page_size=4)


def test_mask_row_that_attends_nothing_is_rejected():
    bad = request(1, 4, (0, 1), 1, mask=((0, 5),))
    with pytest.raises(ValueError, match=r"request 0: field mask: row 0 attends no position"):
        build_page_table(ForwardBatch((bad,)), page_size=4)
