"""Linear memories of ended instances kept for the next ones: reuse instead of fresh pages.

A counted memory (`LinearMemories`) is a fresh mapping whose pages the kernel must find, zero
and map as the guest writes them (its heap image's pages copied from the image's file on first
write), the more so when the pages must come back from the hypervisor first (a VM with a balloon
driver). A memory kept here still has its pages: the next instance of the same shape gets it
after the host has put the image back in the pages the last instance wrote and zeroed every
other byte it had made accessible (`LinearMemories` does that, outside any lock), so no byte of
an ended instance reaches the next.

Bounds: a memory is kept only when its accessible size is at most `max_memory_bytes` (zeroing a
larger one costs more than fresh pages) and it fits `max_total_bytes` with the others; what is
kept longer than `idle_s` unused is given back (`take_idle`, called by the runtime's ticker).
What the pool holds is host memory, charged to no instance. Thread-safe.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Generic, Protocol, TypeVar

__all__ = ["MemoryPool", "PooledMemory"]


class PooledMemory(Protocol):
    """What the pool reads of a memory."""

    capacity: int      # bytes Wasmtime may address
    num_mapped: int    # bytes mapped (alignment, capacity and guard)
    num_bytes: int     # bytes accessible, all of which the next user needs zeroed


M = TypeVar("M", bound=PooledMemory)


class MemoryPool(Generic[M]):
    """Released memories by shape (capacity, num_mapped), most recently released first."""

    def __init__(self, max_total_bytes: int, max_memory_bytes: int = 64 << 20,
                 idle_s: float = 600.0) -> None:
        if max_total_bytes < 0 or max_memory_bytes < 0 or not idle_s > 0:
            raise ValueError(f"MemoryPool: bounds must be >= 0 and idle_s > 0, got "
                             f"{max_total_bytes}, {max_memory_bytes}, {idle_s}")
        self._max_total_bytes = max_total_bytes
        self._max_memory_bytes = max_memory_bytes
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._kept: dict[tuple[int, int], deque[tuple[float, M]]] = {}
        self._num_bytes = 0
        self._closed = False

    @property
    def idle_s(self) -> float:
        """How long a memory is kept unused before take_idle gives it back."""
        return self._idle_s

    @property
    def num_bytes(self) -> int:
        """Accessible bytes of the memories kept (their resident size at most)."""
        with self._lock:
            return self._num_bytes

    @property
    def num_memories(self) -> int:
        with self._lock:
            return sum(map(len, self._kept.values()))

    def put(self, memory: M) -> bool:
        """Keep `memory` for reuse (True), or refuse it (False: the caller unmaps it)."""
        size = memory.num_bytes
        with self._lock:
            if (self._closed or size > self._max_memory_bytes
                    or self._num_bytes + size > self._max_total_bytes):
                return False
            key = (memory.capacity, memory.num_mapped)
            self._kept.setdefault(key, deque()).appendleft((time.monotonic(), memory))
            self._num_bytes += size
            return True

    def take(self, capacity: int, num_mapped: int) -> M | None:
        """A kept memory of that shape (its bytes as the last user left them), or None."""
        with self._lock:
            kept = self._kept.get((capacity, num_mapped))
            if not kept:
                return None
            _, memory = kept.popleft()
            self._num_bytes -= memory.num_bytes
            return memory

    def take_idle(self, now: float | None = None) -> list[M]:
        """Remove and return the memories kept longer than idle_s (the caller unmaps them)."""
        cutoff = (time.monotonic() if now is None else now) - self._idle_s
        idle: list[M] = []
        with self._lock:
            for kept in self._kept.values():
                while kept and kept[-1][0] <= cutoff:      # oldest at the right
                    idle.append(kept.pop()[1])
            self._num_bytes -= sum(memory.num_bytes for memory in idle)
        return idle

    def close(self) -> list[M]:
        """Keep nothing from now on; remove and return every memory kept."""
        with self._lock:
            self._closed = True
            kept = [memory for queue in self._kept.values() for _, memory in queue]
            self._kept.clear()
            self._num_bytes = 0
        return kept
