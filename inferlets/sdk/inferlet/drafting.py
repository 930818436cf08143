"""Drafters for speculative decoding: cheap guesses of the next tokens, which one verify pass
checks at once (the host accepts the longest prefix the model agrees with; see
`Context.generate(..., drafter=...)`). Pure Python, no host calls.

A drafter is any callable `(token_ids) -> list[int]`: given every token of the context so far,
it proposes up to its own limit of next tokens ([] = no guess; a plain step is taken).
"""
from __future__ import annotations

from typing import Callable, Sequence

__all__ = ["Drafter", "PromptLookupDrafter"]

Drafter = Callable[[Sequence[int]], list]


class PromptLookupDrafter:
    """N-gram prompt lookup: find the most recent earlier occurrence of the context's last n
    tokens (n from `max_ngram` down to `min_ngram`) and propose the `num_drafts` tokens that
    followed it. Strong when the output copies from the prompt (editing, extraction, summaries
    that quote)."""

    def __init__(self, num_drafts: int = 6, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if num_drafts <= 0:
            raise ValueError(f"num_drafts must be positive, got {num_drafts}")
        if not 0 < min_ngram <= max_ngram:
            raise ValueError(f"need 0 < min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.num_drafts = num_drafts
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def __call__(self, token_ids: Sequence[int]) -> list[int]:
        tokens = list(token_ids)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):     # most recent match first
                if tokens[start:start + n] == tail:
                    follow = tokens[start + n:start + n + self.num_drafts]
                    if follow:
                        return follow
        return []
