"""A small HTTP tool server on 127.0.0.1 for the outbound tests, the ReAct example and bench/apps.py.

Routes (GET unless said):
- /search?q=TEXT[&delay_ms=N]  {"query": TEXT, "results": [...]}: the ReAct agent's tool, after
                               a delay (the server's own, or `delay_ms` given here)
- /echo (POST or GET)          {"method", "body", "headers"} of the request
- /redirect?to=URL             302 to URL
- /slow                        sends one byte per 0.5 s, for ever (a slow loris)
- /huge                        an endless body, chunked, no Content-Length
- /hang                        accepts and never answers
- /gather?key=K&n=N            answers 200 once N requests of key K are in at once (all of them
                               held until then), 504 after 30 s: proof that N were in flight
One asyncio loop in a thread of its own (no thread per connection: a burst of many agents' calls
costs little), HTTP/1.1 with keep-alive. Only ever bound to 127.0.0.1. Given an ssl.SSLContext
it serves HTTPS (`url` then gives https:// URLs).
"""
from __future__ import annotations

import asyncio
import json
import ssl
import threading
from urllib.parse import parse_qs, urlsplit

__all__ = ["ToolServer", "search_results"]

_MAX_HEAD_BYTES = 65_536
_MAX_BODY_BYTES = 16 << 20


def search_results(query: str) -> list[str]:
    """The canned results of /search: a few lines naming the query."""
    return [f"{query}: result {i}, a short fact about it." for i in range(1, 4)]


class ToolServer:
    """The server on 127.0.0.1 and a free port, its loop in a thread of this process.
    `with ToolServer(delay_ms=100) as server: server.url("/search?q=x")`."""

    def __init__(self, delay_ms: float = 0.0, tls: ssl.SSLContext | None = None) -> None:
        self.delay_ms = delay_ms
        self.tls = tls
        self.num_streamed_chunks = 0          # chunks /slow and /huge wrote so far
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="tool-server",
                                        daemon=True)
        self._stopping: asyncio.Event | None = None
        self._gatherings: dict[str, tuple[list[int], asyncio.Event]] = {}

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    def url(self, path: str) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> "ToolServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *_exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    async def _start(self) -> None:
        self._stopping = asyncio.Event()
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0, backlog=1024,
                                                  ssl=self.tls)

    async def _stop(self) -> None:
        assert self._server is not None and self._stopping is not None
        self._stopping.set()
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ssl.SSLError):
            pass
        finally:
            writer.close()

    async def _one_request(self, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> bool:
        """Serve one request; False when the connection is to close."""
        head = await reader.readuntil(b"\r\n\r\n")
        if len(head) > _MAX_HEAD_BYTES:
            return False
        lines = head.decode("latin-1").split("\r\n")
        method, target, _version = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        length = min(int(headers.get("content-length") or 0), _MAX_BODY_BYTES)
        body = (await reader.readexactly(length)).decode("utf-8", "replace") if length else ""
        parts = urlsplit(target)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        route = parts.path.strip("/")
        if route == "search":
            await asyncio.sleep(float(query.get("delay_ms", self.delay_ms)) / 1000)
            text = query.get("q", "")
            await _json(writer, 200, {"query": text, "results": search_results(text)})
        elif route == "echo":
            await _json(writer, 200, {"method": method, "body": body, "headers": headers})
        elif route == "redirect":
            await _send(writer, 302, [("Location", query.get("to", "/"))], b"")
        elif route == "slow":
            await _head(writer, 200, [("Content-Length", "1000000")])
            await self._stream(writer, b"x", pause_s=0.5)
            return False
        elif route == "huge":
            await _head(writer, 200, [("Transfer-Encoding", "chunked")])
            block = b"y" * 65536
            await self._stream(writer, b"%x\r\n%s\r\n" % (len(block), block), pause_s=0.0)
            return False
        elif route == "gather":
            arrived = await self._gather(query.get("key", ""), int(query.get("n", "1")))
            await _json(writer, 200 if arrived else 504, {"gathered": arrived})
        elif route == "hang":
            assert self._stopping is not None
            await self._stopping.wait()
            return False
        else:
            await _json(writer, 404, {"error": f"no route {parts.path}"})
        return True

    async def _gather(self, key: str, num: int) -> bool:
        count, event = self._gatherings.setdefault(key, ([0], asyncio.Event()))
        count[0] += 1
        if count[0] >= num:
            event.set()
        try:
            await asyncio.wait_for(event.wait(), 30)
        except asyncio.TimeoutError:
            return False
        return True

    async def _stream(self, writer: asyncio.StreamWriter, chunk: bytes, pause_s: float) -> None:
        """Write `chunk` until the client goes away or the server stops."""
        assert self._stopping is not None
        while not self._stopping.is_set():
            writer.write(chunk)
            await writer.drain()
            self.num_streamed_chunks += 1
            await asyncio.sleep(pause_s)


async def _head(writer: asyncio.StreamWriter, status: int, headers: list[tuple[str, str]]) -> None:
    lines = [f"HTTP/1.1 {status} X"] + [f"{name}: {value}" for name, value in headers]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    await writer.drain()


async def _send(writer: asyncio.StreamWriter, status: int, headers: list[tuple[str, str]],
                body: bytes) -> None:
    await _head(writer, status, [*headers, ("Content-Length", str(len(body)))])
    writer.write(body)
    await writer.drain()


async def _json(writer: asyncio.StreamWriter, status: int, value: object) -> None:
    await _send(writer, status, [("Content-Type", "application/json")],
                json.dumps(value).encode())


def main() -> None:
    """`python -m tests.host.servers.tool_server [--delay-ms N]`: serve on 127.0.0.1 in this
    process (its own GIL, apart from a benchmark's host) until stdin closes; the first line on
    stdout is the port."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description="the tool server, on 127.0.0.1")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    opts = parser.parse_args()
    with ToolServer(delay_ms=opts.delay_ms) as server:
        print(server.port, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
