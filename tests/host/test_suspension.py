"""Suspend and restore instead of terminate (issue 53): the page table's half (gate, drain, swap
out, swap in into fresh pages, local ids unchanged, shared pages left alone), the scheduler's
hold, the swap space's bounds, the restore order, and the runtime under an oversubscribed pool:
every instance completes with the outputs of an unconstrained pool; termination only for what no
wait serves (swap space full, the suspension deadline, the tenant's hard quota), named."""
from __future__ import annotations

import threading
import time

import pytest

from engine.batch import GREEDY, ForwardBatch
from host.errors import Cancelled, OutOfPagesError
from host.kv import ExportRegistry, InstancePages, PageAllocator
from host.kv.contention import Holder, PoolView, Suspended, restore_order
from host.kv.swap import SwapSpace
from host.scheduling.scheduler import BatchScheduler
from tests.host.components import components, make_runtime, program_cache_dir  # noqa: F401
from tests.host.fake_engine import FakeEngine
from tests.host.test_runtime import Events, launch
from tests.host.test_scheduler import first_tokens, pass_on


def _table(engine: FakeEngine, allocator: PageAllocator, instance_id: str = "a",
           tenant: str = "t") -> InstancePages:
    return InstancePages(allocator, ExportRegistry(allocator), instance_id=instance_id,
                         tenant=tenant, page_quota=allocator.num_pages,
                         page_size=engine.page_size)


def _fill(engine: FakeEngine, pages: InstancePages, sequence_id: int, token_ids) -> None:
    """Run a prefill of `token_ids` over the sequence (its pages written in the engine)."""
    n = len(token_ids)
    num_pages = len(pages.sequence_pages(sequence_id))
    last_page_len = n - (num_pages - 1) * engine.page_size
    prepared = pages.prepare(sequence_id, token_ids, range(n), last_page_len, (n - 1,),
                             (GREEDY,))
    engine.forward(ForwardBatch((prepared.request,)))
    prepared.on_done()


def _suspend(engine: FakeEngine, pages: InstancePages, charged: list) -> int:
    assert pages.begin_suspend()
    assert pages.wait_drained(1.0)
    out = pages.swap_out(engine.read_pages, lambda nbytes: charged.append(nbytes),
                         engine.kv_page_nbytes)
    assert out.refused is None
    return out.num_pages


def test_swap_out_and_in_moves_pages_keeping_local_ids_and_contents():
    engine = FakeEngine(num_pages=8, page_size=4)
    allocator = PageAllocator(8)
    pages = _table(engine, allocator)
    page_ids = pages.allocate_pages(3)
    sequence = pages.create_sequence()
    pages.sequence_append(sequence, page_ids)
    _fill(engine, pages, sequence, list(range(10, 20)))             # 10 tokens: 3 pages
    before = [engine.page_tokens(p) for p in sorted(pages.physical_ids())]
    charged: list[int] = []
    assert _suspend(engine, pages, charged) == 3
    assert charged == [3 * engine.kv_page_nbytes]
    assert allocator.num_free() == 8 and pages.physical_ids() == set()
    assert pages.num_resident_pages() == 0 and pages.num_swapped_pages() == 3
    other = allocator.allocate(3)                 # another owner takes and scribbles them
    engine.scribble(other, 99)
    fresh = allocator.allocate(3)
    assert pages.swap_in(fresh, engine.write_pages) == 3 * engine.kv_page_nbytes
    assert not pages.suspended and pages.sequence_pages(sequence) == page_ids   # local ids kept
    assert sorted(pages.physical_ids()) == fresh and set(fresh).isdisjoint(other)
    assert [engine.page_tokens(p) for p in fresh] == before
    # the next pass reads the restored pages: same output as it would have been
    prepared = pages.prepare(sequence, (20,), (10,), 3, (0,), (GREEDY,))
    assert prepared.request.page_ids == tuple(fresh)
    prepared.on_done()


def test_shared_and_exported_pages_are_not_swapped():
    engine = FakeEngine(num_pages=8, page_size=4)
    allocator = PageAllocator(8)
    pages = _table(engine, allocator)
    own, shared, exported = pages.allocate_pages(3)
    pages.share_pages([shared])
    assert pages.export_pages("e", [exported], persistent=False) is None
    physical = {pid: p for pid, p in zip((own, shared, exported), sorted(pages.physical_ids()))}
    assert _suspend(engine, pages, []) == 1
    assert pages.physical_ids() == {physical[shared], physical[exported]}   # still resident
    assert allocator.num_free() == 6
    pages.swap_in(allocator.allocate(1), engine.write_pages)
    assert len(pages.physical_ids()) == 3


def test_a_suspended_table_waits_at_its_gate_and_a_loop_pass_declines():
    engine = FakeEngine(num_pages=8, page_size=4)
    allocator = PageAllocator(8)
    pages = _table(engine, allocator)
    (page,) = pages.allocate_pages(1)
    sequence = pages.create_sequence()
    pages.sequence_append(sequence, [page])
    _fill(engine, pages, sequence, [1, 2])
    _suspend(engine, pages, [])
    assert pages.prepare(sequence, (3,), (2,), 3, (0,), (GREEDY,), reclaim=False) is None
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(pages.allocate_pages(1)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got                     # waits while suspended
    pages.swap_in(allocator.allocate(1), engine.write_pages)
    waiter.join(2)
    assert got and len(got[0]) == 1


def test_interrupt_wakes_a_call_waiting_at_the_gate_with_cancelled():
    engine = FakeEngine(num_pages=8, page_size=4)
    pages = _table(engine, PageAllocator(8))
    pages.allocate_pages(1)
    _suspend(engine, pages, [])
    errors: list = []

    def call() -> None:
        try:
            pages.allocate_pages(1)
        except Cancelled as error:
            errors.append(str(error))
    waiter = threading.Thread(target=call)
    waiter.start()
    time.sleep(0.05)
    pages.interrupt("the instance is ending")
    waiter.join(2)
    assert errors == ["kv.allocate-pages: the instance is ending"]
    pages.release_all()                           # swapped pages: nothing to return, no error


def test_suspension_waits_for_passes_in_flight_and_a_refused_charge_changes_nothing():
    engine = FakeEngine(num_pages=8, page_size=4)
    allocator = PageAllocator(8)
    pages = _table(engine, allocator)
    (page,) = pages.allocate_pages(1)
    sequence = pages.create_sequence()
    pages.sequence_append(sequence, [page])
    prepared = pages.prepare(sequence, (1,), (0,), 1, (0,), (GREEDY,))    # in flight: pinned
    assert pages.begin_suspend() and not pages.begin_suspend()
    assert not pages.wait_drained(0.05)
    threading.Timer(0.05, prepared.on_done).start()
    assert pages.wait_drained(2.0)
    out = pages.swap_out(engine.read_pages, lambda nbytes: "swap space full: test",
                         engine.kv_page_nbytes)
    assert (out.refused, out.num_pages) == ("swap space full: test", 0)
    assert engine.num_pages_read == 0                   # charged first: nothing was read
    assert pages.physical_ids() == {0} and allocator.num_free() == 7
    pages.abort_suspend()
    assert not pages.suspended and pages.allocate_pages(1)


def test_kv_cache_pages_round_trip_bit_exact():
    import torch

    from engine.engine_config import ModelConfig
    from engine.kv_cache import KVCache
    model = ModelConfig(name="t", vocab_size=16, hidden_size=8, intermediate_size=16,
                        num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, max_position=64)
    cache = KVCache(model, num_pages=6, page_size=4, dtype=torch.float32)
    cache.pool.copy_(torch.randn(cache.pool.shape))
    data = cache.read_pages([4, 1])
    assert tuple(data.shape) == (2, 2, 2, 4, 1, 4) and data.nbytes == 2 * 2 * 2 * 4 * 4 * 4
    assert data.nbytes == 2 * cache.page_nbytes
    expected = cache.pool[:, [4, 1]].clone()
    cache.pool[:, [4, 1]] = 0
    cache.write_pages([0, 5], data)
    assert torch.equal(cache.pool[:, [0, 5]], expected)       # bit-exact, other ids
    with pytest.raises(ValueError, match="page_ids\\[0\\]=6 out of range"):
        cache.read_pages([6])
    with pytest.raises(ValueError, match="expected"):
        cache.write_pages([0], data)


def test_scheduler_holds_a_suspended_owner_in_order_and_releases_it():
    engine = FakeEngine(num_pages=16, page_size=4)
    scheduler = BatchScheduler(engine)
    first = scheduler.submit_forward(("a", 0), "normal", pass_on(0, [1], 1))
    assert scheduler.suspend_owner("a") == 1 and scheduler.is_suspended("a")
    second = scheduler.submit_forward(("a", 0), "normal", pass_on(0, [2], 2))   # held too
    other = scheduler.submit_forward(("b", 0), "normal", pass_on(1, [9], 1))
    with scheduler:
        other.result(timeout=10)
        time.sleep(0.05)
        assert not first.done() and not second.done()
        assert scheduler.statistics().num_pending == 0
        assert scheduler.resume_owner("a") == 2
        second.result(timeout=10)
    assert [first_tokens(b) for b in engine.batches] == [[9], [1], [2]]
    assert engine.page_tokens(0)[:2] == (1, 2)


def test_scheduler_cancels_held_items_with_their_owner():
    scheduler = BatchScheduler(FakeEngine())
    scheduler.suspend_owner("a")
    future = scheduler.submit_forward(("a", 0), "normal", pass_on(0, [1], 1))
    assert scheduler.cancel_owner("a") == 1
    with pytest.raises(Cancelled):
        future.result(timeout=1)
    assert not scheduler.is_suspended("a")


class _SignallingEngine(FakeEngine):
    """A fake engine that says when a forward has begun."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.forwarding = threading.Event()

    def forward(self, batch):
        self.forwarding.set()
        return super().forward(batch)


def test_run_exclusive_waits_for_the_running_batch():
    engine = _SignallingEngine(num_pages=16, page_size=4, batch_delay_s=0.2)
    with BatchScheduler(engine) as scheduler:
        future = scheduler.submit_forward(("a", 0), "normal", pass_on(0, [1], 1))
        assert engine.forwarding.wait(5)                    # the batch runs
        assert scheduler.run_exclusive(future.done)          # only once it has ended
        submitted = []

        def hold() -> bool:
            submitted.append(scheduler.submit_forward(("a", 0), "normal", pass_on(0, [2], 2)))
            time.sleep(0.1)
            return submitted[0].done()
        assert not scheduler.run_exclusive(hold)              # no batch runs meanwhile
        submitted[0].result(timeout=5)                        # and it runs afterwards


def test_swap_space_is_bounded_in_all_and_per_tenant():
    swap = SwapSpace(1000, lambda tenant: 600 if tenant == "a" else 1000)
    assert swap.charge("a", 500) is None
    assert "tenant 'a'" in swap.charge("a", 200)
    assert swap.charge("b", 400) is None
    assert "swap space full: 200 bytes asked, 900 of 1000" in swap.charge("b", 200)
    swap.refund("a", 500)
    assert swap.charge("b", 200) is None
    assert swap.statistics().tenant_bytes == {"b": 600}
    with pytest.raises(ValueError):
        swap.refund("a", 1)


def test_restore_order_tenant_most_under_its_share_then_oldest():
    view = PoolView(16, (Holder("x", "a", 6, 0), Holder("y", "b", 2, 1)),
                    {"a": 6, "b": 2}, {"a": 8, "b": 8})
    suspended = [Suspended("a-old", "a", 1.0, 2), Suspended("b-new", "b", 3.0, 2),
                 Suspended("b-old", "b", 2.0, 2), Suspended("a-new", "a", 0.5 + 4, 2)]
    assert [s.instance_id for s in restore_order(view, suspended)] == [
        "b-old", "b-new", "a-old", "a-new"]


# ------------------------------------------------------------------ the runtime
def _eventually(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _solo(runtime, components, prompts):  # noqa: F811
    return {p: runtime.wait(launch(runtime, components, "grower", p), timeout=20).value
            for p in prompts}


def test_an_oversubscribed_pool_completes_everyone_with_unconstrained_outputs(
        components, make_runtime):  # noqa: F811
    """Six growers peaking at 6 pages each (36) on a pool of 16: under the old policy some were
    terminated; now every one completes, outputs as on a pool with room for all."""
    prompts = [f"prompt {i}!" for i in range(6)]             # 10 tokens + 12 decoded: 6 pages
    roomy = make_runtime(FakeEngine(num_pages=64, page_size=4))
    expected = _solo(roomy, components, prompts)
    runtime = make_runtime(FakeEngine(num_pages=16, page_size=4))
    program = runtime.load_program(components.component("grower"))
    ids = {p: runtime.launch(program, [p]) for p in prompts}
    outcomes = {p: runtime.wait(i, timeout=60) for p, i in ids.items()}
    assert {p: (o.status, o.value) for p, o in outcomes.items()} == {
        p: ("ok", expected[p]) for p in prompts}
    stats = runtime.statistics()
    assert stats.suspensions.num_suspensions >= 1 and stats.suspensions.num_restores >= 1
    assert (stats.suspensions.num_suspended, stats.suspensions.swap_bytes) == (0, 0)
    assert stats.pages.num_free == 16


def test_a_victim_over_its_fair_share_is_suspended_then_restored(components,  # noqa: F811
                                                                  make_runtime):
    """Was test_runtime's termination of the instance over its fair share: the new policy
    serves it (suspended while the older needs the pages, restored once they are back).
    Its pages copied (restore="swap", RuntimeConfig's default)."""
    engine = FakeEngine(num_pages=16, page_size=4)
    runtime = make_runtime(engine)
    older_events, newer_events = Events(), Events()
    older = launch(runtime, components, "holder", "x" * 4, on_event=older_events)
    assert older_events.next() == ("message", "holding")
    newer = launch(runtime, components, "holder", "x" * 10, on_event=newer_events)
    assert newer_events.next() == ("message", "holding")
    runtime.send(older, "x" * 4)                          # 2 free: newer holds 10 > 8
    assert older_events.next() == ("message", "holding")
    assert runtime.suspensions.is_suspended(newer)
    assert engine.num_pages_read == 10
    stats = runtime.statistics().suspensions
    assert (stats.num_suspended, stats.num_pages_in_swap, stats.swap_bytes) == (
        1, 10, 10 * engine.kv_page_nbytes)
    runtime.send(older, "")
    assert runtime.wait(older, timeout=5).value == "released"
    assert _eventually(lambda: not runtime.suspensions.is_suspended(newer))
    assert engine.num_pages_written == 10
    runtime.send(newer, "xx")                              # it goes on, none the wiser
    assert newer_events.next() == ("message", "holding")
    runtime.send(newer, "")
    assert runtime.wait(newer, timeout=5).value == "released"
    assert runtime.statistics().pages.num_free == 16
    assert runtime.statistics().suspensions.suspended_s > 0


def test_swap_space_full_terminates_the_victim_naming_it(components, make_runtime):  # noqa: F811
    runtime = make_runtime(FakeEngine(num_pages=16, page_size=4), swap_mb=0)
    older_events, newer_events = Events(), Events()
    older = launch(runtime, components, "holder", "x" * 4, on_event=older_events)
    assert older_events.next() == ("message", "holding")
    newer = launch(runtime, components, "holder", "x" * 10, on_event=newer_events)
    assert newer_events.next() == ("message", "holding")
    runtime.send(older, "x" * 4)
    assert older_events.next() == ("message", "holding")
    outcome = runtime.wait(newer, timeout=5)
    assert outcome.status == "trap" and "swap space full" in outcome.value
    assert older in outcome.value and "over its fair share of 8" in outcome.value
    runtime.send(older, "")
    assert runtime.wait(older, timeout=5).value == "released"
    assert runtime.statistics().pages.num_free == 16


def test_a_requester_no_victim_serves_waits_then_goes_on(components, make_runtime):  # noqa: F811
    """Was test_runtime's out-of-pages trap when no instance holds more: the requester now
    waits, suspended, and goes on once the pool has room."""
    runtime = make_runtime(FakeEngine(num_pages=16, page_size=4))
    first_events, second_events = Events(), Events()
    first = launch(runtime, components, "holder", "x" * 10, on_event=first_events)
    assert first_events.next() == ("message", "holding")
    second = launch(runtime, components, "holder", "x" * 4, on_event=second_events)
    assert second_events.next() == ("message", "holding")
    runtime.send(second, "x" * 6)                          # 2 free; first holds 10 <= 10
    with pytest.raises(Exception):
        second_events.next(timeout=0.3)                   # waits
    assert runtime.suspensions.is_suspended(second)
    runtime.send(first, "")
    assert runtime.wait(first, timeout=5).value == "released"
    assert second_events.next() == ("message", "holding")
    runtime.send(second, "")
    assert runtime.wait(second, timeout=5).value == "released"
    assert runtime.statistics().pages.num_free == 16


def test_a_suspension_past_its_deadline_ends_the_instance_naming_it(components,  # noqa: F811
                                                                    make_runtime):
    runtime = make_runtime(FakeEngine(num_pages=16, page_size=4), suspend_deadline_s=0.3)
    first_events, second_events = Events(), Events()
    first = launch(runtime, components, "holder", "x" * 10, on_event=first_events)
    assert first_events.next() == ("message", "holding")
    second = launch(runtime, components, "holder", "x" * 4, on_event=second_events)
    assert second_events.next() == ("message", "holding")
    runtime.send(second, "x" * 6)
    outcome = runtime.wait(second, timeout=5)
    assert outcome.status == "trap" and "suspend_deadline_s" in outcome.value
    assert runtime.statistics().suspensions.num_deadline_terminations == 1
    runtime.send(first, "")
    assert runtime.wait(first, timeout=5).value == "released"
    stats = runtime.statistics()
    assert (stats.pages.num_free, stats.suspensions.swap_bytes) == (16, 0)


def test_above_the_tenant_hard_quota_traps_at_once(components, make_runtime):  # noqa: F811
    runtime = make_runtime(FakeEngine(num_pages=16, page_size=4), kv_shares=(("a", 8),))
    events = Events()
    instance = launch(runtime, components, "holder", "x" * 4, tenant="b", on_event=events)
    assert events.next() == ("message", "holding")
    a_events = Events()
    launch(runtime, components, "holder", "x" * 8, tenant="a", on_event=a_events)
    assert a_events.next() == ("message", "holding")
    runtime.send(instance, "x" * 6)                        # 4 + 6 > 16 - 8
    outcome = runtime.wait(instance, timeout=5)
    assert outcome.status == "trap" and "hard quota of 8" in outcome.value


def test_a_hoarding_tenant_is_suspended_not_the_other(components, make_runtime):  # noqa: F811
    """Tenant a hoards 14 of 16 pages; tenant b's growers (within b's share of 8) take them
    back: only a's hoarder is suspended (again, if it was restored while b still needed its
    pages), b's finish with unconstrained outputs, and a's hoarder goes on afterwards."""
    prompts = ["b one", "b two"]                               # 5 + 12 tokens: 5 pages each
    expected = _solo(make_runtime(FakeEngine(num_pages=64, page_size=4)), components, prompts)
    runtime = make_runtime(FakeEngine(num_pages=16, page_size=4))
    hoard_events = Events()
    hoarder = launch(runtime, components, "holder", "x" * 14, tenant="a",
                     on_event=hoard_events)
    assert hoard_events.next() == ("message", "holding")
    program = runtime.load_program(components.component("grower"))
    ids = [runtime.launch(program, [p], tenant="b") for p in prompts]
    assert [runtime.wait(i, timeout=30).value for i in ids] == [expected[p] for p in prompts]
    stats = runtime.statistics().suspensions
    assert [tenant for tenant, _ in stats.tenant_suspensions] == ["a"]    # a's hoarder alone
    assert _eventually(lambda: runtime.statistics().suspensions.num_suspended == 0)
    stats = runtime.statistics().suspensions
    assert stats.num_restores == stats.num_suspensions >= 1        # restored as often
    runtime.send(hoarder, "")
    assert runtime.wait(hoarder, timeout=5).value == "released"
    assert runtime.statistics().pages.num_free == 16


def test_out_of_pages_error_still_raised_without_runtime():
    allocator = PageAllocator(2)
    pages = InstancePages(allocator, ExportRegistry(allocator), instance_id="a", tenant="t",
                          page_quota=4, page_size=4)
    with pytest.raises(OutOfPagesError):
        pages.allocate_pages(3)


def test_metrics_show_suspensions():
    from host.runtime import SuspensionStats
    from host.server.metrics import RuntimeFigures, ServerMetrics, trap_cause
    stats = SuspensionStats(num_suspended=2, num_suspensions=5, num_restores=3,
                            num_swapped_pages=40, num_restored_pages=24, num_pages_in_swap=16,
                            swap_bytes=16384, suspended_s=1.5, num_deadline_terminations=1,
                            num_recomputed_pages=7)
    figures = RuntimeFigures(num_running_instances=4, num_pages_used=8, num_pages_free=8,
                             num_pages_exported=0, queue_depth=0, num_batches=1,
                             batch_size_counts={1: 1}, num_output_tokens=1, num_input_tokens=1,
                             suspensions=stats)
    text = ServerMetrics(lambda: figures).render().decode()
    for line in ("pie_suspensions_total 5.0", "pie_restores_total 3.0",
                 "pie_swapped_pages_total 40.0", "pie_suspended_seconds_total 1.5",
                 "pie_instances_suspended 2.0", "pie_swap_bytes 16384.0",
                 "pie_recomputed_pages_total 7.0"):
        assert line in text, line
    assert trap_cause("suspended for more than 600 s waiting for KV pages "
                      "(suspend_deadline_s)") == "suspend_deadline"
    assert trap_cause("out of KV pages and swap space full: ...") == "swap_full"


def test_swap_settings_are_checked_at_the_boundary():
    from host.runtime_config import RuntimeConfig
    from host.server.server_config import ServerSection
    with pytest.raises(ValueError, match="swap_mb must be an int"):
        RuntimeConfig(swap_mb=-1)
    with pytest.raises(ValueError, match="suspend_deadline_s must be in"):
        RuntimeConfig(suspend_deadline_s=0)
    with pytest.raises(ValueError, match="server.swap_mb"):
        ServerSection(swap_mb=-1)
    with pytest.raises(ValueError, match="server.suspend_deadline_s"):
        ServerSection(suspend_deadline_s=-1.0)
    with pytest.raises(ValueError, match="RuntimeConfig.restore must be"):
        RuntimeConfig(restore="copy")
    with pytest.raises(ValueError, match="server.restore must be"):
        ServerSection(restore="")
    assert RuntimeConfig(swap_mb=0).swap_mb == 0


@pytest.mark.parametrize("mode", [{"chain_steps": 64}, {"overlap": True}])
def test_run_exclusive_gets_the_engine_between_steps_of_a_running_decode_loop(mode):
    """A host decode loop keeps the engine busy (chained steps on a CPU, passes prepared ahead
    with overlap); a page swap still gets the engine within a step or two, and the loop's
    outputs are those it would have produced anyway."""
    from tests.host.test_decode_loop import Setup, _expected
    setup = Setup([10, 11, 12, 13, 14], num_pool_pages=128, **mode)
    setup.engine.batch_delay_s = 0.02                       # a chain of 64: 1.3 s
    try:
        setup.min_outputs = 1
        rep = setup.submit(150)
        setup.start()
        loop = setup.tables.decode_loops.get("test", rep)
        assert _eventually(lambda: loop._num_outputs >= 5)
        started = time.monotonic()
        outputs_then = setup.scheduler.run_exclusive(lambda: loop._num_outputs)
        waited_s = time.monotonic() - started
        assert waited_s < 0.3 and outputs_then < 150          # the loop was still running
        assert setup.read_all(rep) == _expected(setup.prompt, 150)
    finally:
        setup.close()


def test_waiting_instances_are_restored_oldest_suspension_first(components,  # noqa: F811
                                                                make_runtime):
    """Two instances wait suspended for 9 pages each; when the pool has room for one, the one
    suspended first goes on, and the other only once that one gives its pages back."""
    runtime = make_runtime(FakeEngine(num_pages=16, page_size=4))
    big_events, first_events, second_events = Events(), Events(), Events()
    big = launch(runtime, components, "holder", "x" * 8, on_event=big_events)
    assert big_events.next() == ("message", "holding")
    first = launch(runtime, components, "holder", "x" * 4, on_event=first_events)
    assert first_events.next() == ("message", "holding")
    second = launch(runtime, components, "holder", "x" * 4, on_event=second_events)
    assert second_events.next() == ("message", "holding")
    runtime.send(first, "x" * 5)                     # 9: big's 8 is not more: it waits
    assert _eventually(lambda: runtime.suspensions.is_suspended(first))
    runtime.send(second, "x" * 5)                    # the same, suspended after first
    assert _eventually(lambda: runtime.suspensions.is_suspended(second))
    runtime.send(big, "")
    assert runtime.wait(big, timeout=5).value == "released"
    assert first_events.next() == ("message", "holding")         # 16 free: first's 9
    with pytest.raises(Exception):
        second_events.next(timeout=0.3)                         # 7 left: second still waits
    runtime.send(first, "")
    assert runtime.wait(first, timeout=5).value == "released"
    assert second_events.next() == ("message", "holding")
    runtime.send(second, "")
    assert runtime.wait(second, timeout=5).value == "released"
    assert runtime.statistics().pages.num_free == 16


def test_an_inferlet_reads_its_own_suspended_time(components, make_runtime):  # noqa: F811
    """runtime.suspended-ms: positive for the instance that was suspended, 0 for the other."""
    engine = FakeEngine(num_pages=16, page_size=4)
    runtime = make_runtime(engine)
    older_events, newer_events = Events(), Events()
    older = launch(runtime, components, "suspended_clock", "x" * 4, on_event=older_events)
    assert older_events.next() == ("message", "holding")
    newer = launch(runtime, components, "suspended_clock", "x" * 10, on_event=newer_events)
    assert newer_events.next() == ("message", "holding")
    runtime.send(older, "x" * 4)                          # newer (10 > its fair 8) suspended
    assert older_events.next() == ("message", "holding")
    assert runtime.suspensions.is_suspended(newer)
    time.sleep(0.05)                                      # suspended for at least this
    runtime.send(older, "")
    assert runtime.wait(older, timeout=5).value == "0"
    assert _eventually(lambda: not runtime.suspensions.is_suspended(newer))
    runtime.send(newer, "")
    assert int(runtime.wait(newer, timeout=5).value) >= 50
