"""A small HTTP tool server on 127.0.0.1 for the outbound tests, the ReAct example and bench/apps.py.

Routes (GET unless said):
- /search?q=TEXT[&delay_ms=N]  {"query": TEXT, "results": [...]}: the ReAct agent's tool, after
                               an optional delay (the server's own, or `delay_ms` given here)
- /echo (POST)                 {"method", "body", "headers"} of the request
- /redirect?to=URL             302 to URL
- /slow                        sends one byte per 0.5 s, for ever (a slow loris)
- /huge                        an endless body, chunked, no Content-Length
- /hang                        accepts and never answers
Only ever bound to 127.0.0.1.
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

__all__ = ["ToolServer", "search_results"]


def search_results(query: str) -> list[str]:
    """The canned results of /search: a few lines naming the query."""
    return [f"{query}: result {i}, a short fact about it." for i in range(1, 4)]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, *_args: object) -> None:     # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        route = getattr(self, f"_route_{parts.path.strip('/')}", None)
        if route is None:
            self._json(404, {"error": f"no route {parts.path}"})
        else:
            route(query)

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length).decode("utf-8", "replace")
        self._json(200, {"method": "POST", "body": body,
                         "headers": {k.lower(): v for k, v in self.headers.items()}})

    def _route_search(self, query: dict[str, str]) -> None:
        delay_ms = float(query.get("delay_ms", self.server.delay_ms))
        time.sleep(delay_ms / 1000)
        text = query.get("q", "")
        self._json(200, {"query": text, "results": search_results(text)})

    def _route_echo(self, _query: dict[str, str]) -> None:
        self._json(200, {"method": "GET", "headers": {k.lower(): v
                                                      for k, v in self.headers.items()}})

    def _route_redirect(self, query: dict[str, str]) -> None:
        self.send_response(302)
        self.send_header("Location", query.get("to", "/"))
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _route_slow(self, _query: dict[str, str]) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "1000000")
        self.end_headers()
        self._stream(lambda: b"x", pause_s=0.5)

    def _route_huge(self, _query: dict[str, str]) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        block = b"y" * 65536
        self._stream(lambda: b"%x\r\n%s\r\n" % (len(block), block), pause_s=0.0)

    def _route_hang(self, _query: dict[str, str]) -> None:
        self.server.stopping.wait()

    def _stream(self, chunk, pause_s: float) -> None:
        """Write chunks until the client goes away or the server stops."""
        try:
            while not self.server.stopping.is_set():
                self.wfile.write(chunk())
                self.wfile.flush()
                self.server.num_streamed_chunks += 1
                if pause_s:
                    self.server.stopping.wait(pause_s)
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True

    def _json(self, status: int, value: object) -> None:
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    delay_ms: float = 0.0
    num_streamed_chunks: int = 0
    stopping: threading.Event


class ToolServer:
    """The server in a thread of this process, on 127.0.0.1 and a free port.
    `with ToolServer(delay_ms=100) as server: server.url("/search?q=x")`."""

    def __init__(self, delay_ms: float = 0.0) -> None:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.delay_ms = delay_ms
        self._server.stopping = threading.Event()
        self._thread = threading.Thread(target=self._server.serve_forever, name="tool-server",
                                        daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def num_streamed_chunks(self) -> int:
        """Chunks /slow and /huge wrote so far (how far a cut-off stream got)."""
        return self._server.num_streamed_chunks

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> "ToolServer":
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._server.stopping.set()
        self._server.shutdown()
        self._server.server_close()
