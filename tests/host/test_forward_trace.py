"""How many host files one step-by-step `forward.submit` and its `get` cross (docs/architecture.md,
"One forward pass, traced"): a profiler over the threads of a Runtime counts the distinct
`host/**.py` files whose Python functions are called between the 21st and the 22nd
`forward.submit` of a WAT guest stepping 40 times (submit + get + drop) over a zero-time fake
engine (the steady state), on the threads the pass runs on. C calls and attribute reads are not
calls; the engine's and the fake engine's files are not the host's. The pass run by the guest's
own thread as it waits and by the engine thread: at most MAX_FILES either way; on failure the
files are listed with the functions called in each."""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from host import InstanceLimits, Runtime, RuntimeConfig
from host.bindings import forward
from host.scheduling.scheduler import SchedulerPolicy
from tests.host.components import components, program_cache_dir  # noqa: F401
from tests.host.fake_engine import FakeEngine

HOST_DIR = Path(__file__).resolve().parents[2] / "host"
MAX_FILES = 9                 # the goal of issue 51: fewer than 10
NUM_STEPS = 40
TRACED_SUBMIT = 21            # the window: from this submit to the next one


# The threads a pass runs on: the guest's (pie-<instance id>), the scheduler's engine thread and
# the look-ahead's helper. The epoch ticker's periodic look (pie-epoch) is no part of the pass.
NOT_ON_THE_PATH = frozenset({"pie-epoch", "pie-progress"})


class SubmitWindow:
    """A profile function: counts `forward.submit` calls and, from the `TRACED_SUBMIT`th to the
    next, keeps each host file called on the pass's threads with the names of its functions
    called."""

    def __init__(self) -> None:
        self.num_submits = 0
        self.functions: dict[str, set[str]] = {}
        self._submit_code = forward.submit.__code__
        self._host_prefix = str(HOST_DIR) + "/"

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code is self._submit_code:
            self.num_submits += 1
        if (self.num_submits == TRACED_SUBMIT and code.co_filename.startswith(self._host_prefix)
                and threading.current_thread().name not in NOT_ON_THE_PATH):
            path = code.co_filename[len(self._host_prefix) - len("host/"):]
            self.functions.setdefault(path, set()).add(code.co_qualname)


def traced_files(program_cache_dir: Path, wasm: bytes, run_on_waiter: bool
                 ) -> dict[str, set[str]]:
    """Host file -> functions called in the window, over the config bench/host_overhead.py's
    WAT decode step uses (every thread of the Runtime profiled from its start); the pass run by
    the guest's thread as it waits, or by the engine thread (`run_on_waiter` False)."""
    window = SubmitWindow()
    config = RuntimeConfig(cache_dir=program_cache_dir, limits=InstanceLimits(max_idle_s=30.0),
                           scheduler=SchedulerPolicy(run_on_waiter=run_on_waiter),
                           count_linear_memory=False)
    engine = FakeEngine(num_pages=16384, page_size=16, keep_log=False)
    threading.setprofile(window)
    sys.setprofile(window)
    try:
        with Runtime(engine, config) as runtime:
            program = runtime.load_program(wasm)
            outcome = runtime.wait(runtime.launch(program, ["step", str(NUM_STEPS)]), timeout=120)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert outcome.status == "ok", outcome
    assert window.num_submits == NUM_STEPS
    return window.functions


@pytest.mark.parametrize("run_on_waiter", [True, False])
def test_one_forward_submit_crosses_fewer_than_ten_host_files(  # noqa: F811
        components, program_cache_dir, run_on_waiter):  # noqa: F811
    functions = traced_files(program_cache_dir, components.component("bench_calls"),
                             run_on_waiter)
    listing = "\n".join(f"  {path}: {', '.join(sorted(names))}"
                        for path, names in sorted(functions.items()))
    print(f"{len(functions)} host files between submit {TRACED_SUBMIT} and "
          f"{TRACED_SUBMIT + 1}:\n{listing}")
    assert "host/bindings/forward.py" in functions, listing      # the window was traced
    assert len(functions) <= MAX_FILES, (
        f"one forward.submit + get + drop crosses {len(functions)} host files, the goal is at "
        f"most {MAX_FILES} (docs/architecture.md, 'One forward pass, traced'):\n{listing}")
