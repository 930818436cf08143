"""CPU tests of the CUDA path: device/backend choice, the error without the `cuda` extra, and the
FlashInfer backend's metadata hand-off, checked against a stand-in `flashinfer` module.

The stand-in implements FlashInfer's *documented* semantics of the two paged wrappers (NHD single
tensor cache, CSR page tables, bottom-right causal or a flattened per-request custom mask) in plain
torch and checks the documented argument contract (int32 indptrs, bool mask of the right length),
so these tests fail when the backend hands FlashInfer the wrong pages, lengths, mask or wrapper.
The real kernels are exercised by tests/engine/test_flashinfer.py on a CUDA machine.
"""
from __future__ import annotations

import importlib
import math
import sys
import types

import pytest
import torch

import engine.attention as attention_pkg
from engine.attention import TorchPagedAttention, make_attention_backend
from engine.batch import ForwardBatch, ForwardRequest
from engine.device import (FLASHINFER_CHECKED_VERSION, DeviceChoice, FlashInferUnavailable,
                           choose_device, import_flashinfer, resolve_attention_backend,
                           resolve_device)
from engine.engine_config import EngineConfig
from engine.page_table import build_page_table

PAGE_SIZE, NUM_PAGES, HQ, HKV, D = 4, 16, 6, 2, 16


# ---- a stand-in flashinfer (documented semantics, plain torch) ---------------------------------
def _reference(q, cache, qo_indptr, kv_indptr, indices, last_len, page_size, mask_of):
    """Per request: softmax(q k^T / sqrt(D)) v over its pages, GQA by head groups."""
    out = torch.empty_like(q)
    group = q.shape[1] // cache.shape[3]
    for b in range(len(last_len)):
        pages = indices[kv_indptr[b]:kv_indptr[b + 1]].long()
        kv_len = (len(pages) - 1) * page_size + int(last_len[b])
        k = cache[pages, 0].reshape(-1, *cache.shape[3:])[:kv_len].float().repeat_interleave(group, 1)
        v = cache[pages, 1].reshape(-1, *cache.shape[3:])[:kv_len].float().repeat_interleave(group, 1)
        rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), k) / math.sqrt(q.shape[2])
        mask = mask_of(b, scores.shape[1], kv_len)                       # [q_len, kv_len] or None
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def _check_index_args(qo_indptr, kv_indptr, indices, last_len, page_size):
    for t in (qo_indptr, kv_indptr, indices, last_len):
        assert t.dtype == torch.int32
    assert len(indices) == int(kv_indptr[-1]) and len(last_len) == len(kv_indptr) - 1
    assert bool(((last_len >= 1) & (last_len <= page_size)).all())


class _FakeWrapper:
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", **kwargs) -> None:
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.num_plans = self.num_runs = 0

    def _check_cache(self, cache: torch.Tensor) -> None:
        assert cache.dim() == 5 and cache.shape[1] == 2 and cache.shape[2] == self.page_size


class FakePrefill(_FakeWrapper):
    def plan(self, qo_indptr, kv_indptr, indices, last_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, custom_mask=None, causal=False, pos_encoding_mode="NONE", **dtypes):
        _check_index_args(qo_indptr, kv_indptr, indices, last_len, page_size)
        q_lens = (qo_indptr[1:] - qo_indptr[:-1]).long()
        kv_lens = (kv_indptr[1:] - kv_indptr[:-1] - 1).long() * page_size + last_len.long()
        self.mask_offsets = torch.cat([torch.zeros(1, dtype=torch.long), (q_lens * kv_lens).cumsum(0)])
        if custom_mask is not None:
            assert custom_mask.dtype == torch.bool and len(custom_mask) == int(self.mask_offsets[-1])
        self.args = (qo_indptr, kv_indptr, indices, last_len, page_size)
        self.custom_mask, self.causal, self.page_size = custom_mask, causal, page_size
        self.num_plans += 1

    def _mask_of(self, b: int, q_len: int, kv_len: int):
        if self.custom_mask is not None:
            start = int(self.mask_offsets[b])
            return self.custom_mask[start:start + q_len * kv_len].view(q_len, kv_len)
        if self.causal:
            return torch.arange(kv_len)[None] <= torch.arange(kv_len - q_len, kv_len)[:, None]
        return None

    def run(self, q, cache):
        self._check_cache(cache)
        self.num_runs += 1
        return _reference(q, cache, *self.args, self._mask_of)


class FakeDecode(_FakeWrapper):
    def __init__(self, workspace, kv_layout="NHD", use_tensor_cores=False) -> None:
        super().__init__(workspace, kv_layout)
        self.use_tensor_cores = use_tensor_cores

    def plan(self, kv_indptr, indices, last_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", **dtypes):
        qo_indptr = torch.arange(len(kv_indptr), dtype=torch.int32)
        _check_index_args(qo_indptr, kv_indptr, indices, last_len, page_size)
        self.args = (qo_indptr, kv_indptr, indices, last_len, page_size)
        self.page_size = page_size
        self.num_plans += 1

    def run(self, q, cache):
        self._check_cache(cache)
        assert q.shape[0] == len(self.args[3]), "decode takes one query row per request"
        self.num_runs += 1
        return _reference(q, cache, *self.args, lambda b, q_len, kv_len: None)


def _fake_flashinfer() -> types.ModuleType:
    module = types.ModuleType("flashinfer")
    module.__version__ = FLASHINFER_CHECKED_VERSION     # written from that version's documentation
    module.BatchPrefillWithPagedKVCacheWrapper = FakePrefill
    module.BatchDecodeWithPagedKVCacheWrapper = FakeDecode
    return module


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.fixture
def no_flashinfer(monkeypatch):
    """flashinfer not installed: `import flashinfer` raises ImportError."""
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    _forget_backend_module()
    yield
    _forget_backend_module()


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """The stand-in installed as `flashinfer`; yields a fresh engine.attention.flashinfer."""
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer())
    _forget_backend_module()
    yield importlib.import_module("engine.attention.flashinfer")
    _forget_backend_module()


def _forget_backend_module() -> None:
    sys.modules.pop("engine.attention.flashinfer", None)
    if "flashinfer" in vars(attention_pkg):
        delattr(attention_pkg, "flashinfer")


# ---- device and backend choice ------------------------------------------------------------------
def test_auto_device_follows_cuda_availability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


def test_cuda_without_cuda_is_a_clear_error(no_cuda):
    with pytest.raises(ValueError, match="'cuda' requested but CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be cpu, cuda or auto, got 'tpu'"):
        resolve_device("tpu")


def test_bad_cuda_index_is_a_value_error(with_cuda):
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="'cuda:x' is not a valid CUDA device"):
        resolve_device("cuda:x")


def test_backend_choice_on_cpu(no_cuda, fake_flashinfer):
    cpu = torch.device("cpu")
    assert resolve_attention_backend("auto", cpu) == "torch"     # flashinfer importable, still torch
    assert resolve_attention_backend("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="'flashinfer' needs a CUDA device"):
        resolve_attention_backend("flashinfer", cpu)
    assert choose_device(EngineConfig(device="auto")) == DeviceChoice(cpu, "torch")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        DeviceChoice(cpu, "flashinfer")


def test_backend_choice_on_cuda_with_flashinfer(with_cuda, fake_flashinfer):
    cuda = torch.device("cuda")
    assert resolve_attention_backend("auto", cuda) == "flashinfer"
    assert resolve_attention_backend("torch", cuda) == "torch"   # the fallback stays selectable
    choice = choose_device(EngineConfig(device="auto", attention_backend="auto"))
    assert choice == DeviceChoice(cuda, "flashinfer")


def test_auto_backend_on_cuda_in_float32_is_torch(with_cuda, fake_flashinfer):
    """FlashInfer cannot run float32: `--dtype float32` on CUDA gets the torch backend."""
    cuda = torch.device("cuda")
    assert resolve_attention_backend("auto", cuda, "float32") == "torch"
    assert resolve_attention_backend("auto", cuda, "bfloat16") == "flashinfer"
    choice = choose_device(EngineConfig(device="cuda", dtype="float32"))
    assert choice == DeviceChoice(cuda, "torch")


def test_backend_choice_on_cuda_without_the_extra(with_cuda, no_flashinfer):
    cuda = torch.device("cuda")
    assert resolve_attention_backend("auto", cuda) == "torch"
    with pytest.raises(FlashInferUnavailable, match=r"pip install 'pie-serve\[cuda\]'") as info:
        resolve_attention_backend("flashinfer", cuda)
    assert isinstance(info.value, ImportError) and "ModuleNotFoundError" in str(info.value)


def test_broken_flashinfer_install_is_the_same_clear_error(monkeypatch):
    class BrokenFinder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "flashinfer":
                raise OSError("libcuda.so.1: cannot open shared object file")
            return None

    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    monkeypatch.setattr(sys, "meta_path", [BrokenFinder, *sys.meta_path])
    with pytest.raises(FlashInferUnavailable, match=r"pie-serve\[cuda\].*libcuda\.so\.1"):
        import_flashinfer()


def test_factory_without_the_extra(no_flashinfer):
    auto = make_attention_backend("auto", num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                  page_size=PAGE_SIZE, device="cuda")
    assert isinstance(auto, TorchPagedAttention)
    with pytest.raises((ValueError, ImportError), match=r"pie-serve\[cuda\]"):
        make_attention_backend("flashinfer", num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                               page_size=PAGE_SIZE, device="cuda")


# ---- the backend's hand-off to FlashInfer (stand-in module, CPU) ----------------------------------
def _request(q_len, page_ids, last_page_len, mask=None):
    kv_len = (len(page_ids) - 1) * PAGE_SIZE + last_page_len
    return ForwardRequest(token_ids=tuple(range(1, q_len + 1)),
                          positions=tuple(range(kv_len - q_len, kv_len)),
                          page_ids=tuple(page_ids), last_page_len=last_page_len, mask=mask)


PREFILL = _request(18, (4, 5, 6, 7, 8), 2)                      # long: 18 new tokens over 5 pages
DECODE_A = _request(1, (0, 1, 2), 3)                            # pages 0 and 1 shared with DECODE_B
DECODE_B = _request(1, (0, 1, 9), 1)
MASKED = _request(3, (10, 11), 2, mask=((1, 2, 3), (4, 2), (0, 1, 5)))   # kv_len 6, rows 3..5


def _run_both(backend_cls, requests, num_layers=2, seed=0):
    """Run the FlashInfer backend (stand-in) and the torch backend on the same batch and pool."""
    gen = torch.Generator().manual_seed(seed)
    table = build_page_table(ForwardBatch(tuple(requests)), PAGE_SIZE)
    n = table.num_tokens
    pools = torch.randn(num_layers, NUM_PAGES, 2, PAGE_SIZE, HKV, D, generator=gen).bfloat16()
    qs = torch.randn(num_layers, n, HQ, D, generator=gen).bfloat16()
    ks, vs = torch.randn(2, num_layers, n, HKV, D, generator=gen).bfloat16()
    flash = backend_cls(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PAGE_SIZE,
                        device="cpu", workspace_bytes=64)
    torch_ref = TorchPagedAttention(HQ, HKV, D, PAGE_SIZE)
    flash_pool, ref_pool = pools.clone(), pools.float()
    flash.plan(table)
    torch_ref.plan(table)
    outs = []
    for layer in range(num_layers):
        flash.append_kv(flash_pool[layer], ks[layer], vs[layer])
        torch_ref.append_kv(ref_pool[layer], ks[layer].float(), vs[layer].float())
        outs.append((flash.run(qs[layer], flash_pool[layer]).float(),
                     torch_ref.run(qs[layer].float(), ref_pool[layer])))
    return flash, flash_pool, ref_pool, outs


def test_mixed_batch_runs_on_prefill_wrapper(fake_flashinfer):
    flash, flash_pool, ref_pool, outs = _run_both(
        fake_flashinfer.FlashInferAttention, [PREFILL, DECODE_A, MASKED, DECODE_B])
    assert torch.equal(flash_pool.float(), ref_pool)            # same slots written, shared pages intact
    for flash_out, ref_out in outs:
        torch.testing.assert_close(flash_out, ref_out, atol=2e-2, rtol=2e-2)
    assert (flash._prefill.num_plans, flash._prefill.num_runs) == (1, 2)    # plan once, run per layer
    assert flash._decode.num_plans == 0
    assert flash._prefill.custom_mask is not None and not flash._prefill.causal


def test_unmasked_fill_is_causal(fake_flashinfer):
    flash, _, _, outs = _run_both(fake_flashinfer.FlashInferAttention, [PREFILL, DECODE_A])
    for flash_out, ref_out in outs:
        torch.testing.assert_close(flash_out, ref_out, atol=2e-2, rtol=2e-2)
    assert flash._prefill.causal and flash._prefill.custom_mask is None


def test_pure_decode_batch_runs_on_decode_wrapper(fake_flashinfer):
    flash, flash_pool, ref_pool, outs = _run_both(
        fake_flashinfer.FlashInferAttention, [DECODE_A, DECODE_B])
    assert torch.equal(flash_pool.float(), ref_pool)
    for flash_out, ref_out in outs:
        torch.testing.assert_close(flash_out, ref_out, atol=2e-2, rtol=2e-2)
    assert (flash._decode.num_plans, flash._decode.num_runs) == (1, 2)
    assert flash._prefill.num_plans == 0
    assert flash._decode.use_tensor_cores is False              # group size 3 has a CUDA-core kernel


def test_one_token_with_a_mask_is_not_a_decode(fake_flashinfer):
    masked_decode = _request(1, (3,), 3, mask=((1, 1, 1),))
    flash, _, _, outs = _run_both(fake_flashinfer.FlashInferAttention, [DECODE_A, masked_decode])
    assert flash._prefill.num_plans == 1 and flash._decode.num_plans == 0
    for flash_out, ref_out in outs:
        torch.testing.assert_close(flash_out, ref_out, atol=2e-2, rtol=2e-2)


def test_backend_refuses_float32_and_unplanned_runs(fake_flashinfer):
    flash = fake_flashinfer.FlashInferAttention(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                                page_size=PAGE_SIZE, device="cpu", workspace_bytes=64)
    pool = torch.zeros(NUM_PAGES, 2, PAGE_SIZE, HKV, D)
    with pytest.raises(RuntimeError, match="plan"):
        flash.run(torch.zeros(1, HQ, D), pool)
    flash.plan(build_page_table(ForwardBatch((DECODE_A,)), PAGE_SIZE))
    with pytest.raises(ValueError, match="float16 or bfloat16.*--dtype bfloat16"):
        flash.run(torch.zeros(1, HQ, D), pool)
    with pytest.raises(ValueError, match="page_size 8"):
        flash.plan(build_page_table(ForwardBatch((DECODE_A,)), 8))


def test_large_gqa_groups_decode_on_tensor_cores(fake_flashinfer):
    flash = fake_flashinfer.FlashInferAttention(num_qo_heads=32, num_kv_heads=4, head_dim=D,
                                                page_size=PAGE_SIZE, device="cpu", workspace_bytes=64)
    assert flash._decode.use_tensor_cores is True
