"""The C prefill-attention kernel (quantized CPU mode) against a dense float64 reference at every
kernel level this CPU runs: causal prompts with and without a cached prefix, float32 and float16
pools over scattered pages, GQA groups, tiles cut short; the torch backend runs long requests
without a custom mask on it at the avx2 and avx512-vnni levels (on the kernels' threads), keeps
SDPA for custom masks and at the scalar level; bad rows and shapes are refused."""
from __future__ import annotations

import math

import pytest
import torch

from engine.attention import TorchPagedAttention
from engine.attention import torch_paged
from engine.attention.torch_paged import PREFILL_KERNEL_LEVELS
from engine.batch import ForwardBatch
from engine.page_table import build_page_table
from engine.quant import kernels
from tests.engine.test_attention import HKV, HQ, NUM_PAGES, PAGE_SIZE, reference, req

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable_reason())

HEAD_DIM = 16      # the kernel takes multiples of 16; test_attention's D is 8


def _case(num_tokens: int, prefix: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
          kv_dtype: torch.dtype, seed: int):
    """(plan, q as a strided view, slot view, kv_rows): a context of prefix + num_tokens slots
    on random pages of 8 slots."""
    generator = torch.Generator().manual_seed(seed)
    page_size, kv_len = 8, prefix + num_tokens
    num_pages = -(-kv_len // page_size) + 3
    pages = torch.randperm(num_pages, generator=generator)[:-(-kv_len // page_size)]
    kv_rows = (pages[:, None] * 2 * page_size + torch.arange(page_size)).flatten()[:kv_len]
    slots = torch.randn(num_pages * 2 * page_size, num_kv_heads, head_dim,
                        generator=generator).to(kv_dtype)
    qkv = torch.randn(num_tokens, num_q_heads + num_kv_heads, head_dim, generator=generator)
    return (kernels.PrefillAttention(kv_rows, num_tokens, page_size), qkv[:, :num_q_heads],
            slots, kv_rows)


def _dense(q: torch.Tensor, slots: torch.Tensor, kv_rows: torch.Tensor,
           page_size: int) -> torch.Tensor:
    """Causal softmax attention in float64 over the stored values, GQA by repeated heads."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // slots.shape[1]
    keys = slots[kv_rows].double().repeat_interleave(group, dim=1)            # [kv, Hq, D]
    values = slots[kv_rows + page_size].double().repeat_interleave(group, dim=1)
    kv_len = kv_rows.shape[0]
    scores = torch.einsum("thd,jhd->htj", q.double(), keys) / math.sqrt(head_dim)
    visible = torch.arange(kv_len)[None] <= torch.arange(kv_len - num_tokens, kv_len)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("htj,jhd->thd", scores.softmax(dim=-1), values)


@pytest.mark.parametrize("level", kernels.levels())
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens, prefix, num_q_heads, num_kv_heads, head_dim", [
    (37, 0, 9, 3, 64),        # SmolLM2's heads; 37 tokens: a last tile of 5
    (20, 13, 6, 2, 16),       # a cached prefix
    (33, 5, 4, 4, 48),        # no GQA; head_dim 48: a last block of 3 vectors
    (17, 0, 8, 1, 32),        # a group of 8: tiles of 3 tokens
    (3, 40, 32, 1, 16),       # a group past the tile rows: one token a tile
])
def test_every_level_matches_the_dense_reference(level: str, kv_dtype: torch.dtype,
                                                 num_tokens: int, prefix: int, num_q_heads: int,
                                                 num_kv_heads: int, head_dim: int) -> None:
    plan, q, slots, kv_rows = _case(num_tokens, prefix, num_q_heads, num_kv_heads, head_dim,
                                    kv_dtype, seed=num_tokens)
    out = torch.full((num_tokens, num_q_heads, head_dim), float("nan"))
    result = plan(q, slots, out, num_threads=2, level=level)
    assert result is out
    torch.testing.assert_close(out.double(), _dense(q, slots, kv_rows, plan.page_size),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("level", kernels.levels())
def test_thread_counts_give_the_same_values(level: str) -> None:
    """Units are whole tiles: how many threads take them changes nothing."""
    plan, q, slots, _ = _case(61, 3, 9, 3, 64, torch.float16, seed=4)
    one, two = (plan(q, slots, torch.empty(61, 9, 64), num_threads=n, level=level)
                for n in (1, 2))
    assert torch.equal(one, two)


def _run_backend(batch: ForwardBatch, kernel_threads=None, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randn(NUM_PAGES, 2, PAGE_SIZE, HKV, HEAD_DIM, generator=generator)
    table = build_page_table(batch, PAGE_SIZE)
    q, k_new, v_new = (torch.randn(table.num_tokens, heads, HEAD_DIM, generator=generator)
                       for heads in (HQ, HKV, HKV))
    backend = TorchPagedAttention(HQ, HKV, HEAD_DIM, PAGE_SIZE, c_decode=True,
                                  kernel_threads=kernel_threads)
    backend.plan(table)
    backend.append_kv(pool, k_new, v_new)
    out = backend.run(q, pool)
    expected = reference(q * math.sqrt(8 / HEAD_DIM), pool, table)   # it scales by 1/sqrt(8)
    return out, expected, backend


@pytest.mark.parametrize("level", kernels.levels())
def test_long_requests_run_on_the_kernel_where_its_simd_loops_run(level: str,
                                                                   monkeypatch) -> None:
    monkeypatch.setenv(kernels.LEVEL_ENV, level)
    monkeypatch.setattr(torch_paged, "MAX_TOKEN_ROW_SLOTS", 0)   # not as token rows: too long
    asked = []
    batch = ForwardBatch((req(21, (0, 1, 2, 3, 4, 5), 1),               # a prompt from scratch
                          req(1, (0, 1, 6), 2),                          # decode beside it
                          req(19, (7, 8, 9, 10, 11, 12), 3)))            # a prompt over 4 cached
    out, expected, backend = _run_backend(batch, lambda: asked.append(1) or 2)
    on_kernel = level in PREFILL_KERNEL_LEVELS
    assert backend.c_prefill == on_kernel
    assert [r.c_attention is not None for r in backend._long] == [on_kernel, on_kernel]
    assert len(asked) == (2 if on_kernel else 0)        # the kernels' thread count, per call
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_a_batch_with_custom_masks_keeps_sdpa() -> None:
    """A custom mask in the batch makes every request's mask explicit (PageTable.request_mask)."""
    batch = ForwardBatch((req(21, (0, 1, 2, 3, 4, 5), 1),
                          req(20, (13, 14, 15, 16, 17), 4,
                              mask=tuple((2, 3, 15) for _ in range(20)))))
    out, expected, backend = _run_backend(batch, seed=1)
    assert [r.c_attention for r in backend._long] == [None, None]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_without_the_c_decoder_long_requests_keep_sdpa() -> None:
    backend = TorchPagedAttention(HQ, HKV, HEAD_DIM, PAGE_SIZE)
    assert not backend.c_prefill
    assert not TorchPagedAttention(HQ, HKV, 24, PAGE_SIZE, c_decode=True).c_prefill  # 24 % 16


def test_bad_rows_and_shapes_are_refused_before_the_kernel_reads_them() -> None:
    with pytest.raises(ValueError, match="need a context of at least as many rows"):
        kernels.PrefillAttention(torch.arange(4), num_tokens=5, page_size=4)
    with pytest.raises(ValueError, match="need a context of at least as many rows"):
        kernels.PrefillAttention(torch.arange(4).view(2, 2), num_tokens=2, page_size=4)
    plan = kernels.PrefillAttention(torch.tensor([0, 1, 60]), num_tokens=2, page_size=4)
    q, out = torch.randn(2, HQ, HEAD_DIM), torch.empty(2, HQ, HEAD_DIM)
    with pytest.raises(ValueError, match=r"holding rows 0\.\.64"):
        plan(q, torch.zeros(64, HKV, HEAD_DIM), out)             # row 60's V row is 64
    slots = torch.zeros(65, HKV, HEAD_DIM)
    plan(q, slots, out)                                          # 65 rows hold it
    with pytest.raises(ValueError, match="slot_view must be contiguous float32 / float16"):
        plan(q, slots.to(torch.bfloat16), out)
    with pytest.raises(ValueError, match="D a multiple of 16"):
        plan(torch.randn(2, HQ, 8), torch.zeros(65, HKV, 8), torch.empty(2, HQ, 8))
    with pytest.raises(ValueError, match="q must be CPU float32"):
        plan(q.double(), slots, out)
    with pytest.raises(ValueError, match="out must be CPU float32"):
        plan(q, slots, torch.empty(3, HQ, HEAD_DIM))
