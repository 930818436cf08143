"""One instance's sandbox: idle limit vs waiting on the model, termination that wakes blocked
calls, blocking timeouts, captured stdout / stderr, runtime interface values."""
from __future__ import annotations

import time

from host import InstanceLimits
from tests.host.components import components, make_runtime, program_cache_dir  # noqa: F401
from tests.host.fake_engine import FakeEngine


def launch(runtime, components, guest, *args, **kwargs):  # noqa: F811
    return runtime.launch(runtime.load_program(components.component(guest)), args, **kwargs)


def test_idle_limit_counts_guest_compute_only(components, make_runtime):  # noqa: F811
    runtime = make_runtime(FakeEngine(), InstanceLimits(max_idle_s=0.3))
    started = time.monotonic()
    outcome = runtime.wait(launch(runtime, components, "spin"), timeout=10)
    elapsed = time.monotonic() - started
    assert (outcome.status, outcome.value) == ("trap", "no host call for 0.3 s")
    assert 0.3 <= elapsed < 3.0


def test_waiting_on_the_model_never_trips_the_idle_limit(components, make_runtime):  # noqa: F811
    """Each pass takes 0.25 s in the engine, longer than max_idle_s: still fine."""
    runtime = make_runtime(FakeEngine(batch_delay_s=0.25), InstanceLimits(max_idle_s=0.1))
    outcome = runtime.wait(launch(runtime, components, "generate", "hi"), timeout=30)
    assert outcome.status == "ok", outcome


def test_terminate_wakes_a_blocked_receive(components, make_runtime):  # noqa: F811
    runtime = make_runtime(FakeEngine())
    events = []
    instance_id = launch(runtime, components, "echo", on_event=events.append)
    assert runtime.send(instance_id, "ping")
    deadline = time.monotonic() + 5
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runtime.terminate(instance_id, "client went away")
    outcome = runtime.wait(instance_id, timeout=5)
    assert (outcome.status, outcome.value) == ("terminated", "client went away")
    assert [(e.kind, e.data) for e in events] == [("message", "ping"),
                                                  ("terminated", "client went away")]
    assert not runtime.terminate(instance_id, "again")      # already ended
    assert not runtime.send(instance_id, "late")


def test_terminate_stops_a_computing_guest_quickly(components, make_runtime):  # noqa: F811
    runtime = make_runtime(FakeEngine(), InstanceLimits(max_idle_s=60))
    instance_id = launch(runtime, components, "spin")
    time.sleep(0.1)
    started = time.monotonic()
    runtime.terminate(instance_id, "stop")
    outcome = runtime.wait(instance_id, timeout=5)
    assert (outcome.status, outcome.value) == ("terminated", "stop")
    assert time.monotonic() - started < 1.0       # the epoch check, not the 60 s idle limit


def test_blocking_call_has_its_own_timeout(components, make_runtime):  # noqa: F811
    runtime = make_runtime(FakeEngine(), InstanceLimits(max_blocking_s=0.2))
    outcome = runtime.wait(launch(runtime, components, "echo"), timeout=5)
    assert (outcome.status, outcome.value) == (
        "trap", "messaging.receive: no message within 0.2 s (max_blocking_s)")


def test_a_receive_waits_at_most_max_receive_wait_s(components, make_runtime):  # noqa: F811
    """An instance whose client never writes is ended naming the limit; the default bounds it."""
    assert InstanceLimits().max_receive_wait_s == 300.0
    runtime = make_runtime(FakeEngine(), InstanceLimits(max_receive_wait_s=0.2))
    started = time.monotonic()
    outcome = runtime.wait(launch(runtime, components, "echo"), timeout=5)
    assert (outcome.status, outcome.value) == (
        "trap", "messaging.receive: no message within 0.2 s (max_receive_wait_s)")
    assert time.monotonic() - started < 3


def test_guest_output_goes_to_the_log_not_the_terminal(components, make_runtime,  # noqa: F811
                                                       capfd):
    runtime = make_runtime(FakeEngine())
    instance_id = launch(runtime, components, "hello_stdio")
    assert runtime.wait(instance_id, timeout=5).value == "printed"
    assert runtime.instance_log(instance_id) == ("stdout: hello from stdout",
                                                 "stderr: warning on stderr")
    captured = capfd.readouterr()
    assert "hello from stdout" not in captured.out + captured.err
    assert "warning on stderr" not in captured.out + captured.err


def test_runtime_interface_values(components, make_runtime):  # noqa: F811
    runtime = make_runtime(FakeEngine())
    instance_id = launch(runtime, components, "info")
    assert runtime.wait(instance_id, timeout=5).value == instance_id
    (line,) = runtime.instance_log(instance_id)
    assert line.startswith("log: pie ")


def test_memory_limit_is_the_instance_own(components, make_runtime):  # noqa: F811
    """The trap names the limit this instance was launched with."""
    runtime = make_runtime(FakeEngine(), InstanceLimits(memory_mb=1))
    outcome = runtime.wait(launch(runtime, components, "memory_bomb"), timeout=10)
    assert (outcome.status, outcome.value) == ("trap", "memory limit 1 MiB reached")


def test_engine_failure_is_an_err_of_get_not_a_trap(components, make_runtime):  # noqa: F811
    engine = FakeEngine()
    runtime = make_runtime(engine)
    engine.fail_next_batches(1)
    outcome = runtime.wait(launch(runtime, components, "generate", "hi"), timeout=10)
    assert outcome.status == "error"
    assert outcome.value.startswith("engine failed the batch: ")
    assert runtime.statistics().pages.num_free == engine.num_pages


def test_wasi_exposes_no_environment_argv_or_directories(components, make_runtime,  # noqa: F811
                                                          monkeypatch):
    monkeypatch.setenv("PIE_SECRET", "do-not-leak")
    runtime = make_runtime(FakeEngine())
    outcome = runtime.wait(launch(runtime, components, "environ", "an-argument"), timeout=5)
    assert (outcome.status, outcome.value) == ("ok", "sandboxed")
