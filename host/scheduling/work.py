"""The work the scheduler runs: checked, translated passes and copies (physical page ids only).

Made by the per-instance page tables (host/kv/instance_pages.py), run by the BatchScheduler
(host/scheduling/scheduler.py); this module is the only thing the two share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine.batch import ForwardRequest, TokenCopy

__all__ = ["PreparedForward", "PreparedCopy"]


@dataclass(frozen=True)
class PreparedForward:
    """A checked pass ready for the scheduler: the engine request (physical ids), the copies that
    must run right before it (copy-on-write), and `on_done`, which the scheduler calls exactly once
    when the pass has run, failed or been cancelled."""

    request: ForwardRequest
    copies: tuple[TokenCopy, ...] = ()
    on_done: Callable[[], None] | None = None


@dataclass(frozen=True)
class PreparedCopy:
    """A checked kv.copy-tokens: the copies to run in order on a queue (a copy-on-write of the
    destination first when it was shared), and `on_done` as for PreparedForward."""

    copies: tuple[TokenCopy, ...]
    on_done: Callable[[], None] | None = None
