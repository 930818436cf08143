"""Paged attention in plain torch (CPU reference, runs on any torch device).

Same call shape as FlashInfer's wrappers: `plan(page_table)` once per forward pass, then per layer
`append_kv` (write the new tokens' K/V at their tail slots) and `run` (attention of the new tokens
over their whole context). All index work is done in `plan` and shared by the layers.

Requests are split in two kinds:
- "short" requests (q_len <= MAX_PADDED_Q: decode steps, small fills) run together as one padded
  batch: their contexts are gathered with one index_select into [B, max_kv], and one
  scaled_dot_product_attention call covers them all, whatever the batch size;
- long requests (prefills) run one SDPA call each; their cost is dominated by their own size.
GQA: the G = num_qo_heads / num_kv_heads query heads sharing a KV head are folded into the query
rows of that KV head ([B, Hkv, G * q, D]), so K and V are never repeated.
With `c_decode` (the quantized CPU engine, float32 or float16 pool), a batch whose every request
takes token rows (`takes_token_rows`: decode steps, short prompts, chunks and verify passes
without a custom mask) runs each layer as one call of engine.quant's C decode kernel, one row per
new token attending its causal prefix (append + attention straight from the pages) instead of ~8
torch ops, and the fused decoder can take the whole pass (the engine runs the requests that take
token rows apart from the others: engine/routing.py); at the avx2
or avx512-vnni kernel level, a long request without a custom mask runs on engine.quant's C
prefill kernel (on the kernels' threads, `kernel_threads`) instead of SDPA.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from engine.page_table import PageTable
from engine.quant import kernels as quant_kernels

__all__ = ["TorchPagedAttention", "MAX_PADDED_Q", "PREFILL_KERNEL_LEVELS", "takes_token_rows",
           "MAX_KV_ROW_ENTRIES"]

MAX_PADDED_Q = 16
# A request of more than one new token runs as C decode rows (one per token) while they attend at
# most this many slots (a 180-token prompt from scratch: 16,290; longer ones lose to the prefill
# paths, measured per prompt)
MAX_TOKEN_ROW_SLOTS = 1 << 14
MAX_KV_ROW_ENTRIES = 1 << 20       # and a pass's [N, max_kv] row table has at most this many entries
PREFILL_KERNEL_LEVELS = ("avx2", "avx512-vnni")   # kernel levels whose C prefill beats SDPA


@dataclass(frozen=True)
class _PaddedGroup:
    """Short requests run as one padded batch."""

    query_rows: torch.Tensor    # [Bs, max_q] rows of the flat batch (padding repeats a valid row)
    valid_rows: torch.Tensor    # [Bs, max_q] bool, False for padding
    kv_rows: torch.Tensor       # [2, Bs, max_kv] K rows then V rows in the slot view
    mask: torch.Tensor | None   # [Bs, 1, G * max_q, max_kv] bool, True = attend; None: attend all
    is_whole_batch: bool        # pure decode: the group is every row of the batch, in order


@dataclass(frozen=True)
class _LongRequest:
    """A long request run on its own."""

    start: int                  # first row of the flat batch
    end: int
    kv_rows: torch.Tensor       # [kv_len] K rows in the slot view
    kv_rows_v: torch.Tensor     # [kv_len] V rows
    mask: torch.Tensor | None   # [q_len, kv_len] bool; None: plain causal with q_len == kv_len
    c_attention: quant_kernels.PrefillAttention | None = None   # causal, on the C kernel


def _kv_rows(table: PageTable, request_ids: np.ndarray, max_kv: int) -> torch.Tensor:
    """[len(request_ids), max_kv] K rows of each request's slots 0..max_kv-1 (padding -> slot 0).
    In numpy: a decode step plans this every pass, where torch ops on tiny tensors cost more in
    dispatch than the arithmetic."""
    page_size = table.page_size
    kv_lens = table.kv_lens.numpy()[request_ids]                          # [Bs]
    slots = np.arange(max_kv)[None, :]                                    # [1, max_kv]
    slots = np.where(slots < kv_lens[:, None], slots, 0)                  # [Bs, max_kv]
    first_entries = table.kv_indptr.numpy()[:-1].astype(np.int64)[request_ids]   # [Bs]
    entries = first_entries[:, None] + slots // page_size                # [Bs, max_kv]
    pages = table.kv_page_indices.numpy().astype(np.int64)[entries]      # [Bs, max_kv]
    return torch.from_numpy(pages * (2 * page_size) + slots % page_size)


def takes_token_rows(num_tokens: int | np.ndarray, kv_len: int | np.ndarray,
                     masked: bool = False) -> bool | np.ndarray:
    """Whether a request of `num_tokens` new tokens over a context of `kv_len` slots (theirs
    included) runs as C decode-kernel rows on a `c_decode` backend: unmasked, and one token, or
    more attending at most MAX_TOKEN_ROW_SLOTS slots in all within MAX_KV_ROW_ENTRIES row-table
    entries. A property of the request alone. Ints give a bool; int arrays ([B], unmasked) an
    array of them."""
    if masked:
        return False
    # the rows of a request attend kv_len - num_tokens + 1 .. kv_len slots
    slots = num_tokens * (2 * kv_len - num_tokens + 1) // 2
    return (num_tokens == 1) | ((slots <= MAX_TOKEN_ROW_SLOTS)
                               & (num_tokens * kv_len <= MAX_KV_ROW_ENTRIES))


class TorchPagedAttention:
    """Paged attention over the KV pool (layout: engine.kv_cache.KV_LAYOUT, NHD)."""

    name = "torch"

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 device: str | torch.device = "cpu", c_decode: bool = False,
                 kernel_threads: Callable[[], int] | None = None) -> None:
        self.device = torch.device(device)       # where the pool lives; plan moves indices there
        self.c_decode = (c_decode and self.device.type == "cpu" and head_dim % 8 == 0
                         and quant_kernels.available())
        # the C prefill kernel beats torch's SDPA where its SIMD loops run (docs/performance)
        self.c_prefill = (self.c_decode and head_dim % 16 == 0
                          and quant_kernels.best_level() in PREFILL_KERNEL_LEVELS)
        self._kernel_threads = kernel_threads or torch.get_num_threads
        self._c_indices: tuple[torch.Tensor, ...] | None = None   # append, kv rows, kv lens
        self._c_attention: quant_kernels.DecodeAttention | None = None   # made at layer 0
        self._pending_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.group_size = num_qo_heads // num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self._table: PageTable | None = None                # the planned batch
        self._torch_planned = False                         # _padded / _long made for it
        self._append_rows: torch.Tensor | None = None       # [N] K rows of the new tokens
        self._append_rows_v: torch.Tensor | None = None     # [N] V rows
        self._padded: _PaddedGroup | None = None
        self._long: list[_LongRequest] = []

    # ---- plan (once per forward) -------------------------------------------------------------
    def plan(self, table: PageTable) -> None:
        """Precompute every index of this batch; the layers reuse them. A batch the C decode
        kernel takes as token rows (`_token_rows`) gets only its indices (the torch ones are made
        if ever needed)."""
        append_rows = torch.from_numpy(table.append_page_ids.numpy() * (2 * self.page_size)
                                       + table.append_slots.numpy())              # [N]
        self._table, self._append_rows = table, append_rows.to(self.device)
        self._append_rows_v = (append_rows + self.page_size).to(self.device)
        self._c_attention, self._pending_kv, self._c_indices = None, None, None
        self._padded, self._long, self._torch_planned = None, [], False
        token_rows = self._token_rows(table) if self.c_decode else None
        if token_rows is not None:
            request_ids, kv_lens, max_kv = token_rows
            kv_rows = _kv_rows(table, request_ids, max_kv)
            self._c_indices = (append_rows, kv_rows, torch.from_numpy(kv_lens))
        else:
            self._plan_torch()

    def _token_rows(self, table: PageTable) -> tuple[np.ndarray, np.ndarray, int] | None:
        """The batch as the C decode kernel's rows, one per new token: (each row's request [N],
        its causal KV length [N], the longest), or None for the torch path. A plain decode batch
        always qualifies; one with longer requests (short prefills, chunks, verify passes) when
        it has no custom mask, each of them takes token rows (`takes_token_rows`) and the row
        table has at most MAX_KV_ROW_ENTRIES entries."""
        if table.custom_mask is not None:
            return None
        kv_lens = table.kv_lens.numpy()                                   # [B]
        max_kv = int(kv_lens.max())
        if table.num_tokens == table.num_requests:
            return np.arange(table.num_requests), kv_lens, max_kv
        q_lens = np.diff(table.qo_indptr.numpy()).astype(np.int64)        # [B]
        if (not takes_token_rows(q_lens, kv_lens.astype(np.int64)).all()
                or table.num_tokens * max_kv > MAX_KV_ROW_ENTRIES):
            return None
        request_ids = np.repeat(np.arange(table.num_requests), q_lens)    # [N]
        starts = np.repeat(table.qo_indptr.numpy()[:-1].astype(np.int64), q_lens)
        offsets = np.arange(table.num_tokens) - starts                    # [N] index in request
        return request_ids, (kv_lens - q_lens)[request_ids] + offsets + 1, max_kv

    def _plan_torch(self) -> None:
        """The torch path's indices: one padded group of short requests, long ones alone."""
        table = self._table
        q_lens = table.q_lens()                                           # [B]
        short_ids = (q_lens <= MAX_PADDED_Q).nonzero().flatten()
        self._padded = self._plan_padded(table, short_ids) if len(short_ids) else None
        long_ids = (q_lens > MAX_PADDED_Q).nonzero().flatten().tolist()
        self._long = [self._plan_long(table, b) for b in long_ids]
        self._torch_planned = True

    def _plan_padded(self, table: PageTable, request_ids: torch.Tensor) -> _PaddedGroup:
        q_lens = table.q_lens()[request_ids]                              # [Bs]
        kv_lens = table.kv_lens[request_ids]                              # [Bs]
        max_q, max_kv = int(q_lens.max()), int(kv_lens.max())
        q_offsets = torch.arange(max_q).unsqueeze(0)                      # [1, max_q]
        valid_rows = q_offsets < q_lens.unsqueeze(1)                      # [Bs, max_q]
        starts = table.qo_indptr[:-1].long()[request_ids].unsqueeze(1)
        query_rows = starts + torch.where(valid_rows, q_offsets, 0)       # [Bs, max_q]
        kv_rows = _kv_rows(table, request_ids.numpy(), max_kv)            # [Bs, max_kv]
        kv_rows = torch.stack([kv_rows, kv_rows + self.page_size])       # [2, Bs, max_kv]
        # query i of a request sits at slot kv_len - q_len + i; padding rows see every valid slot
        query_slots = (kv_lens - q_lens).unsqueeze(1) + q_offsets         # [Bs, max_q]
        kv_slots = torch.arange(max_kv).view(1, 1, max_kv)
        mask = (kv_slots <= query_slots.unsqueeze(2)) & (kv_slots < kv_lens.view(-1, 1, 1))
        if table.custom_mask is not None:
            for i, b in enumerate(request_ids.tolist()):
                custom = table.request_mask(b)                            # [q_len, kv_len]
                q_len, kv_len = custom.shape
                mask[i, :q_len, :kv_len] &= custom
        if bool(mask.all()):
            mask = None
        else:   # GQA: the G heads of a KV head are folded into the query rows (head-major)
            g = self.group_size
            mask = mask.unsqueeze(1).expand(-1, g, -1, -1).reshape(len(request_ids), 1, g * max_q, max_kv)
        is_whole_batch = max_q == 1 and len(request_ids) == table.num_requests
        to_device = (lambda t: t if t is None else t.to(self.device))
        return _PaddedGroup(to_device(query_rows), to_device(valid_rows), to_device(kv_rows),
                            to_device(mask), is_whole_batch)

    def _plan_long(self, table: PageTable, b: int) -> _LongRequest:
        start, end = int(table.qo_indptr[b]), int(table.qo_indptr[b + 1])
        kv_len = int(table.kv_lens[b])
        kv_rows = _kv_rows(table, np.array([b]), kv_len)[0]               # [kv_len]
        mask = custom_mask = table.request_mask(b)
        if mask is None and kv_len != end - start:
            query_slots = torch.arange(kv_len - (end - start), kv_len).unsqueeze(1)
            mask = torch.arange(kv_len).unsqueeze(0) <= query_slots       # [q_len, kv_len]
        c_attention = (quant_kernels.PrefillAttention(kv_rows, end - start, self.page_size)
                       if self.c_prefill and custom_mask is None else None)
        return _LongRequest(start, end, kv_rows.to(self.device),
                            (kv_rows + self.page_size).to(self.device),
                            None if mask is None else mask.to(self.device), c_attention)

    # ---- per layer ---------------------------------------------------------------------------
    def append_kv(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new K/V at their tail slots.

        kv_layer: [num_pages, 2, page_size, num_kv_heads, head_dim]
        k, v:     [num_tokens, num_kv_heads, head_dim]
        """
        if self._c_indices is not None and kv_layer.dtype in quant_kernels.KERNEL_KV_DTYPES:
            self._pending_kv = (k, v)            # run() writes them, in the same C call
            return
        if not self._torch_planned:
            self._plan_torch()
        slot_view = kv_layer.view(-1, self.num_kv_heads, self.head_dim)   # a view: writes land
        if k.dtype != kv_layer.dtype:
            k, v = k.to(kv_layer.dtype), v.to(kv_layer.dtype)
        slot_view.index_copy_(0, self._append_rows, k)
        slot_view.index_copy_(0, self._append_rows_v, v)

    def run(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        """Attention of the new tokens over their contexts (after append_kv).

        q:        [num_tokens, num_qo_heads, head_dim]
        kv_layer: [num_pages, 2, page_size, num_kv_heads, head_dim]
        returns   [num_tokens, num_qo_heads, head_dim]
        """
        slot_view = kv_layer.view(-1, self.num_kv_heads, self.head_dim)
        if self._pending_kv is not None:
            return self._run_c_decode(q, slot_view)
        if self._padded is not None and self._padded.is_whole_batch:
            return self._run_decode(q, slot_view)
        out = torch.empty_like(q)
        if self._padded is not None:
            self._run_padded(q, slot_view, out)
        for request in self._long:
            self._run_long(q, slot_view, request, out)
        return out

    def _gather(self, slot_view: torch.Tensor, kv_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [Bs, max_kv, Hkv, D] of rows kv_rows [2, Bs, max_kv] (one index_select: ~10x
        faster than advanced indexing on the CPU for these short rows)."""
        _, bs, max_kv = kv_rows.shape
        gathered = slot_view.index_select(0, kv_rows.view(-1))
        return gathered.view(2, bs, max_kv, self.num_kv_heads, self.head_dim).unbind(0)

    @staticmethod
    def _as_query_dtype(q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V in q's dtype (a float16 pool under float32 activations: exact widening)."""
        return (k, v) if k.dtype == q.dtype else (k.to(q.dtype), v.to(q.dtype))

    def _run_decode(self, q: torch.Tensor, slot_view: torch.Tensor) -> torch.Tensor:
        """Every request decodes one token: no query gather, no scatter, few ops per layer."""
        group = self._padded
        k, v = self._as_query_dtype(q, *self._gather(slot_view, group.kv_rows))
        # k, v: [B, max_kv, Hkv, D]
        bs = k.shape[0]
        qg = q.reshape(bs, self.num_kv_heads, self.group_size, self.head_dim)  # [B, Hkv, G, D]
        attn = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=group.mask)      # [B, Hkv, G, D]
        # reshape, not view: CUDA's SDPA kernels return [B, G, Hkv, D] memory seen as
        # [B, Hkv, G, D] (strided), whose Hkv and G cannot be merged without a copy
        return attn.reshape(bs, self.num_qo_heads, self.head_dim)

    def decode_plan(self, num_rows: int) -> quant_kernels.DecodeAttention | None:
        """The planned batch's indices checked for the C decode kernels, one row per new token,
        when `c_decode` is on and the batch runs as token rows (`_token_rows`; else None).
        num_rows: a layer's slot-view rows."""
        if self._c_indices is None:
            return None
        if self._c_attention is None or self._c_attention.num_rows != num_rows:
            self._c_attention = quant_kernels.DecodeAttention(*self._c_indices, self.page_size,
                                                              num_rows)
        return self._c_attention

    def _run_c_decode(self, q: torch.Tensor, slot_view: torch.Tensor) -> torch.Tensor:
        """Plain decode on the C kernel: append this layer's K/V, attend; [B, Hq, D]."""
        k, v = self._pending_kv
        self._pending_kv = None
        return self.decode_plan(slot_view.shape[0])(q, k, v, slot_view)

    def _run_padded(self, q: torch.Tensor, slot_view: torch.Tensor, out: torch.Tensor) -> None:
        group, hkv, g, d = self._padded, self.num_kv_heads, self.group_size, self.head_dim
        bs, max_q = group.query_rows.shape
        k, v = self._as_query_dtype(q, *self._gather(slot_view, group.kv_rows))
        # k, v: [Bs, max_kv, Hkv, D]
        qp = q.index_select(0, group.query_rows.flatten()).view(bs, max_q, hkv, g, d)
        qp = qp.permute(0, 2, 3, 1, 4).reshape(bs, hkv, g * max_q, d)     # [Bs, Hkv, G*max_q, D]
        attn = F.scaled_dot_product_attention(qp, k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=group.mask)      # [Bs, Hkv, G*max_q, D]
        # attn may be strided (CUDA's kernels); reshape splits it without a copy when it can
        attn = attn.reshape(bs, hkv, g, max_q, d).permute(0, 3, 1, 2, 4)  # [Bs, max_q, Hkv, G, D]
        attn = attn.reshape(bs * max_q, hkv * g, d)
        if max_q == 1:
            out[group.query_rows.flatten()] = attn
        else:
            valid = group.valid_rows.flatten()
            out[group.query_rows.flatten()[valid]] = attn[valid]

    def _run_long(self, q: torch.Tensor, slot_view: torch.Tensor, request: _LongRequest,
                  out: torch.Tensor) -> None:
        if (request.c_attention is not None and q.dtype == torch.float32
                and slot_view.dtype in quant_kernels.KERNEL_KV_DTYPES):
            request.c_attention(q[request.start:request.end], slot_view,
                                out[request.start:request.end], self._kernel_threads())
            return
        k, v = self._as_query_dtype(q, slot_view.index_select(0, request.kv_rows),
                                    slot_view.index_select(0, request.kv_rows_v))
        # k, v: [kv_len, Hkv, D]
        q_req = q[request.start:request.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        attn = F.scaled_dot_product_attention(
            q_req, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            attn_mask=request.mask, is_causal=request.mask is None, enable_gqa=True)
        out[request.start:request.end] = attn[0].transpose(0, 1)
