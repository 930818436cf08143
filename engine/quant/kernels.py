"""Python face of the C extension engine.quant._kernels: checked calls on torch tensors.

Kernel levels ("scalar", "avx2", "avx512-vnni") are what the CPU supports, detected by the
extension at run time from CPUID and the OS's saved register state (XGETBV); `best_level()` is
the fastest, or the one the environment variable PIE_KERNEL_LEVEL names (to run, test or measure
a slower level on a faster CPU), and `level_reason()` says why. Every call checks dtypes, shapes
and contiguity before handing raw addresses to C.
"""
from __future__ import annotations

import importlib
import os

import numpy as np
import torch

from engine.quant.tensor import INTERLEAVED_ROWS, QuantizedTensor

__all__ = ["available", "unavailable_reason", "levels", "best_level", "level_reason",
           "cpu_features", "LEVELS", "LEVEL_ENV", "require", "level_index",
           "matmul", "dequantize", "dequantize_rows", "interleave", "PreparedMatmul",
           "add_rms_norm", "PreparedRmsNorm", "DecodeAttention", "PrefillAttention",
           "KERNEL_KV_DTYPES", "ACT8_LEVELS", "ACT8_ENV", "act8_layout", "act8_supported"]

KERNEL_KV_DTYPES = (torch.float32, torch.float16)     # KV pools the C decode attention reads
LOOKUP_CHUNK_IDS = 64           # dequantize_rows of an interleaved matrix: ids a round
LEVELS = ("scalar", "avx2", "avx512-vnni")   # every level, slowest first (module.c LEVEL_NAMES)
LEVEL_ENV = "PIE_KERNEL_LEVEL"  # names the level to run instead of the best (one of LEVELS)
# levels with 8-bit activation kernels (interleaved Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0, row-major
# Q4_K / Q5_K / Q6_K): the vpdpbusd ones, and the portable reference they equal bit for bit (engine/quant/
# interleaved_act8*.c, kquant_act8*.c)
ACT8_LEVELS = ("scalar", "avx512-vnni")
ACT8_QTYPES = {2: 0, 3: 0, 6: 0, 7: 0, 8: 1}  # GGML Q4_0 / Q4_1 / Q5_0 / Q5_1 -> ACT8_Q4;
# Q8_0 -> ACT8_Q8 (_X8)
ACT8_ROW_QTYPES = {12: 1, 13: 1, 14: 1}  # GGML Q4_K, Q5_K, Q6_K (row-major) -> ACT8_Q8
ACT8_ENV = "PIE_ACT8"           # "0": no 8-bit activations anywhere (to measure the 16-bit path)


def _load_extension():
    try:
        return importlib.import_module("engine.quant._kernels"), ""
    except ImportError as error:
        return None, f"the C extension engine.quant._kernels is not built ({error})"


_EXTENSION, _MISSING_REASON = _load_extension()


def available() -> bool:
    """True when the C kernels can run here."""
    return _EXTENSION is not None


def unavailable_reason() -> str:
    """Why available() is False ('' when it is True)."""
    return _MISSING_REASON


def levels() -> tuple[str, ...]:
    """Kernel levels this CPU runs, slowest first (e.g. ('scalar', 'avx2')); () without the extension."""
    return tuple(_EXTENSION.levels()) if _EXTENSION else ()


def best_level() -> str:
    """The level the engine runs: the one PIE_KERNEL_LEVEL names when it is set (ValueError when
    this CPU lacks it or it is no level), else the fastest this CPU supports; RuntimeError
    without the extension."""
    supported = require().levels()
    forced = os.environ.get(LEVEL_ENV, "").strip()
    if not forced:
        return supported[-1]
    if forced not in supported:
        raise ValueError(f"{LEVEL_ENV}={forced!r}: this CPU runs the kernel levels {supported} "
                         f"(of {LEVELS})")
    return forced


def cpu_features() -> dict[str, bool]:
    """What the extension read from CPUID and XGETBV: avx2 (with FMA, F16C and the OS's ymm
    state), avx512 (F, BW, VL, DQ), avx512_vnni, avx512_bf16, amx, os_zmm (the OS saves the
    zmm and opmask registers); {} without the extension."""
    return dict(_EXTENSION.cpu_features()) if _EXTENSION else {}


def level_reason() -> str:
    """Why best_level() is the level it is, in a few words (for the engine's kernel line)."""
    level, cpu = best_level(), cpu_features()
    if os.environ.get(LEVEL_ENV, "").strip():
        return f"{LEVEL_ENV}={level}; the best here is {require().levels()[-1]}"
    if level == "avx512-vnni":
        act8_off = os.environ.get(ACT8_ENV, "").strip() == "0"
        off = f"; 8-bit activations off: {ACT8_ENV}=0" if act8_off else ""
        return f"the CPU has AVX-512 F/BW/VL/DQ + VNNI and the OS saves the zmm state{off}"
    if cpu.get("avx512") and cpu.get("avx512_vnni") and not cpu.get("os_zmm"):
        return "the CPU has AVX-512 + VNNI but the OS does not save the zmm state"
    if cpu.get("avx512") and not cpu.get("avx512_vnni"):
        return "the CPU has AVX-512 without VNNI: the AVX2 kernels run"
    if level == "avx2":
        return "the CPU has AVX2 + FMA + F16C, no AVX-512 VNNI"
    return "the CPU has no AVX2 + FMA + F16C"


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """x += delta (in place, when delta is given), then rms_norm(x) * weight as a new tensor.

    x, delta [M, K] and weight [K]: contiguous CPU float32 (ValueError otherwise). The sums of
    squares are taken in double precision; the result is torch's F.rms_norm to float32 rounding.
    """
    module = require()
    num_cols = weight.shape[0]
    for name, tensor, shape in (("x", x, None), ("delta", delta, x.shape), ("weight", weight, None)):
        if tensor is None:
            continue
        if (tensor.dtype != torch.float32 or not tensor.is_contiguous()
                or tensor.device.type != "cpu" or (shape is not None and tensor.shape != shape)):
            raise ValueError(f"add_rms_norm: {name} must be a contiguous CPU float32 tensor "
                             f"{'of shape ' + str(tuple(shape)) + ' ' if shape else ''}"
                             f"(got {tensor.dtype} {tuple(tensor.shape)} on {tensor.device})")
    if x.dim() != 2 or x.shape[1] != num_cols or weight.dim() != 1:
        raise ValueError(f"add_rms_norm: x must be [M, {num_cols}] for a weight of [{num_cols}], "
                         f"got {tuple(x.shape)}")
    out = torch.empty_like(x)
    module.rms_norm(x.data_ptr(), 0 if delta is None else delta.data_ptr(), weight.data_ptr(),
                    float(eps), x.shape[0], num_cols, out.data_ptr())
    return out


class PreparedRmsNorm:
    """add_rms_norm with one weight, checked once: the per-call cost is one C call (decode runs
    two norms per layer and one at the end every step)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self._call = require().rms_norm
        self.weight = weight.detach().to(torch.float32).contiguous()      # [K]
        self.eps = float(eps)
        self._weight_ptr = self.weight.data_ptr()
        self._num_cols = self.weight.shape[0]

    def __call__(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] (+= delta [M, K] in place) -> rms_norm(x) * weight [M, K] float32."""
        if (x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2
                or x.shape[1] != self._num_cols or (delta is not None and (
                    delta.dtype != torch.float32 or not delta.is_contiguous()
                    or delta.shape != x.shape))):
            return add_rms_norm(x, delta, self.weight, self.eps)   # the checked path (raises)
        out = torch.empty_like(x)
        self._call(x.data_ptr(), 0 if delta is None else delta.data_ptr(), self._weight_ptr,
                   self.eps, x.shape[0], self._num_cols, out.data_ptr())
        return out


class DecodeAttention:
    """One decode batch's paged attention, its index tensors checked once (plan) and reused by
    every layer: each call writes k_new / v_new at append_rows (V rows: + page_size), then
    returns softmax(q K^T / sqrt(D)) V over each request's first kv_lens rows of kv_rows.

    append_rows [B], kv_rows [B, max_kv], kv_lens [B]: int64, rows of a slot view of `num_rows`
    rows (a KV layer's pages, 2 * page_size rows each). ValueError for anything out of range
    (the C side reads raw addresses)."""

    def __init__(self, append_rows: torch.Tensor, kv_rows: torch.Tensor, kv_lens: torch.Tensor,
                 page_size: int, num_rows: int) -> None:
        self._call = require().decode_attention
        self.append_rows = append_rows.to(torch.int64).contiguous()     # [B]
        self.kv_rows = kv_rows.to(torch.int64).contiguous()             # [B, max_kv]
        self.kv_lens = kv_lens.to(torch.int64).contiguous()             # [B]
        self.page_size, self.num_rows = int(page_size), int(num_rows)
        num_requests = self.append_rows.shape[0]
        if (self.kv_rows.dim() != 2 or self.kv_rows.shape[0] != num_requests
                or self.kv_lens.shape != (num_requests,)):
            raise ValueError("DecodeAttention: append_rows [B], kv_rows [B, max_kv] and "
                             "kv_lens [B] must agree on B")
        highest = self.num_rows - self.page_size        # a K row's V row must exist too
        # checked in numpy: six reductions of tiny tensors, every decode pass (each a dispatch in
        # torch)
        for name, rows in (("append_rows", self.append_rows), ("kv_rows", self.kv_rows)):
            values = rows.numpy()
            if values.size and (values.min() < 0 or values.max() >= highest):
                raise ValueError(f"DecodeAttention: {name} outside rows 0..{highest - 1}")
        lens = self.kv_lens.numpy()
        if num_requests and (lens.min() < 0 or lens.max() > self.kv_rows.shape[1]):
            raise ValueError("DecodeAttention: kv_lens outside 0..max_kv")

    def __call__(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 slot_view: torch.Tensor, num_threads: int = 1,
                 level: str | None = None) -> torch.Tensor:
        """q [B, Hq, D], k_new / v_new [B, Hkv, D] float32 (heads and D contiguous, any token
        stride); slot_view [num_rows, Hkv, D] float32 or float16 (KERNEL_KV_DTYPES; new K/V
        rounded to nearest even) contiguous -> out [B, Hq, D] float32. Big batches share their
        (request, head) pairs over num_threads threads; `level`: the inner loops' kernel level
        (default the best; ValueError for one this CPU lacks)."""
        num_requests, num_q_heads, head_dim = q.shape
        num_kv_heads = slot_view.shape[1]
        for name, tensor, heads in (("q", q, num_q_heads), ("k_new", k_new, num_kv_heads),
                                    ("v_new", v_new, num_kv_heads)):
            if (tensor.dtype != torch.float32 or tensor.shape != (num_requests, heads, head_dim)
                    or tensor.stride()[1:] != (head_dim, 1) or tensor.device.type != "cpu"):
                raise ValueError(f"DecodeAttention: {name} must be CPU float32 [{num_requests}, "
                                 f"{heads}, {head_dim}] with contiguous heads")
        if (slot_view.dtype not in KERNEL_KV_DTYPES or not slot_view.is_contiguous()
                or slot_view.shape != (self.num_rows, num_kv_heads, head_dim)
                or num_requests != self.kv_lens.shape[0] or head_dim % 8
                or num_q_heads % num_kv_heads):
            raise ValueError(f"DecodeAttention: slot_view must be contiguous float32 / float16 "
                             f"[{self.num_rows}, Hkv, D] (D a multiple of 8, Hq of Hkv) for "
                             f"{self.kv_lens.shape[0]} requests")
        out = torch.empty(num_requests, num_q_heads, head_dim, dtype=torch.float32)
        self._call(q.data_ptr(), q.stride(0), k_new.data_ptr(), k_new.stride(0),
                   v_new.data_ptr(), v_new.stride(0), slot_view.data_ptr(),
                   slot_view.dtype == torch.float16,
                   self.append_rows.data_ptr(), self.kv_rows.data_ptr(), self.kv_lens.data_ptr(),
                   num_requests, self.kv_rows.shape[1], self.page_size, num_q_heads,
                   num_kv_heads, head_dim, head_dim ** -0.5, out.data_ptr(), level_index(level),
                   num_threads)
        return out


class PrefillAttention:
    """One request's causal attention over its paged context, its rows checked once (plan) and
    reused by every layer: the num_tokens new tokens are the last of the kv_rows.shape[0] context
    slots, their K / V already written (V rows: + page_size); token t attends to slots 0 ..
    kv_len - num_tokens + t. kv_rows [kv_len] int64: rows of a slot view (a KV layer's pages,
    2 * page_size rows each). ValueError for anything out of range (the C side reads raw
    addresses)."""

    def __init__(self, kv_rows: torch.Tensor, num_tokens: int, page_size: int) -> None:
        self._call = require().prefill_attention
        self.kv_rows = kv_rows.to(torch.int64).contiguous()             # [kv_len]
        self.num_tokens, self.page_size = int(num_tokens), int(page_size)
        kv_len = self.kv_rows.shape[0] if self.kv_rows.dim() == 1 else -1
        if not 0 < self.num_tokens <= kv_len or self.page_size <= 0:
            raise ValueError(f"PrefillAttention: {self.num_tokens} tokens need a context of at "
                             f"least as many rows [kv_len] (got {tuple(self.kv_rows.shape)})")
        rows = self.kv_rows.numpy()
        self._lowest, self._highest = int(rows.min()), int(rows.max())

    def __call__(self, q: torch.Tensor, slot_view: torch.Tensor, out: torch.Tensor,
                 num_threads: int = 1, level: str | None = None) -> torch.Tensor:
        """q [num_tokens, Hq, D] float32 (heads and D contiguous, any token stride); slot_view
        [num_rows, Hkv, D] float32 or float16 (KERNEL_KV_DTYPES) contiguous; out [num_tokens,
        Hq, D] float32 (heads and D contiguous), written and returned. D a multiple of 16."""
        num_tokens, num_q_heads, head_dim = q.shape
        num_rows, num_kv_heads = slot_view.shape[0], slot_view.shape[1]
        for name, tensor in (("q", q), ("out", out)):
            if (tensor.dtype != torch.float32 or tensor.shape != (self.num_tokens, num_q_heads,
                                                                   head_dim)
                    or tensor.stride()[1:] != (head_dim, 1) or tensor.device.type != "cpu"):
                raise ValueError(f"PrefillAttention: {name} must be CPU float32 "
                                 f"[{self.num_tokens}, Hq, D] with contiguous heads")
        if (slot_view.dtype not in KERNEL_KV_DTYPES or not slot_view.is_contiguous()
                or slot_view.dim() != 3 or slot_view.shape[2] != head_dim or head_dim % 16
                or num_q_heads % num_kv_heads or self._lowest < 0
                or self._highest + self.page_size >= num_rows):
            raise ValueError(f"PrefillAttention: slot_view must be contiguous float32 / float16 "
                             f"[num_rows, Hkv, D] (D a multiple of 16, Hq of Hkv) holding rows "
                             f"{self._lowest}..{self._highest + self.page_size}")
        self._call(q.data_ptr(), q.stride(0), slot_view.data_ptr(),
                   slot_view.dtype == torch.float16, self.kv_rows.data_ptr(), self.num_tokens,
                   self.kv_rows.shape[0], self.page_size, num_q_heads, num_kv_heads, head_dim,
                   head_dim ** -0.5, out.data_ptr(), out.stride(0), level_index(level),
                   num_threads)
        return out


def act8_layout(weight: QuantizedTensor) -> int | None:
    """The activation layout (formats.h ACT8_*) of a weight's 8-bit kernels; None when it has
    none (only interleaved Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 and row-major Q4_K / Q5_K / Q6_K
    do)."""
    if weight.interleaved:
        return ACT8_QTYPES.get(int(weight.qtype))
    return ACT8_ROW_QTYPES.get(int(weight.qtype))


def act8_supported(weight: QuantizedTensor, level: str | None = None) -> bool:
    """Whether matmul(..., act_bits=8) runs for this weight at `level` (default the best) and
    PIE_ACT8 is not "0"."""
    return (available() and act8_layout(weight) is not None
            and (level or best_level()) in ACT8_LEVELS
            and os.environ.get(ACT8_ENV, "").strip() != "0")


def matmul(x: torch.Tensor, weight: QuantizedTensor, level: str | None = None,
           num_threads: int | None = None, out: torch.Tensor | None = None,
           act_bits: int = 16) -> torch.Tensor:
    """x [M, K] float32 -> x @ W^T [M, N] float32, reading W's blocks in place.

    The activation rows are quantized to act_bits per block of 32 (engine/quant/formats.h):
    16 bits, the result equals x @ dequantize(W)^T up to that rounding (~1e-5 relative per
    value); 8 bits (act8_supported weights and levels only, ValueError otherwise), up to half
    a step of max |x| / 127 per value of each block (~0.5-1% relative per output row).
    """
    module = require()
    num_rows, num_cols = weight.shape
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != num_cols or x.device.type != "cpu":
        raise ValueError(f"x must be a CPU float32 [M, {num_cols}] tensor, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    x = x.contiguous()
    if out is None:
        out = torch.empty(x.shape[0], num_rows, dtype=torch.float32)
    elif out.shape != (x.shape[0], num_rows) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 [{x.shape[0]}, {num_rows}] tensor")
    if x.shape[0] == 0:
        return out
    module.matmul(weight.kernel_qtype, level_index(level), weight.blocks.data_ptr(),
                  num_rows, num_cols, x.data_ptr(), x.shape[0], out.data_ptr(),
                  num_threads or torch.get_num_threads(), act_bits)
    return out


class PreparedMatmul:
    """matmul against one weight at the best level, its arguments checked once: the per-call
    cost is one C call (decode runs one per quantized weight every step)."""

    def __init__(self, weight: QuantizedTensor, act8_min_rows: int = 0) -> None:
        """act8_min_rows: calls of this many rows and more quantize x to 8 bits (0: never;
        ValueError when the weight has no 8-bit kernels at the best level)."""
        module = require()
        if act8_min_rows < 0 or (act8_min_rows and not act8_supported(weight)):
            raise ValueError(f"PreparedMatmul: 8-bit activations from {act8_min_rows} rows for "
                             f"a {weight.qtype.name} weight at {best_level()}")
        self.weight = weight
        self.act8_min_rows = act8_min_rows
        self._call = module.matmul
        self._args = (weight.kernel_qtype, level_index(None), weight.blocks.data_ptr(),
                      weight.num_rows, weight.num_cols)

    def __call__(self, x: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
        """x [M, K] float32 contiguous (M >= 1) -> [M, N] float32, on `num_threads` threads
        (default: torch's count)."""
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape[1] != self.weight.num_cols:
            return matmul(x, self.weight, num_threads=num_threads)   # checked (raises when wrong)
        num_x_rows = x.shape[0]
        out = torch.empty(num_x_rows, self.weight.num_rows, dtype=torch.float32)
        act_bits = 8 if 0 < self.act8_min_rows <= num_x_rows else 16
        self._call(*self._args, x.data_ptr(), num_x_rows, out.data_ptr(),
                   num_threads or torch.get_num_threads(), act_bits)
        return out


def dequantize(weight: QuantizedTensor, out: torch.Tensor | None = None,
               num_threads: int | None = None, level: str | None = None) -> torch.Tensor:
    """The float32 values [N, K] of the blocks (into `out` when given, e.g. a scratch buffer);
    `level`: the kernels that read them (default best_level(); the values are the same at every
    level, ValueError for one this CPU lacks)."""
    module = require()
    if out is None:
        out = torch.empty(weight.shape, dtype=torch.float32)
    elif tuple(out.shape) != weight.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 {list(weight.shape)} tensor")
    module.dequantize(weight.kernel_qtype, weight.blocks.data_ptr(), weight.num_rows, weight.num_cols,
                      out.data_ptr(), num_threads or torch.get_num_threads(), level_index(level))
    return out


def dequantize_rows(weight: QuantizedTensor, row_ids: torch.Tensor) -> torch.Tensor:
    """The float32 values [n, K] of rows row_ids [n] (int64): an embedding lookup. Interleaved
    matrices dequantize each id's 8-row group and keep its row, LOOKUP_CHUNK_IDS ids at a time
    (a long prompt's groups all at once would be 8x the size of its embeddings). The index work
    is numpy's (a decode step's lookup would be several tiny torch ops otherwise)."""
    if not weight.interleaved:
        return dequantize(weight.rows(row_ids))
    row_bytes = weight.blocks.shape[1]
    all_groups = weight.blocks.numpy().reshape(-1, INTERLEAVED_ROWS * row_bytes)
    ids = row_ids.numpy()
    out = torch.empty(len(ids), weight.num_cols, dtype=torch.float32)
    for start in range(0, len(ids), LOOKUP_CHUNK_IDS):
        chunk = ids[start:start + LOOKUP_CHUNK_IDS]
        groups = torch.from_numpy(all_groups[chunk // INTERLEAVED_ROWS].reshape(-1, row_bytes))
        values = dequantize(QuantizedTensor(groups, weight.qtype, weight.num_cols,
                                            interleaved=True)).numpy()
        values = values.reshape(len(chunk), INTERLEAVED_ROWS, weight.num_cols)
        out[start:start + len(chunk)] = torch.from_numpy(
            values[np.arange(len(chunk)), chunk % INTERLEAVED_ROWS])
    return out                                                                 # [n, K]


def interleave(weight: QuantizedTensor, num_threads: int | None = None) -> QuantizedTensor:
    """The same Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 matrix with its rows interleaved 8 at a time (a
    new tensor of as many bytes, for the kernels that compute 8 rows at once); ValueError for
    other types or a row count that is not a multiple of 8."""
    if weight.interleaved:
        return weight
    if not weight.can_interleave:
        raise ValueError(f"interleave: {weight.qtype.name} x {weight.num_rows} rows "
                         f"(Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0, rows a multiple of "
                         f"{INTERLEAVED_ROWS})")
    out = torch.empty_like(weight.blocks)
    require().interleave(int(weight.qtype), weight.blocks.data_ptr(), weight.num_rows,
                         weight.num_cols, out.data_ptr(), num_threads or torch.get_num_threads())
    return QuantizedTensor(out, weight.qtype, weight.num_cols, interleaved=True)


def require():
    """The extension module; RuntimeError naming why when it is not built."""
    if _EXTENSION is None:
        raise RuntimeError(_MISSING_REASON)
    return _EXTENSION


def level_index(level: str | None) -> int:
    """The C index of a kernel level (None: best_level()); ValueError when this CPU lacks it."""
    supported = require().levels()
    if level is None:
        level = best_level()
    if level not in supported:
        raise ValueError(f"kernel level {level!r} is not supported on this CPU (have {supported})")
    return LEVELS.index(level)
