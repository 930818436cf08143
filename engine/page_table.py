"""ForwardBatch -> FlashInfer-format paged-attention metadata, built once per forward pass.

The same `PageTable` feeds every attention backend (torch on the CPU now, FlashInfer on CUDA later),
so it holds exactly FlashInfer's "paged KV" description of a ragged batch:

  qo_indptr        [B+1] int32   request b's new tokens are rows qo_indptr[b]:qo_indptr[b+1]
  kv_indptr        [B+1] int32   request b's pages are kv_page_indices[kv_indptr[b]:kv_indptr[b+1]]
  kv_page_indices  [nnz] int32   physical page ids, in sequence order
  kv_last_page_len [B]   int32   tokens in each request's last page (after the pass)
  custom_mask      [sum(q_len*kv_len)] bool, or None   FlashInfer's packed layout: per request its
                   [q_len, kv_len] mask (custom RLE rows AND causal) flattened row-major, concatenated
  mask_indptr      [B+1] int32 offsets into custom_mask, or None

plus what the model needs around attention: flat input token ids and RoPE positions [N], the KV
slot each new token is written to (append_page_ids / append_slots [N]), and the flat row of each
output [num_outputs]. Causality is by KV slot order (the new tokens are the last q_len slots of the
sequence), never by RoPE position: positions only rotate, so a request may keep gaps in positions.

Built from Python lists, each field one numpy array shared as a tensor (`_int_tensor`, cheaper
than torch.tensor): a decode step's table is ~15 tiny tensors, where per-token torch ops would
cost more in dispatch than the arithmetic itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, chain

import numpy as np
import torch

from engine.batch import ForwardBatch, ForwardRequest
from engine.errors import RequestError
from engine.paging import kv_len

__all__ = ["PageTable", "build_page_table", "decode_mask_rows"]


@dataclass(frozen=True)
class PageTable:
    """Metadata of one ragged batch (see the module docstring). All tensors are on the CPU."""

    page_size: int
    qo_indptr: torch.Tensor          # [B+1] int32
    kv_indptr: torch.Tensor          # [B+1] int32
    kv_page_indices: torch.Tensor    # [nnz_pages] int32
    kv_last_page_len: torch.Tensor   # [B] int32
    kv_lens: torch.Tensor            # [B] int64, KV length of each request after the pass
    input_ids: torch.Tensor          # [N] int64
    positions: torch.Tensor          # [N] int64
    append_page_ids: torch.Tensor    # [N] int64, page receiving each new token's K/V
    append_slots: torch.Tensor       # [N] int64, slot within that page
    output_rows: torch.Tensor        # [num_outputs] int64, rows of the flat batch that give outputs
    custom_mask: torch.Tensor | None   # [sum(q_len * kv_len)] bool (packed), None: causal only
    mask_indptr: torch.Tensor | None   # [B+1] int32
    outputs_are_all_rows: bool = False   # output_rows is 0..N-1 in order (a plain decode step)

    @property
    def num_requests(self) -> int:
        return int(self.kv_last_page_len.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def q_lens(self) -> torch.Tensor:
        """[B] int64 number of new tokens per request."""
        return (self.qo_indptr[1:] - self.qo_indptr[:-1]).long()

    def request_mask(self, b: int) -> torch.Tensor | None:
        """Request b's [q_len, kv_len] bool mask (custom AND causal), None when causal only."""
        if self.custom_mask is None:
            return None
        q_len = int(self.qo_indptr[b + 1] - self.qo_indptr[b])
        start, end = int(self.mask_indptr[b]), int(self.mask_indptr[b + 1])
        return self.custom_mask[start:end].view(q_len, -1)


def decode_mask_rows(rows: tuple[tuple[int, ...], ...], kv_len: int) -> torch.Tensor:
    """Run-length rows (attend, skip, attend, ...) -> [num_rows, kv_len] bool, True = attend.

    Raises ValueError (naming the row) when a row does not sum to kv_len.
    """
    dense = torch.zeros(len(rows), kv_len, dtype=torch.bool)
    for i, runs in enumerate(rows):
        if any(run < 0 for run in runs) or sum(runs) != kv_len:
            raise ValueError(f"mask row {i} has runs summing to {sum(runs)}, "
                             f"expected the kv length {kv_len} (all runs >= 0)")
        flags = torch.arange(len(runs)) % 2 == 0                 # [num_runs] attend, skip, ...
        dense[i] = torch.repeat_interleave(flags, torch.tensor(runs, dtype=torch.long))
    return dense


def _causal_mask(q_len: int, kv_len: int) -> torch.Tensor:
    """[q_len, kv_len] bool: new token i sits at slot kv_len - q_len + i and sees slots <= it."""
    query_slots = torch.arange(kv_len - q_len, kv_len).unsqueeze(1)   # [q_len, 1]
    return torch.arange(kv_len).unsqueeze(0) <= query_slots          # [q_len, kv_len]


def _packed_mask(requests: tuple[ForwardRequest, ...], kv_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's packed custom mask: flattened per-request [q_len, kv_len] masks, concatenated."""
    pieces = []
    for b, (request, kv_len) in enumerate(zip(requests, kv_lens)):
        mask = _causal_mask(len(request.token_ids), kv_len)
        if request.mask is not None:
            try:
                mask &= decode_mask_rows(request.mask, kv_len)
            except ValueError as err:
                raise RequestError(b, "mask", str(err)) from None
            empty_rows = (~mask.any(dim=1)).nonzero()
            if len(empty_rows):
                raise RequestError(b, "mask", f"row {int(empty_rows[0])} attends no position "
                                   f"once ANDed with the causal mask")
        pieces.append(mask.flatten())
    return torch.cat(pieces), _indptr([len(p) for p in pieces])


def _indptr(lengths: list[int]) -> torch.Tensor:
    return _int_tensor([0, *accumulate(lengths)], np.int32)


def _int_tensor(values: list[int], dtype: type = np.int64) -> torch.Tensor:
    """A CPU tensor of the ints (int64 unless told), through numpy (see the module docstring)."""
    return torch.from_numpy(np.array(values, dtype=dtype))


def _append_slots(requests, q_lens: list[int], kv_lens: list[int],
                  page_size: int) -> tuple[list[int], list[int], list[int]]:
    """(append page id, slot in page) of every new token, and the flat row of every output."""
    page_ids, slots, output_rows = [], [], []
    start = 0
    for request, q_len, kv in zip(requests, q_lens, kv_lens):
        for slot in range(kv - q_len, kv):
            page_ids.append(request.page_ids[slot // page_size])
            slots.append(slot % page_size)
        output_rows.extend(start + i for i in request.output_indices)
        start += q_len
    return page_ids, slots, output_rows


def build_page_table(batch: ForwardBatch, page_size: int) -> PageTable:
    """Build the metadata of a (validated) batch. Masks are checked here (ValueError on bad rows)."""
    requests = batch.requests
    q_lens = [len(r.token_ids) for r in requests]
    num_pages = [len(r.page_ids) for r in requests]
    last_lens = [r.last_page_len for r in requests]
    kv_lens_list = [kv_len(n, last, page_size) for n, last in zip(num_pages, last_lens)]
    append_page_ids, append_slots, output_rows = _append_slots(requests, q_lens, kv_lens_list,
                                                               page_size)
    custom_mask = mask_indptr = None
    if any(r.mask is not None for r in requests):
        custom_mask, mask_indptr = _packed_mask(requests, kv_lens_list)

    return PageTable(
        page_size=page_size,
        qo_indptr=_indptr(q_lens),
        kv_indptr=_indptr(num_pages),
        kv_page_indices=_int_tensor(list(chain.from_iterable(r.page_ids for r in requests)),
                                    np.int32),
        kv_last_page_len=_int_tensor(last_lens, np.int32),
        kv_lens=_int_tensor(kv_lens_list),
        input_ids=_int_tensor(list(chain.from_iterable(r.token_ids for r in requests))),
        positions=_int_tensor(list(chain.from_iterable(r.positions for r in requests))),
        append_page_ids=_int_tensor(append_page_ids),
        append_slots=_int_tensor(append_slots),
        output_rows=_int_tensor(output_rows),
        custom_mask=custom_mask,
        mask_indptr=mask_indptr,
        outputs_are_all_rows=output_rows == list(range(sum(q_lens))),
    )
