"""Linear layers that read fewer bytes when few tokens run.

Decoding a handful of tokens is bound by reading the weights (a decode step of SmolLM2-135M reads
every weight once: 270 MB in bf16). When a weight matrix is exactly on a 4-bit grid per group of 32
inputs -- which is what a Q4_0 / Q4_1 GGUF dequantizes to -- it is also kept packed for torch's
int4 weight-only CPU kernel (`_weight_int4pack_mm_for_cpu`: w = (q - 8) * scale + zero), which reads
~4x fewer bytes. That is a lossless repacking of the file's own weights (up to bf16 rounding of the
per-group scale and zero); weights not on such a grid (F16, Q8_0, random) stay bf16 only.

Rows <= INT4_MAX_TOKENS use the int4 kernel; larger batches are compute bound and use the bf16
matmul, which is faster there. bf16 weights are pre-packed once for oneDNN
(`mkldnn._reorder_linear_weight`, what torch.compile's CPU freezing does): same results as
F.linear, 1.2-2.5x faster for small and medium batches. Float32 ("exact") models use plain
F.linear and never int4.

Weights kept as GGUF blocks (engine.quant.QuantizedTensor, dtype "quantized") are multiplied in
place by the C kernels (engine.quant.linear.QuantizedLinear); `make_linear` picks the class.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.quant import QuantizedTensor
from engine.quant import kernels as quant_kernels
from engine.quant.linear import BatchPlanner, QuantizedLinear

__all__ = ["Linear", "PartsLinear", "make_linear", "pack_int4", "GROUP_SIZE", "INT4_MAX_TOKENS"]

GROUP_SIZE = 32
INT4_MAX_TOKENS = 8
PACK_CHUNK_ROWS = 1024
CHECK_ROW_STRIDE = 8
ON_GRID_TOLERANCE = 0.1        # max |requantized - weight| / scale for a lossless repack


def _int4_kernels_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(
        ops, "_convert_weight_to_int4pack_for_cpu")


def _grid(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """groups [n, K/32, 32] float32 -> (levels 0..15, scale, low [n, K/32, 1]) of its 4-bit grid."""
    low = groups.amin(dim=-1, keepdim=True)
    scale = (groups.amax(dim=-1, keepdim=True) - low) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    levels = (groups - low).mul_(1 / scale).round_().clamp_(0, 15)
    return levels, scale, low


def _on_grid(rows: torch.Tensor) -> bool:
    """True when every group of 32 in rows [n, K] is on a 4-bit grid (up to bf16 rounding)."""
    groups = rows.float().view(rows.shape[0], -1, GROUP_SIZE)
    levels, scale, low = _grid(groups)
    return float(((levels * scale + low - groups).abs_() / scale).max()) <= ON_GRID_TOLERANCE


def pack_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Pack weight [N, K] for the int4 CPU kernel when it is on a 4-bit grid per 32 inputs.

    returns (packed [N, K/2] uint8, scales_and_zeros [K/32, N, 2] bf16), or None when the weight
    is not on such a grid (repacking would lose precision) or the kernel is missing. The grid test
    runs on every CHECK_ROW_STRIDE-th row (a GGUF tensor has one quantization type throughout);
    packing goes in chunks of rows to keep memory low.
    """
    num_rows, num_cols = weight.shape
    if num_cols % GROUP_SIZE or not _int4_kernels_available():
        return None
    if not _on_grid(weight[::CHECK_ROW_STRIDE]):
        return None
    packed, scales_and_zeros = [], []
    for start in range(0, num_rows, PACK_CHUNK_ROWS):
        rows = weight[start:start + PACK_CHUNK_ROWS]
        levels, scale, low = _grid(rows.float().view(rows.shape[0], -1, GROUP_SIZE))
        zero = low + 8 * scale                                             # w = (q - 8) * s + z
        scales_and_zeros.append(torch.cat([scale, zero], dim=-1).transpose(0, 1).to(torch.bfloat16))
        packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            levels.view(-1, num_cols).to(torch.int32), 1))
    return torch.cat(packed), torch.cat(scales_and_zeros, dim=1).contiguous()   # [K/32, N, 2]


def pack_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN-packed copy of a bf16 CPU weight [N, K], or None where that is unavailable."""
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if reorder is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        return reorder(weight, PACKING_BATCH_HINT)
    except RuntimeError:
        return None


PACKING_BATCH_HINT = 32


class Linear:
    """y = x @ weight.T, with packed fast paths for bf16 on the CPU."""

    def __init__(self, weight: torch.Tensor, allow_int4: bool) -> None:
        bf16_cpu = weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
        packed = pack_int4(weight) if allow_int4 and bf16_cpu else None
        self.int4_weight, self.int4_scales_and_zeros = packed if packed else (None, None)
        self.onednn_weight = pack_onednn(weight) if bf16_cpu else None
        self.weight = None if self.onednn_weight is not None else weight   # [N, K]

    @property
    def uses_int4(self) -> bool:
        return self.int4_weight is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N]."""
        if self.int4_weight is not None and x.shape[0] <= INT4_MAX_TOKENS:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.int4_weight, GROUP_SIZE, self.int4_scales_and_zeros)
        if self.onednn_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn_weight, None, "none", [], "")
        return F.linear(x, self.weight)


class PartsLinear:
    """Several linears side by side (fused rows whose GGUF types differ): outputs concatenated."""

    def __init__(self, parts: list) -> None:
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, sum of the parts' N]."""
        return torch.cat([part(x) for part in self.parts], dim=-1)


def _interleaved_if_faster(weight: QuantizedTensor) -> QuantizedTensor:
    """The rows of an interleavable type (QuantizedTensor.can_interleave: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
    interleaved 8 at a time where a vector level runs, whose interleaved kernels are faster than
    its row kernels (docs/performance/2026-11-28-figures-from-docstrings.md); the scalar kernels
    gain nothing from it: there the weight stays as is."""
    if (quant_kernels.available() and quant_kernels.best_level() != "scalar"
            and weight.can_interleave):                # AVX2 or AVX-512: both read 8-row groups
        return quant_kernels.interleave(weight)
    return weight


def make_linear(weights: list[torch.Tensor | QuantizedTensor], allow_int4: bool,
                planner: BatchPlanner | None) -> Linear | QuantizedLinear | PartsLinear:
    """One layer computing x @ cat(weights).T: blocks of one type fuse into one QuantizedLinear,
    dense tensors into one Linear, a mix into PartsLinear. planner: needed for blocks."""
    quantized = [isinstance(w, QuantizedTensor) for w in weights]
    if all(quantized) and len({(w.qtype, w.num_cols) for w in weights}) == 1:
        if planner is None:
            raise ValueError("quantized weights need a BatchPlanner")
        fused = weights[0] if len(weights) == 1 else QuantizedTensor.concat(weights)
        return QuantizedLinear(_interleaved_if_faster(fused), planner)
    if not any(quantized):
        return Linear(weights[0] if len(weights) == 1 else torch.cat(weights), allow_int4)
    return PartsLinear([make_linear([w], allow_int4, planner) for w in weights])
