"""Pure greedy decode steps replayed from CUDA graphs, one per padded batch size.

A batch qualifies (`takes_graph_path`) when every request adds one token with no custom mask and
no drafts, asks for one output, and its sampler is plain greedy (no seed, processing, log-probs or
generation state: those need the host). Such a batch of B rows runs on the graph of the smallest
captured size Bp >= B; the Bp - B padding rows decode token 0 at position 0 into a scratch page
(engine.kv_cache's `scratch_pages`), never a page the host owns.

Fixed buffers, allocated once (int32 unless noted):
  input_ids [Bmax] | positions [Bmax] | append_positions [Bmax] | page_indices [capacity]
      one device tensor, filled from one pinned host tensor by a single copy per step;
  kv_indptr [Bmax+1], kv_last_page_len [Bmax] on the (pinned) host, read by FlashInfer's plan;
  tokens [Bmax] int64: each row's argmax, written by the graph.
A step: fill the host buffers from the page table (numpy), one host-to-device copy, plan the
size's decode wrapper (engine.attention.flashinfer.GraphDecodeAttention), replay, read tokens[:B]
(the step's one synchronisation).

Off CUDA (tests, with a stand-in flashinfer) there is nothing to capture: `replay` calls the
captured function itself over the same buffers, so the graph path's bookkeeping, padding and
tokens can be checked against the eager path on a CPU.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from engine.batch import ForwardBatch, SamplerSpec
from engine.kv_cache import KVCache
from engine.page_table import PageTable

__all__ = ["DecodeGraphs", "GraphCapture", "takes_graph_path", "is_plain_greedy"]

_log = logging.getLogger("pie.engine")


def is_plain_greedy(spec: SamplerSpec) -> bool:
    """A greedy sampler the graph's on-device argmax serves exactly (engine.sampling's plain)."""
    return (spec.kind == "greedy" and not spec.processed and spec.num_logprobs is None
            and spec.state is None)


def takes_graph_path(batch: ForwardBatch, max_rows: int) -> bool:
    """True for a pure greedy decode batch of 1..max_rows requests without adapters (see the
    module docstring)."""
    requests = batch.requests
    return 0 < len(requests) <= max_rows and all(
        len(r.token_ids) == 1 and r.mask is None and not r.num_drafted and r.adapter is None
        and r.output_indices == (0,) and len(r.samplers) == 1 and is_plain_greedy(r.samplers[0])
        for r in requests)


@dataclass(frozen=True)
class GraphCapture:
    """What capturing cost: the sizes captured and the device memory they took (bytes)."""

    batch_sizes: tuple[int, ...]
    memory_bytes: int
    captured: bool                 # False off CUDA: replay runs the step eagerly


class DecodeGraphs:
    """The fixed buffers, per-size attention and graphs of pure greedy decode steps.

    step(input_ids, positions, attention, out) runs one decode step of len(input_ids) rows and
    writes each row's argmax into out (LlamaModel.decode_greedy over the KV cache); make_attention
    (batch_size, page_indices, append_positions, batch_indices) builds the fixed-size attention
    (FlashInferAttention.graph_decode). `capacity`: most page indices one batch may reference
    (a batch with more runs eagerly)."""

    def __init__(self, step: Callable[..., None], make_attention: Callable[..., object],
                 kv_cache: KVCache, batch_sizes: tuple[int, ...], capacity: int,
                 q_dtype: torch.dtype, device: torch.device) -> None:
        if kv_cache.scratch_pages < 1:
            raise ValueError("the KV cache needs a scratch page for the padding rows")
        self.batch_sizes = tuple(batch_sizes)
        self.max_rows = self.batch_sizes[-1]
        self.device = device
        self._step = step
        self._q_dtype = q_dtype
        self._kv_dtype = kv_cache.dtype
        self._scratch_page = kv_cache.num_pages               # the first scratch page
        self._page_size = kv_cache.page_size
        rows = self.max_rows
        self._ids_at, self._pos_at, self._slot_at, self._pages_at = 0, rows, 2 * rows, 3 * rows
        pin = device.type == "cuda"
        self._host = torch.zeros(3 * rows + capacity, dtype=torch.int32, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._indptr_host = torch.zeros(rows + 1, dtype=torch.int32, pin_memory=pin)
        self._last_host = torch.ones(rows, dtype=torch.int32, pin_memory=pin)
        self._indptr_np, self._last_np = self._indptr_host.numpy(), self._last_host.numpy()
        self._device_buffer = torch.zeros_like(self._host, device=device)
        buffer = self._device_buffer
        self.input_ids = buffer[self._ids_at:self._ids_at + rows]          # [Bmax]
        self.positions = buffer[self._pos_at:self._pos_at + rows]          # [Bmax]
        self.append_positions = buffer[self._slot_at:self._slot_at + rows]  # [Bmax]
        self.page_indices = buffer[self._pages_at:]                        # [capacity]
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=device)  # [Bmax]
        self._batch_indices = torch.arange(rows, dtype=torch.int32, device=device)
        self.attention = {b: make_attention(b, self.page_indices, self.append_positions[:b],
                                            self._batch_indices[:b]) for b in self.batch_sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @property
    def capacity(self) -> int:
        return int(self.page_indices.shape[0])

    def padded_size(self, num_rows: int) -> int | None:
        """The smallest captured size >= num_rows, None when larger than every one."""
        for size in self.batch_sizes:
            if size >= num_rows:
                return size
        return None

    def run(self, table: PageTable) -> list[int] | None:
        """Greedy tokens of a pure decode batch's rows, in order; None (nothing done) when the
        batch has more rows or page indices than the buffers hold."""
        num_rows, num_indices = table.num_requests, int(table.kv_page_indices.shape[0])
        size = self.padded_size(num_rows)
        if size is None or num_indices + size - num_rows > self.capacity:
            return None
        used = self._fill(table, size)
        self._device_buffer[:used].copy_(self._host[:used], non_blocking=True)
        self._plan(size, num_indices + size - num_rows)
        self.replay(size)
        return self.tokens[:num_rows].tolist()        # the step's one host synchronisation

    def _fill(self, table: PageTable, size: int) -> int:
        """Write the batch, padded to `size` rows, into the host buffers; entries to copy."""
        host, b, pad = self._host_np, table.num_requests, size - table.num_requests
        num_indices = int(table.kv_page_indices.shape[0])
        ids, pos, slot, pages = self._ids_at, self._pos_at, self._slot_at, self._pages_at
        host[ids:ids + b] = table.input_ids.numpy()
        host[pos:pos + b] = table.positions.numpy()
        host[slot:slot + b] = table.kv_lens.numpy() - 1        # each row's slot in its sequence
        host[ids + b:ids + size] = host[pos + b:pos + size] = host[slot + b:slot + size] = 0
        host[pages:pages + num_indices] = table.kv_page_indices.numpy()
        host[pages + num_indices:pages + num_indices + pad] = self._scratch_page
        self._indptr_np[:b + 1] = table.kv_indptr.numpy()
        self._indptr_np[b + 1:size + 1] = num_indices + np.arange(1, pad + 1)
        self._last_np[:b] = table.kv_last_page_len.numpy()
        self._last_np[b:size] = 1
        return pages + num_indices + pad

    def _plan(self, size: int, num_indices: int) -> None:
        self.attention[size].plan(self._indptr_host[:size + 1], self.page_indices[:num_indices],
                                  self._last_host[:size], self._q_dtype, self._kv_dtype)

    def _run_step(self, size: int) -> None:
        self._step(self.input_ids[:size], self.positions[:size], self.attention[size],
                   self.tokens[:size])

    def replay(self, size: int) -> None:
        """Run the planned step of `size` rows over the buffers: the graph on CUDA, the captured
        function itself elsewhere."""
        graph = self._graphs.get(size)
        if graph is not None:
            graph.replay()
        else:
            self._run_step(size)

    def capture(self) -> GraphCapture:
        """Capture every size (largest first, one memory pool) on CUDA, each planned for a batch
        of padding rows and run once eagerly first (JIT, cuBLAS workspaces); elsewhere nothing."""
        if self.device.type != "cuda":
            return GraphCapture(self.batch_sizes, 0, captured=False)
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        stream = torch.cuda.Stream(self.device)
        pool = None
        for size in reversed(self.batch_sizes):
            self._plan_padding(size)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._run_step(size)                      # warm-up outside the capture
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._run_step(size)
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        return GraphCapture(self.batch_sizes, int(used), captured=True)

    def _plan_padding(self, size: int) -> None:
        """Plan `size` padding rows (the scratch page, one token each): a batch to capture on."""
        self._host_np[:] = 0
        self._host_np[self._pages_at:self._pages_at + size] = self._scratch_page
        self._indptr_np[:size + 1] = np.arange(size + 1)
        self._last_np[:size] = 1
        self._device_buffer.copy_(self._host, non_blocking=True)
        self._plan(size, size)
