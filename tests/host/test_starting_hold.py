"""The adaptive policy's hold for starting instances (SchedulerPolicy.start_hold_ms): without
overlap, a batch of first passes waits, at most start_hold_ms, for the owners launched and not
yet blocked, each of them once; a batch with any other pass is not held."""
from __future__ import annotations

import threading
import time

import pytest

from host.scheduling import policy as batch_policy
from host.scheduling.scheduler import BatchScheduler, SchedulerPolicy
from tests.host.fake_engine import FakeEngine
from tests.host.test_scheduler import pass_on

LONG_HOLD = SchedulerPolicy(start_hold_ms=1000, max_hold_ms=0)   # bound: 1 s; no hold after a batch


def submit_and_wait(scheduler: BatchScheduler, owner: str, page_id: int, delay_s: float = 0.0):
    """A starting instance: some start-up work, then its first pass, blocked on."""
    time.sleep(delay_s)
    scheduler.submit_forward((owner, 0), "normal", pass_on(page_id, [page_id + 1], 1)
                             ).result(timeout=30)


def seconds_to_result(scheduler: BatchScheduler, owner: str, page_id: int = 0) -> float:
    """How long `owner`'s first pass took from submission to its result."""
    started = time.monotonic()
    submit_and_wait(scheduler, owner, page_id)
    return time.monotonic() - started


def first_batch_sizes(policy: SchedulerPolicy) -> list[int]:
    """Two owners launched together, the second submitting 50 ms after the first."""
    engine = FakeEngine(num_pages=8, page_size=4)
    with BatchScheduler(engine, policy) as scheduler:
        scheduler.owner_starting("a")
        scheduler.owner_starting("b")
        threads = [threading.Thread(target=submit_and_wait, args=(scheduler, owner, i, delay))
                   for i, (owner, delay) in enumerate((("a", 0.0), ("b", 0.05)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return [len(batch.requests) for batch in engine.batches]


def test_the_first_pass_waits_for_the_instances_starting_beside_it():
    assert first_batch_sizes(LONG_HOLD) == [2]


def test_without_the_hold_the_first_pass_runs_alone():
    policy = SchedulerPolicy(start_hold_ms=0)
    assert first_batch_sizes(policy) == [1, 1]


def test_the_hold_is_bounded_and_taken_once_per_starting_owner():
    """An owner that never submits delays the first batch by start_hold_ms, the second not."""
    engine = FakeEngine(num_pages=8, page_size=4)
    with BatchScheduler(engine, SchedulerPolicy(start_hold_ms=200)) as scheduler:
        scheduler.owner_starting("a")
        scheduler.owner_starting("silent")
        first_s = seconds_to_result(scheduler, "a")
        second_s = seconds_to_result(scheduler, "a")
        stats = scheduler.statistics()
    assert 0.15 <= first_s < 2.0 and second_s < 0.1
    assert stats.num_hold_timeouts >= 1 and stats.num_batches == 2


def test_an_owner_that_blocks_elsewhere_or_ends_is_no_longer_waited_for():
    """Blocking on anything (owner_waiting: a message, a decode loop's outputs) or ending
    (cancel_owner) ends the wait for that owner."""
    engine = FakeEngine(num_pages=8, page_size=4)
    for release in ("owner_waiting", "cancel_owner"):
        with BatchScheduler(engine, LONG_HOLD) as scheduler:
            scheduler.owner_starting("a")
            scheduler.owner_starting("other")
            timer = threading.Timer(0.05, getattr(scheduler, release), args=("other",))
            timer.start()
            held_s = seconds_to_result(scheduler, "a")
            timer.join()
            assert 0.04 <= held_s < 0.5, release
            assert scheduler.statistics().num_hold_timeouts == 0


def test_a_lone_instance_is_not_held():
    engine = FakeEngine(num_pages=8, page_size=4)
    with BatchScheduler(engine, LONG_HOLD) as scheduler:
        scheduler.owner_starting("alone")
        assert seconds_to_result(scheduler, "alone") < 0.5      # held to the bound: 1 s
        assert scheduler.statistics().num_hold_timeouts == 0


def test_no_hold_with_k_or_t():
    engine = FakeEngine(num_pages=8, page_size=4)
    with BatchScheduler(engine, SchedulerPolicy("k-or-t", k=1, start_hold_ms=1000)) as scheduler:
        scheduler.owner_starting("a")
        scheduler.owner_starting("silent")
        assert seconds_to_result(scheduler, "a") < 0.5


def test_a_running_generations_pass_is_not_held_for_starting_instances():
    """An owner whose passes have run before (a generation under way) fires at once, though an
    instance is starting; the starting one's own first pass is then not held either."""
    engine = FakeEngine(num_pages=8, page_size=4)
    with BatchScheduler(engine, LONG_HOLD) as scheduler:
        scheduler.owner_starting("running")
        submit_and_wait(scheduler, "running", 0)          # its first pass: nobody else starting
        scheduler.owner_starting("silent")
        assert seconds_to_result(scheduler, "running") < 0.5     # held to the bound: 1 s
        assert scheduler.statistics().num_hold_timeouts == 0


def test_a_burst_of_launches_runs_its_first_passes_together(monkeypatch):
    """The first instance of a burst can queue its pass and block before the next launch is
    known: the batch waits until no launch has come for LAUNCH_BURST_GAP_S (widened here so that
    a slow machine still launches "b" inside it)."""
    monkeypatch.setattr(batch_policy, "LAUNCH_BURST_GAP_S", 0.5)
    engine = FakeEngine(num_pages=8, page_size=4)
    with BatchScheduler(engine, LONG_HOLD) as scheduler:
        scheduler.owner_starting("a")
        first = scheduler.submit_forward(("a", 0), "normal", pass_on(0, [1], 1))
        scheduler.owner_waiting("a")                   # blocked before "b" was launched
        time.sleep(0.1)                                # without the wait "a" runs alone here
        scheduler.owner_starting("b")
        second = scheduler.submit_forward(("b", 0), "normal", pass_on(1, [2], 1))
        scheduler.owner_waiting("b")
        first.result(timeout=30)
        second.result(timeout=30)
    assert [len(batch.requests) for batch in engine.batches] == [2]


def test_the_wait_for_a_burst_ends_at_the_start_hold_bound(monkeypatch):
    monkeypatch.setattr(batch_policy, "LAUNCH_BURST_GAP_S", 30.0)
    engine = FakeEngine(num_pages=8, page_size=4)
    with BatchScheduler(engine, SchedulerPolicy(start_hold_ms=200, max_hold_ms=0)) as scheduler:
        scheduler.owner_starting("a")
        held_s = seconds_to_result(scheduler, "a")
    assert 0.15 <= held_s < 2.0


def test_a_childs_spawn_opens_no_wait_for_a_burst(monkeypatch):
    """A spawned child (burst=False) is waited for while it starts, like a launch, but its spawn
    does not make a lone first pass wait for more launches: the same pass as above runs at once."""
    monkeypatch.setattr(batch_policy, "LAUNCH_BURST_GAP_S", 30.0)
    engine = FakeEngine(num_pages=8, page_size=4)
    with BatchScheduler(engine, SchedulerPolicy(start_hold_ms=200, max_hold_ms=0)) as scheduler:
        scheduler.owner_starting("child", burst=False)
        assert seconds_to_result(scheduler, "child") < 0.1
        scheduler.owner_starting("a", burst=False)
        scheduler.owner_starting("b", burst=False)       # spawned before "a" blocked
        threads = [threading.Thread(target=submit_and_wait, args=(scheduler, owner, i, delay))
                   for i, (owner, delay) in enumerate((("a", 0.0), ("b", 0.05)), start=2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert [len(batch.requests) for batch in engine.batches] == [1, 2]


def test_start_hold_ms_is_validated():
    with pytest.raises(ValueError, match="SchedulerPolicy.start_hold_ms must be >= 0"):
        SchedulerPolicy(start_hold_ms=-1)


def test_launches_that_keep_coming_hold_a_first_pass_no_longer_than_the_bound():
    """Each new instance starting would re-arm a hold; the bound counts from the pass's own
    submission, so a stream of launches (a tenant launching without end) cannot starve it."""
    engine = FakeEngine(num_pages=8, page_size=4)
    stop = threading.Event()
    with BatchScheduler(engine, SchedulerPolicy(start_hold_ms=200, max_hold_ms=0)) as scheduler:
        scheduler.owner_starting("a")
        scheduler.owner_starting("stream-first")

        def launch_forever() -> None:
            for i in range(100):                   # one launch every 20 ms for 2 s
                if stop.wait(0.02):
                    return
                scheduler.owner_starting(f"stream-{i}")

        launcher = threading.Thread(target=launch_forever)
        launcher.start()
        held_s = seconds_to_result(scheduler, "a")
        stop.set()
        launcher.join()
    assert 0.15 <= held_s < 0.6


def test_the_runtime_holds_first_passes_on_a_cpu_engine_only():
    from host.runtime_defaults import start_hold_by_default

    class GpuEngine:
        device = type("Device", (), {"type": "cuda"})()

    assert start_hold_by_default(FakeEngine(num_pages=8, page_size=4)) == 500.0
    assert start_hold_by_default(GpuEngine()) == 0.0


def test_with_overlap_the_first_pass_waits_too():
    policy = SchedulerPolicy(start_hold_ms=1000, max_hold_ms=0, overlap=True)
    assert first_batch_sizes(policy) == [2]


def test_with_overlap_a_running_loop_is_never_held_for_a_starting_owner():
    """A loop's passes prepared ahead keep running while instances start: the first pass of
    one of them arriving meanwhile (every queued pass a first one) holds nothing of the loop's
    (the 1 s bound would show)."""
    from tests.host.test_overlap import ToyLoop

    engine = FakeEngine(num_pages=8, page_size=4, batch_delay_s=0.05)
    policy = SchedulerPolicy(start_hold_ms=1000, max_hold_ms=0, overlap=True)
    with BatchScheduler(engine, policy) as scheduler:
        loop = ToyLoop(scheduler, "running", 0, [3], 3)
        loop.num_expected = 3
        deadline = time.monotonic() + 10
        while not engine.batches:                      # the loop's first pass ran
            assert time.monotonic() < deadline
            time.sleep(0.005)
        started = time.monotonic()
        scheduler.owner_starting("new")
        scheduler.owner_starting("silent")             # launched, never submits
        newcomer = threading.Thread(target=submit_and_wait, args=(scheduler, "new", 1))
        newcomer.start()
        assert loop.finished.wait(10)
        loop_s = time.monotonic() - started
        newcomer.join()
    assert loop_s < 0.5
