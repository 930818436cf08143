"""EventSink: where instance events wait for the client that launched them, counted in bytes.

One per websocket connection (shared by its instances) or per OpenAI request. The service puts
events in from the trio thread; the connection's writer (or the HTTP response) takes them out.
The sink counts the bytes waiting (each event's data plus a fixed overhead), so the service can
cut off an instance whose client does not read once `server.max_client_backlog_bytes` are waiting,
whatever the size of each event. Trio thread only (no locks).
"""
from __future__ import annotations

import math
from typing import Any, AsyncIterator

import trio

__all__ = ["EventSink", "event_bytes"]

EVENT_OVERHEAD_BYTES = 64   # the frame around an event's data: type, instance id, kind


def event_bytes(event: Any) -> int:
    """The bytes an event is counted for while it waits."""
    return len(event.data) + EVENT_OVERHEAD_BYTES


class EventSink:
    """An unbounded channel of events with the bytes waiting in it (`num_bytes`)."""

    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel(math.inf)
        self.num_bytes = 0

    def put(self, event: Any) -> None:
        """Queue an event; trio.BrokenResourceError / ClosedResourceError once closed."""
        self._send.send_nowait(event)
        self.num_bytes += event_bytes(event)

    async def get(self) -> Any:
        """The next event; trio.EndOfChannel once closed for sending and empty."""
        event = await self._receive.receive()
        self.num_bytes -= event_bytes(event)
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
        self.num_bytes = 0
