"""The per-tenant counters of outbound calls (host/outbound/stats.py) as a runtime's instances
make them: every refusal counted under its cause, requests and their bytes, MCP calls and
errors, each tenant apart. Servers on 127.0.0.1 only."""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

from host.errors import OutboundRefused
from host.outbound import HttpRequest
from host.outbound.stats import REFUSAL_CAUSES, Refused, cause_of
from host.runtime_config import McpServer, OutboundLimits
from tests.host.outbound_calls import fetch as _answer, outbound, server  # noqa: F401

CALCULATOR = (sys.executable, str(Path(__file__).resolve().parent / "servers" /
                                  "mcp_calculator.py"))




def test_every_refusal_is_counted_under_its_cause(server, outbound):
    port = server.port
    base = dict(allow_hosts=(f"127.0.0.1:{port}", f"localhost:{port}"), timeout_s=5.0)
    handle = outbound.for_instance("alice", OutboundLimits(**base, max_request_bytes=8,
                                                           max_response_bytes=1024,
                                                           max_redirects=0))
    _answer(handle, "http://example.com/")                                    # allowlist
    _answer(handle, f"http://localhost:{port}/search")                        # private_address
    _answer(handle, server.url("/echo"), "POST", b"x" * 9)                    # size (out)
    _answer(handle, server.url("/huge"))                                      # size (in)
    _answer(handle, server.url("/redirect?to=/search"))                       # redirects
    _answer(handle, server.url("/echo"), headers=(("Host", "x"),))            # invalid
    slow = outbound.for_instance("alice", OutboundLimits(**{**base, "timeout_s": 0.5}))
    _answer(slow, server.url("/hang"))                                        # timeout
    single = outbound.for_instance("alice", OutboundLimits(**base, max_concurrent=1))
    single.send("http.send", HttpRequest("GET", server.url("/search?delay_ms=200"), (), b""))
    _answer(single, server.url("/search"))                                    # concurrency
    rated = outbound.for_instance("bob", OutboundLimits(**base, requests_per_minute=1))
    first = _answer(rated, server.url("/search?q=bob"))
    assert first.status == 200
    _answer(rated, server.url("/search"))                                     # rate
    _answer(handle, f"http://127.0.0.1:{_closed_port()}/")                    # not allowed
    figures = outbound.stats.snapshot()
    assert figures["alice"].refusals == {
        "allowlist": 2, "private_address": 1, "size": 2, "redirects": 1, "invalid": 1,
        "timeout": 1, "concurrency": 1}
    bob = figures["bob"]
    assert bob.refusals == {"rate": 1} and bob.num_requests == 1
    assert bob.num_bytes_in == len(first.body) and bob.num_bytes_out == 0


def test_requests_and_bytes_are_counted_per_tenant(server, outbound):
    limits = OutboundLimits(allow_hosts=(f"127.0.0.1:{server.port}",), timeout_s=5.0)
    alice = outbound.for_instance("alice", limits)
    echo = _answer(alice, server.url("/echo"), "POST", b"12345")
    first = _answer(alice, server.url("/search?q=a"))
    _answer(outbound.for_instance("carol", limits), server.url("/search?q=c"))
    figures = outbound.stats.snapshot()
    assert figures["alice"].num_requests == 2 and figures["alice"].num_bytes_out == 5
    assert figures["alice"].num_bytes_in == len(echo.body) + len(first.body)
    assert figures["alice"].refusals == {}
    assert figures["carol"].num_requests == 1 and figures["carol"].num_bytes_out == 0


def test_mcp_calls_and_errors_are_counted(outbound):
    limits = OutboundLimits(mcp_servers=(McpServer("calc", command=CALCULATOR),
                                         McpServer("hang", command=(*CALCULATOR, "--hang"))),
                            mcp_timeout_s=20.0)
    handle = outbound.for_instance("alice", limits)
    assert "42" in handle.mcp_call("mcp.call", "calc", "multiply", {"a": 6, "b": 7}).result(60)
    with pytest.raises(OutboundRefused):
        handle.mcp_call("mcp.call", "nope", "add", {})
    fast = outbound.for_instance("alice", OutboundLimits(mcp_servers=limits.mcp_servers,
                                                         mcp_timeout_s=1.0))
    with pytest.raises(OutboundRefused, match="mcp_timeout_s"):
        fast.mcp_call("mcp.call", "hang", "add", {"a": 1, "b": 2}).result(30)
    figures = outbound.stats.snapshot()["alice"]
    assert figures.num_mcp_calls == 3 and figures.num_mcp_errors == 2
    assert figures.refusals == {"invalid": 1, "timeout": 1}
    assert figures.num_requests == 0


def test_a_refusal_keeps_its_cause_across_processes():
    refused = pickle.loads(pickle.dumps(Refused("rate", "too many")))
    assert isinstance(refused, OutboundRefused) and str(refused) == "too many"
    assert cause_of(refused) == "rate" and cause_of(OutboundRefused("x")) == "failed"
    assert cause_of(ValueError("x")) == "failed" and "failed" in REFUSAL_CAUSES


def _closed_port() -> int:
    """A port no rule of the test's allow_hosts names."""
    return 1
