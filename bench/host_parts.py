"""The parts of bench/host_overhead.py that stand in for the engine and time the host: a fake
engine that sleeps like a GPU step (`BenchEngine`), a timer of every host call, the run of
lined-up instances and the time between a sequence's outputs."""
from __future__ import annotations

import statistics
import threading
import time

from wasmtime import _ffi as ffi

from engine.batch import ForwardBatch, ForwardResult
from host import Runtime
from host.sandbox.wasm import fast_calls
from tests.host.fake_engine import FakeEngine


class BenchEngine(FakeEngine):
    """The fake engine without its per-token bookkeeping: every forward sleeps `batch_delay_s`
    (the GIL released, like a GPU step) and answers token 97 for each output. `engine_s` sums
    the time spent in forward. `hold()` makes the next forward wait for `release()` (not counted)."""

    def __init__(self, batch_delay_s: float = 0.0) -> None:
        super().__init__(num_pages=16384, page_size=16, batch_delay_s=batch_delay_s,
                         keep_log=False)
        self.engine_s = 0.0
        self.trace: list[tuple[float, list[int]]] = []   # per batch: its end, each pass's page 0
        self.num_held = 0               # passes of the batch waiting at the gate
        self._gate = threading.Event()
        self._gate.set()
        self._held = False              # read first in forward: cheaper than the Event's

    def hold(self) -> None:
        self._held = True
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()
        self._held = False

    def forward(self, batch: ForwardBatch) -> list[ForwardResult]:
        if self._held:
            self.num_held = len(batch.requests)
            self._gate.wait()
        started = time.perf_counter()
        if self.batch_delay_s:
            time.sleep(self.batch_delay_s)
        results = [ForwardResult((97,) * len(request.output_indices))
                   for request in batch.requests]
        first_page_ids = [request.page_ids[0] for request in batch.requests]
        ended = time.perf_counter()
        self.trace.append((ended, first_page_ids))
        self.engine_s += time.perf_counter() - started      # the bookkeeping is the engine's
        return results


def inter_token_s(trace: list[tuple[float, list[int]]]) -> float:
    """The mean time between two outputs of one sequence (named by its first page): per
    sequence (its last output's batch end - its first's) / (outputs - 1)."""
    ends: dict[int, list[float]] = {}
    for ended, first_page_ids in trace:
        for page_id in first_page_ids:
            ends.setdefault(page_id, []).append(ended)
    return statistics.mean((times[-1] - times[0]) / (len(times) - 1)
                           for times in ends.values() if len(times) > 1)


class HostCallTimer:
    """Registers a timed copy of the host-call callback (for the Runtimes built while active):
    `seconds` / `calls` sum every host call's duration and count."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._original = fast_calls._call_host_function
        self._callback = ffi.wasmtime_component_func_callback_t(self._timed)

    def _timed(self, *args):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        try:
            return fast_calls.host_call(*args)
        finally:
            self.seconds += time.perf_counter() - started
            self.calls += 1

    def __enter__(self) -> "HostCallTimer":
        fast_calls._call_host_function = self._callback
        return self

    def __exit__(self, *exc_info: object) -> None:
        fast_calls._call_host_function = self._original


def run_to_end(runtime: Runtime, program, args) -> float:
    started = time.perf_counter()
    outcome = runtime.wait(runtime.launch(program, args), timeout=600)
    assert outcome.status == "ok", outcome
    return time.perf_counter() - started


def lined_up(runtime: Runtime, engine: BenchEngine, program, args: list[str],
             num_instances: int) -> dict:
    """Launch `num_instances`, hold the engine until each has queued its first pass, then time
    the run to the end: wall s, engine s, batches and passes in that window."""
    engine.hold()
    engine.num_held = 0
    ids = [runtime.launch(program, args) for _ in range(num_instances)]
    deadline = time.monotonic() + 600
    while engine.num_held + runtime.statistics().scheduler.num_pending < num_instances:
        if time.monotonic() > deadline:
            raise SystemExit("instances did not line up within 600 s")
        time.sleep(0.005)
    before, engine_before = runtime.statistics().scheduler, engine.engine_s
    num_traced = len(engine.trace)
    started, cpu_started = time.perf_counter(), time.process_time()
    engine.release()
    for instance_id in ids:
        outcome = runtime.wait(instance_id, timeout=600)
        assert outcome.status == "ok", outcome
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    after = runtime.statistics().scheduler
    return {"wall_s": wall, "cpu_s": cpu, "engine_s": engine.engine_s - engine_before,
            "inter_token_s": inter_token_s(engine.trace[num_traced:]),
            "num_batches": after.num_batches - before.num_batches,
            "num_forwards": after.num_forwards - before.num_forwards}
