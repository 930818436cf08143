"""The host's own cost, isolated with a fake engine (no model): one table, or `--json`.

Rows (each with the baseline it is read against, measured in the same run):
  - no-op import (messaging.try-receive) through pie's bindings vs a bare wasmtime-py linker;
  - a decode step of a WAT guest (forward.submit + get + drop), zero-time engine;
  - host_us_per_step: a decode step of a Python guest through the SDK (bench/guests/host_bench.py)
    over an engine that sleeps a GPU-like 5 ms per batch: the time spent inside host calls per step
    (timed around every host call) less the engine's own time; the guest's own time (CPython in
    Wasm) and the process CPU per step are shown beside it. The SDK decodes on host loops
    (forward.submit-decode), here with overlapped batches (SchedulerPolicy.overlap, what a GPU
    engine gets); the rows below it: without overlap, and step by step (host_loop=False);
  - launch_ms: a cached Python guest, launch to result (median), and the load from the disk cache;
    beside it the launch with counted linear memories (`pie serve`, `pie run`), and the same
    taking a spare instantiated ahead (`launch_ms_spare`, Runtime.keep_spares);
  - batch_fill_256 / host_share_256: 256 Python guests decoding at once (host loops, overlap)
    over an engine that sleeps a GPU-like 5 ms per batch: mean passes per batch / 256, and the
    host time per batch as a fraction of the engine time: a guest's time between two tokens less
    a batch's engine time (`_wall`: the whole run's wall less engine time, the guests' start and
    end included); the same without overlap (`_no_overlap`) and 256 WAT guests step by step
    (forward.submit + get + drop, `_stepped`);
  - tpot_overhead_llama1b: Python guests (1, 8, 64) decoding over an engine that sleeps 16.8 ms
    per batch (the Pie paper's vLLM time per output token, Llama-3-1B), with overlap: the time
    between two tokens of a guest (TPOT: its last token's batch end less its first's, over the
    tokens between) less one batch's engine time, as a fraction of it; the worst of the three;
    `_wall`: the wall time per token from the release of the lined-up batch to the last guest's
    end (their ends included); `_no_overlap` the same without overlap (`--stepped`: the guests
    step by step instead of on host loops, the A/B of the loops). The engine's time per batch
    is the fake engine's forward (its sleep); it ignores its input tokens, so the tokens fed to
    overlapped passes cost it nothing;
  - host_share_1ms_{1,8,64}: the same measure over an engine that sleeps 1.0 ms per batch (a
    decode step replayed from a CUDA graph, docs/cuda.md), with overlap: TPOT / one batch's
    engine time - 1, at 1, 8 and 64 Python guests (target <= 0.10 at 64);
  - idle_instance_mb: resident memory per instance blocked in receive() (Python guest), N of them.
Runs that several instances make are lined up first: the engine holds its first batch until every
instance has queued its first pass, so launch time is not counted as batching.

Run from the repo root: .venv/bin/python bench/host_overhead.py [--quick] [--json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_DIR))

import torch  # noqa: E402

from host import Runtime, RuntimeConfig  # noqa: E402
from host.sandbox.programs.build import build_cached  # noqa: E402
from host.scheduling.scheduler import SchedulerPolicy  # noqa: E402
from tests.host.components import ComponentBuilder  # noqa: E402
from host_parts import BenchEngine, HostCallTimer, lined_up, run_to_end  # noqa: E402

GUEST_APP = REPO_DIR / "bench" / "guests" / "host_bench.py"
GPU_STEP_S = 0.005           # batch_fill_256: a GPU-like engine step
LLAMA1B_TPOT_S = 0.0168      # the Pie paper: vLLM, Llama-3-1B, time per output token
GRAPH_STEP_S = 0.001         # a decode step replayed from a CUDA graph (docs/cuda.md's target)
BARE_COUNT = 20000


def bare_noop_rate(wasm: bytes, count: int) -> float:
    """Calls/s of the same guest loop on a bare wasmtime-py linker (no pie wrapper)."""
    from wasmtime import Store, WasiConfig
    from wasmtime.component import Component, Linker, ResourceType

    from host.bindings import INTERFACE_MODULES
    from host.sandbox.programs import make_engine

    engine = make_engine()
    linker = Linker(engine)
    linker.add_wasip2()
    with linker.root() as root:
        for module in INTERFACE_MODULES:
            with root.add_instance(module.INTERFACE) as interface:
                for name in module.RESOURCES:
                    interface.add_resource(name, ResourceType.host(1), lambda store, rep: None)
                for name in list(module.FUNCTIONS) + list(module.METHODS):
                    interface.add_func(name, _bare_function(name, count))
    store = Store(engine)
    store.set_wasi(WasiConfig())
    store.set_epoch_deadline(1 << 40)
    instance = linker.instantiate(store, Component(engine, wasm))
    started = time.perf_counter()
    instance.get_func(store, "run")(store)
    return count / (time.perf_counter() - started)


def _bare_function(name: str, count: int):
    if name == "try-receive":
        return lambda store: None
    if name == "arguments":
        return lambda store: ["noop", str(count)]
    return lambda store, *args: None


def call_rows(wat: bytes, config: RuntimeConfig, count: int) -> tuple[list, dict]:
    """No-op import (pie vs bare) and the WAT decode step."""
    with Runtime(BenchEngine(), config) as runtime:
        program = runtime.load_program(wat)
        run_to_end(runtime, program, ["noop", "10"])   # warm up
        noop_s = run_to_end(runtime, program, ["noop", str(count)])
        num_steps = count // 10
        step_s = run_to_end(runtime, program, ["step", str(num_steps)])
    bare_rate, pie_rate = bare_noop_rate(wat, BARE_COUNT), count / noop_s
    rows = [("no-op import (try-receive), pie", f"{1e6 / pie_rate:.1f} us/call",
             f"bare wasmtime-py {1e6 / bare_rate:.1f} us/call (pie/bare x{bare_rate / pie_rate:.2f})"),
            ("decode step, WAT guest (submit + get + drop)", f"{1e6 * step_s / num_steps:.0f} us",
             "zero-time engine")]
    return rows, {"wat_us_per_step": 1e6 * step_s / num_steps}


def python_step_rows(py_wasm: bytes, config: RuntimeConfig, num_steps: int) -> tuple[list, dict]:
    """host_us_per_step: one Python guest decoding over a 5 ms engine, host calls timed; on
    host loops (the SDK's default), then step by step."""
    rows, figures = [], {}
    for mode, label, key, overlap in (
            ("decode", "host loops, overlap", "host_us_per_step", True),
            ("decode", "host loops, no overlap", "host_us_per_step_no_overlap", False),
            ("decode-steps", "step by step", "host_us_per_step_stepped", False)):
        engine = BenchEngine(GPU_STEP_S)
        with HostCallTimer() as timer, Runtime(engine, with_overlap(config, overlap)) as runtime:
            program = runtime.load_program(py_wasm)
            run_to_end(runtime, program, [mode, "8"])            # warm up
            timer.seconds, timer.calls, engine.engine_s = 0.0, 0, 0.0
            cpu_started = time.process_time()
            wall = run_to_end(runtime, program, [mode, str(num_steps)])
            cpu_us = 1e6 * (time.process_time() - cpu_started) / num_steps
        host_us = 1e6 * (timer.seconds - engine.engine_s) / num_steps
        guest_us = 1e6 * (wall - timer.seconds) / num_steps
        rows.append((f"decode step, Python guest via the SDK ({label}): host", f"{host_us:.0f} us",
                     f"target <= 50; {timer.calls / num_steps:.1f} host calls/step, guest+launch "
                     f"{guest_us:.0f} us/step, process CPU {cpu_us:.0f} us/step"))
        figures[key] = host_us
    return rows, figures


def launch_rows(py_wasm: bytes, config: RuntimeConfig, repeats: int) -> tuple[list, dict]:
    """launch_ms on the runtime's default memories (Wasmtime's, copy-on-write images), and the
    same with counted memories (what `pie serve` and `pie run` use: the heap image mapped
    copy-on-write from the host's file, host/sandbox/image_files.py)."""
    with Runtime(BenchEngine(), config) as runtime:
        runtime.load_program(py_wasm)                  # compiled into the disk cache
    with Runtime(BenchEngine(), config) as runtime:
        started = time.perf_counter()
        program = runtime.load_program(py_wasm)
        cached_load = time.perf_counter() - started
        launch = _median_launch(runtime, program, repeats)
    counted_config = dataclasses.replace(config, count_linear_memory=True)
    with Runtime(BenchEngine(), counted_config) as runtime:
        program = runtime.load_program(py_wasm)
        counted = _median_launch(runtime, program, repeats)
        runtime.keep_spares(program, 1)
        spare = _median_launch(runtime, program, repeats, lambda: runtime.wait_spares(10))
    rows = [("Python guest: launch to result (cached)", f"{launch * 1e3:.2f} ms",
             f"target <= 5; load from the disk cache {cached_load * 1e3:.1f} ms"),
            ("  the same, memories counted (pie serve / pie run)", f"{counted * 1e3:.2f} ms",
             "count_linear_memory: a pooled memory, the heap image put back in the pages the "
             "last instance wrote"),
            ("  the same, taking a spare (pie serve's built-in)", f"{spare * 1e3:.2f} ms",
             "Runtime.keep_spares: instantiated ahead while nothing ran")]
    return rows, {"launch_ms": launch * 1e3, "launch_ms_counted": counted * 1e3,
                  "launch_ms_spare": spare * 1e3}


def _median_launch(runtime: Runtime, program, repeats: int, settle=lambda: None) -> float:
    """The median launch-to-result of `repeats` runs, `settle()` called before each."""
    run_to_end(runtime, program, ["noop"])            # warm up
    times = []
    for _ in range(repeats):
        settle()
        times.append(run_to_end(runtime, program, ["noop"]))
    return statistics.median(times)


def with_overlap(config: RuntimeConfig, overlap: bool) -> RuntimeConfig:
    return dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler,
                                                                     overlap=overlap))


def batch_fill_rows(py_wasm: bytes, wat: bytes, config: RuntimeConfig, num_steps: int,
                    num_instances: int = 256) -> tuple[list, dict]:
    """256 guests decoding over a 5 ms engine: Python guests on host loops with overlapped
    batches (the goal's row), the same without overlap, and WAT guests step by step."""
    rows, figures = [], {}
    for label, program, args, overlap, key in (
            ("Python guests, host loops, overlap", py_wasm, ["decode", str(num_steps)], True, ""),
            ("  the same, no overlap", py_wasm, ["decode", str(num_steps)], False, "_no_overlap"),
            ("  WAT guests step by step", wat, ["step", str(num_steps)], False, "_stepped")):
        engine = BenchEngine(GPU_STEP_S)
        with Runtime(engine, with_overlap(config, overlap)) as runtime:
            run = lined_up(runtime, engine, runtime.load_program(program), args, num_instances)
        fill = run["num_forwards"] / run["num_batches"] / num_instances
        share = (run["wall_s"] - run["engine_s"]) / run["engine_s"]
        gap_share = run["inter_token_s"] / (run["engine_s"] / run["num_batches"]) - 1
        rows.append((f"{num_instances} {label}, 5 ms engine: batch fill", f"{fill:.3f}",
                     f"target >= 0.9; {run['num_batches']} batches, "
                     f"{1e3 * run['wall_s'] / run['num_batches']:.2f} ms each"))
        rows.append(("    host time per batch / engine time", f"{gap_share:.3f}",
                     f"target <= 0.05 (between a guest's tokens); over the whole run, with the "
                     f"guests' start and end: {share:.3f}; process CPU "
                     f"{1e6 * run['cpu_s'] / run['num_forwards']:.0f} us/pass"))
        figures.update({f"batch_fill_256{key}": fill, f"host_share_256{key}": gap_share,
                        f"host_share_256{key}_wall": share})
    return rows, figures


def tpot_rows(py_wasm: bytes, config: RuntimeConfig, num_steps: int,
              mode: str = "decode") -> tuple[list, dict]:
    """Python guests over a 16.8 ms engine, with overlapped batches and without: the time
    between two tokens of a guest (TPOT) against one batch's engine time; beside it the wall
    time per token from the release of the lined-up batch to the last guest's end."""
    rows, figures = [], {}
    for overlap, key in ((True, ""), (False, "_no_overlap")):
        overheads, wall_overheads = [], []
        for num_instances in (1, 8, 64):
            run, batch_s, share = _per_token_share(py_wasm, config, LLAMA1B_TPOT_S, overlap,
                                                   [mode, str(num_steps)], num_instances)
            overheads.append(share)
            wall_overheads.append(run["wall_s"] * num_instances / run["num_forwards"] / batch_s
                                  - 1)
            how = ("host loops" if mode == "decode" else "step by step") + (
                ", overlap" if overlap else ", no overlap")
            rows.append((f"16.8 ms engine, {num_instances} Python guests ({how}): TPOT",
                         f"{run['inter_token_s'] * 1e3:.2f} ms",
                         f"host adds {overheads[-1]:+.3f} (target <= 0.03; engine "
                         f"{batch_s * 1e3:.2f} ms/batch, "
                         f"{run['num_forwards'] / run['num_batches']:.1f} passes/batch; wall per "
                         f"token with the guests' start and end {wall_overheads[-1]:+.3f})"))
        figures.update({f"tpot_overhead_llama1b{key}": max(overheads),
                        f"tpot_overhead_llama1b{key}_wall": max(wall_overheads)})
    return rows, figures


def _per_token_share(py_wasm: bytes, config: RuntimeConfig, step_s: float, overlap: bool,
                     args: list[str], num_instances: int) -> tuple[dict, float, float]:
    """`num_instances` lined-up Python guests over an engine sleeping `step_s` per batch: (the
    run, one batch's engine time, the host's share per token: TPOT / that time - 1)."""
    engine = BenchEngine(step_s)
    with Runtime(engine, with_overlap(config, overlap)) as runtime:
        run = lined_up(runtime, engine, runtime.load_program(py_wasm), args, num_instances)
    batch_s = run["engine_s"] / run["num_batches"]
    return run, batch_s, run["inter_token_s"] / batch_s - 1


def short_step_rows(py_wasm: bytes, config: RuntimeConfig, num_steps: int,
                    mode: str = "decode") -> tuple[list, dict]:
    """The tpot row's measure over a 1.0 ms engine (a graph-replayed step), with overlap: the
    host's share per token, TPOT / one batch's engine time - 1, at 1, 8 and 64 Python guests."""
    rows, figures = [], {}
    for num_instances in (1, 8, 64):
        run, batch_s, share = _per_token_share(py_wasm, config, GRAPH_STEP_S, True,
                                               [mode, str(num_steps)], num_instances)
        figures[f"host_share_1ms_{num_instances}"] = share
        rows.append((f"1.0 ms engine, {num_instances} Python guests (overlap): TPOT",
                     f"{run['inter_token_s'] * 1e3:.3f} ms",
                     f"host adds {share:+.3f} (target <= 0.10 at 64; engine "
                     f"{batch_s * 1e3:.3f} ms/batch, "
                     f"{run['num_forwards'] / run['num_batches']:.1f} passes/batch)"))
    return rows, figures


def idle_rows(py_wasm: bytes, config: RuntimeConfig, num_instances: int) -> tuple[list, dict]:
    """Resident memory per Python instance blocked in receive()."""
    with Runtime(BenchEngine(), config) as runtime:
        program = runtime.load_program(py_wasm)
        runtime.wait(runtime.launch(program, ["noop"]))
        before = _rss_mb()
        ready = threading.Semaphore(0)

        def on_event(event) -> None:
            if event.kind == "message":
                ready.release()
        ids = [runtime.launch(program, ["idle"], on_event=on_event) for _ in range(num_instances)]
        for _ in ids:                            # each sends "ready" right before receive()
            ready.acquire(timeout=600)
        time.sleep(0.2)
        per_instance = (_rss_mb() - before) / num_instances
        for instance_id in ids:
            runtime.send(instance_id, "end")
        for instance_id in ids:
            runtime.wait(instance_id, timeout=600)
    rows = [(f"{num_instances} idle Python guests (in receive)", f"{per_instance:.2f} MB each",
             "resident memory growth / instances")]
    return rows, {"idle_instance_mb": per_instance}


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and instances")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the goals")
    parser.add_argument("--idle-instances", type=int, default=None,
                        help="instances of the idle-memory row (default 1000, --quick 100)")
    parser.add_argument("--no-run-on-waiter", action="store_true",
                        help="every batch on the engine thread (the old behaviour: A/B)")
    parser.add_argument("--stepped", action="store_true",
                        help="tpot: Python guests step by step, not on host loops (A/B)")
    parser.add_argument("--only", default="",
                        help="comma-separated sections: calls,step,launch,fill,tpot,step1ms,idle")
    options = parser.parse_args()
    quick = options.quick
    builder = ComponentBuilder()
    wat = builder.component("bench_calls")
    py_path, _ = build_cached(GUEST_APP, REPO_DIR / ".cache" / "bench" / "builds")
    py_wasm = py_path.read_bytes()
    rows, figures = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        policy = SchedulerPolicy(run_on_waiter=not options.no_run_on_waiter)
        config = RuntimeConfig(cache_dir=Path(tmp), scheduler=policy, count_linear_memory=False)
        sections = {
            "calls": lambda: call_rows(wat, config, 5000 if quick else BARE_COUNT),
            "step": lambda: python_step_rows(py_wasm, config, 100 if quick else 400),
            "launch": lambda: launch_rows(py_wasm, config, 10 if quick else 30),
            "fill": lambda: batch_fill_rows(py_wasm, wat, config, 20 if quick else 60),
            "tpot": lambda: tpot_rows(py_wasm, config, 10 if quick else 30,
                                      "decode-steps" if options.stepped else "decode"),
            "step1ms": lambda: short_step_rows(py_wasm, config, 30 if quick else 100,
                                               "decode-steps" if options.stepped else "decode"),
            "idle": lambda: idle_rows(py_wasm, config,
                                      options.idle_instances or (100 if quick else 1000))}
        for name in options.only.split(",") if options.only else sections:
            new_rows, new_figures = sections[name]()
            rows += new_rows
            figures.update(new_figures)
    if options.json:
        print(json.dumps({key: round(value, 4) for key, value in figures.items()}))
        return
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} torch threads")
    width = max(len(row[0]) for row in rows)
    for name, value, detail in rows:
        print(f"{name:<{width}}  {value:>16}  {detail}")


if __name__ == "__main__":
    main()
