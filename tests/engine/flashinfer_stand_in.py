"""A stand-in `flashinfer` for the fused-kernel and CUDA-graph decode path, runnable on a CPU.

Each function keeps the real one's parameter names (tests/engine/test_flashinfer_signatures.py
binds the engine's calls to the real signatures) and computes FlashInfer's documented result in
plain torch. Every kernel is registered as one torch custom op (namespace `pie_stand_in`), as the
real package registers its kernels (`flashinfer::...`): a TorchDispatchMode sees one operation per
kernel launch, which is what tests/engine/test_dispatch_count.py counts. The decode wrapper also
takes FlashInfer's CUDA-graph mode (`use_cuda_graph=True` with caller-owned indptr / indices /
last-page-length buffers): `plan` copies into those buffers and `run` reads only them, so a step
that works here reads only what a captured graph would read.

`stand_in_flashinfer()` builds the module to install as `flashinfer` (prefill: test_device's
FakePrefill).
"""
from __future__ import annotations

import types

import torch

from engine.device import FLASHINFER_CHECKED_VERSION
from tests.engine.test_device import FakePrefill, _check_index_args, _reference

__all__ = ["StandInDecode", "stand_in_flashinfer"]


@torch.library.custom_op("pie_stand_in::rmsnorm", mutates_args=())
def _rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = input.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(input.dtype)


@torch.library.custom_op("pie_stand_in::fused_add_rmsnorm", mutates_args=("input", "residual"))
def _fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    x = input.float() + residual.float()            # the sum, unrounded, feeds the norm
    residual.copy_(x)
    input.copy_(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float())


@torch.library.custom_op("pie_stand_in::rope", mutates_args=("query", "key"))
def _rope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
          cos_sin_cache: torch.Tensor) -> None:
    half = cos_sin_cache.shape[1] // 2
    cos = cos_sin_cache[positions.long(), :half].unsqueeze(1)          # [N, 1, D/2] float32
    sin = cos_sin_cache[positions.long(), half:].unsqueeze(1)
    for x in (query, key):
        heads = x.view(x.shape[0], -1, head_size)
        x1, x2 = heads[..., :half].float(), heads[..., half:].float()
        heads.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


@torch.library.custom_op("pie_stand_in::silu_and_mul", mutates_args=())
def _silu_and_mul(input: torch.Tensor) -> torch.Tensor:
    gate, up = input.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(input.dtype)


@torch.library.custom_op("pie_stand_in::append_paged_kv_cache", mutates_args=("paged_kv_cache",))
def _append(append_key: torch.Tensor, append_value: torch.Tensor, batch_indices: torch.Tensor,
            positions: torch.Tensor, paged_kv_cache: torch.Tensor, kv_indices: torch.Tensor,
            kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor) -> None:
    page_size = paged_kv_cache.shape[2]
    pages = kv_indices[(kv_indptr[batch_indices.long()] + positions // page_size).long()].long()
    slots = (positions % page_size).long()
    paged_kv_cache[pages, 0, slots] = append_key.to(paged_kv_cache.dtype)
    paged_kv_cache[pages, 1, slots] = append_value.to(paged_kv_cache.dtype)


@torch.library.custom_op("pie_stand_in::paged_decode", mutates_args=())
def _paged_decode(q: torch.Tensor, paged_kv_cache: torch.Tensor, kv_indptr: torch.Tensor,
                  kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor) -> torch.Tensor:
    qo_indptr = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return _reference(q, paged_kv_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                      paged_kv_cache.shape[2], lambda b, q_len, kv_len: None)


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    assert out is None and input.dtype == weight.dtype and input.is_contiguous()
    return torch.ops.pie_stand_in.rmsnorm(input, weight, eps)


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    assert input.dtype == residual.dtype == weight.dtype, "one dtype for all three"
    assert input.shape == residual.shape and input.is_contiguous() and residual.is_contiguous()
    torch.ops.pie_stand_in.fused_add_rmsnorm(input, residual, weight, eps)


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache,
                                          is_neox=True):
    assert is_neox and cos_sin_cache.dtype == torch.float32 and positions.is_contiguous()
    assert positions.dtype in (torch.int32, torch.int64)
    assert query.stride(-1) == 1 and key.stride(-1) == 1
    torch.ops.pie_stand_in.rope(positions, query, key, head_size, cos_sin_cache)


def silu_and_mul(input, out=None, enable_pdl=None):
    assert out is None and input.stride(-1) == 1
    return torch.ops.pie_stand_in.silu_and_mul(input)


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          kv_indices, kv_indptr, kv_last_page_len, kv_layout="NHD"):
    assert kv_layout == "NHD" and paged_kv_cache.dim() == 5
    for t in (batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len):
        assert t.dtype == torch.int32 and t.is_contiguous() and t.device == append_key.device
    assert len(batch_indices) == len(positions) == append_key.shape[0]
    assert len(kv_indptr) == len(kv_last_page_len) + 1
    torch.ops.pie_stand_in.append_paged_kv_cache(append_key, append_value, batch_indices,
                                                 positions, paged_kv_cache, kv_indices,
                                                 kv_indptr, kv_last_page_len)


class StandInDecode:
    """BatchDecodeWithPagedKVCacheWrapper: eager, or CUDA-graph mode over caller-owned buffers."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 use_tensor_cores=False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend="auto", jit_args=None) -> None:
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.use_cuda_graph = use_cuda_graph
        self.device = float_workspace_buffer.device
        if use_cuda_graph:
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
            self.fixed_batch_size = len(paged_kv_last_page_len_buffer)
        self._indptr = paged_kv_indptr_buffer
        self._indices = paged_kv_indices_buffer
        self._last = paged_kv_last_page_len_buffer
        self.num_plans = self.num_runs = 0

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, pos_encoding_mode="NONE", q_data_type="float16", kv_data_type=None,
             **kwargs):
        _check_index_args(indptr, indptr, indices, last_page_len, page_size)
        assert indptr.device.type == "cpu" and last_page_len.device.type == "cpu"
        if self.use_cuda_graph:
            assert len(last_page_len) == self.fixed_batch_size, "fixed batch size"
            assert len(indices) <= len(self._indices)
            self._indptr.copy_(indptr)
            self._last.copy_(last_page_len)
            self._indices[:len(indices)].copy_(indices)
        else:
            self._indptr, self._indices = indptr.to(self.device), indices.to(self.device)
            self._last = last_page_len.to(self.device)
        self.page_size = page_size
        self.num_plans += 1

    def run(self, q, paged_kv_cache):
        assert q.is_contiguous() and paged_kv_cache.shape[2] == self.page_size
        assert q.shape[0] == len(self._last), "decode takes one query row per request"
        self.num_runs += 1
        return torch.ops.pie_stand_in.paged_decode(q, paged_kv_cache, self._indptr,
                                                   self._indices, self._last)


def stand_in_flashinfer() -> types.ModuleType:
    """A fresh stand-in module (wrappers, norm, rope, activation, page)."""
    module = types.ModuleType("flashinfer")
    module.__version__ = FLASHINFER_CHECKED_VERSION
    module.BatchPrefillWithPagedKVCacheWrapper = FakePrefill
    module.BatchDecodeWithPagedKVCacheWrapper = StandInDecode
    module.norm = types.SimpleNamespace(rmsnorm=rmsnorm, fused_add_rmsnorm=fused_add_rmsnorm)
    module.rope = types.SimpleNamespace(
        apply_rope_with_cos_sin_cache_inplace=apply_rope_with_cos_sin_cache_inplace)
    module.activation = types.SimpleNamespace(silu_and_mul=silu_and_mul)
    module.page = types.SimpleNamespace(append_paged_kv_cache=append_paged_kv_cache)
    return module
