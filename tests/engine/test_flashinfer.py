"""FlashInfer (CUDA) against the torch backend and against float32 runs of the same batches.

Marked `cuda` and skipped only when CUDA is absent: on a CUDA machine without flashinfer these
tests fail with the error naming the `cuda` extra, they are not skipped.

- kernel level: FlashInferAttention on the GPU (bfloat16) vs TorchPagedAttention on host float32
  copies of the same pool and queries, batch by batch (a prefill and a masked prefill; a decode, a
  shared-page fork, a masked decode and a prefill; a pure decode batch, on the decode wrapper),
  for the default model's head shape (9 query heads, 3 KV heads, head_dim 64) and GQA group 4
  with head_dim 128;
- model level, for the default model (the random-weight twin on the GPU kit) and a tiny random
  model of the second shape: the same batches on FlashInfer bf16, torch bf16 and torch float32
  (the float32 path on CUDA); FlashInfer's error against float32 within 2x torch-bf16's own, row
  by row, and greedy tokens equal to float32's wherever its margin is decisive
  (tests/engine/float32_comparison.py: a fixed tolerance between the two bf16 paths measured the
  weights, not the kernels);
- float32 with the flashinfer backend is refused with a clear error (its kernels are 16-bit);
- sampling: FlashInfer's fused top-k/top-p through CudaSampler keeps to the allowed tokens.
"""
from __future__ import annotations

import gc

import pytest
import torch

from engine.attention import TorchPagedAttention
from engine.batch import SamplerSpec
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.page_table import build_page_table
from tests.engine.conftest import tiny_hf_model, tiny_weights
from tests.engine.float32_comparison import (GQA4_HEAD128, NUM_PAGES, PAGE_SIZE,
                                             check_against_float32, mixed_batches,
                                             print_summaries, run_batches)

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HEAD_SHAPES = {"9q-3kv-d64": (9, 3, 64), "8q-2kv-d128": (8, 2, 128)}    # (Hq, Hkv, D)
MODELS = ("default", "gqa4-d128")
PATHS = (("flashinfer", "bfloat16"), ("torch", "bfloat16"), ("torch", "float32"))


@pytest.mark.parametrize("heads", list(HEAD_SHAPES.values()), ids=list(HEAD_SHAPES))
def test_kernels_match_the_torch_backend(heads):
    from engine.attention.flashinfer import FlashInferAttention, is_pure_decode

    num_qo_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(NUM_PAGES, 2, PAGE_SIZE, num_kv_heads, head_dim, generator=gen).bfloat16()
    gpu_pool, ref_pool = pool.cuda(), pool.float()
    flash = FlashInferAttention(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                head_dim=head_dim, page_size=PAGE_SIZE, device="cuda")
    ref = TorchPagedAttention(num_qo_heads, num_kv_heads, head_dim, PAGE_SIZE)
    for batch in mixed_batches(vocab_size=2048).values():
        table = build_page_table(batch, PAGE_SIZE)
        q, k, v = (torch.randn(table.num_tokens, h, head_dim, generator=gen).bfloat16()
                   for h in (num_qo_heads, num_kv_heads, num_kv_heads))
        flash.plan(table)
        ref.plan(table)
        flash.append_kv(gpu_pool, k.cuda(), v.cuda())
        ref.append_kv(ref_pool, k.float(), v.float())
        out = flash.run(q.cuda(), gpu_pool).float().cpu()               # [N, Hq, D]
        torch.testing.assert_close(gpu_pool.float().cpu(), ref_pool)   # same slots, shared intact
        torch.testing.assert_close(out, ref.run(q.float(), ref_pool), atol=2e-2, rtol=2e-2)
    assert is_pure_decode(table)          # the last batch ran on the decode wrapper


def _engine(model: str, backend: str, dtype: str) -> Engine:
    """The default model (the GGUF the environment has) or the tiny GQA-4 / head_dim-128 model,
    on CUDA with this attention backend and dtype."""
    fields = dict(device="cuda", attention_backend=backend, dtype=dtype, page_size=PAGE_SIZE,
                  num_pages=NUM_PAGES)
    if model == "default":
        from engine import load_default_engine
        return load_default_engine(progress=False, seed=0, **fields)
    weights = tiny_weights(tiny_hf_model(GQA4_HEAD128))
    return Engine(GQA4_HEAD128, weights, None, EngineConfig(**fields), seed=0)


@pytest.fixture(scope="module", params=MODELS)
def logits_by_path(request):
    """{(backend, dtype): {batch name: float32 logits [R, vocab] on the CPU}} for one model; each
    engine runs the batches from a fresh pool and is freed before the next is built."""
    results = {}
    for backend, dtype in PATHS:
        engine = _engine(request.param, backend, dtype)
        assert engine.attention.name == backend and engine.dtype == getattr(torch, dtype)
        results[backend, dtype] = run_batches(engine.logits,
                                              mixed_batches(engine.model_config.vocab_size))
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return request.param, results


def test_model_logits_and_greedy_tokens_match_float32(logits_by_path):
    model, results = logits_by_path
    comparisons = check_against_float32(results["flashinfer", "bfloat16"],
                                        results["torch", "bfloat16"],
                                        results["torch", "float32"])
    print_summaries(f"{model}: flashinfer-bf16 vs torch-bf16, against torch-float32", comparisons)


def test_float32_is_refused_by_the_flashinfer_backend():
    engine = _engine("gqa4-d128", "flashinfer", "float32")
    batch = next(iter(mixed_batches(engine.model_config.vocab_size).values()))
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        engine.logits(batch)


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
