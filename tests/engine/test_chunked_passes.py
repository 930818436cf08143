"""A batch of more than max_pass_tokens input tokens runs as consecutive passes
(engine.chunking.split_batch): the parts fit, their output rows are the batch's, and the engine
computes the same logits and K/V as one pass would."""
from __future__ import annotations

import pytest
import torch

from engine.batch import ForwardBatch, SamplerSpec
from engine.chunking import split_batch
from engine.engine_config import EngineConfig
from tests.engine.test_engine import fill

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAGE_SIZE = 4
TOP5 = SamplerSpec(kind="distribution", num_top=5)


def mixed_batch() -> ForwardBatch:
    """A 7-token prompt (3 outputs), a 3-token fill after 5 cached tokens, a 12-token prompt with
    a custom mask hiding slot 2 from its tokens 5.. (2 outputs): 22 tokens, 6 outputs."""
    mask = tuple((12,) if i < 5 else (2, 1, 9) for i in range(12))
    return ForwardBatch((
        fill([5, 17, 3, 88, 42, 9, 1], 0, (0, 1), PAGE_SIZE, outputs=(0, 3, 6)),
        fill([60, 33, 21], 5, (2, 3), PAGE_SIZE),
        fill([7, 2, 64, 8, 19, 23, 4, 50, 11, 12, 13, 14], 0, (4, 5, 6), PAGE_SIZE,
             outputs=(5, 11), mask=mask),
    ))


def test_parts_fit_and_their_rows_are_the_batch_outputs() -> None:
    batch = mixed_batch()
    parts = split_batch(batch, 5, PAGE_SIZE)
    assert [part.num_tokens for part, _ in parts] == [5, 5, 5, 5, 2]
    assert all(len(rows) == sum(len(r.output_indices) for r in part.requests)
               for part, rows in parts)
    assert sorted(row for _, rows in parts for row in rows) == list(range(6))
    # every sequence's tokens and positions come back whole and in order
    for index, original in enumerate(batch.requests):
        pieces = [r for part, _ in parts for r in part.requests
                  if r.page_ids[0] == original.page_ids[0]]
        assert sum((r.token_ids for r in pieces), ()) == original.token_ids, index
        assert sum((r.positions for r in pieces), ()) == original.positions, index
        assert pieces[-1].page_ids == original.page_ids
        assert pieces[-1].last_page_len == original.last_page_len
    with pytest.raises(ValueError, match="max_tokens"):
        split_batch(batch, 0, PAGE_SIZE)


def test_whole_batches_are_not_cut() -> None:
    batch = mixed_batch()
    assert [rows for _, rows in split_batch(batch, 22, PAGE_SIZE)] == [[0, 1, 2, 3, 4, 5]]
    parts = split_batch(batch, 10, PAGE_SIZE)              # 7 + 3 fill one; the 12 are cut 10 + 2
    assert [len(part.requests) for part, _ in parts] == [2, 1, 1]
    assert parts[0][0].requests == batch.requests[:2]


def test_a_requests_pieces_do_not_depend_on_the_requests_before_it() -> None:
    batch = mixed_batch()
    alone = split_batch(ForwardBatch(batch.requests[2:]), 5, PAGE_SIZE)
    after_others = split_batch(batch, 5, PAGE_SIZE)
    pieces = [[r.positions for part, _ in parts for r in part.requests
               if r.page_ids[0] == batch.requests[2].page_ids[0]]
              for parts in (alone, after_others)]
    assert pieces[0] == pieces[1] == [tuple(range(0, 5)), tuple(range(5, 10)), (10, 11)]
    # a request that fits no part's room starts the next part, uncut
    parts = split_batch(ForwardBatch(batch.requests[1:]), 13, PAGE_SIZE)
    assert [[len(r.token_ids) for r in part.requests] for part, _ in parts] == [[3], [12]]


def test_chunked_engine_computes_the_same_logits_kv_and_next_token(make_tiny_engine) -> None:
    whole = make_tiny_engine(page_size=PAGE_SIZE, max_pass_tokens=64)
    chunked = make_tiny_engine(page_size=PAGE_SIZE, max_pass_tokens=5)
    runs = []
    original = type(chunked)._run_pass
    chunked._run_pass = lambda batch: runs.append(batch.num_tokens) or original(chunked, batch)
    batch = mixed_batch()
    for engine in (whole, chunked):                    # the cached context of request 2
        engine.kv_cache.pool.zero_()                   # slots nobody writes compare equal
        engine.forward(ForwardBatch((fill([70, 71, 72, 73, 74], 0, (2, 3), PAGE_SIZE),)))
    runs.clear()
    expected, got = whole.logits(batch), chunked.logits(batch)
    assert runs == [5, 5, 5, 5, 2]
    assert got.shape == expected.shape == (6, whole.model_config.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    pages = [0, 1, 2, 3, 4, 5, 6]
    torch.testing.assert_close(chunked.kv_cache.pool[:, pages], whole.kv_cache.pool[:, pages],
                               rtol=1e-5, atol=1e-5)
    step = ForwardBatch((fill([int(expected[2].argmax())], 7, (0, 1), PAGE_SIZE,
                              samplers=(TOP5,)),))
    (after_chunks,), (after_whole,) = chunked.forward(step)[0].outputs, whole.forward(step)[0].outputs
    assert after_chunks.token_ids == after_whole.token_ids
    assert after_chunks.probs == pytest.approx(after_whole.probs, rel=1e-5)


def test_max_pass_tokens_is_validated_and_defaults_to_256_on_the_cpu(make_tiny_engine) -> None:
    with pytest.raises(ValueError, match="max_pass_tokens"):
        EngineConfig(max_pass_tokens=0)
    assert make_tiny_engine().max_pass_tokens == 256
