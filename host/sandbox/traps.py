"""Name the cause of a Wasmtime trap that no host function recorded.

Traps reach Python as WasmtimeError with no trap code, so they are classified by message. Memory
exhaustion shows up only as `unreachable` (memory.grow returns -1 at the store limit; the guest's
allocator then aborts): an `unreachable` trap whose guest log or backtrace shows an allocation
failure (CPython's MemoryError, Rust's "memory allocation of N bytes failed", "out of memory")
is reported as "memory limit N MiB reached".
"""
from __future__ import annotations

import re
from typing import Any, Sequence

__all__ = ["classify_trap", "MEMORY_MARKERS"]

# Wasmtime's store limiter at instantiation: "resource limit exceeded: <kind> count too high at N"
_COUNT_TOO_HIGH = re.compile(r"resource limit exceeded: (\w+) count too high at (\d+)")
_COUNT_LIMITS = {"memory": ("max_memories", "linear memories"),
                 "table": ("max_tables", "tables"),
                 "instance": ("max_core_instances", "core instances")}

MEMORY_MARKERS = ("memoryerror", "memory allocation of", "out of memory", "cannot allocate",
                  "handle_alloc_error", "alloc_error")
_NUM_LOG_LINES_CHECKED = 30


def classify_trap(message: str, limits: Any, log_lines: Sequence[str]) -> str:
    """A one-line cause for a trap message of Wasmtime."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else "unknown trap"
    lowered = message.lower()
    if "wasm trap: interrupt" in lowered:
        return f"no host call for {limits.max_idle_s:g} s"
    if "unreachable" in last:
        recent = " ".join(log_lines[-_NUM_LOG_LINES_CHECKED:]).lower()
        if any(marker in recent or marker in lowered for marker in MEMORY_MARKERS):
            return f"memory limit {limits.memory_mb} MiB reached"
        return "guest trapped: wasm `unreachable` instruction executed (abort or panic)"
    if "exceeds memory limits" in lowered or "memory minimum size" in lowered:
        return f"memory limit {limits.memory_mb} MiB reached (at instantiation)"
    count = _COUNT_TOO_HIGH.search(lowered)
    if count is not None and count.group(1) in _COUNT_LIMITS:
        field, what = _COUNT_LIMITS[count.group(1)]
        return (f"the component needs more than {field} {getattr(limits, field)} {what} "
                f"(refused at instantiation)")
    if "table minimum size" in lowered or "exceeds table limits" in lowered:
        return (f"a table needs more than max_table_elements {limits.max_table_elements} "
                f"elements (refused at instantiation)")
    if "unknown handle index" in lowered:
        return f"guest trapped: invalid resource handle ({last})"
    if "cannot enter component instance" in lowered:
        return "guest trapped: re-entered a poisoned instance"
    if "wasm trap" in lowered or "wasm backtrace" in lowered:
        return f"guest trapped: {last.removeprefix('wasm trap: ')}"
    return f"cannot run the component: {last}"
