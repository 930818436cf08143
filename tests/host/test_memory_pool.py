"""The pool of ended instances' linear memories: what it keeps and gives back, and that a reused
memory shows the next instance nothing of the last one (zeros, its own data segments, and a trap
past its size: Wasmtime elides bounds checks and relies on the inaccessible pages)."""
from __future__ import annotations

import ctypes
import gc
import threading
import time
from dataclasses import dataclass

import pytest
from wasmtime import Instance, Module, Store, Trap, WasmtimeError

from host.runtime_config import RuntimeConfig
from host.sandbox.programs.compile_worker import make_engine
from host.sandbox.linear_memory import LinearMemories
from host.sandbox.memory_pool import MemoryPool
from tests.host.components import make_runtime, program_cache_dir  # noqa: F401
from tests.host.fake_engine import FakeEngine
from tests.host.test_linear_memory import smaps_entry

WASM_PAGE = 64 << 10


@dataclass
class FakeMemory:
    capacity: int
    num_mapped: int
    num_bytes: int


def test_the_pool_gives_back_a_memory_of_the_same_shape_newest_first():
    pool: MemoryPool[FakeMemory] = MemoryPool(max_total_bytes=100, max_memory_bytes=50)
    older, newer, other = FakeMemory(8, 9, 10), FakeMemory(8, 9, 20), FakeMemory(4, 9, 30)
    assert pool.put(older) and pool.put(newer) and pool.put(other)
    assert pool.num_bytes == 60 and pool.num_memories == 3
    assert pool.take(8, 9) is newer and pool.take(8, 9) is older and pool.take(8, 9) is None
    assert pool.take(4, 10) is None and pool.num_bytes == 30


def test_the_pool_refuses_a_memory_past_its_bounds():
    pool: MemoryPool[FakeMemory] = MemoryPool(max_total_bytes=100, max_memory_bytes=60)
    assert not pool.put(FakeMemory(8, 9, 61))             # too large on its own
    assert pool.put(FakeMemory(8, 9, 60))
    assert not pool.put(FakeMemory(8, 9, 41))             # past the total
    assert pool.put(FakeMemory(8, 9, 40)) and pool.num_bytes == 100


def test_idle_memories_and_a_closed_pool_give_everything_back():
    pool: MemoryPool[FakeMemory] = MemoryPool(max_total_bytes=100, idle_s=5.0)
    first, second = FakeMemory(8, 9, 10), FakeMemory(8, 9, 20)
    pool.put(first)
    pool.put(second)
    assert pool.take_idle(time.monotonic()) == []
    assert pool.take_idle(time.monotonic() + 6) == [first, second]    # oldest first
    assert pool.num_bytes == 0
    pool.put(first)
    assert pool.close() == [first] and not pool.put(second) and pool.num_memories == 0


def test_a_pool_needs_sane_bounds():
    with pytest.raises(ValueError, match="idle_s"):
        MemoryPool(max_total_bytes=1, idle_s=0)


def memory_base(store: Store, instance: Instance) -> tuple[int, object]:
    memory = instance.exports(store)["m"]
    return ctypes.cast(memory.data_ptr(store), ctypes.c_void_p).value, memory


WRITER = '(module (memory (export "m") 3))'
READER = '''(module (memory (export "m") 1) (data (i32.const 16) "hello")
  (func (export "load") (param i32) (result i32) (i32.load8_u (local.get 0)))
  (func (export "grow") (param i32) (result i32) (memory.grow (local.get 0))))'''


def test_a_reused_memory_is_zeroed_holds_its_own_data_and_traps_past_its_size():
    memories = LinearMemories(threading.local(), pool_bytes=64 << 20)
    engine = make_engine(memories)
    store = Store(engine)
    writer = Instance(store, Module(engine, WRITER), [])
    base, memory = memory_base(store, writer)
    ctypes.memset(base, 0xAB, 3 * WASM_PAGE)       # the last instance's bytes, everywhere
    del memory, writer, store
    gc.collect()
    assert memories.num_memories == 0 and memories.pool.num_memories == 1

    store = Store(engine)
    store.set_epoch_deadline(1_000_000)            # the engine interrupts on epochs
    reader = Instance(store, Module(engine, READER), [])
    reused_base, memory = memory_base(store, reader)
    assert reused_base == base and memories.pool.num_memories == 0
    data = ctypes.string_at(base, WASM_PAGE)
    assert data[16:21] == b"hello" and data[:16] == bytes(16) and data[21:] == bytes(WASM_PAGE - 21)
    load, grow = reader.exports(store)["load"], reader.exports(store)["grow"]
    with pytest.raises((Trap, WasmtimeError), match="out of bounds"):
        load(store, 2 * WASM_PAGE)                 # the last instance's third page: gone
    assert grow(store, 2) == 1                     # accessible again, and zero
    assert load(store, 2 * WASM_PAGE) == 0 and load(store, 3 * WASM_PAGE - 1) == 0
    del memory, reader, store, load, grow
    gc.collect()
    assert memories.pool.num_memories == 1


def test_idle_and_closed_pools_unmap_their_memories():
    memories = LinearMemories(threading.local(), pool_bytes=64 << 20)
    engine = make_engine(memories)
    bases = []
    for _ in range(2):
        stores = [Store(engine) for _ in range(2)]     # two at once: two memories
        for store in stores:
            bases.append(memory_base(store, Instance(store, Module(engine, WRITER), []))[0])
        del stores, store
        gc.collect()
    assert memories.pool.num_memories == 2 and len(set(bases)) == 2    # the 2nd pair reused
    memories.release_idle(time.monotonic() + 3600)
    assert memories.pool.num_memories == 0 and all(smaps_entry(b) == {} for b in bases)
    store = Store(engine)
    base = memory_base(store, Instance(store, Module(engine, WRITER), []))[0]
    memories.close_pool()
    del store
    gc.collect()
    assert memories.pool.num_memories == 0 and smaps_entry(base) == {}


def test_without_a_pool_an_ended_memory_is_unmapped():
    memories = LinearMemories(threading.local())
    engine = make_engine(memories)
    store = Store(engine)
    base = memory_base(store, Instance(store, Module(engine, WRITER), []))[0]
    del store
    gc.collect()
    assert memories.pool.num_memories == 0 and smaps_entry(base) == {}


def test_a_memory_whose_growth_failed_to_change_protection_is_not_pooled():
    """A failed mprotect may have left pages past the size accessible: such a memory is unmapped
    at its end, never handed to another instance."""
    memories = LinearMemories(threading.local(), pool_bytes=64 << 20)
    engine = make_engine(memories)
    store = Store(engine)
    store.set_epoch_deadline(1_000_000)
    reader = Instance(store, Module(engine, READER), [])
    base = memory_base(store, reader)[0]
    memories._protect = lambda *_args: False           # the next growth's mprotect fails
    assert reader.exports(store)["grow"](store, 1) == -1
    del reader, store
    gc.collect()
    assert memories.pool.num_memories == 0 and smaps_entry(base) == {}


def test_the_runtime_keeps_pooled_memories_for_memory_pool_idle_s(make_runtime):  # noqa: F811
    runtime = make_runtime(FakeEngine(), count_linear_memory=True, memory_pool_idle_s=42.0)
    assert runtime.linear_memories.pool.idle_s == 42.0
    assert RuntimeConfig().memory_pool_idle_s == 600.0      # bursts minutes apart stay warm
    for bad in (0, -1.0, 86_401):
        with pytest.raises(ValueError, match="memory_pool_idle_s"):
            RuntimeConfig(memory_pool_idle_s=bad)
