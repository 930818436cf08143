"""Quantized weights kept as their GGUF blocks, and the C kernels that multiply by them.

    weight = QuantizedTensor.from_blocks(raw_uint8_rows, GGMLQuantizationType.Q4_1, num_cols)
    y = kernels.matmul(x, weight)          # x [M, K] float32 -> y [M, N] float32

`kernels.available()` is False when the C extension was not built (the engine then uses its
torch path); `kernels.unavailable_reason()` says why.
"""
from engine.quant.tensor import KERNEL_QTYPES, QuantizedTensor

__all__ = ["KERNEL_QTYPES", "QuantizedTensor"]
