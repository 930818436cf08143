"""Swap or recompute: which restores a suspended instance's pages sooner on this device, from a
small measurement made once, when the runtime starts (host/runtime.py), before any instance
holds a page.

- copy: `read_pages` then `write_pages` of a few pool pages (a page's way out to host memory
  and back), the fastest of a few tries;
- prefill: one pass of those pages' worth of tokens into them (what recomputing a token costs),
  the fastest of a few tries.

A victim whose pages can all be recomputed (host/kv/page_log.py) is recomputed when its tokens
cost less to prefill than its pages cost to copy (`RestoreCosts.recompute_cheaper`); otherwise,
and always for the rest, it is swapped. The restore mode `swap` / `recompute` in RuntimeConfig
overrides the measurement (tests, benchmarks).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from engine.batch import GREEDY, ForwardBatch, ForwardRequest
from engine.protocol import EngineLike
from host.kv import PageAllocator

__all__ = ["RestoreCosts", "measure_restore_costs", "RESTORE_MODES"]

RESTORE_MODES = ("auto", "swap", "recompute")
_MEASURE_PAGES = 4             # pages copied and prefilled by the measurement
_TRIES = 3


@dataclass(frozen=True)
class RestoreCosts:
    """Seconds per page copied out and back, and per token recomputed, on this engine;
    `mode` "swap" / "recompute" fixes the choice, "auto" compares the two."""

    copy_s_per_page: float
    prefill_s_per_token: float
    mode: str = "auto"

    def recompute_cheaper(self, num_pages: int, num_tokens: int) -> bool:
        """Whether recomputing `num_tokens` (the victim's, over `num_pages` pages) beats
        copying the pages out and back."""
        if self.mode != "auto":
            return self.mode == "recompute"
        return num_tokens * self.prefill_s_per_token < num_pages * self.copy_s_per_page

    def describe(self) -> str:
        if self.mode != "auto":
            return f"restore: {self.mode} (set, not measured)"
        return (f"restore: a page copied out and back {self.copy_s_per_page * 1e3:.3f} ms, a "
                f"token recomputed {self.prefill_s_per_token * 1e3:.3f} ms (auto)")


def measure_restore_costs(engine: EngineLike, allocator: PageAllocator,
                          mode: str = "auto") -> RestoreCosts:
    """Measure on `engine` (nothing else using it: called before the runtime serves), with
    pages of `allocator` returned afterwards. With `mode` other than "auto" nothing is
    measured."""
    if mode not in RESTORE_MODES:
        raise ValueError(f"restore mode must be one of {RESTORE_MODES}, got {mode!r}")
    if mode != "auto":
        return RestoreCosts(0.0, 0.0, mode)
    num_pages = min(_MEASURE_PAGES, allocator.num_free())
    if num_pages == 0:
        return RestoreCosts(0.0, 0.0, "swap")
    page_ids = allocator.allocate(num_pages)
    try:
        num_tokens = num_pages * engine.page_size
        request = ForwardRequest(tuple(range(1, num_tokens + 1)), tuple(range(num_tokens)),
                                 tuple(page_ids), engine.page_size, (num_tokens - 1,),
                                 (GREEDY,))          # one output: the pass has finished on return
        prefill_s = _fastest(lambda: engine.forward(ForwardBatch((request,))))

        def copy() -> None:
            engine.write_pages(page_ids, engine.read_pages(page_ids))
            engine.read_pages(page_ids[:1])          # the write has landed (a device's copy)

        copy_s = _fastest(copy)
    finally:
        allocator.release(page_ids)
    return RestoreCosts(copy_s / num_pages, prefill_s / num_tokens)


def _fastest(run) -> float:
    """The shortest of _TRIES timed runs, after one untimed."""
    run()
    best = float("inf")
    for _ in range(_TRIES):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best
