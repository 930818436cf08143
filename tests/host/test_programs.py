"""Programs: validation errors, and compile-once with the on-disk artifact cache."""
from __future__ import annotations

import hashlib
import re
import threading

import pytest

from host import ProgramError
from host.bindings import provided_items
from host.sandbox.programs import ProgramCache, make_engine
from tests.host.components import components  # noqa: F401


@pytest.fixture(scope="module")
def engine():
    return make_engine()


def new_store(engine, cache_dir) -> ProgramCache:
    return ProgramCache(engine, cache_dir, provided_items())


def test_load_validates_and_hashes(engine, tmp_path, components):  # noqa: F811
    wasm = components.component("generate")
    program = new_store(engine, tmp_path).load(wasm)
    assert program.hash == hashlib.sha256(wasm).hexdigest()
    assert program.num_bytes == len(wasm)


@pytest.mark.parametrize("wasm,phrase", [
    (b"", "not a WebAssembly binary"),
    (b"\x7fELF\x02\x01\x01\x00", "not a WebAssembly binary"),
    (b"\x00asm\x0d\x00\x01\x00\x07\x07garbage", "no export `run`"),   # read, not compiled
    (b"\x00asm\x0d\x00\x01\x00\x0b\x07garbage", "not a valid component"),  # a bad export
    (b"\x00asm\x0d\x00\x01\x00\x0b\x09\x01\x00\x03run\x01\x00\x00\x00", "not a valid component"),
])
def test_bad_bytes_name_the_reason(engine, tmp_path, wasm, phrase):
    store = new_store(engine, tmp_path)
    with pytest.raises(ProgramError, match=phrase):
        store.load(wasm)
    assert store.statistics().num_programs == 0
    assert not list(tmp_path.rglob("*.cwasm"))      # nothing cached for refused bytes


@pytest.mark.parametrize("guest,phrase", [
    ("no_run", "no export `run`"),
    ("run_string", "`run` must be `func() -> result<string, string>`"),
    ("foreign", "imports `pie:test/gadget@0.1.0`, which this host does not provide"),
])
def test_wrong_world_is_refused(engine, tmp_path, components, guest, phrase):  # noqa: F811
    with pytest.raises(ProgramError, match=re.escape(phrase)):
        new_store(engine, tmp_path).load(components.component(guest))
    assert not list(tmp_path.rglob("*.cwasm"))


def test_core_module_is_refused(engine, tmp_path, components):  # noqa: F811
    with pytest.raises(ProgramError, match="core WebAssembly module, not a component"):
        new_store(engine, tmp_path).load(components.core_module("generate"))


def test_an_interface_function_the_host_lacks_is_refused(engine, tmp_path, components):  # noqa: F811
    provided = provided_items()
    provided["pie:inferlet/kv@0.1.0"] -= {"mask-tokens"}
    store = ProgramCache(engine, tmp_path, provided)
    with pytest.raises(ProgramError, match=r"kv@0.1.0\.mask-tokens"):
        store.load(components.component("generate"))


def test_second_load_does_not_compile(engine, tmp_path, components):  # noqa: F811
    wasm = components.component("generate")
    first = new_store(engine, tmp_path)
    program = first.load(wasm)
    assert first.load(wasm) is program                    # in-process memo
    assert first.get(program.hash) is program
    stats = first.statistics()
    assert (stats.num_compiles, stats.num_disk_loads, stats.num_memory_hits) == (1, 0, 1)
    artifacts = list((tmp_path / "components").glob(f"{program.hash}-*.cwasm"))
    assert len(artifacts) == 1

    second = new_store(engine, tmp_path)                  # a new process, in effect
    assert second.load(wasm).hash == program.hash
    stats = second.statistics()
    assert (stats.num_compiles, stats.num_disk_loads) == (0, 1)


def test_corrupt_artifact_is_recompiled(engine, tmp_path, components):  # noqa: F811
    wasm = components.component("info")
    program = new_store(engine, tmp_path).load(wasm)
    (artifact,) = (tmp_path / "components").glob(f"{program.hash}-*.cwasm")
    artifact.write_bytes(b"not an artifact")
    again = new_store(engine, tmp_path)
    again.load(wasm)
    assert again.statistics().num_compiles == 1
    assert artifact.read_bytes() != b"not an artifact"


def test_concurrent_loads_compile_once(engine, tmp_path, components):  # noqa: F811
    wasm = components.component("echo")
    store = new_store(engine, tmp_path)
    hashes = []
    threads = [threading.Thread(target=lambda: hashes.append(store.load(wasm).hash))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(hashes)) == 1 and len(hashes) == 8
    assert store.statistics().num_compiles == 1


def test_unknown_hash_is_a_clear_error(engine, tmp_path):
    with pytest.raises(ProgramError, match="unknown program 'abc'"):
        new_store(engine, tmp_path).get("abc")


def test_without_cache_dir_compiles_in_memory_only(engine, components):  # noqa: F811
    store = ProgramCache(engine, None, provided_items())
    wasm = components.component("info")
    assert store.load(wasm) is store.load(wasm)
    assert store.statistics().num_compiles == 1


def test_foreign_import_is_refused_without_compiling_and_remembered(engine, tmp_path,  # noqa: F811
                                                                     components):  # noqa: F811
    """The import section is read from the bytes: no compilation, and the second load of the
    same bytes is answered from the remembered refusal."""
    store = new_store(engine, tmp_path)
    wasm = components.component("foreign")
    for _ in range(2):
        with pytest.raises(ProgramError, match=re.escape("pie:test/gadget@0.1.0")):
            store.load(wasm)
    stats = store.statistics()
    assert (stats.num_compiles, stats.num_refusals, stats.num_programs) == (0, 2, 0)


def test_compile_is_bounded_in_time(engine, tmp_path, components):  # noqa: F811
    store = ProgramCache(engine, tmp_path, provided_items(), compile_timeout_s=0.001)
    with pytest.raises(ProgramError, match=r"compilation took longer than the limit of 0.001 s "
                                           r"\(compile_timeout_s\)"):
        store.load(components.component("generate"))
    assert store.statistics().num_compiles == 0


def test_compile_is_bounded_in_memory(engine, tmp_path, components):  # noqa: F811
    """The child's address space is capped (24 MiB: less than Python and the compiler need; a
    componentize-py component needs ~450 MiB); the parent refuses, naming the bound."""
    store = ProgramCache(engine, tmp_path, provided_items(), compile_memory_mb=24)
    with pytest.raises(ProgramError, match=r"24 MiB \(compile_memory_mb\)"):
        store.load(components.component("generate"))
