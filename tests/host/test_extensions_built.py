"""`make setup` builds both C extensions wherever a C compiler is present.

The tests of each extension skip when it is missing (a machine without a compiler runs the
fallbacks: the engine's torch path, wasmtime-py's converters), so a build that failed quietly
would otherwise go unnoticed here and in CI.
"""
from __future__ import annotations

import importlib.util
import shutil
import sysconfig

import pytest

from host.sandbox.wasm.wit_codec import load_codec

COMPILER = shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0])
pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C compiler: the fallbacks run")


@pytest.mark.parametrize("module", ["engine.quant._kernels", "host.sandbox.wasm._wit_values"])
def test_the_extension_was_built(module: str) -> None:
    assert importlib.util.find_spec(module) is not None, f"{module} was not built by make setup"


def test_the_host_call_codec_is_in_use() -> None:
    assert load_codec() is not None      # built, and its struct layout matches wasmtime-py's
