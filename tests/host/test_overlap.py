"""SchedulerPolicy.overlap (host/scheduling/lookahead.py), over the fake engine with toy decode
loops: each pass offers `prepare_next`, the pass after it, whose token the engine is fed from the
pass before. The loops' outputs equal the fake model's; passes prepared ahead whose predecessor
failed or whose owner ended never run and end (on_done, then a Cancelled outcome)."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Callable

import pytest

from engine.batch import ForwardBatch, ForwardResult
from host.errors import Cancelled
from host.runtime_defaults import overlap_by_default
from host.scheduling.helper_thread import HelperThread
from host.scheduling.scheduler import BatchScheduler, SchedulerPolicy
from host.scheduling.work import PreparedForward
from tests.host.fake_engine import FakeEngine, fake_next_token
from tests.host.test_scheduler import pass_on

PAGE_SIZE = 4
OVERLAP = SchedulerPolicy(overlap=True)


class RecordingEngine(FakeEngine):
    """The fake engine, keeping each batch as the scheduler gave it (fed_from included)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(num_pages=64, page_size=PAGE_SIZE, **kwargs)
        self.given: list[ForwardBatch] = []

    def forward(self, batch: ForwardBatch) -> list[ForwardResult]:
        self.given.append(batch)
        return super().forward(batch)


class ToyLoop:
    """`num_steps` one-token passes on its own page (at most PAGE_SIZE tokens), prepared ahead
    when the scheduler asks; `outcomes` in the order they came."""

    def __init__(self, scheduler: BatchScheduler, owner: str, page_id: int, prompt: list[int],
                 num_steps: int) -> None:
        self.scheduler, self.owner, self.page_id = scheduler, owner, page_id
        self.kv_len, self.num_left = len(prompt), num_steps
        self.outcomes: list[object] = []
        self.done_calls = self.num_prepared = 0
        self.finished = threading.Event()
        scheduler.submit_forward((owner, 0), "normal", self._pass(prompt),
                                 self.prepare_next).add_done_callback(
            lambda future: self.on_outcome(future.exception() or future.result()))

    def _pass(self, token_ids: list[int]) -> PreparedForward:
        prepared = pass_on(self.page_id, token_ids, self.kv_len, PAGE_SIZE)
        return PreparedForward(prepared.request, (), self._on_done)

    def _on_done(self) -> None:
        self.done_calls += 1

    def prepare_next(self) -> tuple[PreparedForward, Callable] | None:
        if self.num_left <= 1:
            return None
        self.num_left -= 1
        self.num_prepared += 1
        self.kv_len += 1
        return self._pass([0]), self.on_outcome

    def on_outcome(self, outcome: object) -> None:
        self.outcomes.append(outcome)
        if isinstance(outcome, BaseException) or len(self.outcomes) == self.num_expected:
            self.finished.set()

    num_expected = 0


def _expected(prompt: list[int], num_steps: int) -> list[ForwardResult]:
    context, results = list(prompt), []
    for _ in range(num_steps):
        results.append(ForwardResult((fake_next_token(context),)))
        context.append(results[-1].outputs[0])
    return results


def _loops(scheduler, prompts: list[list[int]], num_steps: int) -> list[ToyLoop]:
    loops = []
    for index, prompt in enumerate(prompts):
        loop = ToyLoop(scheduler, f"owner{index}", index, prompt, num_steps)
        loop.num_expected = num_steps
        loops.append(loop)
    return loops


def test_each_batch_runs_the_passes_prepared_during_the_one_before_fed_their_tokens() -> None:
    engine = RecordingEngine(batch_delay_s=0.002)
    prompts = [[3], [8], [5]]
    scheduler = BatchScheduler(engine, OVERLAP)
    loops = _loops(scheduler, prompts, 3)               # kv 1 + 3 steps: one page each
    with scheduler:
        for loop in loops:
            assert loop.finished.wait(10)
    for loop, prompt in zip(loops, prompts):
        assert loop.outcomes == _expected(prompt, 3)
        assert loop.done_calls == 3
    assert [len(batch.requests) for batch in engine.given] == [3, 3, 3]
    assert engine.given[0].fed_from is None
    for batch in engine.given[1:]:
        assert all(source is not None for source in batch.fed_from)
        assert [request.token_ids for request in batch.requests] == [(0,)] * 3
    assert scheduler.statistics().num_pending == 0


def test_loops_of_different_lengths_each_get_the_tokens_of_their_own_passes() -> None:
    """Once a loop ends the passes prepared ahead follow a subset of the running batch: each
    still gets its input token from its own loop's pass."""
    engine = RecordingEngine(batch_delay_s=0.002)
    prompts, lengths = [[3], [8], [5]], [1, 3, 2]
    scheduler = BatchScheduler(engine, OVERLAP)
    loops = []
    for index, (prompt, num_steps) in enumerate(zip(prompts, lengths)):
        loop = ToyLoop(scheduler, f"owner{index}", index, prompt, num_steps)
        loop.num_expected = num_steps
        loops.append(loop)
    with scheduler:
        for loop in loops:
            assert loop.finished.wait(10)
    for loop, prompt, num_steps in zip(loops, prompts, lengths):
        assert loop.outcomes == _expected(prompt, num_steps)
    assert [len(batch.requests) for batch in engine.given] == [3, 2, 1]
    assert [request.page_ids[0] for request in engine.given[1].requests] == [1, 2]


def test_a_failed_batch_drops_the_passes_prepared_after_its_passes() -> None:
    engine = RecordingEngine()
    engine.fail_next_batches(1)
    scheduler = BatchScheduler(engine, OVERLAP)
    loops = _loops(scheduler, [[3], [8]], 3)
    with scheduler:
        for loop in loops:
            assert loop.finished.wait(10)
        time.sleep(0.05)                                # a pass still to run would have by now
    assert len(engine.given) == 1                       # the prepared ones never ran
    for loop in loops:
        dropped, failed = loop.outcomes             # the drop comes first (engine thread)
        assert isinstance(dropped, Cancelled) and "pass before it" in str(dropped)
        assert isinstance(failed, RuntimeError)
        assert loop.done_calls == 2                     # both pins released


def test_cancel_owner_drops_its_passes_prepared_ahead() -> None:
    engine = RecordingEngine(batch_delay_s=0.05)
    scheduler = BatchScheduler(engine, OVERLAP)
    loops = _loops(scheduler, [[3], [8]], 3)
    with scheduler:
        deadline = time.monotonic() + 10
        while not engine.given:                         # the first batch runs; owner0 ends
            assert time.monotonic() < deadline
            time.sleep(0.005)
        scheduler.cancel_owner("owner0")
        assert loops[1].finished.wait(10)
        time.sleep(0.1)
    assert loops[1].outcomes == _expected([8], 3)
    assert [isinstance(outcome, Cancelled) for outcome in loops[0].outcomes] == [True, False]
    assert all(len(batch.requests) == 1 for batch in engine.given[1:])   # owner1's alone
    assert loops[0].done_calls == 2


def test_closing_ends_every_pass_once_the_one_running_the_one_ahead_and_the_queued() -> None:
    engine = RecordingEngine(batch_delay_s=0.02)
    scheduler = BatchScheduler(engine, OVERLAP)
    loops = _loops(scheduler, [[3], [8]], 3)
    scheduler.start()
    deadline = time.monotonic() + 10
    while not engine.given:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    scheduler.close()                                 # while the first batch runs
    for loop in loops:
        assert loop.num_prepared == 1
        assert loop.done_calls == 2                   # each pass's pin released once
        assert len(loop.outcomes) == 2
        assert isinstance(loop.outcomes[-1], Cancelled)   # the pass ahead did not run
    assert len(engine.given) == 1


def test_a_queue_with_work_queued_gets_no_pass_prepared_ahead() -> None:
    """A pass queued on the loop's queue behind its pass goes next: the loop's next pass is not
    prepared ahead of it (the toy loop has no other way on)."""
    engine = RecordingEngine()
    scheduler = BatchScheduler(engine, OVERLAP)
    loop = ToyLoop(scheduler, "a", 0, [3], 2)
    loop.num_expected = 1
    other = scheduler.submit_forward(("a", 0), "normal", pass_on(1, [7], 1, PAGE_SIZE))
    with scheduler:
        other.result(timeout=10)
        time.sleep(0.05)
    assert loop.outcomes == _expected([3], 1)
    assert [[r.token_ids for r in batch.requests] for batch in engine.given] == [[(3,)], [(7,)]]


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_the_policy_takes_only_a_bool_or_none(value) -> None:
    with pytest.raises(ValueError, match="overlap must be a bool or None"):
        SchedulerPolicy(overlap=value)


def test_by_default_overlap_is_on_for_an_engine_on_a_gpu_only() -> None:
    class OnDevice(FakeEngine):
        def __init__(self, device_type: str) -> None:
            super().__init__(num_pages=8, page_size=PAGE_SIZE)
            self.device = SimpleNamespace(type=device_type)
    assert overlap_by_default(OnDevice("cuda")) is True
    assert overlap_by_default(OnDevice("cpu")) is False
    assert overlap_by_default(FakeEngine()) is False


def test_the_helper_thread_returns_each_calls_value_or_raises_its_error() -> None:
    with HelperThread("test-helper") as helper:
        helper.start(lambda a, b: a + b, 2, 3)
        assert helper.result() == 5
        helper.start(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            helper.result()
        helper.start(threading.current_thread)
        assert helper.result().name == "test-helper"
    assert not helper._thread.is_alive()
