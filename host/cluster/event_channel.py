"""EventChannel: instance events pushed from a replica to its front over one TCP connection.

Events are the hot path of a cluster (every token an instance streams is one); a Ray call per
batch costs a task's round trip, so a replica pushes its events to each front over a socket of
their own, while everything else (launches, sends, liveness) stays on Ray. The front listens
on its node's address (`EventListener`); the replica connects (`EventWriter`) when the front
asks it to over Ray, sending first the front's secret token (given to it in that Ray call) and
its (replica id, epoch); a peer that does not send the token within `HELLO_TIMEOUT_S` is
dropped. Frames are a 4-byte length and a pickle (only from a peer that sent the token), at
most `MAX_FRAME_BYTES`. The token travels in clear, like Ray's own traffic: a cluster's network
is trusted as Ray's is.
"""
from __future__ import annotations

import hmac
import os
import pickle
import select
import socket
import struct
import threading
import time
from typing import Any

__all__ = ["EventListener", "EventReader", "EventWriter", "ChannelClosed", "MAX_FRAME_BYTES",
           "HELLO_TIMEOUT_S", "FRAME_TIMEOUT_S"]

MAX_FRAME_BYTES = 64 << 20
HELLO_TIMEOUT_S = 5.0
FRAME_TIMEOUT_S = 60.0
_MAX_GREETING = 16             # connections being checked at once; more are dropped
_TOKEN_BYTES = 32
_HEADER = struct.Struct("!I")
_MAX_HELLO_BYTES = 256
_MAX_WAITING_CONNECTIONS = 64


class ChannelClosed(Exception):
    """The connection ended (the peer closed it or went away) or broke the framing."""


def _recv_exact(sock: socket.socket, num_bytes: int) -> bytes:
    chunks, left = [], num_bytes
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ChannelClosed("the peer closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket, max_bytes: int) -> bytes:
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if length > max_bytes:
        raise ChannelClosed(f"a frame of {length} bytes, over the limit of {max_bytes}")
    return _recv_exact(sock, length)


def _close(sock: socket.socket) -> None:
    """Shut both directions (a reader blocked on the socket wakes), then close."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {len(payload)} bytes, over the limit of {MAX_FRAME_BYTES}")
    sock.sendall(_HEADER.pack(len(payload)) + payload)


class EventReader:
    """The front's end of one replica's connection. `read(timeout_s)`: the next object sent, or
    None when none came in time; ChannelClosed once the connection ended."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def read(self, timeout_s: float) -> Any:
        self._sock.settimeout(timeout_s)
        try:
            header = self._sock.recv(_HEADER.size, socket.MSG_PEEK)
        except socket.timeout:
            return None
        except OSError as exc:
            raise ChannelClosed(f"the connection broke: {exc}") from None
        if not header:
            raise ChannelClosed("the peer closed the connection")
        self._sock.settimeout(FRAME_TIMEOUT_S)       # a frame begun arrives whole, or never
        try:
            return pickle.loads(_recv_frame(self._sock, MAX_FRAME_BYTES))
        except OSError as exc:
            raise ChannelClosed(f"the connection broke: {exc}") from None

    def close(self) -> None:
        _close(self._sock)


class EventListener:
    """The front's listening socket: accepts replicas' connections, checks each one's token and
    hello, and hands it to whoever waits for that (replica id, epoch)."""

    def __init__(self, host: str) -> None:
        self.token = os.urandom(_TOKEN_BYTES)
        self._server = socket.create_server((host, 0))
        self.address = (host, self._server.getsockname()[1])
        self._cond = threading.Condition()
        self._ready: dict[tuple[str, int], socket.socket] = {}
        self._closed = False
        self._greeting = threading.BoundedSemaphore(_MAX_GREETING)
        self._thread = threading.Thread(target=self._accept, daemon=True,
                                        name="pie-event-listener")
        self._thread.start()

    def take(self, replica_id: str, epoch: int, timeout_s: float) -> EventReader | None:
        """The connection of the replica's life `epoch`, waiting up to `timeout_s` for it."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (replica_id, epoch) not in self._ready and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            sock = self._ready.pop((replica_id, epoch), None)
        return None if sock is None else EventReader(sock)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            waiting = list(self._ready.values())
            self._ready.clear()
            self._cond.notify_all()
        for sock in waiting:
            sock.close()
        _close(self._server)                             # wakes the accept loop
        self._thread.join(2.0)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return                                   # closed
            if not self._greeting.acquire(blocking=False):
                sock.close()
                continue
            threading.Thread(target=self._greet, args=(sock,), daemon=True,
                             name="pie-event-hello").start()

    def _greet(self, sock: socket.socket) -> None:
        try:
            self._check(sock)
        finally:
            self._greeting.release()

    def _check(self, sock: socket.socket) -> None:
        """Check one connection's token and hello within HELLO_TIMEOUT_S; keep it or drop it."""
        sock.settimeout(HELLO_TIMEOUT_S)
        try:
            token = _recv_exact(sock, _TOKEN_BYTES)
            if not hmac.compare_digest(token, self.token):
                raise ChannelClosed("wrong token")
            replica_id, _, epoch = _recv_frame(sock, _MAX_HELLO_BYTES).decode().partition(":")
            key = (replica_id, int(epoch))
        except (OSError, ChannelClosed, ValueError, UnicodeDecodeError):
            sock.close()
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._cond:
            if self._closed or len(self._ready) >= _MAX_WAITING_CONNECTIONS:
                sock.close()
                return
            stale = self._ready.pop(key, None)
            self._ready[key] = sock
            self._cond.notify_all()
        if stale is not None:
            stale.close()


class EventWriter:
    """The replica's end: connects to a front's listener and sends objects, each one frame.
    A send that cannot complete within `send_timeout_s` (the front stopped reading) fails."""

    def __init__(self, address: tuple[str, int], token: bytes, replica_id: str, epoch: int,
                 send_timeout_s: float = 30.0) -> None:
        self._sock = socket.create_connection(tuple(address), timeout=HELLO_TIMEOUT_S)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(send_timeout_s)
        self._sock.sendall(bytes(token))
        _send_frame(self._sock, f"{replica_id}:{epoch}".encode())

    def peer_closed(self) -> bool:
        """Whether the front closed its end (checked without waiting)."""
        readable, _, _ = select.select([self._sock], [], [], 0)
        if not readable:
            return False
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def send(self, obj: Any) -> None:
        """Send one object; ChannelClosed when the front is gone or stopped reading."""
        try:
            _send_frame(self._sock, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as exc:
            raise ChannelClosed(f"the front's connection broke: {exc}") from None

    def close(self) -> None:
        _close(self._sock)
