"""The C decode-attention kernel (quantized CPU mode) against the dense per-request reference:
decode batches, and short prompts beside them as one row per new token, run on it (new K/V written
at their tail slots, ragged lengths, shared pages, GQA); masked batches and long prompts keep the
torch path; bad indices are refused."""
from __future__ import annotations

import math

import pytest
import torch

from engine.attention import TorchPagedAttention, torch_paged
from engine.batch import ForwardBatch
from engine.page_table import build_page_table
from engine.quant import kernels
from tests.engine.test_attention import D, HKV, HQ, NUM_PAGES, PAGE_SIZE, reference, req

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable_reason())

HEAD_DIM = 16      # the kernel takes multiples of 8; test_attention's D is 8


def run_c_backend(batch: ForwardBatch, head_dim: int, seed: int,
                  kv_dtype: torch.dtype = torch.float32):
    """(backend output, reference, backend, pool, table, new K, new V) for one pass; the
    reference reads the pool as stored (float16 widened exactly)."""
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randn(NUM_PAGES, 2, PAGE_SIZE, HKV, head_dim, generator=generator).to(kv_dtype)
    table = build_page_table(batch, PAGE_SIZE)
    qkv = torch.randn(table.num_tokens, HQ + 2 * HKV, head_dim, generator=generator)
    q, k_new, v_new = qkv[:, :HQ], qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]   # strided views
    backend = TorchPagedAttention(HQ, HKV, head_dim, PAGE_SIZE, c_decode=True)
    backend.plan(table)
    backend.append_kv(pool, k_new, v_new)
    out = backend.run(q, pool)
    expected = reference(q * math.sqrt(D / head_dim), pool.float(), table)   # scales by 1/sqrt(D)
    return out, expected, backend, pool, table, k_new, v_new


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", [0, 1])
def test_plain_decode_batches_run_on_the_kernel_and_match(seed: int, kv_dtype: torch.dtype) -> None:
    batch = ForwardBatch((req(1, (3, 4), 2), req(1, (5,), 4), req(1, (3, 6, 7), 1),
                          req(1, (8,), 1)))           # ragged lengths, page 3 shared, 1-slot context
    out, expected, backend, pool, table, k_new, v_new = run_c_backend(batch, HEAD_DIM, seed,
                                                                      kv_dtype)
    assert backend._c_attention is not None               # the kernel ran
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for row in range(table.num_tokens):                   # the new K/V landed at their tail slots
        page, slot = int(table.append_page_ids[row]), int(table.append_slots[row])
        assert torch.equal(pool[page, 0, slot], k_new[row].to(kv_dtype))
        assert torch.equal(pool[page, 1, slot], v_new[row].to(kv_dtype))


@pytest.mark.parametrize("level", kernels.levels())
def test_a_float16_pool_stores_what_torch_rounds_to_bit_for_bit(level: str) -> None:
    """Every float32 -> float16 case of the C append: ties to even, the largest finite half and
    the first value that rounds to inf, subnormal halves and their ties, underflow to zero,
    infinities, signed zeros."""
    specials = torch.tensor([0.0, -0.0, 1.0, -2.5, 65504.0, 65519.99, 65520.0, -1e6,
                             float("inf"), float("-inf"), 2.0 ** -14, 2.0 ** -24, 2.0 ** -25,
                             3 * 2.0 ** -25, 1.5 * 2.0 ** -24, 2.0 ** -26, -(2.0 ** -20),
                             1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -11 + 2.0 ** -20])
    generator = torch.Generator().manual_seed(5)
    spread = torch.randn(4096, generator=generator) * torch.exp2(
        torch.randint(-30, 18, (4096,), generator=generator).float())
    values = torch.cat([specials, spread])
    num_rows = -(-len(values) // (HKV * HEAD_DIM))
    padded = torch.zeros(num_rows * HKV * HEAD_DIM)
    padded[:len(values)] = values
    k_new = padded.view(num_rows, HKV, HEAD_DIM)
    append_rows = torch.arange(num_rows) * 2 * 4            # one 4-slot page per row: K at slot 0
    attention = kernels.DecodeAttention(append_rows, append_rows.view(-1, 1),
                                        torch.ones(num_rows, dtype=torch.int64), 4, num_rows * 8)
    slot_view = torch.zeros(num_rows * 8, HKV, HEAD_DIM, dtype=torch.float16)
    attention(torch.zeros(num_rows, HQ, HEAD_DIM), k_new, k_new, slot_view, level=level)
    stored = slot_view[append_rows].flatten()[:len(values)]
    assert torch.equal(stored.view(torch.int16), values.half().view(torch.int16))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("level", kernels.levels())
def test_every_level_reads_both_pools_alike(level: str, kv_dtype: torch.dtype) -> None:
    """The scalar loops (any CPU) and the SIMD ones attend over a float32 or float16 pool to the
    same result as the dense reference over the stored values."""
    batch = ForwardBatch((req(1, (3, 4), 2), req(1, (5,), 4), req(1, (3, 6, 7), 1)))
    generator = torch.Generator().manual_seed(7)
    pool = torch.randn(NUM_PAGES, 2, PAGE_SIZE, HKV, HEAD_DIM, generator=generator).to(kv_dtype)
    table = build_page_table(batch, PAGE_SIZE)
    q, k_new, v_new = (torch.randn(table.num_tokens, heads, HEAD_DIM, generator=generator)
                       for heads in (HQ, HKV, HKV))
    backend = TorchPagedAttention(HQ, HKV, HEAD_DIM, PAGE_SIZE, c_decode=True)
    backend.plan(table)
    slot_view = pool.view(-1, HKV, HEAD_DIM)
    out = backend.decode_plan(slot_view.shape[0])(q, k_new, v_new, slot_view, level=level)
    expected = reference(q * math.sqrt(D / HEAD_DIM), pool.float(), table)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_masked_batches_keep_the_torch_path() -> None:
    masked = ForwardBatch((req(1, (3, 4), 2, mask=((1, 4, 1),)), req(1, (5,), 4)))
    out, expected, backend, *_ = run_c_backend(masked, HEAD_DIM, seed=2)
    assert backend._c_attention is None
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_short_prompts_beside_decode_steps_run_as_token_rows(kv_dtype: torch.dtype) -> None:
    """Each new token of a prompt, a chunk over cached slots or a decode step is a row of its
    own attending its causal prefix: the new tokens' K/V all land before any row attends."""
    batch = ForwardBatch((req(3, (1,), 3),               # a prompt from scratch
                          req(1, (5,), 4),               # a decode step
                          req(6, (2, 6), 3),             # six new tokens over one cached page
                          req(1, (3, 7, 8), 1)))         # a decode step into a fresh page
    out, expected, backend, pool, table, k_new, v_new = run_c_backend(batch, HEAD_DIM, seed=3,
                                                                      kv_dtype=kv_dtype)
    attention = backend._c_attention
    assert attention is not None and attention.kv_lens.tolist() == [1, 2, 3, 4, 2, 3, 4, 5, 6,
                                                                     7, 9]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for row in range(table.num_tokens):
        page, slot = int(table.append_page_ids[row]), int(table.append_slots[row])
        assert torch.equal(pool[page, 0, slot], k_new[row].to(kv_dtype))


def test_prompts_past_the_token_row_limit_keep_the_torch_path(monkeypatch) -> None:
    batch = ForwardBatch((req(3, (1,), 3), req(1, (5,), 4)))
    monkeypatch.setattr(torch_paged, "MAX_TOKEN_ROW_SLOTS", 5)         # the prompt attends 6
    out, expected, backend, *_ = run_c_backend(batch, HEAD_DIM, seed=4)
    assert backend._c_attention is None
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(torch_paged, "MAX_TOKEN_ROW_SLOTS", 6)
    out, expected, backend, *_ = run_c_backend(batch, HEAD_DIM, seed=4)
    assert backend._c_attention is not None
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_head_dims_the_kernel_cannot_take_keep_the_torch_path() -> None:
    assert not TorchPagedAttention(HQ, HKV, D + 4, PAGE_SIZE, c_decode=True).c_decode
    assert not TorchPagedAttention(HQ, HKV, D, PAGE_SIZE).c_decode


def test_out_of_range_indices_are_refused_before_the_kernel_reads_them() -> None:
    rows = torch.tensor([0, 1])
    lens = torch.tensor([1, 1])
    with pytest.raises(ValueError, match="kv_rows outside rows 0..59"):
        kernels.DecodeAttention(rows, torch.tensor([[0], [60]]), lens, page_size=4, num_rows=64)
    with pytest.raises(ValueError, match="kv_lens outside 0..max_kv"):
        kernels.DecodeAttention(rows, torch.tensor([[0], [1]]), torch.tensor([1, 2]), 4, 64)
    attention = kernels.DecodeAttention(rows, torch.tensor([[0], [1]]), lens, 4, 64)
    q = torch.randn(2, HQ, HEAD_DIM)
    k = torch.randn(2, HKV, HEAD_DIM)
    with pytest.raises(ValueError, match=r"slot_view must be contiguous float32 / float16 \[64"):
        attention(q, k, k, torch.zeros(32, HKV, HEAD_DIM))
    with pytest.raises(ValueError, match="slot_view must be contiguous float32 / float16"):
        attention(q, k, k, torch.zeros(64, HKV, HEAD_DIM, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="q must be CPU float32"):
        attention(q.double(), k, k, torch.zeros(64, HKV, HEAD_DIM))


def _gqa_case(num_q_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
              seed: int):
    """Three requests over random pages of a 16-page pool (page_size 4): (attention plan, q,
    k_new, v_new, slot view, kv_rows, kv_lens)."""
    generator = torch.Generator().manual_seed(seed)
    page_size, num_pages = 4, 16
    kv_lens = torch.tensor([1, 7, 13])
    kv_rows = torch.zeros(3, 13, dtype=torch.int64)
    for b, kv_len in enumerate(kv_lens.tolist()):
        pages = torch.randperm(num_pages, generator=generator)[:-(-kv_len // page_size)]
        rows = (pages[:, None] * 2 * page_size + torch.arange(page_size)).flatten()
        kv_rows[b, :kv_len] = rows[:kv_len]
    append_rows = kv_rows[torch.arange(3), kv_lens - 1]        # the new token: the last slot
    plan = kernels.DecodeAttention(append_rows, kv_rows, kv_lens, page_size,
                                   num_pages * 2 * page_size)
    slots = torch.randn(num_pages * 2 * page_size, num_kv_heads, head_dim,
                        generator=generator).to(kv_dtype)
    q = torch.randn(3, num_q_heads, head_dim, generator=generator)
    k_new, v_new = (torch.randn(3, num_kv_heads, head_dim, generator=generator) for _ in "kv")
    return plan, q, k_new, v_new, slots, kv_rows, kv_lens


@pytest.mark.parametrize("level", kernels.levels())
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim",
                         [(4, 4, 8), (9, 3, 24), (8, 1, 16), (20, 2, 8), (6, 2, 64)])
def test_query_heads_sharing_a_kv_head_get_what_each_would_get_alone(
        level: str, kv_dtype: torch.dtype, num_q_heads: int, num_kv_heads: int,
        head_dim: int) -> None:
    """GQA: each K / V row is read once for the query heads that share it (groups of 1, 3, 8
    and 10 -- run as 8 + 2 -- heads; head dims with and without a last 8 past the 16-wide
    steps). Every head's output is bit for bit its output with a KV head of its own (the rows
    copied per query head), and matches the dense reference over the stored values."""
    group = num_q_heads // num_kv_heads
    plan, q, k_new, v_new, slots, kv_rows, kv_lens = _gqa_case(num_q_heads, num_kv_heads,
                                                              head_dim, kv_dtype, seed=group)
    own_slots = slots.repeat_interleave(group, dim=1).contiguous()
    shared = plan(q, k_new, v_new, slots, level=level)
    alone = plan(q, k_new.repeat_interleave(group, dim=1), v_new.repeat_interleave(group, dim=1),
                 own_slots, level=level)
    assert torch.equal(shared, alone)
    page_size = plan.page_size
    for b, kv_len in enumerate(kv_lens.tolist()):
        rows = kv_rows[b, :kv_len]
        keys = slots[rows].double().repeat_interleave(group, dim=1)          # [kv_len, Hq, D]
        values = slots[rows + page_size].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,jhd->hj", q[b].double(), keys) / math.sqrt(head_dim)
        expected = torch.einsum("hj,jhd->hd", scores.softmax(dim=-1), values)
        torch.testing.assert_close(shared[b].double(), expected, atol=1e-5, rtol=1e-5)
