"""The SDK's error type: what the inferlet returns as its error result."""
from __future__ import annotations

__all__ = ["InferletError"]


class InferletError(RuntimeError):
    """A failure the inferlet reports to its client (its `run` returns err with this message)."""
