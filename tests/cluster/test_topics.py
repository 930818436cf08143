"""Topics across replicas (fake engine, local Ray): a broadcast made on one replica reaches the
tenant's subscribers on every replica, no other tenant's; the Directory holds which replicas
subscribe to what, and forgets a topic once its subscribers ended."""
from __future__ import annotations

import time

import pytest
import ray

from host.cluster.front import replica_of
from tests.cluster.conftest import Events
from tests.host.components import components  # noqa: F401


def topic_map(front) -> dict:
    return ray.get(front.handles.directory.topic_map.remote())


def wait_for(check, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_broadcast_reaches_subscribers_on_every_replica(make_front,
                                                       components) -> None:  # noqa: F811
    front = make_front()
    subscriber = front.load_program(components.component("subscriber"))
    broadcaster = front.load_program(components.component("broadcaster"))
    listeners = {}
    for tenant in ("beta", "beta", "beta", "beta", "gamma"):
        events = Events()
        instance_id = front.launch(subscriber, [], tenant=tenant, on_event=events)
        assert events.next() == ("message", "subscribed")
        listeners[instance_id] = tenant
    beta = [i for i, t in listeners.items() if t == "beta"]
    assert {replica_of(i)[0] for i in beta} == {"r0", "r1"}
    assert topic_map(front)[("beta", "news")] == ["r0", "r1"]

    sent = front.launch(broadcaster, ["hello all"], tenant="beta")
    assert front.wait(sent, 20).value == "hello all"
    for instance_id in beta:                    # those on the broadcaster's replica and the other
        assert front.wait(instance_id, 20).value == "hello all"
    (gamma,) = [i for i, t in listeners.items() if t == "gamma"]
    with pytest.raises(TimeoutError):
        front.wait(gamma, 0.5)                  # another tenant's subscriber hears nothing
    front.terminate(gamma, "test over")
    assert front.wait(gamma, 20).status == "terminated"
    wait_for(lambda: not topic_map(front), "the topics to leave the directory")


def test_subscriber_after_a_lost_replica_still_hears(make_front, components) -> None:  # noqa: F811
    """A replica's topics are dropped with it; its next life subscribes and hears again."""
    front = make_front()
    handles = front.handles
    subscriber = front.load_program(components.component("subscriber"))
    broadcaster = front.load_program(components.component("broadcaster"))
    first = Events()
    lost = front.launch(subscriber, [], tenant="beta", on_event=first)
    assert first.next() == ("message", "subscribed")
    victim = replica_of(lost)[0]
    ray.kill(handles.replicas[victim], no_restart=False)
    assert front.wait(lost, 30).status == "trap"
    wait_for(lambda: victim in front.loads(), "the replica to rejoin", 60)
    assert ("beta", "news") not in topic_map(front)
    listeners = []
    for _ in range(2):
        events = Events()
        listeners.append(front.launch(subscriber, [], tenant="beta", on_event=events))
        assert events.next() == ("message", "subscribed")
    assert {replica_of(i)[0] for i in listeners} == {"r0", "r1"}
    assert front.wait(front.launch(broadcaster, ["again"], tenant="beta"), 20).value == "again"
    assert [front.wait(i, 20).value for i in listeners] == ["again", "again"]
