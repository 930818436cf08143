"""How many torch operations one CUDA-path decode step dispatches per layer, counted on the CPU.

The CUDA code path is selected on the CPU with the stand-in flashinfer
(tests/engine/flashinfer_stand_in.py), whose kernels are one torch custom op each, as the real
package's are: a TorchDispatchMode then sees what a GPU step launches, one operation per kernel
(views included: they cost the host dispatch time even when they launch nothing). The model runs
in float16 so that its projections take F.linear, the CUDA path's matmul (bf16 on the CPU takes
oneDNN's packed kernel instead). Per layer = (count with 4 layers - count with 2 layers) / 2, so
embedding, final norm, lm_head and argmax are left out.

Measured (docs/cuda.md states them), all operations (not views) per layer: the eager CUDA decode
of commit 3eed873, torch glue around FlashInfer attention, 31 (18); the same glue today 29 (16)
(two no-op casts before the K/V store are gone); with FlashInfer's fused kernels, eager 21 (11)
and the graph-replayed step 18 (10): 2 norms, 4 matmuls, RoPE, the K/V append, attention,
SiLU-and-mul and the copy that makes q contiguous.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.batch import GREEDY, ForwardBatch, ForwardRequest
from engine.kv_cache import KVCache
from engine.model.flashinfer_kernels import FlashInferKernels
from engine.model.llama import LlamaModel
from engine.page_table import build_page_table
from tests.engine.cuda_path import UNTIED, cuda_path_on_cpu, random_weights
from tests.engine.flashinfer_stand_in import stand_in_flashinfer

PAGE_SIZE, NUM_PAGES, ROWS = 4, 32, 3
DTYPE = torch.float16
TORCH_GLUE = (29, 16)       # (all, not views) per layer: the torch glue path (no fused kernels)
BOUNDS = {False: (21, 11), True: (18, 10)}    # graph step?: the same with the fused kernels
VIEWS = ("aten::reshape", "aten::chunk", "aten::t", "aten::split")   # composite, alias only


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def _is_view(func) -> bool:
    return bool(getattr(func, "is_view", False)) or func._schema.name in VIEWS


def _decode_batch() -> ForwardBatch:
    """ROWS requests, one token each, 6 tokens already in 2 pages each."""
    return ForwardBatch(tuple(
        ForwardRequest(token_ids=(5 + r,), positions=(6,), page_ids=(2 * r, 2 * r + 1),
                       last_page_len=3, output_indices=(0,), samplers=(GREEDY,))
        for r in range(ROWS)))


def _count(num_layers: int, fused: bool, graph: bool, backend) -> Counter:
    """Operations of one decode step of a `num_layers` model on the CUDA path's code."""
    config = dataclasses.replace(UNTIED, num_layers=num_layers)
    module = stand_in_flashinfer()
    kernels = FlashInferKernels(module, config, torch.device("cpu")) if fused else None
    model = LlamaModel(config, random_weights(config), DTYPE, "cpu", False, None, kernels)
    cache = KVCache(config, NUM_PAGES, PAGE_SIZE, DTYPE, scratch_pages=1)
    cache.pool.normal_()
    table = build_page_table(_decode_batch(), PAGE_SIZE)
    attention = backend.FlashInferAttention(num_qo_heads=config.num_heads,
                                            num_kv_heads=config.num_kv_heads,
                                            head_dim=config.head_dim, page_size=PAGE_SIZE,
                                            device="cpu", workspace_bytes=64)
    if graph:
        ids = table.input_ids.to(torch.int32)
        pages = torch.zeros(NUM_PAGES, dtype=torch.int32)
        pages[:len(table.kv_page_indices)] = table.kv_page_indices
        graph_attention = attention.graph_decode(ROWS, pages, (table.kv_lens - 1).to(torch.int32),
                                                 torch.arange(ROWS, dtype=torch.int32))
        graph_attention.plan(table.kv_indptr, pages[:len(table.kv_page_indices)],
                             table.kv_last_page_len, DTYPE, DTYPE)
        out = torch.empty(ROWS, dtype=torch.int64)
        with _Count() as counter:
            model.decode_greedy(ids, table.positions.to(torch.int32), cache, graph_attention, out)
        return counter.ops
    attention.plan(table)
    with _Count() as counter:
        model.forward(table, cache, attention)
    return counter.ops


def _per_layer(fused: bool, graph: bool, backend) -> tuple[int, int, Counter]:
    """(all operations, non-view operations, the per-layer ops by name) of one layer."""
    two, four = _count(2, fused, graph, backend), _count(4, fused, graph, backend)
    layer = Counter({func: (four[func] - two[func]) // 2 for func in four})
    layer = +layer
    kernels = sum(n for func, n in layer.items() if not _is_view(func))
    return sum(layer.values()), kernels, layer


@pytest.fixture
def backend(monkeypatch):
    with cuda_path_on_cpu(monkeypatch) as module:
        yield module


def test_torch_glue_decode_dispatches_what_it_did(backend):
    total, kernels, layer = _per_layer(fused=False, graph=False, backend=backend)
    assert (total, kernels) == TORCH_GLUE, dict(layer)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph step"])
def test_fused_decode_dispatches_far_fewer_ops_per_layer(backend, graph):
    total, kernels, layer = _per_layer(fused=True, graph=graph, backend=backend)
    assert total <= BOUNDS[graph][0] and kernels <= BOUNDS[graph][1], dict(layer)
    assert total <= TORCH_GLUE[0] * 3 // 4 and kernels <= TORCH_GLUE[1] * 3 // 4
    names = {func._schema.name for func in layer}
    assert {"pie_stand_in::fused_add_rmsnorm", "pie_stand_in::rope",
            "pie_stand_in::silu_and_mul", "pie_stand_in::paged_decode"} <= names
    assert ("pie_stand_in::append_paged_kv_cache" in names) == graph     # eager: indexed stores
    assert "aten::index_put_" not in names or not graph
