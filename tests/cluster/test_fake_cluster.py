"""A cluster of fake-engine replicas on a local Ray: placement, quotas across replicas, exports
imported locally or copied across, and a replica killed mid-run ending only its own instances."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from host.cluster.errors import ClusterError, ReservationError, StaleEpochError
from host.cluster.front import replica_of
from host.cluster.placement import PlacementPolicy
from host.runtime import Runtime
from host.runtime_config import RuntimeConfig
from host.server.metrics import trap_cause
from tests.cluster.conftest import NUM_PAGES, Events
from tests.host.components import components  # noqa: F401
from tests.host.fake_engine import FakeEngine


def wait_until(check, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def all_pages_free(front) -> bool:
    """Every page of every replica free, but for those persistent exports hold."""
    figures = front.replica_figures()
    return len(figures) == 2 and all(
        f.stats.pages.num_free + f.num_pages_exported == NUM_PAGES for f in figures)


def test_outputs_equal_one_process_and_launches_spread(make_front, components,  # noqa: F811
                                                       tmp_path) -> None:
    program_bytes = components.component("generate")
    with Runtime(FakeEngine(num_pages=NUM_PAGES, page_size=4),
                 RuntimeConfig(cache_dir=tmp_path)) as alone:
        expected = {p: alone.wait(alone.launch(alone.load_program(program_bytes), [p]), 10).value
                    for p in ("a", "bb", "hello")}
    front = make_front()
    program = front.load_program(program_bytes)
    holders = [front.launch(front.load_program(components.component("echo")), [])
               for _ in range(4)]
    assert sorted(replica_of(i)[0] for i in holders) == ["r0", "r0", "r1", "r1"]
    used = set()
    for prompt, value in expected.items():
        with ThreadPoolExecutor(8) as pool:
            ids = list(pool.map(lambda _: front.launch(program, [prompt]), range(8)))
        used.update(replica_of(i)[0] for i in ids)
        assert [front.wait(i, 20).value for i in ids] == [value] * 8
    assert used == {"r0", "r1"}
    for instance_id in holders:
        assert front.send(instance_id, "")
        assert front.wait(instance_id, 20).value == "bye"
    assert front.statistics().placements == {"least_loaded": 28}
    wait_until(lambda: all_pages_free(front), what="every page back")


def test_quotas_hold_across_replicas(make_front, components) -> None:  # noqa: F811
    front = make_front()                  # tenant acme: 3 instances, 12 pages
    echo = front.load_program(components.component("echo"))
    limits = front.config.limits.__class__(max_idle_s=20.0, page_quota=4)
    ids = [front.launch(echo, [], tenant="acme", limits=limits) for _ in range(3)]
    assert {replica_of(i)[0] for i in ids} == {"r0", "r1"}
    with pytest.raises(ReservationError, match="instance quota: 3 running across the cluster"):
        front.launch(echo, [], tenant="acme", limits=limits)
    front.send(ids[0], "")
    assert front.wait(ids[0], 20).value == "bye"
    wait_until(lambda: ray.get(front.handles.directory.usage.remote("acme")) == (2, 8),
               what="the reservation freed")
    more = front.launch(echo, [], tenant="acme", limits=limits)
    for instance_id in (*ids[1:], more):
        front.terminate(instance_id)
        assert front.wait(instance_id, 20).status == "terminated"
    wait_until(lambda: ray.get(front.handles.directory.usage.remote("acme")) == (0, 0),
               what="every reservation freed")


def test_affinity_is_validated(make_front, components) -> None:  # noqa: F811
    front = make_front()
    echo = front.load_program(components.component("echo"))
    with pytest.raises(ClusterError, match="at most 256 characters"):
        front.launch(echo, [], affinity="x" * 257)
    with pytest.raises(ClusterError, match="not a valid inferlet component"):
        front.load_program(b"\0asm not really")


def exported(front, name: str) -> dict[str, int]:
    return ray.get(front.handles.directory.holders.remote("default", name))


def test_an_import_is_placed_where_its_export_lies(make_front, components) -> None:  # noqa: F811
    front = make_front()
    events = Events()
    exporter = front.launch(front.load_program(components.component("exporter")),
                            ["prefix", "persistent"], on_event=events)
    assert events.next() == ("message", "exported")
    home = replica_of(exporter)[0]
    wait_until(lambda: exported(front, "prefix") == {home: 2}, what="the export indexed")
    importer_program = front.load_program(components.component("importer"))
    for _ in range(3):
        got = Events()
        importer = front.launch(importer_program, ["prefix"], on_event=got, affinity="prefix")
        assert replica_of(importer)[0] == home
        assert got.next() == ("message", "imported")
        front.send(importer, "bye")
        assert front.wait(importer, 20).value == "done"
    stats = front.statistics()
    assert (stats.placements["export"], stats.num_import_local) == (3, 3)
    keyed = front.launch(importer_program, ["absent"], affinity="session-1")
    assert front.wait(keyed, 20).status == "error"           # no such export: the guest's err
    assert front.statistics().placements["key"] == 1
    front.send(exporter, "bye")
    assert front.wait(exporter, 20).value == "done"


def test_an_export_is_copied_to_the_replica_an_import_lands_on(make_front,  # noqa: F811
                                                               components) -> None:
    front = make_front(policy=PlacementPolicy(balance_abs=0, balance_rel=1.0))
    events = Events()
    exporter = front.launch(front.load_program(components.component("exporter")),
                            ["shared", "persistent"], on_event=events)
    assert events.next() == ("message", "exported")
    home = replica_of(exporter)[0]
    wait_until(lambda: exported(front, "shared") == {home: 2}, what="the export indexed")
    # the exporter keeps its replica busier: affinity is ignored, the import lands elsewhere
    got = Events()
    importer = front.launch(front.load_program(components.component("importer")), ["shared"],
                            on_event=got, affinity="shared")
    away = replica_of(importer)[0]
    assert away != home
    assert got.next() == ("message", "imported")
    assert front.statistics().num_import_mirrored == 1
    wait_until(lambda: exported(front, "shared") == {home: 2, away: 2}, what="the mirror indexed")
    for instance_id in (importer, exporter):
        front.send(instance_id, "bye")
        assert front.wait(instance_id, 20).value == "done"


def test_concurrent_launches_see_each_other(make_front, components) -> None:  # noqa: F811
    """Launches placed at once from many threads spread as evenly as launches one by one."""
    front = make_front()
    echo = front.load_program(components.component("echo"))
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda _: front.launch(echo, []), range(8)))
    assert sorted(replica_of(i)[0] for i in ids) == ["r0"] * 4 + ["r1"] * 4
    for instance_id in ids:
        front.send(instance_id, "")
        assert front.wait(instance_id, 20).value == "bye"


def test_a_lost_replica_ends_only_its_own_instances(make_front, components) -> None:  # noqa: F811
    front = make_front()                  # tenant beta: 8 instances, 64 pages
    echo = front.load_program(components.component("echo"))
    exporter_events = Events()
    exporter = front.launch(front.load_program(components.component("exporter")),
                            ["gone", "persistent"], tenant="beta", on_event=exporter_events)
    assert exporter_events.next() == ("message", "exported")
    victim_replica = replica_of(exporter)[0]
    wait_until(lambda: ray.get(front.handles.directory.holders.remote("beta", "gone")),
               what="the export indexed")
    events = {}
    for _ in range(5):
        got = Events()
        events[front.launch(echo, [], tenant="beta", on_event=got)] = got
    victims = [i for i in events if replica_of(i)[0] == victim_replica] + [exporter]
    survivors = [i for i in events if replica_of(i)[0] != victim_replica]
    assert victims and survivors

    killed_at = time.monotonic()
    ray.kill(front.handles.replicas[victim_replica], no_restart=False)
    for instance_id in victims:
        outcome = front.wait(instance_id, 10)
        assert outcome.status == "trap", outcome
        assert f"replica {victim_replica} is gone" in outcome.value
        assert trap_cause(outcome.value) == "replica_lost"
    final_after_s = time.monotonic() - killed_at
    directory = front.handles.directory
    assert ray.get(directory.why_missing.remote("beta", "gone")) == \
        f"export 'gone' was lost with replica {victim_replica}"
    assert ray.get(directory.usage.remote("beta"))[0] == len(survivors)

    for instance_id in survivors:                        # untouched: they answer and finish
        front.send(instance_id, "still here")
        assert events[instance_id].next() == ("message", "still here")
        front.send(instance_id, "")
        assert front.wait(instance_id, 20).value == "bye"
    stats = front.statistics()
    assert (stats.num_lost_instances, stats.num_replicas_lost) == (len(victims), 1)

    # Ray restarts it under a new epoch: it rejoins and takes placements again
    wait_until(lambda: victim_replica in front.loads(), timeout=60, what="the replica rejoined")
    stale = front.handles.replicas[victim_replica].send.remote(1, "x", "hi")
    with pytest.raises(StaleEpochError, match="epoch 2; a call of epoch 1"):
        ray.get(stale)
    later = [front.launch(echo, [], tenant="beta") for _ in range(2)]
    assert {replica_of(i)[0] for i in later} == {"r0", "r1"}
    for instance_id in later:
        front.send(instance_id, "")
        assert front.wait(instance_id, 20).value == "bye"
    wait_until(lambda: all_pages_free(front), what="every page back")
    wait_until(lambda: ray.get(directory.num_reservations.remote()) == 0,
               what="every reservation back")
    assert final_after_s < 10.0                           # generous: the bench holds < 2 s


@pytest.mark.parametrize("push_events", [True, False])
def test_events_pushed_or_polled_arrive_in_order(make_front, components,  # noqa: F811
                                                 push_events) -> None:
    front = make_front(push_events=push_events)
    echo = front.load_program(components.component("echo"))
    events = [Events(), Events()]
    ids = [front.launch(echo, [], on_event=e) for e in events]
    assert {replica_of(i)[0] for i in ids} == {"r0", "r1"}
    for instance_id, got in zip(ids, events):
        for index in range(20):
            assert front.send(instance_id, f"m{index}")
        assert [got.next() for _ in range(20)] == [("message", f"m{i}") for i in range(20)]
        front.send(instance_id, "")
        assert front.wait(instance_id, 20).value == "bye"
    assert len(front.statistics().event_latencies_s) >= 42


def test_replicas_that_cannot_reach_the_front_are_polled(make_front, components,  # noqa: F811
                                                         monkeypatch) -> None:
    from host.cluster import front as front_module

    class Unreachable(front_module.EventListener):
        """A listener whose advertised address nobody listens on."""

        def __init__(self, host: str) -> None:
            super().__init__(host)
            self.address = (host, 9)

    monkeypatch.setattr(front_module, "EventListener", Unreachable)
    front = make_front()
    echo = front.load_program(components.component("echo"))
    events = Events()
    instance_id = front.launch(echo, [], on_event=events)
    front.send(instance_id, "by poll")
    assert events.next() == ("message", "by poll")
    front.send(instance_id, "")
    assert front.wait(instance_id, 20).value == "bye"
