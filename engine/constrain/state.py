"""`GenerationState`: what one generation keeps between passes, shared by the host (which creates,
queries and drops it) and the sampler (which reads it for penalties and the grammar mask, and
advances it with every token it returns). Thread-safe: the sampler runs on the engine thread,
queries come from the instance's thread.
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["GenerationState", "GenerationStatus"]


@dataclass(frozen=True)
class GenerationStatus:
    """num_tokens: tokens the generation produced. accepting: the grammar (if any) is complete
    here. stopped: the grammar admits nothing more (only a stop token). error: why the matcher
    failed ("" when it did not)."""

    num_tokens: int
    accepting: bool
    stopped: bool
    error: str = ""


class GenerationState:
    """The tokens a generation produced (counts for presence / frequency / repetition penalties)
    and an optional llguidance matcher."""

    def __init__(self, matcher: Any = None) -> None:
        self.matcher = matcher
        self._lock = threading.Lock()
        self._counts: Counter[int] = Counter()
        self._num_tokens = 0

    @property
    def constrained(self) -> bool:
        return self.matcher is not None

    def accept(self, token_id: int) -> bool:
        """Record a produced token; False when the grammar rejects it (the matcher then fails)."""
        with self._lock:
            self._counts[token_id] += 1
            self._num_tokens += 1
            return self.matcher is None or self.matcher.consume_token(token_id)

    def history(self) -> tuple[list[int], list[int]]:
        """(distinct token ids produced, how many times each)."""
        with self._lock:
            return list(self._counts), list(self._counts.values())

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the grammar's allowed tokens into row `row` of an int32 bitmask [R, ceil(V/32)]."""
        import llguidance.torch as ll_torch
        with self._lock:
            ll_torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def status(self) -> GenerationStatus:
        with self._lock:
            if self.matcher is None:
                return GenerationStatus(self._num_tokens, True, False)
            return GenerationStatus(self._num_tokens, self.matcher.is_accepting(),
                                    self.matcher.is_stopped(),
                                    self.matcher.get_error() if self.matcher.is_error() else "")
