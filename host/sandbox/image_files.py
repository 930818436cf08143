"""A program's heap image as a sealed in-memory file, mapped copy-on-write into its memories.

Copying a componentize-py guest's heap image (13 MB for the built-in) into each new linear
memory writes every page of it; on a VM whose free pages go back to the hypervisor (a balloon
with free page reporting) each of those pages must first come back, and a burst of cold starts
spends hundreds of milliseconds there. So `ImageFiles` writes each image once into a memfd
(sized to whole 4 KiB pages, the tail zeros; sealed: it never changes again) and `map` maps it
`MAP_PRIVATE | MAP_FIXED` over the start of a memory: creating the memory costs a mapping, the
guest's reads share the file's pages, and only the pages it writes become its own (a private
copy-on-write copy, that no other mapping sees). The file and a read-only mapping of it (the
source `restore` copies from) live as long as the MemoryImage; the page map's descriptor as long
as the ImageFiles (never closed under a `restore` reading it).

`restore` turns such a memory back into the image for its next instance (host/sandbox/
memory_pool.py): it reads the memory's page map (/proc/self/pagemap) and copies the image over
exactly the pages that are no longer the file's (written, or swapped out), keeping them resident
for the next guest, which writes mostly the same ones; a page the last instance did not write is
the file's and holds the image already. The same reading at a memory's end (`note_written`)
tells a fresh memory of the image which pages its guest will likely write (`last_written`:
host/sandbox/linear_memory.py faults them in ahead for a spare). It is used only where a self-test at construction found
the page map telling a written private page from a read one; elsewhere (no page map, hidden
flags) `restore` answers False and the caller maps the image afresh.

Host memory, charged to no instance: one image's pages per program (shared by all its memories),
the instances' written pages being charged as their memories' bytes are. Thread-safe.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import re
import threading
import weakref
from typing import Any

from host.sandbox.programs.memory_image import MemoryImage

__all__ = ["ImageFiles"]

_OS_PAGE = 4096
_PROT_READ, _PROT_READ_WRITE = 1, 3
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
_MAP_FAILED = ctypes.c_void_p(-1).value
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
_PAGEMAP = "/proc/self/pagemap"
# A /proc/self/pagemap entry is 64 bits, little-endian; its top byte holds "present" (bit 63),
# "swapped" (62) and "file page or shared" (61). A page is written (no longer the file's) when
# it is swapped out, or present and not the file's; 1 in this table for such a top byte.
_PRESENT, _SWAPPED, _FILE = 0x80, 0x40, 0x20
_WRITTEN = bytes(int(bool(top & _SWAPPED or (top & _PRESENT and not top & _FILE)))
                 for top in range(256))
_WRITTEN_RUN = re.compile(b"\x01+")


class _ImageFile:
    """One image's memfd and a read-only shared mapping of it."""

    __slots__ = ("fd", "source", "num_bytes")

    def __init__(self, fd: int, source: int, num_bytes: int) -> None:
        self.fd = fd                  # the sealed memfd: the image, then zeros to a whole page
        self.source = source          # its read-only mapping: what restore copies from
        self.num_bytes = num_bytes    # the file's size: the image rounded up to a whole page


def image_span(image: MemoryImage) -> int:
    """The bytes at the start of a memory that an image's file covers: its data, rounded up to a
    whole OS page (within the memory's size, a whole number of 64 KiB pages)."""
    return -(-len(image.data) // _OS_PAGE) * _OS_PAGE


class ImageFiles:
    """The image files of one runtime's programs (made on first use), and the page map that
    tells which pages of a mapped image a guest wrote."""

    def __init__(self, libc: Any) -> None:
        self._libc = libc
        self._lock = threading.Lock()
        self._files: weakref.WeakKeyDictionary[MemoryImage, _ImageFile] = \
            weakref.WeakKeyDictionary()
        # per image: the runs of pages the last memory that ended with it had written
        self._written: weakref.WeakKeyDictionary[MemoryImage, list[tuple[int, int]]] = \
            weakref.WeakKeyDictionary()
        self._pagemap_fd = _open_pagemap()     # open as long as this object: never reused
        if self._pagemap_fd is not None and not self._pagemap_tells_written_pages():
            os.close(self._pagemap_fd)
            self._pagemap_fd = None
        if self._pagemap_fd is not None:
            weakref.finalize(self, os.close, self._pagemap_fd)

    @property
    def reads_written_pages(self) -> bool:
        """Whether `restore` can work (the page map passed its self-test)."""
        return self._pagemap_fd is not None

    def map(self, base: int, image: MemoryImage) -> bool:
        """Map `image`'s file copy-on-write over [base, base + image_span(image)) (that range
        becomes read-write, whatever it held is dropped). False, nothing changed, when no file
        could be made for it (the caller copies the image in). Raises OSError when the mapping
        failed: the range may then be unmapped (the caller gives the whole memory up)."""
        image_file = self._file(image)
        if image_file is None:
            return False
        got = self._libc.mmap(base, image_file.num_bytes, _PROT_READ_WRITE,
                              _MAP_PRIVATE | _MAP_FIXED, image_file.fd, 0)
        if got != base:
            raise OSError(ctypes.get_errno(), f"mapping a heap image of {image_file.num_bytes} "
                          f"bytes failed: {os.strerror(ctypes.get_errno())}")
        return True

    def restore(self, base: int, image: MemoryImage) -> bool:
        """Make [base, base + image_span(image)), mapped by `map` from this image's file and
        written since, hold the image again: the pages written (no longer the file's) get the
        image's bytes back, the others are the file's already. False, nothing changed, where the
        page map cannot tell (the caller maps afresh)."""
        image_file = self._file(image)
        fd = self._pagemap_fd
        if image_file is None or fd is None:
            return False
        num_pages = image_file.num_bytes // _OS_PAGE
        try:
            entries = _read_entries(fd, base, num_pages)
        except OSError:
            return False
        for first, count in written_runs(entries):
            offset = first * _OS_PAGE
            ctypes.memmove(base + offset, image_file.source + offset, count * _OS_PAGE)
        return True

    def note_written(self, base: int, image: MemoryImage, num_bytes: int) -> None:
        """Record which of the first `num_bytes` of a memory mapped by `map` from `image` are
        no longer the file's (written: private copies, or zero pages touched past the image),
        as `image`'s last written pages (`last_written`). Nothing where the page map cannot
        tell."""
        fd = self._pagemap_fd
        if fd is None:
            return
        try:
            runs = written_runs(_read_entries(fd, base, -(-num_bytes // _OS_PAGE)))
        except OSError:
            return
        with self._lock:
            self._written[image] = runs

    def last_written(self, image: MemoryImage) -> list[tuple[int, int]]:
        """(first page, number of pages) of each run the last memory of `image` to end had
        written (`note_written`); [] when none has."""
        with self._lock:
            return self._written.get(image, [])

    def _file(self, image: MemoryImage) -> _ImageFile | None:
        """The image's file, made on first use; None when the OS refuses one."""
        with self._lock:
            image_file = self._files.get(image)
            if image_file is None:
                image_file = self._make(image)
                if image_file is not None:
                    self._files[image] = image_file
                    weakref.finalize(image, _close, self._libc, image_file)
            return image_file

    def _make(self, image: MemoryImage) -> _ImageFile | None:
        num_bytes = image_span(image)
        if num_bytes == 0:
            return None
        try:
            fd = os.memfd_create("pie-image", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError:
            return None
        try:
            os.ftruncate(fd, num_bytes)
            view = memoryview(image.data)
            written = 0
            while written < len(view):
                written += os.pwrite(fd, view[written:], written)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        except OSError:
            os.close(fd)
            return None
        source = self._libc.mmap(None, num_bytes, _PROT_READ, _MAP_SHARED, fd, 0)
        if source in (None, _MAP_FAILED):
            os.close(fd)
            return None
        return _ImageFile(fd, source, num_bytes)

    def _pagemap_tells_written_pages(self) -> bool:
        """Map a two-page file privately, read one page and write the other: the page map must
        show the read one as the file's and the written one as present and not the file's."""
        try:
            fd = os.memfd_create("pie-pagemap-test", os.MFD_CLOEXEC)
        except OSError:
            return False
        try:
            os.ftruncate(fd, 2 * _OS_PAGE)
            base = self._libc.mmap(None, 2 * _OS_PAGE, _PROT_READ_WRITE, _MAP_PRIVATE, fd, 0)
            if base in (None, _MAP_FAILED):
                return False
            try:
                ctypes.string_at(base, 1)
                ctypes.memset(base + _OS_PAGE, 1, 1)
                entries = _read_entries(self._pagemap_fd, base, 2)
            finally:
                self._libc.munmap(base, 2 * _OS_PAGE)
        except OSError:
            return False
        finally:
            os.close(fd)
        read, written = entries[7], entries[15]          # the two entries' top bytes
        return bool(read & _PRESENT and read & _FILE and written_runs(entries) == [(1, 1)])


def _open_pagemap() -> int | None:
    try:
        return os.open(_PAGEMAP, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _read_entries(fd: int, base: int, num_pages: int) -> bytes:
    """The page map's 8-byte entries of num_pages pages from `base`. Raises OSError."""
    num_bytes = num_pages * 8
    data = os.pread(fd, num_bytes, base // _OS_PAGE * 8)
    if len(data) != num_bytes:
        raise OSError(f"{_PAGEMAP}: read {len(data)} of {num_bytes} bytes")
    return data


def written_runs(entries: bytes) -> list[tuple[int, int]]:
    """(first page, number of pages) of each run of pages that are not the file's, from their
    page map entries: present and not the file's (a private copy), or swapped out. A page not
    present and not swapped (not touched since it was mapped: its first access maps the file's;
    its entry may still carry the soft-dirty bit) or present from the file is the file's."""
    flags = entries[7::8].translate(_WRITTEN)
    return [(run.start(), run.end() - run.start()) for run in _WRITTEN_RUN.finditer(flags)]


def _close(libc: Any, image_file: _ImageFile) -> None:
    libc.munmap(image_file.source, image_file.num_bytes)
    os.close(image_file.fd)
