"""A weight matrix kept in its GGUF block format: raw bytes per row, never dequantized whole."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

__all__ = ["KERNEL_QTYPES", "INTERLEAVABLE_QTYPES", "INTERLEAVED_ROWS", "QTYPE_NAMES",
           "QuantizedTensor"]

KERNEL_QTYPES = frozenset((Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K,
                           Q.Q5_K, Q.Q6_K))  # types the C kernels read
INTERLEAVABLE_QTYPES = frozenset((Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0))
INTERLEAVED_ROWS = 8
# the C side's ids of interleaved matrices (formats.h QTYPE_Q4_0_X8, _Q4_1_X8, _Q8_0_X8, _Q5_0_X8,
# _Q5_1_X8)
_INTERLEAVED_KERNEL_QTYPES = {Q.Q4_0: 256, Q.Q4_1: 257, Q.Q8_0: 258, Q.Q5_0: 259,
                              Q.Q5_1: 260}
QTYPE_NAMES = {int(q): q.name for q in KERNEL_QTYPES} | {
    code: f"{q.name}x{INTERLEAVED_ROWS}" for q, code in _INTERLEAVED_KERNEL_QTYPES.items()}


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """An [num_rows, num_cols] matrix of GGUF blocks.

    blocks: [num_rows, row_bytes] uint8, contiguous; row i holds num_cols values of `qtype`.
    interleaved: the rows of each group of 8 are interleaved per block (engine/quant/formats.h,
    the _X8 layout: same bytes, read by kernels that compute 8 rows at once); then only whole
    groups can be sliced and no single row can be read.
    """

    blocks: torch.Tensor
    qtype: Q
    num_cols: int
    interleaved: bool = False

    def __post_init__(self) -> None:
        if self.qtype not in KERNEL_QTYPES:
            raise ValueError(f"no kernel for quantization type {self.qtype.name}; "
                             f"supported: {sorted(q.name for q in KERNEL_QTYPES)}")
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2:
            raise ValueError(f"blocks must be a 2-D uint8 tensor, got {self.blocks.dtype} "
                             f"{tuple(self.blocks.shape)}")
        if not self.blocks.is_contiguous():
            raise ValueError("blocks must be contiguous")
        if self.interleaved and not self.can_interleave:
            raise ValueError(f"only Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 matrices of whole "
                             f"{INTERLEAVED_ROWS}-row groups are interleaved, not "
                             f"{self.qtype.name} x {self.blocks.shape[0]} rows")
        expected = row_bytes(self.qtype, self.num_cols)
        if self.blocks.shape[1] != expected:
            raise ValueError(f"{self.qtype.name} rows of {self.num_cols} values take {expected} "
                             f"bytes, got {self.blocks.shape[1]}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.num_cols)

    @property
    def num_rows(self) -> int:
        return self.blocks.shape[0]

    @property
    def can_interleave(self) -> bool:
        """Whether the interleaved layout can hold this matrix (its type, whole 8-row groups)."""
        return self.qtype in INTERLEAVABLE_QTYPES and self.num_rows % INTERLEAVED_ROWS == 0

    @property
    def kernel_qtype(self) -> int:
        """The type id the C kernels are given (a GGML id, or an interleaved layout's)."""
        return _INTERLEAVED_KERNEL_QTYPES[self.qtype] if self.interleaved else int(self.qtype)

    def rows(self, row_ids: torch.Tensor) -> QuantizedTensor:
        """The rows at row_ids [n] (int64) as a new QuantizedTensor (an embedding lookup)."""
        if self.interleaved:
            raise ValueError("an interleaved matrix has no single rows to look up")
        return QuantizedTensor(self.blocks.index_select(0, row_ids), self.qtype, self.num_cols)

    def row_slice(self, start: int, end: int) -> QuantizedTensor:
        """Rows [start, end) as a view of the same blocks (interleaved: whole 8-row groups)."""
        if self.interleaved and (start % INTERLEAVED_ROWS or (end - start) % INTERLEAVED_ROWS):
            raise ValueError(f"an interleaved matrix slices at multiples of {INTERLEAVED_ROWS} rows")
        return QuantizedTensor(self.blocks[start:end], self.qtype, self.num_cols, self.interleaved)

    @staticmethod
    def concat(parts: list[QuantizedTensor]) -> QuantizedTensor:
        """Rows of all parts, in order; they must share qtype and num_cols."""
        first = parts[0]
        if any((p.qtype, p.num_cols, p.interleaved) != (first.qtype, first.num_cols,
                                                         first.interleaved) for p in parts):
            raise ValueError("only tensors of one quantization type, width and layout concatenate")
        return QuantizedTensor(torch.cat([p.blocks for p in parts]), first.qtype, first.num_cols,
                               first.interleaved)


def row_bytes(qtype: Q, num_cols: int) -> int:
    """Bytes of one row of num_cols values; ValueError when num_cols is not whole blocks."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if num_cols % block_size:
        raise ValueError(f"{qtype.name} rows need a multiple of {block_size} values, got {num_cols}")
    return num_cols // block_size * type_size
