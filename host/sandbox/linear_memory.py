"""Every linear memory of a runtime's instances, created by the host so it counts them.

Wasmtime's store limits bound each memory on its own and say nothing when a `memory.grow` is
refused; a guest then reports whatever its allocator makes of it (CPython in componentize-py
0.25.1 doubling a str that no longer fits raises "TypeError: unsupported operand type(s) for +:
'' and ''": formatting the type names already failed). So the host creates the memories itself
(a Wasmtime host memory creator): `LinearMemories` reserves each memory's address space (PROT_NONE,
as Wasmtime would), makes its accessible prefix read-write as it grows, charges every byte to the
instance whose thread created it (`current.instance`), refuses a growth past that instance's
total (`InstanceLimits.memory_mb`, all its memories together) and records that it did, so the
instance's outcome can name the limit whatever the guest reports.

Memories created outside an instance thread are not charged. Data segments are copied into each
memory (`memory_init_cow` off: Wasmtime's copy-on-write images need its own mmap memories);
where the program's one memory has a `MemoryImage` (host/sandbox/programs/memory_image.py: its
active segments were emptied when it was loaded), the creator maps that image's file over the
memory's start, copy-on-write, as it creates the memory (host/sandbox/image_files.py: the guest
gets private copies of only the pages it writes), or copies the image in where no file could be
made. Each reservation starts on a 2 MiB boundary and is advised for transparent huge pages, so
what lies past the image faults in 2 MiB at a time where the kernel allows it (THP "madvise" or
"always") rather than one fault per 4 KiB page; where the kernel has no huge pages to give it
falls back to 4 KiB pages. A growth's last partial 2 MiB stays in small pages (only whole
read-write 2 MiB ranges get a huge page), so a memory's resident size stays within its
accessible size. A memory's charge is its accessible size, however much of it is shared with
the image's file.

An ended instance's memory goes to a `MemoryPool` (`pool_bytes`, 0 = none; unmapped after
`pool_idle_s` unused) when it fits; a new memory of the same shape is then that one, every byte
the last instance could reach past the new image zeroed here and what lies past the new size
made inaccessible again (host/sandbox/memory_pool.py: why). Its start holds the new image: the
pages the last instance wrote of the same image's mapping copied back from the image (its other
pages are the file's: `ImageFiles.restore`), else the image's file mapped afresh over it, else
the image copied in.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Any, Protocol

from wasmtime import Config, WasmtimeError
from wasmtime import _bindings

from host.sandbox.image_files import ImageFiles, image_span
from host.sandbox.programs.memory_image import MemoryImage
from host.sandbox.memory_pool import MemoryPool

__all__ = ["LinearMemories", "MemoryOwner"]

_PROT_NONE, _PROT_READ_WRITE = 0, 3
_MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x02, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value
_OS_PAGE = 4096
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23      # Linux 5.14: fault pages in writable (a private copy made now)
_Finalizer = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class ImageHolder(Protocol):
    memory_image: MemoryImage | None   # what the program's one memory starts as (None: zeros)


class MemoryOwner(Protocol):
    """What an instance exposes to be charged for its memories."""

    memory_limit_bytes: int      # its total, all memories together
    num_memory_bytes: int        # charged now
    memory_limit_hit: bool       # a creation or growth was refused at the limit
    program: ImageHolder         # the image of its memory, if any


def _libc() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _error(message: str) -> int:
    """A wasmtime_error_t* for Wasmtime to own, as the callbacks return it."""
    return ctypes.cast(WasmtimeError(message)._consume(), ctypes.c_void_p).value or 0


class _Memory:
    __slots__ = ("base", "num_bytes", "capacity", "mapping", "num_mapped", "owner", "reusable",
                 "image")

    def __init__(self, base: int, num_bytes: int, capacity: int, mapping: int, num_mapped: int,
                 owner: MemoryOwner | None, image: MemoryImage | None) -> None:
        self.base = base              # address 0 of the memory, on a 2 MiB boundary
        self.num_bytes = num_bytes
        self.capacity = capacity      # what Wasmtime may address: the reservation less the guard
        self.mapping = mapping        # the start of what was mapped: base less its alignment
        self.num_mapped = num_mapped  # what was mapped: alignment, capacity and guard
        self.owner = owner
        self.reusable = True          # False once a protection change failed: never pooled
        self.image = image            # whose file is mapped over [0, image_span) (None: none)


class LinearMemories:
    """The host memory creator of one Wasmtime engine. Keep it alive as long as the engine."""

    def __init__(self, current: threading.local, pool_bytes: int = 0,
                 pool_idle_s: float = 600.0) -> None:
        self._current = current
        self._libc = _libc()
        self._images = ImageFiles(self._libc)
        self.pool: MemoryPool[_Memory] = MemoryPool(pool_bytes, idle_s=pool_idle_s)
        self._lock = threading.Lock()
        self._memories: dict[int, _Memory] = {}
        self._next_key = 1
        self._callbacks = (_bindings.wasmtime_memory_get_callback_t(self._get),
                           _bindings.wasmtime_memory_grow_callback_t(self._grow),
                           _Finalizer(self._finalize),
                           _bindings.wasmtime_new_memory_callback_t(self._new),
                           _Finalizer(lambda _env: None))
        self._creator = _bindings.wasmtime_memory_creator_t()
        self._creator.env = None
        self._creator.new_memory = self._callbacks[3]
        self._creator.finalizer = self._callbacks[4]

    def install(self, config: Config) -> None:
        """Make `config`'s engine create its memories here."""
        _bindings.wasmtime_config_host_memory_creator_set(config.ptr(),
                                                          ctypes.byref(self._creator))

    @property
    def num_memories(self) -> int:
        with self._lock:
            return len(self._memories)

    # ---------------------------------------------------- Wasmtime's callbacks (never raise)
    def _new(self, _env: Any, _type: Any, minimum: int, _maximum: int, reserved: int,
             guard: int, memory_out: Any) -> int:
        try:
            owner = getattr(self._current, "instance", None)
            if owner is not None and not self._charge(owner, minimum):
                return _error(f"memory limit {owner.memory_limit_bytes >> 20} MiB reached "
                              f"(a memory of {minimum} bytes at instantiation)")
            capacity = max(reserved, minimum)
            num_mapped = capacity + guard + _HUGE_PAGE
            image = owner.program.memory_image if owner is not None else None
            if image is not None and image.num_bytes != minimum:
                image = None                      # not the memory the image is of
            memory = (self._reused(capacity, num_mapped, minimum, image)
                      or self._mapped(capacity, num_mapped, minimum, image))
            if memory is None:
                if owner is not None:
                    self._charge(owner, -minimum)
                return _error(f"cannot reserve a linear memory of {capacity} bytes")
            memory.owner = owner
            with self._lock:
                key = self._next_key
                self._next_key += 1
                self._memories[key] = memory
            out = memory_out[0]
            out.env = key
            out.get_memory, out.grow_memory, out.finalizer = self._callbacks[:3]
            return 0
        except BaseException as exc:  # noqa: BLE001 -- never unwind through Wasmtime
            return _error(f"host memory creator failed: {exc!r}")

    def _get(self, env: Any, size_out: Any, capacity_out: Any) -> int:
        memory = self._memories[env]
        size_out[0] = memory.num_bytes
        capacity_out[0] = memory.capacity
        return memory.base

    def _grow(self, env: Any, new_size: int) -> int:
        try:
            memory = self._memories[env]
            delta = new_size - memory.num_bytes
            if new_size > memory.capacity:
                return _error(f"a linear memory cannot grow past {memory.capacity} bytes")
            owner = memory.owner
            if owner is not None and not self._charge(owner, delta):
                return _error(f"memory limit {owner.memory_limit_bytes >> 20} MiB reached")
            if not self._protect(memory.base, memory.num_bytes, new_size):
                memory.reusable = False     # pages past its size may be accessible now
                if owner is not None:
                    self._charge(owner, -delta)
                return _error("cannot make linear memory accessible")
            memory.num_bytes = new_size
            return 0
        except BaseException as exc:  # noqa: BLE001
            return _error(f"host memory creator failed: {exc!r}")

    def _finalize(self, env: Any) -> None:
        with self._lock:
            memory = self._memories.pop(env, None)
        if memory is None:
            return
        if memory.owner is not None:
            self._charge(memory.owner, -memory.num_bytes)
            memory.owner = None
        if memory.image is not None:
            self._images.note_written(memory.base, memory.image, memory.num_bytes)
        if not (memory.reusable and self.pool.put(memory)):
            self._unmap(memory)

    def warm(self, owner: MemoryOwner) -> None:
        """Fault in, writable, the pages of `owner`'s memories that the last memory of the same
        image to end had written (ImageFiles.last_written), within each one's accessible size
        (already charged): a guest that starts later (a spare) then finds them as a pooled
        memory's, not at a fault each. Nothing where the page map cannot tell or the kernel
        has no MADV_POPULATE_WRITE."""
        with self._lock:
            memories = [m for m in self._memories.values()
                        if m.owner is owner and m.image is not None]
        for memory in memories:
            accessible = -(-memory.num_bytes // _OS_PAGE) * _OS_PAGE
            for first, count in self._images.last_written(memory.image):
                start = first * _OS_PAGE
                end = min(start + count * _OS_PAGE, accessible)
                if end > start:
                    self._libc.madvise(memory.base + start, end - start, _MADV_POPULATE_WRITE)

    # ------------------------------------------------------------------------- the pool
    def release_idle(self, now: float | None = None) -> None:
        """Unmap the pooled memories unused for the pool's idle_s (the runtime's ticker)."""
        for memory in self.pool.take_idle(now):
            self._unmap(memory)

    def close_pool(self) -> None:
        """Unmap every pooled memory and pool none from now on (the runtime closes)."""
        for memory in self.pool.close():
            self._unmap(memory)

    def _mapped(self, capacity: int, num_mapped: int, minimum: int,
                image: MemoryImage | None) -> _Memory | None:
        """A fresh reservation with [0, minimum) read-write (starting with `image`), or None."""
        mapping = self._libc.mmap(None, num_mapped, _PROT_NONE,
                                  _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if mapping in (None, _MAP_FAILED):
            return None
        base = -(-mapping // _HUGE_PAGE) * _HUGE_PAGE
        self._libc.madvise(base, capacity, _MADV_HUGEPAGE)   # advice: may be refused
        if not self._protect(base, 0, minimum):
            self._libc.munmap(mapping, num_mapped)
            return None
        try:
            mapped = image is not None and self._images.map(base, image)
        except OSError:
            self._libc.munmap(mapping, num_mapped)
            return None
        if image is not None and not mapped:
            ctypes.memmove(base, image.data, len(image.data))
        return _Memory(base, minimum, capacity, mapping, num_mapped, None,
                       image if mapped else None)

    def _reused(self, capacity: int, num_mapped: int, minimum: int,
                image: MemoryImage | None) -> _Memory | None:
        """A pooled memory of that shape, [0, minimum) read-write and the rest inaccessible,
        holding `image` then zeros (all zeros without one); or None. The image is the same
        image's mapping with the pages the last instance wrote copied back, or its file mapped
        afresh, or (no file) copied over the last instance's bytes; what lies past it is
        zeroed, so no byte is written twice."""
        memory = self.pool.take(capacity, num_mapped)
        if memory is None:
            return None
        base, used = memory.base, memory.num_bytes
        try:
            num_image_bytes = self._put_image(memory, image)
        except OSError:                          # its start may be unmapped now: give it up
            self._unmap(memory)
            return None
        if used > num_image_bytes:               # every byte the last instance could reach
            ctypes.memset(base + num_image_bytes, 0, used - num_image_bytes)
        keep = -(-minimum // _OS_PAGE) * _OS_PAGE
        end = -(-used // _OS_PAGE) * _OS_PAGE
        if (end > keep and self._libc.mprotect(base + keep, end - keep, _PROT_NONE) != 0) \
                or not self._protect(base, used, minimum):
            self._unmap(memory)
            return None
        memory.num_bytes = minimum
        if image is not None and memory.image is None:   # within [0, minimum): the image's check
            ctypes.memmove(base, image.data, num_image_bytes)
        return memory

    def _put_image(self, memory: _Memory, image: MemoryImage | None) -> int:
        """Make a pooled memory's start hold `image` from its file, its written pages restored
        if the file mapped there is the image's own, else the file mapped afresh: the bytes at
        its start that hold the image now (memory.image set). Where neither works, or without an
        image: the bytes the caller must copy the image into, or 0 (memory.image None). Raises
        OSError when mapping failed (ImageFiles.map)."""
        if image is not None and ((memory.image is image
                                   and self._images.restore(memory.base, image))
                                  or self._images.map(memory.base, image)):
            memory.image = image
            return image_span(image)
        memory.image = None
        return 0 if image is None else len(image.data)

    # -------------------------------------------------------------------------- helpers
    def _unmap(self, memory: _Memory) -> None:
        """Give a memory's whole mapping (alignment, capacity and guard) back."""
        self._libc.munmap(memory.mapping, memory.num_mapped)

    def _charge(self, owner: MemoryOwner, num_bytes: int) -> bool:
        """Add num_bytes to the owner's total; False (and marked as hit) past its limit."""
        with self._lock:
            total = owner.num_memory_bytes + num_bytes
            if num_bytes > 0 and total > owner.memory_limit_bytes:
                owner.memory_limit_hit = True
                return False
            owner.num_memory_bytes = total
            return True

    def _protect(self, base: int, old_size: int, new_size: int) -> bool:
        """Make [0, new_size) of the memory read-write (it was so up to old_size)."""
        start = old_size // _OS_PAGE * _OS_PAGE
        end = -(-new_size // _OS_PAGE) * _OS_PAGE
        if end <= start:
            return True
        return self._libc.mprotect(base + start, end - start, _PROT_READ_WRITE) == 0
