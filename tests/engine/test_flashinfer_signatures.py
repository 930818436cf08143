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
