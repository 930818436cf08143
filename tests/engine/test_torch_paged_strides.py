"""The torch attention backend takes SDPA outputs in any layout, as CUDA's kernels return them.

On CUDA, `scaled_dot_product_attention` (the memory-efficient and flash kernels) writes its
output as [B, L, H, D] memory and returns it as a strided [B, H, L, D] view. The CPU kernels
return contiguous tensors, so a `.view` that merges H with another dim passes on the CPU and
fails on CUDA ("view size is not compatible with input tensor's size and stride"; the H200 run of
2026-11-28, `--device cuda --dtype float32`). Here SDPA is wrapped to return exactly that layout
on the CPU: the same values, CUDA's strides; every path (pure decode, padded short requests, long
prefills, masks, shared pages) must give the reference's attention, and a whole model the same
logits as with contiguous outputs.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import TorchPagedAttention
from engine.batch import ForwardBatch, ForwardRequest, SamplerSpec
from engine.page_table import build_page_table
from tests.engine.test_attention import HKV, HQ, D, NUM_PAGES, PAGE_SIZE, reference, req


class CudaLayoutSdpa:
    """F.scaled_dot_product_attention whose 4-D output has CUDA's strides ([B, L, H, D] memory
    seen as [B, H, L, D]); counts the calls that returned a non-contiguous tensor."""

    def __init__(self) -> None:
        self.real = F.scaled_dot_product_attention
        self.num_strided = 0

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        out = self.real(*args, **kwargs)                                  # [B, H, L, D]
        strided = out.transpose(1, 2).contiguous().transpose(1, 2)       # same values
        self.num_strided += not strided.is_contiguous()
        return strided


@pytest.fixture
def cuda_layout_sdpa(monkeypatch) -> CudaLayoutSdpa:
    sdpa = CudaLayoutSdpa()
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    return sdpa


BATCHES = {
    "pure decode": ForwardBatch((req(1, (0, 1, 2), 3), req(1, (0, 1, 3), 1),
                                 req(1, (4,), 2), req(1, (5, 6), 4))),
    "masked decode": ForwardBatch((req(1, (0, 1), 3, mask=((2, 1, 4),)), req(1, (2,), 2))),
    "mixed with shared pages": ForwardBatch((req(21, (0, 1, 2, 3, 4, 5), 1),
                                             req(1, (0, 1, 6), 2), req(3, (0, 1, 7), 3),
                                             req(5, (8, 9), 1))),
    "masked fills": ForwardBatch((req(2, (10, 11), 2, mask=((1, 3, 2), (2, 1, 3))),
                                  req(20, (12, 13, 14, 15, 16), 4,
                                      mask=tuple((2, 3, 15) for _ in range(20))))),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(BATCHES))
def test_every_path_takes_strided_attention_outputs(cuda_layout_sdpa, name, dtype):
    torch.manual_seed(0)
    table = build_page_table(BATCHES[name], PAGE_SIZE)
    pool = torch.randn(NUM_PAGES, 2, PAGE_SIZE, HKV, D).to(dtype)
    q = torch.randn(table.num_tokens, HQ, D).to(dtype)
    k, v = (torch.randn(table.num_tokens, HKV, D).to(dtype) for _ in range(2))
    backend = TorchPagedAttention(HQ, HKV, D, PAGE_SIZE)
    backend.plan(table)
    backend.append_kv(pool, k, v)
    out = backend.run(q, pool)                                            # [N, HQ, D]
    assert cuda_layout_sdpa.num_strided > 0       # the kernels' layout really was handed over
    expected = reference(q.float(), pool.float(), table)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_a_model_gives_the_same_logits_with_strided_attention_outputs(make_tiny_engine,
                                                                      monkeypatch):
    """The whole float32 model on the torch backend: a prefill then a decode batch, logits with
    CUDA-layout SDPA outputs equal to those with the CPU's contiguous ones."""
    greedy = (SamplerSpec(),)
    prefill = ForwardBatch((ForwardRequest(tuple(range(3, 23)), tuple(range(20)), (0, 1, 2, 3, 4),
                                           4, (19,), greedy),
                            ForwardRequest((5, 6, 7), (0, 1, 2), (8,), 3, (2,), greedy)))
    decode = ForwardBatch((ForwardRequest((9,), (20,), (0, 1, 2, 3, 4, 5), 1, (0,), greedy),
                           ForwardRequest((9,), (3,), (8,), 4, (0,), greedy)))

    def run() -> list[torch.Tensor]:
        engine = make_tiny_engine(attention_backend="torch")
        return [engine.logits(batch) for batch in (prefill, decode)]

    contiguous = run()
    sdpa = CudaLayoutSdpa()
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    strided = run()
    assert sdpa.num_strided > 0
    for a, b in zip(contiguous, strided):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
