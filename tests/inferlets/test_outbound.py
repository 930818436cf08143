"""Outgoing HTTP and MCP tools through the WIT and the SDK, on the real model and Wasmtime: the
ReAct example calling a real HTTP tool, the MCP calculator with its arguments constrained by the
tool's schema, and the hostile cases seen from a guest (a host outside the allowlist, a redirect
to a private address, a slow loris, a huge answer, too many requests in flight, an MCP server
that never answers), each an error naming its limit while another instance's request goes on.
Servers run on 127.0.0.1 only (tests/host/servers/)."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from host.runtime_config import InstanceLimits, McpServer, OutboundLimits
from tests.host.servers.tool_server import ToolServer, search_results

SERVERS = Path(__file__).resolve().parents[1] / "host" / "servers"
CALCULATOR = (sys.executable, str(SERVERS / "mcp_calculator.py"))


@pytest.fixture(scope="module")
def server():
    with ToolServer() as running:
        yield running


def _limits(server: ToolServer, **overrides) -> InstanceLimits:
    outbound = OutboundLimits(allow_hosts=(f"127.0.0.1:{server.port}",), **overrides)
    return InstanceLimits(outbound=outbound)


def test_react_calls_a_real_http_tool(run_inferlet, server):
    run = run_inferlet("react", ["--tool", "http", "--tool-url", server.url("/search"),
                                 "--num-calls", "4", "--calls-per-turn", "2", "--timings"],
                       limits=_limits(server))
    result = run.json()
    assert len(result["observations"]) == 4
    timings = result["timings"]                  # two tool turns and the answer
    assert len(timings) == 3 and timings[-1]["tool_s"] == 0.0
    assert all(t["generate_s"] > 0 for t in timings) and all(t["tool_s"] > 0 for t in timings[:2])
    for index, (turn, observation) in enumerate(zip(
            [t for t in result["turns"] for _ in range(2)], result["observations"])):
        expected = search_results(turn[:100])[0][:200]
        assert observation == f"Observation {index + 1}: {expected}"


def test_react_without_the_host_allowed_fails_naming_the_allowlist(run_inferlet, server):
    run = run_inferlet("react", ["--tool", "http", "--tool-url", server.url("/search"),
                                 "--num-calls", "1"])
    assert run.status == "error"
    assert f"127.0.0.1:{server.port} is not in allow_hosts (none allowed)" in run.value


def test_get_and_post_through_the_sdk(run_inferlet, server):
    got = run_inferlet("outbound_probe", ["get", server.url("/search?q=pie")],
                       limits=_limits(server)).json()
    assert got["status"] == 200 and got["type"] == "application/json"
    assert json.loads(got["text"])["results"] == search_results("pie")
    posted = run_inferlet("outbound_probe", ["post", server.url("/echo"), '{"x": 1}'],
                          limits=_limits(server)).json()
    assert json.loads(posted["json"]["body"]) == {"x": 1}
    assert posted["json"]["headers"]["content-type"] == "application/json"


@pytest.mark.parametrize("path,overrides,phrase", [
    ("/redirect?to=http://localhost:{port}/search", {"allow_hosts_extra": "localhost:{port}"},
     "a non-global address (loopback)"),
    ("/slow", {"timeout_s": 1.0}, "no complete answer within 1 s (timeout_s)"),
    ("/huge", {"max_response_bytes": 100_000}, "passed max_response_bytes 100000"),
])
def test_hostile_answers_are_errors_naming_the_limit(run_inferlet, server, path, overrides,
                                                     phrase):
    overrides = dict(overrides)
    extra = overrides.pop("allow_hosts_extra", None)
    limits = _limits(server, **overrides)
    if extra:
        limits = replace(limits, outbound=replace(limits.outbound, allow_hosts=(
            *limits.outbound.allow_hosts, extra.format(port=server.port))))
    run = run_inferlet("outbound_probe", ["get", server.url(path.format(port=server.port))],
                       limits=limits)
    assert phrase in run.json()["error"]


def test_requests_in_flight_past_the_limit_are_refused(run_inferlet, server):
    answers = run_inferlet("outbound_probe", ["many", server.url("/search?delay_ms=200"), "4"],
                           limits=_limits(server, max_concurrent=2)).json()
    assert [a.get("status") for a in answers[:2]] == [200, 200]
    for refused in answers[2:]:
        assert "its limit (max_concurrent 2)" in refused["error"]


def test_an_mcp_calculator_called_with_schema_constrained_arguments(run_inferlet):
    limits = InstanceLimits(outbound=OutboundLimits(
        mcp_servers=(McpServer("calc", command=CALCULATOR),), mcp_timeout_s=120.0))
    result = run_inferlet("mcp_calculator", ["--question", "What is 12 times 7?"],
                          limits=limits).json()
    assert {"add", "multiply", "evaluate"} <= set(result["tools"])
    arguments = result["arguments"]
    assert set(arguments) == {"a", "b"} and not result["is_error"]
    assert result["result"] == {"result": float(arguments["a"]) * float(arguments["b"])}


def test_an_mcp_server_that_never_answers_is_an_error_and_others_go_on(run_inferlet, runtime,
                                                                         program, server):
    hanging = InstanceLimits(outbound=OutboundLimits(
        mcp_servers=(McpServer("hang", command=(*CALCULATOR, "--hang")),), mcp_timeout_s=2.0))
    other = runtime.launch(program("outbound_probe"), ["get", server.url("/search?delay_ms=500")],
                           limits=_limits(server))
    run = run_inferlet("outbound_probe", ["call", "hang", "add", '{"a": 1, "b": 2}'],
                       limits=hanging)
    assert "no answer to tool 'add' within 2 s (mcp_timeout_s)" in run.json()["error"]
    outcome = runtime.wait(other, timeout=120)
    assert outcome.status == "ok" and json.loads(outcome.value)["status"] == 200
    unknown = run_inferlet("outbound_probe", ["call", "nope", "add", "{}"], limits=hanging)
    assert "no MCP server 'nope' (available: hang)" in unknown.json()["error"]
