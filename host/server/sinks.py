"""EventSink: where instance events wait for the client that launched them, counted in bytes.

One per websocket connection (shared by its instances) or per OpenAI request. An event is
counted (`reserve`, on the instance's thread) the moment it is queued towards the trio loop, is put
in from the trio thread, and stops counting when the connection's writer (or the HTTP response)
takes it out, or when it is dropped on the way (`release`). So `num_bytes` (each event's data plus
a fixed overhead) covers the events in flight to trio as well as those waiting here, and the
service can cut off an instance whose client does not read once `server.max_client_backlog_bytes`
would be passed, whatever the size of each event and however slow the trio loop. The count is
under a small lock; the channel itself is used from the trio thread only.
"""
from __future__ import annotations

import math
import threading
from typing import Any, AsyncIterator

import trio

__all__ = ["EventSink", "event_bytes"]

EVENT_OVERHEAD_BYTES = 64   # the frame around an event's data: type, instance id, kind


def event_bytes(event: Any) -> int:
    """The bytes an event is counted for while it waits."""
    return len(event.data) + EVENT_OVERHEAD_BYTES


class EventSink:
    """An unbounded channel of events with the bytes on their way to it or waiting in it
    (`num_bytes`; the service bounds it)."""

    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel(math.inf)
        self._lock = threading.Lock()
        self._num_bytes = 0
        self._closed = False

    @property
    def num_bytes(self) -> int:
        """Bytes of the events reserved and not yet taken out or released."""
        return self._num_bytes

    def reserve(self, event: Any) -> int:
        """Count an event on its way here (any thread); the bytes counted now, this one
        included. A closed sink counts nothing (0)."""
        with self._lock:
            if self._closed:
                return 0
            self._num_bytes += event_bytes(event)
            return self._num_bytes

    def release(self, event: Any) -> None:
        """Stop counting a reserved event that will not be put (dropped on its way)."""
        self._add(-event_bytes(event))

    def _add(self, num_bytes: int) -> None:
        with self._lock:
            if not self._closed:
                self._num_bytes += num_bytes

    def put(self, event: Any) -> None:
        """Queue an event counted by `reserve`; trio.BrokenResourceError / ClosedResourceError
        once closed (it then counts nothing)."""
        self._send.send_nowait(event)

    async def get(self) -> Any:
        """The next event; trio.EndOfChannel once closed for sending and empty."""
        event = await self._receive.receive()
        self._add(-event_bytes(event))
        return event

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._events()

    async def _events(self) -> AsyncIterator[Any]:
        while True:
            try:
                yield await self.get()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return

    async def close_sending(self) -> None:
        """No more events: readers drain what is left, then stop."""
        await self._send.aclose()

    def close(self) -> None:
        """Drop what is waiting; later puts fail (the service then stops delivering)."""
        self._receive.close()
        with self._lock:
            self._closed = True
            self._num_bytes = 0
