"""host/sandbox/wasm/fast_calls.py: cached converters are the program's own, and frozen types convert
like wasmtime-py's."""
from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
from wasmtime import _ffi as ffi
from wasmtime.component import Record, Variant
from wasmtime.component._types import F32, U8, U32, U64, EnumType, String

from host.sandbox.wasm.fast_calls import (_FrozenList, _FrozenOption, _FrozenRecord, _FrozenResult,
                                      _FrozenVariant)
from tests.host.components import (_run, _wasm_tools, components,  # noqa: F401
                                   make_runtime, program_cache_dir)
from tests.host.fake_engine import FakeEngine

# `runtime.log` imported as func(u32) -> u32 instead of func(string): Wasmtime links it anyway
# and calls the host with the guest's own signature.
MISMATCHED_WIT = """package pie:inferlet@0.1.0;
interface runtime {
    log: func(message: u32) -> u32;
}
world inferlet {
    import runtime;
    export run: func() -> result<string, string>;
}
"""
MISMATCHED_WAT = """(module
  (import "pie:inferlet/runtime@0.1.0" "log" (func $log (param i32) (result i32)))
  (memory (export "memory") 1)
  (global $bump (mut i32) (i32.const 4096))
  (func (export "cabi_realloc") (param i32 i32 i32 i32) (result i32)
    (local $p i32)
    (local.set $p (global.get $bump))
    (global.set $bump (i32.add (global.get $bump) (local.get 3)))
    (local.get $p))
  (data (i32.const 1024) "ok")
  (func (export "run") (result i32)
    (drop (call $log (i32.const 7)))
    (i32.store (i32.const 2000) (i32.const 0))
    (i32.store (i32.const 2004) (i32.const 1024))
    (i32.store (i32.const 2008) (i32.const 2))
    (i32.const 2000)))
"""


def build_mismatched(tmp: Path) -> bytes:
    (tmp / "wit").mkdir()
    (tmp / "wit" / "world.wit").write_text(MISMATCHED_WIT)
    (tmp / "guest.wat").write_text(MISMATCHED_WAT)
    tool = _wasm_tools()
    _run([tool, "parse", str(tmp / "guest.wat"), "-o", str(tmp / "core.wasm")])
    _run([tool, "component", "embed", str(tmp / "wit"), str(tmp / "core.wasm"), "--world",
          "inferlet", "-o", str(tmp / "embedded.wasm")])
    return _run([tool, "component", "new", str(tmp / "embedded.wasm"), "-o", "/dev/stdout"])


def test_each_program_is_called_with_its_own_signature(components, make_runtime,  # noqa: F811
                                                      tmp_path):
    """The string-taking `log` of a proper guest, before and after a guest that imports `log`
    as u32 -> u32: each gets converters of its own import (no cross-program cache hit)."""
    runtime = make_runtime(FakeEngine())
    proper = runtime.load_program(components.component("info"))
    mismatched = runtime.load_program(build_mismatched(tmp_path))
    outcomes = [runtime.wait(runtime.launch(program), timeout=10)
                for program in (proper, mismatched, proper)]
    assert outcomes[0].status == outcomes[2].status == "ok"
    assert outcomes[1].status == "trap"
    assert outcomes[1].value.startswith("runtime.log: host error: TypeError(")


def round_trip(ty, value):
    raw = ffi.wasmtime_component_val_t()
    ty.convert_to_c(None, value, ctypes.pointer(raw))
    return ty.convert_from_c(raw)


U32_LIST = _FrozenList(U32())
OUTPUT = _FrozenVariant([("token", U32()),
                         ("distribution", _FrozenRecord([("token-ids", U32_LIST),
                                                         ("probs", _FrozenList(F32()))]))])


def distribution(token_ids: list[int], probs: list[float]) -> Record:
    record = Record()
    setattr(record, "token-ids", token_ids)
    record.probs = probs
    return record


def sampler(seed: int | None) -> Record:
    record = Record()
    for name, value in (("kind", "sample"), ("temperature", 0.5), ("top-k", 40), ("top-p", 1.0),
                        ("min-p", 0.0), ("seed", seed), ("num-top", 0)):
        setattr(record, name, value)
    return record


ENUM = EnumType.__new__(EnumType)     # an enum's conversion asks its type nothing
SAMPLER = _FrozenRecord([("kind", ENUM),
                         ("temperature", F32()), ("top-k", U32()), ("top-p", F32()),
                         ("min-p", F32()), ("seed", _FrozenOption(U64())), ("num-top", U32())])


@pytest.mark.parametrize("ty, value", [
    (U32_LIST, [1, 2, 3]),
    (U32_LIST, []),
    (_FrozenList(String()), ["a", "bc", ""]),
    (_FrozenList(U8()), b"bytes"),
    (_FrozenList(_FrozenList(U32())), [[1], [], [2, 3]]),
    (_FrozenList(SAMPLER), [sampler(7), sampler(None)]),
    (_FrozenOption(U32_LIST), None),
    (_FrozenOption(U32_LIST), [4, 5]),
    (_FrozenResult(_FrozenList(OUTPUT), String()), [7, distribution([1, 2], [0.5, 0.25])]),
    (_FrozenResult(_FrozenList(OUTPUT), String()), "engine failed"),
    (_FrozenResult(None, String()), None),
    (_FrozenResult(String(), String()), Variant("err", "tagged")),
])
def test_frozen_types_round_trip(ty, value):
    """forward-future.get's result<list<output>, string> and friends: lowered and lifted back
    through the frozen converters, the value is unchanged (untagged / tagged as wasmtime-py)."""
    assert round_trip(ty, value) == value


def test_frozen_types_refuse_what_wasmtime_py_refuses():
    with pytest.raises(TypeError, match="expected Variant type"):
        round_trip(_FrozenResult(String(), String()), "bare")
    with pytest.raises(ValueError, match="not valid for this variant"):
        round_trip(_FrozenResult(U32_LIST, String()), 3)
    with pytest.raises(TypeError, match="expected list value"):
        round_trip(U32_LIST, (1, 2))


def test_value_helpers_keep_the_gil_and_calls_into_wasm_release_it(make_runtime):  # noqa: F811
    from wasmtime import _bindings

    from host.sandbox.wasm.gil_calls import GIL_KEEPING_FUNCTIONS, keeps_gil

    make_runtime(FakeEngine())          # building the linker installs it
    assert all(keeps_gil(getattr(_bindings, f"_{name}")) for name in GIL_KEEPING_FUNCTIONS)
    for name in ("wasmtime_component_func_call", "wasmtime_component_linker_instantiate",
                 "wasmtime_component_resource_any_drop", "wasmtime_component_list_type_element"):
        assert not keeps_gil(getattr(_bindings, f"_{name}")), name
