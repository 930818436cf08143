"""The C converter of host-call values (host/sandbox/wasm/wit_values.c) against wasmtime-py's own.

Values are built in libwasmtime's C representation by wasmtime-py's converters (through the
host's frozen types) and lifted by the C codec, and lowered by the C codec and lifted back by
wasmtime-py: both directions must give the Python value they started from.
"""
from __future__ import annotations

import ctypes

import pytest
from wasmtime import _ffi as ffi
from wasmtime.component._types import F32, S64, U32, U64, Record, String, Variant

from host.sandbox.wasm.fast_calls import _FrozenList, _FrozenOption, _FrozenRecord, _FrozenResult, \
    _FrozenVariant
from host.sandbox.wasm import fast_calls
from host.sandbox.wasm.wit_codec import HostResource, descriptor, layout_matches, load_codec
from tests.host.components import components, make_runtime, program_cache_dir  # noqa: F401
from tests.host.fake_engine import FakeEngine

CODEC = load_codec()
pytestmark = pytest.mark.skipif(CODEC is None, reason="host.sandbox.wasm._wit_values is not built")


def _record(**fields) -> Record:
    record = Record()
    for name, value in fields.items():
        setattr(record, name.replace("_", "-"), value)
    return record


DISTRIBUTION = _FrozenRecord([("token-ids", _FrozenList(U32())), ("probs", _FrozenList(F32()))])
OUTPUT = _FrozenVariant([("token", U32()), ("distribution", DISTRIBUTION)])
CASES = [
    (_FrozenList(U32()), [0, 1, 2**32 - 1]),
    (_FrozenList(U32()), []),
    (_FrozenRecord([("a", U32()), ("b", F32()), ("c", String()), ("d", _FrozenOption(U64())),
                    ("e", S64())]),
     _record(a=7, b=0.5, c="héllo ✓", d=2**64 - 1, e=-(2**63))),
    (_FrozenRecord([("d", _FrozenOption(U64()))]), _record(d=None)),
    (_FrozenResult(_FrozenList(OUTPUT), String()),
     [97, _record(token_ids=[3, 4], probs=[0.25, 0.75])]),     # untagged: int / Record cases
    (_FrozenResult(_FrozenList(OUTPUT), String()), "engine failed the batch: boom"),
    (_FrozenOption(_FrozenOption(U32())), Variant("some", None)),    # tagged outside only
    (_FrozenOption(_FrozenOption(U32())), Variant("some", 5)),
    (_FrozenOption(_FrozenOption(U32())), Variant("none")),
    (_FrozenVariant([("a", U32()), ("b", U32()), ("c", None)]), Variant("b", 9)),
    (_FrozenVariant([("a", U32()), ("b", U32()), ("c", None)]), Variant("c")),
    (_FrozenList(_FrozenList(U32())), [[1, 2], [], [3]]),
]


def _python_lowered(ty, value) -> ffi.wasmtime_component_val_t:
    raw = ffi.wasmtime_component_val_t()
    ty.convert_to_c(None, value, ctypes.pointer(raw))
    return raw


def test_the_struct_layout_is_the_one_wasmtime_py_uses() -> None:
    assert layout_matches(CODEC._module.layout())


@pytest.mark.parametrize("ty, value", CASES)
def test_c_lift_reads_what_wasmtime_py_lowered(ty, value) -> None:
    raw = _python_lowered(ty, value)
    try:
        assert CODEC.lift(ctypes.addressof(raw), descriptor(ty)) == value
    finally:
        ffi.wasmtime_component_val_delete(ctypes.byref(raw))


@pytest.mark.parametrize("ty, value", CASES)
def test_c_lower_gives_what_wasmtime_py_lifts(ty, value) -> None:
    raw = ffi.wasmtime_component_val_t()
    CODEC.lower(value, descriptor(ty), ctypes.addressof(raw))
    assert ty.convert_from_c(raw) == value


def test_lift_args_reads_an_argument_array() -> None:
    types = [U32(), _FrozenList(U32()), String()]
    values = [5, [1, 2, 3], "text"]
    array = (ffi.wasmtime_component_val_t * 3)()
    for i, (ty, value) in enumerate(zip(types, values)):
        ty.convert_to_c(None, value, ctypes.pointer(array[i]))
    descs = tuple(descriptor(ty) for ty in types)
    assert CODEC.lift_args(ctypes.addressof(array), descs, 0) == values
    assert CODEC.lift_args(ctypes.addressof(array), (descs[0], None, descs[2]), 0) == [5, None,
                                                                               "text"]
    for i in range(3):
        ffi.wasmtime_component_val_delete(ctypes.byref(array[i]))


@pytest.mark.parametrize("ty, value, error", [
    (U32(), 2**32, OverflowError), (U32(), -1, OverflowError), (U32(), 1.5, TypeError),
    (F32(), 1, TypeError), (String(), b"bytes", TypeError),
    (_FrozenList(U32()), [1, 2, "three"], TypeError),
    (_FrozenResult(_FrozenList(OUTPUT), String()), [1.5], ValueError),
    (_FrozenVariant([("a", U32()), ("b", U32())]), Variant("nope", 1), ValueError),
    (_FrozenVariant([("a", U32()), ("b", U32())]), 1, TypeError),
    (_FrozenResult(_FrozenList(OUTPUT), String()), 42, ValueError),
    (_FrozenRecord([("a", U32())]), Record(), AttributeError),
])
def test_a_bad_value_raises_and_leaves_the_result_untouched(ty, value, error) -> None:
    raw = ffi.wasmtime_component_val_t()
    with pytest.raises(error):
        CODEC.lower(value, descriptor(ty), ctypes.addressof(raw))
    assert raw.kind == ffi.WASMTIME_COMPONENT_BOOL.value and not raw.of.boolean


def test_a_value_of_another_kind_is_refused_by_lift() -> None:
    raw = _python_lowered(U32(), 3)
    with pytest.raises(TypeError, match="expected a value of kind 12, got kind 6"):
        CODEC.lift(ctypes.addressof(raw), descriptor(String()))


class _CountingCodec:
    """The codec, counting the conversions it makes."""

    def __init__(self, codec) -> None:
        self.codec, self.num_lifts, self.num_lowers = codec, 0, 0

    def lift_args(self, *args):
        self.num_lifts += 1
        return self.codec.lift_args(*args)

    def lower(self, *args):
        self.num_lowers += 1
        return self.codec.lower(*args)


@pytest.mark.parametrize("with_codec", [True, False])
def test_host_calls_work_with_and_without_the_codec(with_codec, components, make_runtime,  # noqa: F811
                                                    monkeypatch) -> None:
    """The same guest decode loop (submit + get + drop) through C and through Python converters
    (the codec is looked up when a function's signature is first built, i.e. per runtime)."""
    counting = _CountingCodec(CODEC) if with_codec else None
    monkeypatch.setattr(fast_calls, "_CODEC", counting)
    engine = FakeEngine(num_pages=64, page_size=16)
    runtime = make_runtime(engine)
    outcome = runtime.wait(runtime.launch(runtime.load_program(components.component(
        "bench_calls")), ["step", "20"]), timeout=60)
    assert (outcome.status, outcome.value) == ("ok", "done")
    assert engine.statistics().num_batches == 20
    if with_codec:      # 20 x (submit + get), plus the setup calls
        assert counting.num_lifts >= 40 and counting.num_lowers >= 20


def test_a_resource_needs_the_store_context() -> None:
    raw = ffi.wasmtime_component_val_t()
    with pytest.raises(ValueError, match="needs the store's context"):
        CODEC.lower(HostResource(1, 1), (21,), ctypes.addressof(raw))
    assert raw.kind == ffi.WASMTIME_COMPONENT_BOOL.value
