"""The overlapped engine loop's short path (host/scheduling/lookahead.py: `_chain`): once a batch
is only passes prepared ahead, the next goes to the engine without the scheduler's lock and is
recorded when the helper resolves it. The toy decode loops of test_overlap.py, over a fake engine
that fails a chosen batch."""
from __future__ import annotations

import time
from typing import Callable

from engine.batch import ForwardBatch, ForwardResult
from engine.errors import RequestError
from host.errors import Cancelled
from host.scheduling.scheduler import BatchScheduler
from tests.host.test_overlap import OVERLAP, PAGE_SIZE, RecordingEngine, _expected, _loops
from tests.host.test_scheduler import pass_on


class FailingEngine(RecordingEngine):
    """Raises `make_error(batch)` instead of running the batch numbered `failing_batch` (0 the
    first); runs the others."""

    def __init__(self, failing_batch: int, make_error: Callable[[ForwardBatch], Exception],
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.failing_batch, self.make_error = failing_batch, make_error
        self.num_calls = 0

    def forward(self, batch: ForwardBatch) -> list[ForwardResult]:
        self.num_calls += 1
        if self.num_calls - 1 == self.failing_batch:
            raise self.make_error(batch)
        return super().forward(batch)


def _run(engine: RecordingEngine, prompts: list[list[int]], num_steps: int):
    scheduler = BatchScheduler(engine, OVERLAP)
    loops = _loops(scheduler, prompts, num_steps)
    with scheduler:
        for loop in loops:
            assert loop.finished.wait(10)
        time.sleep(0.05)                              # a pass still to run would have by now
        stats = scheduler.statistics()
    return loops, stats


def test_batches_of_passes_prepared_ahead_are_counted_like_the_others() -> None:
    engine = RecordingEngine(batch_delay_s=0.002)
    loops, stats = _run(engine, [[3], [8], [5]], 3)
    for loop, prompt in zip(loops, [[3], [8], [5]]):
        assert loop.outcomes == _expected(prompt, 3)
    assert len(engine.given) == 3
    assert (stats.num_batches, stats.num_forwards, stats.num_failed_batches) == (3, 9, 0)
    assert stats.batch_size_histogram == ((3, 3),)


def test_a_failed_batch_of_passes_prepared_ahead_fails_them_and_drops_the_ones_after() -> None:
    engine = FailingEngine(1, lambda batch: RuntimeError("fake engine: batch 1 failed"))
    loops, stats = _run(engine, [[3], [8]], 3)
    assert len(engine.given) == 1                     # batch 2 was never formed
    for loop, prompt in zip(loops, [[3], [8]]):
        first, dropped, failed = loop.outcomes
        assert first == _expected(prompt, 1)[0]
        assert isinstance(dropped, Cancelled) and "pass before it" in str(dropped)
        assert isinstance(failed, RuntimeError) and "batch 1 failed" in str(failed)
        assert loop.done_calls == 3                   # every pin released once
    assert (stats.num_batches, stats.num_failed_batches) == (2, 1)


def test_a_request_error_in_a_batch_of_passes_prepared_ahead_fails_that_pass_alone() -> None:
    """The engine refuses owner1's pass (index 1) in batch 1: that loop ends with the error,
    its pass prepared after it is dropped; owner0's pass runs again alone and its loop ends as
    if nothing happened."""
    engine = FailingEngine(1, lambda batch: RequestError(1, "page_ids", "refused"))
    loops, stats = _run(engine, [[3], [8]], 4)
    assert loops[0].outcomes == _expected([3], 4)
    first, dropped, refused = loops[1].outcomes
    assert first == _expected([8], 1)[0]
    assert isinstance(dropped, Cancelled) and "pass before it" in str(dropped)
    assert isinstance(refused, RequestError) and refused.reason == "refused"
    assert [len(batch.requests) for batch in engine.given] == [2, 1, 1, 1]
    assert (stats.num_batches, stats.num_forwards, stats.num_failed_batches) == (4, 6, 1)
    assert loops[1].done_calls == 3 and loops[0].done_calls == 4


def test_a_pass_submitted_while_loops_run_ahead_joins_their_next_batch() -> None:
    """The short path yields as soon as anything is queued: another owner's pass goes into the
    batch after the one running when it came, beside the loops' passes prepared ahead."""
    engine = RecordingEngine(batch_delay_s=0.02)
    scheduler = BatchScheduler(engine, OVERLAP)
    loops = _loops(scheduler, [[3], [8]], 3)
    with scheduler:
        deadline = time.monotonic() + 10
        while len(engine.given) < 2:                  # batch 2 runs, on the short path
            assert time.monotonic() < deadline
            time.sleep(0.001)
        num_before = len(engine.given)
        other = scheduler.submit_forward(("x", 0), "normal", pass_on(9, [7], 1, PAGE_SIZE))
        other.result(timeout=10)
        for loop in loops:
            assert loop.finished.wait(10)
    joined = [index for index, batch in enumerate(engine.given)
              if any(request.page_ids == (9,) for request in batch.requests)]
    assert joined == [num_before] == [2]              # batch 3, the loops' last passes in it
    assert len(engine.given[2].requests) == 3
    for loop, prompt in zip(loops, [[3], [8]]):
        assert loop.outcomes == _expected(prompt, 3)
