"""The runtime with many instances: batching, queue order, priorities, export/import sharing,
messaging, contention, statistics."""
from __future__ import annotations

import dataclasses
import gc
import queue
import time

import pytest

from host.sandbox.instance import Instance
from host.scheduling.scheduler import SchedulerPolicy
from tests.host.components import components, make_runtime, program_cache_dir  # noqa: F401
from tests.host.fake_engine import FakeEngine, FakeTokenizer, fake_next_token


class Events:
    """Collects one instance's events; `next()` waits for the next one."""

    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()

    def __call__(self, event) -> None:
        self.queue.put((event.kind, event.data))

    def next(self, timeout: float = 10.0) -> tuple[str, str]:
        return self.queue.get(timeout=timeout)


def launch(runtime, components, guest, *args, **kwargs):  # noqa: F811
    return runtime.launch(runtime.load_program(components.component(guest)), args, **kwargs)


def used_refcounts(runtime) -> list[int]:
    return [runtime.page_allocator.refcount(p) for p in range(runtime.page_allocator.num_pages)
            if runtime.page_allocator.refcount(p)]


def test_64_instances_are_batched(components, make_runtime):  # noqa: F811
    engine = FakeEngine(num_pages=512, page_size=4, batch_delay_s=0.002)
    runtime = make_runtime(engine)
    program = runtime.load_program(components.component("generate"))
    solo = {p: runtime.wait(runtime.launch(program, [p]), timeout=10).value for p in ("p0", "p9")}
    num_batches_before = runtime.statistics().scheduler.num_batches

    instance_ids = {f"p{i}": runtime.launch(program, [f"p{i}"]) for i in range(64)}
    outcomes = {p: runtime.wait(i, timeout=60) for p, i in instance_ids.items()}
    assert all(o.status == "ok" for o in outcomes.values()), outcomes
    assert (outcomes["p0"].value, outcomes["p9"].value) == (solo["p0"], solo["p9"])
    stats = runtime.statistics()
    num_batches = stats.scheduler.num_batches - num_batches_before
    num_passes = 64 * 6                                  # 1 prefill + 5 decode passes each
    assert stats.scheduler.max_batch_size > 1
    assert num_batches <= num_passes // 4, (num_batches, stats.scheduler.batch_size_histogram)
    assert stats.pages.num_free == 512


def test_passes_on_one_queue_run_in_order(components, make_runtime):  # noqa: F811
    engine = FakeEngine(num_pages=16, page_size=4, batch_delay_s=0.02)
    runtime = make_runtime(engine)
    prompt = "abcdefghijkl"
    outcome = runtime.wait(launch(runtime, components, "chunks", prompt), timeout=10)
    tokens = FakeTokenizer().encode(prompt)
    expected = "".join(chr(fake_next_token(tokens[:4 * k + 4])) for k in range(3))
    assert (outcome.status, outcome.value) == ("ok", expected)
    chunk_batches = [next(i for i, batch in enumerate(engine.batches)
                          if any(r.token_ids == tuple(tokens[4 * k:4 * k + 4])
                                 for r in batch.requests)) for k in range(3)]
    assert chunk_batches[0] < chunk_batches[1] < chunk_batches[2]   # one per batch, in order


def test_high_priority_queue_goes_first(components, make_runtime):  # noqa: F811
    engine = FakeEngine(num_pages=16, page_size=4, batch_delay_s=0.05)
    runtime = make_runtime(engine, policy=SchedulerPolicy(max_batch_tokens=4))
    assert runtime.wait(launch(runtime, components, "priority"), timeout=10).value == "done"
    order = [chr(batch.requests[0].token_ids[0]) for batch in engine.batches]
    assert sorted(order) == ["b", "h", "l"]
    assert order.index("h") < order.index("l")


def test_export_import_shares_pages_with_refcounts(components, make_runtime):  # noqa: F811
    runtime = make_runtime(FakeEngine(num_pages=16, page_size=4))
    exporter_events, importer_events = Events(), Events()
    exporter = launch(runtime, components, "exporter", "prefix", on_event=exporter_events)
    assert exporter_events.next() == ("message", "exported")
    assert used_refcounts(runtime) == [2, 2]             # the exporter's ids + the export
    assert runtime.exports.names("default") == ["prefix"]

    importer = launch(runtime, components, "importer", "prefix", on_event=importer_events)
    assert importer_events.next() == ("message", "imported")
    assert used_refcounts(runtime) == [3, 3]             # shared, no copy
    assert runtime.statistics().pages.num_used == 2

    runtime.send(importer, "bye")
    assert runtime.wait(importer, timeout=5).value == "done"
    assert used_refcounts(runtime) == [2, 2]
    runtime.send(exporter, "bye")
    assert runtime.wait(exporter, timeout=5).value == "done"
    assert used_refcounts(runtime) == []                 # the non-persistent export went too
    assert runtime.exports.names("default") == []


def test_persistent_export_outlives_its_instance_within_its_tenant(components,  # noqa: F811
                                                                    make_runtime):
    runtime = make_runtime(FakeEngine(num_pages=16, page_size=4))
    events = Events()
    exporter = launch(runtime, components, "exporter", "kept", "persistent", on_event=events)
    assert events.next() == ("message", "exported")
    runtime.send(exporter, "bye")
    assert runtime.wait(exporter, timeout=5).value == "done"
    assert runtime.exports.names("default") == ["kept"]
    assert used_refcounts(runtime) == [1, 1]             # held by the export alone

    outsider = launch(runtime, components, "importer", "kept", tenant="other")
    outcome = runtime.wait(outsider, timeout=5)
    assert outcome.status == "error" and "not found" in outcome.value
    events = Events()
    insider = launch(runtime, components, "importer", "kept", on_event=events)
    assert events.next() == ("message", "imported")
    runtime.send(insider, "bye")
    assert runtime.wait(insider, timeout=5).value == "done"
    assert used_refcounts(runtime) == [1, 1]


def test_messaging_round_trips(components, make_runtime):  # noqa: F811
    runtime = make_runtime(FakeEngine())
    events = Events()
    echo = launch(runtime, components, "echo", on_event=events)
    for message in ("hello", "ünïcode ✓", "x" * 5000):
        runtime.send(echo, message)
        assert events.next() == ("message", message)
    runtime.send(echo, "")
    assert events.next() == ("result", "bye")


def test_broadcast_reaches_subscribers_of_the_tenant_and_store_round_trips(
        components, make_runtime):  # noqa: F811
    runtime = make_runtime(FakeEngine())
    subscribers = []
    for tenant in ("default", "default", "other"):
        events = Events()
        subscribers.append(launch(runtime, components, "subscriber", tenant=tenant,
                                  on_event=events))
        assert events.next() == ("message", "subscribed")
    outcome = runtime.wait(launch(runtime, components, "broadcaster", "hello all"), timeout=5)
    assert (outcome.status, outcome.value) == ("ok", "hello all")   # store set / get / delete
    assert runtime.wait(subscribers[0], timeout=5).value == "hello all"
    assert runtime.wait(subscribers[1], timeout=5).value == "hello all"
    with pytest.raises(TimeoutError):
        runtime.wait(subscribers[2], timeout=0.2)        # another tenant: nothing arrives
    runtime.terminate(subscribers[2], "test over")
    assert runtime.wait(subscribers[2], timeout=5).status == "terminated"


def test_contention_terminates_the_instance_over_its_fair_share(components,  # noqa: F811
                                                                  make_runtime):
    """With no swap space (swap_mb=0) the victim is terminated; with swap the new policy serves
    it instead (tests/host/test_suspension.py)."""
    runtime = make_runtime(FakeEngine(num_pages=16, page_size=4), swap_mb=0)
    older_events, newer_events = Events(), Events()
    older = launch(runtime, components, "holder", "x" * 4, on_event=older_events)
    assert older_events.next() == ("message", "holding")
    newer = launch(runtime, components, "holder", "x" * 10, on_event=newer_events)
    assert newer_events.next() == ("message", "holding")

    runtime.send(older, "x" * 4)                          # 2 free: newer holds 10 > 8 = 16 // 2
    assert older_events.next() == ("message", "holding")
    outcome = runtime.wait(newer, timeout=5)
    assert outcome.status == "trap" and "swap space full" in outcome.value
    assert "out of KV pages" in outcome.value and older in outcome.value
    runtime.send(older, "")
    assert runtime.wait(older, timeout=5).value == "released"
    assert runtime.statistics().pages.num_free == 16


def test_out_of_pages_when_no_instance_holds_more(components, make_runtime):  # noqa: F811
    """With no swap space the requester cannot wait suspended: it traps. With swap it waits
    and goes on (tests/host/test_suspension.py)."""
    runtime = make_runtime(FakeEngine(num_pages=16, page_size=4), swap_mb=0)
    first_events, second_events = Events(), Events()
    first = launch(runtime, components, "holder", "x" * 10, on_event=first_events)
    assert first_events.next() == ("message", "holding")
    second = launch(runtime, components, "holder", "x" * 4, on_event=second_events)
    assert second_events.next() == ("message", "holding")
    runtime.send(second, "x" * 6)
    outcome = runtime.wait(second, timeout=5)
    assert outcome.status == "trap" and "out of KV pages" in outcome.value
    assert runtime.list_instances() and runtime.list_instances()[0].instance_id == first
    runtime.send(first, "")
    assert runtime.wait(first, timeout=5).value == "released"
    assert runtime.statistics().pages.num_free == 16


def test_statistics_and_listing(components, make_runtime):  # noqa: F811
    runtime = make_runtime(FakeEngine())
    echo = launch(runtime, components, "echo", tenant="t1")
    (info,) = runtime.list_instances("t1")
    assert info.instance_id == echo and info.tenant == "t1"
    assert runtime.list_instances("t2") == []
    stats = runtime.statistics()
    assert (stats.num_running, stats.num_launched) == (1, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.num_running = 5
    with pytest.raises(TimeoutError):
        runtime.wait(echo, timeout=0.05)
    with pytest.raises(KeyError, match="unknown instance"):
        runtime.send("nope", "x")
    runtime.send(echo, "")
    runtime.wait(echo, timeout=5)
    assert runtime.statistics().num_finished == 1 and runtime.list_instances() == []


def test_close_terminates_running_instances(components, make_runtime):  # noqa: F811
    runtime = make_runtime(FakeEngine())
    echo = launch(runtime, components, "echo")
    started = time.monotonic()
    runtime.close()
    assert runtime.wait(echo, timeout=1).status == "terminated"
    assert time.monotonic() - started < 5
    with pytest.raises(RuntimeError, match="closed"):
        launch(runtime, components, "echo")


def test_every_binding_lowers_and_lifts(components, make_runtime):  # noqa: F811
    """Distribution outputs, seeded samplers, masks, share / mask / copy, sequences, export
    release, chat template, vocabulary: the coverage guest checks each answer itself."""
    engine = FakeEngine(num_pages=16, page_size=4)
    runtime = make_runtime(engine)
    instance_id = launch(runtime, components, "coverage")
    outcome = runtime.wait(instance_id, timeout=10)
    assert (outcome.status, outcome.value) == ("ok", "covered"), runtime.instance_log(instance_id)
    assert runtime.instance_log(instance_id)[-1] == "log: step 7"
    assert engine.statistics().num_copied_tokens >= 2
    assert runtime.statistics().pages.num_free == 16


def test_an_ended_instance_is_kept_as_its_outcome_and_log_only(components,  # noqa: F811
                                                                make_runtime):
    """Not its Instance (tables, locks, callbacks): thousands are kept for `wait`."""
    runtime = make_runtime(FakeEngine())
    instance_id = launch(runtime, components, "hello_stdio")
    assert runtime.wait(instance_id, timeout=5).value == "printed"

    def instance_alive() -> bool:
        gc.collect()
        return any(type(o) is Instance and o.instance_id == instance_id
                   for o in gc.get_objects())

    deadline = time.monotonic() + 5
    while instance_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not instance_alive()
    outcome = runtime.wait(instance_id, timeout=0)
    assert (outcome.status, outcome.value) == ("ok", "printed")
    assert runtime.instance_log(instance_id) == ("stdout: hello from stdout",
                                                 "stderr: warning on stderr")
    assert runtime.terminate(instance_id) is False
    assert runtime.send(instance_id, "late") is False


def test_freeze_heap_puts_the_objects_alive_out_of_the_collectors_reach(make_runtime):  # noqa: F811
    gc.unfreeze()
    try:
        make_runtime(FakeEngine())
        assert gc.get_freeze_count() == 0            # the default: the process's GC untouched
        make_runtime(FakeEngine(), freeze_heap=True)
        assert gc.get_freeze_count() > 1000          # the engine's, the runtime's, pytest's...
    finally:
        gc.unfreeze()


def test_model_info_names_the_configured_model(make_runtime):  # noqa: F811
    """RuntimeConfig.model_name is the name inferlets see in model-info (`pie serve` and `pie run`
    pass the served name); unset, the engine's own; empty, an error."""
    from host import RuntimeConfig

    engine = FakeEngine(num_pages=8, page_size=4)
    assert make_runtime(engine).services.model_info.name == engine.model_name
    named = make_runtime(FakeEngine(num_pages=8, page_size=4), model_name="SmolLM2-135M-Instruct")
    assert named.services.model_info.name == "SmolLM2-135M-Instruct"
    with pytest.raises(ValueError, match="model_name must be a non-empty string"):
        RuntimeConfig(model_name=" ")
