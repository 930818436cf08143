"""LinearMemories, the host's counted linear memories: where their reservations start, the huge
pages they ask for (the copy of a guest's heap image at instantiation faults in 2 MiB at a time),
and that the whole mapping goes when the memory does."""
from __future__ import annotations

import ctypes
import gc
import threading
from pathlib import Path

from wasmtime import Instance, Module, Store

from host.sandbox.programs.compile_worker import make_engine
from host.sandbox.linear_memory import LinearMemories

HUGE_PAGE = 2 << 20
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def smaps_entry(base: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that starts at `base` ({} when none does)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{base:x}":
            fields = {}
            for field in lines[i + 1:]:
                name, sep, value = field.partition(":")
                if not sep or "-" in name:
                    break
                fields[name] = value.strip()
                if name == "VmFlags":
                    break
            return fields
    return {}


def test_a_counted_memory_starts_on_a_huge_page_boundary_and_asks_for_huge_pages():
    memories = LinearMemories(threading.local())
    engine = make_engine(memories)
    store = Store(engine)
    instance = Instance(store, Module(engine, '(module (memory (export "m") 200))'), [])
    memory = instance.exports(store)["m"]          # 200 x 64 KiB = 12.5 MiB
    base = ctypes.cast(memory.data_ptr(store), ctypes.c_void_p).value
    assert memories.num_memories == 1 and memory.data_len(store) == 200 << 16
    assert base % HUGE_PAGE == 0
    entry = smaps_entry(base)
    if THP_ENABLED.exists():                       # a kernel with transparent huge pages
        assert "hg" in entry["VmFlags"].split()
    ctypes.memset(base, 7, memory.data_len(store))
    assert ctypes.string_at(base + (200 << 16) - 4, 4) == b"\x07" * 4
    if THP_ENABLED.exists() and "[never]" not in THP_ENABLED.read_text():
        huge_kb = int(smaps_entry(base)["AnonHugePages"].split()[0])
        assert 0 < huge_kb <= 12 << 10             # whole 2 MiB ranges only: 6 of them at most
    del memory, instance, store
    gc.collect()
    assert memories.num_memories == 0 and smaps_entry(base) == {}
