"""Outgoing HTTP (WIT `http`), within what the operator allowed the tenant.

    answer = inferlet.http.get("http://127.0.0.1:8080/search?q=rome")
    answer.status, answer.headers["content-type"], answer.json()

    pending = [inferlet.http.start("GET", url) for url in urls]     # all in flight at once
    answers = [p.result() for p in pending]

Every host and port must be in the tenant's `allow_hosts` (`pie run --allow-host HOST[:PORT]`);
each request is bounded by the host's limits (timeout, response size, requests per minute,
requests in flight per instance). A refusal or a failure raises HttpError naming the cause and
the limit; a 4xx / 5xx answer is an answer (check `status`, or call `raise_for_status`).
"""
from __future__ import annotations

import json as _json

from inferlet._wit import Err, http
from inferlet.errors import InferletError

__all__ = ["HttpError", "Response", "Pending", "start", "request", "get", "post"]


class HttpError(InferletError):
    """A request the host refused or that failed (the message names the cause and the limit),
    or an error status (raise_for_status)."""


class Headers:
    """Response headers: case-insensitive lookup; every (name, value) pair in `items()`."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self._pairs = [(name.lower(), value) for name, value in pairs]

    def get(self, name: str, default: str | None = None) -> str | None:
        name = name.lower()
        return next((value for key, value in self._pairs if key == name), default)

    def __getitem__(self, name: str) -> str:
        value = self.get(name)
        if value is None:
            raise KeyError(name)
        return value

    def __contains__(self, name: str) -> bool:
        return self.get(name) is not None

    def items(self) -> list[tuple[str, str]]:
        return list(self._pairs)

    def __repr__(self) -> str:
        return f"Headers({self._pairs!r})"


class Response:
    """An answer: status, headers, body (bytes) and the URL that gave it (after redirects)."""

    def __init__(self, status: int, headers: Headers, body: bytes, url: str) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.url = url

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def text(self, encoding: str = "utf-8") -> str:
        """The body decoded (undecodable bytes replaced)."""
        return self.body.decode(encoding, errors="replace")

    def json(self):
        """The body parsed as JSON (ValueError when it is not)."""
        return _json.loads(self.body)

    def raise_for_status(self) -> "Response":
        """This response, or HttpError for a 4xx / 5xx status."""
        if self.status >= 400:
            raise HttpError(f"{self.url}: HTTP {self.status}: {self.text()[:200]}")
        return self

    def __repr__(self) -> str:
        return f"Response({self.status}, {self.url!r}, {len(self.body)} bytes)"


class Pending:
    """A request on its way (`start`): `ready()` without blocking, `result()` once."""

    def __init__(self, handle) -> None:
        self._handle = handle

    def ready(self) -> bool:
        return self._handle.ready()

    def result(self) -> Response:
        """Block until the answer; HttpError on a refusal or failure."""
        try:
            answer = self._handle.get()
        except Err as err:
            raise HttpError(err.value) from None
        finally:
            self._handle = _Spent()
        return Response(answer.status, Headers(answer.headers), bytes(answer.body), answer.url)


class _Spent:
    def ready(self) -> bool:
        return True

    def get(self):
        raise HttpError("this request's answer was already taken")


def start(method: str, url: str, body: bytes | str | None = None, *,
          headers: dict[str, str] | list[tuple[str, str]] | None = None,
          json=None) -> Pending:
    """Send a request and return at once (several can be in flight, up to the host's
    max_concurrent). `json=` sends a value as JSON (with its Content-Type)."""
    pairs = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
    if json is not None:
        if body is not None:
            raise ValueError("give body or json, not both")
        body = _json.dumps(json)
        if not any(name.lower() == "content-type" for name, _ in pairs):
            pairs.append(("Content-Type", "application/json"))
    data = body.encode("utf-8") if isinstance(body, str) else bytes(body or b"")
    return Pending(http.send(method.upper(), url, pairs, data))


def request(method: str, url: str, body: bytes | str | None = None, *,
            headers: dict[str, str] | list[tuple[str, str]] | None = None,
            json=None) -> Response:
    """Send a request and wait for its answer (HttpError on a refusal or failure)."""
    return start(method, url, body, headers=headers, json=json).result()


def get(url: str, *, headers: dict[str, str] | None = None) -> Response:
    """GET `url`."""
    return request("GET", url, headers=headers)


def post(url: str, body: bytes | str | None = None, *, headers: dict[str, str] | None = None,
         json=None) -> Response:
    """POST `body` (or `json=`) to `url`."""
    return request("POST", url, body, headers=headers, json=json)
