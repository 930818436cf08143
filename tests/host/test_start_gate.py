"""Instances start at most `start_slots` at once (host/sandbox/start_gate.py): a start gives its
slot back at its guest's first host wait or its end, a start that holds one past max_hold_s stops
holding the others up, and one terminated while it waits ends at once."""
from __future__ import annotations

import threading
import time

import pytest

from host import InstanceLimits, RuntimeConfig
from host.sandbox.guest_activity import GuestActivity
from host.sandbox.start_gate import StartGate, default_start_slots, start_gate_for
from tests.host.components import components, make_runtime, program_cache_dir  # noqa: F401
from tests.host.fake_engine import FakeEngine
from tests.host.test_instance import launch


def test_at_most_num_slots_hold_at_once():
    gate = StartGate(2, max_hold_s=30)
    first, second = gate.acquire(), gate.acquire()
    acquired = threading.Event()
    waiter = threading.Thread(target=lambda: (gate.acquire(), acquired.set()))
    waiter.start()
    assert not acquired.wait(0.2)                     # both slots held
    gate.release(first)
    assert acquired.wait(2)
    waiter.join()
    assert gate.num_holding == 2
    gate.release(second)
    assert gate.num_holding == 1


def test_a_hold_past_max_hold_s_stops_counting():
    gate = StartGate(1, max_hold_s=0.2)
    stuck = gate.acquire()                            # never released: a spinning guest
    started = time.monotonic()
    token = gate.acquire()
    assert 0.15 <= time.monotonic() - started < 2.0
    gate.release(stuck)                               # its late release frees nothing twice
    assert gate.num_holding == 1
    gate.release(token)
    assert gate.num_holding == 0


def test_config_and_bounds():
    assert start_gate_for(0) is None
    assert start_gate_for(3).num_slots == 3
    assert start_gate_for(None).num_slots == default_start_slots() >= 2
    for bad in (-1, 4097, 2.0):
        with pytest.raises(ValueError, match="start_slots"):
            RuntimeConfig(start_slots=bad)
    with pytest.raises(ValueError):
        StartGate(0)


def test_the_first_wait_gives_the_slot_back_once():
    gate = StartGate(1, max_hold_s=30)
    activity = GuestActivity(gate)
    activity.start()
    assert gate.num_holding == 1
    with activity.blocked():
        assert gate.num_holding == 0
    other = gate.acquire()                            # the slot is someone else's now
    with activity.blocked():                          # a later wait frees nothing of theirs
        pass
    activity.end()
    assert gate.num_holding == 1 and activity.num_active == 0
    gate.release(other)


def test_a_guest_blocked_in_receive_does_not_hold_up_the_next_start(components,  # noqa: F811
                                                                     make_runtime):
    runtime = make_runtime(FakeEngine(), start_slots=1)
    runtime.services.guests.start_gate.max_hold_s = 30    # only the wait can free the slot
    waiting = launch(runtime, components, "echo")         # blocks in receive
    started = time.monotonic()
    outcome = runtime.wait(launch(runtime, components, "info"), timeout=10)
    assert outcome.status == "ok"
    assert time.monotonic() - started < 5.0
    assert runtime.send(waiting, "")
    assert runtime.wait(waiting, timeout=5).value == "bye"
    assert runtime.services.guests.start_gate.num_holding == 0


def test_a_spinning_guest_delays_the_next_start_by_max_hold_s_only(components,  # noqa: F811
                                                                   make_runtime):
    runtime = make_runtime(FakeEngine(), InstanceLimits(max_idle_s=30), start_slots=1)
    runtime.services.guests.start_gate.max_hold_s = 0.3
    spinning = launch(runtime, components, "spin")        # never calls the host
    time.sleep(0.05)
    started = time.monotonic()
    outcome = runtime.wait(launch(runtime, components, "info"), timeout=10)
    assert outcome.status == "ok"
    assert 0.2 <= time.monotonic() - started < 5.0
    assert runtime.terminate(spinning, "stop")
    assert runtime.wait(spinning, timeout=5).status == "terminated"


def test_a_start_terminated_while_it_waits_ends_at_once_and_balances(components,  # noqa: F811
                                                                      make_runtime):
    runtime = make_runtime(FakeEngine(), InstanceLimits(max_idle_s=30), start_slots=1)
    guests = runtime.services.guests
    guests.start_gate.max_hold_s = 30                     # the spinner keeps the one slot
    spinning = launch(runtime, components, "spin")
    time.sleep(0.05)
    queued = launch(runtime, components, "info")
    time.sleep(0.05)
    started = time.monotonic()
    assert runtime.terminate(queued, "changed my mind")
    outcome = runtime.wait(queued, timeout=5)
    assert (outcome.status, outcome.value) == ("terminated", "changed my mind")
    assert time.monotonic() - started < 2.0               # not after the spinner's 30 s
    assert runtime.terminate(spinning, "stop")
    assert runtime.wait(spinning, timeout=5).status == "terminated"
    deadline = time.monotonic() + 5                       # the queued thread ends by itself
    while (guests.num_active or guests.start_gate.num_holding) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (guests.num_active, guests.start_gate.num_holding) == (0, 0)


class _HeldEngine(FakeEngine):
    """A FakeEngine whose passes wait until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def forward(self, batch):
        self.release.wait(30)
        return super().forward(batch)


def test_a_guest_blocked_on_a_pass_gives_its_slot_back_and_is_counted_out(  # noqa: F811
        components, make_runtime):  # noqa: F811
    engine = _HeldEngine()
    runtime = make_runtime(engine, start_slots=1)
    guests = runtime.services.guests
    guests.start_gate.max_hold_s = 30                 # only the wait can free the slot
    waiting = launch(runtime, components, "bench_calls", "step", "1")
    deadline = time.monotonic() + 10
    while (guests.start_gate.num_holding or guests.num_active) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert guests.start_gate.num_holding == 0         # forward-future.get's wait gave it back
    assert guests.num_active == 0                     # and counted the guest out meanwhile
    assert runtime.statistics().num_running == 1
    engine.release.set()
    assert runtime.wait(waiting, timeout=10).status == "ok"
    assert guests.num_active == 0 and guests.start_gate.num_holding == 0
