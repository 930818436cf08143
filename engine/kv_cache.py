"""The KV page pool: one tensor per layer, pages addressed by physical id only.

Layout (KV_LAYOUT = "NHD"), per layer:

    [num_pages, 2, page_size, num_kv_heads, head_dim]      index 0 of dim 1 = K, 1 = V

Why this layout:
- it is FlashInfer's single-tensor paged KV cache in its "NHD" layout, so the CUDA backend can hand
  each layer's tensor to FlashInfer's wrappers and `append_paged_kv_cache` without any copy;
- one page holds K and V of all its tokens contiguously, so copying or sharing a page is one slice,
  and the torch backend gathers a request's context with one `index_select` over a flat slot view
  (`slot_view`: K of (page, s) is row page*2*page_size + s, V is that + page_size);
- NHD keeps a token's heads together, matching the [num_tokens, num_kv_heads, head_dim] layout the
  projections produce, so writing the new tokens is a plain indexed store.

All layers live in one allocation [num_layers, num_pages, 2, page_size, num_kv_heads, head_dim]
(`layer(i)` is a view), so a token copy across all layers is a single slice assignment. The pool is
allocated with `torch.empty` (pages the OS has not touched cost no RSS); a slot is only ever read
after a forward pass has written it.
"""
from __future__ import annotations

from typing import Sequence

import torch

from engine.batch import TokenCopy
from engine.engine_config import EngineConfig, ModelConfig

__all__ = ["KV_LAYOUT", "KVCache", "num_pages_for"]

KV_LAYOUT = "NHD"


def page_bytes(model: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes one page occupies across all layers (K and V)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return model.num_layers * 2 * page_size * model.num_kv_heads * model.head_dim * element_size


def num_pages_for(model: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> int:
    """`config.num_pages` when given, else as many pages as fit in `config.kv_memory_mb`."""
    if config.num_pages is not None:
        return config.num_pages
    num_pages = config.kv_memory_mb * 2**20 // page_bytes(model, config.page_size, dtype)
    if num_pages <= 0:
        raise ValueError(f"kv_memory_mb={config.kv_memory_mb} holds no page of "
                         f"{page_bytes(model, config.page_size, dtype)} bytes")
    return int(num_pages)


class KVCache:
    """The page pool tensors. Knows nothing about which request owns a page."""

    def __init__(self, model: ModelConfig, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu",
                 scratch_pages: int = 0) -> None:
        """`num_pages` pages the host addresses (ids 0..num_pages-1), then `scratch_pages` more
        that only the engine writes (engine.cuda_graphs: the padded rows of a replayed decode
        step write their K/V there); copies and batches never name a scratch page."""
        if scratch_pages < 0:
            raise ValueError(f"scratch_pages must be >= 0, got {scratch_pages}")
        self.num_layers = model.num_layers
        self.num_pages = num_pages
        self.scratch_pages = scratch_pages
        self.page_size = page_size
        self.num_kv_heads = model.num_kv_heads
        self.head_dim = model.head_dim
        self.dtype = dtype
        # [num_layers, num_pages, 2, page_size, num_kv_heads, head_dim]
        self.pool = torch.empty(model.num_layers, num_pages + scratch_pages, 2, page_size,
                                model.num_kv_heads,
                                model.head_dim, dtype=dtype, device=device)
        self.layers = list(self.pool.unbind(0))       # per-layer views, made once

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page across all layers, K and V: what `read_pages` copies per page."""
        return (self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim
                * self.pool.element_size())

    def layer(self, layer_idx: int) -> torch.Tensor:
        """[num_pages + scratch_pages, 2, page_size, num_kv_heads, head_dim] view of one layer."""
        return self.layers[layer_idx]

    def check_copies(self, copies: Sequence[TokenCopy]) -> None:
        """Raise ValueError naming the copy index and field for an out-of-range copy."""
        for i, copy in enumerate(copies):
            for field in ("src_page_id", "dst_page_id"):
                page_id = getattr(copy, field)
                if not 0 <= page_id < self.num_pages:
                    raise ValueError(f"copy {i}: field {field}: page id {page_id} out of range "
                                     f"[0, {self.num_pages})")
            if copy.num_tokens < 0:
                raise ValueError(f"copy {i}: field num_tokens: {copy.num_tokens} < 0")
            for field in ("src_offset", "dst_offset"):
                offset = getattr(copy, field)
                if offset < 0 or offset + copy.num_tokens > self.page_size:
                    raise ValueError(f"copy {i}: field {field}: slots {offset}.."
                                     f"{offset + copy.num_tokens} exceed page size {self.page_size}")

    def check_page_ids(self, page_ids: Sequence[int], call: str) -> None:
        """Raise ValueError naming `call` and the index for a page id outside [0, num_pages)."""
        for i, page_id in enumerate(page_ids):
            if not 0 <= page_id < self.num_pages:
                raise ValueError(f"{call}: page_ids[{i}]={page_id} out of range "
                                 f"[0, {self.num_pages})")

    def read_pages(self, page_ids: Sequence[int]) -> torch.Tensor:
        """A host (CPU) copy of whole pages, all layers, K and V, in `page_ids` order:
        [num_layers, len(page_ids), 2, page_size, num_kv_heads, head_dim], the pool's dtype.
        Bit-exact: `write_pages` of it restores the same bytes."""
        self.check_page_ids(page_ids, "read_pages")
        index = torch.tensor(list(page_ids), dtype=torch.long, device=self.pool.device)
        # [num_layers, n, 2, page_size, num_kv_heads, head_dim]
        return self.pool.index_select(1, index).to("cpu")

    def write_pages(self, page_ids: Sequence[int], data: torch.Tensor) -> None:
        """Overwrite whole pages with `data` as `read_pages` returned it (same page count, shape
        and dtype; ValueError otherwise, nothing written)."""
        self.check_page_ids(page_ids, "write_pages")
        expected = (self.num_layers, len(page_ids), 2, self.page_size, self.num_kv_heads,
                    self.head_dim)
        if tuple(data.shape) != expected or data.dtype != self.dtype:
            raise ValueError(f"write_pages: data of shape {tuple(data.shape)} and dtype "
                             f"{data.dtype}, expected {expected} and {self.dtype}")
        if len(set(page_ids)) != len(page_ids):
            raise ValueError("write_pages: a page id is listed twice")
        index = torch.tensor(list(page_ids), dtype=torch.long, device=self.pool.device)
        self.pool.index_copy_(1, index, data.to(self.pool.device))

    def copy_tokens(self, copies: Sequence[TokenCopy]) -> int:
        """Copy token slots (K and V, all layers) page to page, in order. Returns tokens copied.

        All copies are checked before any is applied, so a bad list changes nothing.
        """
        self.check_copies(copies)
        for copy in copies:
            n = copy.num_tokens
            src = self.pool[:, copy.src_page_id, :, copy.src_offset:copy.src_offset + n]
            # clone: source and destination may overlap when they are the same page
            self.pool[:, copy.dst_page_id, :, copy.dst_offset:copy.dst_offset + n] = src.clone()
        return sum(c.num_tokens for c in copies)
