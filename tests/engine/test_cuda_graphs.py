"""The decode graph path (engine.cuda_graphs) with the CUDA code path selected on the CPU.

A stand-in flashinfer (tests/engine/flashinfer_stand_in.py) computes the fused kernels and the
CUDA-graph-mode decode wrapper in torch; `replay` runs the captured step eagerly over the same
fixed buffers. Checked here: the graph path gives the same greedy tokens as the eager path and as
the float32 CPU engine, padding rows never touch the host's pages, only pure greedy decode batches
take it, and one replayed step reads only its fixed buffers, the weights and the pool, with no
host synchronisation. The same on a GPU: tests/engine/test_cuda_graphs_gpu.py.
"""
from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.batch import GREEDY, ForwardBatch, ForwardRequest, SamplerSpec
from engine.cuda_graphs import takes_graph_path
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.page_table import build_page_table
from tests.engine.cuda_path import UNTIED, cuda_path_on_cpu, random_weights

PAGE_SIZE, NUM_PAGES = 4, 64
SIZES = (1, 2, 4, 8)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
# where the stand-in kernels' torch code lives: on a GPU that is device code, free to read values
STAND_IN_KERNEL_FILES = ("tests/engine/flashinfer_stand_in.py", "tests/engine/test_device.py")


def _engine(monkeypatch, **overrides) -> Engine:
    settings = {"page_size": PAGE_SIZE, "num_pages": NUM_PAGES, "dtype": "bfloat16",
                "cuda_graph_batch_sizes": SIZES, **overrides}
    with cuda_path_on_cpu(monkeypatch):
        return Engine(UNTIED, random_weights(UNTIED), None, EngineConfig(**settings), seed=0)


def _replays(engine: Engine) -> int:
    return sum(a._wrapper.num_plans for a in engine.decode_graphs.attention.values())


def test_graph_path_gives_the_eager_and_the_cpu_engines_tokens(monkeypatch):
    """3 prompts padded to 4 rows, then 1 prompt (no padding): 12 greedy steps each."""
    cpu = Engine(UNTIED, random_weights(UNTIED), None,
                 EngineConfig(page_size=PAGE_SIZE, num_pages=NUM_PAGES, dtype="float32"))
    assert cpu.decode_graphs is None and cpu.model.kernels is None
    assert cpu.kv_cache.scratch_pages == 0                       # the CPU engine is unchanged
    graphs = _engine(monkeypatch)
    eager = _engine(monkeypatch, cuda_graphs=False)
    assert eager.decode_graphs is None and eager.model.kernels is not None
    for prompts in (PROMPTS, PROMPTS[1:2]):
        expected = cpu.generate_greedy_batch(prompts, 12)
        replays = _replays(graphs)
        assert graphs.generate_greedy_batch(prompts, 12) == expected
        assert eager.generate_greedy_batch(prompts, 12) == expected
        assert _replays(graphs) == replays + 11     # every step after the prefill
    assert "replay" in graphs.decode_paths and "every pass eager" in eager.decode_paths


def test_padding_rows_write_only_the_scratch_page(monkeypatch):
    engine = _engine(monkeypatch)
    pool = engine.kv_cache.pool
    pool.zero_()
    engine.generate_greedy_batch(PROMPTS, 3)                     # 3 rows padded to 4
    used = {p for r in range(len(PROMPTS)) for p in _pages(r, 3)}
    scratch = engine.kv_cache.num_pages
    assert pool.shape[1] == NUM_PAGES + 1
    written = {p for p in range(pool.shape[1]) if bool(pool[:, p].any())}
    assert written == used | {scratch}


def _pages(row: int, num_new_tokens: int) -> tuple[int, ...]:
    """The pages generate_greedy_batch(PROMPTS, num_new_tokens) gives prompt `row` (each prompt
    consecutive pages from 0, enough for all its tokens)."""
    counts = [-(-(len(p) + num_new_tokens) // PAGE_SIZE) for p in PROMPTS]
    start = sum(counts[:row])
    return tuple(range(start, start + counts[row]))


def _decode_request(token: int, position: int, pages: tuple[int, ...],
                    sampler: SamplerSpec = GREEDY, **fields) -> ForwardRequest:
    last = position % PAGE_SIZE + 1
    return ForwardRequest(token_ids=(token,), positions=(position,), page_ids=pages,
                          last_page_len=last, output_indices=(0,), samplers=(sampler,), **fields)


def test_only_pure_greedy_decode_batches_take_the_graph_path():
    plain = _decode_request(3, 5, (0, 1))
    assert takes_graph_path(ForwardBatch((plain,) * 8), max_rows=8)
    assert not takes_graph_path(ForwardBatch((plain,) * 9), max_rows=8)          # too many rows
    assert not takes_graph_path(ForwardBatch(()), max_rows=8)
    others = {
        "sample": _decode_request(3, 5, (0, 1), SamplerSpec(kind="sample", temperature=0.7)),
        "seeded": _decode_request(3, 5, (0, 1), SamplerSpec(kind="sample", seed=4)),
        "logprobs": _decode_request(3, 5, (0, 1), SamplerSpec(kind="greedy", num_logprobs=2)),
        "logit bias": _decode_request(3, 5, (0, 1),
                                      SamplerSpec(kind="greedy", logit_bias=((4, 2.0),))),
        "distribution": _decode_request(3, 5, (0, 1), SamplerSpec(kind="distribution", num_top=3)),
        "masked": _decode_request(3, 5, (0, 1), mask=((6,),)),
        "prefill": ForwardRequest(token_ids=(3, 4), positions=(5, 6), page_ids=(0, 1),
                                  last_page_len=3, output_indices=(1,), samplers=(GREEDY,)),
        "no output": ForwardRequest(token_ids=(3,), positions=(5,), page_ids=(0, 1),
                                    last_page_len=2),
    }
    for name, request in others.items():
        assert not takes_graph_path(ForwardBatch((plain, request)), max_rows=8), name


def test_a_sampling_row_runs_the_step_eagerly(monkeypatch):
    engine = _engine(monkeypatch)
    engine.generate_greedy_batch(PROMPTS[:1], 2)
    replays = _replays(engine)
    # positions 0..5 are written (5 prompt tokens, one decode step): 6 is the next
    sample = _decode_request(5, 6, _pages(0, 2), SamplerSpec(kind="sample", temperature=0.8, seed=1))
    [result] = engine.forward(ForwardBatch((sample,)))
    assert isinstance(result.outputs[0], int) and _replays(engine) == replays


def _key(t: torch.Tensor) -> int:
    """A tensor's storage address (an opaque tensor, e.g. a oneDNN-packed weight: its identity)."""
    try:
        return t.untyped_storage().data_ptr()
    except NotImplementedError:
        return id(t)


class _HostReadGuard(TorchDispatchMode):
    """Fails on any host read or cross-device copy, and on any input that is neither one of
    `allowed` storages nor made earlier in the same step."""

    REJECTED = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
                torch.ops.aten.lift_fresh.default}

    def __init__(self, allowed: set[int]) -> None:
        super().__init__()
        self.allowed, self.made, self.ops = set(allowed), set(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        assert func not in self.REJECTED, f"host synchronisation: {func}"
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)]
        for t in inputs:
            ptr = _key(t)
            assert ptr in self.allowed or ptr in self.made, f"{func} reads a tensor from outside"
        if func is torch.ops.aten._to_copy.default and "device" in kwargs:
            assert kwargs["device"] == inputs[0].device, f"{func} copies across devices"
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made.add(_key(t))
        self.ops.append(func)
        return out


def _storages(*roots) -> set[int]:
    """Data pointers of every tensor reachable from `roots` (attributes, lists, dicts)."""
    found, seen, stack = set(), set(), list(roots)
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            found.add(_key(item))
        elif isinstance(item, (list, tuple, set)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            stack.extend(vars(item).values())
        elif hasattr(item, "__slots__"):
            stack.extend(getattr(item, s) for s in item.__slots__ if hasattr(item, s))
    return found


def test_a_replayed_step_reads_only_its_buffers_and_never_syncs(monkeypatch):
    engine = _engine(monkeypatch)
    engine.generate_greedy_batch(PROMPTS, 3)     # prefill + 2 graph steps: positions 0..len+1
    graphs = engine.decode_graphs
    requests = tuple(_decode_request(9, len(p) + 2, _pages(r, 3)) for r, p in enumerate(PROMPTS))
    table = build_page_table(ForwardBatch(requests), PAGE_SIZE)
    used = graphs._fill(table, 4)
    graphs._device_buffer[:used].copy_(graphs._host[:used])
    graphs._plan(4, int(table.kv_page_indices.shape[0]) + 1)
    allowed = _storages(engine.model, engine.kv_cache.pool, graphs.attention[4],
                        graphs._device_buffer, graphs.tokens, graphs._batch_indices)
    for name in ("tolist", "item", "cpu", "numpy", "__int__", "__bool__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, _refuse(name, getattr(torch.Tensor, name)))
    with _HostReadGuard(allowed) as guard:
        graphs.replay(4)
    monkeypatch.undo()
    assert len(guard.ops) > 10 * UNTIED.num_layers
    tokens = graphs.tokens[:3].tolist()
    eager = _engine(monkeypatch, cuda_graphs=False)
    eager.generate_greedy_batch(PROMPTS, 3)
    assert tokens == [r.outputs[0] for r in eager.forward(ForwardBatch(requests))]


def _refuse(name: str, original):
    """Tensor.<name> that fails, except inside a stand-in kernel (device code on a GPU)."""
    def refuse(*args, **kwargs):
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename.endswith(STAND_IN_KERNEL_FILES):
                return original(*args, **kwargs)
            frame = frame.f_back
        raise AssertionError(f"Tensor.{name} in a replayed step: a host synchronisation")
    return refuse


@pytest.mark.parametrize("sizes", [(), (0, 1), (2, 1), (1, 1), (1.5,)])
def test_bad_batch_size_ladders_are_refused(sizes):
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        EngineConfig(cuda_graph_batch_sizes=sizes)


def test_a_list_ladder_is_kept_as_a_tuple():
    assert EngineConfig(cuda_graph_batch_sizes=[1, 3]).cuda_graph_batch_sizes == (1, 3)
