"""The decode graph path on a real GPU: graph and eager give the same greedy tokens, and a replay
does no host synchronisation (torch.cuda.set_sync_debug_mode("error")).

Marked `cuda` and skipped only when CUDA is absent (with CUDA but no flashinfer they fail naming
the `cuda` extra). The CPU twin of these checks: tests/engine/test_cuda_graphs.py.
"""
from __future__ import annotations

import pytest
import torch

from engine.batch import ForwardBatch
from engine.page_table import build_page_table
from tests.engine.test_cuda_graphs import PAGE_SIZE, PROMPTS, _decode_request, _pages

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SIZES = (1, 2, 4, 8)


def _engine(**overrides):
    from engine.engine import Engine
    from engine.engine_config import EngineConfig
    from tests.engine.cuda_path import UNTIED, random_weights

    settings = {"page_size": PAGE_SIZE, "num_pages": 64, "dtype": "bfloat16", "device": "cuda",
                "attention_backend": "flashinfer", "cuda_graph_batch_sizes": SIZES, **overrides}
    return Engine(UNTIED, random_weights(UNTIED), None, EngineConfig(**settings), seed=0)


def test_graph_and_eager_paths_give_the_same_tokens_on_cuda():
    graphs, eager = _engine(), _engine(cuda_graphs=False)
    assert graphs.graph_capture.captured and graphs.graph_capture.memory_bytes >= 0
    for prompts in (PROMPTS, PROMPTS[1:2]):
        assert graphs.generate_greedy_batch(prompts, 12) == eager.generate_greedy_batch(prompts, 12)


def test_the_default_model_decodes_the_same_with_and_without_graphs():
    from engine import load_default_engine

    prompts = [[1, 504, 3458, 314], [1, 2136], [1, 504, 1200, 282, 260, 1867]]
    runs = [load_default_engine(device="cuda", dtype="bfloat16", num_pages=64, page_size=16,
                                progress=False, seed=0, cuda_graphs=on,
                                cuda_graph_batch_sizes=SIZES).generate_greedy_batch(prompts, 16)
            for on in (True, False)]
    assert runs[0] == runs[1]


def test_a_replay_does_not_synchronise_with_the_host():
    engine = _engine()
    engine.generate_greedy_batch(PROMPTS, 3)
    graphs = engine.decode_graphs
    requests = tuple(_decode_request(9, len(p) + 2, _pages(r, 3)) for r, p in enumerate(PROMPTS))
    table = build_page_table(ForwardBatch(requests), PAGE_SIZE)
    used = graphs._fill(table, 4)
    graphs._device_buffer[:used].copy_(graphs._host[:used], non_blocking=True)
    graphs._plan(4, int(table.kv_page_indices.shape[0]) + 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graphs.replay(4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(graphs.tokens[:3].tolist()) == 3
