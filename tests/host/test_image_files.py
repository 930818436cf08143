"""A program's heap image mapped copy-on-write into its linear memories (host/sandbox/
image_files.py, host/sandbox/linear_memory.py): a new memory holds the image without a copy, an
instance's writes are its own (never seen by another memory, the next instance or the image),
a reused memory gets the image back in exactly the pages written, the charge is the memory's
accessible size, and where the page map or a file is missing the image is mapped or copied."""
from __future__ import annotations

import array
import ctypes
import gc
import os
import threading
from pathlib import Path

import pytest
from wasmtime import Store, WasmtimeError
from wasmtime.component import Component, Linker

from host.sandbox import image_files
from host.sandbox.image_files import ImageFiles, image_span, written_runs
from host.sandbox.linear_memory import LinearMemories, _libc
from host.sandbox.programs.compile_worker import make_engine
from host.sandbox.programs.memory_image import MemoryImage, split_memory_image
from tests.host.test_memory_image import Owner, Program, component_of

WASM_PAGE = 64 << 10
OS_PAGE = 4096
NUM_PAGES = 40                   # the memory: 40 x 64 KiB
# An image of ~35 OS pages, its last one partly past the data (the file's zeros).
WAT = ('(module (memory 40) (data (i32.const 16) "hello") (data (i32.const 70000) "world")'
       ' (data (i32.const 143000) "end"))')


def mapping_of(base: int) -> tuple[str, dict[str, str]]:
    """(the header line, the fields) of the /proc/self/smaps mapping that starts at `base`."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{base:x}":
            fields = {}
            for field in lines[i + 1:]:
                name, sep, value = field.partition(":")
                if not sep or "-" in name:
                    break
                fields[name] = value.strip()
            return line, fields
    return "", {}


def private_kb(base: int) -> int:
    """KiB of the mapping at `base` that are private copies (written since it was mapped)."""
    return int(mapping_of(base)[1]["Anonymous"].split()[0])


class Setup:
    """A memory creator whose instances all have `owner`, and the component of WAT split."""

    def __init__(self, pool_bytes: int = 64 << 20) -> None:
        self.rewritten, self.image = split_memory_image(component_of(WAT))
        self.owner = Owner(Program(self.image))
        self.current = threading.local()
        self.current.instance = self.owner
        self.memories = LinearMemories(self.current, pool_bytes=pool_bytes)
        self.engine = make_engine(self.memories)
        self.component = Component(self.engine, self.rewritten)
        self.expected = self.image.data + bytes(NUM_PAGES * WASM_PAGE - len(self.image.data))

    def instantiate(self) -> tuple[Store, int]:
        """A new instance: its Store (keep it alive) and the base of its memory."""
        before = set(self.memories._memories)
        store = Store(self.engine)
        store.set_epoch_deadline(1_000_000)            # the engine interrupts on epochs
        Linker(self.engine).instantiate(store, self.component)
        (key,) = set(self.memories._memories) - before
        return store, self.memories._memories[key].base

    def contents(self, base: int) -> bytes:
        return ctypes.string_at(base, NUM_PAGES * WASM_PAGE)


def written_pages(base: int, span: int) -> list[int]:
    """Write one byte into some pages of the image (the first, the partial last one) and past
    it; the OS pages of the image written."""
    offsets = [0, 5 * OS_PAGE + 17, span - 1, span + 3, NUM_PAGES * WASM_PAGE - 1]
    for offset in offsets:
        ctypes.memset(base + offset, 0xAB, 1)
    return sorted({offset // OS_PAGE for offset in offsets if offset < span})


def test_a_new_memory_maps_the_image_and_its_writes_are_its_own():
    setup = Setup()
    span = image_span(setup.image)
    store_a, base_a = setup.instantiate()
    store_b, base_b = setup.instantiate()
    header, _ = mapping_of(base_a)
    assert "pie-image" in header and private_kb(base_a) == 0      # mapped, nothing copied
    assert setup.contents(base_a) == setup.expected == setup.contents(base_b)
    assert setup.owner.num_memory_bytes == 2 * NUM_PAGES * WASM_PAGE   # the accessible bytes
    pages = written_pages(base_a, span)
    assert private_kb(base_a) == 4 * len(pages)                  # only those became its own
    assert setup.contents(base_b) == setup.expected              # the other memory: untouched
    image_file = setup.memories._images._file(setup.image)
    assert ctypes.string_at(image_file.source, span) == setup.expected[:span]   # the image too
    del store_a, store_b
    gc.collect()
    assert setup.owner.num_memory_bytes == 0 and setup.memories.pool.num_memories == 2


def test_a_reused_memory_gets_the_image_back_in_the_pages_written():
    setup = Setup()
    span = image_span(setup.image)
    assert setup.memories._images.reads_written_pages == os.path.exists("/proc/self/pagemap")
    store, base = setup.instantiate()
    pages = written_pages(base, span)
    del store
    gc.collect()
    store, reused_base = setup.instantiate()
    assert reused_base == base and setup.contents(base) == setup.expected
    assert setup.owner.num_memory_bytes == NUM_PAGES * WASM_PAGE
    if setup.memories._images.reads_written_pages:   # restored in place: kept, still its own
        assert private_kb(base) == 4 * len(pages)
    ctypes.memset(base + span - 1, 0xCD, 1)             # the next instance writes again
    del store
    gc.collect()
    store, base = setup.instantiate()
    assert setup.contents(base) == setup.expected


def test_without_a_page_map_a_reused_memory_maps_the_image_afresh(monkeypatch):
    monkeypatch.setattr(image_files, "_open_pagemap", lambda: None)
    setup = Setup()
    assert not setup.memories._images.reads_written_pages
    store, base = setup.instantiate()
    written_pages(base, image_span(setup.image))
    del store
    gc.collect()
    store, reused_base = setup.instantiate()
    assert reused_base == base and setup.contents(base) == setup.expected
    assert private_kb(base) == 0                         # the written pages dropped


def test_a_page_map_that_hides_its_flags_is_not_used(monkeypatch):
    monkeypatch.setattr(image_files, "_read_entries",
                        lambda _fd, _base, num_pages: bytes(8 * num_pages))
    assert not ImageFiles(_libc()).reads_written_pages


def test_where_no_file_can_be_made_the_image_is_copied(monkeypatch):
    def refuse(*_args):
        raise OSError("no memfd here")
    monkeypatch.setattr(os, "memfd_create", refuse)
    setup = Setup()
    store, base = setup.instantiate()
    assert "pie-image" not in mapping_of(base)[0] and setup.contents(base) == setup.expected
    ctypes.memset(base, 0xAB, NUM_PAGES * WASM_PAGE)
    del store
    gc.collect()
    store, base = setup.instantiate()
    assert setup.contents(base) == setup.expected


def test_a_memory_of_one_image_reused_for_another_or_for_none():
    setup = Setup()
    store, base = setup.instantiate()
    written_pages(base, image_span(setup.image))
    del store
    gc.collect()
    other = MemoryImage(NUM_PAGES * WASM_PAGE, b"\x07" * 5000)
    setup.owner.program = Program(other)
    store, reused_base = setup.instantiate()
    assert reused_base == base
    assert setup.contents(base) == other.data + bytes(NUM_PAGES * WASM_PAGE - 5000)
    ctypes.memset(base + 100, 0xAB, 1)
    del store
    gc.collect()
    setup.owner.program = Program(None)
    store, reused_base = setup.instantiate()
    assert reused_base == base and setup.contents(base) == bytes(NUM_PAGES * WASM_PAGE)


def test_a_failed_mapping_gives_the_memory_up_and_its_charge_back():
    setup = Setup()
    store, base = setup.instantiate()
    del store
    gc.collect()

    def fail(_base, _image):
        raise OSError("mmap failed")
    setup.memories._images.restore = lambda _base, _image: False
    setup.memories._images.map = fail
    with pytest.raises(WasmtimeError, match="cannot reserve a linear memory"):
        setup.instantiate()                  # the pooled memory, then a fresh one: both fail
    assert mapping_of(base) == ("", {}) and setup.memories.pool.num_memories == 0
    assert setup.owner.num_memory_bytes == 0 and setup.memories.num_memories == 0


def test_the_image_file_is_sealed_and_closed_with_its_image():
    files = ImageFiles(_libc())
    image = MemoryImage(WASM_PAGE, b"abc" * 2000)
    image_file = files._file(image)
    assert image_file.num_bytes == 2 * OS_PAGE and os.fstat(image_file.fd).st_size == 2 * OS_PAGE
    with pytest.raises(OSError):
        os.pwrite(image_file.fd, b"x", 0)                # F_SEAL_WRITE
    fd = image_file.fd
    del image, image_file
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)                                     # closed with its image


def test_the_page_map_stays_open_as_long_as_its_image_files():
    files = ImageFiles(_libc())
    fd = files._pagemap_fd
    assert (fd is not None) == os.path.exists("/proc/self/pagemap")
    del files
    gc.collect()
    if fd is not None:
        with pytest.raises(OSError):
            os.fstat(fd)


@pytest.mark.parametrize("entries, runs", [
    ([0, 0, 0], []),
    ([1 << 55, (1 << 63) | (1 << 61), 0], []),          # soft-dirty hole, a page of the file
    ([(1 << 63) | 5, (1 << 63) | 6, 0, 1 << 62], [(0, 2), (3, 1)]),   # private, swapped out
    ([0, (1 << 63) | (1 << 56) | 9], [(1, 1)]),
])
def test_written_runs_are_the_pages_that_are_not_the_files(entries, runs):
    assert written_runs(array.array("Q", entries).tobytes()) == runs


def written_page_set(base: int) -> set[int]:
    """The OS pages of the memory at `base` that are no longer the image file's (page map)."""
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        entries = image_files._read_entries(fd, base, NUM_PAGES * WASM_PAGE // OS_PAGE)
    finally:
        os.close(fd)
    return {first + i for first, count in written_runs(entries) for i in range(count)}


def test_warm_faults_in_what_the_last_memory_of_the_image_wrote():
    """A fresh memory (no pool) of an image whose last memory wrote some pages: `warm` makes
    those pages its own ahead, image and past it, and changes none of its bytes."""
    setup = Setup(pool_bytes=0)
    assert setup.memories._images.reads_written_pages       # Linux with /proc/self/pagemap
    span = image_span(setup.image)
    store, base = setup.instantiate()
    written_pages(base, span)
    expected_pages = written_page_set(base)
    assert len(expected_pages) == 5                       # 3 in the image, 2 past it
    del store
    gc.collect()
    store, base = setup.instantiate()
    assert written_page_set(base) == set() and private_kb(base) == 0
    setup.memories.warm(setup.owner)
    assert written_page_set(base) == expected_pages
    assert private_kb(base) == 4 * len([p for p in expected_pages if p * OS_PAGE < span])
    assert setup.contents(base) == setup.expected
    assert setup.owner.num_memory_bytes == NUM_PAGES * WASM_PAGE   # charged as before
