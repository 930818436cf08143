"""The LoRA adapters of a decode pass as the fused C decoder reads them (engine/quant/lora.h).

`LoraTable`: a set of adapters' low-rank factors per layer and fused projection, checked once
against the decoder's shape and packed into the int64 table of addresses lora.c reads (the
tensors stay referenced by the table). `DecoderLora`: one pass's rows of each adapter of a
table. The factors are each adapter's own tensors: nothing is copied, padded or stacked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from engine.quant.decoder import DecoderShape

__all__ = ["LoraFactors", "LoraTable", "DecoderLora", "LORA_MAX_PARTS", "LORA_FIELDS",
           "projection_dims"]

LORA_MAX_PARTS = 3                        # lora.h LORA_MAX_PARTS
LORA_FIELDS = 3 + 3 * LORA_MAX_PARTS      # lora.h LORA_FIELDS


class LoraFactors(Protocol):
    """One adapter's share of one fused projection (engine.adapters.peft.ProjectionLora): a
    [P * rank, in], the P targeted parts' A stacked; per part the fused output's columns
    (start, end) it adds to and b_t [rank, end - start], its B transposed (scale included)."""

    a: torch.Tensor
    slices: tuple[tuple[int, int], ...]
    b_t: tuple[torch.Tensor, ...]


def projection_dims(shape: DecoderShape) -> tuple[tuple[int, int], ...]:
    """(in, out) of the fused projections qkv, o, gate_up, down."""
    q_dim = shape.num_q_heads * shape.head_dim
    kv_dim = shape.num_kv_heads * shape.head_dim
    return ((shape.hidden, q_dim + 2 * kv_dim), (q_dim, shape.hidden),
            (shape.hidden, 2 * shape.intermediate), (shape.intermediate, shape.hidden))


def _check_float(tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if (tensor.dtype != torch.float32 or tensor.device.type != "cpu"
            or not tensor.is_contiguous() or tuple(tensor.shape) != shape):
        raise ValueError(f"LoraTable: {what} must be a contiguous CPU float32 {list(shape)}, "
                         f"not {tensor.dtype} {list(tensor.shape)} on {tensor.device}")


def _fields(factors: LoraFactors | None, dims: tuple[int, int], where: str) -> list[int]:
    """One projection's LORA_FIELDS (zeros when the adapter does not target it), checked."""
    if factors is None:
        return [0] * LORA_FIELDS
    num_parts, (in_dim, out_dim) = len(factors.slices), dims
    if not 0 < num_parts <= LORA_MAX_PARTS or len(factors.b_t) != num_parts \
            or factors.a.dim() != 2 or factors.a.shape[0] % num_parts:
        raise ValueError(f"LoraTable: {where}: 1..{LORA_MAX_PARTS} parts, each with its B and "
                         f"rank rows of A")
    rank = factors.a.shape[0] // num_parts
    _check_float(factors.a, (num_parts * rank, in_dim), f"{where} A")
    fields = [num_parts, rank, factors.a.data_ptr()]
    for (start, end), b_t in zip(factors.slices, factors.b_t):
        if not 0 <= start < end <= out_dim:
            raise ValueError(f"LoraTable: {where}: columns [{start}, {end}) are outside the "
                             f"projection's {out_dim}")
        _check_float(b_t, (rank, end - start), f"{where} B")
        fields += [start, end, b_t.data_ptr()]
    return fields + [0] * (3 * (LORA_MAX_PARTS - num_parts))


class LoraTable:
    """The factors of G adapters for a decoder of `shape` over `num_layers` layers.

    adapters[g][i][p]: adapter g's LoraFactors of fused projection p (qkv, o, gate_up, down) of
    layer i, or None where it does not target it. ValueError naming the adapter, layer and
    projection of a tensor that does not fit.
    """

    def __init__(self, adapters: Sequence[Sequence[Sequence[LoraFactors | None]]],
                 shape: DecoderShape, num_layers: int) -> None:
        dims = projection_dims(shape)
        if not adapters or any(len(layers) != num_layers for layers in adapters):
            raise ValueError(f"LoraTable: at least one adapter, each of {num_layers} layers")
        rows = []
        for g, layers in enumerate(adapters):
            for i, projections in enumerate(layers):
                if len(projections) != len(dims):
                    raise ValueError(f"LoraTable: adapter {g} layer {i}: {len(dims)} projections")
                rows.append([_fields(factors, dims[p], f"adapter {g} layer {i} projection {p}")
                             for p, factors in enumerate(projections)])
        self.shape = shape
        self.num_layers = num_layers
        self.num_groups = len(adapters)
        self._adapters = adapters                 # C reads their addresses: keep them alive
        self.table = torch.tensor(rows, dtype=torch.int64).view(
            self.num_groups, num_layers, len(dims), LORA_FIELDS)


@dataclass(frozen=True)
class DecoderLora:
    """One pass's adapters: the rows of group g (adapter g of `table`) are
    rows[indptr[g]:indptr[g + 1]], each row of the pass in at most one group (the C decoder
    checks this against the pass)."""

    table: LoraTable
    indptr: torch.Tensor        # int64 [G + 1]
    rows: torch.Tensor          # int64 [indptr[G]]

    @classmethod
    def of(cls, table: LoraTable, groups: Sequence[Sequence[int]]) -> DecoderLora:
        """The pass where group g's rows are groups[g] (one group per adapter of `table`)."""
        if len(groups) != table.num_groups:
            raise ValueError(f"DecoderLora: {len(groups)} groups for {table.num_groups} adapters")
        indptr = [0]
        for rows in groups:
            indptr.append(indptr[-1] + len(rows))
        return cls(table, torch.tensor(indptr, dtype=torch.int64),
                   torch.tensor([r for rows in groups for r in rows], dtype=torch.int64))
