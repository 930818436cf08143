"""GGUF blocks of a type the C kernels do not read, rewritten exactly as a type they do.

llama.cpp's k-quant mixes fall back to Q5_0 for a tensor whose row length is not a multiple of
256 (Q4_K_M of SmolLM2, width 576, holds mostly Q5_0). Q5_0 stores 32 values per block as
d * (q - 16) with q in 0..31 and one float16 scale d: the same d and q - 16 as an int8 are a
Q8_0 block of the same values, bit for bit, at 34 bytes a block instead of 22. So such a
tensor keeps the block kernels (and their 8-bit activations) instead of becoming float32.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

__all__ = ["WIDENED_QTYPES", "widen_blocks"]

QK = 32
_Q5_0_BYTES, _Q8_0_BYTES = 22, 34      # d (2), high bits (4), low nibbles (16) | d (2), qs (32)
WIDENED_QTYPES = {Q.Q5_0: Q.Q8_0}      # the type each is rewritten as


def widen_blocks(rows: np.ndarray, qtype: Q) -> np.ndarray:
    """`rows` ([num_rows, row_bytes] uint8 of `qtype`'s blocks) as WIDENED_QTYPES[qtype]'s:
    [num_rows, blocks_per_row * 34] uint8 holding the same values. ValueError for another type
    or a row that is not whole blocks."""
    if qtype != Q.Q5_0:
        raise ValueError(f"widen_blocks: no exact rewrite of {qtype.name}")
    num_rows, row_bytes = rows.shape
    if row_bytes % _Q5_0_BYTES:
        raise ValueError(f"widen_blocks: a Q5_0 row of {row_bytes} bytes is not whole blocks")
    blocks = rows.reshape(-1, _Q5_0_BYTES)                      # [num_blocks, 22]
    high = np.unpackbits(blocks[:, 2:6], axis=1, bitorder="little")   # [num_blocks, 32]: bit j
    low = blocks[:, 6:]                                          # [num_blocks, 16]
    nibbles = np.concatenate([low & 0x0F, low >> 4], axis=1)     # value j, then j + 16
    values = (nibbles | (high << 4)).astype(np.int16) - 16       # [num_blocks, 32] in -16..15
    out = np.empty((blocks.shape[0], _Q8_0_BYTES), dtype=np.uint8)
    out[:, :2] = blocks[:, :2]                                   # the same float16 scale
    out[:, 2:] = values.astype(np.int8).view(np.uint8)
    return out.reshape(num_rows, -1)
