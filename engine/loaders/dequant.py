"""Dequantize GGUF tensor data into float32 / bfloat16 torch tensors.

The common llama.cpp types (F32, F16, BF16, Q4_0, Q4_1, Q8_0) are dequantized here with a few
vectorized torch ops over all blocks at once (multi-threaded, faster than
`gguf.quants.dequantize`, which the tests use as the oracle). The k-quants and Q5_x go through
`gguf.quants.dequantize` (numpy, vectorized). Other types (IQ*, TQ*, MXFP4, integer tensors)
are refused: the caller names the tensor and the type.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

__all__ = ["SUPPORTED_QTYPES", "dequantize"]

_TORCH_PATHS = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0)
_GGUF_PATHS = (Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
SUPPORTED_QTYPES = frozenset(_TORCH_PATHS + _GGUF_PATHS)
_BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}   # 32 values per block
_CHUNK_ELEMENTS = 1 << 20


def dequantize(data: np.ndarray, qtype: Q, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize the raw bytes of one tensor.

    data:    [num_rows * bytes_per_row] uint8 (rows = the GGUF's outer dimension)
    returns: [num_rows, row_len] of `dtype`, a fresh tensor (never a view of `data`)
    """
    if qtype not in SUPPORTED_QTYPES:
        raise NotImplementedError(f"no dequantizer for {qtype.name}")
    if qtype in _GGUF_PATHS:
        values = quants.dequantize(data, qtype)   # [num_elements] float32
        return torch.from_numpy(values.reshape(num_rows, -1)).to(dtype)
    raw = _as_uint8_tensor(data).view(num_rows, -1)   # [num_rows, bytes_per_row]
    if qtype == Q.F32:
        return raw.view(torch.float32).to(dtype, copy=True)
    if qtype == Q.F16:
        return raw.view(torch.float16).to(dtype)
    if qtype == Q.BF16:
        return raw.view(torch.bfloat16).to(dtype, copy=True)
    if dtype == torch.float32:
        return _dequantize_blocks(raw, qtype).view(num_rows, -1)
    return _dequantize_in_chunks(raw, qtype, dtype)


def _dequantize_in_chunks(raw: torch.Tensor, qtype: Q, dtype: torch.dtype) -> torch.Tensor:
    """Like _dequantize_blocks, then cast, a slab of rows at a time: the float32 temporary
    stays small (_CHUNK_ELEMENTS float32) instead of the size of the whole tensor (an
    embedding's is large).

    raw:     [num_rows, bytes_per_row] uint8
    returns: [num_rows, row_len] of `dtype`
    """
    num_rows, row_len = raw.shape[0], raw.shape[1] // _BLOCK_BYTES[qtype] * 32
    out = torch.empty(num_rows, row_len, dtype=dtype)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // row_len)
    for start in range(0, num_rows, rows_per_chunk):
        chunk = raw[start:start + rows_per_chunk]
        out[start:start + rows_per_chunk] = _dequantize_blocks(chunk, qtype).view(chunk.shape[0], -1)
    return out


def _as_uint8_tensor(data: np.ndarray) -> torch.Tensor:
    """A zero-copy torch view of read-only bytes (we only ever read from it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(data)


def _dequantize_blocks(raw: torch.Tensor, qtype: Q) -> torch.Tensor:
    """Blocks of 32 values with a float16 scale (and a float16 minimum for Q4_1).

    Writes straight into one fresh output: full-size temporaries cost more in page faults
    than in arithmetic here.
    raw:     [num_rows, bytes_per_row] uint8
    returns: [num_blocks, 32] float32
    """
    blocks = raw.reshape(-1, _BLOCK_BYTES[qtype])   # [num_blocks, block_bytes]
    scale = blocks[:, 0:2].view(torch.float16).float()   # [num_blocks, 1]
    out = torch.empty(blocks.shape[0], 32, dtype=torch.float32)   # [num_blocks, 32]
    if qtype == Q.Q8_0:
        out.copy_(blocks[:, 2:].view(torch.int8))
        return out.mul_(scale)
    header = 4 if qtype == Q.Q4_1 else 2
    packed = blocks[:, header:]   # [num_blocks, 16]: value j in the low nibble, j + 16 in the high
    out[:, :16].copy_(packed & 0x0F)
    out[:, 16:].copy_(packed >> 4)
    if qtype == Q.Q4_0:
        return out.sub_(8).mul_(scale)
    minimum = blocks[:, 2:4].view(torch.float16).float()   # [num_blocks, 1]
    return torch.addcmul(minimum, out, scale, out=out)
