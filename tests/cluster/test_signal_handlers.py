"""A guest's trap stays an error in a process that joined Ray, or left it, after Wasmtime set up
its signal handlers (the order of the tests in one pytest process, and of a front that compiled
a program before starting Ray): `init_ray` / `shutdown_ray` keep Ray's crash handlers, and its
reset to the default ones, from taking the signal."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[2]

_TRAP_AFTER_RAY = textwrap.dedent("""
    import faulthandler, sys
    import ray, wasmtime
    from host.cluster.cluster import init_ray, shutdown_ray

    if sys.argv[1] == "faulthandler-on":
        faulthandler.enable()          # as pytest has it
    engine = wasmtime.Engine()
    store = wasmtime.Store(engine)
    module = wasmtime.Module(engine, '(module (func (export "trap") unreachable))')
    trap = wasmtime.Instance(store, module, []).exports(store)["trap"]

    def traps() -> bool:
        try:
            trap(store)
        except wasmtime.Trap:
            return True
        return False

    assert traps()                     # Wasmtime's handlers are in place
    init_ray(num_cpus=1, include_dashboard=False, object_store_memory=80 << 20,
             log_to_driver=False)
    joined = traps()
    shutdown_ray()
    print("trapped after ray" if joined and traps() else "no trap", flush=True)
""")


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _TRAP_AFTER_RAY, mode], cwd=REPO_DIR,
                          capture_output=True, text=True, timeout=180)


def test_a_trap_after_joining_ray_is_an_error_not_a_crash() -> None:
    for mode in ("faulthandler-on", "faulthandler-off"):
        done = _run(mode)
        assert done.returncode == 0, (mode, done.returncode, done.stderr[-2000:])
        assert "trapped after ray" in done.stdout, (mode, done.stdout, done.stderr[-2000:])
