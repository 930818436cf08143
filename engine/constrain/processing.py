"""Logit processing before sampling: repetition / frequency / presence penalties over the tokens a
generation produced, logit bias, an allowed-token set and the grammar's token mask.

Rows without processing are left untouched (no copy); processed rows are rewritten in a float32
copy. The grammar masks of every constrained row are filled into one int32 bitmask [R, V/32] and
applied with one kernel call.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["process_logits", "RowError", "NEG_INF"]

NEG_INF = float("-inf")


class RowError(ValueError):
    """An output row that cannot be sampled; `row` is its index in the batch's outputs."""

    def __init__(self, row: int, reason: str) -> None:
        super().__init__(f"output row {row}: {reason}")
        self.row = row
        self.reason = reason


def _penalize(row: torch.Tensor, spec) -> None:
    """row [V]: apply the spec's penalties in place, over its state's history."""
    token_ids, counts = spec.state.history()
    if not token_ids:
        return
    ids = torch.tensor(token_ids)                                      # [H]
    values = row[ids]                                                  # [H]
    if spec.repetition_penalty != 1.0:
        values = torch.where(values > 0, values / spec.repetition_penalty,
                             values * spec.repetition_penalty)
    values = values - spec.frequency_penalty * torch.tensor(counts, dtype=row.dtype)
    values = values - spec.presence_penalty
    row[ids] = values


def _restrict(row: torch.Tensor, allowed_token_ids: Sequence[int]) -> None:
    """row [V]: -inf outside `allowed_token_ids`, in place."""
    keep = torch.zeros_like(row, dtype=torch.bool)
    keep[torch.tensor(allowed_token_ids)] = True
    row.masked_fill_(~keep, NEG_INF)


def _apply_grammar(logits: torch.Tensor, rows: list[int], specs: Sequence) -> None:
    """logits [R, V]: -inf where the grammar of rows `rows` forbids a token, in place."""
    import llguidance.torch as ll_torch
    vocab = logits.shape[1]
    bitmask = ll_torch.allocate_token_bitmask(len(rows), vocab)          # [n, ceil(V / 32)]
    for slot, row in enumerate(rows):
        specs[row].state.fill_mask(bitmask, slot)
    shifts = torch.arange(32, dtype=torch.int32)                       # [32]
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool()           # [n, W, 32]
    allowed = allowed.reshape(len(rows), -1)[:, :vocab]                # [n, V]
    logits[rows] = logits[rows].masked_fill(~allowed, NEG_INF)


def process_logits(logits: torch.Tensor, specs: Sequence) -> torch.Tensor:
    """logits [R, V] float32 -> logits with each row's processing applied (the input itself when
    no row has any). Raises RowError naming the row when a row's processing leaves no token."""
    rows = [row for row, spec in enumerate(specs) if spec.processed]
    if not rows:
        return logits
    logits = logits.float().clone()
    for row in rows:
        spec = specs[row]
        if spec.penalized:
            _penalize(logits[row], spec)
        if spec.logit_bias:
            ids = torch.tensor([t for t, _ in spec.logit_bias])
            logits[row, ids] += torch.tensor([b for _, b in spec.logit_bias])
        if spec.allowed_token_ids is not None:
            _restrict(logits[row], spec.allowed_token_ids)
    constrained = [row for row in rows if specs[row].state is not None
                   and specs[row].state.constrained]
    if constrained:
        _apply_grammar(logits, constrained, specs)
    empty = torch.isinf(logits[rows]).all(dim=-1)
    if bool(empty.any()):
        raise RowError(rows[int(empty.nonzero()[0])],
                       "the grammar, bias and allowed tokens leave no token to choose")
    return logits
