"""The CUDA path's calls into the real flashinfer package, checked on a CPU (docs/cuda.md).

The attention backend and the CUDA sampler run against a recording proxy around the real
flashinfer (tests/engine/flashinfer_recording.py): every call binds to the real signature, its
arguments must meet what flashinfer's docstrings require (tests/engine/flashinfer_contract.py), and
the stand-in computes the result. Each batch runs twice: on the CPU (values: the stand-in's output
against the torch backend, index tensors against the page table) and on the meta device (which
tensors sit on the device and which on the host, at full workspace size, where nothing computes).

Needs flashinfer-python (`make check-cuda` installs the checked version and runs this file with
PIE_CHECK_CUDA=1, where a missing or broken package is an error). Without the package, and outside
`make check-cuda`, the module is skipped: `make setup` does not install it (docs/cuda.md says why).
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys

import pytest
import torch

if os.environ.get("PIE_CHECK_CUDA") == "1":
    import flashinfer                 # make check-cuda: missing or broken is a failure
else:
    flashinfer = pytest.importorskip(
        "flashinfer", reason="flashinfer-python is not installed; `make check-cuda` installs it")
import flashinfer.page                # noqa: E402  (pure-torch helpers the contract calls)
import flashinfer.prefill             # noqa: E402

from engine.attention import TorchPagedAttention                            # noqa: E402
from engine.attention.flashinfer import WORKSPACE_BYTES                     # noqa: E402
from engine.batch import ForwardBatch, SamplerSpec                          # noqa: E402
from engine.engine_config import ModelConfig                                       # noqa: E402
from engine.device import FLASHINFER_CHECKED_VERSION                        # noqa: E402
from engine.kv_cache import KVCache                                         # noqa: E402
from engine.page_table import build_page_table                             # noqa: E402
from tests.engine.flashinfer_contract import check_attention_calls, check_sampling_call  # noqa: E402
from tests.engine.flashinfer_recording import (DECODE, PREFILL, Recorder, plan_target,  # noqa: E402
                                               recording_flashinfer)
from tests.engine.test_device import (D, DECODE_A, DECODE_B, HKV, HQ, MASKED, NUM_PAGES,  # noqa: E402
                                      PAGE_SIZE, PREFILL as PREFILL_REQUEST, _forget_backend_module,
                                      _request)
from tests.engine.test_sampling_cuda import SPECS, VOCAB, _logits                  # noqa: E402

NUM_LAYERS = 2
FORK = _request(3, (0, 1, 12), 3)          # shares DECODE_A's full pages 0 and 1, adds 3 tokens
MASKED_DECODE = _request(1, (3,), 3, mask=((1, 1, 1),))
BATCHES = {                                # name -> (requests, the wrapper FlashInfer must run)
    "decode": ((DECODE_A, DECODE_B), DECODE),
    "prefill": ((PREFILL_REQUEST,), PREFILL),
    "mixed": ((PREFILL_REQUEST, DECODE_A, MASKED, DECODE_B), PREFILL),
    "masked": ((MASKED, MASKED_DECODE), PREFILL),
    "shared_pages": ((DECODE_A, FORK, DECODE_B), PREFILL),
}
MODEL = ModelConfig(name="heads-only", vocab_size=VOCAB, hidden_size=HQ * D, intermediate_size=8,
                    num_layers=NUM_LAYERS, num_heads=HQ, num_kv_heads=HKV, head_dim=D,
                    max_position=256)


@pytest.fixture
def recorded(monkeypatch):
    """Install a recording flashinfer; yields make(compute) -> (recorder, backend module)."""
    def make(compute: bool):
        recorder = Recorder()
        monkeypatch.setitem(sys.modules, "flashinfer",
                            recording_flashinfer(flashinfer, recorder, compute))
        _forget_backend_module()
        return recorder, importlib.import_module("engine.attention.flashinfer")

    yield make
    _forget_backend_module()


def _run_layers(backend_module, requests, device, dtype, workspace_bytes, seed=0):
    """Plan once, then append_kv + run per layer on a real KVCache pool; returns (table, outs)."""
    gen = torch.Generator().manual_seed(seed)
    table = build_page_table(ForwardBatch(tuple(requests)), PAGE_SIZE)
    cache = KVCache(MODEL, NUM_PAGES, PAGE_SIZE, dtype, device)
    if device.type != "meta":
        cache.pool.copy_(torch.randn(cache.pool.shape, generator=gen))
    backend = backend_module.FlashInferAttention(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                                 page_size=PAGE_SIZE, device=device,
                                                 workspace_bytes=workspace_bytes)
    backend.plan(table)
    outs = []
    for layer in range(NUM_LAYERS):
        q = torch.randn(table.num_tokens, HQ, D, generator=gen).to(device, dtype)
        k, v = torch.randn(2, table.num_tokens, HKV, D, generator=gen).to(device, dtype)
        backend.append_kv(cache.layer(layer), k, v)
        outs.append((q, cache.layer(layer), backend.run(q, cache.layer(layer))))
    return table, outs


@pytest.mark.parametrize("batch", list(BATCHES))
def test_backend_calls_bind_and_meet_the_contract_on_cpu(recorded, batch):
    requests, wrapper = BATCHES[batch]
    recorder, backend_module = recorded(compute=True)
    table, outs = _run_layers(backend_module, requests, torch.device("cpu"), torch.bfloat16, 64)
    used = check_attention_calls(recorder.calls, table, torch.device("cpu"), (HQ, HKV, D),
                                 (torch.bfloat16, torch.bfloat16), NUM_PAGES, NUM_LAYERS, 64,
                                 flashinfer)
    assert used == wrapper
    reference = TorchPagedAttention(HQ, HKV, D, PAGE_SIZE)      # the stand-in's answer is the right one
    reference.plan(table)
    for q, kv_layer, out in outs:
        expected = reference.run(q.float(), kv_layer.float())
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_backend_tensors_sit_where_flashinfer_reads_them(recorded, batch, dtype):
    """On the meta device: workspace, pages, mask, q and cache on the device, full 128 MiB
    workspace; indptrs on the host unless the batch has a mask."""
    requests, wrapper = BATCHES[batch]
    recorder, backend_module = recorded(compute=False)
    meta = torch.device("meta")
    table, _ = _run_layers(backend_module, requests, meta, dtype, WORKSPACE_BYTES)
    used = check_attention_calls(recorder.calls, table, meta, (HQ, HKV, D), (dtype, dtype),
                                 NUM_PAGES, NUM_LAYERS, WORKSPACE_BYTES, flashinfer)
    assert used == wrapper


def test_fused_sampler_call_binds_and_meets_the_contract(monkeypatch):
    from engine.sampling_cuda import CudaSampler, uses_fused_sampling

    recorder = Recorder()
    monkeypatch.setitem(sys.modules, "flashinfer", recording_flashinfer(flashinfer, recorder))
    sampler = CudaSampler("cpu", seed=3)
    logits = _logits(1)
    tokens = sampler.sample(logits, SPECS)
    fused_rows = [r for r, spec in enumerate(SPECS) if uses_fused_sampling(spec)]
    [call] = recorder.calls
    check_sampling_call(call, len(fused_rows), VOCAB, torch.device("cpu"))
    assert call.arguments["generator"] is sampler._generator
    assert [tokens[r] for r in fused_rows] == logits[fused_rows].argmax(-1).tolist()   # stand-in's


def test_a_call_the_real_signature_refuses_fails_at_the_proxy():
    """The proxy is strict: what the real functions would refuse, binding refuses."""
    recorder = Recorder()
    module = recording_flashinfer(flashinfer, recorder, compute=False)
    decode = module.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64, dtype=torch.uint8), "NHD")
    index = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(TypeError, match="q_dtype"):                  # misspelt keyword
        decode.plan(index, index[:1], index[:1], HQ, HKV, D, PAGE_SIZE, q_dtype=torch.bfloat16)
    with pytest.raises(TypeError):                                   # keyword-only, given positionally
        recorder.bind("decode.plan", plan_target(flashinfer.BatchDecodeWithPagedKVCacheWrapper),
                      (index, index[:1], index[:1], HQ, HKV, D, PAGE_SIZE, "NONE"), {})
    with pytest.raises(TypeError, match="page_size"):                # missing argument
        module.BatchPrefillWithPagedKVCacheWrapper(torch.empty(64, dtype=torch.uint8)).plan(
            index, index, index[:0], index[:1], HQ, HKV, D)
    with pytest.raises(TypeError, match="temperature"):
        module.sampling.top_k_top_p_sampling_from_probs(torch.ones(1, 2) / 2, 1, 1.0,
                                                        temperature=1.0)
    assert [call.name for call in recorder.calls] == [f"{DECODE}.__init__", f"{PREFILL}.__init__"]


def test_the_checked_version_is_the_installed_one():
    """`make check-cuda` installs FLASHINFER_CHECKED_VERSION; the decode wrapper's public `plan`
    takes **kwargs, so the proxy binds the `_plan_impl` it forwards to, which names them."""
    assert flashinfer.__version__ == FLASHINFER_CHECKED_VERSION
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper
    assert "q_data_type" not in inspect.signature(decode.plan).parameters
    assert plan_target(decode) is decode._plan_impl
    assert "q_data_type" in inspect.signature(decode._plan_impl).parameters
    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper
    assert plan_target(prefill) is prefill.plan


# ---- the fused layer kernels and the CUDA-graph decode (engine.cuda_graphs) --------------------
GRAPH_SIZES = (1, 2, 4)


def _graph_engine_calls(monkeypatch) -> tuple[Recorder, object]:
    """The CUDA-path engine on the CPU over a recording flashinfer: a prefill of 3 prompts, then
    3 decode steps (3 rows padded to 4, replayed from the graph path)."""
    from engine.engine import Engine
    from engine.engine_config import EngineConfig
    from tests.engine.cuda_path import UNTIED, cuda_path_on_cpu, random_weights

    recorder = Recorder()
    with cuda_path_on_cpu(monkeypatch, recording_flashinfer(flashinfer, recorder)):
        engine = Engine(UNTIED, random_weights(UNTIED), None,
                        EngineConfig(page_size=4, num_pages=32, dtype="bfloat16",
                                     cuda_graph_batch_sizes=GRAPH_SIZES), seed=0)
        engine.generate_greedy_batch([[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]], 4)
    return recorder, engine


def _int32_on(t, device, length=None):
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1
    assert t.device == device and t.is_contiguous()
    assert length is None or t.shape[0] == length


def test_graph_decode_wrappers_bind_in_cuda_graph_mode(monkeypatch):
    """One decode wrapper per size, built with use_cuda_graph=True over int32 device buffers of
    [B+1] / [capacity] / [B]; each plan keeps the size, indptr and last-page lengths on the host,
    page indices on the device; one plan and one run per layer per replayed step."""
    recorder, engine = _graph_engine_calls(monkeypatch)
    cpu = torch.device("cpu")
    inits = [c for c in recorder.named(f"{DECODE}.__init__") if c.arguments["use_cuda_graph"]]
    assert [len(c.arguments["paged_kv_last_page_len_buffer"]) for c in inits] == list(GRAPH_SIZES)
    capacity = engine.num_pages + GRAPH_SIZES[-1]
    for init in inits:
        args, size = init.arguments, len(init.arguments["paged_kv_last_page_len_buffer"])
        assert args["kv_layout"] == "NHD" and args["backend"] == "auto"
        assert args["use_tensor_cores"] is False                     # GQA group 2: CUDA cores
        _int32_on(args["paged_kv_indptr_buffer"], cpu, size + 1)
        _int32_on(args["paged_kv_indices_buffer"], cpu, capacity)
        _int32_on(args["paged_kv_last_page_len_buffer"], cpu, size)
        assert args["float_workspace_buffer"].shape == (WORKSPACE_BYTES,)
    graph_plans = recorder.named(f"{DECODE}.plan")
    assert len(graph_plans) == 3                                     # 3 replayed steps
    for plan in graph_plans:     # (the buffers are reused: only the last plan's values remain)
        args = plan.arguments
        _int32_on(args["indptr"], cpu, 5)                           # 3 rows padded to 4
        _int32_on(args["last_page_len"], cpu, 4)
        _int32_on(args["indices"], cpu)
        assert args["pos_encoding_mode"] == "NONE" and args["q_len_per_req"] == 1
        assert args["q_data_type"] == args["kv_data_type"] == torch.bfloat16
    last = graph_plans[-1].arguments
    assert len(last["indices"]) == int(last["indptr"][-1])
    kv_lens = flashinfer.page.get_seq_lens(last["indptr"], last["last_page_len"], 4)
    assert kv_lens.tolist() == [5 + 3, 2 + 3, 3 + 3, 1]             # the padding row: 1 slot
    assert int(last["indices"][-1]) == engine.num_pages              # ... in the scratch page
    assert len(recorder.named(f"{DECODE}.run")) == 3 * engine.model_config.num_layers


def test_fused_kernel_calls_bind_and_meet_the_contract(monkeypatch):
    """Every fused kernel the CUDA path calls binds to the real signature with the dtypes, shapes
    and layouts its docstring and C++ checks require (flashinfer/data/csrc: norm.cu, rope.cu,
    page.cu: last dim contiguous, index tensors int32 and contiguous, one device)."""
    recorder, engine = _graph_engine_calls(monkeypatch)
    config, cpu = engine.model_config, torch.device("cpu")
    d, q_dim, kv_dim = config.head_dim, config.num_heads * config.head_dim, \
        config.num_kv_heads * config.head_dim
    layers = config.num_layers
    # prefill + 3 steps: 2 fused norms per layer, the first layer's and the final norm plain
    assert len(recorder.named("norm.fused_add_rmsnorm")) == 4 * (2 * layers - 1 + 1)
    assert len(recorder.named("norm.rmsnorm")) == 4
    for call in recorder.named("norm.fused_add_rmsnorm") + recorder.named("norm.rmsnorm"):
        args = call.arguments
        tensors = [args["input"], args["weight"]] + ([args["residual"]] if "residual" in args
                                                      else [])
        assert {t.dtype for t in tensors} == {torch.bfloat16} and args["eps"] == config.rms_norm_eps
        assert all(t.is_contiguous() for t in tensors) and args["input"].dim() == 2
        assert args["weight"].shape == (config.hidden_size,) and args["enable_pdl"] is None
        if "residual" in args:
            assert args["residual"].shape == args["input"].shape
        else:
            assert args["out"] is None
    for call in recorder.named("rope.apply_rope_with_cos_sin_cache_inplace"):
        args = call.arguments
        n = args["positions"].shape[0]
        assert args["positions"].dtype in (torch.int32, torch.int64)
        assert args["positions"].is_contiguous() and args["positions"].dim() == 1
        assert args["query"].shape == (n, q_dim) and args["key"].shape == (n, kv_dim)
        assert args["query"].stride(-1) == 1 and args["key"].stride(-1) == 1
        assert args["head_size"] == d and type(args["head_size"]) is int
        cache = args["cos_sin_cache"]
        assert cache.dtype == torch.float32 and cache.shape == (config.max_position, d)
        assert cache.is_contiguous() and args["is_neox"] is True
    for call in recorder.named("activation.silu_and_mul"):
        args = call.arguments
        assert args["input"].shape[-1] == 2 * config.intermediate_size
        assert args["input"].stride(-1) == 1 and args["out"] is None
    appends = recorder.named("page.append_paged_kv_cache")
    assert len(appends) == 3 * layers                                # the replayed steps only
    for call in appends:
        args = call.arguments
        rows = args["append_key"].shape[0]
        assert args["append_key"].shape == args["append_value"].shape == (rows, config.num_kv_heads, d)
        assert args["append_key"].stride(-1) == 1
        _int32_on(args["batch_indices"], cpu, rows)
        _int32_on(args["positions"], cpu, rows)
        _int32_on(args["kv_last_page_len"], cpu, rows)
        _int32_on(args["kv_indptr"], cpu, rows + 1)
        _int32_on(args["kv_indices"], cpu)
        cache = args["paged_kv_cache"]
        assert cache.dim() == 5 and cache.shape[1] == 2 and cache.dtype == torch.bfloat16
        assert cache.shape[0] == engine.num_pages + 1 and args["kv_layout"] == "NHD"


def test_the_fused_kernels_exist_where_the_engine_calls_them():
    """flashinfer.norm / rope / activation / page are attributes of the imported package."""
    for name in ("norm.rmsnorm", "norm.fused_add_rmsnorm",
                 "rope.apply_rope_with_cos_sin_cache_inplace", "activation.silu_and_mul",
                 "page.append_paged_kv_cache"):
        submodule, function = name.split(".")
        assert callable(getattr(getattr(flashinfer, submodule), function)), name
