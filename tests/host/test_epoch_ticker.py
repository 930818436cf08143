"""The epoch ticker rests while no guest can run Wasm (host/sandbox/guest_activity.py): an idle
runtime and instances blocked in host waits cost no wake-ups, and a guest that computes, from its
start or after a wait, is still ticked for, trapped at its idle limit and stopped by terminate."""
from __future__ import annotations

import threading
import time

import pytest

from host import InstanceLimits
from host.sandbox.guest_activity import IDLE_WAIT_S, GuestActivity
from tests.host.components import components, make_runtime, program_cache_dir  # noqa: F401
from tests.host.fake_engine import FakeEngine
from tests.host.test_instance import launch


def ticks_over(runtime, seconds: float) -> int:
    """The epoch ticks the runtime makes in the next `seconds`."""
    before = runtime.num_epoch_ticks
    time.sleep(seconds)
    return runtime.num_epoch_ticks - before


def test_an_idle_runtime_does_not_tick(make_runtime):  # noqa: F811
    runtime = make_runtime(FakeEngine())
    assert ticks_over(runtime, 0.3) == 0


def test_a_guest_blocked_in_receive_is_not_ticked_for(components, make_runtime):  # noqa: F811
    runtime = make_runtime(FakeEngine())
    instance_id = launch(runtime, components, "echo")
    time.sleep(0.2)                                   # it starts and blocks in receive
    assert ticks_over(runtime, 0.3) == 0
    assert runtime.send(instance_id, "")
    assert runtime.wait(instance_id, timeout=5).value == "bye"


def test_a_guest_computing_after_a_wait_is_ticked_for_and_trapped(components,  # noqa: F811
                                                                   make_runtime):
    runtime = make_runtime(FakeEngine(), InstanceLimits(max_idle_s=0.3))
    instance_id = launch(runtime, components, "wake_spin")
    time.sleep(0.2)
    assert ticks_over(runtime, 0.2) == 0              # blocked in receive
    assert runtime.send(instance_id, "go")
    started = time.monotonic()
    outcome = runtime.wait(instance_id, timeout=10)
    assert (outcome.status, outcome.value) == ("trap", "no host call for 0.3 s")
    assert 0.3 <= time.monotonic() - started < 0.3 + IDLE_WAIT_S + 2.0
    assert runtime.num_epoch_ticks >= 5               # ticked while it computed


def test_terminate_stops_a_guest_computing_after_a_wait_quickly(components,  # noqa: F811
                                                                 make_runtime):
    runtime = make_runtime(FakeEngine(), InstanceLimits(max_idle_s=60))
    instance_id = launch(runtime, components, "wake_spin")
    time.sleep(0.2)
    assert runtime.send(instance_id, "go")
    time.sleep(0.1)                                   # computing; the ticker may be resting
    started = time.monotonic()
    runtime.terminate(instance_id, "stop")
    outcome = runtime.wait(instance_id, timeout=5)
    assert (outcome.status, outcome.value) == ("terminated", "stop")
    assert time.monotonic() - started < 1.0           # terminate woke the ticker


def test_the_activity_count_balances_and_wakes_its_waiter():
    activity = GuestActivity()
    activity.enter()
    with pytest.raises(RuntimeError):
        with activity.blocked():
            assert activity.num_active == 0
            raise RuntimeError("a wait that failed")
    assert activity.num_active == 1
    activity.leave()
    started = time.monotonic()
    activity.wait_for_guests(0.05)                    # nobody: waits out its timeout
    assert time.monotonic() - started >= 0.04
    for wake in (lambda: activity.enter(wake=True), activity.wake):
        timer = threading.Timer(0.05, wake)
        timer.start()
        started = time.monotonic()
        activity.wait_for_guests(5.0)
        assert time.monotonic() - started < 2.0
        timer.join()
    assert activity.num_active == 1
