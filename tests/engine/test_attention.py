"""Torch paged attention vs a dense per-request reference: prefill, decode, mixed, masks, shared
pages, GQA; and one SDPA call for a whole decode batch."""
from __future__ import annotations

import math

import torch

from engine.attention import TorchPagedAttention, make_attention_backend
from engine.batch import ForwardBatch, ForwardRequest
from engine.page_table import build_page_table

PAGE_SIZE, NUM_PAGES, HQ, HKV, D = 4, 32, 6, 2, 8


def req(num_tokens: int, page_ids: tuple[int, ...], last: int, mask=None) -> ForwardRequest:
    return ForwardRequest(token_ids=(1,) * num_tokens, positions=tuple(range(num_tokens)),
                          page_ids=page_ids, last_page_len=last, mask=mask)


def reference(q: torch.Tensor, pool: torch.Tensor, table) -> torch.Tensor:
    """Slot-by-slot gather and explicit softmax attention, one request at a time."""
    out = torch.zeros_like(q)
    for b in range(table.num_requests):
        pages = table.kv_page_indices[table.kv_indptr[b]:table.kv_indptr[b + 1]].tolist()
        kv_len = int(table.kv_lens[b])
        slots = [(pages[j // PAGE_SIZE], j % PAGE_SIZE) for j in range(kv_len)]
        k = torch.stack([pool[p, 0, s] for p, s in slots])              # [kv_len, Hkv, D]
        v = torch.stack([pool[p, 1, s] for p, s in slots])
        start, end = int(table.qo_indptr[b]), int(table.qo_indptr[b + 1])
        q_len = end - start
        mask = table.request_mask(b)
        if mask is None:
            mask = torch.arange(kv_len)[None] <= torch.arange(kv_len - q_len, kv_len)[:, None]
        for h in range(HQ):
            kh, vh = k[:, h // (HQ // HKV)], v[:, h // (HQ // HKV)]
            scores = q[start:end, h] @ kh.T / math.sqrt(D)              # [q_len, kv_len]
            scores = scores.masked_fill(~mask, float("-inf"))
            out[start:end, h] = torch.softmax(scores, -1) @ vh
    return out


def run_backend(batch: ForwardBatch, seed: int = 0):
    torch.manual_seed(seed)
    pool = torch.randn(NUM_PAGES, 2, PAGE_SIZE, HKV, D)
    table = build_page_table(batch, PAGE_SIZE)
    q = torch.randn(table.num_tokens, HQ, D)
    k_new, v_new = torch.randn(table.num_tokens, HKV, D), torch.randn(table.num_tokens, HKV, D)
    backend = TorchPagedAttention(HQ, HKV, D, PAGE_SIZE)
    backend.plan(table)
    backend.append_kv(pool, k_new, v_new)
    for row in range(table.num_tokens):        # the new K/V landed at their tail slots
        page, slot = int(table.append_page_ids[row]), int(table.append_slots[row])
        assert torch.equal(pool[page, 0, slot], k_new[row])
        assert torch.equal(pool[page, 1, slot], v_new[row])
    return backend.run(q, pool), reference(q, pool, table)


def test_mixed_prefill_decode_and_shared_pages():
    long_prefill = req(21, (0, 1, 2, 3, 4, 5), 1)           # > MAX_PADDED_Q: its own SDPA call
    batch = ForwardBatch((
        long_prefill,
        req(1, (0, 1, 6), 2),                                # decode sharing pages 0, 1
        req(3, (0, 1, 7), 3),                                # small fill sharing pages 0, 1
        req(5, (8, 9), 1),                                   # small prefill from scratch
    ))
    ours, expected = run_backend(batch)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_custom_masks_in_padded_and_long_requests():
    batch = ForwardBatch((
        req(2, (10, 11), 2, mask=((1, 3, 2), (2, 1, 3))),
        req(20, (12, 13, 14, 15, 16), 4, mask=tuple((2, 3, 15) for _ in range(20))),
        req(1, (17,), 3),
    ))
    ours, expected = run_backend(batch, seed=1)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_decode_batch_of_32_is_one_sdpa_call(monkeypatch):
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting_sdpa(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
    batch = ForwardBatch(tuple(req(1, (b % NUM_PAGES,), 1 + b % PAGE_SIZE) for b in range(32)))
    ours, expected = run_backend(batch, seed=2)
    assert len(calls) == 1
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_factory_gives_torch_backend_on_cpu():
    backend = make_attention_backend("auto", num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                     page_size=PAGE_SIZE)
    assert backend.name == "torch"


def test_pure_decode_batch_with_masks_and_ragged_lengths():
    batch = ForwardBatch((
        req(1, (3, 4), 2, mask=((1, 4, 1),)),
        req(1, (5,), 4),
        req(1, (3, 6, 7), 1, mask=((0, 2, 7),)),
    ))
    ours, expected = run_backend(batch, seed=3)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
