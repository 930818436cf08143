"""A recording proxy around the real `flashinfer` package, to check the CUDA path on a CPU.

`recording_flashinfer(real, recorder, compute)` builds a module to install as `flashinfer`. Each
call the attention backend or the CUDA sampler makes into it is first bound to the *real* function's
signature (`inspect.signature(real).bind(*args, **kwargs)`): a wrong name, a missing argument or an
extra positional raises TypeError there, as the real call would. The bound arguments, by the real
parameter names with the real defaults applied, are recorded as a `Call`; then the call goes to the
stand-in of tests/engine/test_device.py (prefill wrapper), tests/engine/flashinfer_stand_in.py
(decode wrapper, eager or CUDA-graph mode, and the fused kernels `KERNELS`) or
tests/engine/test_sampling_cuda.py (sampler), and what the stand-in returns is returned. With compute=False (tensors on the meta device, where
nothing can be computed) the stand-ins are skipped and `run` returns an empty tensor shaped like `q`
(the documented output: [qo_indptr[-1], num_qo_heads, head_dim] in q's dtype).

The real wrappers cannot be built on a CPU (their constructor pins host memory), so nothing real
runs except argument binding and the pure-torch planning helpers the contract checks call.
"""
from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tests.engine.flashinfer_stand_in import StandInDecode, stand_in_flashinfer
from tests.engine.test_device import FakePrefill
from tests.engine.test_sampling_cuda import _FakeSampling

KERNELS = ("norm.rmsnorm", "norm.fused_add_rmsnorm", "rope.apply_rope_with_cos_sin_cache_inplace",
           "activation.silu_and_mul", "page.append_paged_kv_cache")
PREFILL = "BatchPrefillWithPagedKVCacheWrapper"
DECODE = "BatchDecodeWithPagedKVCacheWrapper"
SAMPLING = "sampling.top_k_top_p_sampling_from_probs"


@dataclass(frozen=True)
class Call:
    """One call into flashinfer: e.g. name "BatchPrefillWithPagedKVCacheWrapper.plan"."""

    name: str
    arguments: dict[str, Any]         # real parameter name -> value, defaults applied, no `self`


@dataclass
class Recorder:
    """The calls made through one recording module, in order."""

    calls: list[Call] = field(default_factory=list)

    def bind(self, name: str, function: Callable, args: tuple, kwargs: dict, *,
             method: bool = True) -> dict[str, Any]:
        """Bind to `function`'s real signature (TypeError when it would not), record, return."""
        signature = inspect.signature(function)
        bound = signature.bind(None, *args, **kwargs) if method else signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
        self.calls.append(Call(name, arguments))
        return arguments

    def named(self, name: str) -> list[Call]:
        return [call for call in self.calls if call.name == name]


def plan_target(real_cls: type) -> Callable:
    """The function whose signature names `plan`'s arguments.

    BatchDecodeWithPagedKVCacheWrapper.plan (0.7.x) takes `*deprecated_positional_args, **kwargs`
    and forwards them to `_plan_impl`, whose keyword-only parameters are the real names; binding
    the public `plan` alone would accept any keyword.
    """
    public = inspect.signature(real_cls.plan)
    if any(p.kind is p.VAR_KEYWORD for p in public.parameters.values()):
        return real_cls._plan_impl
    return real_cls.plan


def _recording_wrapper(real_cls: type, stand_in_cls: type, recorder: Recorder,
                       compute: bool) -> type:
    name = real_cls.__name__

    class RecordingWrapper:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            recorder.bind(f"{name}.__init__", real_cls.__init__, args, kwargs)
            self.stand_in = stand_in_cls(*args, **kwargs) if compute else None

        def plan(self, *args: Any, **kwargs: Any) -> None:
            inspect.signature(real_cls.plan).bind(None, *args, **kwargs)     # the public method too
            recorder.bind(f"{name}.plan", plan_target(real_cls), args, kwargs)
            if self.stand_in is not None:
                self.stand_in.plan(*args, **kwargs)

        def run(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            arguments = recorder.bind(f"{name}.run", real_cls.run, args, kwargs)
            if self.stand_in is None:
                return torch.empty_like(arguments["q"])
            return self.stand_in.run(*args, **kwargs)

    RecordingWrapper.__name__ = RecordingWrapper.__qualname__ = f"Recording{name}"
    return RecordingWrapper


def recording_flashinfer(real: types.ModuleType, recorder: Recorder,
                         compute: bool = True) -> types.ModuleType:
    """A `flashinfer` module whose wrappers and fused sampler bind to `real`'s signatures."""
    module = types.ModuleType("flashinfer")
    module.__version__ = real.__version__
    module.BatchPrefillWithPagedKVCacheWrapper = _recording_wrapper(
        real.BatchPrefillWithPagedKVCacheWrapper, FakePrefill, recorder, compute)
    module.BatchDecodeWithPagedKVCacheWrapper = _recording_wrapper(
        real.BatchDecodeWithPagedKVCacheWrapper, StandInDecode, recorder, compute)
    stand_in = _FakeSampling()

    def top_k_top_p_sampling_from_probs(*args: Any, **kwargs: Any) -> torch.Tensor:
        recorder.bind(SAMPLING, real.sampling.top_k_top_p_sampling_from_probs, args, kwargs,
                      method=False)
        return stand_in.top_k_top_p_sampling_from_probs(*args, **kwargs)

    module.sampling = types.SimpleNamespace(
        top_k_top_p_sampling_from_probs=top_k_top_p_sampling_from_probs)
    kernels = stand_in_flashinfer()
    for name in KERNELS:
        submodule, function = name.split(".")
        space = getattr(module, submodule, None) or types.SimpleNamespace()
        setattr(module, submodule, space)
        setattr(space, function, _recording_function(
            name, getattr(getattr(real, submodule), function),
            getattr(getattr(kernels, submodule), function), recorder, compute))
    return module


def _recording_function(name: str, real: Callable, stand_in: Callable, recorder: Recorder,
                        compute: bool) -> Callable:
    """A module-level flashinfer function: bind to `real`, record, then run the stand-in (on the
    meta device, where nothing computes: a fresh output shaped like the first argument, or
    nothing for the in-place kernels)."""
    def function(*args: Any, **kwargs: Any) -> Any:
        arguments = recorder.bind(name, real, args, kwargs, method=False)
        if compute:
            return stand_in(*args, **kwargs)
        if name == "activation.silu_and_mul":
            first = arguments["input"]
            return first.new_empty(*first.shape[:-1], first.shape[-1] // 2)
        if name == "norm.rmsnorm":
            return torch.empty_like(arguments["input"])
        return None
    function.__name__ = name.split(".")[-1]
    return function
