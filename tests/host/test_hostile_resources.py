"""Hostile guests against the bounds of one instance's resources: its memories and tables in
total, its log, its result, the tenant store it writes, the client messages it never reads, a
WASI call terminate cannot interrupt. Each ends (or is refused) with a message naming the limit,
while 8 well-behaved instances beside it finish with exactly their solo results and the page pool
returns to where it started."""
from __future__ import annotations

import dataclasses
import gc
import time

import pytest

from host import InstanceLimits
from host.errors import LimitError
from host.runtime_config import MessageLimits
from tests.host.components import components, make_runtime, program_cache_dir  # noqa: F401
from tests.host.test_hostile import (LIMITS, assert_well_behaved_unharmed, fresh_engine,
                                     launch_well_behaved, solo_results)  # noqa: F401


def run_beside_well_behaved(runtime, components, guest, *, args=(), limits=None):  # noqa: F811
    """Launch `guest` and the 8 well-behaved instances; the guest's outcome."""
    program = runtime.load_program(components.component(guest))
    hostile_id = runtime.launch(program, list(args), limits=limits)
    well_behaved = launch_well_behaved(runtime, components)
    return hostile_id, well_behaved


def assert_pool_back(runtime, num_free_at_start: int, num_memories_left: int = 0) -> None:
    """Every page back, nothing running, and the linear memories the host made unmapped (but
    `num_memories_left`, those of abandoned threads) once their Stores are collected."""
    stats = runtime.statistics()
    assert stats.pages.num_free == num_free_at_start
    assert stats.num_running == 0
    if runtime.linear_memories is None:
        return
    deadline = time.monotonic() + 5
    while runtime.linear_memories.num_memories > num_memories_left and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert runtime.linear_memories.num_memories == num_memories_left


# ------------------------------------------------------------------------- sampler fields
def sampler_record(**fields):
    from wasmtime.component import Record

    record = Record()
    values = {"kind": "sample", "temperature": 0.7, "top-k": 0, "top-p": 1.0, "min-p": 0.0,
              "seed": None, "num-top": 0}
    values.update(fields)
    for name, value in values.items():
        setattr(record, name, value)
    return record


@pytest.mark.parametrize("fields,phrase", [
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"top-p": float("nan")}, "top_p"),
    ({"top-p": 0.0}, "top_p"),
    ({"min-p": float("nan")}, "min_p"),
    ({"min-p": float("-inf")}, "min_p"),
    ({"top-k": 4_000_000_000}, "top_k 4000000000 is more than the vocabulary size 97"),
    ({"kind": "distribution", "num-top": 98}, "num_top 98 is more than the vocabulary size 97"),
    ({"kind": "distribution", "num-top": 0}, "num_top > 0"),
])
def test_every_bad_sampler_field_traps_at_the_binding(fields, phrase):
    from host.bindings.samplers import _sampler_spec
    from host.errors import TrapError

    with pytest.raises(TrapError, match=rf"forward.submit: sampler 2: .*{phrase}"):
        _sampler_spec("forward.submit", 2, sampler_record(**fields), 97)
    assert _sampler_spec("forward.submit", 0, sampler_record(), 97).temperature == 0.7


# ------------------------------------------------------------ memories and tables, in total
def test_extra_memories_are_refused_at_instantiation(components, make_runtime,  # noqa: F811
                                                     solo_results):  # noqa: F811
    runtime = make_runtime(fresh_engine(), LIMITS)
    num_free = runtime.statistics().pages.num_free
    hostile_id, well_behaved = run_beside_well_behaved(runtime, components, "multi_memory")
    outcome = runtime.wait(hostile_id, timeout=30)
    assert outcome.status == "trap", outcome
    assert "max_memories 1" in outcome.value, outcome.value
    assert_well_behaved_unharmed(runtime, well_behaved, solo_results)
    assert_pool_back(runtime, num_free)


@pytest.mark.parametrize("counted", [False, True], ids=["split", "counted"])
def test_memories_share_one_memory_limit(counted, components, make_runtime,  # noqa: F811
                                         solo_results):  # noqa: F811
    """Four memories allowed: each grows until refused, and all four together stay within
    memory_mb (8 MiB = 128 pages of 64 KiB), not 4 x 8 MiB: split evenly by the store limits, or
    counted by the host's LinearMemories."""
    limits = dataclasses.replace(LIMITS, max_memories=4)
    runtime = make_runtime(fresh_engine(), limits, count_linear_memory=counted)
    num_free = runtime.statistics().pages.num_free
    hostile_id, well_behaved = run_beside_well_behaved(runtime, components, "multi_memory")
    outcome = runtime.wait(hostile_id, timeout=30)
    assert outcome.status == "ok", outcome
    assert 120 <= int(outcome.value) <= 128, outcome.value
    assert_well_behaved_unharmed(runtime, well_behaved, solo_results)
    assert_pool_back(runtime, num_free)


@pytest.mark.parametrize("guest,status", [("memory_liar", "error"), ("memory_bomb", "trap")])
def test_counted_memory_limit_is_named_whatever_the_guest_says(  # noqa: F811
        guest, status, components, make_runtime, solo_results):  # noqa: F811
    """memory_liar hits the limit, then fails with CPython's misleading TypeError; the host saw
    the refused growth and says so."""
    runtime = make_runtime(fresh_engine(), LIMITS, count_linear_memory=True)
    num_free = runtime.statistics().pages.num_free
    hostile_id, well_behaved = run_beside_well_behaved(runtime, components, guest)
    outcome = runtime.wait(hostile_id, timeout=30)
    assert outcome.status == status, outcome
    assert outcome.value.startswith("memory limit 8 MiB reached"), outcome.value
    if guest == "memory_liar":
        assert outcome.value.endswith("TypeError: unsupported operand type(s) for +: '' and ''")
    assert_well_behaved_unharmed(runtime, well_behaved, solo_results)
    assert_pool_back(runtime, num_free)


def test_memory_limit_is_named_under_the_runtime_defaults(components, make_runtime):  # noqa: F811
    """No count_linear_memory given: the Runtime's own default counts, so memory_liar (CPython
    reports the refused growth as an unrelated TypeError) ends naming the limit it hit."""
    from host.runtime_config import RuntimeConfig

    assert RuntimeConfig().count_linear_memory
    runtime = make_runtime(fresh_engine(), LIMITS)
    outcome = runtime.wait(runtime.launch(runtime.load_program(components.component(
        "memory_liar"))), timeout=30)
    assert outcome.status == "error", outcome
    assert outcome.value.startswith("memory limit 8 MiB reached"), outcome.value


def test_an_instance_waiting_for_a_silent_client_is_ended(components, make_runtime,  # noqa: F811
                                                          solo_results):  # noqa: F811
    """echo blocks in receive() and its client never writes: it ends at max_receive_wait_s,
    naming it, and gives its pages back; the instances beside it are unharmed."""
    runtime = make_runtime(fresh_engine(), LIMITS)
    num_free = runtime.statistics().pages.num_free
    hostile_id, well_behaved = run_beside_well_behaved(
        runtime, components, "echo", limits=dataclasses.replace(LIMITS, max_receive_wait_s=0.5))
    outcome = runtime.wait(hostile_id, timeout=30)
    assert (outcome.status, outcome.value) == (
        "trap", "messaging.receive: no message within 0.5 s (max_receive_wait_s)")
    assert_well_behaved_unharmed(runtime, well_behaved, solo_results)
    assert_pool_back(runtime, num_free)


def test_tables_are_bounded(components, make_runtime, solo_results):  # noqa: F811
    limits = dataclasses.replace(LIMITS, max_table_elements=10_000)
    runtime = make_runtime(fresh_engine(), limits)
    num_free = runtime.statistics().pages.num_free
    hostile_id, well_behaved = run_beside_well_behaved(runtime, components, "table_bomb")
    outcome = runtime.wait(hostile_id, timeout=30)
    assert outcome.status == "ok", outcome
    assert int(outcome.value) <= 3 * 10_000     # three tables, each at most max_table_elements
    assert_well_behaved_unharmed(runtime, well_behaved, solo_results)
    assert_pool_back(runtime, num_free)


def test_too_many_tables_are_refused(components, make_runtime):  # noqa: F811
    runtime = make_runtime(fresh_engine(), dataclasses.replace(LIMITS, max_tables=2))
    outcome = runtime.wait(runtime.launch(runtime.load_program(
        components.component("table_bomb"))), timeout=30)
    assert outcome.status == "trap" and "max_tables 2" in outcome.value, outcome


# ----------------------------------------------------------------------- bytes it makes us hold
def test_result_over_its_limit_traps(components, make_runtime, solo_results):  # noqa: F811
    limits = dataclasses.replace(LIMITS, max_result_chars=1 << 20)
    runtime = make_runtime(fresh_engine(), limits)
    num_free = runtime.statistics().pages.num_free
    hostile_id, well_behaved = run_beside_well_behaved(runtime, components, "big_result")
    outcome = runtime.wait(hostile_id, timeout=30)
    assert outcome.status == "trap", outcome.status
    assert "2097152 characters" in outcome.value and "max_result_chars" in outcome.value
    assert len(outcome.value) < 200
    assert_well_behaved_unharmed(runtime, well_behaved, solo_results)
    assert_pool_back(runtime, num_free)


def test_tenant_store_is_bounded_in_characters(components, make_runtime,  # noqa: F811
                                              solo_results):  # noqa: F811
    runtime = make_runtime(fresh_engine(), LIMITS,
                           messages=MessageLimits(store_max_chars=1 << 20))
    num_free = runtime.statistics().pages.num_free
    hostile_id, well_behaved = run_beside_well_behaved(runtime, components, "store_flood")
    outcome = runtime.wait(hostile_id, timeout=30)
    assert outcome.status == "trap", outcome
    assert "store_max_chars" in outcome.value and "1048576" in outcome.value, outcome.value
    store = runtime.hub.store("default")
    assert len(store) == 3 and store.num_chars <= 1 << 20   # 3 values of 256 Ki + keys fit
    assert_well_behaved_unharmed(runtime, well_behaved, solo_results)
    assert_pool_back(runtime, num_free)


def test_client_messages_to_an_instance_that_never_reads_are_refused(  # noqa: F811
        components, make_runtime, solo_results):  # noqa: F811
    runtime = make_runtime(fresh_engine(), LIMITS,
                           messages=MessageLimits(client_max_chars=1 << 20))
    num_free = runtime.statistics().pages.num_free
    events = []
    program = runtime.load_program(components.component("deaf"))
    deaf_id = runtime.launch(program, on_event=events.append)
    well_behaved = launch_well_behaved(runtime, components)
    deadline = time.monotonic() + 10
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    message = "m" * (256 << 10)
    for _ in range(4):
        assert runtime.send(deaf_id, message)
    with pytest.raises(LimitError, match=r"client_max_chars.*1048576"):
        runtime.send(deaf_id, message)
    assert runtime.send(deaf_id, "")                  # what fits still goes through
    assert runtime.hub.channel(deaf_id).inbox.num_pending_chars == 1 << 20
    assert_well_behaved_unharmed(runtime, well_behaved, solo_results)
    assert runtime.terminate(deaf_id, "test over")
    assert runtime.wait(deaf_id, timeout=5).status == "terminated"
    assert_pool_back(runtime, num_free)


def test_logs_are_bounded_running_and_after_the_end(components, make_runtime):  # noqa: F811
    limits = dataclasses.replace(LIMITS, max_log_chars=100_000)
    runtime = make_runtime(fresh_engine(), limits, finished_log_chars=20_000,
                           max_finished_chars=100_000)
    program = runtime.load_program(components.component("chatty"))
    finals = []                                       # final events in the order they ended
    on_event = (lambda event: finals.append(event) if event.is_final else None)
    ids = [runtime.launch(program, on_event=on_event) for _ in range(8)]
    deadline = time.monotonic() + 60       # not runtime.wait: the oldest may be forgotten by then
    while len(finals) < len(ids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [event.data for event in finals] == ["said it all"] * len(ids)
    ended = [event.instance_id for event in finals]
    kept = {}
    for instance_id in ids:
        try:
            kept[instance_id] = runtime.instance_log(instance_id)
        except KeyError:
            pass
    # 8 M characters logged by each; each ended log keeps at most 20,000 of its newest; all
    # ended instances together at most 100,000: the oldest are forgotten, the newest kept.
    sizes = [sum(len(line) for line in log) for log in kept.values()]
    assert ended[0] not in kept and ended[-1] in kept
    assert all(0 < size <= 20_000 for size in sizes) and sum(sizes) <= 100_000
    assert all(log[-1].startswith("log: xxxx") for log in kept.values())
    with pytest.raises(KeyError, match="unknown instance"):
        runtime.wait(ended[0])


# --------------------------------------------------------------------------- time and compute
PATIENT = dataclasses.replace(LIMITS, max_idle_s=5.0)   # the idle limit does not end the sleep


def wait_for_first_event(events: list) -> None:
    deadline = time.monotonic() + 10
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)


def test_time_blocked_in_wasi_counts_toward_the_idle_limit(  # noqa: F811
        components, make_runtime, solo_results):  # noqa: F811
    runtime = make_runtime(fresh_engine(), LIMITS)   # max_idle_s 0.5; the guest sleeps 10 s
    num_free = runtime.statistics().pages.num_free
    events = []
    sleeper_id = runtime.launch(runtime.load_program(components.component("sleeper")),
                                on_event=events.append)
    well_behaved = launch_well_behaved(runtime, components)
    wait_for_first_event(events)
    started = time.monotonic()
    outcome = runtime.wait(sleeper_id, timeout=5)
    assert time.monotonic() - started < 1.5
    assert (outcome.status, outcome.value) == ("trap",
                                               "no host call for 0.5 s (blocked in a WASI call)")
    assert [e.kind for e in events] == ["message", "trap"]   # exactly one final event
    assert runtime.num_lingering("default") == 1 and runtime.num_lingering("other") == 0
    assert_well_behaved_unharmed(runtime, well_behaved, solo_results)
    assert_pool_back(runtime, num_free, num_memories_left=1)   # until its sleep returns


def test_terminate_ends_an_instance_blocked_in_wasi_within_a_second(  # noqa: F811
        components, make_runtime, solo_results):  # noqa: F811
    runtime = make_runtime(fresh_engine(), PATIENT)
    num_free = runtime.statistics().pages.num_free
    events = []
    program = runtime.load_program(components.component("sleeper"))
    sleeper_id = runtime.launch(program, on_event=events.append)
    well_behaved = launch_well_behaved(runtime, components)
    wait_for_first_event(events)
    assert [e.data for e in events] == ["sleeping"]
    time.sleep(0.2)                                   # now inside the 10 s WASI sleep
    started = time.monotonic()
    assert runtime.terminate(sleeper_id, "enough")
    outcome = runtime.wait(sleeper_id, timeout=5)
    assert time.monotonic() - started < 1.0
    assert (outcome.status, outcome.value) == ("terminated", "enough")
    assert [e.kind for e in events] == ["message", "terminated"]   # exactly one final event
    assert_well_behaved_unharmed(runtime, well_behaved, solo_results)
    assert_pool_back(runtime, num_free, num_memories_left=1)   # until its sleep returns


def test_close_does_not_wait_for_a_wasi_sleep(components, make_runtime):  # noqa: F811
    runtime = make_runtime(fresh_engine(), PATIENT)
    events = []
    runtime.launch(runtime.load_program(components.component("sleeper")),
                   on_event=events.append)
    wait_for_first_event(events)
    time.sleep(0.2)
    started = time.monotonic()
    runtime.close()
    assert time.monotonic() - started < 1.5
    assert events[-1].kind == "terminated"
    assert runtime.statistics().pages.num_free == runtime.page_allocator.num_pages
