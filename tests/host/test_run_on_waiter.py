"""SchedulerPolicy.run_on_waiter: under the adaptive policy, the thread about to block on a pass
runs the batch itself when it may fire (no hand-off to the engine thread and back)."""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from host.scheduling.scheduler import BatchScheduler, SchedulerPolicy
from tests.host.fake_engine import FakeEngine
from tests.host.test_scheduler import LONG_HOLD, decode_loop


def record_runner_names(engine: FakeEngine) -> list[str]:
    """The name of the thread of each engine.forward call, in order."""
    names, forward = [], engine.forward
    engine.forward = lambda batch: names.append(threading.current_thread().name) or forward(batch)
    return names


def test_adaptive_runs_the_batch_on_the_thread_that_blocks_on_it():
    """A lone decode loop: once its first pass has run, every batch runs on the loop's own thread
    (it blocks on its pass when the batch may fire), with no hand-off to the engine thread."""
    engine = FakeEngine(num_pages=64, page_size=4, batch_delay_s=0.002, keep_log=False)
    runner_names = record_runner_names(engine)
    with BatchScheduler(engine, LONG_HOLD) as scheduler:
        decode_loop(scheduler, "alone", 10, 0)
        stats = scheduler.statistics()
    assert runner_names[1:] == [threading.current_thread().name] * 9
    assert stats.num_forwards == 10 and stats.num_hold_timeouts == 0


@pytest.mark.parametrize("policy", [SchedulerPolicy("k-or-t", k=1, t_ms=1.0),
                                    replace(LONG_HOLD, run_on_waiter=False)])
def test_batches_stay_on_the_engine_thread_unless_run_on_waiter(policy):
    engine = FakeEngine(num_pages=64, page_size=4, batch_delay_s=0.001, keep_log=False)
    runner_names = record_runner_names(engine)
    with BatchScheduler(engine, policy) as scheduler:
        decode_loop(scheduler, "alone", 5, 0)
    assert runner_names == ["pie-engine"] * 5


def test_close_waits_for_a_batch_running_on_a_waiting_thread():
    """close() returns only once the batch in flight on a waiting thread has ended."""
    engine = FakeEngine(num_pages=64, page_size=4, batch_delay_s=0.2, keep_log=False)
    scheduler = BatchScheduler(engine, LONG_HOLD)
    scheduler.start()
    decode_loop(scheduler, "warm", 1, 0)                 # a hold is on for "warm" from now
    waiter = threading.Thread(target=decode_loop, args=(scheduler, "warm", 1, 0))
    waiter.start()
    while not scheduler._running:                       # the 0.2 s batch has started
        time.sleep(0.001)
    scheduler.close()
    assert not scheduler._running and scheduler.statistics().num_forwards == 2
    waiter.join(timeout=10)


def test_run_on_waiter_must_be_a_bool():
    with pytest.raises(ValueError, match="SchedulerPolicy.run_on_waiter must be a bool"):
        SchedulerPolicy(run_on_waiter="yes")
