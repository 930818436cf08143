"""The C block kernels against a float32 reference built from the same blocks (gguf's numpy
dequantizer is the oracle), for every quantization type and every kernel level this CPU runs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

from engine.quant import KERNEL_QTYPES, QuantizedTensor
from engine.quant import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable_reason())

# byte offsets of the float16 scale fields inside one block
HALF_OFFSETS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
                Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
# activation rows are rounded to 16 bits per block of 32: relative error of a whole output row
ACTIVATION_ROUNDING_TOLERANCE = 1e-4


def random_blocks(qtype: Q, num_rows: int, num_cols: int, seed: int) -> np.ndarray:
    """[num_rows, row_bytes] uint8: random quants, random finite float16 scales."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    num_blocks = num_rows * num_cols // block_size
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for offset in HALF_OFFSETS[qtype]:
        scales = rng.uniform(-0.05, 0.05, size=num_blocks).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    return blocks.reshape(num_rows, -1)


def reference_weight(blocks: np.ndarray, qtype: Q, num_cols: int) -> torch.Tensor:
    values = quants.dequantize(blocks.reshape(-1), qtype)   # gguf's own dequantizer
    return torch.from_numpy(values.reshape(-1, num_cols).astype(np.float32))


@pytest.mark.parametrize("qtype", sorted(KERNEL_QTYPES), ids=lambda q: q.name)
def test_dequantize_matches_gguf(qtype: Q) -> None:
    blocks = random_blocks(qtype, 24, 512, seed=1)
    weight = QuantizedTensor(torch.from_numpy(blocks), qtype, 512)
    torch.testing.assert_close(kernels.dequantize(weight), reference_weight(blocks, qtype, 512),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("level", kernels.levels())
@pytest.mark.parametrize("num_x_rows", [1, 3, 4, 8, 13])
@pytest.mark.parametrize("qtype", sorted(KERNEL_QTYPES), ids=lambda q: q.name)
def test_matmul_matches_float32_reference(qtype: Q, num_x_rows: int, level: str) -> None:
    num_rows, num_cols = 72, 768
    blocks = random_blocks(qtype, num_rows, num_cols, seed=num_x_rows)
    weight = QuantizedTensor(torch.from_numpy(blocks), qtype, num_cols)
    x = torch.randn(num_x_rows, num_cols, generator=torch.Generator().manual_seed(7))
    expected = x @ reference_weight(blocks, qtype, num_cols).T                 # [M, N]
    y = kernels.matmul(x, weight, level=level, num_threads=2)
    relative = (y - expected).norm(dim=1) / expected.norm(dim=1)
    assert float(relative.max()) < ACTIVATION_ROUNDING_TOLERANCE


@pytest.mark.parametrize("qtype", sorted(KERNEL_QTYPES), ids=lambda q: q.name)
def test_levels_agree_with_scalar(qtype: Q) -> None:
    """SIMD kernels do the same integer arithmetic as the portable one (float sums reordered)."""
    blocks = random_blocks(qtype, 40, 512, seed=3)
    weight = QuantizedTensor(torch.from_numpy(blocks), qtype, 512)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(3))
    scalar = kernels.matmul(x, weight, level="scalar", num_threads=1)
    for level in kernels.levels():
        torch.testing.assert_close(kernels.matmul(x, weight, level=level, num_threads=2), scalar,
                                   rtol=1e-4, atol=1e-4)


def test_one_output_row_and_many_threads() -> None:
    blocks = random_blocks(Q.Q4_1, 1, 64, seed=5)
    weight = QuantizedTensor(torch.from_numpy(blocks), Q.Q4_1, 64)
    x = torch.randn(2, 64)
    expected = x @ reference_weight(blocks, Q.Q4_1, 64).T
    torch.testing.assert_close(kernels.matmul(x, weight, num_threads=8), expected,
                               rtol=0.02, atol=0.02)


def test_rejects_a_wrong_activation_shape() -> None:
    weight = QuantizedTensor(torch.from_numpy(random_blocks(Q.Q8_0, 4, 64, seed=0)), Q.Q8_0, 64)
    with pytest.raises(ValueError, match=r"float32 \[M, 64\]"):
        kernels.matmul(torch.randn(2, 32), weight)
    with pytest.raises(ValueError, match="float32"):
        kernels.matmul(torch.randn(2, 64, dtype=torch.float64), weight)


def test_rejects_blocks_of_the_wrong_width() -> None:
    with pytest.raises(ValueError, match="take 36 bytes"):
        QuantizedTensor(torch.zeros(2, 40, dtype=torch.uint8), Q.Q4_0, 64)
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedTensor(torch.zeros(2, 144, dtype=torch.uint8), Q.Q4_K, 128)
    with pytest.raises(ValueError, match="no kernel"):
        QuantizedTensor(torch.zeros(2, 110, dtype=torch.uint8), Q.Q3_K, 256)


def test_unsupported_level_is_refused() -> None:
    weight = QuantizedTensor(torch.from_numpy(random_blocks(Q.Q8_0, 4, 64, seed=0)), Q.Q8_0, 64)
    with pytest.raises(ValueError, match="not supported"):
        kernels.matmul(torch.randn(1, 64), weight, level="avx9000")
