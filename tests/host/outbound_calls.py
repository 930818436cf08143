"""What the outbound tests share: the tool server and the Outbound service as fixtures, and one
HTTP call of an instance's handle (send, wait for its answer, take it)."""
from __future__ import annotations

import pytest

from host.outbound import HttpRequest, HttpResponse, Outbound
from tests.host.servers.tool_server import ToolServer


@pytest.fixture(scope="module")
def server():
    with ToolServer() as running:
        yield running


@pytest.fixture
def outbound():
    service = Outbound()
    yield service
    service.close()


def fetch(handle, url: str, method: str = "GET", body: bytes = b"",
          headers: tuple = ()) -> HttpResponse | str:
    """The answer to one request through `handle`: the response, or the err text."""
    rep = handle.send("http.send", HttpRequest(method, url, headers, body))
    future = handle.future_of("get", rep)
    if future is not None:
        future.exception(30)             # wait; take() words a failure
    return handle.take("http.send", rep)
