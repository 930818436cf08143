"""Messaging: client round trips, topics per tenant, the key-value store, and cancellation of
blocking receives by terminate."""
from __future__ import annotations

import threading
import time

import pytest

from host.errors import Cancelled, LimitError, TrapError
from host.messages.hub import Inbox, KeyValueStore, MessageHub
from host.runtime_config import MessageLimits


def open_channel(hub: MessageHub, instance_id: str, tenant: str = "t"):
    sent: list[str] = []
    return hub.open(instance_id, tenant, sent.append), sent


def receive_in_thread(receive):
    """Run a blocking receive in a thread; returns (thread, outcome list)."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(receive())
        except Exception as error:        # the test inspects it
            outcome.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_client_round_trip():
    hub = MessageHub()
    channel, sent = open_channel(hub, "a")
    assert channel.try_receive() is None
    assert hub.deliver("a", "hello") and hub.deliver("a", "again")
    assert channel.receive() == "hello" and channel.try_receive() == "again"
    channel.send("reply")
    assert sent == ["reply"]
    assert not hub.deliver("nobody", "x")
    assert channel.receive(timeout=0.01) is None


def test_the_hub_says_whether_an_instance_waits_for_its_client():
    hub = MessageHub()
    channel, _ = open_channel(hub, "a")
    assert not hub.waiting_for_client("a") and not hub.waiting_for_client("nobody")
    thread, outcome = receive_in_thread(channel.receive)
    deadline = time.monotonic() + 5
    while not hub.waiting_for_client("a"):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    hub.deliver("a", "wake")
    thread.join(timeout=5)
    assert outcome == ["wake"] and not hub.waiting_for_client("a")
    hub.deliver("a", "queued")                 # a message waits: the instance does not
    assert not hub.waiting_for_client("a")


def test_blocking_receive_wakes_on_message_and_on_terminate():
    hub = MessageHub()
    channel, _ = open_channel(hub, "a")
    thread, outcome = receive_in_thread(channel.receive)
    time.sleep(0.02)
    hub.deliver("a", "wake")
    thread.join(timeout=5)
    assert outcome == ["wake"]
    thread, outcome = receive_in_thread(channel.receive)
    time.sleep(0.02)
    hub.close("a", "instance a terminated by its client")
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert isinstance(outcome[0], Cancelled)
    assert str(outcome[0]) == "messaging.receive: instance a terminated by its client"
    assert not hub.deliver("a", "late")
    with pytest.raises(Cancelled, match="messaging.send: instance a terminated"):
        channel.send("x")


def test_broadcast_reaches_only_earlier_subscribers_of_the_tenant():
    hub = MessageHub()
    a, _ = open_channel(hub, "a")
    b, _ = open_channel(hub, "b")
    other, _ = open_channel(hub, "c", tenant="u")
    a.subscribe("news")
    other.subscribe("news")
    assert b.broadcast("news", "one") == 1
    b.subscribe("news")
    assert a.broadcast("news", "two") == 2           # the sender gets its own broadcast too
    assert a.receive_topic("news") == "one" and a.try_receive_topic("news") == "two"
    assert b.receive_topic("news") == "two" and b.try_receive_topic("news") is None
    assert other.try_receive_topic("news") is None
    with pytest.raises(TrapError, match="messaging.receive-topic: not subscribed to topic 'x'"):
        a.receive_topic("x")


def test_topic_receive_is_cancelled_by_terminate_and_subscriptions_end():
    hub = MessageHub()
    a, _ = open_channel(hub, "a")
    b, _ = open_channel(hub, "b")
    a.subscribe("news")
    thread, outcome = receive_in_thread(lambda: a.receive_topic("news"))
    time.sleep(0.02)
    hub.close("a", "terminated")
    thread.join(timeout=5)
    assert isinstance(outcome[0], Cancelled)
    assert str(outcome[0]) == "messaging.receive-topic: terminated"
    assert b.broadcast("news", "x") == 0
    with pytest.raises(Cancelled):
        a.subscribe("news")


def test_store_is_per_tenant():
    hub = MessageHub(MessageLimits(store_max_keys=2))
    a, _ = open_channel(hub, "a")
    b, _ = open_channel(hub, "b")
    other, _ = open_channel(hub, "c", tenant="u")
    a.store_set("k", "v")
    assert b.store_get("k") == "v" and other.store_get("k") is None
    a.store_set("k", "w")
    a.store_set("j", "1")
    with pytest.raises(TrapError, match="store-set: the store is full \\(2 keys\\); cannot add 'z'"):
        b.store_set("z", "1")
    assert b.store_delete("k") and not b.store_delete("k")
    assert len(hub.store("t")) == 1


def test_inbox_capacity_drops_oldest():
    inbox = Inbox(capacity=2)
    for message in ("1", "2", "3"):
        inbox.put(message)
    assert inbox.num_dropped == 1
    assert [inbox.try_receive(), inbox.try_receive(), inbox.try_receive()] == ["2", "3", None]


def test_concurrent_deliveries_arrive_once_each():
    hub = MessageHub()
    channel, _ = open_channel(hub, "a")
    senders = [threading.Thread(target=lambda i=i: [hub.deliver("a", f"{i}:{n}") for n in range(50)])
               for i in range(8)]
    for sender in senders:
        sender.start()
    received = [channel.receive(timeout=5) for _ in range(400)]
    for sender in senders:
        sender.join()
    assert sorted(received) == sorted(f"{i}:{n}" for i in range(8) for n in range(50))
    assert channel.try_receive() is None


def test_store_validates_capacity():
    store = KeyValueStore(max_keys=1)
    store.set("a", "1")
    store.set("a", "2")                              # replacing does not need room
    assert store.get("a") == "2"


def test_store_is_bounded_in_characters_and_a_refused_set_changes_nothing():
    store = KeyValueStore(max_keys=100, max_chars=20)
    store.set("a", "x" * 9)                           # 10 characters
    store.set("b", "y" * 9)                           # 20
    with pytest.raises(LimitError, match=r"would hold 21 characters, more than its limit of 20 "
                                         r"\(store_max_chars\)"):
        store.set("c", "")
    with pytest.raises(LimitError, match="store_max_chars"):
        store.set("a", "x" * 10)                      # replacing counts the new value only
    assert store.get("a") == "x" * 9 and store.num_chars == 20
    store.set("a", "")                                # smaller: fits
    assert store.num_chars == 11
    assert store.delete("b") and store.num_chars == 1


def test_topic_inbox_drops_oldest_past_its_characters():
    hub = MessageHub(MessageLimits(topic_max_chars=10))
    reader, _ = open_channel(hub, "r")
    writer, _ = open_channel(hub, "w")
    reader.subscribe("news")
    for message in ("aaaa", "bbbb", "cccc", "dd"):
        writer.broadcast("news", message)
    inbox = hub.subscription("t", "news", "r")
    assert inbox.num_pending_chars == 10 and inbox.num_dropped == 1
    assert writer.broadcast("news", "x" * 11) == 0     # longer than the bound alone: dropped
    assert [reader.try_receive_topic("news") for _ in range(4)] == ["bbbb", "cccc", "dd", None]
    assert inbox.num_dropped == 2


def test_subscriptions_are_bounded():
    hub = MessageHub(MessageLimits(max_subscriptions=2))
    channel, _ = open_channel(hub, "a")
    channel.subscribe("one")
    channel.subscribe("two")
    channel.subscribe("one")                          # again: no new subscription
    with pytest.raises(LimitError, match=r"messaging.subscribe: already subscribed to 2 topics "
                                         r"\(max_subscriptions\)"):
        channel.subscribe("three")


def test_client_inbox_refuses_past_its_characters():
    hub = MessageHub(MessageLimits(client_max_chars=8))
    channel, _ = open_channel(hub, "a")
    assert hub.deliver("a", "12345")
    with pytest.raises(LimitError, match=r"client inbox of instance a \(client_max_chars\).*"
                                         r"limit of 8 characters"):
        hub.deliver("a", "6789")
    assert hub.deliver("a", "678")
    assert channel.try_receive() == "12345" and hub.deliver("a", "9")
