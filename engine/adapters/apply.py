"""Applying several LoRA adapters inside one batch, after the base projections.

The base GEMM of a projection runs once for the whole batch (engine.model.llama); then, per
fused projection, `LoraPass.add` adds each row's adapter delta to the output: the rows are
gathered into one padded segment per adapter, [G, L, in] (G adapters in the batch, L rows in the
largest group); one batched matmul against the set's A, stacked once per set of adapters
([G, in, P * R]: P targeted parts of the fused projection, R the largest rank, zero-padded),
gives [G, L, P * R]; per part one batched matmul against its B ([G, R, out_part]) gives the
delta of that part's columns, put back in row order by one index_select (rows without an adapter
read a zero row) and added to that part's columns of the output (a strided view: index_add_
there is an order of magnitude slower on the CPU). Rows without an adapter take no part. A batch whose rows all use one adapter skips the gather and the scatter. The op
count per projection does not grow with the number of adapters; the bytes read do (a decode
step reads every adapter of its batch once), and the padded rows' work grows with how unevenly
the rows are spread over them.

A decode pass the model runs in its fused C decoder takes the adapters from there instead
(`LoraPass.for_decoder`: each adapter's own tensors, no stacks, engine/quant/lora.c).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.adapters.peft import FUSED_PROJECTIONS, LoraAdapter, ProjectionLora
from engine.quant.decoder import DecoderShape
from engine.quant.lora import DecoderLora, LoraTable

__all__ = ["StackedAdapters", "StackedProjection", "LoraPass", "stack_adapters"]


@dataclass(frozen=True)
class StackedProjection:
    """One fused projection of one layer for a set of G adapters: a_t [G, in, P * rank] (part j
    at columns j*rank..(j+1)*rank, zero where an adapter does not target it or has a lower
    rank) and per part (start, end, b_t [G, rank, end - start]): the fused output's columns it
    adds to and its B, transposed."""

    a_t: torch.Tensor
    rank: int
    parts: tuple[tuple[int, int, torch.Tensor], ...]


@dataclass(frozen=True)
class StackedAdapters:
    """The adapters of a batch stacked per layer and fused projection.

    layers[i][p]: None when no adapter of the set targets projection p of layer i, else its
    StackedProjection, adapters in `names`' order. num_bytes: the memory the stacks took (0 for
    one adapter: views of its own tensors). adapters: the set itself, in `names`' order.
    """

    names: tuple[str, ...]
    layers: tuple[tuple[StackedProjection | None, ...], ...]
    num_bytes: int
    adapters: tuple[LoraAdapter, ...]
    _tables: dict = field(default_factory=dict, compare=False, repr=False)

    def decoder_table(self, shape: DecoderShape, num_layers: int) -> LoraTable:
        """The set as a fused C decoder of `shape` reads it, made on first use and kept."""
        key = (shape, num_layers)
        if key not in self._tables:
            self._tables[key] = LoraTable([adapter.layers for adapter in self.adapters], shape,
                                          num_layers)
        return self._tables[key]


def _stack(projections: Sequence[ProjectionLora | None]) -> StackedProjection:
    """One fused projection of G adapters (None: not targeted by that one) stacked."""
    present = [proj for proj in projections if proj is not None]
    rank = max(proj.b_t[0].shape[0] for proj in present)
    slices = sorted({piece for proj in present for piece in proj.slices})
    like = present[0].a
    a_t = like.new_zeros(len(projections), like.shape[1], len(slices) * rank)   # [G, in, P*R]
    b_ts = [like.new_zeros(len(projections), rank, end - start)                # [G, R, out_j]
            for start, end in slices]
    for g, proj in enumerate(projections):
        if proj is None:
            continue
        r = proj.b_t[0].shape[0]
        for k, (piece, b_t) in enumerate(zip(proj.slices, proj.b_t)):
            j = slices.index(piece)
            a_t[g, :, j * rank:j * rank + r] = proj.a[k * r:(k + 1) * r].t()
            b_ts[j][g, :r] = b_t
    return StackedProjection(a_t, rank, tuple((start, end, b_t)
                                              for (start, end), b_t in zip(slices, b_ts)))


def _view(proj: ProjectionLora) -> StackedProjection:
    """One adapter's projection as a stack of one, without a copy."""
    rank = proj.b_t[0].shape[0]
    return StackedProjection(proj.a.t().unsqueeze(0), rank, tuple(
        (start, end, b_t.unsqueeze(0)) for (start, end), b_t in zip(proj.slices, proj.b_t)))


def _nbytes(stacked: StackedProjection) -> int:
    return sum(t.numel() * t.element_size()
               for t in (stacked.a_t, *(b_t for _, _, b_t in stacked.parts)))


def stack_adapters(adapters: Sequence[LoraAdapter]) -> StackedAdapters:
    """Stack `adapters` (at least one, all for one base model) for LoraPass."""
    names = tuple(adapter.name for adapter in adapters)
    layers, num_bytes = [], 0
    for i in range(len(adapters[0].layers)):
        layer: list[StackedProjection | None] = []
        for p in range(len(FUSED_PROJECTIONS)):
            projections = [adapter.layers[i][p] for adapter in adapters]
            if all(proj is None for proj in projections):
                layer.append(None)
            elif len(projections) == 1:
                layer.append(_view(projections[0]))
            else:
                layer.append(_stack(projections))
                num_bytes += _nbytes(layer[-1])
        layers.append(tuple(layer))
    return StackedAdapters(names, tuple(layers), num_bytes, tuple(adapters))


class LoraPass:
    """The adapter deltas of one forward pass: which rows use which adapter of `stacked`.

    groups[g]: the flat rows of the pass ([N] rows of its input) that use adapter g, ascending;
    each row in at most one group. Index tensors are made once here, on `device`, and serve
    every layer. num_threads: torch's thread count for the adapters' matmuls when the pass runs
    torch's own ops on fewer (BatchPlanner.kernels_own_the_threads: the block kernels' workers
    are idle between their calls; torch's sleep after each op, OMP_WAIT_POLICY=PASSIVE, which
    `import engine` sets), None to keep torch's.
    """

    def __init__(self, stacked: StackedAdapters, groups: Sequence[Sequence[int]],
                 num_rows: int, device: torch.device, num_threads: int | None = None) -> None:
        if len(groups) != len(stacked.names) or not all(groups):
            raise ValueError("LoraPass: one non-empty group of rows per stacked adapter")
        self.stacked = stacked
        self.groups = tuple(tuple(rows) for rows in groups)
        self.num_threads = num_threads
        self._decoder: DecoderLora | None = None
        self.num_groups = len(groups)
        self.whole = len(groups) == 1 and len(groups[0]) == num_rows   # every row, one adapter
        self.group_len = max(len(rows) for rows in groups)
        padded = [list(rows) + [rows[0]] * (self.group_len - len(rows)) for rows in groups]
        self.gather = torch.tensor([r for rows in padded for r in rows], dtype=torch.long,
                                   device=device)                      # [G * L]
        self.num_padded = self.num_groups * self.group_len
        position = {r: g * self.group_len + j for g, rows in enumerate(groups)
                    for j, r in enumerate(rows)}
        self.partial = len(position) < num_rows          # some rows without an adapter
        self.inverse = torch.tensor([position.get(r, self.num_padded) for r in range(num_rows)],
                                    dtype=torch.long, device=device)   # [N] into G * L (+ 1)

    def for_decoder(self, shape: DecoderShape, num_layers: int) -> DecoderLora:
        """The pass's adapters as a fused C decoder of `shape` over `num_layers` layers takes
        them (engine.quant.lora): the set's table, each group's rows."""
        if self._decoder is None:
            self._decoder = DecoderLora.of(self.stacked.decoder_table(shape, num_layers),
                                           self.groups)
        return self._decoder

    def add(self, layer: int, projection: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [N, out] += each row's adapter delta of fused projection `projection` of `layer`
        from its input x [N, in] (in place; rows without an adapter unchanged)."""
        stacked = self.stacked.layers[layer][projection]
        if stacked is None:
            return
        if self.num_threads is None:
            self._add(stacked, x, y)
            return
        before = torch.get_num_threads()
        torch.set_num_threads(self.num_threads)
        try:
            self._add(stacked, x, y)
        finally:
            torch.set_num_threads(before)

    def _add(self, stacked: StackedProjection, x: torch.Tensor, y: torch.Tensor) -> None:
        rank = stacked.rank
        if self.whole:
            t = torch.mm(x, stacked.a_t[0])                                # [N, P * R]
            for j, (start, end, b_t) in enumerate(stacked.parts):
                y[:, start:end].addmm_(t[:, j * rank:(j + 1) * rank], b_t[0])
            return
        num_groups, group_len, num_padded = self.num_groups, self.group_len, self.num_padded
        xs = x.index_select(0, self.gather).view(num_groups, group_len, -1)   # [G, L, in]
        t = torch.bmm(xs, stacked.a_t)                                     # [G, L, P * R]
        for j, (start, end, b_t) in enumerate(stacked.parts):
            t_j = t[:, :, j * rank:(j + 1) * rank]
            if self.partial:                          # [G * L + 1, out_j], the last row zero
                delta = t.new_empty(num_padded + 1, end - start)
                delta[num_padded].zero_()
                torch.bmm(t_j, b_t, out=delta[:num_padded].view(num_groups, group_len, -1))
            else:
                delta = torch.bmm(t_j, b_t).view(num_padded, end - start)
            y[:, start:end].add_(delta.index_select(0, self.inverse))      # [N, out_j]
