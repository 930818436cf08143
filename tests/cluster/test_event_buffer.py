"""A replica's EventBuffer (host/cluster/event_buffer.py): per-front order, the byte bound, and
final events that always get through."""
from __future__ import annotations

import threading

import pytest

from host.cluster.event_buffer import EventBuffer, ReplicaEvent


def event(local_id: str, data: str = "x", kind: str = "message") -> ReplicaEvent:
    return ReplicaEvent(local_id, kind, data, 0.0)


def test_each_front_takes_its_own_events_in_order() -> None:
    buffer = EventBuffer(1 << 20)
    for i in range(5):
        assert buffer.put("f1", event("a", str(i)), final=False)
    buffer.put("f2", event("b"), final=False)
    assert [e.data for e in buffer.take("f1", 0.0, 3)] == ["0", "1", "2"]
    assert [e.data for e in buffer.take("f1", 0.0, 10)] == ["3", "4"]
    assert buffer.take("f1", 0.0, 10) == [] and buffer.num_bytes("f1") == 0
    assert [e.local_id for e in buffer.take("f2", 0.0, 10)] == ["b"]


def test_messages_past_the_bound_are_refused_but_a_final_event_is_kept() -> None:
    buffer = EventBuffer(200)
    assert buffer.put("f", event("a", "m" * 100), final=False)
    assert not buffer.put("f", event("a", "m" * 100), final=False)
    assert buffer.put("f", event("a", "done" * 100, "trap"), final=True)
    assert [e.kind for e in buffer.take("f", 0.0, 10)] == ["message", "trap"]


def test_a_long_poll_wakes_at_the_first_event_and_at_close() -> None:
    buffer = EventBuffer(1 << 20)
    timer = threading.Timer(0.05, buffer.put, ("f", event("a"), False))
    timer.start()
    assert len(buffer.take("f", 10.0, 10)) == 1
    threading.Timer(0.05, buffer.close).start()
    assert buffer.take("f", 10.0, 10) == []


def test_the_bound_is_validated() -> None:
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        EventBuffer(0)
