"""A front's and the Directory's failures (fake engine, local Ray): a front closed without
ending its instances leaves them running, another front lists and attaches them (their waiting
events first) and their reservations still return; a Directory killed and restarted by Ray is
restored by the fronts (epochs, reservations, exports) and quotas hold again; a Directory gone
for good makes launches fail with an error naming it."""
from __future__ import annotations

import time

import pytest
import ray

from host.cluster.errors import ClusterError, ReservationError
from host.cluster.front import replica_of
from tests.cluster.conftest import Events
from tests.host.components import components  # noqa: F401


def wait_for(check, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def reservations(front) -> int:
    return ray.get(front.handles.directory.num_reservations.remote())


def test_another_front_attaches_a_closed_fronts_instances(make_front,
                                                          components) -> None:  # noqa: F811
    first = make_front()
    echo = first.load_program(components.component("echo"))
    subscriber = first.load_program(components.component("subscriber"))
    events = [Events(), Events()]
    ids = [first.launch(echo, [], tenant="acme", on_event=events[0]),
           first.launch(subscriber, [], tenant="acme", on_event=events[1])]
    assert {replica_of(i)[0] for i in ids} == {"r0", "r1"}
    assert events[1].next() == ("message", "subscribed")
    first.close(terminate=False)
    assert reservations(first) == 2

    second = make_front()
    running = {i.instance_id: i for i in second.running_instances("acme")}
    assert set(running) == set(ids) and not any(i.attached_here for i in running.values())
    assert second.running_instances("beta") == []
    with pytest.raises(KeyError, match="unknown instance"):
        second.attach(ids[0], "beta")                 # another tenant's: not found
    broadcaster = second.load_program(components.component("broadcaster"))
    assert second.wait(second.launch(broadcaster, ["news"], tenant="acme"), 20).value == "news"
    time.sleep(0.3)                   # the subscriber ends; its final event waits on its replica
    attached = [Events(), Events()]
    for instance_id, got in zip(ids, attached):
        assert second.attach(instance_id, "acme", on_event=got) == instance_id
    assert second.wait(ids[1], 20).value == "news"
    assert attached[1].next() == ("result", "news")
    assert second.send(ids[0], "after")
    assert attached[0].next() == ("message", "after")
    second.send(ids[0], "")
    assert second.wait(ids[0], 20).value == "bye"
    assert second.running_instances("acme") == []
    wait_for(lambda: reservations(second) == 0, "the reservations to return")


def test_reservations_return_when_no_front_attaches(make_front, components) -> None:  # noqa: F811
    first = make_front()
    sleeper = first.load_program(components.component("generate"))
    first.launch(sleeper, ["abc"], tenant="acme")     # ends on its own, nobody reading
    first.close(terminate=False)
    wait_for(lambda: reservations(first) == 0, "the replica to free the reservation")


def test_directory_restarted_by_ray_is_restored(make_front, components) -> None:  # noqa: F811
    front = make_front()
    directory = front.handles.directory
    echo = front.load_program(components.component("echo"))
    ids = [front.launch(echo, [], tenant="acme") for _ in range(2)]
    ray.kill(directory, no_restart=False)
    wait_for(lambda: front.directory_restorations >= 1, "the front to restore the directory")
    assert ray.get(directory.usage.remote("acme")) == (2, 0)
    third = front.launch(echo, [], tenant="acme")
    with pytest.raises(ReservationError, match="max_instances is 3"):
        front.launch(echo, [], tenant="acme")
    for instance_id in [*ids, third]:
        front.send(instance_id, "")
        assert front.wait(instance_id, 20).value == "bye"
    wait_for(lambda: reservations(front) == 0, "the reservations to return")


def test_directory_gone_for_good_is_named(make_front, components) -> None:  # noqa: F811
    """Last in this module: the module's Directory does not come back."""
    front = make_front()
    echo = front.load_program(components.component("echo"))
    running = front.launch(echo, [])
    directory = front.handles.directory
    ray.kill(directory, no_restart=True)

    def dead() -> bool:
        try:
            ray.get(directory.life.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return True
        return False

    wait_for(dead, "ray.kill to take effect")
    with pytest.raises(ClusterError, match="the cluster's directory is not answering"):
        front.launch(echo, [])
    front.send(running, "still here")                 # what runs goes on
    front.send(running, "")
    assert front.wait(running, 20).value == "bye"
