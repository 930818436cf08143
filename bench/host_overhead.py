"""The host's own cost, isolated with the fake engine (tests/host/fake_engine.py).

Prints one table:
  - guest->host call rate: a no-op import (messaging.try-receive) through pie's bindings, side by
    side with the same import on a bare wasmtime-py linker (the baseline: no pie wrapper);
  - a decode step (forward.submit + get + drop) through the scheduler and the fake engine;
  - launch time of a cached program (new Runtime, program from the disk cache, instantiate, run to
    the end), for a WAT guest and, when componentize-py can build one, a Python guest (~18 MB);
    target < 50 ms;
  - scheduler overhead per batch with 64 instances decoding at once.

Run from the repo root: .venv/bin/python bench/host_overhead.py [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_DIR))

from host import Runtime, RuntimeConfig  # noqa: E402
from tests.host.components import ComponentBuilder  # noqa: E402
from tests.host.fake_engine import FakeEngine  # noqa: E402

PY_GUEST = '''
import wit_world
from wit_world.imports import runtime


class WitWorld(wit_world.WitWorld):
    def run(self) -> str:
        return runtime.instance_id()
'''


def timed_run(runtime: Runtime, program, args) -> float:
    started = time.perf_counter()
    outcome = runtime.wait(runtime.launch(program, args), timeout=600)
    assert outcome.status == "ok", outcome
    return time.perf_counter() - started


def bare_noop_rate(wasm: bytes, count: int) -> float:
    """Calls/s of the same guest loop on a bare wasmtime-py linker (no pie wrapper)."""
    from wasmtime import Store, WasiConfig
    from wasmtime.component import Component, Linker

    from host.bindings import INTERFACE_MODULES
    from host.sandbox.programs import make_engine

    engine = make_engine()
    linker = Linker(engine)
    linker.add_wasip2()
    with linker.root() as root:
        for module in INTERFACE_MODULES:
            with root.add_instance(module.INTERFACE) as interface:
                for name in module.RESOURCES:
                    from wasmtime.component import ResourceType
                    interface.add_resource(name, ResourceType.host(1), lambda store, rep: None)
                for name in list(module.FUNCTIONS) + list(module.METHODS):
                    interface.add_func(name, _bare_function(name))
    store = Store(engine)
    store.set_wasi(WasiConfig())
    store.set_epoch_deadline(1 << 40)
    instance = linker.instantiate(store, Component(engine, wasm))
    started = time.perf_counter()
    instance.get_func(store, "run")(store)
    return count / (time.perf_counter() - started)


def _bare_function(name: str):
    if name == "try-receive":
        return lambda store: None
    if name == "arguments":
        return lambda store: ["noop", str(BARE_COUNT)]
    return lambda store, *args: None


BARE_COUNT = 20000


def build_python_guest() -> bytes | None:
    """A minimal componentize-py inferlet (cached under .cache/bench/); None when it cannot build."""
    cache = REPO_DIR / ".cache" / "bench" / "py_guest.wasm"
    if cache.exists():
        return cache.read_bytes()
    tool = Path(sys.executable).parent / "componentize-py"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "app.py").write_text(PY_GUEST)
        done = subprocess.run([str(tool), "-d", str(REPO_DIR / "wit"), "-w", "inferlet",
                               "componentize", "app", "-o", "app.wasm"], cwd=tmp,
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"(python guest not built: {done.stderr.strip()[-200:]})")
            return None
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_bytes((Path(tmp) / "app.wasm").read_bytes())
    return cache.read_bytes()


def launch_times(wasm: bytes, cache_dir: Path, repeats: int) -> tuple[float, float, float]:
    """(first load s, cached load s in a new Runtime, median launch-to-end s)."""
    with Runtime(FakeEngine(), RuntimeConfig(cache_dir=cache_dir)) as runtime:
        started = time.perf_counter()
        runtime.load_program(wasm)
        first_load = time.perf_counter() - started
    with Runtime(FakeEngine(), RuntimeConfig(cache_dir=cache_dir)) as runtime:
        started = time.perf_counter()
        program = runtime.load_program(wasm)
        cached_load = time.perf_counter() - started
        assert runtime.statistics().programs.num_compiles == 0
        runs = [timed_run(runtime, program, ()) for _ in range(repeats)]
    return first_load, cached_load, statistics.median(runs)


def scheduler_per_batch(wasm: bytes, cache_dir: Path) -> tuple[int, float, float, float]:
    """64 instances decoding at once: (batches, mean batch size, wall ms/batch, engine ms/batch)."""
    engine = FakeEngine(num_pages=1024, page_size=4, keep_log=False)
    engine_time = [0.0]
    forward = engine.forward

    def timed_forward(batch):
        started = time.perf_counter()
        try:
            return forward(batch)
        finally:
            engine_time[0] += time.perf_counter() - started
    engine.forward = timed_forward
    with Runtime(engine, RuntimeConfig(cache_dir=cache_dir)) as runtime:
        program = runtime.load_program(wasm)
        started = time.perf_counter()
        ids = [runtime.launch(program, ["step", "50"]) for _ in range(64)]
        for instance_id in ids:
            assert runtime.wait(instance_id, timeout=600).status == "ok"
        wall = time.perf_counter() - started
        stats = runtime.statistics().scheduler
    mean_size = stats.num_forwards / stats.num_batches
    return (stats.num_batches, mean_size, 1000 * wall / stats.num_batches,
            1000 * engine_time[0] / stats.num_batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, no Python guest")
    options = parser.parse_args()
    builder = ComponentBuilder()
    bench_wasm = builder.component("bench_calls")
    count = 5000 if options.quick else BARE_COUNT
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = Path(tmp)
        with Runtime(FakeEngine(), RuntimeConfig(cache_dir=cache_dir)) as runtime:
            program = runtime.load_program(bench_wasm)
            timed_run(runtime, program, ["noop", "10"])   # warm up
            noop_s = timed_run(runtime, program, ["noop", str(count)])
            step_count = count // 10
            step_s = timed_run(runtime, program, ["step", str(step_count)])
        bare_rate = bare_noop_rate(bench_wasm, BARE_COUNT)
        pie_rate = count / noop_s
        rows.append(("no-op import (try-receive), pie", f"{pie_rate:,.0f} calls/s",
                     f"{1e6 / pie_rate:.1f} us/call"))
        rows.append(("no-op import, bare wasmtime-py (baseline)", f"{bare_rate:,.0f} calls/s",
                     f"pie/bare time x{bare_rate / pie_rate:.2f}"))
        rows.append(("decode step (submit + get + drop)", f"{step_count / step_s:,.0f} steps/s",
                     f"{1e6 * step_s / step_count:.0f} us/step"))
        first, cached, launch = launch_times(builder.component("info"), cache_dir, 20)
        rows.append(("WAT program: compile / cached load", f"{first * 1e3:.1f} ms",
                     f"{cached * 1e3:.1f} ms"))
        rows.append(("WAT program: launch to end (cached)", f"{launch * 1e3:.2f} ms",
                     "target < 50 ms"))
        py_wasm = None if options.quick else build_python_guest()
        if py_wasm is not None:
            first, cached, launch = launch_times(py_wasm, cache_dir, 10)
            rows.append((f"Python program ({len(py_wasm) / 1e6:.1f} MB): compile / cached load",
                         f"{first:.2f} s", f"{cached * 1e3:.1f} ms"))
            rows.append(("Python program: launch to end (cached)", f"{launch * 1e3:.2f} ms",
                         "target < 50 ms"))
        batches, size, wall_ms, engine_ms = scheduler_per_batch(bench_wasm, cache_dir)
        rows.append(("64 instances x 50 steps: batches / mean size", f"{batches}",
                     f"{size:.1f} passes"))
        rows.append(("  per batch: wall / fake engine / host", f"{wall_ms:.2f} ms",
                     f"{engine_ms:.2f} ms / {wall_ms - engine_ms:.2f} ms"))
    width = max(len(row[0]) for row in rows)
    print(f"{'measure':<{width}}  {'value':>18}  detail")
    for name, value, detail in rows:
        print(f"{name:<{width}}  {value:>18}  {detail}")


if __name__ == "__main__":
    main()
