"""Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 matrices with rows interleaved 8 at a time (engine/quant/
interleaved*.c): the same values as the GGUF blocks (gguf's own dequantizer is the oracle), the
same products at every kernel level and thread count, and refusals for what the layout cannot
hold."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.quant import QuantizedTensor
from engine.quant import kernels
from tests.engine.test_quant_kernels import (ACTIVATION_ROUNDING_TOLERANCE, random_blocks,
                                             reference_weight)

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable_reason())

QTYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)


def weights(qtype: Q, num_rows: int, num_cols: int, seed: int):
    blocks = random_blocks(qtype, num_rows, num_cols, seed)
    weight = QuantizedTensor(torch.from_numpy(blocks), qtype, num_cols)
    return weight, kernels.interleave(weight), reference_weight(blocks, qtype, num_cols)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_same_bytes_and_values_as_the_gguf_blocks(qtype: Q) -> None:
    weight, interleaved, reference = weights(qtype, 40, 96, seed=2)
    assert interleaved.interleaved and interleaved.blocks.shape == weight.blocks.shape
    assert not torch.equal(interleaved.blocks, weight.blocks)          # a real relayout
    assert torch.equal(kernels.dequantize(interleaved), kernels.dequantize(weight))
    torch.testing.assert_close(kernels.dequantize(interleaved), reference, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("level", kernels.levels())
@pytest.mark.parametrize("num_x_rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_matmul_matches_float32_reference(qtype: Q, num_x_rows: int, level: str) -> None:
    _, interleaved, reference = weights(qtype, 104, 768, seed=num_x_rows)  # 13 groups of 8
    x = torch.randn(num_x_rows, 768, generator=torch.Generator().manual_seed(5))
    expected = x @ reference.T                                             # [M, N]
    for num_threads in (1, 3):                 # chunks of the rows must keep 8-row groups whole
        y = kernels.matmul(x, interleaved, level=level, num_threads=num_threads)
        relative = (y - expected).norm(dim=1) / expected.norm(dim=1)
        assert float(relative.max()) < ACTIVATION_ROUNDING_TOLERANCE


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_levels_agree_with_the_row_kernels(qtype: Q) -> None:
    weight, interleaved, _ = weights(qtype, 64, 256, seed=9)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(1))
    rows = kernels.matmul(x, weight, level="scalar")
    for level in kernels.levels():
        torch.testing.assert_close(kernels.matmul(x, interleaved, level=level), rows,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_an_embedding_lookup_reads_the_rows_it_names(qtype: Q) -> None:
    weight, interleaved, reference = weights(qtype, 48, 64, seed=4)
    row_ids = torch.tensor([0, 7, 8, 47, 13, 13])
    looked_up = kernels.dequantize_rows(interleaved, row_ids)
    assert torch.equal(looked_up, kernels.dequantize_rows(weight, row_ids))
    torch.testing.assert_close(looked_up, reference[row_ids], rtol=1e-6, atol=1e-7)


def test_a_long_lookup_runs_in_rounds_and_reads_every_row() -> None:
    weight, interleaved, reference = weights(Q.Q8_0, 48, 64, seed=6)
    num_ids = 2 * kernels.LOOKUP_CHUNK_IDS + 5                 # two full rounds and a partial
    row_ids = torch.randint(0, 48, (num_ids,), generator=torch.Generator().manual_seed(2))
    looked_up = kernels.dequantize_rows(interleaved, row_ids)
    assert looked_up.shape == (num_ids, 64)
    torch.testing.assert_close(looked_up, reference[row_ids], rtol=1e-6, atol=1e-7)


def test_what_the_layout_cannot_hold_is_refused() -> None:
    q8, _, _ = weights(Q.Q4_1, 16, 64, seed=3)
    blocks = random_blocks(Q.Q4_K, 16, 256, seed=3)
    with pytest.raises(ValueError, match="Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0"):
        kernels.interleave(QuantizedTensor(torch.from_numpy(blocks), Q.Q4_K, 256))
    odd = QuantizedTensor(q8.blocks[:12].contiguous(), Q.Q4_1, 64)
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.interleave(odd)
    interleaved = kernels.interleave(q8)
    with pytest.raises(ValueError, match="multiples of 8"):
        interleaved.row_slice(4, 12)
    with pytest.raises(ValueError, match="no single rows"):
        interleaved.rows(torch.tensor([1]))
    with pytest.raises(ValueError, match="layout"):
        QuantizedTensor.concat([q8, interleaved])
    assert interleaved.row_slice(8, 16).num_rows == 8
