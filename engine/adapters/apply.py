"""Applying several LoRA adapters inside one batch, after the base projections.

The base GEMM of a projection runs once for the whole batch (engine.model.llama); then, per
fused projection, `LoraPass.add` adds each row's adapter delta (x @ a.T) @ b.T to the output:
the rows are gathered into one padded segment per adapter, [G, L, in] (G adapters in the batch,
L rows in the largest group), and two batched matmuls against the adapters' weights stacked
once per set of adapters ([G, in, R] and [G, R, out], R the largest fused rank, zero-padded)
give [G, L, out], added back at the rows with index_add_. Rows without an adapter take no part.
A batch whose rows all use one adapter skips the gather and the scatter (two matmuls in place).
The op count per projection does not grow with the number of adapters; the padded rows' work
does, with how unevenly the rows are spread over them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.adapters.peft import FUSED_PROJECTIONS, LoraAdapter

__all__ = ["StackedAdapters", "LoraPass", "stack_adapters"]

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class StackedAdapters:
    """The adapters of a batch stacked per layer and fused projection.

    layers[i][p]: None when no adapter of the set targets projection p of layer i, else
    (a_t [G, in, R], b_t [G, R, out]) in `names`' order, zero-padded to the largest R.
    num_bytes: the memory the stacks took (0 for one adapter: views of its own tensors).
    """

    names: tuple[str, ...]
    layers: tuple[tuple[Pair | None, ...], ...]
    num_bytes: int


def _stack(pairs: Sequence[Pair | None], like: Pair) -> Pair:
    """(a [R_g, in], b [out, R_g]) or None per adapter -> (a_t [G, in, R], b_t [G, R, out])."""
    a0, b0 = like
    rank = max(a.shape[0] for pair in pairs if pair is not None for a, _ in [pair])
    a_t = a0.new_zeros(len(pairs), a0.shape[1], rank)                 # [G, in, R]
    b_t = b0.new_zeros(len(pairs), rank, b0.shape[0])                 # [G, R, out]
    for g, pair in enumerate(pairs):
        if pair is not None:
            a, b = pair
            a_t[g, :, :a.shape[0]] = a.t()
            b_t[g, :b.shape[1]] = b.t()
    return a_t, b_t


def stack_adapters(adapters: Sequence[LoraAdapter]) -> StackedAdapters:
    """Stack `adapters` (at least one, all for one base model) for LoraPass."""
    names = tuple(adapter.name for adapter in adapters)
    layers, num_bytes = [], 0
    for i in range(len(adapters[0].layers)):
        layer: list[Pair | None] = []
        for p in range(len(FUSED_PROJECTIONS)):
            pairs = [adapter.layers[i][p] for adapter in adapters]
            present = [pair for pair in pairs if pair is not None]
            if not present:
                layer.append(None)
            elif len(pairs) == 1:
                a, b = present[0]
                layer.append((a.t().unsqueeze(0), b.t().unsqueeze(0)))   # views, no copy
            else:
                a_t, b_t = _stack(pairs, present[0])
                num_bytes += a_t.numel() * a_t.element_size() + b_t.numel() * b_t.element_size()
                layer.append((a_t, b_t))
        layers.append(tuple(layer))
    return StackedAdapters(names, tuple(layers), num_bytes)


class LoraPass:
    """The adapter deltas of one forward pass: which rows use which adapter of `stacked`.

    groups[g]: the flat rows of the pass ([N] rows of its input) that use adapter g, ascending;
    each row in at most one group. Index tensors are made once here, on `device`, and serve
    every layer.
    """

    def __init__(self, stacked: StackedAdapters, groups: Sequence[Sequence[int]],
                 num_rows: int, device: torch.device) -> None:
        if len(groups) != len(stacked.names) or not all(groups):
            raise ValueError("LoraPass: one non-empty group of rows per stacked adapter")
        self.stacked = stacked
        self.num_groups = len(groups)
        self.whole = len(groups) == 1 and len(groups[0]) == num_rows   # every row, one adapter
        self.group_len = max(len(rows) for rows in groups)
        padded = [list(rows) + [rows[0]] * (self.group_len - len(rows)) for rows in groups]
        self.gather = torch.tensor([r for rows in padded for r in rows], dtype=torch.long,
                                   device=device)                      # [G * L]
        self.rows = torch.tensor([r for rows in groups for r in rows], dtype=torch.long,
                                 device=device)                        # [M] rows with an adapter
        ragged = any(len(rows) != self.group_len for rows in groups)
        self.valid = torch.tensor([g * self.group_len + j for g, rows in enumerate(groups)
                                   for j in range(len(rows))], dtype=torch.long,
                                  device=device) if ragged else None   # [M] into G * L

    def add(self, layer: int, projection: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [N, out] += each row's adapter delta of fused projection `projection` of `layer`
        from its input x [N, in] (in place; rows without an adapter unchanged)."""
        pair = self.stacked.layers[layer][projection]
        if pair is None:
            return
        a_t, b_t = pair                                   # [G, in, R], [G, R, out]
        if self.whole:
            y.addmm_(torch.mm(x, a_t[0]), b_t[0])
            return
        xs = x.index_select(0, self.gather).view(self.num_groups, self.group_len, -1)  # [G, L, in]
        delta = torch.bmm(torch.bmm(xs, a_t), b_t).view(-1, b_t.shape[2])   # [G * L, out]
        if self.valid is not None:
            delta = delta.index_select(0, self.valid)                       # [M, out]
        y.index_add_(0, self.rows, delta)
