"""The wasmtime-py 50.0.1 thread-safety race: it shows errors without host/sandbox/wasm/wasmtime_fix.py and
none with it. Each run is a subprocess (the unfixed one must never import `host`)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from wasmtime.component import _enter, _linker, _types

from host.sandbox.wasm import wasmtime_fix
from tests.host.components import components  # noqa: F401

RACE_SCRIPT = Path(__file__).resolve().parent / "wasmtime_race.py"
NUM_THREADS, NUM_CALLS = 16, 40


@pytest.fixture(scope="module")
def race_component(components, tmp_path_factory) -> Path:  # noqa: F811
    path = tmp_path_factory.mktemp("race") / "race.wasm"
    path.write_bytes(components.component("race"))
    return path


def run_race(component: Path, mode: str) -> dict:
    done = subprocess.run([sys.executable, str(RACE_SCRIPT), str(component), mode,
                           str(NUM_THREADS), str(NUM_CALLS)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_race_fails_without_the_fix(race_component):
    """A race is probabilistic (3-10 errors in 640 calls here): up to 3 runs must show one."""
    for _ in range(3):
        summary = run_race(race_component, "unfixed")
        assert summary["calls"] == NUM_THREADS * NUM_CALLS
        if summary["errors"]:
            break
    assert summary["errors"] > 0, summary      # lost / misattributed exceptions, TypeError


def test_race_passes_with_the_fix(race_component):
    summary = run_race(race_component, "fixed")
    assert summary == {"calls": NUM_THREADS * NUM_CALLS, "errors": 0, "samples": []}


def test_fix_is_applied_once_at_import_of_host():
    assert wasmtime_fix.is_applied()
    assert _linker.catch_exceptions is _enter.catch_exceptions
    assert _enter.maybe_raise_last_exn.__module__ == "host.sandbox.wasm.wasmtime_fix"
    assert _types.VariantLikeType._lower.__module__ == "host.sandbox.wasm.wasmtime_fix"
    before = (_enter.catch_exceptions, _types.VariantLikeType._lower)
    wasmtime_fix.apply()   # idempotent
    assert (_enter.catch_exceptions, _types.VariantLikeType._lower) == before
