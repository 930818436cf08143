"""Paged attention on CUDA with FlashInfer, over the same `PageTable` as the torch backend.

Same call shape as `TorchPagedAttention`: `plan(table)` once per forward pass, then per layer
`append_kv(kv_layer, k, v)` and `run(q, kv_layer)`.

- A batch where every request adds exactly one token and none has a custom mask runs on
  `BatchDecodeWithPagedKVCacheWrapper`; any other batch (prefills, multi-token fills, masks) runs
  on `BatchPrefillWithPagedKVCacheWrapper`. Both wrappers are built once and share one workspace.
- The FlashInfer `plan` (its scheduling work) happens once per batch, at the first `run` of the
  batch, because only then are the query and KV dtypes known; the other layers reuse it.
- Page pool layout: "NHD", the layout of `engine.kv_cache` ([num_pages, 2, page_size,
  num_kv_heads, head_dim] per layer), which is FlashInfer's single-tensor paged cache for
  kv_layout="NHD": each layer's tensor is handed to FlashInfer as is, no copy, no transpose.
- Masks: the table's custom mask already holds (custom AND causal) per request, flattened
  row-major, in FlashInfer's `custom_mask` layout; it is passed unpacked as `custom_mask` and
  FlashInfer packs it (`segment_packbits`) with the matching byte offsets. (Passing a packed mask
  ourselves is avoided: FlashInfer then keeps the *unpacked* mask_indptr.) With no mask, causal=True
  is FlashInfer's bottom-right aligned causal mask, the same rule as the table's.
- New K/V are written with a plain indexed store at the table's (append_page_ids, append_slots):
  the same slots the torch backend writes, one kernel per tensor, no extra metadata.

Importing this module imports flashinfer; without it the import raises `FlashInferUnavailable`
(an ImportError naming `pip install 'pie-serve[cuda]'`), which the backend factory turns into a
fall back (auto) or a clear error (flashinfer asked for).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.device import import_flashinfer
from engine.kv_cache import KV_LAYOUT
from engine.page_table import PageTable

flashinfer = import_flashinfer()

__all__ = ["FlashInferAttention", "GraphDecodeAttention", "WORKSPACE_BYTES", "is_pure_decode"]

WORKSPACE_BYTES = 128 * 2**20                 # FlashInfer's recommended float workspace
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
CUDA_CORE_DECODE_GROUP_SIZES = (1, 2, 3, 4)   # larger GQA groups decode faster on tensor cores


def is_pure_decode(table: PageTable) -> bool:
    """True when every request adds exactly one token and no request has a custom mask."""
    return table.custom_mask is None and bool((table.q_lens() == 1).all())


@dataclass(frozen=True)
class _BatchMetadata:
    """One batch's metadata where FlashInfer wants it (indptrs on the host, pages on the device)."""

    decode: bool                        # True: decode wrapper, False: prefill wrapper
    qo_indptr: torch.Tensor             # [B+1] int32
    kv_indptr: torch.Tensor             # [B+1] int32
    kv_page_indices: torch.Tensor       # [nnz_pages] int32, on the device
    kv_last_page_len: torch.Tensor      # [B] int32
    custom_mask: torch.Tensor | None    # [sum(q_len * kv_len)] bool on the device, or None
    append_page_ids: torch.Tensor       # [N] int64 on the device
    append_slots: torch.Tensor          # [N] int64 on the device


def _batch_metadata(table: PageTable, device: torch.device) -> _BatchMetadata:
    custom_mask = None
    # FlashInfer reads indptrs on the host; with a mask, older versions pack it next to qo_indptr,
    # so then every index tensor goes to the device (plan copies what it needs back). 0.7.2.post1
    # moves the mask offsets to the mask's device itself; device indptrs are right for both.
    # (The checked version and these placements: tests/engine/test_flashinfer_signatures.py.)
    index_device = torch.device("cpu")
    if table.custom_mask is not None:
        custom_mask = table.custom_mask.to(device, non_blocking=True)
        index_device = device

    def int32(t: torch.Tensor, where: torch.device) -> torch.Tensor:
        return t.to(device=where, dtype=torch.int32, non_blocking=True)

    return _BatchMetadata(
        decode=is_pure_decode(table),
        qo_indptr=int32(table.qo_indptr, index_device),
        kv_indptr=int32(table.kv_indptr, index_device),
        kv_page_indices=int32(table.kv_page_indices, device),
        kv_last_page_len=int32(table.kv_last_page_len, index_device),
        custom_mask=custom_mask,
        append_page_ids=table.append_page_ids.to(device, torch.long, non_blocking=True),
        append_slots=table.append_slots.to(device, torch.long, non_blocking=True),
    )


class FlashInferAttention:
    """FlashInfer batch prefill / batch decode over the NHD page pool of `engine.kv_cache`."""

    name = "flashinfer"

    def __init__(self, *, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 device: str | torch.device = "cuda", workspace_bytes: int = WORKSPACE_BYTES) -> None:
        """`device` is a CUDA device: FlashInfer's kernels are CUDA only (engine.device refuses
        flashinfer on the CPU; only tests with a stand-in flashinfer module build one there)."""
        device = torch.device(device)
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.device = device
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        group_size = num_qo_heads // num_kv_heads
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, KV_LAYOUT)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, KV_LAYOUT,
            use_tensor_cores=group_size not in CUDA_CORE_DECODE_GROUP_SIZES)
        self._batch: _BatchMetadata | None = None
        self._planned_dtypes: tuple[torch.dtype, torch.dtype] | None = None

    # ---- once per forward pass ---------------------------------------------------------------
    def plan(self, table: PageTable) -> None:
        """Take this batch's metadata; FlashInfer's own plan runs at the batch's first `run`."""
        if table.page_size != self.page_size:
            raise ValueError(f"page table has page_size {table.page_size}, "
                             f"the backend was built for {self.page_size}")
        self._batch = _batch_metadata(table, self.device)
        self._planned_dtypes = None

    def _plan_wrapper(self, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        for what, dtype in (("query", q_dtype), ("KV cache", kv_dtype)):
            if dtype not in SUPPORTED_DTYPES:
                raise ValueError(f"flashinfer attention needs float16 or bfloat16, the {what} is "
                                 f"{dtype}; run the engine with --dtype bfloat16 on CUDA")
        batch = self._batch
        heads = (self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size)
        if batch.decode:
            self._decode.plan(batch.kv_indptr, batch.kv_page_indices, batch.kv_last_page_len,
                              *heads, pos_encoding_mode="NONE",
                              q_data_type=q_dtype, kv_data_type=kv_dtype)
        else:
            self._prefill.plan(batch.qo_indptr, batch.kv_indptr, batch.kv_page_indices,
                               batch.kv_last_page_len, *heads,
                               custom_mask=batch.custom_mask,
                               causal=batch.custom_mask is None, pos_encoding_mode="NONE",
                               q_data_type=q_dtype, kv_data_type=kv_dtype)
        self._planned_dtypes = (q_dtype, kv_dtype)

    # ---- per layer ---------------------------------------------------------------------------
    def append_kv(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' K/V at their tail slots.

        kv_layer: [num_pages, 2, page_size, num_kv_heads, head_dim]  (NHD)
        k, v:     [num_tokens, num_kv_heads, head_dim]
        """
        batch = self._require_batch()
        if k.dtype != kv_layer.dtype:              # (the model dtype is the cache's on CUDA)
            k, v = k.to(kv_layer.dtype), v.to(kv_layer.dtype)
        kv_layer[:, 0][batch.append_page_ids, batch.append_slots] = k
        kv_layer[:, 1][batch.append_page_ids, batch.append_slots] = v

    def run(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        """Attention of the new tokens over their contexts (after append_kv).

        q:        [num_tokens, num_qo_heads, head_dim]
        kv_layer: [num_pages, 2, page_size, num_kv_heads, head_dim]
        returns   [num_tokens, num_qo_heads, head_dim]  (decode: one row per request, same order)
        """
        batch = self._require_batch()
        if self._planned_dtypes != (q.dtype, kv_layer.dtype):
            self._plan_wrapper(q.dtype, kv_layer.dtype)
        wrapper = self._decode if batch.decode else self._prefill
        return wrapper.run(q.contiguous(), kv_layer)

    def decode_plan(self, num_rows: int) -> None:
        """No fused C decoder on CUDA: the model runs its layers one by one."""
        return None

    def graph_decode(self, batch_size: int, page_indices: torch.Tensor,
                     append_positions: torch.Tensor,
                     batch_indices: torch.Tensor) -> GraphDecodeAttention:
        """Decode attention of exactly `batch_size` rows over fixed buffers, for a CUDA graph
        (engine.cuda_graphs); it shares this backend's workspace (one pass runs at a time)."""
        return GraphDecodeAttention(
            self._workspace, batch_size, page_indices, append_positions, batch_indices,
            num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, page_size=self.page_size)

    def _require_batch(self) -> _BatchMetadata:
        if self._batch is None:
            raise RuntimeError("FlashInferAttention.plan(table) must be called before the layers run")
        return self._batch


class GraphDecodeAttention:
    """Pure decode attention of a fixed number of rows whose kernels read only fixed buffers, so
    that a CUDA graph captured once replays it for any such batch.

    FlashInfer's decode wrapper in its CUDA-graph mode (`use_cuda_graph=True`): its indptr
    [B+1], page-index [capacity] and last-page-length [B] buffers are allocated here once, and
    `plan` (outside the graph, before each replay) copies a batch's values into them and
    rewrites the wrapper's own plan buffers. New K/V go in with `flashinfer.page.
    append_paged_kv_cache` (K and V of every row in one kernel) at `append_positions` [B] int32,
    each row's slot in its sequence (kv_len - 1), read from the same buffers.

    page_indices: the caller's fixed [capacity] int32 device buffer, shared by every batch size
    (a wrapper keeps its own copy); append_positions, batch_indices: fixed [B] int32 views.
    """

    name = "flashinfer-graph"

    def __init__(self, workspace: torch.Tensor, batch_size: int, page_indices: torch.Tensor,
                 append_positions: torch.Tensor, batch_indices: torch.Tensor, *,
                 num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int) -> None:
        if append_positions.shape != (batch_size,) or batch_indices.shape != (batch_size,):
            raise ValueError(f"append_positions and batch_indices must be [{batch_size}], got "
                             f"{tuple(append_positions.shape)} and {tuple(batch_indices.shape)}")
        device = workspace.device
        self.batch_size = batch_size
        self.heads = (num_qo_heads, num_kv_heads, head_dim, page_size)
        self._append_positions = append_positions
        self._batch_indices = batch_indices
        self._indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=device)
        self._indices = torch.zeros_like(page_indices)
        self._last_page_len = torch.ones(batch_size, dtype=torch.int32, device=device)
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, KV_LAYOUT, use_cuda_graph=True,
            use_tensor_cores=num_qo_heads // num_kv_heads not in CUDA_CORE_DECODE_GROUP_SIZES,
            paged_kv_indptr_buffer=self._indptr, paged_kv_indices_buffer=self._indices,
            paged_kv_last_page_len_buffer=self._last_page_len)

    @property
    def capacity(self) -> int:
        """Most page indices one batch may have."""
        return int(self._indices.shape[0])

    def plan(self, kv_indptr: torch.Tensor, kv_page_indices: torch.Tensor,
             kv_last_page_len: torch.Tensor, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        """Take one batch of exactly batch_size rows (never inside a graph).

        kv_indptr [B+1] and kv_last_page_len [B] int32 on the host (pinned on CUDA: FlashInfer's
        scheduler reads them there), kv_page_indices [nnz] int32 on the device."""
        for what, dtype in (("query", q_dtype), ("KV cache", kv_dtype)):
            if dtype not in SUPPORTED_DTYPES:
                raise ValueError(f"flashinfer attention needs float16 or bfloat16, the {what} is "
                                 f"{dtype}; run the engine with --dtype bfloat16 on CUDA")
        self._wrapper.plan(kv_indptr, kv_page_indices, kv_last_page_len, *self.heads,
                           pos_encoding_mode="NONE", q_data_type=q_dtype, kv_data_type=kv_dtype)

    def append_kv(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write each row's K/V [B, num_kv_heads, head_dim] at its tail slot (one kernel).

        kv_layer: [num_pages, 2, page_size, num_kv_heads, head_dim]  (NHD)"""
        flashinfer.page.append_paged_kv_cache(
            k, v, self._batch_indices, self._append_positions, kv_layer, self._indices,
            self._indptr, self._last_page_len, KV_LAYOUT)

    def run(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        """q [B, num_qo_heads, head_dim] -> attention output [B, num_qo_heads, head_dim]."""
        return self._wrapper.run(q.contiguous(), kv_layer)
