"""The arithmetic of a paged sequence, written once.

A sequence of `kv_len` token slots lives in `num_pages` pages of `page_size` slots; every page but
the last is full, the last holds `last_page_len` (1..page_size) slots. The host, the engine and
the tests use these; the guest SDK, which cannot import the engine, mirrors `kv_len`.
"""
from __future__ import annotations

__all__ = ["kv_len", "last_page_len", "num_pages_needed"]


def kv_len(num_pages: int, last_page_len: int, page_size: int) -> int:
    """Slots held by `num_pages` pages whose last holds `last_page_len` (0 for no pages)."""
    return 0 if num_pages == 0 else (num_pages - 1) * page_size + last_page_len


def last_page_len(num_slots: int, page_size: int) -> int:
    """Slots used in the last page of a sequence of `num_slots` >= 1 slots."""
    return (num_slots - 1) % page_size + 1


def num_pages_needed(num_slots: int, page_size: int) -> int:
    """Pages needed for `num_slots` slots."""
    return -(-num_slots // page_size)
