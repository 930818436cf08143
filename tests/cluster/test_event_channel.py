"""The event channel between a replica and its front (no Ray): objects cross in order, a peer
without the front's token (or with a bad hello, or an oversized frame) is dropped, a closed peer
ends the reader."""
from __future__ import annotations

import socket
import struct

import pytest

from host.cluster import event_channel
from host.cluster.event_channel import ChannelClosed, EventListener, EventWriter


@pytest.fixture
def listener():
    made = EventListener("127.0.0.1")
    yield made
    made.close()


def test_objects_cross_in_order(listener) -> None:
    writer = EventWriter(listener.address, listener.token, "r0", 3)
    reader = listener.take("r0", 3, timeout_s=5)
    assert reader is not None
    for index in range(50):
        writer.send(("event", index))
    assert [reader.read(5) for _ in range(50)] == [("event", i) for i in range(50)]
    assert reader.read(0.05) is None                     # nothing more: a timeout, not an error
    writer.close()
    with pytest.raises(ChannelClosed):
        reader.read(5)
    reader.close()


def test_connection_is_kept_per_replica_life(listener) -> None:
    EventWriter(listener.address, listener.token, "r1", 1)
    assert listener.take("r1", 2, timeout_s=0.3) is None   # another life's is not handed out
    assert listener.take("r1", 1, timeout_s=5) is not None


def test_wrong_token_is_dropped(listener) -> None:
    writer = EventWriter(listener.address, b"x" * 32, "r0", 1)
    assert listener.take("r0", 1, timeout_s=0.5) is None
    with pytest.raises(ChannelClosed):                   # the listener closed it
        for _ in range(100):
            writer.send("x" * 100_000)


def test_silent_peer_is_dropped(listener, monkeypatch) -> None:
    monkeypatch.setattr(event_channel, "HELLO_TIMEOUT_S", 0.2)
    with socket.create_connection(listener.address) as sock:
        sock.settimeout(5)
        assert sock.recv(1) == b""                       # closed after the hello's timeout
    writer = EventWriter(listener.address, listener.token, "r0", 1)   # others still get in
    assert listener.take("r0", 1, timeout_s=5) is not None
    writer.close()


def test_oversized_frame_ends_the_reader(listener, monkeypatch) -> None:
    writer = EventWriter(listener.address, listener.token, "r0", 1)
    reader = listener.take("r0", 1, timeout_s=5)
    monkeypatch.setattr(event_channel, "MAX_FRAME_BYTES", 1000)
    writer._sock.sendall(struct.pack("!I", 1001) + b"\0" * 1001)
    with pytest.raises(ChannelClosed, match="over the limit of 1000"):
        reader.read(5)
    reader.close()
    writer.close()
