"""The checked FlashInfer version: recorded once (engine.device), pinned by the `cuda` extra, and a
different installed version warned about once at start-up on CUDA. Runs without the real package
(a stand-in module carries the version)."""
from __future__ import annotations

import sys
import tomllib
import types
import warnings
from pathlib import Path

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.device import (FLASHINFER_CHECKED_VERSION, DeviceChoice, FlashInferVersionWarning,
                           choose_device, unchecked_flashinfer_version)

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _flashinfer_of_version(version: str) -> types.ModuleType:
    module = types.ModuleType("flashinfer")
    module.__version__ = version
    return module


def _start_ups(monkeypatch, *, cuda: bool, version: str, num_start_ups: int = 3):
    """choose_device `num_start_ups` times with flashinfer `version` installed; returns
    (the choices, the FlashInferVersionWarnings shown under Python's default filter)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setitem(sys.modules, "flashinfer", _flashinfer_of_version(version))
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        choices = [choose_device(EngineConfig(device="auto")) for _ in range(num_start_ups)]
    return choices, [w for w in shown if issubclass(w.category, FlashInferVersionWarning)]


def test_the_cuda_extra_pins_the_checked_version():
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    assert extras["cuda"] == [f"flashinfer-python=={FLASHINFER_CHECKED_VERSION}"]


def test_unchecked_version_is_named():
    assert unchecked_flashinfer_version(_flashinfer_of_version(FLASHINFER_CHECKED_VERSION)) is None
    assert unchecked_flashinfer_version(_flashinfer_of_version("0.6.18")) == "0.6.18"
    assert unchecked_flashinfer_version(types.ModuleType("flashinfer")) == "unknown"


def test_a_different_version_warns_once_at_start_up_on_cuda(monkeypatch):
    choices, shown = _start_ups(monkeypatch, cuda=True, version="0.6.18")
    assert choices == [DeviceChoice(torch.device("cuda"), "flashinfer")] * 3   # it still runs
    [warning] = shown
    message = str(warning.message)
    assert "flashinfer 0.6.18 is installed" in message
    assert f"checked against {FLASHINFER_CHECKED_VERSION}" in message
    assert "pie-serve[cuda]" in message


def test_the_checked_version_does_not_warn(monkeypatch):
    _, shown = _start_ups(monkeypatch, cuda=True, version=FLASHINFER_CHECKED_VERSION)
    assert shown == []


def test_no_version_warning_on_the_cpu(monkeypatch):
    choices, shown = _start_ups(monkeypatch, cuda=False, version="0.6.18")
    assert choices[0] == DeviceChoice(torch.device("cpu"), "torch") and shown == []


def test_no_version_warning_without_flashinfer(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flashinfer", None)         # not installed
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        choice = choose_device(EngineConfig(device="auto"))
    assert choice == DeviceChoice(torch.device("cuda"), "torch") and shown == []


@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
def test_the_warning_covers_both_attention_backends_on_cuda(monkeypatch, backend):
    """The CUDA sampler uses flashinfer even under the torch attention backend. With every
    warning shown ("always"), one start-up still issues exactly one: it is not per import."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flashinfer", _flashinfer_of_version("0.8.0"))
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        choose_device(EngineConfig(device="cuda", attention_backend=backend))
    assert [w.category for w in shown] == [FlashInferVersionWarning]
