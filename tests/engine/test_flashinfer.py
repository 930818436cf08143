"""FlashInfer (CUDA) against the torch backend on the same mixed batches.

Marked `cuda` and skipped only when CUDA is absent: on a CUDA machine without flashinfer these
tests fail with the error naming the `cuda` extra, they are not skipped.

- kernel level: FlashInferAttention on the GPU (bfloat16) vs TorchPagedAttention on host float32
  copies of the same pool and queries, batch by batch: prefill + decode + custom masks + shared
  pages, then a pure decode batch (the decode wrapper);
- model level: the real default model on CUDA in bfloat16, flashinfer vs torch attention, the same
  three batches on two engines: logits close, greedy tokens equal wherever the reference's top-1
  beats its top-2 by more than the tolerance (a near tie may flip in bfloat16; that is not a bug);
- sampling: FlashInfer's fused top-k/top-p through CudaSampler keeps to the allowed tokens.
"""
from __future__ import annotations

import pytest
import torch

from engine.attention import TorchPagedAttention
from engine.batch import ForwardBatch, ForwardRequest, SamplerSpec
from engine.page_table import build_page_table

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PAGE_SIZE, NUM_PAGES, HQ, HKV, D = 16, 32, 9, 3, 64     # SmolLM2-135M's head shape


def _request(q_len, page_ids, last_page_len, first_token=100, mask=None):
    kv_len = (len(page_ids) - 1) * PAGE_SIZE + last_page_len
    return ForwardRequest(token_ids=tuple(range(first_token, first_token + q_len)),
                          positions=tuple(range(kv_len - q_len, kv_len)),
                          page_ids=tuple(page_ids), last_page_len=last_page_len,
                          output_indices=(q_len - 1,), samplers=(SamplerSpec(),), mask=mask)


def _rows(kv_len, keep_every):
    """A run-length mask row over kv_len that skips every `keep_every`-th slot except the last."""
    flags = [(s % keep_every != 1) or s == kv_len - 1 for s in range(kv_len)]
    runs, current, count = [], True, 0
    for flag in flags:
        if flag == current:
            count += 1
        else:
            runs.append(count)
            current, count = flag, 1
    runs.append(count)
    return tuple(runs)


# A: 40-token prefill. C: 20-token prefill with a mask. Then A decodes; B forks A's first two full
# pages (shared, never written) and adds 3 tokens in its own page; C decodes with a mask; D
# prefills 17 tokens. Then all four decode together.
BATCHES = [
    [_request(40, (0, 1, 2), 8, 200),
     _request(20, (10, 11), 4, 300, mask=tuple(_rows(20, 3) for _ in range(20)))],
    [_request(1, (0, 1, 2), 9, 400),
     _request(3, (0, 1, 5), 3, 500),
     _request(1, (10, 11), 5, 600, mask=(_rows(21, 4),)),
     _request(17, (20, 21), 1, 700)],
    [_request(1, (0, 1, 2), 10, 800), _request(1, (0, 1, 5), 4, 900),
     _request(1, (10, 11), 6, 1000), _request(1, (20, 21), 2, 1100)],
]


def test_kernels_match_the_torch_backend():
    from engine.attention.flashinfer import FlashInferAttention, is_pure_decode

    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(NUM_PAGES, 2, PAGE_SIZE, HKV, D, generator=gen).bfloat16()
    gpu_pool, ref_pool = pool.cuda(), pool.float()
    flash = FlashInferAttention(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                page_size=PAGE_SIZE, device="cuda")
    ref = TorchPagedAttention(HQ, HKV, D, PAGE_SIZE)
    for requests in BATCHES:
        table = build_page_table(ForwardBatch(tuple(requests)), PAGE_SIZE)
        q, k, v = (torch.randn(table.num_tokens, h, D, generator=gen).bfloat16()
                   for h in (HQ, HKV, HKV))
        flash.plan(table)
        ref.plan(table)
        flash.append_kv(gpu_pool, k.cuda(), v.cuda())
        ref.append_kv(ref_pool, k.float(), v.float())
        out = flash.run(q.cuda(), gpu_pool).float().cpu()               # [N, HQ, D]
        torch.testing.assert_close(gpu_pool.float().cpu(), ref_pool)   # same slots, shared intact
        torch.testing.assert_close(out, ref.run(q.float(), ref_pool), atol=2e-2, rtol=2e-2)
    assert is_pure_decode(table)          # the last batch ran on the decode wrapper


@pytest.fixture(scope="module")
def engines():
    from engine import load_default_engine

    def load(backend):
        return load_default_engine(device="cuda", dtype="bfloat16", attention_backend=backend,
                                   num_pages=64, progress=False, seed=0)

    return load("flashinfer"), load("torch")


def _logits(engine, requests):
    table = build_page_table(ForwardBatch(tuple(requests)), engine.page_size)
    engine.attention.plan(table)
    return engine.model.forward(table, engine.kv_cache, engine.attention).float().cpu()


def test_model_logits_and_greedy_tokens_match(engines):
    flash_engine, torch_engine = engines
    assert flash_engine.attention.name == "flashinfer" and torch_engine.attention.name == "torch"
    tolerance = 0.35                      # logits are O(10); bfloat16 over 30 layers
    num_compared = num_rows = 0
    for requests in BATCHES:
        flash_logits, ref_logits = _logits(flash_engine, requests), _logits(torch_engine, requests)
        torch.testing.assert_close(flash_logits, ref_logits, atol=tolerance, rtol=0.02)
        top2 = ref_logits.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) > 2 * tolerance
        assert torch.equal(flash_logits.argmax(-1)[decisive], ref_logits.argmax(-1)[decisive])
        num_compared += int(decisive.sum())
        num_rows += len(decisive)
    assert num_compared >= num_rows // 2, f"only {num_compared}/{num_rows} rows were decisive"


def test_fused_sampling_keeps_to_top_k():
    from engine.sampling_cuda import CudaSampler

    sampler = CudaSampler("cuda", seed=0)
    assert sampler.uses_flashinfer
    logits = torch.randn(64, 1000, device="cuda") * 4
    top1 = SamplerSpec(kind="sample", temperature=1.0, top_k=1)
    assert sampler.sample(logits, [top1] * 64) == logits.argmax(-1).tolist()
    top3 = SamplerSpec(kind="sample", temperature=1.0, top_k=3, top_p=0.95)
    tokens = sampler.sample(logits, [top3] * 64)
    allowed = logits.topk(3, dim=-1).indices.tolist()
    assert all(token in row for token, row in zip(tokens, allowed))
