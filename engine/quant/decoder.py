"""Every decoder layer of a plain decode pass in one C call (engine/quant/decoder.c).

A decode step runs every layer's dozen or so small operations, and from Python each costs a
dispatch that, over all of them, is a large share of the step. `FusedDecoder` hands the whole
stack to C at once: RMSNorm, the Q/K/V, O, gate/up and down block matmuls, RoPE, paged attention
(appending the new K/V) and SiLU, the same functions the per-layer path computes.

It applies to passes where every request adds one token with no custom mask
(`DecodeAttention`: the checked indices) and every weight runs on the block kernels at that many
rows (`max_rows`); the model uses its per-layer path otherwise. A pass whose rows name LoRA
adapters (`engine.quant.lora.DecoderLora`) gets each row's low-rank deltas added after each base
projection, in the same call (engine/quant/lora.c).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from engine.quant import kernels
from engine.quant.kernels import DecodeAttention
from engine.quant.tensor import QuantizedTensor

if TYPE_CHECKING:
    from engine.quant.lora import DecoderLora

__all__ = ["FusedDecoder", "DecoderShape", "MAX_PARTS"]

MAX_PARTS = 3                      # decoder.h MAX_PROJECTION_PARTS
PROJECTION_FIELDS = 3 + 3 * MAX_PARTS    # num_parts, num_cols, parts, act8_min_rows
LAYER_FIELDS = 2 + 4 * PROJECTION_FIELDS


@dataclass(frozen=True)
class DecoderShape:
    """The model dimensions the C decoder checks its weights against."""

    hidden: int
    intermediate: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


@dataclass(frozen=True)
class FusedLayer:
    """One layer's weights as the C decoder reads them: norms [hidden] float32 contiguous,
    projections as lists of block parts stacked by rows (qkv, o, gate_up, down)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    projections: tuple[tuple[QuantizedTensor, ...], ...]


def _projection_fields(parts: Sequence[QuantizedTensor], act8_min_rows: int) -> list[int]:
    fields = [len(parts), parts[0].num_cols]
    for part in parts:
        fields += [part.kernel_qtype, part.blocks.data_ptr(), part.num_rows]
    return fields + [0] * (3 * (MAX_PARTS - len(parts))) + [act8_min_rows]


def projection_act8_rows(parts: Sequence[QuantizedTensor],
                         act8_min_rows: Callable[[QuantizedTensor], int] | None) -> int:
    """The rows from which a projection's input is quantized to 8 bits: the most any part asks
    for, 0 (never) when some part never does or the parts want different activation layouts."""
    if act8_min_rows is None or len({kernels.act8_layout(part) for part in parts}) != 1:
        return 0
    rows = [act8_min_rows(part) for part in parts]
    return 0 if 0 in rows else max(rows)


class FusedDecoder:
    """The C decoder over `layers` (kept referenced: C holds their addresses)."""

    def __init__(self, shape: DecoderShape, layers: Sequence[FusedLayer], max_rows: int,
                 act8_min_rows: Callable[[QuantizedTensor], int] | None = None) -> None:
        """max_rows: passes of more tokens must not use it (the block kernels' limit);
        act8_min_rows: for a weight, the pass rows from which its input is quantized to 8 bits
        (0: never; `BatchPlanner.act8_min_rows`), None: every pass in 16 bits."""
        module = kernels.require()
        for layer in layers:
            for norm in (layer.input_norm, layer.post_norm):
                if (norm.dtype != torch.float32 or not norm.is_contiguous()
                        or norm.shape != (shape.hidden,)):
                    raise ValueError(f"FusedDecoder: norms must be contiguous float32 "
                                     f"[{shape.hidden}]")
            if len(layer.projections) != 4 or not all(0 < len(p) <= MAX_PARTS
                                                      for p in layer.projections):
                raise ValueError(f"FusedDecoder: 4 projections of 1..{MAX_PARTS} parts each")
        self.shape = shape
        self.layers = tuple(layers)
        self.max_rows = max_rows
        self.act8_rows = tuple(tuple(projection_act8_rows(parts, act8_min_rows)
                                     for parts in layer.projections) for layer in self.layers)
        table = torch.tensor([[layer.input_norm.data_ptr(), layer.post_norm.data_ptr()]
                              + [f for parts, rows in zip(layer.projections, act8_rows)
                                 for f in _projection_fields(parts, rows)]
                              for layer, act8_rows in zip(self.layers, self.act8_rows)],
                             dtype=torch.int64)                          # [L, LAYER_FIELDS]
        self._run = module.decoder_run
        self._capsule = module.decoder_new(
            len(self.layers), shape.hidden, shape.intermediate, shape.num_q_heads,
            shape.num_kv_heads, shape.head_dim, float(shape.eps),
            kernels.level_index(kernels.best_level()), table.data_ptr())

    def run(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
            pool: torch.Tensor, plan: DecodeAttention, num_threads: int,
            lora: DecoderLora | None = None) -> None:
        """x [m, hidden] float32 (the embeddings) becomes the residual stream after the last
        layer, in place; cos / signed_sin [m, head_dim] float32 RoPE rows of the tokens'
        positions; pool [num_layers, num_pages, 2, page_size, Hkv, D] float32 or float16
        contiguous (the new K/V written into it, rounded to float16 there); plan: the pass's
        checked decode indices; lora: the rows' adapters, made for this decoder's shape and
        layers. ValueError for anything that does not fit."""
        shape, m = self.shape, x.shape[0]
        if not 0 < m <= self.max_rows or plan.append_rows.shape[0] != m:
            raise ValueError(f"FusedDecoder: {m} tokens (at most {self.max_rows}, one per request "
                             f"of the plan's {plan.append_rows.shape[0]})")
        for name, tensor, width in (("x", x, shape.hidden), ("cos", cos, shape.head_dim),
                                    ("signed_sin", signed_sin, shape.head_dim)):
            if (tensor.dtype != torch.float32 or not tensor.is_contiguous()
                    or tensor.shape != (m, width) or tensor.device.type != "cpu"):
                raise ValueError(f"FusedDecoder: {name} must be contiguous CPU float32 [{m}, {width}]")
        expected = (len(self.layers), plan.num_rows // (2 * plan.page_size), 2, plan.page_size,
                    shape.num_kv_heads, shape.head_dim)
        if (pool.dtype not in kernels.KERNEL_KV_DTYPES or not pool.is_contiguous()
                or tuple(pool.shape) != expected):
            raise ValueError(f"FusedDecoder: pool must be contiguous float32 / float16 "
                             f"{list(expected)}")
        table, num_groups, indptr, rows = self._lora_fields(lora)
        self._run(self._capsule, x.data_ptr(), m, cos.data_ptr(), signed_sin.data_ptr(),
                  pool.data_ptr(), pool[0].numel(), pool.dtype == torch.float16,
                  plan.append_rows.data_ptr(),
                  plan.kv_rows.data_ptr(), plan.kv_lens.data_ptr(), plan.kv_rows.shape[1],
                  plan.page_size, num_threads, table, num_groups, indptr, rows)

    def _lora_fields(self, lora: DecoderLora | None) -> tuple[int, int, int, int]:
        """(table address, number of groups, indptr address, rows address) of decoder_run; all
        0 without adapters. ValueError for a table of another decoder's shape."""
        if lora is None:
            return 0, 0, 0, 0
        table = lora.table
        if table.shape != self.shape or table.num_layers != len(self.layers):
            raise ValueError(f"FusedDecoder: adapters laid out for {table.num_layers} layers of "
                             f"{table.shape}, not {len(self.layers)} of {self.shape}")
        for name, tensor, length in (("indptr", lora.indptr, table.num_groups + 1),
                                     ("rows", lora.rows, None)):
            length = int(lora.indptr[-1]) if length is None else length
            if (tensor.dtype != torch.int64 or not tensor.is_contiguous()
                    or tensor.shape != (length,) or tensor.device.type != "cpu" or length == 0):
                raise ValueError(f"FusedDecoder: adapter {name} must be contiguous CPU int64 "
                                 f"[{length}], not empty")
        return table.table.data_ptr(), table.num_groups, lora.indptr.data_ptr(), lora.rows.data_ptr()
