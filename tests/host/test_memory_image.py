"""The memory image taken out of a component's data segments (host/sandbox/programs/memory_image.py):
which components are split and which are left alone, that a split component still compiles, and
that the host's memory creator copies the image into a new and into a reused memory."""
from __future__ import annotations

import ctypes
import gc
import threading
from dataclasses import dataclass

import pytest
import wasmtime
from wasmtime import Store
from wasmtime.component import Component, Linker

from host.sandbox.programs.compile_worker import make_engine
from host.sandbox.linear_memory import LinearMemories
from host.sandbox.programs.memory_image import MemoryImage, _u32_bytes, split_memory_image

WASM_PAGE = 64 << 10
TWO_SEGMENTS = '(module (memory 1) (data (i32.const 16) "hello") (data (i32.const 18) "XY"))'


def section(section_id: int, payload: bytes) -> bytes:
    return bytes([section_id]) + _u32_bytes(len(payload)) + payload


def component_of(wat: str, num_instantiations: int = 1) -> bytes:
    """A component of one core module (from `wat`, no imports), instantiated that often."""
    instances = _u32_bytes(num_instantiations) + b"\x00\x00\x00" * num_instantiations
    return (b"\0asm\x0d\x00\x01\x00" + section(1, wasmtime.wat2wasm(wat))
            + (section(2, instances) if num_instantiations else b""))


def test_a_split_component_compiles_and_its_image_holds_the_segments_in_order():
    component = component_of(TWO_SEGMENTS)
    split = split_memory_image(component)
    assert split is not None
    rewritten, image = split
    assert image.num_bytes == WASM_PAGE
    assert image.data == bytes(16) + b"heXYo"          # the later segment wins, as in Wasm
    assert len(rewritten) == len(component) - len(b"helloXY")
    Component(wasmtime.Engine(), rewritten)            # still a valid component


@pytest.mark.parametrize("wat, num_instantiations, why", [
    (TWO_SEGMENTS, 2, "instantiated twice: two memories"),
    (TWO_SEGMENTS, 0, "never instantiated"),
    ('(module (global i32 (i32.const 0)) (memory 1) (data (global.get 0) "x"))', 1,
     "an offset that is not a constant"),
    ('(module (memory 1) (data (i32.const 65535) "xy"))', 1,
     "past the initial size: instantiation traps, as before"),
    ('(module (memory 100) (data (i32.const 6000000) "x"))', 1, "an image mostly of zeros"),
    ('(module (memory 1) (memory 1) (data (i32.const 0) "x"))', 1, "two memories"),
    ('(module (memory i64 1) (data (i64.const 0) "x"))', 1, "a 64-bit memory"),
    ('(module (func))', 1, "no memory"),
])
def test_other_shapes_are_left_as_they_are(wat, num_instantiations, why):
    assert split_memory_image(component_of(wat, num_instantiations)) is None, why


def test_passive_segments_are_kept_whole():
    wat = ('(module (memory 1) (data "passive") (data (i32.const 8) "active")'
           ' (func (export "f") (memory.init 0 (i32.const 0) (i32.const 0) (i32.const 7))))')
    rewritten, image = split_memory_image(component_of(wat))
    assert image.data == bytes(8) + b"active"
    assert b"passive" in rewritten and b"active" not in rewritten.replace(b"passive", b"")
    Component(wasmtime.Engine(), rewritten)


def test_cut_or_garbled_bytes_are_left_alone_without_raising():
    component = component_of(TWO_SEGMENTS)
    for length in range(8, len(component), 7):
        assert split_memory_image(component[:length]) is None
    assert split_memory_image(b"\0asm\x0d\x00\x01\x00" + b"\xff" * 64) is None
    assert split_memory_image(b"") is None


@dataclass
class Program:
    memory_image: MemoryImage | None


@dataclass
class Owner:
    program: Program
    memory_limit_bytes: int = 64 << 20
    num_memory_bytes: int = 0
    memory_limit_hit: bool = False


def test_the_memory_creator_copies_the_image_into_new_and_reused_memories():
    wat = '(module (memory 3) (data (i32.const 16) "hello") (data (i32.const 70000) "world"))'
    rewritten, image = split_memory_image(component_of(wat))
    current = threading.local()
    current.instance = Owner(Program(image))
    memories = LinearMemories(current, pool_bytes=64 << 20)
    engine = make_engine(memories)
    component = Component(engine, rewritten)
    expected = image.data + bytes(3 * WASM_PAGE - len(image.data))
    for reused in (False, True):
        store = Store(engine)
        store.set_epoch_deadline(1_000_000)            # the engine interrupts on epochs
        Linker(engine).instantiate(store, component)
        (memory,) = memories._memories.values()
        assert ctypes.string_at(memory.base, 3 * WASM_PAGE) == expected, f"reused: {reused}"
        assert memories.pool.num_memories == 0
        ctypes.memset(memory.base, 0xAB, 3 * WASM_PAGE)  # the instance's own bytes, everywhere
        del memory, store
        gc.collect()
        assert memories.num_memories == 0 and memories.pool.num_memories == 1


def test_an_image_of_another_size_is_not_copied():
    _, image = split_memory_image(component_of(TWO_SEGMENTS))
    current = threading.local()
    current.instance = Owner(Program(image))
    memories = LinearMemories(current)
    engine = make_engine(memories)
    store = Store(engine)
    store.set_epoch_deadline(1_000_000)
    Linker(engine).instantiate(store, Component(engine, component_of('(module (memory 2))')))
    (memory,) = memories._memories.values()
    assert ctypes.string_at(memory.base, 2 * WASM_PAGE) == bytes(2 * WASM_PAGE)
