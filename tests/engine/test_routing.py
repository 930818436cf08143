"""A pass's requests grouped by path (engine/routing.py): the token-row requests apart from the
rest, packed within the limits; on the quantized CPU engine a request's logits are the same to
the last bit alone and in any batch, beside decode steps, other prompts, a prompt too long for
token rows and a masked request."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.batch import ForwardBatch
from engine.quant import kernels
from engine.routing import split_by_path
from tests.engine.test_engine import fill
from tests.engine.test_quant_decoder import MIXED_TYPES, _types, quantized_engine
from tests.engine.gguf_factory import tiny_hf_weights, write_tiny_gguf

PAGE_SIZE = 4


def _batch(lengths: list[int], masked: tuple[int, ...] = ()) -> ForwardBatch:
    """One request per length, sequence i on pages 8 i.., request i with i + 1 outputs
    (at most its length); `masked`: the requests that carry a custom mask."""
    requests = []
    for i, length in enumerate(lengths):
        outputs = range(max(0, length - i - 1), length)
        mask = ((length,),) * length if i in masked else None
        requests.append(fill(list(range(1, length + 1)), 0,
                             range(8 * i, 8 * i + -(-length // PAGE_SIZE)), PAGE_SIZE,
                             outputs=outputs, mask=mask))
    return ForwardBatch(tuple(requests))


def _split(batch: ForwardBatch, max_rows: int = 64, max_entries: int = 1 << 20):
    """split_by_path with token rows for requests of at most 4 tokens, unmasked."""
    return split_by_path(batch, lambda r: len(r.token_ids) <= 4 and r.mask is None,
                         lambda r: len(r.token_ids), max_rows, max_entries)


def test_a_batch_of_one_kind_comes_back_whole() -> None:
    for lengths in ([1, 3, 4], [9, 12]):
        batch = _batch(lengths)
        assert _split(batch) == [(batch, list(range(sum(range(1, len(lengths) + 1)))))]


def test_token_rows_go_first_and_each_output_keeps_its_row() -> None:
    batch = _batch([1, 9, 3, 2], masked=(3,))       # rows: 0 | 1 2 | 3 4 5 | 6 7 (two of 2)
    parts = _split(batch)
    assert [[len(r.token_ids) for r in part.requests] for part, _ in parts] == [[1, 3], [9, 2]]
    assert [rows for _, rows in parts] == [[0, 3, 4, 5], [1, 2, 6, 7]]
    assert parts[1][0].requests[1].mask is not None


def test_token_row_requests_are_packed_within_both_limits() -> None:
    batch = _batch([4, 4, 1, 3, 1])
    assert [[len(r.token_ids) for r in part.requests]
            for part, _ in _split(batch, max_rows=8)] == [[4, 4], [1, 3, 1]]
    # tokens x longest context: 4 x 4 fits 16, 8 x 4 does not; 5 x 3 does
    assert [[len(r.token_ids) for r in part.requests]
            for part, _ in _split(batch, max_entries=16)] == [[4], [4], [1, 3, 1]]


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    weights = tiny_hf_weights(seed=3)
    return write_tiny_gguf(tmp_path_factory.mktemp("routing") / "mixed.gguf", weights,
                           matrix_type=Q.Q8_0, types=_types(weights, MIXED_TYPES))


@pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable_reason())
@pytest.mark.usefixtures("one_torch_thread")
def test_a_requests_logits_do_not_depend_on_its_batch(mixed_gguf, monkeypatch) -> None:
    """The 3-token prompt (token rows, the fused decoder) alone and beside: a decode step, a
    10-token prompt made too long for token rows (the slot limit lowered to 20), a masked one.
    Before engine/routing.py the long or masked neighbour sent the whole pass down the per-layer
    path, whose arithmetic differs in the last bits."""
    monkeypatch.setattr("engine.attention.torch_paged.MAX_TOKEN_ROW_SLOTS", 20)
    prompt = fill([4, 4, 8], 0, (0,), PAGE_SIZE)
    neighbours = {
        "a decode step": fill([9], 5, (8, 9), PAGE_SIZE),
        "a long prompt": fill(list(range(2, 12)), 0, (16, 17, 18), PAGE_SIZE),
        "a masked prompt": fill([3, 1, 5], 0, (24,), PAGE_SIZE, mask=((3,), (3,), (1, 1, 1))),
    }
    engine = quantized_engine(mixed_gguf, fused=True)
    fused_calls = []
    run = engine.model.fused_decoder.run
    engine.model.fused_decoder.run = lambda *args: fused_calls.append(args[0].shape[0]) or run(*args)
    alone = engine.logits(ForwardBatch((prompt,)))
    assert fused_calls == [3]
    for name, neighbour in neighbours.items():
        for batch in (ForwardBatch((neighbour, prompt)), ForwardBatch((prompt, neighbour))):
            index = batch.requests.index(prompt)
            assert torch.equal(engine.logits(batch)[index], alone[0]), name
    batch = ForwardBatch((prompt, *neighbours.values()))
    fused_calls.clear()
    assert torch.equal(engine.logits(batch)[0], alone[0])
    assert fused_calls == [4]        # the prompt and the decode step; the others layer by layer
