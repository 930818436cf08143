"""Outgoing HTTP and MCP calls of instances (host/outbound/), at the host's level: the allowlist,
the address checks on every hop, the limits (timeout, response size, requests per minute,
requests in flight), each refusal an err naming its limit while the other instances' requests go
on. Servers run on 127.0.0.1 only (tests/host/servers/)."""
from __future__ import annotations

import re
import sys
import tracemalloc
from pathlib import Path

import pytest

from host.errors import OutboundRefused, TrapError
from host.outbound import HttpRequest, HttpResponse
from host.outbound.policy import check_addresses, check_url, parse_rules
from host.runtime_config import McpServer, OutboundLimits
from tests.host.outbound_calls import fetch as _fetch, outbound, server  # noqa: F401
from tests.host.servers.tool_server import ToolServer

SERVERS = Path(__file__).resolve().parent / "servers"
CALCULATOR = (sys.executable, str(SERVERS / "mcp_calculator.py"))


def _limits(server: ToolServer, **overrides) -> OutboundLimits:
    values = dict(allow_hosts=(f"127.0.0.1:{server.port}",), timeout_s=5.0)
    values.update(overrides)
    return OutboundLimits(**values)




# -- the allowlist and the addresses --------------------------------------------------------

def test_rules_match_hosts_suffixes_and_ports():
    rules = parse_rules(("api.example.com", ".example.org:8443", "127.0.0.1:9000", "[::1]:9001"))
    assert check_url("https://api.example.com/x?y=1", rules).path == "/x?y=1"
    assert check_url("http://api.example.com/", rules).port == 80
    assert check_url("https://a.b.example.org:8443/", rules).host == "a.b.example.org"
    assert check_url("http://127.0.0.1:9000/", rules).rule.literal is not None
    assert check_url("http://[::1]:9001/", rules).host == "::1"
    for url, cause in (("https://api.example.com:8080/", "not in allow_hosts"),
                       ("https://evil-example.org:8443/", "not in allow_hosts"),
                       ("https://example.com.attacker.net/", "not in allow_hosts"),
                       ("ftp://api.example.com/", "only http and https"),
                       ("http://user:pw@api.example.com/", "credentials"),
                       ("http://127.0.0.1:9001/", "not in allow_hosts")):
        with pytest.raises(OutboundRefused, match=cause):
            check_url(url, rules)
    with pytest.raises(OutboundRefused, match=r"\(none allowed\)"):
        check_url("https://api.example.com/", ())


def test_a_name_never_reaches_a_private_address():
    rules = parse_rules(("api.example.com", "127.0.0.1:80"))
    target = check_url("http://api.example.com/", rules)
    assert str(check_addresses(target, ["93.184.216.34"])) == "93.184.216.34"
    for address, kind in (("127.0.0.1", "loopback"), ("10.1.2.3", "private"),
                          ("169.254.169.254", "link-local"), ("::ffff:192.168.0.1", "private"),
                          ("::1", "loopback"), ("0.0.0.0", "unspecified")):
        with pytest.raises(OutboundRefused, match=rf"a non-global address \({kind}\)"):
            check_addresses(target, ["93.184.216.34", address])   # every address is checked
    literal = check_url("http://127.0.0.1/", rules)
    assert str(check_addresses(literal, ["127.0.0.1"])) == "127.0.0.1"


def test_limits_are_validated():
    for bad in (dict(allow_hosts=("a..b",)), dict(allow_hosts=("h:x",)), dict(timeout_s=0),
                dict(max_concurrent=0), dict(max_response_bytes=0),
                dict(mcp_servers=(McpServer("a", url="http://x"), McpServer("a", url="http://y")))):
        with pytest.raises(ValueError):
            OutboundLimits(**bad)
    with pytest.raises(ValueError, match="exactly one of url, command"):
        McpServer("calc")
    with pytest.raises(ValueError, match="http"):
        McpServer("calc", url="file:///etc/passwd")


# -- requests --------------------------------------------------------------------------------

def test_get_and_post_reach_an_allowed_server(server, outbound):
    handle = outbound.for_instance("t", _limits(server))
    answer = _fetch(handle, server.url("/search?q=rome"))
    assert isinstance(answer, HttpResponse) and answer.status == 200
    assert b'"query": "rome"' in answer.body
    assert ("content-type", "application/json") in answer.headers
    echo = _fetch(handle, server.url("/echo"), "POST", b"payload", (("X-Tool", "1"),))
    assert b'"body": "payload"' in echo.body and b'"x-tool": "1"' in echo.body
    assert handle.num_in_flight == 0


def test_a_host_outside_the_allowlist_is_refused_before_anything_is_sent(server, outbound):
    handle = outbound.for_instance("t", _limits(server))
    assert "example.com:80 is not in allow_hosts" in _fetch(handle, "http://example.com/")
    assert f"127.0.0.1:{server.port + 1}" in _fetch(handle, f"http://127.0.0.1:{server.port + 1}/")
    nothing = outbound.for_instance("t", OutboundLimits())
    assert "(none allowed)" in _fetch(nothing, server.url("/search"))


def test_headers_the_host_sets_are_refused(server, outbound):
    handle = outbound.for_instance("t", _limits(server, max_request_bytes=16))
    assert "set by the host" in _fetch(handle, server.url("/echo"), headers=(("Host", "x"),))
    assert "CR, LF" in _fetch(handle, server.url("/echo"), headers=(("X-A", "a\r\nB: c"),))
    assert "max_request_bytes 16" in _fetch(handle, server.url("/echo"), "POST", b"x" * 17)
    assert "method" in _fetch(handle, server.url("/echo"), "CONNECT")


def test_a_redirect_is_checked_on_every_hop(server, outbound):
    limits = _limits(server, allow_hosts=(f"127.0.0.1:{server.port}", f"localhost:{server.port}",
                                          "internal.example"))
    handle = outbound.for_instance("t", limits)
    followed = _fetch(handle, server.url("/redirect?to=/search?q=hop"))
    assert followed.status == 200 and followed.url.endswith("/search?q=hop")
    to_name = _fetch(handle, server.url(f"/redirect?to=http://localhost:{server.port}/search"))
    assert re.search(r"localhost resolves to (127\.0\.0\.1|::1), a non-global address "
                     r"\(loopback\)", to_name)
    to_private = _fetch(handle, server.url("/redirect?to=http://10.0.0.1/"))
    assert "10.0.0.1:80 is not in allow_hosts" in to_private
    loop = server.url("/redirect?to=" + server.url("/redirect?to=/search"))
    assert "more than 1 redirects (max_redirects)" in _fetch(
        outbound.for_instance("t", _limits(server, max_redirects=1)), loop)


def test_a_slow_loris_server_is_cut_at_the_timeout(server, outbound):
    handle = outbound.for_instance("t", _limits(server, timeout_s=1.0))
    assert "no complete answer within 1 s (timeout_s)" in _fetch(handle, server.url("/slow"))
    assert "timeout_s" in _fetch(handle, server.url("/hang"))
    assert handle.num_in_flight == 0


def test_a_huge_response_stops_at_the_cap(server, outbound):
    handle = outbound.for_instance("t", _limits(server, max_response_bytes=256 << 10))
    before = server.num_streamed_chunks
    answer = _fetch(handle, server.url("/huge"))
    assert "passed max_response_bytes 262144" in answer
    # the host read about the cap, not the endless body: a few 64 KiB chunks, then it hung up
    assert server.num_streamed_chunks - before < 64


def test_a_huge_response_costs_the_host_about_the_cap(server, outbound):
    """An endless body read to a 1 MiB cap: the host's allocations peak near the cap, and what
    it kept is released once the refusal is taken."""
    handle = outbound.for_instance("t", _limits(server, max_response_bytes=1 << 20))
    _fetch(handle, server.url("/search"))                    # the loop and client exist first
    tracemalloc.start()
    try:
        baseline, _ = tracemalloc.get_traced_memory()
        answer = _fetch(handle, server.url("/huge"))
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "passed max_response_bytes 1048576" in answer
    assert peak - baseline < 8 << 20
    assert current - baseline < 1 << 20


def test_requests_in_flight_per_instance_are_bounded(server, outbound):
    limits = _limits(server, max_concurrent=2, timeout_s=10.0)
    handle, other = outbound.for_instance("t", limits), outbound.for_instance("t", limits)
    slow = [handle.send("http.send", HttpRequest("GET", server.url("/search?delay_ms=300"), (),
                                                 b"")) for _ in range(2)]
    third = handle.take("http.send", handle.send("http.send", HttpRequest(
        "GET", server.url("/search"), (), b"")))
    assert "2 requests of this instance in flight or unread, its limit (max_concurrent 2)" in third
    assert _fetch(other, server.url("/search?q=other")).status == 200    # another instance goes on
    for rep in slow:
        handle.future_of("get", rep).result(30)
        assert handle.take("http.send", rep).status == 200
    assert _fetch(handle, server.url("/search")).status == 200          # slots came back
    with pytest.raises(TrapError, match="already read"):
        handle.take("http.send", slow[0])


def test_requests_per_minute_are_charged_to_the_tenant(server, outbound):
    limits = _limits(server, requests_per_minute=3)
    first, second = outbound.for_instance("a", limits), outbound.for_instance("a", limits)
    assert _fetch(first, server.url("/search")).status == 200
    assert _fetch(second, server.url("/search")).status == 200
    assert _fetch(first, server.url("/search")).status == 200
    refused = _fetch(second, server.url("/search"))
    assert "3 requests of this tenant in the last minute" in refused
    assert "requests_per_minute 3" in refused
    assert _fetch(outbound.for_instance("b", limits), server.url("/search")).status == 200


def test_dropping_and_clearing_cancel_requests_in_flight(server, outbound):
    handle = outbound.for_instance("t", _limits(server, max_concurrent=1, timeout_s=30.0))
    rep = handle.send("http.send", HttpRequest("GET", server.url("/hang"), (), b""))
    future = handle.future_of("get", rep)
    handle.drop(rep)
    assert handle.num_in_flight == 0 and future.cancelled()
    rep = handle.send("http.send", HttpRequest("GET", server.url("/hang"), (), b""))
    future = handle.future_of("get", rep)
    handle.clear()
    assert handle.num_in_flight == 0 and future.cancelled()


def test_many_instances_requests_are_in_flight_together(server, outbound):
    """Eight instances' requests are all in flight at once on the one loop: the server answers
    only once it holds all eight."""
    limits = _limits(server, timeout_s=60.0)
    handles = [outbound.for_instance("t", limits) for _ in range(8)]
    reps = [h.send("http.send", HttpRequest("GET", server.url("/gather?key=eight&n=8"), (), b""))
            for h in handles]
    for handle, rep in zip(handles, reps):
        handle.future_of("get", rep).result(60)
    assert [h.take("http.send", rep).status for h, rep in zip(handles, reps)] == [200] * 8


# -- MCP -------------------------------------------------------------------------------------

def test_mcp_tools_are_listed_and_called(outbound):
    limits = OutboundLimits(mcp_servers=(McpServer("calc", command=CALCULATOR),),
                            mcp_timeout_s=60.0)
    handle = outbound.for_instance("t", limits)
    tools = {name: schema for name, _, schema in handle.mcp_tools("mcp.tools", "calc").result(90)}
    assert {"add", "multiply", "evaluate"} <= set(tools) and '"a"' in tools["add"]
    answer = handle.mcp_call("mcp.call", "calc", "multiply", {"a": 6, "b": 7}).result(90)
    assert '"structuredContent": {"result": 42.0}' in answer and '"isError": false' in answer
    with pytest.raises(OutboundRefused, match=r"no MCP server 'nope' \(available: calc\)"):
        handle.mcp_call("mcp.call", "nope", "add", {})
    small = outbound.for_instance("t", OutboundLimits(
        mcp_servers=limits.mcp_servers, mcp_timeout_s=60.0, max_mcp_result_chars=10))
    with pytest.raises(OutboundRefused, match="max_mcp_result_chars 10"):
        small.mcp_call("mcp.call", "calc", "add", {"a": 1, "b": 2}).result(90)


def test_an_mcp_server_that_never_answers_times_out(outbound):
    hanging = McpServer("hang", command=(*CALCULATOR, "--hang"))
    limits = OutboundLimits(mcp_servers=(hanging,), mcp_timeout_s=2.0)
    handle = outbound.for_instance("t", limits)
    with pytest.raises(OutboundRefused,
                       match=r"MCP server 'hang': no answer to tool 'add' within 2 s "
                             r"\(mcp_timeout_s\)"):
        handle.mcp_call("mcp.call", "hang", "add", {"a": 1, "b": 2}).result(30)


def test_a_server_that_cannot_start_is_an_err(outbound):
    limits = OutboundLimits(mcp_servers=(McpServer("gone", command=("/nonexistent/mcp",)),),
                            mcp_timeout_s=10.0)
    with pytest.raises(OutboundRefused, match="MCP server 'gone'"):
        outbound.for_instance("t", limits).mcp_tools("mcp.tools", "gone").result(30)


def test_pie_run_allows_what_its_options_name():
    from host.cli import _mcp_server, build_parser
    namespace = build_parser().parse_args([
        "run", "app.py", "--allow-host", "127.0.0.1:8080", "--allow-host", ".example.com",
        "--mcp", "calc=python calc.py --quiet", "--mcp", "web=https://mcp.example.com/mcp"])
    assert namespace.allow_host == ["127.0.0.1:8080", ".example.com"]
    servers = [_mcp_server(name, target) for name, target in namespace.mcp]
    assert servers == [McpServer("calc", command=("python", "calc.py", "--quiet")),
                       McpServer("web", url="https://mcp.example.com/mcp")]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "app.py", "--mcp", "calc"])
