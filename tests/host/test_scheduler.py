"""BatchScheduler over the fake engine: the batching rule, priorities, policies, failures,
cancellation, and copies ordered with passes."""
from __future__ import annotations

import threading
import time

import pytest

from engine.batch import GREEDY, ForwardRequest, ForwardResult, TokenCopy
from engine.errors import RequestError
from host.errors import Cancelled
from host.kv import ExportRegistry, InstancePages, PageAllocator
from host.scheduling.scheduler import BatchScheduler, SchedulerPolicy
from host.scheduling.work import PreparedForward
from tests.host.components import components, make_runtime, program_cache_dir  # noqa: F401
from tests.host.fake_engine import FakeEngine, fake_next_token


def pass_on(page_id: int, token_ids, kv_len: int, page_size: int = 4) -> PreparedForward:
    """A pass over one page holding kv_len tokens, the last len(token_ids) of them new."""
    n = len(token_ids)
    return PreparedForward(ForwardRequest(tuple(token_ids), tuple(range(kv_len - n, kv_len)),
                                          (page_id,), kv_len, (n - 1,), (GREEDY,)))


def first_tokens(batch) -> list[int]:
    return [request.token_ids[0] for request in batch.requests]


def test_each_queue_contributes_its_head_per_batch(fake_engine):
    scheduler = BatchScheduler(fake_engine)
    futures = [scheduler.submit_forward(("a", 0), "normal", pass_on(0, [t], t)) for t in (1, 2, 3)]
    futures.append(scheduler.submit_forward(("b", 0), "normal", pass_on(1, [9], 1)))
    assert scheduler.synchronize_future(("a", 0)) is futures[2]
    with scheduler:
        results = [f.result(timeout=10) for f in futures]
    assert [first_tokens(b) for b in fake_engine.batches] == [[1, 9], [2], [3]]
    assert fake_engine.page_tokens(0) == (1, 2, 3, -1)
    assert results[2] == ForwardResult((fake_next_token([1, 2, 3]),))
    assert scheduler.synchronize_future(("a", 0)) is None
    stats = scheduler.statistics()
    assert (stats.num_batches, stats.num_forwards, stats.num_pending) == (3, 4, 0)
    assert stats.batch_size_histogram == ((1, 2), (2, 1))


def test_priority_then_age_under_a_token_budget(fake_engine):
    scheduler = BatchScheduler(fake_engine, SchedulerPolicy(max_batch_tokens=2))
    order = [("low", 1), ("normal", 2), ("high", 3), ("normal", 4), ("high", 5)]
    futures = [scheduler.submit_forward((f"i{t}", 0), priority, pass_on(t, [t, t], 2))
               for priority, t in order]
    big = scheduler.submit_forward(("big", 0), "low", pass_on(9, [7, 7, 7], 3))
    with scheduler:
        for future in futures + [big]:
            future.result(timeout=10)
    assert [first_tokens(b) for b in fake_engine.batches] == [[3], [5], [2], [4], [1], [7]]


def test_budget_fills_batches_in_order(fake_engine):
    scheduler = BatchScheduler(fake_engine, SchedulerPolicy(max_batch_tokens=5))
    futures = [scheduler.submit_forward((q, 0), "normal", pass_on(p, tokens, len(tokens)))
               for q, p, tokens in [("a", 0, [1, 1]), ("b", 1, [2, 2]), ("c", 2, [3, 3]),
                                    ("d", 3, [4])]]
    with scheduler:
        for future in futures:
            future.result(timeout=10)
    assert [first_tokens(b) for b in fake_engine.batches] == [[1, 2], [3, 4]]


def test_many_submitters_are_batched():
    engine = FakeEngine(num_pages=64, page_size=8, batch_delay_s=0.002, keep_log=False)
    num_steps = 4
    with BatchScheduler(engine) as scheduler:
        def submitter(index: int) -> None:
            for step in range(num_steps):
                prepared = pass_on(index, [step + 1], step + 1)
                scheduler.submit_forward((str(index), 0), "normal", prepared).result(timeout=30)

        threads = [threading.Thread(target=submitter, args=(i,)) for i in range(64)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats = scheduler.statistics()
    assert stats.num_forwards == 64 * num_steps
    assert stats.max_batch_size > 8
    assert stats.num_batches < 64 * num_steps / 4
    assert all(engine.page_tokens(i)[:num_steps] == (1, 2, 3, 4) for i in range(64))


def test_k_or_t_fires_at_k_queues(fake_engine):
    policy = SchedulerPolicy(kind="k-or-t", k=3, t_ms=60_000)
    with BatchScheduler(fake_engine, policy) as scheduler:
        first = [scheduler.submit_forward((q, 0), "normal", pass_on(p, [1], 1))
                 for q, p in (("a", 0), ("b", 1))]
        time.sleep(0.05)
        assert not any(f.done() for f in first)
        last = scheduler.submit_forward(("c", 0), "normal", pass_on(2, [1], 1))
        last.result(timeout=10)
        assert all(f.done() for f in first)
    assert [len(b.requests) for b in fake_engine.batches] == [3]


def test_k_or_t_fires_after_t(fake_engine):
    policy = SchedulerPolicy(kind="k-or-t", k=64, t_ms=30)
    with BatchScheduler(fake_engine, policy) as scheduler:
        started = time.monotonic()
        scheduler.submit_forward(("a", 0), "normal", pass_on(0, [1], 1)).result(timeout=10)
        assert time.monotonic() - started >= 0.025


def test_engine_failure_fails_only_that_batch(fake_engine):
    with BatchScheduler(fake_engine) as scheduler:
        fake_engine.fail_next_batches(1)
        failed = scheduler.submit_forward(("a", 0), "normal", pass_on(0, [1], 1))
        with pytest.raises(RuntimeError, match="injected failure"):
            failed.result(timeout=10)
        good = scheduler.submit_forward(("a", 0), "normal", pass_on(0, [5], 1))
        assert good.result(timeout=10) == ForwardResult((fake_next_token([5]),))
        assert scheduler.statistics().num_failed_batches == 1


def test_a_malformed_request_fails_alone(fake_engine):
    scheduler = BatchScheduler(fake_engine)
    futures = [scheduler.submit_forward((q, 0), "normal", prepared) for q, prepared in
               [("a", pass_on(0, [1], 1)), ("bad", pass_on(999, [2], 1)), ("c", pass_on(2, [3], 1))]]
    with scheduler:
        with pytest.raises(RequestError, match=r"request 1: field page_ids: page_ids\[0\]=999 out of"):
            futures[1].result(timeout=10)
        assert (futures[1].exception().request_index, futures[1].exception().field) == (1, "page_ids")
        assert [f.result(timeout=10).outputs for f in (futures[0], futures[2])] == [
            (fake_next_token([1]),), (fake_next_token([3]),)]
    assert [first_tokens(b) for b in fake_engine.batches] == [[1, 3]]
    assert scheduler.statistics().num_failed_batches == 1


class _MessageOnlyEngine(FakeEngine):
    """Raises, for the first batch, a plain ValueError whose text looks like a request error."""

    def forward(self, batch):
        if len(batch.requests) == 3:
            raise ValueError("request 1: field page_ids: looks like an engine request error")
        return super().forward(batch)


def test_only_a_typed_request_error_fails_one_request():
    """The scheduler reads RequestError.request_index; a message that merely reads like one fails
    the whole batch (nothing parses error text)."""
    engine = _MessageOnlyEngine()
    scheduler = BatchScheduler(engine)
    futures = [scheduler.submit_forward((q, 0), "normal", pass_on(page, [page + 1], 1))
               for q, page in (("a", 0), ("b", 1), ("c", 2))]
    with scheduler:
        for future in futures:
            with pytest.raises(ValueError, match="looks like an engine request error"):
                future.result(timeout=10)
    assert not isinstance(futures[0].exception(), RequestError)


def test_cancel_owner_drops_pending_items(fake_engine):
    done = []
    scheduler = BatchScheduler(fake_engine)
    prepared = PreparedForward(pass_on(0, [1], 1).request, (), lambda: done.append("a"))
    doomed = [scheduler.submit_forward(("a", 0), "normal", prepared),
              scheduler.submit_copy(("a", 1), "high", [TokenCopy(0, 1, 0, 0, 1)])]
    kept = scheduler.submit_forward(("b", 0), "normal", pass_on(2, [2], 1))
    assert scheduler.cancel_owner("a") == 2
    assert done == ["a"] and scheduler.synchronize_future(("a", 0)) is None
    with scheduler:
        kept.result(timeout=10)
    for future in doomed:
        with pytest.raises(Cancelled, match="instance a terminated"):
            future.result(timeout=0)
    assert fake_engine.statistics().num_copied_tokens == 0
    assert scheduler.statistics().num_cancelled == 2


def test_close_cancels_pending_and_refuses_new(fake_engine):
    scheduler = BatchScheduler(fake_engine)
    pending = scheduler.submit_forward(("a", 0), "normal", pass_on(0, [1], 1))
    scheduler.close()
    with pytest.raises(Cancelled, match="scheduler closed"):
        pending.result(timeout=0)
    late = scheduler.submit_copy(("a", 0), "normal", [])
    with pytest.raises(Cancelled, match="submission refused"):
        late.result(timeout=0)


def test_copies_run_in_queue_order_with_passes(fake_engine):
    with BatchScheduler(fake_engine) as scheduler:
        key = ("a", 0)
        scheduler.submit_forward(key, "normal", pass_on(0, [1, 2], 2))
        scheduler.submit_copy(key, "normal", [TokenCopy(0, 1, 0, 0, 2)])
        scheduler.submit_forward(key, "normal", pass_on(1, [3], 3))
        scheduler.synchronize_future(key).result(timeout=10)
    assert fake_engine.page_tokens(1)[:3] == (1, 2, 3)


def test_fork_with_copy_on_write_matches_running_alone():
    """Two forks of one prefix decode different tokens through the scheduler; each output is
    what its own context alone gives, and the prefix pages are never written by a fork."""
    engine = FakeEngine(num_pages=8, page_size=4)
    pool = PageAllocator(8)
    resources = InstancePages(pool, ExportRegistry(pool), instance_id="a", tenant="t",
                                  page_quota=8, page_size=4)
    prompt = [10, 11, 12, 13, 14, 15]
    pages = resources.allocate_pages(2)
    parent = resources.create_sequence()
    resources.sequence_append(parent, pages)
    with BatchScheduler(engine) as scheduler:
        prefill = resources.prepare(parent, prompt, list(range(6)), 2, [5], [GREEDY])
        scheduler.submit_forward(("a", 0), "normal", prefill).result(timeout=10)
        child = resources.create_sequence()
        resources.sequence_append(child, resources.share_pages(pages))
        steps = [resources.prepare(seq, [token], [6], 3, [0], [GREEDY])
                 for seq, token in ((parent, 20), (child, 30))]
        # Both writers copy: the parent's old page stays referenced until the child's copy of
        # it has run (a pending release counts as a sharer).
        assert [step.request.page_ids for step in steps] == [(0, 2), (0, 3)]
        assert [len(step.copies) for step in steps] == [1, 1]
        futures = [scheduler.submit_forward(("a", q), "normal", step)
                   for q, step in enumerate(steps)]
        outputs = [future.result(timeout=10).outputs[0] for future in futures]
    assert outputs == [fake_next_token(prompt + [20]), fake_next_token(prompt + [30])]
    assert len(engine.batches[-1].requests) == 2
    assert engine.page_tokens(1) == (14, 15, -1, -1)      # the shared page was never written
    resources.release_all()
    assert pool.statistics().num_free == 8


# ------------------------------------------------- adaptive: regrouping after a batch
LONG_HOLD = SchedulerPolicy(max_hold_ms=1000, hold_fraction=1000)   # bound: 1 s


def decode_loop(scheduler: BatchScheduler, owner: str, num_steps: int, page_id: int,
                start: threading.Barrier | None = None) -> None:
    """An instance's decode loop: submit, block on the result, submit again; end (cancel_owner,
    as the runtime does when an instance ends)."""
    if start is not None:
        start.wait(timeout=30)
    for step in range(num_steps):
        prepared = pass_on(page_id, [step + 1], step % 4 + 1)
        scheduler.submit_forward((owner, 0), "normal", prepared).result(timeout=30)
    scheduler.cancel_owner(owner)


def test_adaptive_regroups_decode_steps_into_full_batches():
    """8 submitters that resubmit right after their result, at slightly different times: every
    steady-state batch carries all 8 (the old fire-when-idle rule split them, e.g. 1 + 7)."""
    engine = FakeEngine(num_pages=64, page_size=4, batch_delay_s=0.003, keep_log=False)
    num_steps = 20
    start = threading.Barrier(8)
    with BatchScheduler(engine, LONG_HOLD) as scheduler:
        threads = [threading.Thread(target=decode_loop,
                                    args=(scheduler, f"i{i}", num_steps, i, start))
                   for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats = scheduler.statistics()
    sizes = dict(stats.batch_size_histogram)
    assert stats.num_forwards == 8 * num_steps
    # the first pass fires alone (nothing expected yet); the others join from the next batch on
    assert sizes.get(8, 0) >= num_steps - 3, stats.batch_size_histogram
    assert stats.num_batches <= num_steps + 3, stats.batch_size_histogram
    assert stats.num_hold_timeouts == 0


def test_adaptive_regroups_the_forks_of_one_instance():
    """One owner with 4 queues (forks): it submits on each, blocks on the first result, collects
    the others, resubmits. The batch after the first waits until it blocks again: 4 per batch,
    not 1 + 3 (its first resubmission no longer fires the idle engine alone)."""
    engine = FakeEngine(num_pages=64, page_size=4, batch_delay_s=0.003, keep_log=False)
    num_steps = 10
    with BatchScheduler(engine, LONG_HOLD) as scheduler:
        for step in range(num_steps):
            futures = []
            for q in range(4):
                futures.append(scheduler.submit_forward(("forks", q), "normal",
                                                        pass_on(q, [step + 1], step % 4 + 1)))
                time.sleep(0.001)               # the guest's work between two host calls
            for future in futures:
                future.result(timeout=30)
        stats = scheduler.statistics()
    sizes = dict(stats.batch_size_histogram)
    assert sizes.get(4, 0) >= num_steps - 1, stats.batch_size_histogram   # the first step splits
    assert stats.num_batches <= num_steps + 3 and stats.num_hold_timeouts == 0


def test_adaptive_never_holds_a_lone_instance_once_it_is_back():
    engine = FakeEngine(num_pages=64, page_size=4, batch_delay_s=0.002, keep_log=False)
    with BatchScheduler(engine, LONG_HOLD) as scheduler:
        started = time.monotonic()
        decode_loop(scheduler, "alone", 10, 0)
        elapsed = time.monotonic() - started
        stats = scheduler.statistics()
    assert elapsed < 0.5          # one held-to-the-bound step alone would take 1 s
    assert stats.num_batches == 10 and stats.num_hold_timeouts == 0


def held_submission_s(scheduler: BatchScheduler, consume) -> float:
    """Run one pass of owner a, consume its result with `consume`, then time a pass of owner b
    (a never blocks again)."""
    consume(scheduler.submit_forward(("a", 0), "normal", pass_on(0, [1], 1)))
    started = time.monotonic()
    scheduler.submit_forward(("b", 0), "normal", pass_on(1, [2], 1)).result(timeout=10)
    return time.monotonic() - started


def test_adaptive_holds_for_an_awaited_queue_up_to_the_bound():
    engine = FakeEngine(num_pages=64, page_size=4, batch_delay_s=0.002)
    policy = SchedulerPolicy(max_hold_ms=300, hold_fraction=1000)
    with BatchScheduler(engine, policy) as scheduler:
        held_s = held_submission_s(scheduler, lambda future: future.result(timeout=10))
        stats = scheduler.statistics()
    assert 0.25 <= held_s < 2.0
    assert stats.num_hold_timeouts == 1


def test_adaptive_does_not_hold_for_a_result_nobody_awaited():
    engine = FakeEngine(num_pages=64, page_size=4, batch_delay_s=0.002)
    policy = SchedulerPolicy(max_hold_ms=1000, hold_fraction=1000)

    def poll(future) -> None:     # consumes the result without blocking on it
        while not future.done():
            time.sleep(0.001)

    with BatchScheduler(engine, policy) as scheduler:
        held_s = held_submission_s(scheduler, poll)
        assert scheduler.statistics().num_hold_timeouts == 0
    assert held_s < 0.5


def test_adaptive_stops_holding_for_an_owner_that_ended():
    engine = FakeEngine(num_pages=64, page_size=4, batch_delay_s=0.002)
    with BatchScheduler(engine, LONG_HOLD) as scheduler:
        ender = threading.Timer(0.05, scheduler.cancel_owner, args=("a",))

        def consume(future) -> None:
            future.result(timeout=10)
            ender.start()

        held_s = held_submission_s(scheduler, consume)
        ender.join()
        stats = scheduler.statistics()
    assert 0.04 <= held_s < 0.5
    assert stats.num_hold_timeouts == 0


@pytest.mark.parametrize("field, value", [("max_hold_ms", -1.0), ("hold_fraction", -0.5)])
def test_hold_bounds_are_validated(field, value):
    with pytest.raises(ValueError, match=f"SchedulerPolicy.{field} must be >= 0"):
        SchedulerPolicy(**{field: value})


def test_runtime_instances_regroup_through_wasm(components, make_runtime):  # noqa: F811
    """End to end: 8 Wasm guests in a decode loop (forward.submit, get, drop) block through
    Instance.wait_future, which tells the scheduler; steady-state batches carry all 8."""
    engine = FakeEngine(num_pages=64, page_size=4, batch_delay_s=0.003, keep_log=False)
    runtime = make_runtime(engine, policy=LONG_HOLD)
    program = runtime.load_program(components.component("bench_calls"))
    num_steps = 20
    instance_ids = [runtime.launch(program, ["step", str(num_steps)]) for _ in range(8)]
    assert [runtime.wait(i, timeout=60).status for i in instance_ids] == ["ok"] * 8
    stats = runtime.statistics().scheduler
    sizes = dict(stats.batch_size_histogram)
    assert stats.num_forwards == 8 * num_steps
    # launches trickle in, and on a loaded machine a guest may miss a batch now and then; a
    # scheduler that does not regroup runs almost none of 8 (see the hold tests above)
    assert sizes.get(8, 0) >= num_steps * 6 // 10, stats.batch_size_histogram
    assert stats.num_hold_timeouts == 0
