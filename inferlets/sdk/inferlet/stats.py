"""What a context computed itself and what it shares: `ContextStats`, from `Context.stats()`.

Counted in the SDK from what the context already knows (no host call): a fork shares its
parent's KV pages (`kv.share-pages`) and an import the export's, so their slots were computed
once, elsewhere. A fork's page ids are its own handles (they differ from the parent's), so
comparing `page_ids` cannot show the sharing; these figures do.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ContextStats"]


@dataclass(frozen=True)
class ContextStats:
    """One context's KV, as the SDK counts it.

    num_tokens:          tokens of the context, pending ones included.
    num_kv_slots:        KV slots its pages hold (computed or submitted).
    num_tokens_computed: of those, the slots its own passes computed (not inherited from the
                         context it was forked from, nor imported).
    num_pages:           KV pages it holds.
    num_pages_shared:    of those, the full pages it shares with another context: a fork's
                         inherited pages (on both sides of the fork), an import's read-only pages.
    """

    num_tokens: int
    num_kv_slots: int
    num_tokens_computed: int
    num_pages: int
    num_pages_shared: int
