"""pie's host: runs inferlets (WebAssembly components) in sandboxed instances and batches their
forward passes onto one engine. Importing `host` installs the wasmtime-py thread-safety fixes
(host/sandbox/wasm/wasmtime_fix.py) before any component runs."""
from host.sandbox.wasm import wasmtime_fix as _wasmtime_fix

_wasmtime_fix.apply()

from host.runtime_config import InstanceLimits, RuntimeConfig  # noqa: E402
from host.sandbox.events import InstanceEvent, InstanceOutcome  # noqa: E402
from host.sandbox.programs import Program, ProgramError  # noqa: E402
from host.runtime import InstanceInfo, Runtime, RuntimeStats  # noqa: E402

__all__ = ["Runtime", "RuntimeConfig", "RuntimeStats", "InstanceLimits", "InstanceEvent",
           "InstanceOutcome", "InstanceInfo", "Program", "ProgramError"]
