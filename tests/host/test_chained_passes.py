"""BatchScheduler.submit_chained from a batch's own resolution (a host decode loop's next step):
queued together once the batch has resolved, in the order submitted; cancelled when the
scheduler closed meanwhile."""
from __future__ import annotations

import dataclasses
import threading
import time

from engine.batch import ForwardResult
from host.errors import Cancelled
from host.scheduling.scheduler import BatchScheduler
from tests.host.fake_engine import FakeEngine, fake_next_token
from tests.host.test_scheduler import first_tokens, pass_on


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_chained_passes_from_a_resolution_are_queued_after_it_in_order(fake_engine) -> None:
    scheduler = BatchScheduler(fake_engine)
    pending_seen: list[int] = []
    outcomes: dict[str, object] = {}

    def chain(name: str, page_id: int, token_id: int):
        def on_first(_future) -> None:
            assert scheduler.submit_chained((name, 0), "normal", pass_on(page_id, [token_id], 2),
                                            lambda outcome: outcomes.__setitem__(name, outcome))
            pending_seen.append(scheduler.statistics().num_pending)
        return on_first

    first_a = scheduler.submit_forward(("a", 0), "normal", pass_on(0, [1], 1))
    first_b = scheduler.submit_forward(("b", 0), "normal", pass_on(1, [5], 1))
    first_a.add_done_callback(chain("a", 0, 2))
    first_b.add_done_callback(chain("b", 1, 6))
    with scheduler:
        _wait_for(lambda: len(outcomes) == 2)
    assert pending_seen == [0, 0]           # neither visible while the batch still resolved
    assert [first_tokens(batch) for batch in fake_engine.batches] == [[1, 5], [2, 6]]
    assert outcomes == {"a": ForwardResult((fake_next_token([1, 2]),)),
                        "b": ForwardResult((fake_next_token([5, 6]),))}


def test_a_chained_pass_queued_after_the_scheduler_closed_is_cancelled() -> None:
    engine = FakeEngine(num_pages=8, page_size=4)
    scheduler = BatchScheduler(engine)
    calls: list = []
    closer = threading.Thread(target=scheduler.close)

    def on_first(_future) -> None:          # on the thread resolving the first batch
        closer.start()                      # close() marks the scheduler closed, then waits
        _wait_for(lambda: scheduler.submit_forward(("probe", 0), "normal",
                                                   pass_on(3, [9], 1)).done())
        prepared = dataclasses.replace(pass_on(0, [2], 2), on_done=lambda: calls.append("on_done"))
        assert scheduler.submit_chained(("a", 0), "normal", prepared, calls.append)

    scheduler.submit_forward(("a", 0), "normal", pass_on(0, [1], 1)).add_done_callback(on_first)
    scheduler.start()
    _wait_for(lambda: len(calls) == 2)
    closer.join(timeout=10)
    assert calls[0] == "on_done" and isinstance(calls[1], Cancelled)
    assert [first_tokens(batch) for batch in engine.batches] == [[1]]
    assert scheduler.statistics().num_pending == 0


def test_cancel_owner_drops_chained_passes_not_queued_yet(fake_engine) -> None:
    """An instance's end (its loops stopped, then cancel_owner) while the batch that chained
    its next pass still resolves: that pass never runs, on pages the instance no longer holds."""
    scheduler = BatchScheduler(fake_engine)
    calls: list = []

    def on_first(_future) -> None:          # on the thread resolving the first batch
        prepared = dataclasses.replace(pass_on(0, [2], 2), on_done=lambda: calls.append("on_done"))
        assert scheduler.submit_chained(("a", 0), "normal", prepared, calls.append)
        canceller = threading.Thread(target=scheduler.cancel_owner, args=("a",))
        canceller.start()
        canceller.join(timeout=10)

    scheduler.submit_forward(("a", 0), "normal", pass_on(0, [1], 1)).add_done_callback(on_first)
    scheduler.submit_forward(("b", 0), "normal", pass_on(1, [5], 1))
    with scheduler:
        _wait_for(lambda: len(calls) == 2)
        time.sleep(0.05)                    # a pass queued anyway would have run by now
    assert calls[0] == "on_done" and isinstance(calls[1], Cancelled)
    assert [first_tokens(batch) for batch in fake_engine.batches] == [[1, 5]]
    stats = scheduler.statistics()
    assert (stats.num_pending, stats.num_cancelled) == (0, 1)
